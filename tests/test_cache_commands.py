"""``kvtier inspect | verify | purge`` against real files written by the real DiskTier (no mocks)."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import unreadable
from support.namespaces import toy_namespace
from support.store_files import settle_scan

from kvtier.cachetools import PurgeSelection, inspect_cache, parse_duration, purge_cache, verify_cache
from kvtier.cli.main import main
from kvtier.core.keys import Namespace
from kvtier.tiers.base import IoError, IoKind, IoResult
from kvtier.tiers.blockfile import HEADER_LEN, encode_header
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.layout import DiskLayout
from kvtier.tiers.disk.ledger import decode, ledger_path

PAYLOAD = 256
FILE_BYTES = HEADER_LEN + PAYLOAD
WORLD = 2
BLOCKS = {"smol": 6, "qwen": 4}
DAY = 86400.0


def make_namespace(layers: int) -> Namespace:
    return toy_namespace(layers=layers, kv_heads=3, head_size=64, block_tokens=16, kv_dtype="bfloat16", tp_size=WORLD)


NAMESPACES = {"smol": make_namespace(30), "qwen": make_namespace(28)}
MODEL_NAMES = {"smol": "SmolLM2-135M-Instruct", "qwen": "Qwen3-0.6B"}


def open_tier(root: Path, ns: Namespace, model_name: str) -> DiskTier:
    """A tier as the connector builds it (scheduler_side.py), on a small payload."""
    return DiskTier(
        root_dir=root, model_name=model_name, engine_digest=ns.digest,
        rank_digests=ns.rank_digests(), namespace_json=ns.config_json(model_name),
        payload_bytes=PAYLOAD, capacity_bytes=1 << 20, n_read_threads=1, n_write_threads=1, max_pending_writes=64,
    )


def wait(tier: DiskTier, n: int) -> list[IoResult]:
    results: list[IoResult] = []
    deadline = time.monotonic() + 30
    while len(results) < n:
        results += tier.poll()
        assert time.monotonic() < deadline, "disk tier jobs did not complete"
        time.sleep(0.001)
    return results


def key_of(name: str, i: int) -> bytes:
    return hashlib.sha256(f"{name}/{i}".encode()).digest()


def read(tier: DiskTier, key: bytes) -> IoResult:
    tier.submit_read(1, key, [memoryview(bytearray(PAYLOAD)) for _ in range(WORLD)])
    (result,) = wait(tier, 1)
    assert result.kind is IoKind.READ
    return result


@dataclass
class Cache:
    root: Path

    def layout(self, name: str) -> DiskLayout:
        ns = NAMESPACES[name]
        return DiskLayout(self.root, MODEL_NAMES[name], ns.digest, WORLD, 0)

    def prefix(self, name: str) -> str:
        return self.layout(name).prefix

    def path(self, name: str, i: int, rank: int = 0) -> Path:
        return Path(self.layout(name).path(key_of(name, i).hex(), rank))

    def age(self, name: str, i: int, seconds: float, ranks: tuple[int, ...] = (0, 1)) -> None:
        stamp = time.time() - seconds
        for rank in ranks:
            os.utime(self.path(name, i, rank), (stamp, stamp))

    def ledger_bytes(self, name: str) -> int:
        """The bytes the namespace's usage ledger charges."""
        with open(ledger_path(self.layout(name)), "rb") as f:
            return decode(f.read())[1]

    def block_bytes(self, name: str) -> int:
        """The bytes of the namespace's block files in their place (what its ledger must charge)."""
        layout = self.layout(name)
        return sum(os.path.getsize(p) for rank in range(WORLD) for p in Path(layout.rank_dirs[rank]).rglob("*.bin"))

    def files(self) -> dict[str, int]:
        """Every file under the root with its size (to check that nothing changed)."""
        return {str(p.relative_to(self.root)): p.stat().st_size for p in self.root.rglob("*") if p.is_file()}


@pytest.fixture
def cache(tmp_path: Path) -> Cache:
    """Two namespaces of two ranks, written through DiskTier; block i of each is i days old."""
    for name, count in BLOCKS.items():
        tier = open_tier(tmp_path, NAMESPACES[name], MODEL_NAMES[name])
        for i in range(count):
            sources = [memoryview(os.urandom(PAYLOAD)) for _ in range(WORLD)]
            assert tier.submit_write(i, key_of(name, i), NAMESPACES[name].digest, 16, sources)
        assert all(r.ok for r in wait(tier, count))
        tier.close()
    made = Cache(tmp_path)
    for name, count in BLOCKS.items():
        for i in range(count):
            made.age(name, i, i * DAY + 60)
    return made


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


