"""The speculative-decoding benchmark: plain decoding against each method, measured and predicted.

Plain decoding vs n-gram lookup, a draft model and an EAGLE head at k in {2, 4, 6}: acceptance,
target forwards per token, and the speedup at batch 1 (latency) and at a larger batch
(throughput), next to what Leviathan et al.'s formula predicts from the measured acceptance
and draft cost. `llmopt bench --workload spec` runs it.
"""

from __future__ import annotations

import time

from llmopt.bench.common import Clock, progress_bar, table, warm_up
from llmopt.bench.inputs import BenchRequest

SPEC_METHODS = {"ngram": {"method": "ngram", "prompt_lookup_max": 4},
                "draft_model": {"method": "draft_model", "model": "tiny-draft"},
                "eagle": {"method": "eagle", "model": "tiny-eagle"}}


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Leviathan et al. (2023), eq. 1: tokens per target forward when each draft token is
    accepted with probability alpha, independently: (1 - alpha^(k+1)) / (1 - alpha)."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def alpha_from_length(length: float, k: int) -> float:
    """The alpha whose expected tokens per step equals the measured mean acceptance length."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < length else (lo, mid)
    return (lo + hi) / 2


def predicted_speedup(alpha: float, k: int, c: float, verify: float = 1.0) -> float:
    """Leviathan et al., theorem 3.8: walltime improvement (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)),
    with c = one draft forward / one target forward. The theorem assumes verifying k + 1 tokens
    costs what decoding one does (true while a forward is memory-bound, as on a GPU at small
    batch); `verify` replaces that 1 with the measured ratio."""
    return expected_tokens_per_step(alpha, k) / (k * c + verify)


def _timed_engine(llm):
    """Count and time target forwards and proposals (wrapping, not changing, the engine)."""
    eng = llm.llm_engine
    timer = {"target_s": 0.0, "target_calls": 0, "propose_s": 0.0, "propose_calls": 0, "draft_tokens": 0}

    def wrap(obj, name, key):
        inner = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.process_time()
            try:
                return inner(*a, **kw)
            finally:
                timer[key + "_s"] += time.process_time() - t0
                timer[key + "_calls"] += 1
                if key == "propose":
                    timer["draft_tokens"] += sum(a[1])
        setattr(obj, name, timed)

    wrap(eng.runner, "execute", "target")
    if eng.proposer is not None:
        wrap(eng.proposer, "propose", "propose")
    return timer


def bench_spec(make_llm, requests: list[BenchRequest], methods: list[str], ks: list[int],
               batch1: int, progress: bool = True, spec_methods: dict | None = None) -> dict:
    """Every configuration runs the first `batch1` requests one at a time (latency) and then
    all of them at once (throughput); times are CPU seconds of this process (one thread: what
    the run would take alone on a core). `spec_methods` maps a method's name to its
    speculative_config (default SPEC_METHODS, the bundled target's)."""
    spec_methods = SPEC_METHODS if spec_methods is None else spec_methods
    if batch1 < 1 or any(k < 1 for k in ks):
        raise ValueError(f"--spec-batch1 ({batch1}) and every --spec-k ({ks}) must be >= 1")
    configs = [("plain", 0)] + [(m, k) for m in methods for k in ks]
    out = {"workload": "spec", "num_requests": len(requests), "batch1_requests": batch1,
           "prompt_lens": [len(r.prompt_token_ids) for r in requests],
           "output_len": requests[0].max_tokens, "runs": {}}
    tokens = {}
    for method, k in progress_bar(configs, "spec configs", progress):
        sc = None if method == "plain" else {**spec_methods[method], "num_speculative_tokens": k}
        llm = make_llm(speculative_config=sc)
        warm_up(llm)
        timer = _timed_engine(llm)
        run = {}
        for label, group in (("batch1", [[r] for r in requests[:batch1]]), ("batch", [requests])):
            for key in timer:
                timer[key] = 0
            before = llm.get_metrics()
            t0 = Clock.start()
            outs = []
            for reqs in group:
                outs += llm.generate([r.prompt() for r in reqs], [r.params() for r in reqs], use_tqdm=False)
            clock = Clock.since(t0)
            after = llm.get_metrics()
            m = {key: after[key] - before[key] for key in before}
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            drafts, accepted = m["spec_decode_num_drafts"], m["spec_decode_num_accepted_tokens"]
            run[label] = {
                "cpu_s": clock.cpu, "wall_s": clock.wall, "generated": generated,
                "ms_per_token": 1e3 * clock.cpu / generated, "tokens_per_s": generated / clock.cpu,
                "target_forwards": timer["target_calls"],
                "forwards_per_token": timer["target_calls"] * len(group[0]) / generated,
                "acceptance_rate": accepted / m["spec_decode_num_draft_tokens"] if drafts else 0.0,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                "target_ms_per_forward": 1e3 * timer["target_s"] / max(1, timer["target_calls"]),
                "draft_ms_per_token": 1e3 * timer["propose_s"] / max(1, timer["draft_tokens"]),
            }
            if label == "batch1":
                tokens[(method, k)] = [o.outputs[0].token_ids for o in outs]
        out["runs"][f"{method}:{k}"] = run
    plain = tokens[("plain", 0)]
    out["same_tokens"] = {f"{m}:{k}": sum(a == b for a, b in zip(t, plain)) for (m, k), t in tokens.items()}
    base = out["runs"]["plain:0"]
    for key, run in out["runs"].items():
        b1 = run["batch1"]
        run["speedup_batch1"] = base["batch1"]["ms_per_token"] / b1["ms_per_token"]
        run["speedup_batch"] = run["batch"]["tokens_per_s"] / base["batch"]["tokens_per_s"]
        if key != "plain:0":
            k = int(key.split(":")[1])
            # c: a draft token's cost in units of a plain decode step (the target forward at batch 1)
            c = b1["draft_ms_per_token"] / base["batch1"]["target_ms_per_forward"]
            alpha = alpha_from_length(b1["mean_acceptance_length"], k)
            verify = b1["target_ms_per_forward"] / base["batch1"]["target_ms_per_forward"]
            run.update(c=c, alpha=alpha, verify_cost=verify,
                       predicted_speedup_v1=predicted_speedup(alpha, k, c),
                       predicted_speedup=predicted_speedup(alpha, k, c, verify))
    return out


def spec_table(r: dict) -> str:
    rows = []
    for key, run in r["runs"].items():
        method, k = key.split(":")
        b1, b = run["batch1"], run["batch"]
        plain = key == "plain:0"
        rows.append([method, "-" if plain else k,
                     "-" if plain else f"{100 * b1['acceptance_rate']:.1f}%",
                     f"{b1['mean_acceptance_length']:.2f}", f"{b1['forwards_per_token']:.2f}",
                     f"{b1['ms_per_token']:.2f}", f"{run['speedup_batch1']:.2f}x",
                     "-" if plain else f"{run['c']:.2f}", "-" if plain else f"{run['verify_cost']:.2f}",
                     "-" if plain else f"{run['predicted_speedup_v1']:.2f}x",
                     "-" if plain else f"{run['predicted_speedup']:.2f}x",
                     f"{b['tokens_per_s']:.0f}", f"{run['speedup_batch']:.2f}x",
                     f"{r['same_tokens'][key]}/{r['batch1_requests']}"])
    best = max((k for k in r["runs"] if k.endswith(":4")), default=None,
               key=lambda k: r["runs"][k]["batch1"]["mean_acceptance_length"])
    note = ""
    if best:
        length = r["runs"][best]["batch1"]["mean_acceptance_length"]
        fastest = max(r["runs"], key=lambda k: r["runs"][k]["speedup_batch1"])
        note = (f"\n\nbest mean acceptance length at k = 4: {best.split(':')[0]} {length:.2f} "
                f"(goal >= 2.5: {'met' if length >= 2.5 else 'NOT met'}); fastest at batch 1: "
                f"{fastest.replace(':', ' k=')} x{r['runs'][fastest]['speedup_batch1']:.2f}")
    return (f"{r['batch1_requests']} requests one at a time (batch 1), then {r['num_requests']} at once "
            f"(batch); prompts of {min(r['prompt_lens'])}-{max(r['prompt_lens'])} held-out tokens, "
            f"{r['output_len']} greedy tokens each. Acceptance = accepted / proposed draft tokens; "
            "acceptance length = tokens per verification step (1 + accepted / drafts); c = CPU time "
            "of one draft token / one plain decode forward; verify = CPU time of a verification "
            "forward / a plain decode forward (v); predicted = Leviathan et al.'s (1 - a^(k+1)) / "
            "((1 - a)(kc + 1)) with a fitted to the measured acceptance length, which assumes a "
            "verification costs one decode step (v = 1, a memory-bound GPU), and the same with the "
            "measured v in place of 1.\n\n"
            + table(["method", "k", "acceptance", "acceptance length", "target forwards / token",
                     "ms / token (batch 1)", "speedup (batch 1)", "c", "verify v", "predicted (v = 1)",
                     "predicted (measured v)",
                     "tokens/s (batch)", "speedup (batch)", "same tokens as plain"], rows) + note)
