"""llmopt: a readable LLM inference engine, and a course in making LLM serving fast.

    from llmopt import LLM, SamplingParams
    llm = LLM(model="tiny")
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0.0, max_tokens=64))
"""

from llmopt.llm import LLM
from llmopt.model.registry import list_models, model_path
from llmopt.outputs import CompletionOutput, RequestOutput
from llmopt.sampling_params import SamplingParams
from llmopt.structured.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "model_path", "list_models"]
