"""Streaming text out of a growing list of token ids, a few characters at a time.

A token is not a character: a byte-level BPE token can hold half of a UTF-8 character,
and decoding the ids so far then ends in a replacement character '\ufffd' that the next
token completes. So text is released only when it decodes cleanly, and each step decodes
only a short window (the tokens since the last clean cut, as vLLM's detokenizer does),
not the whole output again. With stop strings the last few characters are held back too:
they could still turn out to be the start of a stop string, which is never sent.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.hold_back = max((len(s) for s in stop or []), default=1) - 1
        self.text = ""          # every character decoded so far
        self.num_sent = 0       # characters already handed out
        self.prefix_offset = 0  # token ids[prefix_offset:read_offset] decode to text's tail
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_ids: list[int], final_text: str | None = None) -> str:
        """The new text to send after the output grew to `token_ids`.

        `final_text` is the engine's text of a finished request (cut at a stop string if one
        matched): everything of it not sent yet goes out, nothing is held back.
        """
        if final_text is not None:
            delta = final_text[self.num_sent:]
            self.text, self.num_sent = final_text, len(final_text)
            return delta
        if len(token_ids) > self.read_offset:
            before = self._decode(token_ids[self.prefix_offset:self.read_offset])
            after = self._decode(token_ids[self.prefix_offset:])
            # a trailing '\ufffd' is an unfinished character: wait for the next token
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        ready = len(self.text) - self.hold_back
        if ready <= self.num_sent:
            return ""
        delta = self.text[self.num_sent:ready]
        self.num_sent = ready
        return delta
