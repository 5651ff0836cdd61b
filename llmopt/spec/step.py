"""The engine's side of a speculative step: how many drafts each sequence may take, and what
the verification kept (the engine's `_propose` and `_process` call these).

A sequence drafts only when it is decoding (its prompt fully computed) and only as many
tokens as a fully accepted run could still emit: k + 1 tokens may come back (the drafts and
the bonus), so k stops one short of max_tokens and of the model's length.
"""

from __future__ import annotations

from llmopt.sequence import Sequence


def new_spec_stats(num_spec_tokens: int) -> dict:
    return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
            "accepted_per_position": [0] * num_spec_tokens}


def draft_length(seq: Sequence, num_spec_tokens: int, max_model_len: int) -> int:
    """How many drafts `seq` may take this step (0: it decodes plainly)."""
    if seq.num_computed_tokens != seq.num_tokens - 1:
        return 0  # still prefilling
    room = max_model_len - len(seq) - 1
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
    return max(0, min(num_spec_tokens, room))


def count_verified(spec_stats: dict, seq: Sequence, n: int, emitted: list[tuple]) -> dict:
    """k drafts were computed in the step's n tokens; only the accepted ones (len(emitted) - 1)
    stay valid: `seq` advances over those, the counts go into `spec_stats`. Returns the step's
    record of the drafts and what was emitted (for the engine's trace)."""
    drafts, accepted = list(seq.spec_token_ids), len(emitted) - 1
    seq.num_computed_tokens += n - len(drafts) + accepted
    st = spec_stats
    st["num_drafts"] += 1
    st["num_draft_tokens"] += len(drafts)
    st["num_accepted_tokens"] += accepted
    st["accepted_per_position"][:accepted] = [c + 1 for c in st["accepted_per_position"][:accepted]]
    return {"draft_token_ids": drafts, "emitted_token_ids": [t for t, _ in emitted]}
