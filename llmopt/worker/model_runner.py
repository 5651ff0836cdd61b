"""The model runner: turns a scheduled step into one flat forward pass, and samples.

All new tokens of all scheduled sequences (whole prompts, prompt chunks, single decode
tokens) go through the model together as one flat batch. Only sequences whose step
reaches their last known token produce logits and a new token; a prompt chunk that
stops short of its end just fills the cache.

This is the one-process executor the engine calls (`execute`); with tensor or pipeline
parallelism, llmopt.distributed's `ParallelModelRunner` is the same runner with the forward
done by the ranks, and may keep several micro-batches in flight (`submit`, then `collect`).
"""

from __future__ import annotations

import torch

from llmopt.layers.attention import AttentionMetadata, slots_of
from llmopt.layers.rejection_sampler import rejection_sample
from llmopt.layers.sampler import apply_token_bitmask, hold_back_stop_tokens, sample, sampling_probs, top_logprobs
from llmopt.layers.tree_sampler import tree_rejection_sample
from llmopt.model.forward import run_model
from llmopt.sequence import Sequence
from llmopt.worker.draft_tree import accepted_slot_moves, add_tree_layout, move_slots
from llmopt.worker.kv_cache import PagedKVCache


class ModelRunner:
    max_in_flight = 1  # steps that may be submitted before the first is collected
    structured = None  # the engine's StructuredOutputManager: the grammars' bitmask before sampling
    # The two pieces lessons 02 and 05 let a learner replace (llmopt.exercises): each token's
    # cache slot, and the speculative verifier.
    slots_of = staticmethod(slots_of)
    rejection_sampler = staticmethod(rejection_sample)

    def __init__(self, model, kv_cache: PagedKVCache, block_manager, device,
                 eos_token_ids: set[int] = frozenset()):
        """block_manager: whatever keeps the block tables (`block_tables`, `block_size`)."""
        self.model, self.kv_cache, self.bm, self.device = model, kv_cache, block_manager, device
        self.eos_token_ids = eos_token_ids  # held back until min_tokens, with stop_token_ids
        self.compiled = None  # the decode step in one call (compiled_decode.py), when enabled
        self.graphs = None    # on CUDA: decode steps replayed as CUDA graphs (cuda_graphs.py)

    def enable_compiled_decode(self, max_num_seqs: int = 256, max_blocks_per_seq: int = 0) -> str | None:
        """Run steps (prompts, decodes, verification) through the compiled step where it can run
        this model and pool, on CUDA decode steps as CUDA graphs (buffers for max_num_seqs
        sequences of max_blocks_per_seq blocks); returns why not (None when enabled)."""
        from llmopt.worker.compiled_decode import CompiledDecode, why_not
        from llmopt.worker.cuda_graphs import GraphedDecode, why_not_graphs

        if torch.device(self.device).type == "cuda":
            reason = why_not_graphs(self.model, self.kv_cache, self.device)
            if reason is None:
                self.graphs = GraphedDecode(self.model, self.kv_cache, max_num_seqs, max_blocks_per_seq)
            return reason
        reason = why_not(self.model, self.kv_cache, self.device)
        if reason is None:
            self.compiled = CompiledDecode(self.model, self.kv_cache)
        return reason

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

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's flat token ids and its attention metadata, built once."""
        ids, starts, lens, tables = self.step_inputs(scheduled)
        meta = AttentionMetadata.paged(tables, starts, lens, self.bm.block_size, self.device, self.slots_of)
        add_tree_layout(meta, [seq.spec_tree for seq, _ in scheduled])  # draft trees: positions, masks
        return torch.tensor(ids, device=self.device), meta

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> dict[str, list[tuple]]:
        """Run one step. Returns request_id -> [(token, logprob info or None), ...] for every
        sequence that produced tokens: one token, or with speculation the accepted drafts
        plus one more."""
        input_ids, meta = self.prepare(scheduled)
        self.last_meta = meta
        compute_logits = self.model.compute_logits
        if self.compiled_runs(meta):
            hidden = self.compiled.forward(input_ids, meta)  # (a capture of this very model, not a swapped-in one)
            compute_logits = self.compiled.compute_logits
        elif self.graphs is not None and self.graphs.model is self.model and self.graphs.runs(meta):
            hidden = self.graphs.forward(input_ids, meta)
        else:
            hidden = run_model(self.model, self.kv_cache, input_ids, meta)
        self.last_hidden = hidden  # an EAGLE head drafts from the target's features
        rows, index = self.sampling_rows(scheduled)
        self.last_slot_moves = ([], [])  # draft trees: where the accepted paths' KV moved
        if not rows:
            return {}
        out = self.sample(rows, compute_logits(hidden[torch.tensor(index, device=hidden.device)]))
        move_slots(self.kv_cache, *self.last_slot_moves)
        return out

    def compiled_runs(self, meta: AttentionMetadata) -> bool:
        """Whether this step goes through the compiled step: any step (decode, verification,
        prompts and their chunks, mixed) whose draft trees, if any, fit the kernels' masks, when
        the compiled capture is of this very model (not a swapped-in one)."""
        if self.compiled is None or self.compiled.model is not self.model:
            return False
        return meta.tree_masks is None or meta.tree_bits is not None

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
        masks = self.structured.bitmask(rows, firsts, at) if self.structured is not None else None
        if masks is not None:  # structured outputs: only what each grammar allows next
            allowed = apply_token_bitmask(allowed, *masks)
        tokens = {}
        if plain:
            picked = sample(allowed[[firsts[i] for i in plain]], [rows[i].params for i in plain],
                            [rows[i].generator for i in plain])
            tokens.update({i: [t] for i, t in zip(plain, picked.tolist())})
        emit_rows = {}  # a tree's emitted tokens come from the rows of its accepted path
        for i, seq in enumerate(rows):
            if seq.spec_tree is not None:
                tokens[i], emit_rows[i] = self._verify_tree(seq, allowed[firsts[i]:firsts[i] + 1 + len(seq.spec_tree)])
            elif seq.spec_token_ids:
                tokens[i] = self._verify(seq, allowed[firsts[i]:firsts[i] + 1 + len(seq.spec_token_ids)])
        for i, seq in enumerate(rows):
            emitted = tokens[i]
            info = [None] * len(emitted)
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                at_rows = [firsts[i] + r for r in emit_rows.get(i, range(len(emitted)))]
                chosen, ranks, top_v, top_i = top_logprobs(
                    logits[torch.tensor(at_rows, device=logits.device)],
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
        return self.rejection_sampler(probs, seq.spec_draft_probs, drafts, seq.generator,
                                      greedy=seq.params.greedy)

    def _verify_tree(self, seq: Sequence, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """A draft tree's check (llmopt/layers/tree_sampler.py): the emitted tokens and the rows
        they were drawn from; the accepted path's KV is queued to move into place."""
        tree = seq.spec_tree
        emitted, path = tree_rejection_sample(sampling_probs(logits, seq.params), tree.tokens, tree.parents,
                                              seq.generator, greedy=seq.params.greedy)
        src, dst = accepted_slot_moves(self.bm.block_tables[seq.request_id], seq.num_tokens, path,
                                       self.bm.block_size)
        self.last_slot_moves[0].extend(src)
        self.last_slot_moves[1].extend(dst)
        return emitted, [0] + [1 + node for node in path]
