"""The circuit breaker of a tier behind a server (Redis, S3): stop asking a server that does not answer.

States: CLOSED (normal) -> OPEN after ``threshold`` consecutive failed requests or batches (a
connection refused, reset or timed out; a server that answers with an error is NOT a failure) ->
after a back-off, the tier's monitor thread runs one trial (Redis: a PING; S3: one LIST page):
HALF_OPEN while it runs -> CLOSED if it succeeds, OPEN again with the back-off doubled if not.
The back-off starts at ``base_backoff`` (1 s) and doubles up to ``max_backoff`` (the tier entry's
``reconnect_max_s``, 30 s by default); closing resets it.

While the breaker is not CLOSED the tier answers from memory without waiting for anyone:
presence is ABSENT (a miss), reads and probes fail at once, writes are dropped. Requests that
were already running when it opened fail by themselves within ``timeout_s``; their failures
(and late successes) no longer change the state: only the trial does.

Threading: thread-safe. Worker threads report outcomes (:meth:`success`, :meth:`failure`), the
monitor thread runs trials (:meth:`begin_trial`, :meth:`end_trial`), the caller's thread reads
:attr:`closed` (a plain attribute read, no lock) and :attr:`generation`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure breaker with an exponential back-off between trials."""

    def __init__(
        self,
        *,
        threshold: int = 3,
        base_backoff: float = 1.0,
        max_backoff: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_open: Callable[[], None] | None = None,
    ) -> None:
        if threshold < 1 or base_backoff <= 0 or max_backoff < base_backoff:
            raise ValueError("need threshold >= 1 and 0 < base_backoff <= max_backoff")
        self._threshold = threshold
        self._base = base_backoff
        self._max = max_backoff
        self._clock = clock
        self.on_open = on_open
        """Called (outside the lock, on the thread that opened it) each time it opens."""
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._backoff = base_backoff
        self._retry_at = 0.0
        self.closed = True
        """True while CLOSED (read without a lock by the caller's thread)."""
        self.opens = 0
        """How many times it opened (a running total)."""
        self.generation = 0
        """Bumped on every change between CLOSED and not CLOSED."""

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def threshold(self) -> int:
        """Consecutive failures that open the breaker."""
        return self._threshold

    @property
    def backoff(self) -> float:
        """The current wait between trials (seconds)."""
        return self._backoff

    def success(self) -> None:
        """A batch got answers from the server."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                self._failures = 0

    def failure(self) -> bool:
        """A batch failed to reach the server. Returns True if this opened the breaker."""
        with self._lock:
            if self._state is not BreakerState.CLOSED:
                return False
            self._failures += 1
            if self._failures < self._threshold:
                return False
            self._open_locked(self._base)
        if self.on_open is not None:
            self.on_open()
        return True

    def trip(self) -> None:
        """Open now (the server was unreachable at start-up)."""
        with self._lock:
            if self._state is not BreakerState.CLOSED:
                return
            self._open_locked(self._base)
        if self.on_open is not None:
            self.on_open()

    def retry_at(self) -> float | None:
        """When the next trial is due (``clock`` time), or None when CLOSED or a trial runs."""
        with self._lock:
            return self._retry_at if self._state is BreakerState.OPEN else None

    def begin_trial(self) -> bool:
        """OPEN and due: go HALF_OPEN and return True (the caller then runs a trial and calls
        :meth:`end_trial`). Otherwise False."""
        with self._lock:
            if self._state is not BreakerState.OPEN or self._clock() < self._retry_at:
                return False
            self._state = BreakerState.HALF_OPEN
            return True

    def end_trial(self, ok: bool) -> None:
        """The trial's outcome: close (and reset the back-off), or open again (doubled back-off)."""
        with self._lock:
            if self._state is not BreakerState.HALF_OPEN:
                return
            if ok:
                self._state = BreakerState.CLOSED
                self._failures = 0
                self._backoff = self._base
                self.closed = True
                self.generation += 1
            else:
                self._backoff = min(self._backoff * 2, self._max)
                self._state = BreakerState.OPEN
                self._retry_at = self._clock() + self._backoff

    def _open_locked(self, backoff: float) -> None:
        self._state = BreakerState.OPEN
        self._backoff = backoff
        self._retry_at = self._clock() + backoff
        self._failures = 0
        self.closed = False
        self.opens += 1
        self.generation += 1
