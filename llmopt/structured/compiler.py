"""Compile a constraint into a token-level grammar once, off the engine's step loop, and cache it.

xgrammar (vLLM's and SGLang's default backend) turns a JSON schema, regex, choice list or EBNF
grammar into a pushdown automaton over the model's vocabulary, with the masks of context-free
tokens precomputed. Compiling takes milliseconds for a real schema and can take seconds for a
large one, so it runs in worker threads: the engine keeps stepping the other requests while a
new request's grammar compiles. Results are cached by the constraint's key (its canonical text),
so a schema that every request of an API shares is compiled once. A compile is bounded three
ways: the size checks in params.py before it starts, a wall-clock limit on waiting for it, and
a limit on the compiled grammar's memory.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from llmopt.structured.matcher import RequestGrammar
from llmopt.structured.params import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0               # a request whose grammar is not ready by then is refused
MAX_GRAMMAR_BYTES = 64 * 2**20         # one compiled grammar (its precomputed masks, mostly)
CACHE_BYTES = 512 * 2**20              # all cached grammars together, least recently used out
NUM_COMPILE_THREADS = 2                # one slow compile does not hold up every other


class GrammarCompileError(ValueError):
    """The constraint does not compile, or compiling it broke a limit: a bad request (HTTP 400)."""


class GrammarCompiler:
    """Compiled grammars by key, each compiled once in a worker thread (xgrammar underneath)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, timeout_s: float = COMPILE_TIMEOUT_S,
                 max_grammar_bytes: int = MAX_GRAMMAR_BYTES, cache_bytes: int = CACHE_BYTES):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout_s, self.max_grammar_bytes, self.cache_bytes = timeout_s, max_grammar_bytes, cache_bytes
        self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="llmopt-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._refused: dict[tuple, str] = {}  # keys that timed out: refused at once from then on
        self._backend = None
        self._backend_lock = threading.Lock()
        self.num_compiles = 0
        self.compile_seconds = 0.0

    def backend(self):
        """xgrammar's compiler for this tokenizer, built on first use (reading a 49k-token
        vocabulary takes ~0.5 s, which an engine that never constrains should not pay)."""
        with self._backend_lock:
            if self._backend is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                # one thread per compile: the cores belong to the model's forward passes
                self._backend = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._backend

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar for `params` as a future: cached, in flight, or started now."""
        key = params.key
        with self._lock:
            if key in self._refused:
                f = Future()
                f.set_exception(GrammarCompileError(self._refused[key]))
                return f
            f = self._cache.get(key)
            if f is not None:
                self._cache.move_to_end(key)
                return f
            f = self._pool.submit(self._compile, params)
            self._cache[key] = f
        # Outside the lock: a compile that has already finished (a bad spec fails in microseconds)
        # runs its callback right here, and _settle takes the lock: inside it, this thread waited
        # for itself forever.
        f.add_done_callback(lambda done, key=key: self._settle(key, done))
        return f

    def compile(self, params: StructuredOutputsParams, name: str = "structured_outputs"):
        """Wait for the compiled grammar (at most timeout_s); GrammarCompileError naming `name`
        and the compiler's message if it does not compile or takes too long."""
        f = self.submit(params)
        try:
            return f.result(timeout=self.timeout_s)
        except FutureTimeout:
            msg = (f"{name}.{params.kind} did not compile within {self.timeout_s:g} s and is refused; "
                   "simplify it (fewer alternatives, shallower nesting, smaller repetition counts)")
            with self._lock:
                self._refused[params.key] = msg
                self._cache.pop(params.key, None)
            raise GrammarCompileError(msg) from None
        except GrammarCompileError as e:
            raise GrammarCompileError(str(e).replace("structured_outputs", name, 1)) from None

    def _compile(self, params: StructuredOutputsParams):
        import time

        start = time.perf_counter()
        xgc = self.backend()
        kind, spec, compact = params.key
        try:
            if kind == "json":
                compiled = xgc.compile_json_schema(spec, any_whitespace=not compact, strict_mode=True)
            elif kind == "json_object":  # any object: strict mode would forbid every property
                compiled = xgc.compile_json_schema('{"type": "object"}', any_whitespace=not compact,
                                                   strict_mode=False)
            elif kind == "regex":
                compiled = xgc.compile_regex(spec)
            elif kind == "choice":
                compiled = xgc.compile_grammar(choice_grammar(json.loads(spec)))
            else:
                compiled = xgc.compile_grammar(spec)
        except Exception as e:  # xgrammar reports a bad spec as RuntimeError with its parser's message
            raise GrammarCompileError(f"structured_outputs.{kind} does not compile: {_first_line(e)}") from None
        self.compile_seconds += time.perf_counter() - start
        self.num_compiles += 1
        size = compiled.memory_size_bytes
        if size > self.max_grammar_bytes:
            raise GrammarCompileError(f"structured_outputs.{kind} compiles to {size / 2**20:.0f} MiB, over the "
                                      f"limit of {self.max_grammar_bytes / 2**20:.0f} MiB; simplify it")
        # A spec that matches nothing (the regex "[^\s\S]") compiles, and then its request
        # failed in a step (HTTP 500) when the sampler found no token allowed: refused here.
        if not RequestGrammar(compiled, self.stop_token_ids, self.vocab_size).allows_a_token():
            raise GrammarCompileError(f"structured_outputs.{kind} matches no text at all (not even an "
                                      "empty output): no token may start it")
        return compiled

    def _settle(self, key: tuple, done: Future) -> None:
        """A finished compile: forget a failure (a fixed spec with the same text cannot exist, but
        the cache should hold grammars, not errors) and keep the cache within its byte budget."""
        with self._lock:
            if done.exception() is not None:
                if self._cache.get(key) is done:
                    del self._cache[key]
                return
            total = 0
            for k in list(reversed(self._cache)):  # newest first; evict the oldest beyond the budget
                f = self._cache[k]
                if f.done() and f.exception() is None:
                    total += f.result().memory_size_bytes
                    if total > self.cache_bytes and k != key:
                        del self._cache[k]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices: list[str]) -> str:
    """`choice` as EBNF: one alternative per string (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(e: Exception) -> str:
    """The compiler's message without its log prefix ("[18:01:13] /project/cpp/x.cc:94: ")."""
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
