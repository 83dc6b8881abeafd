"""Host-tier shared-memory regions across real processes: a dead engine's leftover region never
blocks a restart nor gets mapped; a live one of the same name is a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.tiers.shm import RegionInUseError, SharedRegion

SIZE = 1 << 20


def start_creator(directory: Path, name: str) -> subprocess.Popen:
    """A real process that creates and publishes the region, says so, then lives until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from kvtier.tiers.shm import RegionInUseError, SharedRegion
        region = SharedRegion.create({name!r}, {SIZE}, Path({str(directory)!r}))
        region.view[:4] = b"dead"
        region.publish(b"old engine")
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_leftover_region_of_a_killed_engine_is_replaced_and_never_attached(tmp_path):
    creator = start_creator(tmp_path, "kvtier-e-r0")
    creator.send_signal(signal.SIGKILL)
    creator.wait()
    leftover = tmp_path / "kvtier-e-r0"
    assert leftover.exists()  # killed before any scheduler attached and unlinked it

    # A scheduler that starts first waits for the live worker instead of mapping the dead slots.
    with pytest.raises(TimeoutError):
        SharedRegion.attach("kvtier-e-r0", SIZE, tmp_path, timeout_s=0.3)

    region = SharedRegion.create("kvtier-e-r0", SIZE, tmp_path)  # the restarted worker: no failure
    try:
        assert bytes(region.view[:4]) == b"\0\0\0\0"  # a fresh region, not the dead one's bytes
        region.publish(b"new engine")
        other = SharedRegion.attach("kvtier-e-r0", SIZE, tmp_path, timeout_s=5)
        assert other.description == b"new engine"
        other.close()
    finally:
        region.unlink()
        region.close()


def test_a_live_region_of_the_same_name_is_a_clear_error(tmp_path):
    creator = start_creator(tmp_path, "kvtier-e-r0")
    try:
        with pytest.raises(RegionInUseError, match="same kv_transfer_config.engine_id"):
            SharedRegion.create("kvtier-e-r0", SIZE, tmp_path)
        attached = SharedRegion.attach("kvtier-e-r0", SIZE, tmp_path, timeout_s=5)  # live: mapped
        assert attached.description == b"old engine"
        assert bytes(attached.view[:4]) == b"dead"
        attached.close()
    finally:
        creator.kill()
        creator.wait()
    assert (tmp_path / "kvtier-e-r0").exists()


def test_closing_the_creator_releases_the_name(tmp_path):
    region = SharedRegion.create("kvtier-x-r0", SIZE, tmp_path)
    region.close()  # the owner went away without unlinking (as at a crash)
    again = SharedRegion.create("kvtier-x-r0", SIZE, tmp_path)
    again.unlink()
    again.close()
    assert not any(tmp_path.iterdir())
    assert os.listdir(tmp_path) == []
