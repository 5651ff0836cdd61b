"""The model runner: turns a scheduled step into one flat forward pass, and samples.

All new tokens of all scheduled sequences (whole prompts, prompt chunks, single decode
tokens) go through the model together as one flat batch. Only sequences whose step
reaches their last known token produce logits and a new token; a prompt chunk that
stops short of its end just fills the cache.

How the forward runs is the step backend's business (`StepBackend` below), chosen once by
`choose_step_backend` (llmopt/worker/backends.py) when the engine is built: eager torch, the
compiled CPU step, or CUDA graphs.

This is the one-process executor the engine calls (`execute`); with tensor or pipeline
parallelism, llmopt.distributed's `ParallelModelRunner` is the same runner with the forward
done by the ranks, and may keep several micro-batches in flight (`submit`, then `collect`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.layers.attention import AttentionMetadata, host_to_device, slots_of
from llmopt.layers import sampler_cpu
from llmopt.layers.sampler import hold_back_stop_tokens, top_logprobs
from llmopt.sequence import Sequence
from llmopt.spec.draft_tree import accepted_slot_moves, add_tree_layout, move_slots
from llmopt.spec.rejection_sampler import rejection_sample
from llmopt.spec.tree_sampler import tree_rejection_sample
from llmopt.structured.bitmask import apply_token_bitmask
from llmopt.worker.kv_cache import PagedKVCache


class StepBackend:
    """How the engine's steps run, chosen once when it is built (llmopt/worker/backends.py).
    `forward(input_ids, meta)`: hidden states [num_tokens, hidden] of the step `meta`;
    `compute_logits(hidden)`: the model's head over them; `sampler`: the module whose `sample`
    and `sampling_probs` turn them into tokens (llmopt/layers/sampler.py, plain, or its CPU
    tricks, llmopt/layers/sampler_cpu.py); `path`: what `LLMEngine.decode_path` reports. This
    base runs the model eagerly, op by op: the reference the others are tested against
    (CompiledDecode, GraphedDecode), and the forward they fall back to for a step they cannot
    take. With enforce_eager=True the pool's attention and the sampler are plain torch too."""

    sampler = sampler_cpu

    def __init__(self, model, kv_cache, reason: str = "chosen by the caller", sampler=None):
        self.model, self.kv_cache = model, kv_cache
        self.path = f"eager ({reason})"
        if sampler is not None:
            self.sampler = sampler

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, meta, self.kv_cache)  # (a paged pool needs no begin_step)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def decode_tokens(self, input_ids: torch.Tensor, meta: AttentionMetadata, params: list,
                      generators: list) -> torch.Tensor:
        """A decode step that ends in its tokens: one new token per sequence in, each sequence's
        next token out, drawn by `sampler` under params[i] with generators[i], as a tensor left
        on the device (a backend may make the whole step one call: GraphedDecode)."""
        return self.sampler.sample(self.compute_logits(self.forward(input_ids, meta)), params, generators)


@dataclass
class StepOutput:
    """What one step gives back. `sampled`: request_id -> [(token, logprob info or None), ...]
    for every sequence that produced tokens (one, or with speculation the accepted drafts plus
    one more). The rest is for a proposer that drafts from the target's own work (EAGLE):
    the step's hidden states, the slot each token's KV went to, and where the accepted paths
    of draft trees were moved (source slots, destination slots)."""

    sampled: dict[str, list[tuple]]
    hidden: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    slot_moves: tuple[list[int], list[int]] = ((), ())


