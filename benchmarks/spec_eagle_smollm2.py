"""EAGLE on SmolLM2-135M-Instruct: chain drafts, EAGLE-2 trees and n-gram lookup against plain decoding.

One run per workload (`--workload chat` or `code`), every method beside plain decoding in the
same run: acceptance length (tokens per verification step), acceptance per draft position,
and the batch-1 and batch speedups (CPU time of this process, one thread,
`llmopt.bench.spec.bench_spec`). The prompts are not among the head's training prompts
(scripts/train_eagle_smollm2.py); greedy, float32.

    python benchmarks/spec_eagle_smollm2.py --workload chat    # 8 requests: batch 1, then batch 8
    python benchmarks/spec_eagle_smollm2.py --workload code    # then both are in the table

Writes benchmarks/results/spec_eagle_smollm2.md and .json (each workload kept, the table
rebuilt from all of them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from llmopt import LLM
from llmopt.bench import BenchRequest
from llmopt.bench.spec import bench_spec, spec_table

PROMPTS = {
    "chat": ["What makes a good breakfast?", "Explain how rainbows form.",
             "Give me three ideas for a rainy weekend.", "Why do cats purr?",
             "How can I become a better listener?", "Describe the life cycle of a butterfly.",
             "What should I pack for a week at the beach?", "Why is the sky dark at night?"],
    "code": ["Write a Python function that returns the second largest number in a list.",
             "Write a Python function that counts how often each character occurs in a string.",
             "Write a Python class for a simple bank account with deposit and withdraw methods.",
             "Write a Python function that checks whether two strings are anagrams.",
             "Write a Python function that returns all prime numbers below n.",
             "Write a Python function that capitalizes the first letter of every word.",
             "Write a Python function that converts a Roman numeral to an integer.",
             "Write a Python function that returns the longest common prefix of a list of strings."],
}
RESULTS = Path(__file__).resolve().parent / "results" / "spec_eagle_smollm2.md"


def requests(tokenizer, workload: str, max_tokens: int) -> list[BenchRequest]:
    out = []
    for text in PROMPTS[workload]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append(BenchRequest(list(ids), max_tokens))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=list(PROMPTS), required=True)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--requests", type=int, default=8, help="batch 1: one at a time; batch: all at once")
    ap.add_argument("--k", type=int, default=5, help="draft depth of every method (n-gram: tokens)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--total-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    methods = {"ngram": {"method": "ngram", "prompt_lookup_max": 4},
               "eagle": {"method": "eagle", "model": "smollm2-eagle"},
               "eagle_tree": {"method": "eagle", "model": "smollm2-eagle",
                              "tree": {"top_k": args.top_k, "total_tokens": args.total_tokens}}}
    made = []

    def make_llm(**kw):
        made.append(LLM("smollm2", enable_prefix_caching=False, **kw))
        return made[-1]

    probe = LLM("smollm2")
    reqs = requests(probe.tokenizer, args.workload, args.max_tokens)[:args.requests]
    del probe
    load = os.getloadavg()[0]
    result = bench_spec(make_llm, reqs, list(methods), [args.k], batch1=len(reqs), progress=False,
                        spec_methods=methods)
    # acceptance per draft position, over the whole run of each method (batch 1 and batch)
    for llm, key in zip(made[1:], [f"{m}:{args.k}" for m in methods]):
        m = llm.get_metrics()
        result["runs"][key]["accepted_per_position"] = [
            m[f"spec_decode_num_accepted_tokens_per_pos_{i}"] / max(1, m["spec_decode_num_drafts"])
            for i in range(args.k)]
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    result.update(command=shlex.join(["python", "benchmarks/spec_eagle_smollm2.py", *argv]),
                  load_average_1min=load, torch=torch.__version__, python=platform.python_version(),
                  cpu=next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "?"),
                  tree={"depth": args.k, "top_k": args.top_k, "total_tokens": args.total_tokens})
    store = args.out.with_suffix(".json")
    runs = json.loads(store.read_text()) if store.exists() else {}
    runs[args.workload] = result
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(runs, indent=1, default=str) + "\n")
    args.out.write_text(render(runs))
    print(args.out.read_text())
    return 0


def render(runs: dict) -> str:
    parts = ["# EAGLE on SmolLM2-135M-Instruct: chain, EAGLE-2 tree, n-gram", ""]
    for workload, r in runs.items():
        t = r["tree"]
        parts += [f"## {workload} prompts", "",
                  f"`{r['command']}`; {r['cpu']}, load average {r['load_average_1min']:.2f} at the start, "
                  f"torch {r['torch']}, one thread, float32, greedy. Tree: depth {t['depth']}, top_k "
                  f"{t['top_k']}, total_tokens {t['total_tokens']} (acceptance for a tree counts accepted / "
                  "drafted nodes, so it is low by design; c is the drafting time per depth level).", "",
                  spec_table(r).split("\n\nbest mean")[0].replace("held-out tokens", "tokens (chat template and question)"),
                  "", "Accepted tokens per draft step, by position (1 = first draft token):", "",
                  "| method | " + " | ".join(str(i + 1) for i in range(t["depth"])) + " |",
                  "|---|" + "---|" * t["depth"]]
        for key, run in r["runs"].items():
            if "accepted_per_position" in run:
                parts.append(f"| {key.split(':')[0]} | " + " | ".join(f"{a:.2f}" for a in run["accepted_per_position"])
                             + " |")
        parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
