"""The kernels batch-invariant mode runs (llmopt/worker/compiled_decode.py), each row checked bit
for bit: a row's result computed alone equals the same row computed among others.

- dense_matmul.cpp's row kernel at 1 to 13 rows of x (bf16 and fp32 weights): the kernel the
  invariant step uses at every row count.
- GGUF blocks at 1 to 13 rows (int8 and float activations).
- Paged attention with `batch_invariant=True`: a long context's decode row alone (where the kernel
  would slice it across threads) and beside other sequences; a prompt's rows as one chunk and as
  several chunks (other tiles of queries); and the mode still equal to the plain-torch reference.
"""

from __future__ import annotations

import pytest
import torch

from llmopt.kernels import cpu
from llmopt.kernels.cpu.paged_attention import paged_attention_cpu
from llmopt.kernels.paged_attention_ref import paged_attention_ref

from tests.kernels.test_cpu_kernels import GGUF_TYPES, activations, gguf_weight, paged_batch

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no C++ CPU kernels: {cpu.why_unavailable()}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_row_kernel_rows_do_not_depend_on_the_others(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 576, generator=g) * 0.05).to(dtype)   # 576 = 72 vectors of 8, 36 of 16: no tail
    w_tail = (torch.randn(40, 100, generator=g) * 0.05).to(dtype)  # K = 100: a scalar tail after the vectors
    for weight in (w, w_tail):
        x = torch.randn(13, weight.shape[1], generator=g).to(dtype)
        alone = torch.cat([cpu.load().dense_matmul(x[i:i + 1], weight) for i in range(13)])
        for m in range(2, 14):
            together = cpu.load().dense_matmul(x[:m], weight)
            assert torch.equal(together, alone[:m]), f"{m} rows of x change a row's result"


@pytest.mark.parametrize("kind", GGUF_TYPES)
@pytest.mark.parametrize("acts", ["int8", "float32"])
def test_gguf_block_rows_do_not_depend_on_the_others(kind, acts):
    w, _ = gguf_weight(kind)
    x = activations(13).bfloat16()
    alone = torch.cat([w.matmul(x[i:i + 1].contiguous(), acts) for i in range(13)])
    for m in (2, 5, 8, 13):
        assert torch.equal(w.matmul(x[:m].contiguous(), acts), alone[:m]), f"{m} rows change a row's result"


def attend(batch, rows=None, invariant=True):
    q, k_pool, v_pool, table, qsl, lens, scale = batch
    return paged_attention_cpu(q, k_pool, v_pool, table, qsl, lens, scale, batch_invariant=invariant)


def restrict(batch, seqs, query_lens=None):
    """The same pool and sequences, only `seqs` of them (and their queries) in the call."""
    q, k_pool, v_pool, table, qsl, lens, scale = batch
    rows = torch.cat([torch.arange(int(qsl[i]), int(qsl[i + 1])) for i in seqs])
    n = [int(qsl[i + 1] - qsl[i]) for i in seqs]
    new_qsl = torch.tensor([0] + n).cumsum(0).int()
    return q[rows], k_pool, v_pool, table[seqs].contiguous(), new_qsl, lens[seqs].contiguous(), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_long_decode_row_alone_and_beside_others(dtype):
    # sequence 0: 900 keys, one query (alone it is sliced across threads unless invariant)
    batch = paged_batch([900, 40, 300, 17, 600, 5], [1, 1, 1, 1, 1, 1], dtype=dtype, group=3, seed=3)
    together = attend(batch)
    for i in range(6):
        alone = attend(restrict(batch, [i]))
        assert torch.equal(alone[0], together[i]), f"sequence {i}'s row differs alone"
    q, k_pool, v_pool, table, qsl, lens, scale = batch
    want = paged_attention_ref(q, k_pool, v_pool, table, qsl, lens, scale)
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(together.float(), want.float(), atol=tol, rtol=tol)


def test_a_prompt_in_chunks_equals_the_prompt_whole():
    """A 70-token prompt over 330 keys of context, as one chunk of 70 queries and as chunks of
    23 + 1 + 46 in three calls (each with a neighbour decoding): every query row the same."""
    seq_len, n = 400, 70
    batch = paged_batch([seq_len, 64], [n, 1], dtype=torch.bfloat16, group=3, seed=5)
    whole = attend(batch)[:n]
    q, k_pool, v_pool, table, qsl, lens, scale = batch
    got, done = [], 0
    for chunk in (23, 1, 46):
        end_len = seq_len - n + done + chunk   # the sequence's length after this chunk
        part = (torch.cat([q[done:done + chunk], q[n:n + 1]]), k_pool, v_pool, table,
                torch.tensor([0, chunk, chunk + 1], dtype=torch.int32), torch.tensor([end_len, 64], dtype=torch.int32),
                scale)
        got.append(attend(part)[:chunk])
        done += chunk
    assert torch.equal(torch.cat(got), whole)
