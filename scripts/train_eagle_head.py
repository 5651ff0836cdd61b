"""Train the bundled EAGLE draft head (`tiny-eagle`) on the bundled target (`tiny`).

The target is frozen; its final hidden states ("features") over the training corpus are
computed once. The head learns, at every position p, to predict the target's feature
at p from the embedding of token p and the feature at p-1 (see llmopt/spec/eagle.py):

    loss = smooth_l1(f'_p, f_p)  +  w * KL(target's next-token distribution || head's)

The KL term teaches what acceptance needs (agreeing with the target's choice); the
regression term keeps the predicted feature usable as the next step's input. A second
pass feeds the head its own predicted features as inputs, the situation it meets from
the second drafted token on, so that deeper draft positions are trained too.

Same corpus, tokenizer and held-out split as scripts/train_tiny_models.py; seeded; on 2
CPU cores it takes about 25 minutes.

    python scripts/train_eagle_head.py              # writes llmopt/bundled/tiny-eagle
    python scripts/train_eagle_head.py --quick      # a smoke run into /tmp
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_tiny_models import corpus_files, encode_docs, lr_at, read  # noqa: E402

from llmopt.layers.attention import AttentionMetadata  # noqa: E402
from llmopt.model.loader import load_model  # noqa: E402
from llmopt.model.registry import model_path  # noqa: E402
from llmopt.spec.eagle import EagleHead, head_config  # noqa: E402
from llmopt.worker.kv_cache import NoKVCache  # noqa: E402

KL_WEIGHT = 0.5


def token_stream(tokenizer, files: list[Path], max_tokens: int, seed: int) -> torch.Tensor:
    files = list(files)
    random.Random(seed).shuffle(files)
    texts, n = [], 0
    for p in files:
        t = read(p)
        texts.append(t)
        n += len(t) // 3  # about 3 characters per token; trimmed exactly below
        if n > max_tokens * 1.2:
            break
    return encode_docs(tokenizer, texts)[:max_tokens]


def run_flat(module_forward, batch: int, seq_len: int):
    """Run a module over [batch, seq_len] as independent causal sequences (no cache)."""
    return module_forward(AttentionMetadata.uncached([seq_len] * batch), NoKVCache())


@torch.no_grad()
def target_features(target, stream: torch.Tensor, seq_len: int, batch: int = 16, bf16: bool = True) -> torch.Tensor:
    """[num_seqs, seq_len, hidden] bf16 features of the target over the stream."""
    seqs = stream[: len(stream) // seq_len * seq_len].view(-1, seq_len)
    out = []
    for i in range(0, len(seqs), batch):
        ids = seqs[i:i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = run_flat(lambda meta, c: target(ids.flatten(), meta, c), len(ids), seq_len)
        out.append(h.view(len(ids), seq_len, -1).to(torch.bfloat16))
    return seqs, torch.cat(out)


def head_pass(head, target, ids, prev):
    b, t = ids.shape
    emb = target.model.embed_tokens(ids).flatten(0, 1)
    return run_flat(lambda meta, c: head(emb, prev.flatten(0, 1), meta, c), b, t).view(b, t, -1)


def shift_right(f: torch.Tensor) -> torch.Tensor:
    """Feature at p-1 for every p (zeros before the first token)."""
    return torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)


def losses(head, target, ids, feats, logits=None):
    """`logits`: features -> logits (default the target's lm_head; a head with a draft
    vocabulary trains on that vocabulary's rows only)."""
    logits = logits or target.compute_logits
    f = feats.float()
    with torch.no_grad():
        p_target = logits(f).log_softmax(-1)

    def one(prev):
        pred = head_pass(head, target, ids, prev)
        logq = logits(pred).log_softmax(-1)
        kl = F.kl_div(logq.flatten(0, 1), p_target.flatten(0, 1), log_target=True, reduction="batchmean")
        return F.smooth_l1_loss(pred, f) + KL_WEIGHT * kl, pred

    loss1, pred = one(shift_right(f))
    loss2, _ = one(shift_right(pred.detach()))  # inputs as at draft depth >= 2
    return loss1 + loss2


@torch.no_grad()
def agreement(head, target, seqs, feats, depth: int) -> float:
    """Top-1 agreement with the target when the head's input feature at each position is
    its own prediction `depth - 1` times over (depth 1 = true features)."""
    hits = total = 0
    for i in range(0, len(seqs), 16):
        ids, f = seqs[i:i + 16], feats[i:i + 16].float()
        prev = shift_right(f)
        for _ in range(depth):
            pred = head_pass(head, target, ids, prev)
            prev = shift_right(pred)
        same = target.compute_logits(pred).argmax(-1) == target.compute_logits(f).argmax(-1)
        hits += int(same[:, 1:].sum())
        total += same[:, 1:].numel()
    return hits / total


def train_step(head, target, opt, seqs, feats, step: int, args, gen, logits=None, bf16: bool = True) -> torch.Tensor:
    """One AdamW step on a random batch of sequences (warmup, then cosine decay); the loss."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, args.steps, args.lr, warmup=max(1, args.steps // 20))
    pick = torch.randint(0, len(seqs), (args.batch,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = losses(head, target, seqs[pick], feats[pick], logits)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return loss


def save_head(head: EagleHead, cfg: dict, out: Path, report: dict, dtype=torch.bfloat16) -> None:
    """Safetensors with checkpoint-style names (q_proj/k_proj/v_proj, gate_proj/up_proj)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in head.named_parameters():
        fused = next(((f, part, s) for f, part, s in head.stacked_params if f".{f}." in name), None)
        if fused is None:
            tensors[name] = p.detach().to(dtype).contiguous()
            continue
        for f, part, shard in head.stacked_params:
            if f == fused[0]:
                lo, hi = head.shard_rows(f, shard)
                tensors[name.replace(f, part)] = p.detach()[lo:hi].to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": str(dtype).removeprefix("torch.")}, indent=2)
                                     + "\n")
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "llmopt" / "bundled" / "tiny-eagle")
    ap.add_argument("--tokens", type=int, default=800_000, help="training tokens (features kept in RAM)")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (one is fastest on a small CPU shared with other work)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run into /tmp/tiny-eagle")
    args = ap.parse_args(argv)
    if args.quick:
        args.out, args.tokens, args.steps = Path("/tmp/tiny-eagle"), 20_000, 10
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()

    from transformers import AutoTokenizer

    target_dir = model_path("tiny")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = load_model(target_dir, torch.float32)
    target.requires_grad_(False)
    train_files, held_files = corpus_files()
    seqs, feats = target_features(target, token_stream(tokenizer, train_files, args.tokens, args.seed),
                                  args.seq_len)
    held_seqs, held_feats = target_features(
        target, token_stream(tokenizer, held_files, 64 * args.seq_len, args.seed), args.seq_len)
    print(f"features: {tuple(feats.shape)} train, {tuple(held_feats.shape)} held out "
          f"({time.time() - t0:.0f} s)", flush=True)

    cfg = head_config(target.config)
    head = EagleHead(target.config)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        loss = train_step(head, target, opt, seqs, feats, step, args, gen)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.time() - t0:.0f} s)", flush=True)

    head.eval()
    report = {"target": "tiny", "train_tokens": int(seqs.numel()), "steps": args.steps,
              "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr, "seed": args.seed,
              "parameters": sum(p.numel() for p in head.parameters()),
              "heldout_top1_agreement": {f"depth_{d}": agreement(head, target, held_seqs, held_feats, d)
                                         for d in (1, 2, 3)},
              "train_seconds": round(time.time() - t0)}
    print(json.dumps(report, indent=2))
    save_head(head, cfg, args.out, report)
    print(f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