@dataclass
class DeviceStep:
    """A decode step launched with its tokens left where they were sampled (`tokens`, [B] on the
    device), one row per sequence of `seqs`; `sampled()` reads them back as StepOutput.sampled
    does. On a GPU their copy to `host` (pinned) is queued right behind the step, and `ready`
    marks its end, so reading waits for this step only, not for one queued after it
    (llmopt/engine/overlap.py queues the next first)."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    host: torch.Tensor
    ready: object = None  # a torch.cuda.Event, or None where `host` is `tokens` (the CPU)

    def sampled(self) -> dict[str, list[tuple]]:
        if self.ready is not None:
            self.ready.synchronize()
        return {seq.request_id: [(t, None)] for seq, t in zip(self.seqs, self.host.tolist())}


class ModelRunner:
    """Runs the steps the engine schedules. Everything a step needs comes with the call: the
    scheduled sequences, their block tables (request_id -> blocks) and, for structured
    outputs, the grammars' bitmask over the rows that sample (the engine's
    StructuredOutputManager.bitmask); nothing is read back from the engine."""

    max_in_flight = 1  # steps that may be submitted before the first is collected
    # The pieces lessons 02, 05 and 13 let a learner replace (llmopt.exercises): each token's
    # cache slot, the speculative verifier, and the grammar's mask on the logits.
    slots_of = staticmethod(slots_of)
    rejection_sampler = staticmethod(rejection_sample)
    apply_token_bitmask = staticmethod(apply_token_bitmask)

    def __init__(self, model, kv_cache: PagedKVCache, block_size: int, device,
                 eos_token_ids: set[int] = frozenset()):
        self.model, self.kv_cache, self.block_size, self.device = model, kv_cache, block_size, device
        self.eos_token_ids = eos_token_ids  # held back until min_tokens, with stop_token_ids
        self.backend = StepBackend(model, kv_cache)  # the engine sets the one it chose (choose_step_backend)
        self.keep_hidden = False  # True: every step returns its hidden states (an EAGLE head reads them)

    def step_inputs(self, scheduled: list[tuple[Sequence, int]], block_tables: dict[str, list[int]]):
        """The step as plain lists: new token ids (flat), each sequence's start position,
        new-token count and block table."""
        ids, starts, lens, tables = [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids += (seq.token_ids + seq.spec_token_ids)[start:start + n]
            starts.append(start)
            lens.append(n)
            tables.append(block_tables[seq.request_id])
        return ids, starts, lens, tables

    def prepare(self, scheduled: list[tuple[Sequence, int]],
                block_tables: dict[str, list[int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's flat token ids and its attention metadata, built once."""
        ids, starts, lens, tables = self.step_inputs(scheduled, block_tables)
        meta = AttentionMetadata.paged(tables, starts, lens, self.block_size, self.device, self.slots_of)
        trees = [seq.spec_tree for seq, _ in scheduled]
        if any(tree is not None for tree in trees):  # draft trees: their positions and masks
            add_tree_layout(meta, trees)
        return torch.tensor(ids, device=self.device), meta

    def decodes_on_device(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether the step is one `launch` can run: every sequence decodes one token and samples
        it plainly (no drafts, grammar, log-probabilities or min_tokens to hold stop tokens for),
        and nothing asks for the step's hidden states (`keep_hidden`: an EAGLE head does)."""
        return not self.keep_hidden and bool(scheduled) and all(
            n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens and not seq.spec_token_ids
            and seq.spec_tree is None and seq.grammar is None and seq.params.logprobs is None
            and seq.params.min_tokens <= len(seq.output_token_ids) for seq, n in scheduled)

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], block_tables: dict[str, list[int]],
               after: DeviceStep | None = None) -> DeviceStep:
        """Queue a decode step of `seqs` (`decodes_on_device`) and return without reading its
        tokens. Each sequence's input is its last token; with `after`, the token `after` sampled
        for it, still on the device and not yet in the sequence: this step is queued behind that
        one before the host has seen its result (the overlap, llmopt/engine/overlap.py)."""
        if after is None:
            starts = [seq.num_tokens - 1 for seq in seqs]
            input_ids = host_to_device([seq.token_ids[-1] for seq in seqs], torch.long, self.device)
        else:
            starts = [seq.num_tokens for seq in seqs]
            row = {seq.request_id: i for i, seq in enumerate(after.seqs)}
            index = [row[seq.request_id] for seq in seqs]
            input_ids = after.tokens if index == list(range(len(after.seqs))) else \
                after.tokens[host_to_device(index, torch.long, self.device)]
        meta = AttentionMetadata.paged([block_tables[seq.request_id] for seq in seqs], starts, [1] * len(seqs),
                                       self.block_size, self.device, self.slots_of)
        tokens = self.backend.decode_tokens(input_ids, meta, [s.params for s in seqs], [s.generator for s in seqs])
        if not tokens.is_cuda:
            return DeviceStep(seqs, tokens, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)  # queued behind the step; `ready` marks its end
        ready = torch.cuda.Event()
        ready.record()
        return DeviceStep(seqs, tokens, host, ready)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], block_tables: dict[str, list[int]],
                grammar_bitmask=None) -> StepOutput:
        """Run one step (see StepOutput)."""
        if grammar_bitmask is None and self.decodes_on_device(scheduled):
            return StepOutput(self.launch([seq for seq, _ in scheduled], block_tables).sampled())
        input_ids, meta = self.prepare(scheduled, block_tables)
        hidden = self.backend.forward(input_ids, meta)
        out = StepOutput({}, hidden, meta.slot_mapping, ([], []))
        rows, index = self.sampling_rows(scheduled)
        if rows:
            logits = self.backend.compute_logits(hidden[torch.tensor(index, device=hidden.device)])
            out.sampled = self.sample(rows, logits, grammar_bitmask, block_tables, out.slot_moves)
        if out.slot_moves[0]:
            move_slots(self.kv_cache, *out.slot_moves)
        return out

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

    def sample(self, rows: list[Sequence], logits: torch.Tensor, grammar_bitmask=None,
               block_tables: dict[str, list[int]] | None = None,
               slot_moves: tuple[list[int], list[int]] | None = None) -> dict[str, list[tuple]]:
        """Tokens (and logprobs) for every sampling row, from its logits. `grammar_bitmask`:
        (bitmask, the logits rows it covers) for structured outputs, or None; a draft tree's
        accepted path is looked up in `block_tables` and its KV moves added to `slot_moves`."""
        out, at = {}, 0
        slot_moves = ([], []) if slot_moves is None else slot_moves
        plain = [i for i, s in enumerate(rows) if not s.spec_token_ids]
        firsts = []
        for seq in rows:
            firsts.append(at)
            at += 1 + len(seq.spec_token_ids)
        # draws come from `allowed` (stop tokens held back below min_tokens); logprobs from `logits`
        allowed = logits
        if any(s.params.min_tokens > len(s.output_token_ids) for s in rows):
            allowed = hold_back_stop_tokens(logits, [(f, 1 + len(s.spec_token_ids), s.params, len(s.output_token_ids))
                                                     for f, s in zip(firsts, rows)], self.eos_token_ids)
        if grammar_bitmask is not None:  # structured outputs: only what each grammar allows next
            allowed = self.apply_token_bitmask(allowed, *grammar_bitmask)
        tokens = {}
        if plain:
            picked = self.backend.sampler.sample(allowed[[firsts[i] for i in plain]], [rows[i].params for i in plain],
                            [rows[i].generator for i in plain])
            tokens.update({i: [t] for i, t in zip(plain, picked.tolist())})
        emit_rows = {}  # a tree's emitted tokens come from the rows of its accepted path
        for i, seq in enumerate(rows):
            if seq.spec_tree is not None:
                tokens[i], emit_rows[i] = self._verify_tree(seq, allowed[firsts[i]:firsts[i] + 1 + len(seq.spec_tree)],
                                                            block_tables[seq.request_id], slot_moves)
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
        probs = self.backend.sampler.sampling_probs(logits, seq.params)
        drafts = torch.tensor(seq.spec_token_ids, device=logits.device)
        return self.rejection_sampler(probs, seq.spec_draft_probs, drafts, seq.generator,
                                      greedy=seq.params.greedy)

    def _verify_tree(self, seq: Sequence, logits: torch.Tensor, table: list[int],
                     slot_moves: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
        """A draft tree's check (llmopt/spec/tree_sampler.py): the emitted tokens and the rows
        they were drawn from; the accepted path's KV is queued in `slot_moves` to move into place."""
        tree = seq.spec_tree
        emitted, path = tree_rejection_sample(self.backend.sampler.sampling_probs(logits, seq.params), tree.tokens, tree.parents,
                                              seq.generator, greedy=seq.params.greedy)
        src, dst = accepted_slot_moves(table, seq.num_tokens, path, self.block_size)
        slot_moves[0].extend(src)
        slot_moves[1].extend(dst)
        return emitted, [0] + [1 + node for node in path]
