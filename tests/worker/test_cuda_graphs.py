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

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
           "# sort a list of numbers\n" * 3, "x = [", "for i in range(10):", "while True:"]
# different lengths, so the batch shrinks 7 -> 6 -> ... -> 1 and crosses padded buckets
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 9, 12, 14, 17, 40)]


def graphed(llm, max_num_seqs: int) -> GraphedDecode:
    engine = llm.llm_engine
    blocks = -(-engine.max_model_len // engine.block_size)
    engine.runner.backend = GraphedDecode(engine.model, engine.kv_cache, max_num_seqs, blocks, capture=call_again)
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
    llm = LLM("tiny", **kw)
    assert llm.llm_engine.decode_path == "cuda graphs"
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
    assert g.failed.startswith("capturing bucket 8: RuntimeError") and sum(g.replayed.values()) == 0
