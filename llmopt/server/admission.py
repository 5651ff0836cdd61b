"""Admission control: what a replica does when more work arrives than it can serve.

Without a bound, an overloaded server queues every request it gets: the queue, and each
request's wait, grows for as long as the overload lasts, clients time out on requests the
server will still spend compute on, and a load balancer cannot tell a busy replica from an
idle one. Two limits turn that into fast, explicit answers:

1. a bound on the requests waiting for admission (`--max-waiting-requests`; those the running
   batch has free places for do not count, as they start at the next step): past it a new
   request is refused at once with 503 and a `Retry-After` header, so that a load balancer
   tries another replica and a client backs off instead of piling on. The header's value is
   how long requests have recently waited in the queue (at least 1 s): by then, about one
   queue's worth of work has been served;
2. a deadline per request (`--request-timeout`, or shorter for one request with its
   `X-Request-Timeout` header): a request not finished that many seconds after it arrived is
   aborted and its KV blocks freed. One that had produced no token yet
   is answered 504; a stream that had started ends with finish_reason "abort" and an error event.

vLLM bounds its queue only by memory and leaves deadlines to the client; operators put
both in front of it (a proxy's queue limit and timeouts). Here they sit in the replica, where
the queue length is known exactly.
"""

from __future__ import annotations

import math
import time
from collections import deque


class Overloaded(RuntimeError):
    """The waiting queue is full: the request is refused (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(RuntimeError):
    """The request did not finish within its deadline and was aborted (HTTP 504)."""


class AdmissionControl:
    """The two limits, and the recent queue times that size Retry-After."""

    RECENT = 64  # requests whose queue time Retry-After is computed from

    def __init__(self, max_waiting_requests: int | None = None, request_timeout: float | None = None):
        if max_waiting_requests is not None and (isinstance(max_waiting_requests, bool)
                                                 or not isinstance(max_waiting_requests, int)
                                                 or max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests must be an integer >= 1 or None (no bound), "
                             f"got {max_waiting_requests!r}")
        if request_timeout is not None and not (isinstance(request_timeout, (int, float))
                                                and 0 < request_timeout < math.inf):
            raise ValueError(f"request_timeout must be a number of seconds > 0 or None (no deadline), "
                             f"got {request_timeout!r}")
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout = request_timeout
        self._queue_times: deque[float] = deque(maxlen=self.RECENT)

    def check(self, num_waiting: int) -> None:
        """Refuse a new request if `num_waiting` requests already wait for a place in the running batch."""
        bound = self.max_waiting_requests
        if bound is not None and num_waiting >= bound:
            raise Overloaded(f"the server is overloaded: {num_waiting} requests are waiting (at most {bound}); "
                             f"retry after {self.retry_after()} s or on another replica", self.retry_after())

    def timeout(self, requested: float | None = None) -> float | None:
        """A request's time limit: the one it asked for, capped by the server's (None: none)."""
        limits = [t for t in (requested, self.request_timeout) if t is not None]
        return min(limits) if limits else None

    @staticmethod
    def parse_timeout(header: str | None) -> float | None:
        """The X-Request-Timeout header's value (seconds > 0), or ValueError naming it."""
        if header is None:
            return None
        try:
            value = float(header)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise ValueError(f"the X-Request-Timeout header must be a number of seconds > 0, got {header!r}")
        return value

    def observe_queue_time(self, seconds: float) -> None:
        self._queue_times.append(seconds)

    def retry_after(self) -> int:
        """Whole seconds (1 to 60): the mean time recent requests waited to be scheduled."""
        if not self._queue_times:
            return 1
        mean = sum(self._queue_times) / len(self._queue_times)
        return max(1, min(60, math.ceil(mean)))


def remaining(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (None: no deadline); never below 0."""
    return None if deadline is None else max(0.0, deadline - time.perf_counter())
