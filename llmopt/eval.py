"""Perplexity through the engine: how surprised the model is by text it never trained on.

    perplexity = exp( mean over tokens of  -log p(token | the tokens before it) )

It is measured through a running `LLM`'s own model, its own KV cache and its own step (the
compiled CPU step where the engine runs one), so whatever the engine does to the numbers
(quantized weights, an FP8 or int4 cache, a different dtype, its kernels) shows in the result.
The text is cut into windows of `seq_len` tokens; each window is fed in
chunks of `chunk_size` tokens, so the queries of later chunks read keys and values back
from the paged cache exactly as a long prompt's later chunks do in serving.

The bundled held-out text (Python files the tiny models never saw) is split once: the
first part calibrates quantizers (GPTQ, AWQ, FP8 scales), the rest evaluates them, so a
method is never scored on the text it was fitted to.
"""

from __future__ import annotations

import math
from numbers import Integral

import torch

from llmopt.model.dummy import refuse_text
from llmopt.model.registry import heldout_text

# The one protocol every compared perplexity follows: the committed SmolLM2 tables
# (benchmarks/precision.py, quant.py, fp8_eval.py) and the lessons that set them side by side.
# The first 12,288 tokens of the evaluation split, cut into windows of 512 tokens (each window
# fed whole: an FP8 cache is read back even then, see layers/paged_attention.py). A perplexity
# measured on other tokens or other windows has another fp32 baseline (the text's difficulty
# varies along it) and is not comparable with these.
PROTOCOL = {"max_tokens": 12_288, "seq_len": 512}


