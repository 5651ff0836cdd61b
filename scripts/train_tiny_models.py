"""Train the two bundled models, `tiny` (target) and `tiny-draft`, from scratch.

The corpus is the Python standard library's own source, which every machine with
Python has offline, so the models are small code models. A byte-level BPE tokenizer
is trained first; then the target (Llama architecture with GQA) learns next-token
prediction, and the draft learns to imitate the target (distillation on the target's
soft labels), which is what a speculative-decoding draft is for: agreeing with its
target. Everything is seeded; on 2 CPU cores it takes well under an hour.

    python scripts/train_tiny_models.py            # writes llmopt/bundled/{tiny,tiny-draft}
    python scripts/train_tiny_models.py --quick    # a smoke run into /tmp, minutes
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "llmopt" / "bundled"

SPECIAL_TOKENS = ["<|endoftext|>", "<|bos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
# A plain-text chat format for the server lesson; the markers are single tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TARGET = dict(hidden_size=384, intermediate_size=640, num_hidden_layers=6,
              num_attention_heads=6, num_key_value_heads=2, head_dim=64)
DRAFT = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=3, num_key_value_heads=1, head_dim=64)


# ----------------------------------------------------------------------------- corpus
def corpus_files() -> tuple[list[Path], list[Path]]:
    """Standard-library sources, split by a hash of the path into train and held out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo",
            "encodings", "pydoc_data", "ensurepip"}
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not skip.intersection(p.relative_to(stdlib).parts))
    train, held = [], []
    for p in files:
        rel = p.relative_to(stdlib).as_posix()
        (held if zlib.crc32(rel.encode()) % 10 == 0 else train).append(p)
    return train, held


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


# -------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<|bos|>")
    # Llama-style: the tokenizer prepends BOS, so every prompt starts like training text.
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|endoftext|>",
        pad_token="<|pad|>", unk_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE, model_max_length=2048, clean_up_tokenization_spaces=False)


def encode_docs(tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t)["input_ids"] + [eos]
    return torch.tensor(ids, dtype=torch.int64)


# ----------------------------------------------------------------------------- models
def make_model(tokenizer, shape: dict, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, initializer_range=0.02, **shape)
    return LlamaForCausalLM(cfg)


