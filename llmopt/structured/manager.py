"""The engine's side of structured outputs: vLLM's `StructuredOutputManager`.

A constrained request waits here, outside the scheduler, until its grammar has compiled in a
worker thread (llmopt/structured/compiler.py): the other requests keep running meanwhile. Once
ready it joins the scheduler with a matcher of its own. Then, each step:

1. before sampling, the engine computes the batch bitmask (`bitmask`) and hands it to the
   runner, whose sampler masks the disallowed tokens to -inf before temperature, top-k and top-p;
2. after sampling, every token the engine appends moves the request's matcher (`accept`);
3. where the grammar then forces a continuation, jump-forward appends it (`jump_forward`),
   and a grammar that can only end finishes the request without spending a step on EOS.
"""

from __future__ import annotations

import time

from llmopt.structured.compiler import GrammarCompiler
from llmopt.structured.jump_forward import jump_forward_tokens
from llmopt.structured.matcher import RequestGrammar, batch_bitmask

PENDING_WAIT_S = 0.02  # how long a step with nothing else to run waits for a compile


class GrammarDeadEnd(ValueError):
    """The constraint reached a state where no token is allowed: a bad request (HTTP 400)."""


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_model_len: int,
                 enable_jump_forward: bool = True):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.stop_token_ids = set(stop_token_ids)
        self.enable_jump_forward = enable_jump_forward
        self._compiler: GrammarCompiler | None = None
        self.pending: list = []  # (sequence, future of its compiled grammar), in arrival order
        self.stats = {"structured_requests": 0, "structured_jump_forward_tokens": 0,
                      "structured_jump_forward_steps_saved": 0, "structured_jump_forward_retokenized": 0,
                      "structured_eos_steps_saved": 0, "structured_mask_seconds": 0.0,
                      "structured_mask_rows": 0}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._compiler

    # -- admission -------------------------------------------------------------------------------
    def check(self, params, index) -> None:
        """The combinations a grammar cannot serve, refused before any work."""
        so = params.structured_outputs
        if so is None:
            return
        if params.ignore_eos:
            raise ValueError(f"request {index}: ignore_eos cannot be combined with structured_outputs "
                             "(the grammar decides where the output ends)")
        if params.min_tokens:
            raise ValueError(f"request {index}: min_tokens cannot be combined with structured_outputs "
                             "(holding EOS back could leave the grammar no token to allow)")

    def compile(self, params, name: str = "structured_outputs"):
        """Compile now (in a worker thread, waiting at most the compile limit): a ValueError
        naming `name` and the compiler's message if the constraint does not compile."""
        if params.structured_outputs is not None:
            return self.compiler.compile(params.structured_outputs, name)
        return None

    def add(self, seq) -> None:
        """A new constrained request waits until its grammar is compiled."""
        self.stats["structured_requests"] += 1
        self.pending.append((seq, self.compiler.submit(seq.params.structured_outputs)))

    def remove(self, seq) -> None:
        self.pending = [(s, f) for s, f in self.pending if s is not seq]

    def admit_ready(self, wait: bool) -> list[tuple]:
        """The waiting requests whose grammar is settled, as (sequence, error): error None, its
        grammar ready and any forced opening text appended (`jump_forward`; a request that
        reached max_tokens on it alone is already finished); else why it cannot run (the grammar
        did not compile, or not in time). The engine schedules, finishes or fails them; the
        rest keep waiting. `wait`: nothing else can run, so block briefly for the oldest compile."""
        if not self.pending:
            return []
        if wait and not any(f.done() for _, f in self.pending):
            try:
                self.pending[0][1].exception(timeout=PENDING_WAIT_S)
            except TimeoutError:
                pass
        settled, still = [], []
        for seq, f in self.pending:
            if not f.done() and time.perf_counter() - seq.metrics.arrival_time > self.compiler.timeout_s:
                settled.append((seq, ValueError(
                    f"structured_outputs did not compile within {self.compiler.timeout_s:g} s")))
            elif not f.done():
                still.append((seq, f))
            elif f.exception() is not None:
                settled.append((seq, f.exception()))
            else:
                seq.grammar = RequestGrammar(f.result(), self.stop_token_ids, self.vocab_size)
                if self.enable_jump_forward:  # a grammar that opens with forced text: it joins the prefill
                    self.jump_forward(seq, time.perf_counter())
                settled.append((seq, None))
        self.pending = still
        return settled

    # -- each step ----------------------------------------------------------------------------------
    def bitmask(self, rows):
        """The step's bitmask for the sequences that sample, in the runner's row order
        (ModelRunner.sampling_rows: each sequence's 1 + drafts logits rows, one after another):
        (bitmask, the rows it covers), or None when none is constrained (see
        matcher.batch_bitmask). Timed for the metrics."""
        start = time.perf_counter()
        firsts = [0]
        for seq in rows:
            firsts.append(firsts[-1] + 1 + len(seq.spec_token_ids))
        out = batch_bitmask(rows, firsts[:-1], firsts[-1], self.vocab_size)
        if out is not None:
            self.stats["structured_mask_seconds"] += time.perf_counter() - start
            self.stats["structured_mask_rows"] += len(out[1])
        return out

    def accept(self, seq, token_id: int) -> bool:
        """The engine appended `token_id`: move the matcher. A refusal would be a bug, not bad
        input: that request alone ends with finish_reason "error"."""
        if seq.grammar.accept(token_id):
            return True
        if not seq.grammar.allows_a_token():
            # bad input, not a bug: the spec leads where nothing may follow (the regex
            # "a[^\s\S]" after its "a"); xgrammar cannot tell at compile time
            seq.error = GrammarDeadEnd(
                f"structured_outputs allows no token after the {len(seq.output_token_ids)} tokens generated "
                "so far: the constraint can never be completed (an empty character class or "
                "contradictory schema?)")
        else:
            seq.error = RuntimeError(f"the grammar refused token {token_id} that the engine appended")
        seq.finish("error", None)
        return False

    def jump_forward(self, seq, now: float) -> int:
        """Append what the grammar forces after the request's newest token (see jump_forward.py),
        each token checked for stops as a sampled one is; end the request where only EOS remains.
        Returns how many output tokens that added (a re-encoded last token counts -1 then +1)."""
        g = seq.grammar
        if g is None or seq.is_finished or g.is_terminated:
            return 0
        added = 0
        if self.enable_jump_forward:
            # the newest token's KV is computed in the next step: it may still be re-encoded
            replaceable = (seq.num_computed_tokens == seq.num_tokens - 1 and seq.params.logprobs is None
                           and bool(seq.output_token_ids))
            last = seq.output_token_ids[-1] if seq.output_token_ids else None
            tokens, replaced = jump_forward_tokens(g, self.tokenizer, last, replaceable)
            if replaced:
                seq.output_token_ids.pop()
                seq.metrics.token_times.pop()
                added -= 1
                self.stats["structured_jump_forward_retokenized"] += 1
            room = self.max_model_len - len(seq)
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - len(seq.output_token_ids))
            appended = 0
            for token in tokens[:max(room, 0)]:
                g.accept(token)
                g.forced_positions.append(len(seq.output_token_ids))
                seq.append_token(token, now)
                appended += 1
                seq.check_stop(self.stop_token_ids, self.max_model_len, self.tokenizer)
                if seq.is_finished:
                    break
            added += appended
            self.stats["structured_jump_forward_tokens"] += appended
            # a re-encoded boundary token replaces one that was sampled: that one saved nothing
            self.stats["structured_jump_forward_steps_saved"] += max(0, appended - replaced)
        if not seq.is_finished and g.only_stop_allowed():
            eos = self.tokenizer.eos_token_id
            eos = eos if eos in self.stop_token_ids else min(self.stop_token_ids)
            g.accept(eos)
            seq.append_token(eos, now)
            added += 1
            seq.check_stop(self.stop_token_ids, self.max_model_len, self.tokenizer)
            self.stats["structured_eos_steps_saved"] += 1
        return added

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
