"""Train the bundled EAGLE head for SmolLM2 (`smollm2-eagle`), offline, in resumable chunks.

The head must learn SmolLM2's habits on the text it will draft: SmolLM2's own answers. So
the data is made here, not downloaded: prompts built from shipped templates and topics
(chat and code), answered by SmolLM2 itself through the engine (greedy and sampled), then
the target's features over those conversations, then the same training as the bundled
tiny head (scripts/train_eagle_head.py: feature regression + KL to the target's next-token
distribution, a second pass on the head's own features), with one change: the head drafts
from the --draft-vocab tokens the conversations use most (EAGLE-3's reduced vocabulary,
shipped as draft_vocab.json), and the KL is taken over those, so that neither training nor
drafting pays for SmolLM2's whole 49,152-row lm_head.

Every stage writes to --work (default runs/eagle-smollm2) and picks up where it stopped,
so each run stays under --max-seconds (the machine is shared):

    python scripts/train_eagle_smollm2.py data     --max-seconds 540   # repeat until done
    python scripts/train_eagle_smollm2.py features
    python scripts/train_eagle_smollm2.py train    --max-seconds 540   # repeat until done
    python scripts/train_eagle_smollm2.py save     # -> llmopt/bundled/smollm2-eagle (fp16)

(the bundled head: data until done, features, then `train --threads 2 --steps 1000 --batch 8
--max-seconds 2400 --until-step 781` and the same without --until-step, then `save --threads 2
--batch 8 --steps 1000`. A chunk reseeds the batch sampler with seed + its first step, so the
same chunk boundaries give the same head.)
    python scripts/train_eagle_smollm2.py report   # after benchmarks/spec_eagle_smollm2.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_eagle_head import agreement, save_head, target_features, train_step  # noqa: E402

from llmopt.model.loader import load_model  # noqa: E402
from llmopt.model.registry import model_path  # noqa: E402
from llmopt.spec.eagle import EagleHead, head_config  # noqa: E402

# Prompts like the ones a chat model meets, none of them the benchmark's held-out ones
# (benchmarks/spec_eagle_smollm2.py): topics x request templates, coding tasks x code templates.
TOPICS = ["photosynthesis", "the water cycle", "black holes", "the French revolution", "vaccines",
          "climate change", "the stock market", "machine learning", "the human heart", "volcanoes",
          "healthy sleep", "learning a new language", "saving money", "public speaking", "gardening",
          "the internet", "electric cars", "the moon landing", "honey bees", "recycling",
          "time management", "the Roman empire", "renewable energy", "friendship", "coffee",
          "exercise", "the solar system", "inflation", "democracy", "chess",
          "earthquakes", "the immune system", "ancient Egypt", "the printing press", "tides",
          "dinosaurs", "the human brain", "meditation", "cooking pasta", "bicycles", "rain forests",
          "the Olympic games", "nuclear energy", "dogs as pets", "writing a resume", "job interviews",
          "the theory of evolution", "DNA", "the periodic table", "gravity", "the speed of light",
          "World War II", "the Renaissance", "jazz music", "photography", "social media",
          "online privacy", "cloud computing", "smartphones", "artificial intelligence", "robots",
          "the ocean", "coral reefs", "deserts", "mountains", "glaciers", "the Amazon river",
          "volunteering", "teamwork", "leadership", "budgeting", "credit cards", "taxes",
          "drinking enough water", "vitamins", "running a marathon", "yoga", "stress",
          "reading books", "studying for exams", "online learning", "the history of writing",
          "the wheel", "electricity", "magnets", "the seasons", "weather forecasts", "bread baking",
          "tea", "chocolate", "spices", "wind power", "solar panels", "bridges", "skyscrapers"]
CHAT = ["Explain {t} in simple terms.", "What are three interesting facts about {t}?",
        "Write a short paragraph about {t}.", "Why is {t} important?",
        "Give me some tips related to {t}.", "Summarize what people should know about {t}.",
        "Write a short poem about {t}.", "What is the history of {t}?",
        "What are the pros and cons of {t}?", "How would you explain {t} to a child?",
        "List five key points about {t}.", "What are common misconceptions about {t}?"]
TASKS = ["reverses a string", "checks whether a number is prime", "computes the factorial of n",
         "returns the n-th Fibonacci number", "sorts a list with bubble sort", "counts the words in a text",
         "finds the largest element of a list", "removes duplicates from a list", "checks if a string is a palindrome",
         "merges two sorted lists", "computes the average of a list of numbers", "converts Celsius to Fahrenheit",
         "reads a file and prints each line", "flattens a nested list", "implements binary search",
         "counts vowels in a string", "returns the greatest common divisor of two numbers",
         "transposes a matrix", "validates an email address with a regular expression", "parses a CSV line",
         "sums the digits of a number", "finds the minimum of a list", "converts a decimal number to binary",
         "checks whether a year is a leap year", "returns the length of the longest word in a sentence",
         "rotates a list by k positions", "multiplies two matrices", "computes the median of a list",
         "splits a list into chunks of size n", "returns the intersection of two lists",
         "implements a stack with push and pop", "implements a queue", "computes the power of a number",
         "sorts a dictionary by its values", "generates a random password", "finds the mode of a list",
         "checks whether a list is sorted", "returns the squares of the even numbers in a list",
         "computes compound interest", "converts a string to title case", "computes the area of a circle",
         "reverses the words in a sentence", "implements insertion sort", "implements merge sort",
         "finds the index of an element in a list", "computes the dot product of two vectors",
         "counts the lines in a file", "returns the unique words in a text", "computes the sum of a list recursively",
         "checks whether a string contains only digits"]
CODE = ["Write a Python function that {t}.", "Write a Python function that {t}, with a docstring.",
        "How do I write code that {t} in Python?", "Write a JavaScript function that {t}.",
        "Write a Python function that {t} and explain how it works.", "Write a short Python program that {t}."]


def make_prompts(seed: int) -> list[str]:
    prompts = [c.format(t=t) for t in TOPICS for c in CHAT] + [c.format(t=t) for t in TASKS for c in CODE]
    random.Random(seed).shuffle(prompts)
    return prompts


def stage_data(args) -> None:
    """SmolLM2 answers each prompt twice (greedy, and sampled at T = 0.7). Requests stream
    through the engine, --gen-batch at a time, and each answer is saved as it finishes, so a
    chunk cut short by --max-seconds loses only the answers still running."""
    from llmopt import LLM, SamplingParams

    out = args.work / "conversations.jsonl"
    done = {json.loads(line)["key"] for line in out.open()} if out.exists() else set()
    todo = [(f"{mode}:{p}", p, mode) for p in make_prompts(args.seed) for mode in ("greedy", "sampled")]
    todo = [x for x in todo if x[0] not in done]
    print(f"{len(done)} conversations on disk, {len(todo)} to go", flush=True)
    if not todo:
        return
    llm = LLM(model="smollm2", max_num_seqs=args.gen_batch)
    engine, t0, running, n = llm.llm_engine, time.time(), 0, len(done)
    with out.open("a") as f:
        while todo or running:
            while todo and running < args.gen_batch and time.time() - t0 < args.max_seconds:
                key, prompt, mode = todo.pop(0)
                ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
                engine.add_request(key, {"prompt_token_ids": ids}, SamplingParams(
                    temperature=0.0 if mode == "greedy" else 0.7, max_tokens=args.max_answer, seed=args.seed + n + running))
                running += 1
            if time.time() - t0 > args.max_seconds + 60:  # the chunk's time is up: drop what still runs
                break
            for o in engine.step():
                if o.finished:
                    running -= 1
                    n += 1
                    f.write(json.dumps({"key": o.request_id, "token_ids": list(o.prompt_token_ids)
                                        + list(o.outputs[0].token_ids)}) + "\n")
                    f.flush()
                    if n % 8 == 0:
                        print(f"{n} conversations ({time.time() - t0:.0f} s)", flush=True)
            if not todo and time.time() - t0 > args.max_seconds and not running:
                break


def split(args):
    """Conversations -> token streams: 5% of them held out; the rest, then --corpus-tokens of
    Python's standard library (local text, as the tiny models' corpus), for training. Fixed text
    is how EAGLE itself was trained (ShareGPT, not the target's answers): the head learns the
    target's features and next-token distribution on whatever text it reads; SmolLM2's own
    answers add the text it will actually draft."""
    from train_eagle_head import token_stream
    from train_tiny_models import corpus_files

    from llmopt.model.loader import load_tokenizer

    rows = [json.loads(line)["token_ids"] for line in (args.work / "conversations.jsonl").open()]
    random.Random(args.seed).shuffle(rows)
    cut = max(1, len(rows) // 20)
    train = [t for r in rows[cut:] for t in r]
    corpus = token_stream(load_tokenizer(model_path("smollm2")), corpus_files()[0], args.corpus_tokens, args.seed)
    return torch.cat([torch.tensor(train), corpus]), torch.tensor([t for r in rows[:cut] for t in r])


def stage_features(args) -> None:
    """The target's features over the data, in pieces of 32 windows saved as they are done
    (resumable); the last piece assembles features.pt with the draft vocabulary."""
    target = load_model(model_path("smollm2"), torch.float32)
    train, held = split(args)
    parts = args.work / "feature_parts"
    parts.mkdir(exist_ok=True)
    windows = train[: len(train) // args.seq_len * args.seq_len]
    piece = 32 * args.seq_len
    t0 = time.time()
    for i, start in enumerate(range(0, len(windows), piece)):
        path = parts / f"{i:04d}.pt"
        if path.exists():
            continue
        if time.time() - t0 > args.max_seconds:
            if not args.assemble:
                print(f"stopped at piece {i}; run the stage again (or --assemble: train on what is done)", flush=True)
                return
            break
        # float32: this CPU has no bfloat16 matmul units, so autocast would only add conversions
        torch.save(target_features(target, windows[start:start + piece], args.seq_len, batch=4, bf16=False), path)
        print(f"piece {i} ({time.time() - t0:.0f} s)", flush=True)
    pieces = [torch.load(p) for p in sorted(parts.glob("*.pt"))]
    seqs, feats = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
    held_seqs, held_feats = target_features(target, held, args.seq_len, batch=4, bf16=False)
    # the draft vocabulary (llmopt/spec/eagle.py): the tokens SmolLM2's conversations use most
    counts = torch.bincount(torch.cat([train, held]), minlength=target.config.vocab_size)
    vocab = counts.argsort(descending=True)[:args.draft_vocab]
    vocab = vocab[counts[vocab] > 0].sort().values
    torch.save({"seqs": seqs, "feats": feats, "held_seqs": held_seqs, "held_feats": held_feats,
                "vocab": vocab, "vocab_share": float(counts[vocab].sum() / counts.sum())},
               args.work / "features.pt")
    print(f"features: {tuple(feats.shape)} train, {tuple(held_feats.shape)} held out ({time.time() - t0:.0f} s)")


def stage_train(args) -> None:
    target = load_model(model_path("smollm2"), torch.float32)
    target.requires_grad_(False)
    data = torch.load(args.work / "features.pt")
    seqs, feats = data["seqs"], data["feats"]
    weight = target.lm_head.weight[data["vocab"]].contiguous()  # the draft vocabulary's rows

    def logits(h):
        return torch.nn.functional.linear(h, weight).float()

    head = EagleHead(target.config)
    # Start from SmolLM2's own last layer and final norm, and an fc that adds the token's
    # embedding to the previous feature: a head that already speaks the target's feature space,
    # which matters when the CPU budget allows only a few hundred steps.
    head.layers[0].load_state_dict(target.model.layers[-1].state_dict())
    head.norm.load_state_dict(target.model.norm.state_dict())
    with torch.no_grad():
        eye = torch.eye(target.config.hidden_size)
        head.fc.weight.copy_(torch.cat([eye, eye], dim=1))
        head.fc.bias.zero_()
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = args.work / "checkpoint.pt"
    state = {"step": 0, "curve": [], "seconds": 0.0}
    if ckpt.exists():
        saved = torch.load(ckpt)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
    gen = torch.Generator().manual_seed(args.seed + state["step"])
    state.setdefault("load_before_chunks", []).append(os.getloadavg()[0])  # for the report's header
    t0 = time.time()
    last = args.steps if args.until_step is None else min(args.steps, args.until_step)
    while state["step"] < last and time.time() - t0 < args.max_seconds:
        step = state["step"]
        loss = train_step(head, target, opt, seqs, feats, step, args, gen, logits, bf16=False)
        state["step"] += 1
        state["curve"].append([step, round(loss.item(), 4)])
        if step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.time() - t0:.0f} s)", flush=True)
    state["seconds"] += time.time() - t0
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
    print(f"checkpoint at step {state['step']} of {args.steps}")


def stage_save(args) -> None:
    target = load_model(model_path("smollm2"), torch.float32)
    data = torch.load(args.work / "features.pt")
    saved = torch.load(args.work / "checkpoint.pt")
    head = EagleHead(target.config)
    head.load_state_dict(saved["head"])
    head.eval()
    state = saved["state"]
    conversations = sum(1 for _ in (args.work / "conversations.jsonl").open())
    report = {"target": "smollm2", "conversations": conversations, "train_tokens": int(data["seqs"].numel()),
              "steps": state["step"], "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr,
              "seed": args.seed, "threads": args.threads, "parameters": sum(p.numel() for p in head.parameters()),
              "heldout_top1_agreement": {f"depth_{d}": agreement(head, target, data["held_seqs"],
                                                                 data["held_feats"], d) for d in (1, 2, 3)},
              "train_seconds": round(state["seconds"]), "load_before_chunks": state.get("load_before_chunks", []),
              "loss_curve": state["curve"]}
    save_head(head, head_config(target.config), args.out, {k: v for k, v in report.items() if k != "loss_curve"},
              dtype=torch.float16)
    (args.out / "draft_vocab.json").write_text(json.dumps(data["vocab"].tolist()) + "\n")
    report["draft_vocab"] = {"tokens": len(data["vocab"]), "share_of_tokens": data["vocab_share"]}
    (args.work / "report.json").write_text(json.dumps(report) + "\n")
    (args.out / "training_report.json").write_text(json.dumps(
        {k: v for k, v in report.items() if k != "loss_curve"}, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "loss_curve"}, indent=2))


def cpu_model() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if "Model name" in line), "a CPU")
    return f"{name} ({os.cpu_count()} cores)"


def chunk_loads(report: dict) -> str:
    loads = report.get("load_before_chunks", [])
    if not loads:
        return "load average not recorded"
    return ("1-minute load average before each training chunk: " + ", ".join(
        "not recorded" if x is None else f"{x:.2f}" for x in loads)
        + (": a chunk started as the one before it ended counts that chunk's own threads" if len(loads) > 1 else ""))


def stage_report(args) -> None:
    """benchmarks/results/eagle_smollm2.md + .json: the training run, its loss curve, and the
    acceptance per draft position measured by benchmarks/spec_eagle_smollm2.py."""
    results = ROOT / "benchmarks" / "results"
    report = json.loads((args.work / "report.json").read_text())
    bench_file = results / "spec_eagle_smollm2.json"
    bench = json.loads(bench_file.read_text()) if bench_file.exists() else {}
    acceptance = {w: {k.split(":")[0]: r["runs"][k]["accepted_per_position"] for k in r["runs"]
                      if "accepted_per_position" in r["runs"][k] and k.startswith("eagle")} for w, r in bench.items()}
    curve = report["loss_curve"]
    every = max(1, len(curve) // 15)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    lines = ["# The EAGLE head for SmolLM2 (`smollm2-eagle`)", "",
             f"Trained by `scripts/train_eagle_smollm2.py` on {report['conversations']} conversations SmolLM2 "
             f"wrote itself plus {args.corpus_tokens:,} tokens of standard-library text ({report['train_tokens']} training tokens in all), {report['steps']} steps of batch "
             f"{report['batch']} x {report['seq_len']} tokens, {report['train_seconds']} s of training with "
             f"{report.get('threads', args.threads)} threads on {cpu_model()}, nothing else running ("
             f"{chunk_loads(report)}; run in chunks of at most --max-seconds, each resuming the optimizer and "
             "the learning-rate schedule). "
             f"{report['parameters']:,} parameters; shipped in float16, "
             f"{size / 1e6:.1f} MB on disk (llmopt/bundled/smollm2-eagle). Draft vocabulary: "
             f"{report['draft_vocab']['tokens']} tokens, {report['draft_vocab']['share_of_tokens']:.1%} of the "
             "tokens in the data.", "",
             "Held-out top-1 agreement with SmolLM2 (the head's input feature its own prediction d - 1 "
             "times over): " + ", ".join(f"depth {k.split('_')[1]}: {v:.1%}"
                                         for k, v in report["heldout_top1_agreement"].items()) + ". The held-out windows "
             "are whole conversations, chat template included (system prompt, role markers), which the "
             "head predicts easily; on answer tokens alone it agrees less often: the acceptance at "
             "position 1 below is that figure, measured.", "",
             "## Training curve", "", "| step | loss |", "|---|---|"]
    rows = curve[::every] + ([] if curve[::every][-1] == curve[-1] else [curve[-1]])
    lines += [f"| {s} | {loss:.3f} |" for s, loss in rows]
    if acceptance:
        lines += ["", "## Acceptance per draft position", "",
                  "Accepted tokens per draft step at each position (benchmarks/spec_eagle_smollm2.py, greedy):", ""]
        for workload, methods in acceptance.items():
            for method, per in methods.items():
                lines.append(f"- {workload}, {method}: " + ", ".join(f"{a:.2f}" for a in per))
    (results / "eagle_smollm2.md").write_text("\n".join(lines) + "\n")
    (results / "eagle_smollm2.json").write_text(json.dumps({**report, "acceptance_per_position": acceptance,
                                                            "bytes_on_disk": size}, indent=1) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["data", "features", "train", "save", "report"])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "eagle-smollm2")
    ap.add_argument("--out", type=Path, default=ROOT / "llmopt" / "bundled" / "smollm2-eagle")
    ap.add_argument("--max-seconds", type=float, default=540, help="stop the stage's loop after this long")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--max-answer", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--until-step", type=int, default=None, help="train: end this chunk at this step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head drafts from")
    ap.add_argument("--corpus-tokens", type=int, default=8_000, help="standard-library tokens added to the data")
    ap.add_argument("--assemble", action="store_true", help="features: stop at --max-seconds and keep what is done")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="one: a second thread mostly waits on a shared CPU")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    {"data": stage_data, "features": stage_features, "train": stage_train, "save": stage_save,
     "report": stage_report}[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