# ---------------------------------------------------------------------------- inspect


def test_inspect_counts_bytes_ages_without_reading_blocks(cache: Cache, monkeypatch: pytest.MonkeyPatch) -> None:
    cache.path("smol", 5, rank=1).unlink()  # block 5: one rank missing -> incomplete
    cache.age("smol", 4, 40 * DAY, ranks=(0,))  # block 4: rank 1 still 4 days old -> the block is
    tmp = cache.path("qwen", 0).with_name(f"{key_of('qwen', 0).hex()}.bin.123.abcd.tmp")
    tmp.write_bytes(b"x" * 10)
    quarantined = Path(cache.layout("qwen").quarantine_path(key_of("qwen", 3).hex(), 1))
    quarantined.parent.mkdir()
    quarantined.write_bytes(b"q" * 100)
    real_open, real_os_open = builtins.open, os.open

    def no_blocks(opener):
        def guarded(path, *args, **kwargs):
            assert not str(path).endswith(".bin"), f"inspect opened block file {path}"
            return opener(path, *args, **kwargs)
        return guarded

    monkeypatch.setattr(builtins, "open", no_blocks(real_open))
    monkeypatch.setattr(os, "open", no_blocks(real_os_open))
    inventory = inspect_cache(cache.root)
    monkeypatch.undo()

    smol, qwen = sorted(inventory.namespaces, key=lambda ns: ns.model != "SmolLM2-135M-Instruct")
    assert (smol.prefix, qwen.prefix) == (cache.prefix("smol"), cache.prefix("qwen"))
    assert smol.digest16 == NAMESPACES["smol"].digest.hex()[:16] and smol.config_problem is None
    assert smol.layout == {"spec_version": "kvtier/2", "kv_dtype": "bfloat16", "num_layers": 30, "num_kv_heads": 3,
                           "head_size": 64, "block_tokens": 16, "engine_block_tokens": 16, "tp_size": 2,
                           "pp_size": 1, "attention_kind": "full_attention", "backends": ["CPU_ATTN"],
                           "weights": "blake3:0000000000000000", "dtype": "bfloat16"}
    assert not smol.older_spec
    assert (smol.complete_blocks, smol.incomplete_blocks, smol.block_files) == (5, 1, 11)
    assert smol.block_bytes == 11 * FILE_BYTES
    assert smol.ages == {"<1h": 1, "<1d": 0, "<7d": 5, "<30d": 0, "older": 0}  # days 0 | 1,2,3,4(r1),5
    assert qwen.ages == {"<1h": 1, "<1d": 0, "<7d": 3, "<30d": 0, "older": 0}
    assert abs(smol.last_use - (time.time() - 60)) < 5
    assert (qwen.complete_blocks, qwen.temp_files, qwen.temp_bytes) == (4, 1, 10)
    assert (qwen.quarantine_files, qwen.quarantine_bytes, smol.quarantine_files) == (1, 100, 0)
    assert (inventory.quarantine_files, inventory.strays) == (1, [])
    assert (smol.ledger_bytes, qwen.ledger_bytes) == (12 * FILE_BYTES, 8 * FILE_BYTES)  # as the tier charged

    cache.age("smol", 1, 100 * DAY)
    code, out = run("inspect", cache.root, "--json")
    data = json.loads(out)
    assert code == 0 and data["namespaces"][1]["ages"]["older"] == 1
    assert data["namespaces"][1]["complete_blocks"] == 5 and data["quarantine"] == {"files": 1, "bytes": 100}
    code, out = run("inspect", cache.root)
    assert code == 0
    for text in ("SmolLM2-135M-Instruct", "Qwen3-0.6B", smol.digest16, "+1 incomplete", "<30d", "1m ago"):
        assert text in out


