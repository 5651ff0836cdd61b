"""One engine, many HTTP clients: the engine loop runs in a background thread.

The engine is not thread-safe, and a step must not block the event loop that serves the
HTTP connections. So the engine lives in a thread of its own, which repeats:

    admit the requests that arrived since the last step   (continuous batching:
    drop the requests whose clients went away               requests join and leave
    run one step                                            between any two steps)
    hand each request's new output to the client waiting for it

Each client waits on an asyncio queue; the engine thread puts outputs into it with
`loop.call_soon_threadsafe`. Outputs are cumulative (all tokens so far), so a client that
falls behind skips to the newest. A client that leaves (disconnect, cancel) aborts its
request, which frees its KV blocks at the next turn of the loop. Admission control
(admission.py) runs here too: a request is refused while the waiting queue is full, and one
past its deadline is aborted. No request stops the loop:
one that makes a step raise ends with finish_reason "error" (the engine isolates it), and
should a step raise outside that, the requests in the engine fail and the loop goes on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

from llmopt.config import EngineConfig
from llmopt.engine.llm_engine import LLMEngine, ProcessedPrompt
from llmopt.outputs import RequestOutput
from llmopt.sampling_params import SamplingParams
from llmopt.server.admission import AdmissionControl, DeadlineExceeded, remaining
from llmopt.server.metrics import ServerMetrics


class EngineUnavailable(RuntimeError):
    """The engine takes no new requests: it is shutting down, or its thread has died."""


class RequestFailed(RuntimeError):
    """The engine raised while running this request (an HTTP 500 for it alone)."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, served_model_name: str | None = None,
                 admission: AdmissionControl | None = None):
        from llmopt.model.loader import load_tokenizer

        self.admission = admission or AdmissionControl()
        self.engine = LLMEngine(config)
        self.model_name = served_model_name or config.model
        # The front end's own tokenizer: the engine thread decodes with the engine's at the
        # same time, and one Rust tokenizer must not be used from two threads at once.
        self.tokenizer = load_tokenizer(config.tokenizer or self.engine.model_path)
        self.metrics = ServerMetrics(self.model_name)
        self.metrics.on_queue_time = self.admission.observe_queue_time
        self.metrics.record_engine(self.engine.get_metrics())
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._new: list[tuple] = []       # (request_id, text, token ids, params, priority, arrival)
        self._aborts: list[str] = []
        self._engine_waiting = 0          # in the engine's waiting queue, as of the engine thread's last look
        self._engine_running = 0          # in its running batch, likewise
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.accepting = True
        self.error: BaseException | None = None   # set if the engine thread died
        self._thread = threading.Thread(target=self._run, name="llmopt-engine", daemon=True)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- the event loop's side ----------------------------------------------------------------
    def check(self, text: str | None, token_ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks (prompt length, vocabulary, KV pool), run before admission;
        they read only fixed sizes, so they are safe to call outside the engine thread.

        Unlike `LLM.generate`, which stops at max_model_len with finish_reason "length", a request
        whose prompt and max_tokens together pass max_model_len is refused, as vLLM's server does."""
        self.engine.validate_prompt({"prompt_token_ids": token_ids, "prompt": text}, 0)
        n, limit = len(token_ids), self.max_model_len
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens, and the request asks "
                             f"for {n + params.max_tokens}: {n} in the prompt and {params.max_tokens} to "
                             f"generate ({params.max_tokens} > {limit} - {n}); lower the maximum or shorten "
                             "the prompt")
        self.engine.validate_request(token_ids, params, 0)

    async def generate(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                       priority: int = 0, arrival_time: float | None = None,
                       timeout: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after each step it takes part in; the last one
        has `finished=True`. Leaving early (break, cancel, an exception) aborts the request.

        Raises Overloaded (before anything is queued) when the waiting queue is full, and
        DeadlineExceeded when the request is not done `timeout` seconds (capped by the
        server's --request-timeout) after it arrived."""
        if not self.accepting or not self.healthy:
            raise EngineUnavailable("the server is shutting down" if self.error is None
                                    else f"the engine failed: {self.error!r}")
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        limit = self.admission.timeout(timeout)
        deadline = None if limit is None else arrival + limit
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:  # the count and the append together: two requests cannot both take the last place
            # Those the running batch has room for start at the next step: only the rest will wait.
            free = max(0, self.engine.config.max_num_seqs - self._engine_running)
            self.admission.check(max(0, len(self._new) + self._engine_waiting - free))
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._new.append((request_id, text, token_ids, params, priority, arrival))
        self._wake.set()
        finished = False
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(queue.get(), remaining(deadline))
                except TimeoutError:
                    self.metrics.timed_out()
                    raise DeadlineExceeded(f"the request did not finish within its deadline of {limit:g} s "
                                           "(X-Request-Timeout, capped by --request-timeout) and was aborted") from None
                while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
                    item = queue.get_nowait()  # outputs are cumulative: the newest says it all
                if isinstance(item, BaseException):
                    raise item
                if item.finished and item.outputs[0].finish_reason == "error":
                    raise RequestFailed(f"the engine failed on this request: {type(item.error).__name__}: "
                                        f"{item.error}") from item.error
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every request in flight; each client gets its output with finish_reason "abort"."""
        for rid in list(self._streams):
            self.abort(rid)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still queued or running, and stop the engine thread."""
        self.accepting = False
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wake.clear()  # before reading the inbox: a later set() is never lost
                with self._lock:
                    new, self._new = self._new, []
                    aborts, self._aborts = self._aborts, []
                    stopping = self._stopping
                    self._engine_waiting += len(new)  # they join the engine's waiting queue next
                for rid, text, ids, params, priority, arrival in new:
                    try:
                        # checked by `check` on arrival: admitted as it is, not checked again
                        engine.add_request(rid, ProcessedPrompt(text, ids, params), arrival_time=arrival,
                                           priority=priority)
                    except Exception as e:  # one bad request must not stop the loop
                        self._deliver(rid, e)
                for rid in aborts:
                    self._abort_now(rid)
                if stopping:
                    for rid in list(engine.requests):
                        self._abort_now(rid)
                    self._record_engine()
                    return
                if not engine.has_unfinished_requests():
                    self._record_engine()
                    self._wake.wait()
                    continue
                try:
                    outputs = engine.step()
                except Exception as e:
                    outputs = self._fail_everything(e)
                for out in outputs:
                    self._deliver(out.request_id, out)
                self.metrics.record_outputs(outputs)
                self._record_engine()
        except BaseException as e:  # a failed step leaves the engine in an unknown state
            self.error = e
            self.accepting = False
            for rid in list(self._streams):
                self._deliver(rid, EngineUnavailable(f"the engine failed: {e!r}"))
            raise

    def _record_engine(self) -> None:
        m = self.engine.get_metrics()
        with self._lock:
            self._engine_waiting = int(m["num_requests_waiting"])
            self._engine_running = int(m["num_requests_running"])
        self.metrics.record_engine(m)

    def _fail_everything(self, error: Exception) -> list[RequestOutput]:
        """A step raised outside the engine's per-request isolation (in its bookkeeping), so
        its state is in doubt: every request in it fails, freeing every block, and the loop goes
        on with an empty engine. A client whose request finished inside the failed step lost its
        output with it: it gets the error too."""
        outputs = [self.engine.fail_request(rid, error) for rid in list(self.engine.requests)]
        with self._lock:
            not_admitted = {r[0] for r in self._new}
        told = {out.request_id for out in outputs}
        for rid in list(self._streams.copy()):
            if rid not in told and rid not in not_admitted:
                self._deliver(rid, RequestFailed(f"the engine failed: {type(error).__name__}: {error}"))
        return outputs

    def _abort_now(self, rid: str) -> None:
        """Abort in the engine (its blocks go back to the pool); tell a client still waiting."""
        seq = self.engine.requests.get(rid)
        if seq is None:
            return  # finished in the meantime, or never admitted
        self.engine.abort_request(rid)
        seq.finalize_text(self.engine.detokenizer)
        self.metrics.finished(rid, "abort", seq.metrics)
        self._deliver(rid, seq.to_output())

    def _deliver(self, rid: str, item) -> None:
        entry = self._streams.get(rid)
        if entry is None:
            return  # the client has left
        loop, queue = entry
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: the server is gone
