"""The model runner: turns a scheduled step into one flat forward pass, and samples.

All new tokens of all scheduled sequences (whole prompts, prompt chunks, single decode
tokens) go through the model together as one flat batch. Only sequences whose step
reaches their last known token produce logits and a new token; a prompt chunk that
stops short of its end just fills the cache.
"""

from __future__ import annotations

import torch

from llmopt.engine.block_manager import BlockManager
from llmopt.engine.kv_cache import PagedBatch, PagedKVCache
from llmopt.engine.sequence import Sequence
from llmopt.layers.sampler import sample, top_logprobs


class ModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache, block_manager: BlockManager, device):
        self.model, self.kv_cache, self.bm, self.device = model, kv_cache, block_manager, device

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        bs = self.bm.block_size
        ids, positions, slots, tables = [], [], [], []
        query_lens, context_lens = [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            table = self.bm.block_tables[seq.request_id]
            ids += seq.token_ids[start:start + n]
            pos = range(start, start + n)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            tables.append(table)
            query_lens.append(n)
            context_lens.append(start)
        dev = self.device
        width = max(len(t) for t in tables)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        batch = PagedBatch(
            query_lens=query_lens, context_lens=context_lens, block_tables=tables,
            slot_mapping=torch.tensor(slots, device=dev),
            block_table_tensor=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                            dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens_tensor=torch.tensor([c + n for c, n in zip(context_lens, query_lens)],
                                         dtype=torch.int32, device=dev))
        return torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), batch

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> dict[str, tuple]:
        """Run one step; returns request_id -> (token, logprob info or None) for sampled rows."""
        input_ids, positions, batch = self.prepare(scheduled)
        self.kv_cache.begin_step(batch)
        hidden = self.model(input_ids, positions, self.kv_cache)
        # a row samples when this step computes its last known token
        rows, last = [], []
        end = 0
        for seq, n in scheduled:
            end += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(seq)
                last.append(end - 1)
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(last, device=hidden.device)])
        tokens = sample(logits, [s.params for s in rows], [s.generator for s in rows])
        want = max((s.params.logprobs or 0) for s in rows)
        info = None
        if any(s.params.logprobs is not None for s in rows):
            info = top_logprobs(logits, tokens, want)
        out = {}
        for i, (seq, t) in enumerate(zip(rows, tokens.tolist())):
            lp = None
            if seq.params.logprobs is not None:
                chosen, ranks, top_v, top_i = info
                k = seq.params.logprobs
                lp = (float(chosen[i]), int(ranks[i]), top_v[i, :k].tolist() if k else [],
                      top_i[i, :k].tolist() if k else [])
            out[seq.request_id] = (t, lp)
        return out
