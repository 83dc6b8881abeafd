"""A ZMQ subscriber for the KV events vLLM publishes (test support, not shipped).

vLLM's publisher (``--kv-events-config`` / ``LLM(kv_events_config=...)`` with ``"publisher": "zmq"``)
binds an ``ipc://`` endpoint and sends PUB frames ``(topic, sequence, msgpack KVEventBatch)``; a
subscriber connects to it. ZMQ drops what is published before a subscriber is connected, so connect
before the first request and give the subscription a moment to reach the publisher
(:meth:`KVEventSubscriber.settle`).

Threading: one thread (the test's or the harness's) owns a subscriber.
"""

from __future__ import annotations

import time


class KVEventSubscriber:
    """Collects the KV events published on ``endpoint`` (which vLLM binds)."""

    def __init__(self, endpoint: str):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self.events: list = []

    def settle(self, seconds: float = 1.0) -> None:
        """Wait for the subscription to reach the publisher (nothing is published meanwhile)."""
        self.drain(seconds)

    def drain(self, seconds: float) -> list:
        """Receive for ``seconds``; returns every event received so far."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._socket.poll(int(left * 1000)):
                self._receive()
        return self.events

    def drain_until_quiet(self, quiet_s: float = 1.0, limit_s: float = 30.0) -> list:
        """Receive until nothing has come for ``quiet_s`` (at most ``limit_s``); returns the events
        received by this call. (``quiet_s`` is how late a publisher thread may be on a loaded
        machine: what comes later is lost to this call, and an event check fails.)"""
        start = len(self.events)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and self._socket.poll(int(quiet_s * 1000)):
            self._receive()
        return self.events[start:]

    def _receive(self) -> None:
        _topic, _seq, payload = self._socket.recv_multipart()
        self.events.extend(self._decoder.decode(payload).events)

    def close(self) -> None:
        self._socket.close(linger=0)


def as_json(event) -> dict:
    """One event as plain JSON: its type name and fields (hashes as ints or hex strings)."""
    import msgspec

    fields = {name: getattr(event, name) for name in event.__struct_fields__}
    fields = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in fields.items()}
    if "block_hashes" in fields:
        fields["block_hashes"] = [h.hex() if isinstance(h, bytes) else h for h in fields["block_hashes"]]
    if isinstance(fields.get("parent_block_hash"), bytes):
        fields["parent_block_hash"] = fields["parent_block_hash"].hex()
    return {"type": type(event).__name__, **msgspec.to_builtins(fields)}