def follows_protocol(per_window: list[tuple[float, int]]) -> bool:
    """Whether `window_nll`'s output is PROTOCOL's: its windows of `seq_len` scoring its
    `max_tokens - 1` tokens (the first token has nothing before it)."""
    max_tokens, seq_len = PROTOCOL["max_tokens"], PROTOCOL["seq_len"]
    counts = [int(n) for _, n in per_window]
    return sum(counts) == max_tokens - 1 and len(counts) == -(-(max_tokens - 1) // seq_len)


def describe_protocol() -> str:
    """PROTOCOL in words, for a table's header or a lesson's printout."""
    return (f"perplexity protocol (llmopt.eval.PROTOCOL): the first {PROTOCOL['max_tokens']:,} tokens of the "
            f"held-out evaluation split, windows of {PROTOCOL['seq_len']}")


def perplexity(llm, text: str | None = None, max_tokens: int | None = None, seq_len: int = 512,
               chunk_size: int | None = None, batch_size: int = 8, token_ids: list[int] | None = None,
               use_tqdm: bool = False) -> float:
    """Perplexity of `llm` on `text` (default: the held-out evaluation split).

    max_tokens: evaluate only the first `max_tokens` tokens of the text (None: all of it).
    seq_len: tokens of context per window; windows do not overlap, so every token but the
        first is scored exactly once, with up to `seq_len - 1` tokens before it.
    chunk_size: tokens per forward within a window (None: the whole window at once); later
        chunks attend to the cached K/V of earlier ones.
    batch_size: windows run together in one step (a flat batch, as the engine runs requests).
    token_ids: evaluate these token ids instead of tokenizing `text`.
    """
    return perplexity_of(window_nll(llm, text, max_tokens, seq_len, chunk_size, batch_size, token_ids, use_tqdm))


def perplexity_of(per_window: list[tuple[float, int]]) -> float:
    """The perplexity of `window_nll`'s output: exp(summed NLL / tokens scored)."""
    return math.exp(sum(n for n, _ in per_window) / sum(c for _, c in per_window))


def window_nll(llm, text: str | None = None, max_tokens: int | None = None, seq_len: int = 512,
               chunk_size: int | None = None, batch_size: int = 8, token_ids: list[int] | None = None,
               use_tqdm: bool = False) -> list[tuple[float, int]]:
    """Per window of `seq_len` tokens: (summed negative log-likelihood, tokens scored), for
    comparisons that need more than the mean (a paired bootstrap over windows, say).
    Same arguments as `perplexity`.
    """
    engine = getattr(llm, "llm_engine", None)
    if engine is None or not hasattr(engine, "kv_cache"):
        raise TypeError(f"perplexity needs an llmopt LLM, got {type(llm).__name__}")
    if engine.config.load_format == "dummy":
        raise refuse_text("perplexity", str(engine.config.model))
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("max_tokens", max_tokens),
                        ("chunk_size", chunk_size)):
        if value is None and name in ("max_tokens", "chunk_size"):
            continue
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (a token and one to predict), got {seq_len}")
    if seq_len > engine.max_model_len:
        raise ValueError(f"seq_len={seq_len} exceeds the engine's max_model_len ({engine.max_model_len})")
    chunk_size = chunk_size or seq_len
    if token_ids is None:
        if text is None:
            text = heldout_text("eval")
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        # no BOS: windows start mid-file, as the bundled models were trained and scored
        token_ids = engine.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    elif text is not None:
        raise ValueError("give text or token_ids, not both")
    ids = [int(t) for t in token_ids][: max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    vocab = engine.model_config.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab})")
    need = engine.block_manager.blocks_needed(seq_len)
    if need > engine.num_blocks:
        raise ValueError(f"a window of {seq_len} tokens needs {need} KV blocks; the pool has "
                         f"{engine.num_blocks}: lower seq_len or raise num_kv_blocks")
    batch_size = max(1, min(batch_size, engine.block_manager.num_free_blocks // need))

    # windows overlap by one token: window w predicts ids[w*seq_len + 1 : (w+1)*seq_len + 1]
    windows = [ids[s:s + seq_len + 1] for s in range(0, len(ids) - 1, seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    out: list[tuple[float, int]] = []
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids) - 1, desc="perplexity", unit="tok", dynamic_ncols=True)
    for b in range(0, len(windows), batch_size):
        scored = _score_windows(engine, windows[b:b + batch_size], chunk_size)
        out += scored
        if bar is not None:
            bar.update(sum(n for _, n in scored))
    if bar is not None:
        bar.close()
    return out


@torch.inference_mode()
def _score_windows(engine, windows: list[list[int]], chunk_size: int, per_token: bool = False) -> list:
    """(summed NLL, count) of each window's tokens 1..end, run through the engine's model and cache;
    with per_token, each window's [tokens - 1, 2] float tensor instead: (log-probability of the
    token that follows, the best log-probability at that position)."""
    from llmopt.sampling_params import SamplingParams
    from llmopt.sequence import Sequence

    bm, runner = engine.block_manager, engine.runner
    step = runner.backend  # the engine's own forward and head: what it serves
    seqs = [Sequence(f"__perplexity_{i}", None, w[:-1], SamplingParams(max_tokens=1))
            for i, w in enumerate(windows)]
    targets = [torch.tensor(w[1:], device=engine.device) for w in windows]
    totals = [0.0] * len(windows)
    kept: list[list[torch.Tensor]] = [[] for _ in windows]
    try:
        for seq in seqs:
            if not bm.allocate(seq.request_id, len(seq)):
                raise ValueError("the KV block pool is too small for this perplexity batch; "
                                 "lower batch_size or seq_len")
        for start in range(0, max(len(s) for s in seqs), chunk_size):
            live = [i for i, s in enumerate(seqs) if len(s) > start]
            scheduled = [(seqs[i], min(chunk_size, len(seqs[i]) - start)) for i in live]
            input_ids, meta = runner.prepare(scheduled, bm.block_tables)
            logits = step.compute_logits(step.forward(input_ids, meta)).float()
            gold = torch.cat([targets[i][start:start + n] for i, (_, n) in zip(live, scheduled)])
            nll = torch.nn.functional.cross_entropy(logits, gold, reduction="none")
            if per_token:  # the best log-probability is the logit's max minus the same logsumexp
                best = logits.float().amax(-1) - logits.float().logsumexp(-1)
                for i, part in zip(live, torch.stack([-nll.float(), best], 1).split([n for _, n in scheduled])):
                    kept[i].append(part.cpu())
            for i, part in zip(live, nll.split([n for _, n in scheduled])):
                totals[i] += part.sum().item()
            for s, n in scheduled:
                s.num_computed_tokens += n
    finally:
        for seq in seqs:
            bm.free(seq.request_id)
    if per_token:
        return [torch.cat(k) for k in kept]
    return [(t, len(w) - 1) for t, w in zip(totals, windows)]


def forced_gaps(llm, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """`greedy_gaps` with an llmopt LLM as the reference, through its own model and KV cache: for
    every token of each output, the LLM's best log-probability at that position minus this
    token's, given the prompt and the output before it (teacher-forced). The judge of another
    engine's greedy tokens: on a GPU, the float32 engine that reproduced the CPU's tokens judges
    bf16's (benchmarks/gpu_check.py)."""
    engine = getattr(llm, "llm_engine", None)
    if engine is None or not hasattr(engine, "kv_cache"):
        raise TypeError(f"forced_gaps needs an llmopt LLM, got {type(llm).__name__}")
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    pairs = [(list(p), list(o)) for p, o in zip(prompts, outputs) if o]
    if any(not p for p, _ in pairs):
        raise ValueError("every prompt needs at least one token")
    gaps = []
    for b in range(0, len(pairs), 8):
        batch = pairs[b:b + 8]
        windows = [p + o for p, o in batch]
        longest = max(map(len, windows))
        if longest > engine.max_model_len:
            raise ValueError(f"a prompt and its output make {longest} tokens, over max_model_len ({engine.max_model_len})")
        for (p, _), scores in zip(batch, _score_windows(engine, windows, longest, per_token=True)):
            mine, best = scores[len(p) - 1:].unbind(1)
            gaps.append(best - mine)
    return torch.cat(gaps) if gaps else torch.zeros(0)


@torch.inference_mode()
def greedy_gaps(reference, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """For every greedily generated token: a reference model's best log-probability minus this
    token's, given the same prompt and generated prefix (teacher-forced, one forward of prompt +
    output each; `reference` is any causal LM whose call returns `.logits`, transformers' for one).

    Why not compare tokens: another summation order moves bf16 logits by a step or two, flips a
    near-tie, and everything after it differs; a correct engine's tokens are the reference's best
    or within a fraction of a nat of it, a wrong kernel's lie nats below."""
    dev = next(reference.parameters()).device
    gaps = []
    for prompt, out in zip(prompts, outputs):
        if not out:
            continue
        ids = torch.tensor([list(prompt) + list(out)], device=dev)
        n = len(prompt)
        logp = torch.log_softmax(reference(input_ids=ids).logits[0, n - 1: n - 1 + len(out)].float(), -1)
        gaps.append(logp.amax(-1) - logp[torch.arange(len(out), device=dev), torch.tensor(out, device=dev)])
    return torch.cat(gaps).cpu() if gaps else torch.zeros(0)
