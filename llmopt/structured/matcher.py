"""A request's place in its grammar, and the allowed-token bitmask of a whole batch.

Each constrained request holds a matcher (xgrammar's pushdown automaton) that has accepted
exactly its output tokens so far. Before sampling, every constrained row of the step's logits
gets a bitmask of the tokens the grammar allows next: 1 bit per vocabulary entry, 32 to an
int32, as vLLM and SGLang lay it out. Stop tokens are allowed only where the grammar can end.

Speculative rows need one mask per draft position: the matcher accepts the drafts one by one,
filling the mask of each next position, then rolls them back. A draft the grammar refuses gets
probability zero under its position's mask, so the rejection sampler rejects it there; the
matcher only ever moves forward for real by the tokens the engine appends (`accept`), so the
rejected drafts never reach it. Preemption keeps the matcher: the recompute rebuilds KV for the
same tokens the matcher has already accepted.
"""

from __future__ import annotations

import torch

from llmopt.structured.bitmask import unpack_bitmask


class RequestGrammar:
    def __init__(self, compiled, stop_token_ids, vocab_size: int):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))
        self.stop_token_ids = set(stop_token_ids)
        self.num_accepted = 0
        self.forced_positions: list[int] = []  # output positions that jump-forward appended

    def accept(self, token_id: int) -> bool:
        ok = self.matcher.accept_token(token_id)
        self.num_accepted += ok
        return ok

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            self.num_accepted -= n

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] = the tokens allowed next (all of them once the grammar has terminated:
        the request stops at that EOS before such a row is used)."""
        if self.matcher.is_terminated():
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_with_drafts(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> None:
        """Rows first .. first + len(drafts): the mask at each draft position and after the last.
        Past the first draft the grammar refuses, rows allow everything: rejection stops there."""
        self.fill(bitmask, first)
        taken = 0
        for j, token in enumerate(drafts):
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                bitmask[first + j + 1:first + len(drafts) + 1] = -1
                break
            taken += 1
            self.fill(bitmask, first + j + 1)
        if taken:
            self.matcher.rollback(taken)

    def allows_a_token(self) -> bool:
        """Whether any token (a stop token included) may come next; a grammar that has ended
        is not stuck (the request stops at its stop token)."""
        if self.matcher.is_terminated():
            return True
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(mask, 0)
        return bool(unpack_bitmask(mask, self.vocab_size).any())

    def only_stop_allowed(self) -> bool:
        """Whether the grammar is complete and nothing but a stop token may follow."""
        if not self.matcher.is_completed() or self.matcher.is_terminated():
            return False
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(mask, 0)
        allowed = set(unpack_bitmask(mask, self.vocab_size)[0].nonzero().flatten().tolist())
        return allowed <= self.stop_token_ids


def batch_bitmask(rows, firsts: list[int], num_rows: int, vocab_size: int):
    """The step's bitmask for every constrained sequence among `rows` (sequence i's logits
    rows start at firsts[i], one more per draft) -> (int32 bitmask [R, W], the logits rows it
    covers), or None when no row is constrained (then xgrammar is never imported: an engine
    without structured requests runs without it)."""
    covered, fills = [], []
    for seq, first in zip(rows, firsts):
        if getattr(seq, "grammar", None) is not None:
            fills.append((seq, len(covered)))
            covered += range(first, first + 1 + len(seq.spec_token_ids))
    if not covered:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(covered), vocab_size)
    for seq, at in fills:
        seq.grammar.fill_with_drafts(bitmask, at, seq.spec_token_ids)
    return bitmask, covered