def batches(stream: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(model, stream, steps, seq_len, batch, lr, seed, teacher=None, name="model"):
    """AdamW with warmup + cosine; bf16 autocast (fast on CPUs with AMX), fp32 master weights.

    With a teacher, the loss is the KL divergence to the teacher's next-token
    distribution (plus a little hard-label CE), so the student learns to agree with it.
    """
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    t0 = time.time()
    it = batches(stream, seq_len, batch, gen)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        xy = next(it)
        x, y = xy[:, :-1], xy[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits.float()
            if teacher is None:
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            else:
                with torch.no_grad():
                    t_logp = F.log_softmax(teacher(input_ids=x).logits.float(), -1)
                logp = F.log_softmax(logits, -1)
                kl = F.kl_div(logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True,
                              reduction="batchmean")
                loss = kl + 0.1 * F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            el = time.time() - t0
            tok_s = (step + 1) * batch * seq_len / el
            print(f"[{name}] step {step:5d}/{steps} loss {loss.item():.3f} "
                  f"{tok_s:,.0f} tok/s {el / 60:.1f} min", flush=True)
    model.eval()
    return model


# ------------------------------------------------------------------------- evaluation
@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int = 512) -> float:
    nll, n = 0.0, 0
    for s in range(0, len(stream) - 1, seq_len):
        chunk = stream[s:s + seq_len + 1]
        if len(chunk) < 2:
            break
        logits = model(input_ids=chunk[None, :-1]).logits.float()
        nll += F.cross_entropy(logits[0], chunk[1:], reduction="sum").item()
        n += len(chunk) - 1
    return math.exp(nll / n)


@torch.no_grad()
def agreement(draft, target, stream: torch.Tensor, seq_len: int = 512) -> float:
    """Share of held-out positions where the draft's argmax equals the target's."""
    same, n = 0, 0
    for s in range(0, len(stream) - 1, seq_len):
        x = stream[s:s + seq_len][None]
        a = draft(input_ids=x).logits.argmax(-1)
        b = target(input_ids=x).logits.argmax(-1)
        same += (a == b).sum().item()
        n += a.numel()
    return same / n


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, n: int = 48) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def round_to_bf16(model):
    """Store in bfloat16; bf16 values upcast to float32 exactly, so fp32 runs see these."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).to(torch.float32)
    return model


def portable_tokenizer_config(folder: Path) -> None:
    """Write tokenizer_config.json so that transformers 4.x loads it as well as 5.x does.

    transformers 5 names the class TokenizersBackend (4.x does not know it; 5.x keeps
    PreTrainedTokenizerFast as an alias) and lists extra special tokens under a key that
    4.x reads as a dict; the chat template also goes inline, where 4.x looks for it.
    """
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    cfg.pop("backend", None)
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def save(model, tokenizer, out: Path, report: dict):
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = torch.bfloat16
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    portable_tokenizer_config(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, do_sample=False,
                     max_new_tokens=128).save_pretrained(out)
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


# ------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=BUNDLED)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (into /tmp)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--draft-steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.out = Path("/tmp/llmopt-quick-models")
        args.target_steps, args.draft_steps, args.batch, args.seq_len = 20, 10, 4, 128
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    train_files, held_files = corpus_files()
    train_texts = [read(p) for p in train_files]
    held_texts = [read(p) for p in held_files]
    print(f"corpus: {len(train_files)} train files ({sum(map(len, train_texts)) / 1e6:.1f} MB), "
          f"{len(held_files)} held out ({sum(map(len, held_texts)) / 1e6:.1f} MB)", flush=True)

    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_stream = encode_docs(tokenizer, train_texts)
    held_stream = encode_docs(tokenizer, held_texts)
    print(f"tokens: train {len(train_stream):,}, held out {len(held_stream):,}", flush=True)

    # The held-out text ships with the package: perplexity and quantization calibration
    # later use exactly this text, offline, whatever Python version a machine has.
    held_sample = "\n".join(held_texts)[: 400_000]
    eval_stream = encode_docs(tokenizer, [held_sample])

    target = make_model(tokenizer, TARGET, args.seed)
    t0 = time.time()
    train(target, train_stream, args.target_steps, args.seq_len, args.batch, 3e-3, args.seed,
          name="tiny")
    target_min = (time.time() - t0) / 60
    round_to_bf16(target)

    draft = make_model(tokenizer, DRAFT, args.seed + 1)
    t0 = time.time()
    train(draft, train_stream, args.draft_steps, args.seq_len, args.batch, 3e-3, args.seed + 1,
          teacher=target, name="tiny-draft")
    draft_min = (time.time() - t0) / 60
    round_to_bf16(draft)

    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731 (tied: counted once)
    report = {
        "seed": args.seed,
        "corpus": "Python standard library sources (crc32(path) % 10 == 0 held out)",
        "python": sys.version.split()[0],
        "train_tokens_available": len(train_stream),
        "tokens_seen": {"tiny": args.target_steps * args.batch * args.seq_len,
                        "tiny-draft": args.draft_steps * args.batch * args.seq_len},
        "params": {"tiny": n_params(target), "tiny-draft": n_params(draft)},
        "heldout_perplexity": {"tiny": perplexity(target, eval_stream),
                               "tiny-draft": perplexity(draft, eval_stream)},
        "draft_argmax_agreement": agreement(draft, target, eval_stream),
        "train_minutes": {"tiny": target_min, "tiny-draft": draft_min},
        "samples": {p: {"tiny": greedy(target, tokenizer, p), "tiny-draft": greedy(draft, tokenizer, p)}
                    for p in ["def ", "class ", "import "]},
    }
    report["total_minutes"] = (time.time() - t_start) / 60
    print(json.dumps(report, indent=2), flush=True)

    save(target, tokenizer, args.out / "tiny", report)
    save(draft, tokenizer, args.out / "tiny-draft", report)
    (args.out / "heldout.txt").write_text(held_sample, encoding="utf-8")
    print(f"saved to {args.out} in {report['total_minutes']:.1f} min", flush=True)


if __name__ == "__main__":
    main()
