"""Decode steps replayed from static buffers in batch-size buckets (llmopt/worker/cuda_graphs.py).

On the CPU each replay calls the recorded step again (`call_again`), so these tests hold what a
CUDA graph depends on and a GPU is not needed to check: inputs copied into the buffers, the
rows of a padded bucket copying the first sequence, steps that fall back to the eager path
(prompts, batches above the largest bucket), and the greedy tokens equal to the eager path's.
On a CUDA device the same engine records real graphs (benchmarks/gpu_check.py times them).
"""

import pytest
import torch

from llmopt import LLM, SamplingParams
from llmopt.worker.cuda_graphs import BUCKETS, GraphedDecode, call_again, why_not_graphs
from tests.triton_checks import needs_triton

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
           "# sort a list of numbers\n" * 3, "x = [", "for i in range(10):", "while True:"]
# different lengths, so the batch shrinks 7 -> 6 -> ... -> 1 and crosses padded buckets
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 9, 12, 14, 17, 40)]


def graphed(llm, max_num_seqs: int, fused: bool = False) -> GraphedDecode:
    engine = llm.llm_engine
    blocks = -(-engine.max_model_len // engine.block_size)
    engine.runner.backend = GraphedDecode(engine.model, engine.kv_cache, max_num_seqs, blocks, capture=call_again,
                                          fused=fused)
    return engine.runner.backend


def tokens(llm):
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("prefix", [False, True])
def test_bucketed_decode_equals_eager(prefix):
    kw = dict(dtype="float32", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8, enable_prefix_caching=prefix)
    want = tokens(LLM("tiny", **kw))
    llm = LLM("tiny", **kw)
    g = graphed(llm, 6)
    assert g.buckets == [1, 2, 4, 6]
    assert tokens(llm) == want
    # 7 running sequences exceed the largest bucket (eager); 5 and 3 ran padded to 6 and 4
    assert g.replayed[6] > 0 and g.replayed[4] > 0 and g.replayed[2] > 0 and g.replayed[1] > 0
    assert tokens(llm) == want  # the recorded steps serve later requests, other slots, other lengths


def test_padding_rows_copy_the_first_sequence():
    llm = LLM("tiny", dtype="float32", enforce_eager=True, num_kv_blocks=32, max_num_seqs=8)
    g = graphed(llm, 8)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prompts: eager
    assert sum(g.replayed.values()) == 0
    engine.step()  # three decodes: bucket 4, row 3 a copy of row 0
    assert g.replayed[4] == 1
    assert g.ids[3] == g.ids[0] and g.positions[3] == g.positions[0] and g.slots[3] == g.slots[0]
    assert g.seq_lens[3] == g.seq_lens[0] and torch.equal(g.tables[3], g.tables[0])
    assert len({int(s) for s in g.slots[:3]}) == 3  # the real rows keep their own slots


def test_buckets_and_reasons():
    llm = LLM("tiny", dtype="float32", enforce_eager=True, num_kv_blocks=16, max_num_seqs=100)
    g = graphed(llm, 100)
    assert g.buckets == [b for b in BUCKETS if b < 100] + [100] and g.bucket(9) == 16 and g.bucket(97) == 100
    engine = llm.llm_engine
    assert why_not_graphs(engine.model, engine.kv_cache, "cpu") == "CUDA graphs need a CUDA device"
    assert engine.decode_path == "eager (enforce_eager=True)"


@pytest.mark.cuda
def test_cuda_graphs_equal_eager_on_the_gpu():
    """Real graphs: the default engine on CUDA replays its decode steps, with the eager tokens."""
    kw = dict(dtype="float32", device="cuda", num_kv_blocks=64, max_num_seqs=8)
    want = tokens(LLM("tiny", enforce_eager=True, **kw))
    for overlap in (False, True):  # the whole step one graph (fused kernels, sampler), the host overlapped too
        llm = LLM("tiny", async_scheduling=overlap, **kw)
        assert llm.llm_engine.decode_path == "cuda graphs" and llm.llm_engine.runner.backend.fused
        assert tokens(llm) == want and tokens(llm) == want
        assert sum(llm.llm_engine.runner.backend.replayed.values()) > 0


def test_a_step_that_cannot_be_recorded_runs_eagerly():
    """A capture that raises leaves the engine serving, eagerly, with the reason kept."""
    kw = dict(dtype="float32", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8)
    want = tokens(LLM("tiny", **kw))
    llm = LLM("tiny", **kw)
    engine = llm.llm_engine

    def refuse(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    g = GraphedDecode(engine.model, engine.kv_cache, 8, -(-engine.max_model_len // engine.block_size), capture=refuse)
    engine.runner.backend = g
    assert tokens(llm) == want
    assert g.failed.startswith("capturing bucket 8, q=1 (greedy): RuntimeError") and sum(g.replayed.values()) == 0


@needs_triton
def test_whole_step_graph_fused_and_sampling_equals_eager():
    """The step recorded end to end (fused elementwise kernels, head, sampler), greedy and seeded
    sampled rows together, with and without the overlap: the eager path's tokens."""
    ps = list(PARAMS[:5]) + [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True),
                             SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=3, max_tokens=9)]
    kw = dict(dtype="float32", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8)
    want = [list(o.outputs[0].token_ids) for o in LLM("tiny", **kw).generate(PROMPTS, ps, use_tqdm=False)]
    for overlap in (False, True):
        llm = LLM("tiny", async_scheduling=overlap, **kw)
        g = graphed(llm, 8, fused=True)
        assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, ps, use_tqdm=False)] == want
        # sampled rows in the batch of 7 (bucket 8), the last greedy ones alone (bucket 1 or 2)
        assert g.failed is None and (8, 1, "draws") in g.replays and any(k == "greedy" for *_, k in g.replays)


