"""Prompt lookup (n-gram) proposals: no draft model, just the sequence's own history.

Code, documents and chat repeat themselves: if the last n tokens appeared earlier in the
sequence, guess that what followed them then follows them now. Try the longest n first
(`prompt_lookup_max` down to `prompt_lookup_min`) and take the most recent match, as
vLLM's n-gram proposer does.
"""

from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, prompt_lookup_min: int = 1,
                  prompt_lookup_max: int = 4) -> list[int]:
    """Up to k proposed tokens (fewer, or none, when no earlier n-gram matches)."""
    if not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                         f"({prompt_lookup_max})")
    n_tokens = len(token_ids)
    for n in range(min(prompt_lookup_max, n_tokens - 1), prompt_lookup_min - 1, -1):
        suffix = token_ids[n_tokens - n:]
        # the most recent earlier occurrence whose continuation we know
        for start in range(n_tokens - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                follow = token_ids[start + n:start + n + k]
                if follow:
                    return follow
    return []