# ---------------------------------------------------------------------------- verify


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_finds_and_quarantines_bad_files(cache: Cache) -> None:
    flip(cache.path("smol", 0), HEADER_LEN + 17)  # payload byte
    flip(cache.path("smol", 1, rank=1), 110)  # header byte
    os.truncate(cache.path("qwen", 2), FILE_BYTES - 5)
    misplaced = cache.path("qwen", 0).parent / f"{key_of('qwen', 3).hex()}.bin"  # in the wrong leaf directory
    misplaced.write_bytes(cache.path("qwen", 3).read_bytes())
    foreign = Path(cache.layout("smol").path(key_of("qwen", 1).hex(), 0))  # qwen's valid file, under smol
    wrong_key = Path(cache.layout("smol").path(key_of("qwen", 2).hex(), 0))  # smol's valid file, other name
    for path, source in ((foreign, cache.path("qwen", 1)), (wrong_key, cache.path("smol", 2))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(source.read_bytes())
    (cache.root / "notes.txt").write_text("not a cache file")
    bad = {cache.path("smol", 0): "payload checksum mismatch", cache.path("smol", 1, 1): "header checksum",
           cache.path("qwen", 2): f"file is {FILE_BYTES - 5} bytes", misplaced: "misplaced block file",
           foreign: "is not rank 0's", wrong_key: "does not match the file name"}

    before = cache.files()
    code, out = run("verify", cache.root, "--no-quarantine")
    assert code == 1 and cache.files() == before
    assert "BAD notes.txt" in out and out.count("left in place") == 7

    seen: list[tuple[int, int]] = []
    report = verify_cache(cache.root, progress=lambda done, total: seen.append((done, total)))
    problems = {Path(p.path): p for p in report.problems}
    assert set(problems) == {*bad, cache.root / "notes.txt"}
    for path, reason in bad.items():
        assert reason in problems[path].reason and problems[path].action == "quarantined"
        assert not path.exists()
    assert problems[cache.root / "notes.txt"].action == "left in place"
    assert (cache.root / "notes.txt").exists()
    assert seen[-1] == (23, 23) and len(seen) == 23  # every block-named file once
    assert report.files_ok == 2 * (6 + 4) - 3 and report.quarantined == 6
    names = sorted(os.listdir(cache.root / "quarantine"))
    expected = [cache.layout(name).quarantine_path(key_of(owner, i).hex(), rank)
                for name, owner, i, rank in (("qwen", "qwen", 2, 0), ("qwen", "qwen", 3, 0), ("smol", "qwen", 1, 0),
                                             ("smol", "qwen", 2, 0), ("smol", "smol", 0, 0), ("smol", "smol", 1, 1))]
    assert names == sorted(os.path.basename(p) for p in expected)  # the tier's own quarantine names

    code, out = run("verify", cache.root, "--namespace", "Qwen3-0.6B")
    assert code == 0 and "7 ok, no problems" in out
    code, out = run("verify", cache.root, "--json")
    assert code == 1 and [p["path"] for p in json.loads(out)["problems"]] == [str(cache.root / "notes.txt")]


def test_verify_flags_files_of_no_namespace(cache: Cache) -> None:
    os.unlink(cache.layout("qwen").ns_dir + "/config.json")
    os.truncate(cache.path("smol", 0, 1), 10)  # too short for a header
    code, out = run("verify", cache.root)
    assert code == 1
    assert "config.json missing: its 8 block files belong to no namespace (left in place)" in out
    assert "short header" in out and "19 ok" in out
    code, out = run("verify", cache.root, "--namespace", "nope")
    assert code == 2 and "matches 'nope'" in out


# ---------------------------------------------------------------------------- purge


@pytest.mark.parametrize("selector", [
    ["--namespace", "PREFIX"], ["--model", "Qwen3-0.6B"], ["--older-than", "2d"], ["--quarantine"], ["--all"],
])
def test_purge_dry_run_leaves_everything(cache: Cache, selector: list[str]) -> None:
    flip(cache.path("smol", 0), HEADER_LEN)
    verify_cache(cache.root)  # one file in quarantine
    before = cache.files()
    args = [cache.prefix("qwen") if a == "PREFIX" else a for a in selector]
    code, out = run("purge", cache.root, *args, "--dry-run")
    assert code == 0 and "dry run: would remove" in out and "nothing was deleted" in out
    assert cache.files() == before


def test_purge_by_namespace_and_model(cache: Cache) -> None:
    digest = NAMESPACES["qwen"].digest.hex()[:8]
    code, out = run("purge", cache.root, "--namespace", digest)
    assert code == 0
    assert f"removed 4 blocks, 8 files, {8 * FILE_BYTES / 1024:.1f} KiB; config.json removed" in out
    assert not any(p.name.startswith("Qwen3") for p in cache.root.iterdir())  # emptied dirs, ledger gone too
    assert len(cache.files()) == 1 + 12 + 1 + 1  # smol's config, blocks, index snapshot and ledger untouched
    code, out = run("purge", cache.root, "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--json")
    data = json.loads(out)
    assert code == 0 and data["files"] == 12 and data["bytes"] == 12 * FILE_BYTES
    assert data["namespaces"][0]["config_removed"] and cache.files() == {}


def test_purge_older_than_by_last_use(cache: Cache) -> None:
    cache.age("smol", 5, 60, ranks=(1,))  # read recently: the newest rank's mtime counts
    report = purge_cache(cache.root, PurgeSelection(older_than=parse_duration("2d12h")))
    removed = {ns.prefix: (ns.blocks, ns.files, ns.bytes, ns.config_removed) for ns in report.namespaces}
    assert removed == {cache.prefix("smol"): (2, 4, 4 * FILE_BYTES, False),  # blocks 3, 4 (5 was used)
                       cache.prefix("qwen"): (1, 2, 2 * FILE_BYTES, False)}  # block 3
    for name, gone in (("smol", {3, 4}), ("qwen", {3})):
        for i in range(BLOCKS[name]):
            assert cache.path(name, i).exists() is (i not in gone) and cache.path(name, i, 1).exists() is (i not in gone)
    code, out = run("inspect", cache.root, "--json")
    assert [ns["complete_blocks"] for ns in json.loads(out)["namespaces"]] == [3, 4]


def test_purge_quarantine_and_all(cache: Cache) -> None:
    flip(cache.path("smol", 0), HEADER_LEN)
    flip(cache.path("qwen", 0), HEADER_LEN)
    assert verify_cache(cache.root).quarantined == 2
    code, out = run("purge", cache.root, "--model", "Qwen3-0.6B", "--quarantine")  # its blocks and quarantine
    assert code == 0 and f"quarantine: removed 1 files, {FILE_BYTES} B" in out and "removed 4 blocks, 7 files" in out
    assert os.listdir(cache.root / "quarantine") == [os.path.basename(
        cache.layout("smol").quarantine_path(key_of("smol", 0).hex(), 0))]
    assert len(cache.files()) == 1 + 11 + 1 + 1 + 1  # smol: config, blocks, snapshot, ledger; 1 quarantined
    assert cache.ledger_bytes("smol") == cache.block_bytes("smol") == 11 * FILE_BYTES  # verify gave one back
    code, out = run("purge", cache.root, "--all")
    assert code == 0 and "removed 12 files" in out
    assert cache.files() == {} and os.listdir(cache.root) == ["quarantine"]


def test_purge_older_than_gives_the_bytes_back_to_the_ledger(cache: Cache) -> None:
    assert cache.ledger_bytes("smol") == cache.block_bytes("smol") == 2 * 6 * FILE_BYTES
    purge_cache(cache.root, PurgeSelection(older_than=parse_duration("2d12h")))
    assert cache.ledger_bytes("smol") == cache.block_bytes("smol") == 2 * 3 * FILE_BYTES
    assert cache.ledger_bytes("qwen") == cache.block_bytes("qwen") == 2 * 3 * FILE_BYTES


def test_purge_refuses_without_or_with_bad_selectors(cache: Cache) -> None:
    before = cache.files()
    for args in ([], ["--dry-run"], ["--all", "--model", "x"], ["--older-than", "7"], ["--model", "nope"]):
        code, out = run("purge", cache.root, *args)
        assert code == 2, (args, out)
    assert cache.files() == before
    assert parse_duration("30m") == 1800 and parse_duration("12h") == 12 * 3600 and parse_duration("1d12h") == 1.5 * DAY
    with pytest.raises(ValueError):
        parse_duration("7")


def test_purge_while_a_tier_is_open(cache: Cache) -> None:
    tier = open_tier(cache.root, NAMESPACES["smol"], MODEL_NAMES["smol"])
    try:
        settle_scan(tier)  # the start-up rescan: the rescan below must not be a no-op beside it
        key = key_of("smol", 2)
        assert tier.contains(key) and tier.usage().num_blocks == 6
        writer_tmp = cache.path("smol", 2).with_name(f"{key.hex()}.bin.{os.getpid()}.feed.tmp")
        writer_tmp.write_bytes(b"partial")  # a write in progress: never touched
        code, out = run("purge", cache.root, "--namespace", cache.prefix("smol"))
        assert code == 0 and "removed 6 blocks, 12 files" in out and "config.json" not in out
        # The room is there for the engines at once; a writer's temp file is charged too, if the
        # start-up rescan (in the background) counted it.
        assert cache.ledger_bytes("smol") in (0, FILE_BYTES)
        assert writer_tmp.read_bytes() == b"partial" and os.path.exists(cache.layout("smol").ns_dir + "/config.json")

        result = read(tier, key)  # still indexed: the read finds no file, a miss
        assert not result.ok and result.error is IoError.NOT_FOUND
        assert not tier.contains(key) and tier.stats.read_misses == 1
        tier.submit_write(9, key, NAMESPACES["smol"].digest, 16, [memoryview(b"z" * PAYLOAD)] * WORLD)
        assert wait(tier, 1)[0].ok  # the emptied directories are recreated
        assert read(tier, key).ok
        tier.rescan(wait=True)
        assert tier.usage().num_blocks == 1
    finally:
        tier.close()
    writer_tmp.unlink()
    code, out = run("purge", cache.root, "--namespace", cache.prefix("smol"))
    assert code == 0 and "removed 1 blocks, 2 files" in out and "config.json removed" in out


KVTIER1_CONFIG = {  # what a "kvtier/1" root's config.json held
    "attention_kind": "mha", "block_tokens": 128, "head_size": 64, "kv_dtype": "float32",
    "model_digest": "0" * 32, "model_name": "SmolLM2-135M-Instruct", "num_kv_heads": 3, "num_layers": 30,
    "page_format": "cpu:default", "pp_rank": 0, "pp_size": 1, "spec_version": "kvtier/1", "tp_rank": 0, "tp_size": 1,
}


def test_older_spec_roots_are_shown_and_purged(cache: Cache) -> None:
    """A root written by kvtier/1 is never read by this spec: inspect says so; purge --older-spec removes it."""
    old = DiskLayout(cache.root, "SmolLM2-135M-Instruct", bytes.fromhex("71b2536663476fda"), 1, 0)
    old.create(json.dumps(KVTIER1_CONFIG))
    hex_key = "ab" * 32
    path = Path(old.path(hex_key, 0))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * FILE_BYTES)
    inventory = inspect_cache(cache.root)
    (older,) = [ns for ns in inventory.namespaces if ns.prefix == old.prefix]
    assert older.older_spec and older.layout["spec_version"] == "kvtier/1" and older.complete_blocks == 1
    assert not any(ns.older_spec for ns in inventory.namespaces if ns.prefix != old.prefix)
    code, out = run("inspect", cache.root)
    assert code == 0 and "older key spec" in out
    code, out = run("purge", cache.root, "--older-spec", "--json")
    assert code == 0
    data = json.loads(out)
    assert [ns["prefix"] for ns in data["namespaces"]] == [old.prefix] and data["namespaces"][0]["config_removed"]
    assert not path.exists() and not os.path.exists(old.ns_dir)
    assert {ns.prefix for ns in inspect_cache(cache.root).namespaces} == {cache.prefix("smol"), cache.prefix("qwen")}


