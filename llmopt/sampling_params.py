"""How to pick each next token, per request: vLLM's `SamplingParams`, validated up front.

The bounds are the ones the sampler is built for (llmopt/layers/sampler.py): every value
accepted here samples without error, so no request can make an engine step fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral, Real

from llmopt.structured.params import StructuredOutputsParams

# Below this a temperature is greedy, as in vLLM (its _SAMPLING_EPS): such a distribution is
# its argmax already, and float32 turns temperatures under ~1e-45 into a division by zero.
GREEDY_TEMPERATURE = 1e-5
# Far inside float32, the sampler's dtype. At 1e4 every token within 10 logits of the best is
# drawn within 0.1% as often as it: a larger value is a mistake rather than a choice.
MAX_TEMPERATURE = 1e4
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the top-n list costs a sort per token
SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed takes


@dataclass
class SamplingParams:
    """`temperature=0` is greedy (so is anything below 1e-5, as in vLLM). `top_k` of -1 (or 0)
    and `top_p=1` switch those filters off.

    `structured_outputs`: a StructuredOutputsParams; the output then follows its JSON schema,
    regex, choice list or grammar (llmopt/structured/).

    `min_tokens`: until that many tokens are generated, the request's stop tokens (EOS unless
    `ignore_eos`, and `stop_token_ids`) cannot be drawn, and stop strings are not checked.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice, grammar
    # vLLM's: what an engine's plugins read; here {"kv_transfer_params": {...}} for disaggregated
    # prefill and decode (llmopt/engine/kv_transfer.py)
    extra_args: dict | None = None
    # derived once the fields are checked, so that each step reads plain attributes: `stop` as a
    # list, and whether the request is greedy
    stop_strings: list[str] = field(init=False, default_factory=list, repr=False, compare=False)
    greedy: bool = field(init=False, default=False, repr=False, compare=False)

    def __post_init__(self):
        # Each number is checked and stored as a plain float / int: a Fraction (a Real) passed the
        # checks and then failed the engine step that builds the sampler's tensors.
        self.n = _int("n", self.n, lo=1)
        if self.n != 1:
            raise ValueError(f"n={self.n}: llmopt returns one completion per request (n=1); "
                             "submit the prompt several times with different seeds instead")
        self.temperature = _real("temperature", self.temperature, lo=0.0)
        if self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        self.min_p = _real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
                raise ValueError(f"seed must be in [-2**63, 2**64) (what torch.Generator takes), got {self.seed}")
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, lo=1)
        self.min_tokens = _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, lo=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        stop = [self.stop] if isinstance(self.stop, str) else _list("stop", self.stop, "strings")
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = stop
        ids = _list("stop_token_ids", self.stop_token_ids, "token ids")
        if not all(isinstance(t, Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in ids]
        if self.extra_args is not None and not (isinstance(self.extra_args, dict) and all(
                isinstance(v, dict) for k, v in self.extra_args.items() if k == "kv_transfer_params")):
            raise TypeError(f"extra_args must be a dict (kv_transfer_params: a dict), got {self.extra_args!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError("structured_outputs must be a StructuredOutputsParams (json=, regex=, choice=, "
                            f"grammar= or json_object=True), got {type(self.structured_outputs).__name__}")
        self.greedy = self.temperature < GREEDY_TEMPERATURE


def _list(name, value, what) -> list:
    """None -> [], a list or tuple -> a list; anything else a TypeError naming the field (not
    Python's "'int' object is not iterable")."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {what}, got {value!r}")
    return list(value)


def _int(name, value, lo=None) -> int:
    """`value` as a plain int (numpy's integers too), or a TypeError / ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _real(name, value, lo=None) -> float:
    """`value` as a plain float (a Fraction or numpy float too), or an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int or Fraction past float's range
        raise ValueError(f"{name} must be finite, got a number too large for a float") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value
