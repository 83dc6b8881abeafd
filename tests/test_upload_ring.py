"""The page-locked ring a staged job's numbers are uploaded from (``kvtier.copy.lanes.CudaLanes``):
an upload reads the ring's words when the device gets to it, not when it is issued, so no word may
be written again before every upload that reads it ran. The ring records one event per eighth of
a pass and at each wrap (not one per job), and queries them only when a job needs words ahead of
the ones known free.

The device here runs nothing until told to: each upload's copy is queued on its stream with the
bytes its source held when issued, and the test checks, as each copy runs, that its source still
holds them. Streams run in arbitrary interleavings; an event completes once its stream ran past
its latest record.
"""

from __future__ import annotations

import ctypes
import itertools
import random

import numpy as np
import torch
from host_device import HostDevice, host_streams

from kvtier.copy.lanes import CudaLanes
from kvtier.copy.staged_runs import Lane


class DeferredDevice(HostDevice):
    """Copies and event records queue on their stream; :meth:`run` executes a stream's queue."""

    def __init__(self):
        super().__init__()
        self.queues: dict[int, list] = {}
        self.marks = itertools.count()
        self.latest: dict[int, int] = {}  # event -> its latest record's mark
        self.ran: set[int] = set()  # marks executed
        self.copies_run = 0

    def memcpy(self, dst, src, size, stream):
        self._call("memcpy")
        self.queues.setdefault(stream, []).append(("copy", dst, src, size, ctypes.string_at(src, size)))

    def event_record(self, event, stream):
        mark = next(self.marks)
        self.latest[event] = mark
        self.queues.setdefault(stream, []).append(("mark", mark))

    def event_query(self, event):
        return self.latest.get(event) in self.ran

    def run(self, stream, count=None):
        queue = self.queues.get(stream, [])
        todo, self.queues[stream] = queue[:count], queue[len(queue[:count]):]
        for item in todo:
            if item[0] == "mark":
                self.ran.add(item[1])
                continue
            _, dst, src, size, issued = item
            assert ctypes.string_at(src, size) == issued, "a ring word was written again before its upload ran"
            ctypes.memmove(dst, src, size)
            self.copies_run += 1


def lanes_on(device: DeferredDevice, monkeypatch, ring_words: int) -> CudaLanes:
    monkeypatch.setattr(CudaLanes, "UPLOAD_RING_BYTES", 8 * ring_words)
    streams = host_streams(device)
    side = streams.new_stream()
    streams.prepare_staging(side, torch.zeros(2, 8, dtype=torch.int64))
    return streams._lanes[side.cuda_stream]


def test_no_ring_word_is_written_again_before_its_upload_ran(monkeypatch):
    device = DeferredDevice()
    lanes = lanes_on(device, monkeypatch, ring_words=64)
    handles = {Lane.KERNEL: lanes._kernel, Lane.TRANSFER: lanes._transfer}
    pick = random.Random(7)
    fallbacks = wraps = 0
    head = 0
    for job in range(600):
        count = pick.randint(1, 24)
        parts = (np.arange(count, dtype=np.int64) + 1000 * job,)
        lane = pick.choice(list(Lane))
        lanes._reserve(count)
        before = device.calls["memcpy"]
        lanes._upload(parts, lane)
        if device.calls["memcpy"] == before:  # no room in the ring: its own page-locked buffer
            fallbacks += 1
            assert torch.equal(lanes._index[:count], torch.from_numpy(parts[0]))
        wraps += lanes._ring_head < head
        head = lanes._ring_head
        if pick.random() < 0.6:  # the device catches up on some of one stream's work
            stream = handles[pick.choice(list(Lane))]
            device.run(stream, pick.randint(0, 16))
    for stream in handles.values():
        device.run(stream)
    assert wraps > 20 and fallbacks > 0 and device.copies_run > 300, (wraps, fallbacks, device.copies_run)


def test_events_are_recorded_per_fence_not_per_job_and_queried_only_at_need(monkeypatch):
    device = DeferredDevice()
    lanes = lanes_on(device, monkeypatch, ring_words=800)
    records, queries = [], []
    device.event_record = _counting(device.event_record, records)
    device.event_query = _counting(device.event_query, queries)
    for job in range(10):  # 10 x 10 words: a fence every 100 words (an eighth of the ring)
        lanes._reserve(10)
        lanes._upload((np.full(10, job, dtype=np.int64),), Lane.TRANSFER)
    assert len(records) == 1 and not queries
    device.run(lanes._transfer)
    for job in range(80):  # over the wrap: the first pass's fences are queried there, all done
        lanes._reserve(10)
        lanes._upload((np.full(10, job, dtype=np.int64),), Lane.TRANSFER)
        device.run(lanes._transfer)
    assert 8 <= len(records) <= 10 and 0 < len(queries) <= 10


def _counting(call, into: list):
    def counted(*args):
        into.append(args)
        return call(*args)
    return counted
