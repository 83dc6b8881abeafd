"""The Redis tier's monitor thread: brings the tier back after an outage, and keeps its usage.

One daemon thread, ``kvtier-redis-monitor`` (background priority), per tier:

- Recovery: while the circuit breaker is open, once its back-off has passed it runs ONE trial
  (:meth:`~kvtier.tiers.redis.client.RedisClient.connect`: build the client if start-up could
  not, reload a cluster's topology, PING every server). Success stores the namespace's config
  key again (the server may have restarted empty) and closes the breaker; failure doubles the
  back-off (1 s up to 30 s). The caller's thread never waits for any of this.
- Usage: every ``usage_interval`` seconds (and right after recovery) ``INFO memory`` on every
  server, posted for :meth:`~kvtier.tiers.redis.RedisTier.poll` to apply (``used_memory``,
  ``maxmemory``).

Threading: its own thread; talks to the rest of the tier only through the thread-safe breaker
and client and the ``post`` callback (the completion queue).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.core.priority import become_background_thread
from kvtier.core.values import ConfigError
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.redis.client import RedisClient
from kvtier.tiers.redis.errors import describe, is_connection_failure
from kvtier.tiers.redis.jobs import MSG_USAGE

logger = logging.getLogger(__name__)

USAGE_INTERVAL = 5.0
"""Seconds between two ``INFO memory`` refreshes."""


class Monitor:
    """The recovery and usage loop of one tier (see the module docstring)."""

    def __init__(
        self,
        *,
        client: RedisClient,
        breaker: CircuitBreaker,
        post: Callable[[list[tuple]], None],
        on_recovered: Callable[[], None],
        usage_interval: float = USAGE_INTERVAL,
    ) -> None:
        self._client = client
        self._breaker = breaker
        self._post = post
        self._on_recovered = on_recovered
        self._usage_interval = usage_interval
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-redis-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Re-check now (the breaker just opened)."""
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stop and wait for the thread (at most one trial or INFO: their exchanges' deadlines),
        at most ``timeout`` seconds (None: as long as it runs; the thread is a daemon)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        become_background_thread()
        next_usage = 0.0
        while not self._stop.is_set():
            try:
                self._wake.clear()  # a wake() from here on ends the wait below at once
                now = time.monotonic()
                if self._breaker.closed and now >= next_usage:
                    next_usage = now + self._usage_interval
                    self._refresh_usage()
                if self._breaker.begin_trial() and self._trial():
                    next_usage = 0.0
                    continue
                retry_at = self._breaker.retry_at()
                wait = next_usage - time.monotonic() if self._breaker.closed else 0.1
                if retry_at is not None:
                    wait = retry_at - time.monotonic()
                self._wake.wait(min(max(wait, 0.01), self._usage_interval))
            except Exception:  # never let the loop die: the tier could not recover any more
                logger.exception("kvtier redis: monitor loop failed")
                self._stop.wait(1.0)

    def _trial(self) -> bool:
        """HALF_OPEN: connect and PING; on success run ``on_recovered`` (re-store the namespace
        key) BEFORE closing the breaker, so that a closed breaker implies it is stored."""
        try:
            self._client.connect()
            ok = True
        except ConfigError as exc:  # e.g. the password was rotated under us
            logger.error("kvtier redis: reconnecting failed: %s", exc)
            ok = False
        except Exception as exc:
            logger.debug("kvtier redis: reconnect trial failed: %s", describe(exc))
            ok = False
        if ok:
            try:
                self._on_recovered()
            except Exception as exc:
                logger.warning("kvtier redis: after reconnecting: %s", describe(exc))
        self._breaker.end_trial(ok)
        if ok:
            logger.warning(
                "kvtier redis: %s answers again; the Redis tier is back on",
                self._client.config.redacted_url(),
            )
        else:
            logger.debug("kvtier redis: next reconnect trial in %.0f s", self._breaker.backoff)
        return ok

    def _refresh_usage(self) -> None:
        try:
            used, capacity = self._client.info_memory()
        except Exception as exc:
            logger.debug("kvtier redis: INFO memory failed: %s", describe(exc))
            if is_connection_failure(exc):
                self._breaker.failure()
            return
        self._post([(MSG_USAGE, used, capacity)])
