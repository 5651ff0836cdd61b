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
from llmopt.layers.sampler import hold_back_stop_tokens, sample, sampling_probs, top_logprobs
from llmopt.spec.rejection_sampler import rejection_sample


def slots_of(table: list[int], positions, block_size: int) -> list[int]:
    """Cache slot of each token position of a sequence: block * block_size + offset."""
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def build_paged_batch(tables: list[list[int]], starts: list[int], query_lens: list[int],
                      block_size: int, device) -> tuple[torch.Tensor, PagedBatch]:
    """Positions and attention metadata for a flat step: sequence i brings query_lens[i] new
    tokens at positions starts[i]..; its KV goes to the slots its block table maps them to.
    (Draft models and heads run on the same block tables, with KV pools of their own.)"""
    positions, slots = [], []
    for table, start, n in zip(tables, starts, query_lens):
        pos = range(start, start + n)
        positions += pos
        slots += slots_of(table, pos, block_size)
    width = max(len(t) for t in tables)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    batch = PagedBatch(
        query_lens=list(query_lens), context_lens=list(starts), block_tables=tables,
        slot_mapping=torch.tensor(slots, device=device),
        block_table_tensor=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                        dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens_tensor=torch.tensor([c + n for c, n in zip(starts, query_lens)],
                                     dtype=torch.int32, device=device))
    return torch.tensor(positions, device=device), batch


class ModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache, block_manager: BlockManager, device,
                 eos_token_ids: set[int] = frozenset()):
        self.model, self.kv_cache, self.bm, self.device = model, kv_cache, block_manager, device
        self.eos_token_ids = eos_token_ids  # held back until min_tokens, with stop_token_ids

    def step_inputs(self, scheduled: list[tuple[Sequence, int]]):
        """The step as plain lists: new token ids (flat), each sequence's start position,
        new-token count and block table."""
        ids, starts, lens, tables = [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids += (seq.token_ids + seq.spec_token_ids)[start:start + n]
            starts.append(start)
            lens.append(n)
            tables.append(self.bm.block_tables[seq.request_id])
        return ids, starts, lens, tables

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        ids, starts, lens, tables = self.step_inputs(scheduled)
        positions, batch = build_paged_batch(tables, starts, lens, self.bm.block_size, self.device)
        return torch.tensor(ids, device=self.device), positions, batch

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> dict[str, list[tuple]]:
        """Run one step. Returns request_id -> [(token, logprob info or None), ...] for every
        sequence that produced tokens: one token, or with speculation the accepted drafts
        plus one more."""
        input_ids, positions, batch = self.prepare(scheduled)
        self.kv_cache.begin_step(batch)
        self.last_batch = batch
        hidden = self.model(input_ids, positions, self.kv_cache)
        self.last_hidden = hidden  # an EAGLE head drafts from the target's features
        rows, index = self.sampling_rows(scheduled)
        if not rows:
            return {}
        return self.sample(rows, self.model.compute_logits(hidden[torch.tensor(index, device=hidden.device)]))

    @staticmethod
    def sampling_rows(scheduled) -> tuple[list[Sequence], list[int]]:
        """The sequences that sample this step, and the flat positions that need logits. A row
        samples when this step reaches its last known token; with k drafts the last k + 1
        positions all get logits: p_1..p_{k+1} for the rejection sampler."""
        rows, index, end = [], [], 0
        for seq, n in scheduled:
            end += n
            k = len(seq.spec_token_ids)
            if seq.num_computed_tokens + n == seq.num_tokens + k:
                rows.append(seq)
                index += range(end - 1 - k, end)
        return rows, index

    def sample(self, rows: list[Sequence], logits: torch.Tensor) -> dict[str, list[tuple]]:
        """Tokens (and logprobs) for every sampling row, from its logits."""
        out, at = {}, 0
        plain = [i for i, s in enumerate(rows) if not s.spec_token_ids]
        firsts = []
        for seq in rows:
            firsts.append(at)
            at += 1 + len(seq.spec_token_ids)
        # draws come from `allowed` (stop tokens held back below min_tokens); logprobs from `logits`
        allowed = hold_back_stop_tokens(logits, [(f, 1 + len(s.spec_token_ids), s.params, len(s.output_token_ids))
                                                 for f, s in zip(firsts, rows)], self.eos_token_ids)
        tokens = {}
        if plain:
            picked = sample(allowed[[firsts[i] for i in plain]], [rows[i].params for i in plain],
                            [rows[i].generator for i in plain])
            tokens.update({i: [t] for i, t in zip(plain, picked.tolist())})
        for i, seq in enumerate(rows):
            if seq.spec_token_ids:
                tokens[i] = self._verify(seq, allowed[firsts[i]:firsts[i] + 1 + len(seq.spec_token_ids)])
        for i, seq in enumerate(rows):
            emitted = tokens[i]
            info = [None] * len(emitted)
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                chosen, ranks, top_v, top_i = top_logprobs(
                    logits[firsts[i]:firsts[i] + len(emitted)],
                    torch.tensor(emitted, device=logits.device), k)
                info = [(float(chosen[j]), int(ranks[j]), top_v[j].tolist() if k else [],
                         top_i[j].tolist() if k else []) for j in range(len(emitted))]
            out[seq.request_id] = list(zip(emitted, info))
        return out

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        """Speculative decoding's check: the target's distributions at the k + 1 positions,
        filtered exactly as plain sampling filters them, against the proposer's (q, or
        one-hot drafts when it has no distribution, as n-gram lookup has not)."""
        probs = sampling_probs(logits, seq.params)
        drafts = torch.tensor(seq.spec_token_ids, device=logits.device)
        return rejection_sample(probs, seq.spec_draft_probs, drafts, seq.generator,
                                greedy=seq.params.greedy)