# ---------------------------------------------------------------------------- hostile and odd roots


def plant_record(cache: Cache, name: str, key: bytes, payload_len: int, digest: bytes | None = None) -> Path:
    """A rank-0 record of ``name`` with a valid header announcing ``payload_len`` bytes, as long as
    it says (sparse: costs nothing to make)."""
    path = Path(cache.layout(name).path(key.hex(), 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    namespace = digest if digest is not None else NAMESPACES[name].rank_digests()[0]
    with open(path, "wb") as f:
        f.write(encode_header(namespace=namespace, key=key, parent=bytes(32), num_tokens=16,
                              payload_len=payload_len, checksum=0))
        f.truncate(HEADER_LEN + payload_len)
    return path


def test_verify_leaves_a_namespace_with_a_mismatched_config_in_place(cache: Cache) -> None:
    """A config.json that does not match its directory (here: another namespace's, of one rank) is
    reported; the namespace's good blocks are not judged by it (none quarantined)."""
    config = Path(cache.layout("qwen").ns_dir) / "config.json"
    config.write_text(toy_namespace(layers=5, tp_size=1).config_json("Qwen3-0.6B"))
    before = cache.files()
    report = verify_cache(cache.root)
    assert [(p.path, p.action) for p in report.problems] == [(str(config), "left in place")]
    assert "does not match the directory name" in report.problems[0].reason
    assert report.files_ok == 2 * (6 + 4) and report.quarantined == 0
    assert cache.files() == before and not (cache.root / "quarantine").exists()
    code, out = run("verify", cache.root)
    assert code == 1 and "20 ok, 1 problem(s), 0 quarantined" in out


def test_verify_reads_no_payload_beyond_the_block_size(cache: Cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records whose header claims more than the namespace's blocks can hold are problems found
    without reading their payload: the bound comes from config.json, else the usage ledger, else
    a hard cap (then the record is only reported)."""
    read = [0]
    real_preadv = os.preadv

    def counted(fd: int, buffers: list, offset: int) -> int:
        n = real_preadv(fd, buffers, offset)
        read[0] += n
        assert read[0] < 64 << 20, "verify reads a payload beyond the namespace's block size"
        return n

    monkeypatch.setattr(os, "preadv", counted)
    huge = plant_record(cache, "qwen", b"\x01" * 32, 1 << 30)  # 1 GiB: a config.json bound
    report = verify_cache(cache.root, selectors=("Qwen3-0.6B",))
    (problem,) = report.problems
    assert problem.path == str(huge) and problem.action == "quarantined" and not huge.exists()
    assert "payload bytes of this namespace's records (config.json); not read" in problem.reason
    assert report.files_ok == 8 and read[0] == 8 * PAYLOAD

    os.unlink(Path(cache.layout("qwen").ns_dir) / "config.json")  # no config: the ledger's file size bounds it
    longer = plant_record(cache, "qwen", b"\x02" * 32, 4 * PAYLOAD)
    (problem,) = [p for p in verify_cache(cache.root, selectors=("Qwen3-0.6B",)).problems if p.path == str(longer)]
    assert f"more than the {PAYLOAD} payload bytes" in problem.reason and "(usage ledger)" in problem.reason
    assert problem.action == "quarantined" and not longer.exists()

    os.unlink(ledger_path(cache.layout("qwen")))  # neither: the hard cap; reported, left in place, unread
    beyond = plant_record(cache, "qwen", b"\x03" * 32, (1 << 30) + 1)
    (problem,) = [p for p in verify_cache(cache.root, selectors=("Qwen3-0.6B",)).problems if p.path == str(beyond)]
    assert "without the namespace's block size" in problem.reason and problem.action == "left in place"
    assert beyond.exists() and read[0] == 3 * 8 * PAYLOAD


def test_an_ambiguous_digest_prefix_is_refused(cache: Cache) -> None:
    digest = NAMESPACES["qwen"].digest.hex()
    twin = cache.root / f"Other_{digest[:4]}{'f' * 12}"  # another namespace whose digest starts alike
    twin.mkdir()
    before = cache.files()
    for command in (["purge", cache.root, "--namespace", digest[:4]], ["verify", cache.root, "--namespace", digest[:4]]):
        code, out = run(*command)
        assert code == 2 and "is ambiguous" in out and cache.prefix("qwen") in out and twin.name in out
    assert cache.files() == before
    code, out = run("purge", cache.root, "--namespace", digest[:8])  # more digits: one namespace
    assert code == 0 and "removed 4 blocks" in out and twin.exists()


def test_purge_counts_only_what_it_removed(cache: Cache) -> None:
    stuck = Path(cache.layout("smol").path("ab" * 32, 0))  # a directory where a block file should be
    stuck.mkdir(parents=True)
    (stuck / "x").write_text("x")
    code, out = run("purge", cache.root, "--namespace", cache.prefix("smol"), "--json")
    assert code == 1 and "1 file could not be removed" in out
    data = json.loads(out[: out.rindex("}") + 1])
    (smol,) = data["namespaces"]
    assert (smol["blocks"], smol["files"], smol["bytes"]) == (6, 12, 12 * FILE_BYTES)
    assert smol["errors"] == data["errors"] == 1 and smol["failed"] == [str(stuck)] and not smol["config_removed"]
    assert stuck.is_dir() and (Path(cache.layout("smol").ns_dir) / "config.json").exists()


def test_purge_removes_a_namespace_holding_only_its_snapshot(cache: Cache) -> None:
    snapshot = Path(cache.layout("qwen").ns_dir) / "index_g0.snapshot"
    lone = DiskLayout(cache.root, "Gone", bytes.fromhex("ab" * 32), 1, 0)
    os.makedirs(lone.ns_dir)
    (Path(lone.ns_dir) / snapshot.name).write_bytes(snapshot.read_bytes())
    code, out = run("purge", cache.root, "--namespace", lone.prefix, "--dry-run")
    assert code == 0 and f"{lone.prefix}: would remove 0 blocks" in out and "its directories would go" in out
    code, out = run("purge", cache.root, "--namespace", lone.prefix, "--json")
    assert code == 0 and json.loads(out)["namespaces"][0]["namespace_removed"]
    assert not os.path.exists(lone.ns_dir)


def test_quarantined_files_of_a_model_named_with_double_underscores(cache: Cache) -> None:
    odd = DiskLayout(cache.root, "org__model", bytes.fromhex("cd" * 32), 1, 0)
    odd.create(toy_namespace().config_json("org__model"))
    quarantined = Path(odd.quarantine_path("ef" * 32, 0))
    quarantined.parent.mkdir()
    quarantined.write_bytes(b"q" * 100)
    (ns,) = [ns for ns in inspect_cache(cache.root).namespaces if ns.prefix == odd.prefix]
    assert (ns.quarantine_files, ns.quarantine_bytes) == (1, 100)
    code, out = run("purge", cache.root, "--model", "org__model", "--quarantine")
    assert code == 0 and "quarantine: removed 1 files" in out and not quarantined.exists()


def test_purge_refuses_an_absurd_duration(cache: Cache) -> None:
    before = cache.files()
    for duration in ("1" * 400 + "d", "99999999999w"):
        code, out = run("purge", cache.root, "--older-than", duration)
        assert code == 2 and "too long" in out
    code, out = run("purge", cache.root, "--older-than", "300000d")  # 821 years: allowed, nothing that old
    assert code == 0 and "removed 0 files" in out and cache.files() == before


def test_unreadable_directories_are_counted_skips(cache: Cache) -> None:
    """A directory the command cannot read is skipped and reported; inspect, verify and purge go on
    with the rest, say what they did (text and JSON) and exit 1."""
    if unreadable.runner_prefix() is None:
        pytest.skip("cannot run a process without CAP_DAC_OVERRIDE here")
    leaf = cache.path("smol", 0, rank=1).parent  # smol sorts after qwen: purged after it
    quarantine = cache.root / "quarantine"
    quarantine.mkdir()
    (quarantine / "x.bin").write_bytes(b"x")
    for path in (leaf, quarantine):
        unreadable.make_unreadable(path)
    try:
        done = unreadable.kvtier("inspect", cache.root, "--json")
        data = json.loads(done.stdout)
        assert done.returncode == 1 and {u["path"] for u in data["unreadable"]} == {str(leaf), str(quarantine)}
        assert [ns["unreadable"] for ns in data["namespaces"]] == [0, 1]
        done = unreadable.kvtier("verify", cache.root, "--no-quarantine")
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert "19 ok, no problems" in done.stdout and f"SKIPPED {cache.prefix('smol')}_r1/" in done.stdout
        done = unreadable.kvtier("purge", cache.root, "--all", "--json")
        assert done.returncode == 1 and "2 director(ies) could not be read: skipped" in done.stderr
        data = json.loads(done.stdout)
        assert [(ns["files"], ns["unreadable"]) for ns in data["namespaces"]] == [(8, 0), (0, 1)]
        assert data["files"] == 8 and len(data["unreadable"]) == 2
        done = unreadable.kvtier("purge", cache.root, "--all")
        assert done.returncode == 1 and f"{cache.prefix('smol')}: skipped" in done.stdout
        assert "SKIPPED quarantine" in done.stdout and "removed 0 files" in done.stdout
    finally:
        for path in (leaf, quarantine):
            unreadable.make_readable(path)
    assert not os.path.exists(cache.layout("qwen").ns_dir)  # purged
    assert len([p for p in cache.files() if p.endswith(".bin")]) == 12 + 1  # smol's blocks, the quarantined file


# ---------------------------------------------------------------------- only kvtier's own files; what the operator typed


def test_purge_takes_only_what_the_tier_quarantined_and_only_in_a_kvtier_root(cache: Cache, tmp_path_factory) -> None:
    """``quarantine/`` of a folder that holds no kvtier namespace is not kvtier's: nothing in it is
    removed, whatever its name; in a kvtier root only the files named as the tier names quarantined
    records go, the rest is left in place (counted, and listed by inspect)."""
    folder = tmp_path_factory.mktemp("not-a-root")
    (folder / "quarantine").mkdir()
    thesis = folder / "quarantine" / "thesis.docx"
    thesis.write_text("keep")
    look_alike = folder / "quarantine" / os.path.basename(cache.layout("smol").quarantine_path("ab" * 32, 0))
    look_alike.write_bytes(b"q")
    for args in (["--quarantine"], ["--all"], ["--quarantine", "--dry-run"]):
        code, out = run("purge", folder, *args)
        assert code == 0 and thesis.read_text() == "keep" and look_alike.exists(), out  # before: both removed
        assert "quarantine: left in place 2 files" in out and "not a kvtier root" in out
    flip(cache.path("smol", 0), HEADER_LEN)
    assert verify_cache(cache.root).quarantined == 1
    foreign = cache.root / "quarantine" / "thesis.docx"
    foreign.write_text("keep")
    inventory = inspect_cache(cache.root)
    assert (inventory.quarantine_files, inventory.quarantine_bytes) == (1, FILE_BYTES)
    assert [path for path, _ in inventory.strays] == [str(foreign)]
    code, out = run("purge", cache.root, "--quarantine", "--json")
    data = json.loads(out)
    assert code == 0 and data["quarantine"]["files"] == 1 and sum(data["quarantine"]["left_in_place"].values()) == 1
    assert os.listdir(cache.root / "quarantine") == ["thesis.docx"]
    code, out = run("purge", cache.root, "--all")
    assert code == 0 and "left in place 1 file, not kvtier's: in quarantine/ but not named" in out and foreign.exists()


def test_a_digest_prefix_under_four_digits_says_the_minimum(cache: Cache) -> None:
    digest = NAMESPACES["qwen"].digest.hex()
    for command in ("purge", "verify"):
        code, out = run(command, cache.root, "--namespace", digest[:3])
        assert code == 2 and "a digest prefix needs at least 4 hex digits" in out, out  # before: only "no namespace"
    code, out = run("purge", cache.root, "--namespace", "zzz")  # not hex: not a digest prefix, nothing to add
    assert code == 2 and "no namespace" in out and "hex digits" not in out


def test_inspect_names_node_sockets_and_a_node_no_engine_attached_to(tmp_path: Path) -> None:
    from support.node_service import NodeThread

    gone = tmp_path / "gone" / "node.sock"
    code, out = run("inspect", gone)
    assert code == 2 and "does not exist" in out and "a kvtier node's socket (inspect)" in out, out
    code, out = run("verify", gone)
    assert code == 2 and "does not exist" in out and "kvtier node" not in out
    sock = tmp_path / "node.sock"
    node = NodeThread(sock, pool_bytes=1 << 20)
    try:
        code, out = run("inspect", sock)
        assert code == 0 and "no engine attached yet" in out and "None" not in out, out  # before: "slots of None bytes"
        code, out = run("verify", sock)
        assert code == 2 and "only inspect takes a kvtier node's socket" in out
    finally:
        node.stop()


def test_names_from_the_store_reach_the_terminal_as_text_never_as_commands(tmp_path: Path, monkeypatch) -> None:
    """A writer of a shared root picks the model name in a namespace's config and the names of files:
    control characters (an ESC that would retitle the window or clear the screen, a C1 CSI), a
    bidirectional override and rich markup in them are printed as escapes, never sent raw."""
    hostile = "evil\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e[red]x"
    ns = make_namespace(2)
    tier = open_tier(tmp_path, ns, hostile)
    assert tier.submit_write(0, key_of("smol", 0), ns.digest, 16, [memoryview(os.urandom(PAYLOAD))] * WORLD)
    assert all(r.ok for r in wait(tier, 1))
    tier.close()
    (tmp_path / "stray\x1b[2Jname").write_bytes(b"x")
    monkeypatch.setenv("COLUMNS", "1000")  # one table row a line
    for command in (["inspect", tmp_path], ["verify", tmp_path], ["purge", tmp_path, "--all", "--dry-run"]):
        code, out = run(*command)
        assert not any(c in out for c in "\x1b\x07\x9b\u202e"), repr(out)
    code, out = run("inspect", tmp_path)
    assert r"evil\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e[red]x" in out, out
    assert r"stray\x1b[2Jname" in out
