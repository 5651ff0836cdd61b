"""The Llama-family decoder, its checkpoint loader and the bundled models."""

from llmopt.model.config import ModelConfig
from llmopt.model.llama import LlamaForCausalLM
from llmopt.model.loader import load_model
from llmopt.model.registry import list_models, model_path, resolve_model

__all__ = ["ModelConfig", "LlamaForCausalLM", "load_model", "list_models", "model_path", "resolve_model"]
