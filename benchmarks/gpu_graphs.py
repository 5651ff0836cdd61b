"""The `cuda-graphs` section of gpu_check.py: decode steps replayed as CUDA graphs against eager.

SmolLM2 (the wheel's GGUF, once `smollm2-sanity` has passed) in bf16 twice: `enforce_eager=True`, and the default, whose
decode steps replay the graph of their batch-size bucket (llmopt/worker/cuda_graphs.py). First
the greedy tokens of the two (they may part where a padded bucket's matmuls round differently
from the unpadded batch's; smollm2-sanity holds the engine to the CPU), then the median
decode step at 1, 8 and 32 sequences on each path: at small batch a step of SmolLM2 is a few
hundred kernel launches, which a graph replays with one call. In the dry run the bundled model
runs on the CPU with `call_again` standing in for a graph: the buffers and buckets run, the
timings mean nothing.
"""

from __future__ import annotations

import statistics

from gpu_engine import check_greedy, engine_greedy, free, make_llm, prompts
from gpu_sanity import require_sane

BATCHES = (1, 8, 32)


def decode_step_ms(run, llm, batch: int, steps: int) -> float:
    """Median wall milliseconds of `steps` pure decode steps of `batch` sequences."""
    from llmopt import SamplingParams

    engine = llm.llm_engine
    ids = [f"graphs-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, {"prompt_token_ids": [100 + (7 * i + j) % 1000 for j in range(64)]},
                           SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True))
    seqs = [engine.requests[rid] for rid in ids]
    while any(not s.output_token_ids for s in seqs):  # the prompts (eager)
        engine.step()
    times = [run.wall(engine.step)[0] for _ in range(steps)]
    engine.abort_request(ids)
    return 1e3 * statistics.median(times)


def section_cuda_graphs(run) -> None:
    from llmopt.worker.cuda_graphs import GraphedDecode, call_again

    if not require_sane(run):
        return
    eager = make_llm(run, run.model, enforce_eager=True, max_num_seqs=max(BATCHES))
    graphed = make_llm(run, run.model, max_num_seqs=max(BATCHES))
    engine = graphed.llm_engine
    if run.device == "cuda":
        run.check("decode steps replay CUDA graphs", engine.decode_path == "cuda graphs", engine.decode_path)
    else:  # the CPU's compiled step would take the steps: the graph path's buffers in its place
        engine.runner.backend = GraphedDecode(engine.model, engine.kv_cache, max(BATCHES),
                                             -(-engine.max_model_len // engine.block_size), capture=call_again)
    reqs = prompts(run, graphed.tokenizer, 16)
    check_greedy(run, "SmolLM2, CUDA graphs vs eager (bf16)", engine_greedy(graphed, reqs), engine_greedy(eager, reqs))
    replayed = engine.runner.backend.replayed
    run.check("decode steps were replayed", sum(replayed.values()) > 0 and engine.runner.backend.failed is None,
              engine.runner.backend.failed or ", ".join(f"bucket {b}: {n}" for b, n in replayed.items() if n))
    rows, steps = [], 3 if run.dry_run else 20
    for batch in BATCHES[:2] if run.dry_run else BATCHES:
        if not run.has_time(10):
            break
        e, g = decode_step_ms(run, eager, batch, steps), decode_step_ms(run, graphed, batch, steps)
        rows.append([batch, f"{e:.2f}", f"{g:.2f}", f"{e / g:.2f}x"])
        run.section.numbers[f"batch_{batch}"] = {"eager_ms": e, "graphs_ms": g}
    run.table("Decode step, SmolLM2 bf16, 64-token prompts (median of steps, ms)",
              ["sequences", "eager", "CUDA graphs", "speedup"], rows)
    if run.dry_run:
        run.note("timed on the CPU with call_again in the dry run: not a measurement")
    del eager, graphed
    free()
