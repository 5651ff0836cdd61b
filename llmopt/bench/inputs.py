"""What the benchmarks run: real code from the held-out text, cut into requests of chosen lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

from llmopt.model.registry import heldout_text as _heldout
from llmopt.sampling_params import SamplingParams


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int

    def params(self) -> SamplingParams:
        # greedy, and every request generates exactly what it asked for
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)

    def prompt(self) -> dict:
        return {"prompt_token_ids": self.prompt_token_ids}


# -- inputs -------------------------------------------------------------------------------------
def heldout_text() -> str:
    """The whole bundled held-out text (both splits): what workloads draw prompts from."""
    return _heldout("all")


def heldout_tokens(tokenizer) -> list[int]:
    return tokenizer(heldout_text(), verbose=False)["input_ids"]


def cut(stream: list[int], n: int, rng: random.Random) -> list[int]:
    """n consecutive tokens from a random offset of the stream."""
    start = rng.randrange(0, len(stream) - n)
    return stream[start:start + n]


def make_requests(stream, num_requests, prompt_len, output_len, seed=0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(cut(stream, rng.randint(*prompt_len), rng), rng.randint(*output_len))
            for _ in range(num_requests)]
