"""``kvtier inspect / verify / purge`` on a Redis / Valkey remote tier (a URL instead of a directory).

The same reports as for a disk root (:class:`~kvtier.cachetools.inventory.Inventory`,
:class:`~kvtier.cachetools.verify.VerifyReport`, :class:`~kvtier.cachetools.purge.PurgeReport`), from
the tier's own key names and value format (:mod:`kvtier.tiers.redis.codec`): a namespace is the
``<key_prefix>:<digest16>:config`` key and the block keys beside it; any other key under the prefix
is a stray (listed by inspect, bounded; one in a namespace keeps its config key from being purged).
Keys are listed with ``SCAN`` (never ``KEYS``), ages with ``OBJECT IDLETIME`` (not available under
an LFU eviction policy: then ages are not reported), all pipelined in batches
(:mod:`kvtier.cachetools.remote_scan`). Verify reads every value and deletes (``UNLINK``) the bad
ones unless told not to; purge unlinks what it selects, ``--older-than`` reading each block's age
again in the server-side script that unlinks it (:data:`RECHECK_LUA`: a block used since it was
selected is kept; a server that refuses scripts gets the plain unlink, said in the report's notes).
Nothing is read whole before its size is known: a config key at most
:data:`~kvtier.tiers.disk.layout.CONFIG_MAX_BYTES` (``GETRANGE``), a block value only when its length (``STRLEN``) is what its first header
(``GETRANGE``) announces for the namespace's ranks and that header's payload is no longer than the
namespace's records can be (its config's block size, :func:`~kvtier.cachetools.verify.config_payload_bound`,
says for a disk root); any other value is a problem, never read. A config key is judged as a disk
root's ``config.json`` (:func:`~kvtier.cachetools.scan.parse_config`): one that does not parse (a
JSON bomb included) or that names another namespace than its key's digest is reported, and the
namespace's values are left in place unread (nothing is judged, let alone deleted, by a config
judged wrong; without a valid config a value's rank count and block size are unknown).
Safe while engines use the server: an engine that loses a block to verify or purge sees a miss.

Looking is not using. The tools' connections ask for ``CLIENT NO-TOUCH`` (Redis / Valkey 7.2 and
later: :func:`~kvtier.tiers.redis.deadline.bounded_client`), so that nothing they read changes a
key's LRU clock or LFU counter: the server's eviction order and the idle times ``purge
--older-than`` goes by stay the engines' own. A server that refuses it (older than 7.2) counts every
``STRLEN`` and ``GETRANGE`` as a use of the key, so there the tools read what they need in an order
and with commands that touch as little as they can: ``OBJECT IDLETIME`` (which never touches) is
read before anything else of a block, sizes that are only reported are the server's memory for the
key (``MEMORY USAGE``, which never touches) instead of ``STRLEN`` (said in the report's notes), a
real purge reads a key's ``STRLEN`` only in the script or pipeline that unlinks it (a block the
age re-check keeps is not read), and ``purge --older-than --retired`` reads headers only of the
blocks old enough. What still touches on such a server, said
in the report's notes: the config keys (read by every command), every value ``verify`` reads, and
the headers ``purge --retired`` reads of the blocks it keeps.

Called by :mod:`kvtier.cli.cache` in the ``kvtier`` command's process, one thread. Passwords come
from an environment variable or the URL and are never printed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from kvtier.cachetools.inventory import AGE_BUCKETS, Inventory, NamespaceInventory, age_bucket
from kvtier.cachetools.purge import NamespacePurge, PurgeReport, PurgeSelection
from kvtier.cachetools.remote_scan import (_batches, _discover, _idle_seconds, _RemoteNamespace, _scan, _sizes,
                                           purged_namespaces, verified_namespaces)
from kvtier.cachetools.stores import REDIS
from kvtier.cachetools.verify import Problem, VerifyReport
from kvtier.core.fleet_key import AuthConfig
from kvtier.core.keys import describe_config
from kvtier.core.tier_config import REDIS_SCHEMES, redact_url
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError, decode_header
from kvtier.tiers.redis.codec import decode_value
from kvtier.tiers.redis.deadline import bounded_client
from kvtier.tiers.sealing import PLAIN, KeyState, Sealer

READ_BATCH_BYTES = 64 * 2**20
"""Verify reads at most this many bytes of values per round trip."""

MEMORY_NOTE = ("sizes are the server's memory for each key (MEMORY USAGE: the value and the key, as allocated), "
               "not the values' lengths: this server refuses CLIENT NO-TOUCH (Redis / Valkey older than 7.2), on "
               "which STRLEN would count as a use of every block")
VERIFY_TOUCH_NOTE = ("this server refuses CLIENT NO-TOUCH (Redis / Valkey older than 7.2): every value verify read "
                     "now counts as just used (its idle time starts again; run purge --older-than before verify)")
RETIRED_TOUCH_NOTE = ("this server refuses CLIENT NO-TOUCH (Redis / Valkey older than 7.2): the blocks whose header "
                      "--retired read and kept now count as just used")
LFU_NOTE = "no ages: the server refuses OBJECT IDLETIME (an LFU maxmemory-policy keeps no idle time)"


def is_remote(target: str) -> bool:
    """Whether ``target`` names a Redis server (a URL) rather than a directory (by its scheme alone:
    a URL that does not parse is still one, refused with its own error)."""
    scheme, sep, _ = target.partition("://")
    return bool(sep) and scheme.lower() in REDIS_SCHEMES


@dataclass(frozen=True)
class RemoteTarget:
    """How to reach a remote tier: the URL, optional user and password (from an environment
    variable's value, already read), and the tier's ``key_prefix``."""

    url: str
    username: str | None = None
    password: str | None = None
    key_prefix: str = "kvtier"
    connect_timeout_s: float = 5.0
    timeout_s: float = 30.0

    def client(self):
        """A client whose every call has a deadline (a hung or trickling server fails the command:
        :func:`~kvtier.tiers.redis.deadline.bounded_client`) and whose reads do not count as uses of
        the keys where the server accepts ``CLIENT NO-TOUCH`` (``reads_touch()`` says whether it did)."""
        kwargs: dict[str, Any] = {}
        if self.username:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        return bounded_client(self.url, connect_timeout_s=self.connect_timeout_s, timeout_s=self.timeout_s,
                              no_touch=True, **kwargs)

    @property
    def shown(self) -> str:
        return redact_url(self.url)


def inspect_remote(target: RemoteTarget, *, now: float | None = None) -> Inventory:
    """Every namespace under the target's key prefix, with its blocks' ages (``OBJECT IDLETIME``,
    read first) and bytes, and the keys there that are not kvtier's; nothing it does counts as a
    use of a block (see the module docstring)."""
    now = time.time() if now is None else now
    client = target.client()
    inventory = Inventory(root=target.shown, scanned_at=now, namespaces=[], store=REDIS.name)
    spaces = _discover(client, target.key_prefix, inventory.add_stray)
    exact = not client.reads_touch()
    if not exact and any(ns.blocks for ns in spaces):
        inventory.notes.append(MEMORY_NOTE)
    for ns in spaces:
        summary = NamespaceInventory(
            prefix=ns.prefix,
            model=ns.model_name or "?",
            digest16=ns.digest16,
            model_name=ns.model_name,
            layout=describe_config(ns.config) if ns.config is not None else None,
            config_problem=ns.config_problem,
            world=ns.world,
            older_spec=ns.older_spec,
        )
        summary.complete_blocks = summary.block_files = len(ns.blocks)
        summary.stray_files = ns.others
        idle = [s for s in _idle_seconds(client, ns.blocks) if s is not None]  # before anything else of the blocks
        summary.block_bytes = sum(_sizes(client, ns.blocks, exact))
        for seconds in idle:
            summary.ages[age_bucket(seconds)] += 1
        if idle:
            summary.last_use = now - min(idle)
        elif ns.blocks and LFU_NOTE not in inventory.notes:
            inventory.notes.append(LFU_NOTE)
        inventory.namespaces.append(summary)
    return inventory


def verify_remote(
    target: RemoteTarget, selectors: Sequence[str] = (), *, delete: bool = True, auth: AuthConfig | None = None
) -> VerifyReport:
    """Read and check every block value of the selected namespaces (by digest or model); delete
    the bad ones unless ``delete`` is False. Values of namespaces without a usable config of this
    key spec (missing, unreadable, another spec's, or another namespace's) cannot be checked:
    reported, left alone, unread. A value is read only when its length is what its header
    announces and that is within the namespace's block size (:meth:`_RemoteNamespace.value_bound`).
    Fleet keys (``auth``) as
    :func:`~kvtier.cachetools.verify.verify_cache` uses them: without, sealed values are counted
    ``sealed_unchecked`` and left alone. Raises SelectionError as
    :func:`~kvtier.cachetools.selection.select`."""
    sealer = Sealer(auth) if auth is not None else None
    client = target.client()
    chosen = verified_namespaces(_discover(client, target.key_prefix), selectors, target.shown)
    report = VerifyReport(root=target.shown, namespaces=[ns.prefix for ns in chosen], store=REDIS.name)
    bad_action = REDIS.bad_action if delete else "left in place"
    for ns in chosen:
        why = ns.unchecked
        if why is not None or ns.namespace is None:
            report.problems.append(Problem(ns.prefix, f"{why}: its {REDIS.units(len(ns.blocks))} cannot be checked",
                                           "left in place"))
            continue
        if ns.blocks and client.reads_touch() and VERIFY_TOUCH_NOTE not in report.notes:
            report.notes.append(VERIFY_TOUCH_NOTE)
        rank_digests = ns.namespace.rank_digests()
        bad: list[bytes] = []
        for batch in _read_batches(client, ns.blocks, ns.world, ns.payload_bound()):
            for name, value in batch:
                if value is None:
                    report.vanished += 1
                    continue
                if isinstance(value, str):  # not read: its size is not what its header says
                    report.files_checked += 1
                    bad.append(name)
                    report.problems.append(Problem(name.decode(), value, bad_action))
                    continue
                report.files_checked += 1
                report.bytes_checked += len(value)
                reason = check_value(value, rank_digests, ns.space.block_key_of(name), ns.world, sealer, report)
                if reason is None:
                    report.files_ok += 1
                    continue
                bad.append(name)
                report.problems.append(Problem(name.decode(), reason, bad_action))
        if delete and bad:
            for chunk in _batches(bad):
                client.unlink(*chunk)
    return report


def _read_batches(
    client, names: Sequence[bytes], world: int, payload_max: int
) -> Iterator[list[tuple[bytes, bytes | str | None]]]:
    """The values of ``names`` a few at a time, bounded in bytes per trip: ``(name, value)``, value
    None when the key vanished, or a reason (str) instead of a value that was not read because its
    first header announces a payload longer than ``payload_max`` (the namespace's block size) or
    its length (``STRLEN``) is not ``world`` records of that payload."""
    for batch in _batches(names, 64):
        pipe = client.pipeline(transaction=False)
        for name in batch:
            pipe.strlen(name)
            pipe.getrange(name, 0, HEADER_LEN - 1)
        replies = pipe.execute(raise_on_error=False)
        group: list[bytes] = []
        group_sizes: list[int] = []
        skipped: list[tuple[bytes, bytes | str | None]] = []
        total = 0
        for name, size, head in zip(batch, replies[0::2], replies[1::2]):
            if not isinstance(size, int) or size == 0:
                skipped.append((name, None if size == 0 else f"unreadable: {type(size).__name__}"))
                continue
            why = _size_problem(size, head, world, payload_max)
            if why is not None:
                skipped.append((name, why))
                continue
            if group and total + size > READ_BATCH_BYTES:
                yield list(zip(group, _get_bounded(client, group, group_sizes)))
                group, group_sizes, total = [], [], 0
            group.append(name)
            group_sizes.append(size)
            total += size
        if group:
            yield list(zip(group, _get_bounded(client, group, group_sizes)))
        if skipped:
            yield skipped


def _size_problem(size: int, head: object, world: int, payload_max: int) -> str | None:
    """Why a value of ``size`` bytes whose first ``HEADER_LEN`` bytes are ``head`` is not read, or None."""
    if not isinstance(head, bytes):
        return f"unreadable: {type(head).__name__}"
    try:
        header = decode_header(head)
    except CorruptBlockError as exc:
        return str(exc)
    if header.payload_len > payload_max:
        return (f"header claims {header.payload_len} payload bytes: more than the {payload_max} of this "
                "namespace's records (its config); not read")
    expected = world * (HEADER_LEN + header.payload_len)
    if size != expected:
        return f"value of {size} bytes; its header announces {world} record(s) of {expected} bytes in all (not read)"
    return None


def _get_bounded(client, names: Sequence[bytes], sizes: Sequence[int]) -> list[bytes | None]:
    """The values of ``names``, each read with ``GETRANGE`` up to the size found before and one byte
    more, so a value that grew since shows without being read whole; None: gone."""
    pipe = client.pipeline(transaction=False)
    for name, size in zip(names, sizes):
        pipe.getrange(name, 0, size)
    return [v if isinstance(v, bytes) and v else None for v in pipe.execute(raise_on_error=False)]


def check_value(value: bytes, rank_digests: list[bytes], key: bytes | None, world: int, sealer: Sealer | None,
                report: VerifyReport) -> str | None:
    """Why ``value`` (a whole block value of ``world`` records, read from a Redis key or an S3 object)
    is not ``key``'s block in the namespace of ``rank_digests``, or None; sealed records without
    ``sealer`` are counted in ``report.sealed_unchecked``, under a retired key in ``report.retired``."""
    from kvtier.tiers.blockfile import HEADER_LEN, decode_header

    if key is None:
        return "not a block key"
    if len(value) % world or len(value) // world <= HEADER_LEN:
        return f"value of {len(value)} bytes is not {world} block records"
    payload = len(value) // world - HEADER_LEN
    scratch = [memoryview(bytearray(payload)) for _ in range(world)]
    try:
        header = decode_header(value[:HEADER_LEN])
        if sealer is None and header.sealed:  # no key to check it with: never deleted for want of one
            report.sealed_unchecked += 1
            return None
        decode_value(value, scratch, rank_digests=rank_digests, key=key, sealer=sealer or PLAIN)
    except CorruptBlockError as exc:
        return str(exc)
    if sealer is not None and sealer.key_state(header) is KeyState.RETIRED:
        report.retired[header.key_id.hex()] = report.retired.get(header.key_id.hex(), 0) + 1
    return None


def _not_sealed_under(client, names: Sequence[bytes], key_id: bytes) -> list[bytes]:
    """The values of ``names`` whose first record is not sealed under fleet key ``key_id`` (every
    rank's record of a value is written at once, under one key)."""
    from kvtier.tiers.blockfile import HEADER_LEN, decode_header

    out: list[bytes] = []
    for batch in _batches(names):
        pipe = client.pipeline(transaction=False)
        for name in batch:
            pipe.getrange(name, 0, HEADER_LEN - 1)
        for name, head in zip(batch, pipe.execute(raise_on_error=False)):
            if not isinstance(head, bytes) or not head:
                continue  # gone meanwhile (or an error: left alone)
            try:
                header = decode_header(head)
            except CorruptBlockError:
                out.append(name)
                continue
            if not (header.sealed and header.key_id == key_id):
                out.append(name)
    return out


KEPT = -1
GONE = -2
RECHECK_LUA = f"""\
local idle = redis.call('OBJECT', 'IDLETIME', KEYS[1])
if not idle then return {GONE} end
if idle <= tonumber(ARGV[1]) then return {KEPT} end
local size = redis.pcall('STRLEN', KEYS[1])
if type(size) ~= 'number' then size = 0 end
if redis.call('UNLINK', KEYS[1]) == 0 then return {GONE} end
return size
"""
"""``purge --older-than``'s unlink of one block key (``KEYS[1]``), atomic on the server: its idle time
read again (``OBJECT IDLETIME``, never a use) and, only if still more than the cutoff (``ARGV[1]``,
seconds), its length (``STRLEN``; 0 for a value that is not a string) and ``UNLINK``. Returns the
length removed, :data:`KEPT` (used since its age was read: nothing else of it read) or :data:`GONE`
(no such key). One key a call (``EVALSHA``, pipelined). No shebang line: a Redis older than 7.0 runs
it, and as such a script it is not refused on a server at ``maxmemory`` (``UNLINK`` frees memory)."""
RECHECK_NOTE = ("--older-than: blocks were unlinked without their idle time being read again at the unlink (the "
                "server refused the script that does it: {why}), so a block used since its age was read went too")


def purge_remote(
    target: RemoteTarget, selection: PurgeSelection, *, dry_run: bool = False, now: float | None = None
) -> PurgeReport:
    """Unlink what ``selection`` selects. There is no quarantine on a Redis server (bad values are
    deleted where they are found): ``--quarantine`` is a ValueError. Ages (``OBJECT IDLETIME``) are
    read before anything else of a block, and ``--retired`` reads headers only of the blocks old
    enough. With ``--older-than`` each block's age is read again where it is unlinked, atomically on
    the server (:data:`RECHECK_LUA`): a block an engine read or rewrote since is kept and counted
    ``skipped``, as a disk root's purge keeps one; a server that refuses the script gets the plain
    unlink, and the report a note saying why (:class:`_Recheck`). What is counted as removed is what
    ``UNLINK`` removed, with the ``STRLEN`` read just before it in the same script or pipeline (a
    dry run reads no value: sizes as :func:`inspect_remote` measures them, and nothing is read
    again). A namespace's config key goes only with the whole namespace (``--all``,
    ``--namespace``, ``--model``), and only if nothing else of it is left (no block, no stray key,
    scanned again after the unlinks: an engine that wrote meanwhile keeps it)."""
    selection.validate(REDIS)
    client = target.client()
    report = PurgeReport(target.shown, dry_run, store=REDIS.name)
    exact = not dry_run or not client.reads_touch()
    recheck = _Recheck(client, selection.older_than, report.notes) if selection.older_than is not None else None
    for ns in purged_namespaces(_discover(client, target.key_prefix), selection, target.shown):
        result = NamespacePurge(ns.prefix)
        victims = list(ns.blocks)
        if selection.older_than is not None:  # first: nothing of these blocks read yet
            idle = _idle_seconds(client, victims)
            victims = [name for name, seconds in zip(victims, idle)
                       if seconds is not None and seconds > selection.older_than]
        if selection.retired_except is not None:
            if victims and client.reads_touch() and RETIRED_TOUCH_NOTE not in report.notes:
                report.notes.append(RETIRED_TOUCH_NOTE)
            victims = _not_sealed_under(client, victims, selection.retired_except)
        if dry_run:
            if victims and not exact and MEMORY_NOTE not in report.notes:
                report.notes.append(MEMORY_NOTE)
            result.blocks = result.files = len(victims)
            result.bytes = sum(_sizes(client, victims, exact))
        else:
            _unlink_counted(client, victims, result, recheck)
        whole = selection.whole_namespaces and len(victims) == len(ns.blocks) and not ns.others
        if whole and ns.config_key is not None and not result.errors:
            result.config_removed = True if dry_run else _drop_config(client, ns)
        report.namespaces.append(result)
    return report


class _Recheck:
    """The age re-check of one ``purge --older-than`` (one client, the command's thread): runs
    :data:`RECHECK_LUA` on each key and counts what it did. ``refused``: why the server refused the
    script (``SCRIPT`` / ``EVALSHA`` not allowed to the ACL user, unknown on this server, or an error
    of the script such as ``OBJECT IDLETIME`` refused under an LFU policy), None while it has not;
    from the first refusal on, every key goes the plain way (:func:`_unlink_counted`), and
    ``notes`` (the report's) gets :data:`RECHECK_NOTE` once."""

    def __init__(self, client, older_than: float, notes: list[str]) -> None:
        self.client = client
        self.script = client.register_script(RECHECK_LUA)  # only its SHA1: loaded by the first pipeline
        self.cutoff = repr(float(older_than))
        self.notes = notes
        self.refused: str | None = None

    def unlink(self, names: Sequence[bytes], result: NamespacePurge) -> list[bytes]:
        """Unlink those of ``names`` still older than the cutoff (one pipeline), counting in
        ``result`` the removed ones (blocks, bytes) and the kept ones (``skipped``); returns those
        the script could not check, for the plain way."""
        if self.refused is not None:
            return list(names)
        with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                self.script(keys=[name], args=[self.cutoff], client=pipe)
            try:
                replies = pipe.execute(raise_on_error=False)
            except redis.ResponseError as exc:  # SCRIPT EXISTS / LOAD, sent before the pipeline, refused
                self._refuse(exc)
                return list(names)
        left: list[bytes] = []
        for name, reply in zip(names, replies):
            if not isinstance(reply, int):  # an error reply: this key is not checked
                self._refuse(reply)
                left.append(name)
            elif reply == KEPT:
                result.skipped += 1
            elif reply != GONE:
                _removed(result, reply)
        return left

    def _refuse(self, error: object) -> None:
        if self.refused is None:
            text = str(error).strip().split("\n", 1)[0].split(". ", 1)[0]  # its first sentence
            self.refused = (text or type(error).__name__)[:200]
            self.notes.append(RECHECK_NOTE.format(why=self.refused))


def _unlink_counted(client, names: Sequence[bytes], result: NamespacePurge, recheck: _Recheck | None = None) -> None:
    """UNLINK ``names``: through ``recheck`` where given (each key's age read again in the script that
    unlinks it), else (and for the keys ``recheck`` could not check) each after its ``STRLEN`` in the
    same pipeline (the value's length just before it goes: reading it then is no use that could
    matter). Counts in ``result`` the keys removed and their bytes, as ``skipped`` those the re-check
    kept, and as errors (``failed``) those UNLINK refused; a key gone meanwhile is none of these."""
    for batch in _batches(names):
        plain = recheck.unlink(batch, result) if recheck is not None else batch
        if not plain:
            continue
        pipe = client.pipeline(transaction=False)
        for name in plain:
            pipe.strlen(name)
            pipe.unlink(name)
        replies = pipe.execute(raise_on_error=False)
        for name, size, gone in zip(plain, replies[0::2], replies[1::2]):
            if isinstance(gone, Exception):
                result.errors += 1
                result.failed.append(name.decode(errors="replace"))
            elif gone:
                _removed(result, size if isinstance(size, int) else 0)


def _removed(result: NamespacePurge, size: int) -> None:
    """Count one block key unlinked, of ``size`` bytes (a Redis value holds every rank's record)."""
    result.blocks += 1
    result.files += 1
    result.bytes += size


def _drop_config(client, ns: _RemoteNamespace) -> bool:
    """Unlink the namespace's config key if nothing else of the namespace is left (scanned now);
    True if it was removed."""
    if any(name != ns.config_key for name in _scan(client, ns.space.base + b"*")):
        return False
    return bool(client.unlink(ns.config_key))


__all__ = ["AGE_BUCKETS", "RemoteTarget", "inspect_remote", "is_remote", "purge_remote", "verify_remote"]
