"""The offline entry point: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Mirrors vLLM's `LLM` so what a learner writes here runs there with the import changed.
`generate` checks every prompt and parameter first, then hands all requests to the
engine at once and steps it until they are done: the scheduler batches them
continuously, so the order they finish in is the engine's business, the order they are
returned in is the caller's. A call that does not return (an error, Ctrl-C in a notebook)
takes its requests out of the engine again, so the next call starts clean.
"""

from __future__ import annotations

import os
from numbers import Integral

from llmopt.config import EngineConfig
from llmopt.engine.llm_engine import LLMEngine
from llmopt.outputs import RequestOutput
from llmopt.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | os.PathLike = "tiny", **kwargs):
        self.config = EngineConfig(model=model, **kwargs)  # TypeError on unknown arguments
        self.llm_engine = LLMEngine(self.config)
        self._counter = 0

    # the pieces lessons and tests reach for
    @property
    def model(self):
        return self.llm_engine.model

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    @property
    def eos_token_ids(self) -> set[int]:
        return self.llm_engine.eos_token_ids

    @property
    def device(self):
        return self.llm_engine.device

    @property
    def dtype(self):
        return self.llm_engine.dtype

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in the prompts' order.

        Bad arguments raise ValueError / TypeError before anything runs. If a request fails
        inside the engine (a step raised for it: finish_reason "error"), this raises
        RuntimeError chained to the cause. Whenever generate raises or is interrupted, the
        requests it added are aborted first: the engine holds nothing of this call afterwards.
        """
        engine = self.llm_engine
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a {'prompt_token_ids': [...]} dict, or a "
                             f"non-empty list of those; got {type(prompts).__name__}")
        n = len(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * n
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        elif isinstance(sampling_params, (list, tuple)) and len(sampling_params) == n and all(
                isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
        else:
            raise ValueError("sampling_params must be a SamplingParams or a list of exactly one per "
                             f"prompt ({n})")
        if priority is not None:
            if not isinstance(priority, (list, tuple)) or len(priority) != n or not all(
                    isinstance(p, Integral) and not isinstance(p, bool) for p in priority):
                raise ValueError(f"priority must be a list of {n} integers (one per prompt)")
            if self.config.scheduling_policy != "priority":
                raise ValueError(f"priority was given but scheduling_policy is {self.config.scheduling_policy!r}; "
                                 "create the LLM with scheduling_policy='priority'")
        # Check everything before anything is admitted: a bad prompt rejects the whole call.
        checked = [engine.process_inputs(prompt, sp, i) for i, (prompt, sp) in enumerate(zip(prompts, params))]
        for i, request in enumerate(checked):  # a constraint that does not compile: before any work
            engine.structured.compile(request.params, f"request {i}: structured_outputs")
        ids_in_order = []
        try:
            for i, request in enumerate(checked):
                rid = f"gen-{self._counter}"
                self._counter += 1
                ids_in_order.append(rid)
                engine.add_request(rid, request, priority=priority[i] if priority else 0)
            return self._run(ids_in_order, use_tqdm)
        except BaseException:  # KeyboardInterrupt too: a stale request would run in every later call
            engine.abort_request(ids_in_order)  # those already finished are gone: nothing to do
            raise

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None
             ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of {"role", "content"}
        dicts) or to each of a list of conversations, as vLLM's `LLM.chat` does: each is
        rendered by the model's chat template (or `chat_template`), then generated like any
        prompt, all of them batched together."""
        from llmopt.chat import check_messages, render_chat
        from llmopt.engine.request_checks import check_text
        from llmopt.model.dummy import refuse_text

        if self.config.load_format == "dummy":
            raise refuse_text("chat", str(self.config.model))
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation (a non-empty list of {'role', 'content'} "
                             "dicts) or a non-empty list of conversations")
        batched = isinstance(messages[0], (list, tuple))
        conversations = list(messages) if batched else [messages]
        prompts = []
        for i, conversation in enumerate(conversations):
            checked = check_messages(conversation, f"messages[{i}]" if batched else "messages", check_text)
            text, ids = render_chat(self.tokenizer, checked, add_generation_prompt, continue_final_message,
                                    chat_template, chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine, wanted = self.llm_engine, set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while len(done) < len(wanted) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        if out.outputs[0].finish_reason == "error":
                            raise RuntimeError(
                                f"prompt {request_ids.index(out.request_id)} failed in the engine "
                                f"({type(out.error).__name__}: {out.error}); the other requests of this "
                                "call were aborted, the engine is ready for the next one") from out.error
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in request_ids]

    def get_metrics(self) -> dict[str, float]:
        return self.llm_engine.get_metrics()

    def close(self) -> None:
        """Stop the worker processes of tensor/pipeline parallelism (also done when the LLM is
        garbage-collected or Python exits); a one-process LLM has nothing to stop."""
        self.llm_engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
