"""Speculative decoding on the real model (SmolLM2-135M-Instruct): which methods fit it, and what they buy.

SmolLM2 ships no draft model and no EAGLE head, so two methods fit it on a 2-core CPU:

- **n-gram lookup** (prompt lookup), which needs no model at all and pays where the answer
  repeats its prompt: here the chat task is "rewrite this given function", so most of the
  answer is code the prompt already holds;
- **a draft made of SmolLM2's own first layers** (its embedding, the first `--draft-layers`
  blocks, its final norm and tied lm_head): the only draft that shares its tokenizer and fits
  next to it, at no training cost. Before the run, a "logit lens" probe measures how often the
  first l blocks alone already pick the full model's greedy token, for every l: that agreement
  is the acceptance such a draft can reach, and l / 30 its cost c.

    python benchmarks/spec_smollm2.py                # the committed table (a few minutes)

Writes benchmarks/results/spec_smollm2.md and .json. Times are CPU seconds on one thread
(`llmopt.bench.spec.bench_spec`), so other jobs on a shared machine disturb them less.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from llmopt import LLM, model_path
from llmopt.bench import BenchRequest, table
from llmopt.bench.common import load_average, machine
from llmopt.bench.spec import bench_spec, predicted_speedup, spec_table

# functions from the Python standard library, given whole in the prompt (the eval split's kind of text)
TASKS = [
    ("Rename the variable `result` to `total` in this function and give back the whole function.", '''\
def sum_squares(values):
    """Return the sum of the squares of the numbers in values."""
    result = 0
    for value in values:
        if value is None:
            continue
        result += value * value
    return result


def mean_square(values):
    """Return the mean of the squares, or 0.0 for an empty list."""
    values = [v for v in values if v is not None]
    if not values:
        return 0.0
    return sum_squares(values) / len(values)
'''),
    ("Add a docstring to each method of this class and give back the whole class.", '''\
class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek at an empty stack")
        return self.items[-1]

    def __len__(self):
        return len(self.items)
'''),
    ("Add type hints to this function and give back the whole function.", '''\
def parse_pairs(text, sep="=", comment="#"):
    pairs = {}
    for line_number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith(comment):
            continue
        if sep not in line:
            raise ValueError(f"line {line_number}: no {sep!r} in {line!r}")
        key, value = line.split(sep, 1)
        pairs[key.strip()] = value.strip()
    return pairs
'''),
    ("Fix the bug in this function (it skips the last element) and give back the whole function.", '''\
def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    for i in range(window, len(values)):
        averages.append(total / window)
        total += values[i] - values[i - window]
    return averages
'''),
]


def chat_requests(tokenizer, max_tokens: int) -> list[BenchRequest]:
    reqs = []
    for instruction, code in TASKS:
        messages = [{"role": "user", "content": f"{instruction}\n\n```python\n{code}```"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        reqs.append(BenchRequest(list(ids), max_tokens))
    return reqs


@torch.no_grad()
def logit_lens(requests: list[BenchRequest], llm, depths: list[int] | None = None) -> dict[int, float]:
    """For every depth l: how often the first l blocks (then the final norm and lm_head) pick the
    token the full model picks, over the prompts' positions and the full model's greedy answers."""
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.worker.kv_cache import NoKVCache

    model = llm.llm_engine.model
    outs = llm.generate([r.prompt() for r in requests], [r.params() for r in requests], use_tqdm=False)
    agree: dict[int, list[int]] = {}
    for r, o in zip(requests, outs):
        ids = torch.tensor(r.prompt_token_ids + list(o.outputs[0].token_ids))
        cache, meta = NoKVCache(), AttentionMetadata.uncached([len(ids)])
        x = model.model.embed_tokens(ids)
        states = []
        for layer in model.model.layers:
            x = layer(meta, x, model.model.rotary_emb, cache)
            states.append(x)
        final = model.compute_logits(model.model.norm(states[-1])).argmax(-1)
        for depth, h in enumerate(states, start=1):
            if depths is not None and depth not in depths:
                continue
            picks = model.compute_logits(model.model.norm(h)).argmax(-1)
            a = agree.setdefault(depth, [0, 0])
            a[0] += int((picks == final).sum())
            a[1] += len(ids)
    return {d: s / n for d, (s, n) in agree.items()}


def write_truncated(source: Path, layers: int, out: Path) -> Path:
    """SmolLM2's first `layers` blocks as a Hugging Face folder (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file

    from llmopt.model.gguf import gguf_hf_config, is_gguf
    from llmopt.model.loader import load_model, load_tokenizer
    from llmopt.quant.checkpoint import checkpoint_shards

    model = load_model(source)
    raw = gguf_hf_config(source) if is_gguf(source) else json.loads((source / "config.json").read_text())
    raw["num_hidden_layers"] = layers
    tensors = {}
    for name, p in model.named_parameters():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        for ckpt, rows in checkpoint_shards(model, name):
            tensors[ckpt] = (p.data if rows is None else p.data[rows[0]:rows[1]]).contiguous().clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    load_tokenizer(source).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-layers", type=int, default=None,
                    help="blocks in the truncated draft (default: the depth the probe predicts fastest)")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--requests", type=int, default=len(TASKS), help="how many of the tasks to run")
    ap.add_argument("--depths", type=int, nargs="+", default=None,
                    help="depths the probe scores (default: every one; each costs an lm_head over every position)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "spec_smollm2.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load = load_average()  # warns above 1.5: then the times are not this machine's
    command = shlex.join(["python", "benchmarks/spec_smollm2.py", *argv])
    source = model_path("smollm2")
    probe = LLM("smollm2", enable_prefix_caching=False)
    requests = chat_requests(probe.tokenizer, args.max_tokens)[:args.requests]
    lens = logit_lens(requests, probe, args.depths)
    num_layers = probe.llm_engine.model_config.num_hidden_layers
    del probe
    # the speedup the formula predicts for a draft of depth l at k = 4 (c = l / L, verification = one step)
    predicted = {d: predicted_speedup(a, 4, d / num_layers) for d, a in lens.items() if d < num_layers}
    layers = args.draft_layers or max(predicted, key=predicted.get)
    with tempfile.TemporaryDirectory() as tmp:
        draft = write_truncated(source, layers, Path(tmp) / f"smollm2-first{layers}")
        methods = {"ngram": {"method": "ngram", "prompt_lookup_max": 4},
                   "draft_model": {"method": "draft_model", "model": str(draft)}}
        result = bench_spec(lambda **kw: LLM("smollm2", enable_prefix_caching=False, **kw), requests,
                            list(methods), args.k, batch1=len(requests), progress=False, spec_methods=methods)
    result.update(command=command, machine=machine(), load_average=load, logit_lens=lens, draft_layers=layers, predicted_by_depth=predicted)
    depths = sorted(lens)
    text = "\n".join([
        "# Speculative decoding on SmolLM2-135M-Instruct", "",
        f"`{command}`; torch {torch.__version__}, {machine()} ({os.cpu_count()} cores), 1-minute "
        f"load average {load:.2f} at the start (CPU times of this process). The task: chat requests that give a function and ask for it back "
        "edited (rename a variable, add docstrings, add type hints, fix a bug), so the answer repeats "
        "much of the prompt.", "",
        spec_table(result).replace("held-out tokens", "tokens (chat template, instruction and code)"), "",
        "## Which draft fits", "",
        "SmolLM2 has no smaller sibling sharing its tokenizer at hand and no trained EAGLE head, so the "
        f"draft is its own first {layers} of {num_layers} blocks with its final norm and lm_head (no "
        "training). How often such a truncated stack already picks the full model's greedy token, over "
        "the prompts and answers above (the acceptance a draft of that depth can reach), and the batch-1 "
        "speedup Leviathan et al.'s formula predicts from it at k = 4 with c = depth / 30 and a "
        "verification costing one decode step:", "",
        table(["blocks", "agrees with the full model", "predicted speedup (k = 4)"],
              [[d, f"{lens[d]:.1%}", f"{predicted[d]:.2f}x" if d in predicted else "-"] for d in depths]), "",
        f"The depth chosen ({layers}) is the one the formula favours. The low agreement is why the draft's "
        "acceptance is low: a model's early blocks build features for the later ones, and their hidden "
        "state read through the final norm and lm_head is a rough guess of the next token until most of "
        "the stack has run. A draft must be trained to predict the target (a distilled small model, or an "
        "EAGLE head reading the target's own last hidden state) to be both cheap and right; n-gram "
        "lookup is free and right whenever the answer copies the prompt.", ""])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
