"""The pool mapping a client makes: its pages mapped in by a background thread, stopped by close()."""

from __future__ import annotations

import ctypes
import os

import pytest

from kvtier.node.pool import PoolMapping, create_pool_fd

POOL = 96 << 20


def resident_bytes(mapping: PoolMapping) -> int:
    """This process's resident bytes in ``mapping`` (its page-table entries), from /proc/self/smaps."""
    anchor = ctypes.c_char.from_buffer(mapping.view)
    start = ctypes.addressof(anchor)
    del anchor
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= start < high
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found in /proc/self/smaps")


@pytest.fixture
def pool_fd():
    fd = create_pool_fd(POOL)
    yield fd
    os.close(fd)


def test_a_client_mapping_is_populated_in_the_background(pool_fd):
    mapping = PoolMapping(pool_fd, POOL, 4096, 4096)
    try:
        assert mapping.wait_populated(30)
        assert resident_bytes(mapping) == POOL, "every page of the pool mapped in without being touched"
    finally:
        mapping.close()


def test_without_populate_pages_fault_in_on_first_touch(pool_fd):
    mapping = PoolMapping(pool_fd, POOL, 4096, 4096, populate=False)
    try:
        assert mapping.wait_populated(0) and resident_bytes(mapping) < POOL // 8
    finally:
        mapping.close()


def test_close_stops_the_population_early(pool_fd):
    mapping = PoolMapping(pool_fd, POOL, 4096, 4096)
    mapping.close()  # waits for at most one step; the mapping is gone after
    assert mapping.wait_populated(0)
