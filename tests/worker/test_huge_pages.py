"""Weights moved onto huge pages (llmopt/worker/huge_pages.py) are the same numbers, shared as
before, and the engine's tokens do not change."""

import pytest
import torch
from torch import nn

from llmopt import LLM, SamplingParams
from llmopt.kernels.cpu.gguf_blocks import GGUFBlockWeight
from llmopt.worker import huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        qs = torch.randint(0, 256, (256, 18, 16), dtype=torch.uint8)
        d, m = torch.rand(256, 18).half(), torch.rand(256, 18).half()
        self.weight_blocks = GGUFBlockWeight("Q4_1", qs, d, m)


def small_model():
    model = nn.Module()
    model.embed = nn.Embedding(1000, 64)             # 256 KB: moved
    model.head = nn.Linear(64, 1000, bias=False)
    model.head.weight = model.embed.weight           # tied: one tensor, moved once
    model.norm = nn.LayerNorm(64)                    # 256 bytes: stays
    model.register_buffer("table", torch.randn(300, 300))
    model.blocks = Blocks()
    return model


@needs_thp
def test_moved_weights_are_the_same_numbers_and_stay_tied():
    model = small_model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    wb = model.blocks.weight_blocks
    blocks_before = [wb.qs.clone(), wb.d.clone(), wb.m.clone()]
    norm_ptr, embed_ptr = model.norm.weight.data_ptr(), model.embed.weight.data_ptr()
    moved = huge_pages.move_weights(model)
    assert moved >= 1000 * 64 * 4 + 300 * 300 * 4 + wb.qs.nbytes
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.data_ptr() != embed_ptr and model.norm.weight.data_ptr() == norm_ptr
    for new, old in zip([wb.qs, wb.d, wb.m], blocks_before):
        assert torch.equal(new, old) and new.is_contiguous()
    # one mapping, starting on a 2 MB boundary, each tensor on a cache line
    ptrs = sorted(t.data_ptr() for t in (model.embed.weight, model.table, wb.qs, wb.d, wb.m))
    assert ptrs[0] % huge_pages.HUGE_PAGE == 0 and all(p % huge_pages.ALIGN == 0 for p in ptrs)
    assert ptrs[-1] - ptrs[0] < moved
    model.embed.weight.data.add_(1)  # the copies are writable memory of their own
    assert torch.equal(model.head.weight, before["embed.weight"] + 1)


def test_without_huge_pages_nothing_moves(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    model = small_model()
    ptr = model.embed.weight.data_ptr()
    assert huge_pages.move_weights(model) == 0 and model.embed.weight.data_ptr() == ptr


@needs_thp
def test_engine_tokens_are_the_same_with_and_without_huge_pages(monkeypatch):
    prompts = ["The quick brown fox", "def f(x):"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    moved = [t.outputs[0].token_ids for t in LLM(model="tiny").generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(huge_pages, "move_weights", lambda model: 0)
    plain = [t.outputs[0].token_ids for t in LLM(model="tiny").generate(prompts, params, use_tqdm=False)]
    assert moved == plain


@needs_thp
def test_the_compiled_steps_own_copies_move_too():
    """`onto_huge_pages`: tensors of at least a page copied side by side into one 2 MB-aligned
    mapping, the same numbers; smaller ones returned as they are."""
    big, small = torch.randn(64, 300).bfloat16(), torch.randn(8)
    moved = huge_pages.onto_huge_pages([big, small])
    assert torch.equal(moved[0], big) and moved[0].data_ptr() != big.data_ptr()
    assert moved[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert moved[1] is small
