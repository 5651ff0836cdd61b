"""Jump-forward decoding (SGLang): where the grammar allows exactly one continuation, append it.

After `{"name": ` in a schema whose next key is fixed, the grammar forces text (a key, a quote,
punctuation) that sampling would take one decode step per token to produce. Jump-forward asks
the matcher for the forced string and appends its tokens at once; the next step computes their
KV together, like a short prefill, and samples after them. On a CPU, where a SmolLM2 decode
step costs tens of milliseconds, every forced token skipped is that much time saved.

The tokens must be the ones the tokenizer would produce, or the model sees a segmentation it
never saw in training. Two places can differ, and both are handled here:

1. Inside the forced text: xgrammar segments it by greedy longest match and holds back its
   last token whenever a longer vocabulary entry could extend it (`"` may become `",` once
   the model chooses), so the jump does not end inside what the tokenizer would merge. The
   text up to there is re-encoded with the model's tokenizer, and that segmentation is used.
2. At the boundary with the last sampled token: `"` sampled, then `name` forced, may be one
   token `"name` to the tokenizer. That last token's KV is not computed yet (it is computed
   in the next step together with the jump), so it is re-encoded with the forced text and
   replaced, as SGLang's retokenization does; the text is unchanged. Counted in
   `structured_jump_forward_retokenized`.
"""

from __future__ import annotations


def jump_forward_tokens(grammar, tokenizer, last_token: int | None, can_replace_last: bool):
    """(tokens to append, whether the last token is replaced by the first of them) for the
    forced continuation; ([], False) when nothing is forced."""
    forced = grammar.matcher.find_jump_forward_tokens()
    if not forced:
        return [], False
    text = tokenizer.decode(forced)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if tokens != forced and not _accepts(grammar, tokens):
        tokens = forced  # the tokenizer's segmentation leaves the grammar (not seen): keep xgrammar's
    if last_token is None or not can_replace_last:
        return tokens, False
    last_text = tokenizer.decode([last_token])
    if "\ufffd" in last_text or last_token in grammar.stop_token_ids:
        return tokens, False  # half a UTF-8 character: no text to re-encode it from
    joint = tokenizer.encode(last_text + text, add_special_tokens=False)
    if joint == [last_token] + tokens or tokenizer.decode(joint) != last_text + text:
        return tokens, False
    grammar.rollback(1)
    if _accepts(grammar, joint):
        return joint, True
    grammar.accept(last_token)  # the merged tokens leave the grammar: keep the sampled token
    return tokens, False


def _accepts(grammar, tokens: list[int]) -> bool:
    """Whether the matcher accepts all of `tokens` from where it is; its state is unchanged."""
    m, n = grammar.matcher, 0
    for t in tokens:
        if not m.accept_token(t):
            break
        n += 1
    if n:
        m.rollback(n)
    return n == len(tokens)
