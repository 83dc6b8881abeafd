"""S3Tier against a real SeaweedFS (tests/support/seaweed.py, one server for the session; no mock of
S3), plus its pure parts (object key layout, configuration entry, capacity sweep choice, presence
reconciliation) on their own. Every fault of the issue: the store down at start-up, stopped and
back, paused (timeouts), throttling (503 SlowDown from SeaweedFS's own circuit breaker), refused
credentials, a missing bucket, an untrusted certificate; bad objects (truncated, oversized, empty,
foreign, another key's, unsigned under a fleet key, forged) and a block deleted between lookup and
read: each a counted miss, never data."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import obstore
import pytest
from support.seaweed import ACCESS_KEY, SECRET_KEY, s3, seaweed  # noqa: F401  (pytest fixtures)
from test_redis_tier import wait_for as wait_for_redis

from kvtier.core.fleet_key import AuthConfig, FleetKey
from kvtier.core.residency import ChangeKind, ResidencyLog
from kvtier.core.tier_config import S3TierConfig, TierType, parse_secondary_tiers, parse_tier
from kvtier.core.values import ConfigError
from kvtier.tiers.base import IoError, IoKind, IoResult, Medium, Presence
from kvtier.tiers.presence import PresenceCache
from kvtier.tiers.s3 import ObjectKeys, S3Tier
from kvtier.tiers.s3.client import describe
from kvtier.tiers.s3.keys import namespace_folder, parse_block
from kvtier.tiers.s3.jobs import MSG_LISTED
from kvtier.tiers.s3 import monitor
from kvtier.tiers.s3.monitor import Listing, OldestEntries, choose_victims
from kvtier.tiers.value import encode_value

PAYLOAD = 4096
PARENT = b"\x00" * 32
NS_JSON = '{"model_name":"test"}'
TIMEOUT = 2.0  # timeout_s of the tiers under test (a paused store costs this per request)


def rank_digests(world: int, engine: bytes) -> list[bytes]:
    return [bytes([engine[0] ^ 0xA0 ^ rank]) + engine[1:] for rank in range(world)]


def key_of(n: int) -> bytes:
    return n.to_bytes(4, "little") + b"\x5a" * 28


def payload_of(key: bytes, rank: int, size: int = PAYLOAD) -> bytes:
    return random.Random(key + bytes([rank])).randbytes(size)


def entry(server, prefix: str, **more) -> S3TierConfig:
    raw = {k: v for k, v in server.tier(prefix, timeout_s=TIMEOUT, connect_timeout_s=0.5, list_interval_s=0.5,
                                        reconnect_max_s=0.5, **more).items() if k != "type"}
    config = parse_tier(raw, TierType.S3, "secondary_tiers[0]")
    assert isinstance(config, S3TierConfig)
    return config


@pytest.fixture
def tiers(request):
    """``make(config, world=1, engine=..., payload=PAYLOAD, **kw)``; closes every tier a test made.
    Each test gets its own namespace (engine digest) unless it passes one."""
    made: list[S3Tier] = []
    default_engine = os.urandom(32)

    def make(config: S3TierConfig, *, world: int = 1, engine: bytes | None = None, payload: int = PAYLOAD, **kw):
        engine = engine or default_engine
        tier = S3Tier(config, model_name="test-model", engine_digest=engine, rank_digests=rank_digests(world, engine),
                      namespace_json=NS_JSON, payload_bytes=payload, where="secondary_tiers[0]", **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def wait_for(tier: S3Tier, condition, timeout: float = 60.0, what: str = "condition") -> float:
    return wait_for_redis(tier, condition, timeout, what)  # the same loop: poll until condition()


def wait_results(tier: S3Tier, n: int, timeout: float = 60.0) -> list[IoResult]:
    results: list[IoResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < n:
        results += tier.poll()
        assert time.monotonic() < deadline or len(results) >= n, f"only {len(results)} of {n} after {timeout}s"
        time.sleep(0.002)
    return results


def write_all(tier: S3Tier, keys, world: int = 1, payload: int = PAYLOAD) -> list[IoResult]:
    for job, key in enumerate(keys):
        sources = [memoryview(payload_of(key, rank, payload)) for rank in range(world)]
        assert tier.submit_write(job, key, PARENT, 128, sources)
    return wait_results(tier, len(keys))


def read_one(tier: S3Tier, key: bytes, world: int = 1, payload: int = PAYLOAD) -> tuple[IoResult, list[bytes]]:
    dests = [bytearray(b"\xee") * payload for _ in range(world)]
    tier.submit_read(7, key, [memoryview(d) for d in dests])
    deadline = time.monotonic() + 60
    while True:
        mine = [r for r in tier.poll() if r.kind is IoKind.READ and r.job_id == 7]
        if mine:
            break
        assert time.monotonic() < deadline, "the read did not complete"
        time.sleep(0.002)
    (result,) = mine
    return result, [bytes(d) for d in dests]


def probe_now(tier: S3Tier, keys) -> None:
    tier.probe(keys)
    wait_for(tier, lambda: all(tier.presence(k) is not Presence.UNKNOWN for k in keys), what="probe answers")


# ---------------------------------------------------------------- pure parts


def test_object_keys_are_pinned_and_parsed_back():
    keys = ObjectKeys.of("kv/prod", "HuggingFaceTB/SmolLM2-135M", bytes(range(32)))
    key = bytes(range(100, 132))
    assert keys.base == "kv/prod/HuggingFaceTB_SmolLM2-135M_0001020304050607/"
    assert keys.block(key) == f"kv/prod/HuggingFaceTB_SmolLM2-135M_0001020304050607/{key.hex()}.bin"
    assert keys.config == "kv/prod/HuggingFaceTB_SmolLM2-135M_0001020304050607/config.json"
    assert keys.block_key_of(keys.block(key)) == key
    assert keys.block_key_of(keys.config) is None
    assert keys.block_key_of(keys.block(key) + ".tmp") is None
    other = ObjectKeys.of("kv/prod", "/models/llama-3/", bytes(range(1, 33)))
    assert other.folder == "llama-3_0102030405060708"
    assert keys.block_key_of(other.block(key)) is None  # another namespace's
    parsed = parse_block(keys.block(key), "kv/prod/")
    assert parsed is not None and (parsed.folder, parsed.digest16, parsed.key) == (keys.folder, "0001020304050607", key)
    for stray in (keys.config, "kv/prod/x.bin", f"kv/prod/{keys.folder}/{key.hex().upper()}.bin", f"other/{keys.folder}/"
                  f"{key.hex()}.bin", f"kv/prod/notanamespace/{key.hex()}.bin"):
        assert parse_block(stray, "kv/prod") is None, stray
    assert namespace_folder(keys.config, "kv/prod") == keys.folder
    assert namespace_folder(keys.block(key), "kv/prod") is None


def test_config_entry_keys_defaults_and_refusals(tmp_path):
    (config,) = parse_secondary_tiers([{"type": "s3", "url": "s3://my-bucket"}])
    assert (config.bucket, config.prefix, config.endpoint, config.path_style) == ("my-bucket", "kvtier", None, False)
    assert config.capacity_bytes is None and config.max_concurrency == 16
    (config,) = parse_secondary_tiers([{"type": "s3", "url": "s3://b-1/a/b/", "endpoint": "http://minio:9000/"}])
    assert (config.prefix, config.endpoint, config.path_style) == ("a/b", "http://minio:9000", True)
    disk = {"type": "fs", "root_dir": str(tmp_path), "capacity_bytes": 10**9}
    redis = {"type": "redis", "url": "redis://127.0.0.1:1"}
    s3 = {"type": "s3", "url": "s3://bucket/kv"}
    assert [type(t).__name__ for t in parse_secondary_tiers([disk, redis, s3])] == [
        "DiskTierConfig", "RedisTierConfig", "S3TierConfig"]
    bad = [
        ({**s3, "secret_access_key": "x"}, "credentials never go in the configuration"),
        ({**s3, "aws_access_key_id": "x"}, "secondary_tiers[0].aws_access_key_id"),
        ({**s3, "url": "https://bucket.s3.amazonaws.com/kv"}, "must be s3://BUCKET/PREFIX"),
        ({**s3, "url": "s3://Bad_Bucket/kv"}, "bucket name"),
        ({**s3, "url": "s3://bucket/../x"}, "key prefix"),
        ({**s3, "endpoint": "minio:9000"}, "'secondary_tiers[0].endpoint'"),
        ({**s3, "ca_bundle": str(tmp_path / "missing.pem")}, "'secondary_tiers[0].ca_bundle'"),
        ({**s3, "capacity_bytes": 0}, "capacity_bytes"),
        ({**s3, "bogus": 1}, "bogus"),
    ]
    for raw, message in bad:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            parse_secondary_tiers([raw])
    with pytest.raises(ConfigError, match="order fs, redis, s3"):
        parse_secondary_tiers([s3, disk])
    with pytest.raises(ConfigError, match="more than one tier of a type"):
        parse_secondary_tiers([s3, s3])


def test_capacity_sweep_takes_the_least_recently_written_first():
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    entries = [(t0 + timedelta(seconds=s), f"p/n_0000000000000000/{name}.bin", size)
               for s, name, size in ((3, "c", 100), (1, "a", 100), (2, "b", 100), (1, "a2", 50), (4, "d", 100))]
    assert choose_victims(entries, 450, 450) == []  # within the bound: nothing
    victims = choose_victims(entries, 450, 400)  # down to 90% of 400 = 360: the oldest one is enough
    assert [path.split("/")[-1] for path, _ in victims] == ["a.bin"]
    victims = choose_victims(entries, 450, 300)  # down to 270: oldest first, ties by key (a, a2), then b
    assert [path.split("/")[-1] for path, _ in victims] == ["a.bin", "a2.bin", "b.bin"]
    assert 450 - sum(size for _, size in victims) <= 270


def test_a_listing_keeps_only_the_oldest_entries_a_sweep_can_take():
    """The sweep's entries are bounded by the sweep, not the bucket: the kept ones are exactly the
    oldest (ties by key) of everything listed, and held at most twice the limit at a time."""
    rng = random.Random(5)
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    listed = [(t0 + timedelta(seconds=rng.randrange(50)), f"p/n/{rng.getrandbits(32):08x}.bin", rng.randrange(1, 9))
              for _ in range(1_000)]
    kept = OldestEntries(64)
    most = 0
    for entry in listed:
        kept.add(entry)
        most = max(most, len(kept._entries))
    assert kept.oldest() == sorted(listed)[:64] and kept.seen == 1_000 and kept.cut
    assert most < 128
    few = OldestEntries(64)
    for entry in listed[:64]:
        few.add(entry)
    assert few.oldest() == sorted(listed[:64]) and not few.cut
    with pytest.raises(ValueError):
        OldestEntries(0)


def test_presence_reconcile_forgets_what_a_later_listing_lacks():
    now = [100.0]
    log = ResidencyLog(Medium.S3)
    log.enable()
    cache = PresenceCache(log, clock=lambda: now[0])
    old, fresh, listed = key_of(1), key_of(2), key_of(3)
    cache.found(old)
    cache.found(listed)
    now[0] = 110.0  # the listing begins
    began = now[0]
    now[0] = 111.0
    cache.found(fresh)  # written after the listing began: it cannot be in it
    assert cache.reconcile({listed}, began) == 1
    assert cache.get(old) is Presence.ABSENT and cache.get(fresh) is Presence.PRESENT
    assert cache.get(listed) is Presence.PRESENT
    assert [(c.kind, c.key) for c in log.take()] == [
        (ChangeKind.STORED, old), (ChangeKind.STORED, listed), (ChangeKind.STORED, fresh), (ChangeKind.REMOVED, old)]


# ---------------------------------------------------------------- the real store


@pytest.mark.parametrize("world", [1, 2])
def test_round_trip_bit_exact_and_the_object_is_the_value(s3, tiers, world):
    engine = os.urandom(32)
    tier = tiers(entry(s3, f"rt{world}"), world=world, engine=engine)
    keys = [key_of(i) for i in range(6)]
    assert all(r.ok and r.num_bytes == world * (136 + PAYLOAD) for r in write_all(tier, keys, world))
    for key in keys:
        result, data = read_one(tier, key, world)
        assert result.ok and data == [payload_of(key, rank) for rank in range(world)]
    wait_for(tier, lambda: tier.keys.config in s3.objects(f"rt{world}/"), what="config.json stored")
    objects = s3.objects(f"rt{world}/")
    assert set(objects) == {tier.keys.block(k) for k in keys} | {tier.keys.config}
    assert {size for path, size in objects.items() if path.endswith(".bin")} == {tier.value_bytes}
    stored = obstore.get(s3.store(), tier.keys.block(keys[0])).bytes()
    digests = rank_digests(world, engine)
    expected = b"".join(bytes(p) for p in encode_value(digests, keys[0], PARENT, 128,
                                                        [memoryview(payload_of(keys[0], r)) for r in range(world)]))
    assert stored.to_bytes() == expected  # the Redis tier's value, byte for byte
    assert obstore.get(s3.store(), tier.keys.config).bytes().to_bytes() == NS_JSON.encode()
    assert tier.stats.writes_ok == 6 and tier.stats.reads_ok == 6
    assert tier.usage().medium is Medium.S3


def test_lookups_answer_from_memory_probes_and_the_listing(s3, tiers):
    engine = os.urandom(32)
    writer = tiers(entry(s3, "presence"), engine=engine)
    written = [key_of(i) for i in range(5)]
    write_all(writer, written)
    # A second process on the same namespace: its start-up LIST finds them, no probe needed.
    reader = tiers(entry(s3, "presence"), engine=engine, absent_ttl=5.0)  # (ABSENT read after a probe)
    reader.residency.enable()
    wait_for(reader, lambda: reader.stats.listings >= 1, what="first listing")
    assert all(reader.presence(k) is Presence.PRESENT for k in written) and reader.stats.probes == 0
    # Written after that listing: UNKNOWN, then a HEAD probe answers.
    late, missing = key_of(50), key_of(51)
    write_all(writer, [late])
    if reader.presence(late) is Presence.UNKNOWN:  # (unless a listing ran in between)
        probe_now(reader, [late, missing])
    assert reader.presence(late) is Presence.PRESENT
    probe_now(reader, [missing])
    assert reader.presence(missing) is Presence.ABSENT
    # Deleted by another process (another engine's sweep, kvtier purge): the next listing forgets it.
    obstore.delete(s3.store(), writer.keys.block(written[0]))
    before = reader.stats.listings
    wait_for(reader, lambda: reader.stats.listings >= before + 2, what="two more listings")
    assert reader.presence(written[0]) is not Presence.PRESENT
    changes = [(c.kind, c.key) for c in reader.residency.take()]
    assert (ChangeKind.REMOVED, written[0]) in changes and (ChangeKind.STORED, written[0]) in changes
    result, data = read_one(reader, written[1])
    assert result.ok and data == [payload_of(written[1], 0)]


def test_a_block_deleted_between_lookup_and_read_is_a_counted_miss(s3, tiers):
    tier = tiers(entry(s3, "vanish"))
    key = key_of(1)
    write_all(tier, [key])
    assert tier.presence(key) is Presence.PRESENT
    obstore.delete(s3.store(), tier.keys.block(key))
    result, _ = read_one(tier, key)
    assert not result.ok and result.error is IoError.NOT_FOUND
    assert tier.stats.read_misses == 1 and tier.presence(key) is Presence.ABSENT


def _bad_objects(value: bytes, other_value: bytes, foreign: bytes) -> dict[str, bytes]:
    flipped = bytearray(value)
    flipped[136 + 17] ^= 1
    return {"truncated": value[:-100], "oversized": value + os.urandom(8 << 20), "empty": b"",
            "garbage": os.urandom(len(value)), "bit_flip": bytes(flipped), "other_key": other_value,
            "foreign_namespace": foreign}


def test_bad_objects_are_counted_misses_deleted_and_gets_are_bounded(s3, tiers, caplog):
    tier = tiers(entry(s3, "bad"))
    foreign_tier = tiers(entry(s3, "bad-foreign"), engine=os.urandom(32))
    keys = [key_of(i) for i in range(8)]
    write_all(tier, keys)
    write_all(foreign_tier, [keys[0]])
    store = s3.store()
    value = obstore.get(store, tier.keys.block(keys[0])).bytes().to_bytes()
    other = obstore.get(store, tier.keys.block(keys[1])).bytes().to_bytes()
    foreign = obstore.get(store, foreign_tier.keys.block(keys[0])).bytes().to_bytes()
    bad = _bad_objects(value, other, foreign)
    targets = dict(zip(bad, keys[1:]))
    for name, key in targets.items():
        obstore.put(store, tier.keys.block(key), bad[name], use_multipart=False)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.s3"):
        for name, key in targets.items():
            result, data = read_one(tier, key)
            assert not result.ok and result.error is IoError.CORRUPT, name
            assert tier.presence(key) is Presence.ABSENT
    assert tier.stats.corrupt == len(targets)
    # the oversized object (8 MiB more) was read only to one byte past a value's length
    assert f"value is {tier.value_bytes + 1} bytes, expected {tier.value_bytes}" in caplog.text
    wait_for(tier, lambda: not any(tier.keys.block(k) in s3.objects("bad/") for k in targets.values()),
             what="bad objects deleted")
    result, data = read_one(tier, keys[0])
    assert result.ok and data == [payload_of(keys[0], 0)]


def fleet_key(secret: bytes) -> AuthConfig:
    return AuthConfig(FleetKey(secret, "test"))


def test_fleet_key_unsigned_forged_and_readdressed_objects_are_counted_misses(s3, tiers):
    engine = os.urandom(32)
    signed = tiers(replace(entry(s3, "sealed"), auth=fleet_key(b"k" * 32)), engine=engine)
    plain = tiers(entry(s3, "sealed"), engine=engine)
    other_key = tiers(replace(entry(s3, "sealed"), auth=fleet_key(b"o" * 32)), engine=engine)
    good, unsigned, readdressed, forged, foreign_key = (key_of(i) for i in range(5))
    write_all(signed, [good, readdressed, forged])
    write_all(plain, [unsigned])
    write_all(other_key, [foreign_key])
    store = s3.store()
    # re-addressed: a valid signed object copied under another key; forged: its payload changed
    obstore.copy(store, signed.keys.block(good), signed.keys.block(readdressed))
    value = bytearray(obstore.get(store, signed.keys.block(forged)).bytes().to_bytes())
    value[-1] ^= 0xFF
    obstore.put(store, signed.keys.block(forged), bytes(value), use_multipart=False)
    for key in (unsigned, readdressed, forged, foreign_key):
        result, _ = read_one(signed, key)
        assert not result.ok and result.error in (IoError.UNAUTHENTICATED, IoError.CORRUPT), key
    stats = signed.stats
    assert stats.unauthenticated >= 3 and stats.unauthenticated + stats.corrupt == 4
    result, data = read_one(signed, good)
    assert result.ok and data == [payload_of(good, 0)]
    result, _ = read_one(plain, good)  # a reader without the key refuses sealed objects
    assert not result.ok and result.error is IoError.UNAUTHENTICATED


def test_write_room_bounds_writes_in_flight(s3, tiers):
    tier = tiers(replace(entry(s3, "room"), max_pending_writes=3))
    assert tier.write_room() == 3
    sources = [memoryview(bytes(PAYLOAD))]
    accepted = [tier.submit_write(i, key_of(i), PARENT, 1, sources) for i in range(5)]
    assert accepted == [True, True, True, False, False] and tier.write_room() == 0
    assert tier.stats.writes_dropped == 2
    wait_results(tier, 3)
    assert tier.write_room() == 3 and tier.stats.writes_ok == 3
    assert tier.submit_write(9, key_of(0), PARENT, 1, sources)  # stored already: done at once, no request
    (done,) = wait_results(tier, 1)
    assert done.ok and tier.stats.writes_deduped == 1 and tier.write_room() == 3


def test_capacity_is_held_across_every_writer_of_the_prefix(s3, tiers):
    """Two namespaces (two engines) write one prefix bounded to 8 values: the sweeps delete the
    least recently written objects, whoever wrote them, and the prefix ends within the bound."""
    value = 136 + PAYLOAD
    capacity = 8 * value
    first = tiers(replace(entry(s3, "bounded"), capacity_bytes=capacity),
                  engine=os.urandom(32))
    second = tiers(replace(entry(s3, "bounded"), capacity_bytes=capacity),
                   engine=os.urandom(32))
    write_all(first, [key_of(i) for i in range(6)])
    time.sleep(1.1)  # LastModified has a resolution of one second
    write_all(second, [key_of(100 + i) for i in range(6)])

    def total() -> int:
        return sum(size for path, size in s3.objects("bounded/").items() if path.endswith(".bin"))

    wait_for(first, lambda: (second.poll(), total() <= capacity)[1], timeout=60, what="prefix within capacity")
    left = {path for path in s3.objects("bounded/") if path.endswith(".bin")}
    assert not any(first.keys.block(key_of(i)) in left for i in range(3)), "the oldest were not swept first"
    assert all(second.keys.block(key_of(100 + i)) in left for i in range(6)), "newer objects were swept"
    wait_for(first, lambda: (second.poll(), first.evictions + second.evictions >= 4)[1], what="evictions counted")
    assert first.usage().capacity_bytes == capacity


def test_a_sweep_cut_short_by_its_bound_sweeps_again_until_within(s3, tiers, monkeypatch):
    """A prefix over its bound by more objects than one sweep may delete (SWEEP_MAX, 3 here) comes
    within it over the next listings, the oldest first, with no write to prompt them."""
    monkeypatch.setattr(monitor, "SWEEP_MAX", 3)
    monkeypatch.setattr(monitor, "MIN_GAP_S", 0.2)
    value = 136 + PAYLOAD
    writer = tiers(entry(s3, "cut"))
    write_all(writer, [key_of(i) for i in range(4)])
    time.sleep(1.1)  # LastModified has a resolution of one second
    write_all(writer, [key_of(100 + i) for i in range(8)])
    writer.close()

    def blocks() -> set[str]:
        return {path for path, size in s3.objects("cut/").items() if path.endswith(".bin")}

    bounded = tiers(replace(entry(s3, "cut"), capacity_bytes=4 * value, list_interval_s=60.0),
                    engine=os.urandom(32))  # its listing comes at start-up, then only when it asks
    wait_for(bounded, lambda: len(blocks()) * value <= 4 * value, timeout=60, what="prefix within capacity")
    assert len(blocks()) == 3  # down to 90% of the bound: 3 values
    assert not any(writer.keys.block(key_of(i)) in blocks() for i in range(4)), "the oldest were not swept first"
    wait_for(bounded, lambda: bounded.evictions == 9, what="the sweeper's evictions counted")


def test_clear_removes_the_namespace_and_delete_its_keys(s3, tiers):
    tier = tiers(entry(s3, "clear"))
    keys = [key_of(i) for i in range(4)]
    write_all(tier, keys)
    assert tier.delete([keys[0]]) == 1
    wait_for(tier, lambda: tier.keys.block(keys[0]) not in s3.objects("clear/"), what="deleted")
    assert tier.clear() == 3
    wait_for(tier, lambda: set(s3.objects("clear/")) == {tier.keys.config}, what="cleared")
    assert all(tier.presence(k) is not Presence.PRESENT for k in keys)


@pytest.mark.parametrize("removal", ["delete", "clear"])
@pytest.mark.parametrize("when", ["applied", "pending"])
def test_a_listing_that_may_predate_a_removal_does_not_bring_the_removed_keys_back(s3, tiers, removal, when):
    """The monitor's LIST may read an object before this tier's DELETE of it is over, and post
    before or after the removal is applied (seen in CI: a cleared key answered PRESENT). Such a
    listing is delivered here after the removal was applied, or while its DELETE waits behind a
    held removal thread; no removed key comes back, the other keys are still taken, and a listing
    begun once the removal is over is taken whole."""
    tier = tiers(replace(entry(s3, f"stale-{removal}-{when}"), list_interval_s=3600.0), absent_ttl=0.05)
    wait_for(tier, lambda: tier.stats.listings >= 1, what="the start-up listing")  # no other one comes
    keys = [key_of(i) for i in range(3)]
    write_all(tier, keys)
    held = threading.Event()
    if when == "pending":
        tier._remove_pool.submit(held.wait, 10)  # noqa: SLF001 (the removal queues behind this)
    began = time.monotonic()
    if removal == "delete":
        tier.delete([keys[0]])
        gone, kept = keys[:1], keys[1:]
    else:
        tier.clear()
        gone, kept = keys, []
    if when == "applied":
        wait_for(tier, lambda: tier.stats.removed >= len(gone), what="the removal applied")
    listed = began - 0.01 if when == "applied" else time.monotonic()
    tier._path.post([(MSG_LISTED, Listing(set(keys), listed, 0, 3, 3))])  # noqa: SLF001 (the monitor's post)
    time.sleep(0.1)  # the removals' ABSENT answers expire: only the listing can answer now
    tier.poll()
    assert tier.stats.listings == 2
    assert not any(tier.presence(k) is Presence.PRESENT for k in gone), "a removed key came back"
    assert all(tier.presence(k) is Presence.PRESENT for k in kept)
    held.set()
    wait_for(tier, lambda: tier.stats.removed >= len(gone), what="the removal applied")
    if removal == "clear":
        wait_for(tier, lambda: set(s3.objects(f"stale-{removal}-{when}/")) == {tier.keys.config}, what="cleared")
    time.sleep(0.1)
    tier.poll()
    tier._path.post([(MSG_LISTED, Listing(set(kept), time.monotonic(), 0, 2, 2))])  # noqa: SLF001
    time.sleep(0.1)  # every removal and listing is applied by the next poll
    tier.poll()
    assert not any(tier.presence(k) is Presence.PRESENT for k in gone)
    assert all(tier.presence(k) is Presence.PRESENT for k in kept)


def test_refused_credentials_and_a_missing_bucket_are_config_errors_naming_the_key(s3, tiers, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ConfigError) as refused:
        tiers(entry(s3, "auth"))
    text = str(refused.value)
    assert "secondary_tiers[0]" in text and "AWS_ACCESS_KEY_ID" in text and "not-the-secret" not in text
    assert "SignatureDoesNotMatch" in text or "403" in text
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.url.*no bucket 'no-such-bucket'"):
        tiers(replace(entry(s3, "x"), bucket="no-such-bucket"))


def test_credentials_from_a_shared_profile(s3, tiers, tmp_path, monkeypatch):
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[fleet]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
                           "[wrong]\naws_access_key_id = nobody\naws_secret_access_key = nothing\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_PROFILE", "fleet")
    tier = tiers(entry(s3, "profile"))
    assert all(r.ok for r in write_all(tier, [key_of(1)]))
    with pytest.raises(ConfigError, match=r"profile 'wrong'.*aws_access_key_id"):
        tiers(replace(entry(s3, "profile"), profile="wrong"))
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.profile.*'absent'"):
        tiers(replace(entry(s3, "profile"), profile="absent"))


def test_tls_with_the_ca_bundle_and_an_untrusted_certificate(s3, tiers):
    tls = replace(entry(s3, "tls"), endpoint=s3.https_endpoint)
    tier = tiers(replace(tls, ca_bundle=s3.ca_file))
    assert all(r.ok for r in write_all(tier, [key_of(1)]))
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.ca_bundle.*not trusted"):
        tiers(tls)


def test_a_paused_store_costs_misses_never_a_wait_then_recovers(s3, tiers):
    tier = tiers(entry(s3, "paused"))
    keys = [key_of(i) for i in range(4)]
    write_all(tier, keys)
    s3.pause()
    try:
        for job, key in enumerate(keys):  # each times out after ~1 s on its own thread
            tier.submit_read(job, key, [memoryview(bytearray(PAYLOAD))])
        results = wait_results(tier, 4, timeout=60)
        assert all(not r.ok and r.error is IoError.IO for r in results)
        wait_for(tier, lambda: not tier.breaker.closed, what="breaker open")
        started = time.perf_counter()
        assert tier.presence(keys[0]) is Presence.ABSENT and tier.write_room() is None
        assert not tier.submit_write(9, key_of(9), PARENT, 1, [memoryview(bytes(PAYLOAD))])
        tier.submit_read(10, keys[0], [memoryview(bytearray(PAYLOAD))])
        assert time.perf_counter() - started < TIMEOUT / 4, "the caller waited on a paused store"  # (a wait: >= TIMEOUT)
        assert tier.stats.unreachable >= 3 and tier.unavailable >= 3
        assert tier.unavailable == tier.stats.unreachable + tier.stats.breaker_rejects  # RemoteTier's, as Redis's
    finally:
        s3.resume()
    wait_for(tier, lambda: tier.breaker.closed, timeout=60, what="recovered")
    wait_for(tier, lambda: tier.presence(keys[0]) is Presence.PRESENT, what="listed again")
    result, data = read_one(tier, keys[1])
    assert result.ok and data == [payload_of(keys[1], 0)]


def test_a_key_the_client_cannot_list_costs_the_listings_never_the_tier(s3, tiers, monkeypatch, caplog):
    """A writer of the bucket plants a key with an empty segment ('a//b', which S3 allows and obstore
    refuses to list): every LIST of the prefix fails. The store still answers, so the breaker stays
    closed: writes land, HEAD probes find blocks, reads serve them; the log names the key and says
    to remove it. (It was taken for an unreachable store: the tier was off for every engine.)"""
    from obstore.exceptions import InvalidPathError

    planted = "bad-key/zz_0123456789abcdef//x"

    def refuse(*args, **kwargs):
        raise InvalidPathError(f'Encountered object with invalid path: Path "{planted}" contained empty path segment')

    monkeypatch.setattr(obstore, "list", refuse)
    engine = os.urandom(32)
    writer = tiers(entry(s3, "bad-key"), engine=engine)
    keys = [key_of(i) for i in range(3)]
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers.s3.monitor"):
        assert all(r.ok for r in write_all(writer, keys))
        reader = tiers(entry(s3, "bad-key"), engine=engine)  # another process: knows nothing of the blocks
        wait_for(reader, lambda: reader.stats.listing_failures >= 1, what="a failed listing")
        probe_now(reader, keys)
        assert all(reader.presence(k) is Presence.PRESENT for k in keys)
        result, data = read_one(reader, keys[1])
        assert result.ok and data == [payload_of(keys[1], 0)]
    assert reader.breaker.closed and reader.stats.breaker_opens == 0 and writer.stats.breaker_opens == 0
    assert planted in caplog.text and "remove that object" in caplog.text


def test_what_the_store_says_is_logged_on_one_line_without_terminal_commands():
    """A hostile store chooses its error messages and its keys' names: describe() gives one line,
    control characters escaped (the message's regex takes newlines; a key may hold ESC)."""
    from obstore.exceptions import InvalidPathError

    answered = Exception("Error performing GET http://s3/b/k in 1ms - Server returned non-success status "
                         "code: 500 Internal Server Error: <Code>Slow\x1bDown</Code><Message>try\nkvtier s3: "
                         "forged\x1b[2J</Message>")
    assert describe(answered) == "500 Slow\\x1bDown (try\\nkvtier s3: forged\\x1b[2J)"
    planted = InvalidPathError('Path "a//\x1b]0;owned\x07" contained empty path segment')
    assert "\x1b" not in describe(planted) and "\\x1b]0;owned\\x07" in describe(planted)


def test_jobs_that_found_the_store_unreachable_are_counted_once_by_remote_tier(tiers, monkeypatch):
    """RemoteTier counts reads and writes whose request found the store unreachable (S3's fault
    value is its UNREACHABLE), as for Redis; the S3 tier adds only its own faults (throttled...)."""
    from support.redis_server import free_port

    from kvtier.tiers.remote import MSG_IO, UNREACHABLE
    from kvtier.tiers.s3.client import Fault

    assert Fault.UNREACHABLE.value == UNREACHABLE
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    tier = tiers(S3TierConfig(url="s3://b/p", bucket="b", prefix="p", endpoint=f"http://127.0.0.1:{free_port()}",
                              path_style=True, timeout_s=0.5, connect_timeout_s=0.3))
    tier.poll()
    before = tier.unavailable
    failed = [IoResult(1, IoKind.READ, key_of(1), False, error=IoError.IO),
              IoResult(2, IoKind.WRITE, key_of(2), False, error=IoError.IO),
              IoResult(3, IoKind.READ, key_of(3), False, error=IoError.IO)]
    tier.outbox.put([(MSG_IO, failed[0], UNREACHABLE), (MSG_IO, failed[1], UNREACHABLE, None),
                     (MSG_IO, failed[2], Fault.THROTTLED.value)])
    tier.poll()
    assert tier.stats.throttled == 1 and tier.unavailable - before == 2


def test_down_at_start_up_starts_with_misses_and_recovers_when_the_store_is_back(s3, tiers, caplog):
    s3.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.s3"):
            tier = tiers(entry(s3, "down"))
        assert "does not answer at start-up" in caplog.text
        assert not tier.breaker.closed and tier.presence(key_of(1)) is Presence.ABSENT
        assert tier.write_room() is None
        assert not tier.submit_write(1, key_of(1), PARENT, 1, [memoryview(bytes(PAYLOAD))])
    finally:
        s3.start()
    wait_for(tier, lambda: tier.breaker.closed, timeout=60, what="recovered")
    assert all(r.ok for r in write_all(tier, [key_of(1)]))
    assert tier.keys.config in s3.objects("down/")


def test_throttling_backs_off_writes_and_keeps_the_breaker_closed(s3, tiers):
    tier = tiers(replace(entry(s3, "throttled"), max_pending_writes=32),
                 payload=256 * 1024)
    sources = [memoryview(os.urandom(256 * 1024))]
    s3.throttle(writes=1)
    try:
        for i in range(24):
            assert tier.submit_write(i, key_of(i), PARENT, 1, sources)
        held_back = False
        results: list[IoResult] = []
        deadline = time.monotonic() + 60
        while len(results) < 24:
            results += tier.poll()
            held_back |= tier.write_room() == 0 and tier.stats.throttled > 0
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert tier.stats.throttled > 0, "SeaweedFS never answered 503"
        assert held_back, "write_room() never held writes back while throttled"
        assert tier.breaker.closed and tier.stats.breaker_opens == 0
        assert sum(r.ok for r in results) == tier.stats.writes_ok > 0
    finally:
        s3.throttle(None)
    wait_for(tier, lambda: not tier._throttle.active, what="back-off over")
    ok = write_all(tier, [key_of(100 + i) for i in range(4)], payload=256 * 1024)
    assert all(r.ok for r in ok)


@pytest.fixture
def metadata_service(monkeypatch, tmp_path):
    """No credentials anywhere but an instance metadata service on loopback (``AWS_METADATA_ENDPOINT``)
    that answers ``mode``: ``"403"`` (a proxy that denies it) or ``"silent"`` (accepts, never answers)."""
    import http.server
    import socket

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    started = []

    class Deny(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):  # noqa: N802 (IMDSv2's token request)
            self.send_response(403)
            self.end_headers()
            self.wfile.write(b"denied")

        do_GET = do_PUT  # noqa: N815

        def log_message(self, *args):
            pass

    def start(mode: str) -> None:
        if mode == "403":
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Deny)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            started.append(server.shutdown)
            port = server.server_address[1]
        else:
            silent = socket.socket()
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            started.append(silent.close)
            port = silent.getsockname()[1]
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{port}")

    yield start
    for stop in started:
        stop()