@needs_triton
def test_fused_forward_equals_the_model():
    from llmopt.layers.attention import AttentionMetadata
    from llmopt.model.forward import run_model
    from llmopt.worker.fused_decode import fused_forward

    engine = LLM("tiny", dtype="float32", enforce_eager=True, num_kv_blocks=16).llm_engine
    ids = torch.tensor([5, 17, 300, 2, 9])
    tables = [[0, 1], [2]]
    meta = lambda: AttentionMetadata.paged(tables, [0, 0], [3, 2], engine.block_size)  # noqa: E731
    want = run_model(engine.model, engine.kv_cache, ids, meta())
    k0 = engine.kv_cache.k[0].clone()
    got = fused_forward(engine.model, engine.kv_cache, ids, meta())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The same keys, rewritten. The pool is allocated uninitialised, so slots no sequence wrote may
    # hold NaN bits from the start: they must stay as they were, NaN included.
    torch.testing.assert_close(engine.kv_cache.k[0], k0, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("k", [2, 4])
def test_verification_steps_replay_equal_eager(k):
    """A chain of k drafts is checked in a recorded step of k + 1 tokens a sequence (n-gram lookup
    here): the eager path's tokens, with steps of every draft length replayed."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    kw = dict(dtype="float32", enforce_eager=True, num_kv_blocks=64, max_num_seqs=8, speculative_config=spec)
    prompts = ["a = 1\nb = 2\na = 1\nb = 2\na = 1\n", "for i in range(3):\n    print(i)\n" * 2, "x = ["]
    ps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 24, 12)]
    want = [list(o.outputs[0].token_ids) for o in LLM("tiny", **kw).generate(prompts, ps, use_tqdm=False)]
    llm = LLM("tiny", **kw)
    g = graphed(llm, 4)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, ps, use_tqdm=False)] == want
    assert any(q > 1 for _, q, _ in g.replays) and g.failed is None
    assert llm.llm_engine.spec_stats["num_accepted_tokens"] > 0
