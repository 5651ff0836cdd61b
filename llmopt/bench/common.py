"""What every workload shares: timing, percentiles, the header line and table, the baselines' runs."""

from __future__ import annotations

import json

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.bench.inputs import BenchRequest
from llmopt.engine.reference_loops import generate_with_cache
from llmopt.sampling_params import SamplingParams
from llmopt.sequence import Sequence


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The vector instruction sets llmopt's CPU kernels and torch's pick from, best first, as
# /proc/cpuinfo names them, and as a measurement names them.
ISA = (("amx_bf16", "AMX"), ("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16"),
       ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON"))


def isa(flags: str | None = None) -> str:
    """The vector instruction sets this CPU offers, from its flags (/proc/cpuinfo's by default):
    "AVX512_VNNI, AVX-512, AVX2", or "" where none of those is listed."""
    if flags is None:
        from llmopt.kernels.cpu import cpu_flags

        flags = cpu_flags()
    have = set(flags.replace(":", " ").split())
    return ", ".join(name for flag, name in ISA if flag in have)


def llc_bytes(cpu: int = 0) -> int | None:
    """The last-level cache CPU `cpu` sees (the highest cache level sysfs lists for it), in bytes;
    None where sysfs does not say (not Linux, a container hiding it)."""
    best = None
    for index in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        size = int(text.rstrip("KMG")) * scale
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def machine() -> str:
    """This machine as a measurement names it: the GPU where torch uses one, else the CPU's model,
    its vector instruction sets, its last-level cache and torch's thread count."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    llc = llc_bytes()
    parts = [cpu_name(), isa(), llc and f"{llc / 2**20:g} MiB LLC",
             f"{torch.get_num_threads()} thread{'s' * (torch.get_num_threads() != 1)}"]
    return ", ".join(p for p in parts if p)


QUIET_LOAD = 1.5  # a 1-minute load average above this means the numbers are not the machine's own


def load_average() -> float:
    """The 1-minute load average, with a warning when the machine is not quiet enough to measure."""
    import warnings

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if load > QUIET_LOAD:
        warnings.warn(f"load average {load:.2f} > {QUIET_LOAD}: other jobs share the CPU, so these timings "
                      "are not this machine's; rerun on a quiet machine before committing them", stacklevel=2)
    return load


def header(llm, command: str, load: float | None = None) -> str:
    """The table's first line: model, dtype, threads, CPU, the load average when the run started."""
    import transformers

    load = load_average() if load is None else load

    n = sum(p.numel() for p in llm.model.parameters())
    return (f"model `{llm.config.model}` ({n:,} params), {llm.dtype}, {llm.device}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{torch.get_num_threads()} threads, {cpu_name()} ({isa() or 'no AVX2'}, {os.cpu_count()} cores), "
            f"load average {load:.2f} at the start; command: `{command}`")


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def progress_bar(items, desc: str, on: bool, total: int | None = None):
    if not on:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, total=total, dynamic_ncols=True)


def warm_up(llm) -> None:
    """One short request first, so allocator and thread-pool start-up is not timed."""
    ids = list(range(3, 67))
    llm.generate([{"prompt_token_ids": ids}] * 2, SamplingParams(temperature=0.0, max_tokens=4,
                                                                ignore_eos=True), use_tqdm=False)


@dataclass
class Clock:
    """Wall time and this process's CPU time (all threads). On a CPU shared with other jobs
    the wall time of a run depends on what else ran meanwhile; with one thread, its CPU time
    is close to what it would take alone."""

    wall: float
    cpu: float

    @staticmethod
    def start() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    @classmethod
    def since(cls, t0: tuple[float, float]) -> Clock:
        return cls(time.perf_counter() - t0[0], time.process_time() - t0[1])


def write_result(out: str, text: str, load: float, rows: list[dict]) -> None:
    """A benchmark's committed table: `out`.md (the text, printed too) and `out`.json (its rows, with
    the machine and the load average at the start)."""
    from pathlib import Path

    Path(out + ".md").write_text(text)
    Path(out + ".json").write_text(json.dumps({"machine": machine(), "load": load, "rows": rows}, indent=1))
    print(text)


def output_tokens_per_second(llm, prompts: list, params) -> float:
    """One `generate` call over `prompts`: the tokens it produced a second of wall time."""
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def run_engine(llm, requests: list[BenchRequest], progress: bool) -> tuple[Clock, list]:
    t0 = Clock.start()
    outs = llm.generate([r.prompt() for r in requests], [r.params() for r in requests],
                        use_tqdm=progress)
    return Clock.since(t0), outs


def one_at_a_time(llm, requests: list[BenchRequest], progress: bool) -> tuple[Clock, list[list[int]]]:
    """llmopt's contiguous-cache loop, each request alone (no batching at all)."""
    tokens = []
    t0 = Clock.start()
    for i, r in enumerate(progress_bar(requests, "llmopt one at a time", progress)):
        seq = Sequence(f"one-{i}", None, r.prompt_token_ids, r.params())
        generate_with_cache(llm.model, [seq], eos_token_ids=llm.eos_token_ids,
                            max_model_len=llm.max_model_len)
        tokens.append(seq.output_token_ids)
    return Clock.since(t0), tokens


def load_hf_model(llm):
    from transformers import AutoModelForCausalLM

    from llmopt.model.gguf import is_gguf

    path = llm.llm_engine.model_path
    # the same weights the engine runs: a GGUF file is dequantized by transformers' own reader
    where = {"gguf_file": path.name} if is_gguf(path) else {}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent if where else path), dtype=llm.dtype, **where)
    return model.to(llm.device).eval()


@torch.inference_mode()
def hf_static_batches(hf_model, requests: list[BenchRequest], batch_size: int, pad_id: int,
                      progress: bool) -> tuple[Clock, list[list[int]], int]:
    """Hugging Face `generate`, `batch_size` requests at a time, left-padded. A static batch
    runs until its longest request is done; every row then keeps only what it asked for.
    Returns (clock, tokens per request, tokens computed including that waste)."""
    from transformers import GenerationConfig

    dev = next(hf_model.parameters()).device
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    tokens, computed = [], 0
    t0 = Clock.start()
    for batch in progress_bar(batches, f"HF generate, static batches of {batch_size}", progress):
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = [[pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
        mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                for r in batch]
        new = max(r.max_tokens for r in batch)
        # eos_token_id=None: like ignore_eos, rows never stop early (and are never padded)
        config = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=None,
                                  pad_token_id=pad_id)
        out = hf_model.generate(input_ids=torch.tensor(ids, device=dev),
                                attention_mask=torch.tensor(mask, device=dev), generation_config=config)
        rows = out[:, width:].tolist()
        tokens += [row[:r.max_tokens] for row, r in zip(rows, batch)]
        computed += new * len(batch)
    return Clock.since(t0), tokens, computed


def common_prefix_share(a: list[int], b: list[int]) -> float:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(a), len(b), 1)