@pytest.mark.parametrize("mode", ["403", "silent"])
def test_credentials_that_cannot_be_fetched_are_not_blamed_on_the_store(s3, metadata_service, mode, caplog):
    """No credentials are configured and the instance's role gives none: the operator tools and the
    start-up check say so, naming the metadata service, neither "the store refuses the credentials"
    (it was never asked) nor "the store does not answer" (the live one and a dead one alike). A
    service that answers with a refusal is a configuration error (ConfigError, with the fix); one
    that does not answer is as a store that does not: the engine's tier starts and misses, the
    operator tools stop with that reason. Bounded by the tier's timeout."""
    from kvtier.tiers.s3.client import Access, StoreUnreachable, check_access, require_access

    metadata_service(mode)
    for config in (entry(s3, "nocreds"), replace(entry(s3, "nocreds"), endpoint="http://127.0.0.1:9")):
        started = time.monotonic()
        with pytest.raises(ConfigError if mode == "403" else StoreUnreachable) as caught:
            require_access(config, "secondary_tiers[0]")
        assert time.monotonic() - started < 3 * TIMEOUT
        text = str(caught.value)
        assert "127.0.0.1:" in text and "the store itself was not asked" in text, text
        assert "refuses" not in text
        if mode == "403":
            assert "no credentials to sign the store's requests" in text and "403" in text
            assert "AWS_ACCESS_KEY_ID" in text and "refuses" not in text and "does not answer" not in text
            with pytest.raises(ConfigError, match="no credentials to sign"):
                check_access(config, "secondary_tiers[0]")
        else:
            assert text.startswith("the credentials for the S3 store of") and "does not answer (timed out)" in text
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvtier.tiers.s3.client"):
                assert check_access(config, "secondary_tiers[0]") is Access.UNREACHABLE
            assert "credentials for" in caplog.text and "the store itself was not asked" in caplog.text
