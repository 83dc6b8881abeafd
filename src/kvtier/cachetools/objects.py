"""``kvtier inspect / verify / purge`` on an S3 tier (an ``s3://BUCKET/PREFIX`` URL instead of a directory).

The same reports as for a disk root or a Redis server (:class:`~kvtier.cachetools.inventory.Inventory`,
:class:`~kvtier.cachetools.verify.VerifyReport`, :class:`~kvtier.cachetools.purge.PurgeReport`), from
the tier's own object keys (:mod:`kvtier.tiers.s3.keys`) and values (the Redis tier's, checked by
:func:`~kvtier.cachetools.remote.check_value`): a namespace is a ``PREFIX/<model>_<digest16>/``
folder with its ``config.json`` and its blocks; any other object under the prefix is a stray
(listed by inspect, bounded; one in a namespace folder keeps its config.json from being purged).
Everything comes from one paginated ``LIST`` of the prefix (keys, sizes, LastModified): ages are by
last write (an object store keeps no access time).
Verify reads every block object of the selected namespaces with GETs bounded by the object's listed
size and by the namespace's block size from its config.json (as
:func:`~kvtier.cachetools.verify.config_payload_bound` bounds a record: an object larger than that is
bad without being read) and deletes the bad ones unless told not to. A config.json is judged as a
disk root's (:func:`~kvtier.cachetools.scan.parse_config`): one that does not parse or that names
another namespace than its folder's digest is reported and the folder's objects are left in place
unread, as are those of a folder without a config.json of this key spec. Purge deletes what it
selects (bulk DELETE, 1000 keys per request); a folder's config.json goes only with the whole
namespace, and only while nothing else of it is left (listed again after its blocks went). Safe
while engines use the prefix: an engine that loses a block sees a miss and forgets it at its next
listing. A store that does not answer fails the command with one line saying where and why
(:class:`~kvtier.tiers.s3.client.StoreUnreachable`).

Credentials come from the standard AWS chain, as the tier's (:mod:`kvtier.tiers.s3.client`); never
printed. Called by :mod:`kvtier.cli.cache` in the ``kvtier`` command's process, one thread.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.cachetools.inventory import Inventory, NamespaceInventory, age_bucket
from kvtier.cachetools.purge import NamespacePurge, PurgeReport, PurgeSelection
from kvtier.cachetools.remote import check_value
from kvtier.cachetools.remote_scan import Stray, _RemoteNamespace, purged_namespaces, verified_namespaces
from kvtier.cachetools.scan import ParsedConfig, parse_config
from kvtier.cachetools.stores import S3, TARGET
from kvtier.cachetools.verify import Problem, VerifyReport
from kvtier.core.fleet_key import AuthConfig
from kvtier.core.keys import describe_config
from kvtier.core.tier_config import S3_URL_SCHEMES, S3TierConfig, TierType, parse_tier
from kvtier.tiers.blockfile import HEADER_LEN, CorruptBlockError, decode_header
from kvtier.tiers.disk.layout import CONFIG_MAX_BYTES
from kvtier.tiers.s3.keys import CONFIG_NAME, folder_of, namespace_folder, parse_block
from kvtier.tiers.sealing import Sealer

DELETE_BATCH = 1000


def is_s3(target: str) -> bool:
    """Whether ``target`` names an S3 tier (``s3://BUCKET/PREFIX``)."""
    return target.split("://", 1)[0] in S3_URL_SCHEMES and "://" in target


@dataclass(frozen=True)
class ObjectTarget:
    """How to reach an S3 tier: its entry (URL, endpoint, region, CA bundle, profile); no credential."""

    config: S3TierConfig

    @classmethod
    def of(cls, url: str, *, endpoint: str | None = None, region: str | None = None, ca_bundle: str | None = None,
           profile: str | None = None) -> ObjectTarget:
        """ConfigError naming the option (as ``'target.KEY'``: :data:`~kvtier.cachetools.stores.TARGET`)
        when one is malformed."""
        raw = {"url": url, "endpoint": endpoint, "region": region, "ca_bundle": ca_bundle, "profile": profile}
        config = parse_tier({k: v for k, v in raw.items() if v is not None}, TierType.S3, TARGET)
        assert isinstance(config, S3TierConfig)
        return cls(config)

    @property
    def shown(self) -> str:
        return self.config.location

    def store(self):
        """The store, once it answered a LIST of the prefix: ConfigError when it refuses the
        credentials, has no such bucket or an untrusted certificate (or the CA bundle is no PEM
        file); :class:`~kvtier.tiers.s3.client.StoreUnreachable` when it does not answer."""
        from kvtier.tiers.s3.client import make_store, require_access

        store = make_store(self.config, TARGET)
        require_access(self.config, TARGET, store)
        return store


@dataclass
class _ObjectNamespace(_RemoteNamespace):
    """One namespace folder: ``blocks`` are its block objects' keys; ``sizes`` / ``written`` theirs;
    ``config_key`` its config.json's key."""

    folder: str = ""
    sizes: dict[str, int] = field(default_factory=dict)
    written: dict[str, float] = field(default_factory=dict)  # LastModified, seconds since the epoch

    @property
    def prefix(self) -> str:
        return self.folder

    @property
    def model(self) -> str | None:
        return self.folder.rsplit("_", 1)[0]


def _discover(store, prefix: str, stray: Stray | None = None) -> list[_ObjectNamespace]:
    """Every namespace folder under ``prefix`` (by its config.json, or by its blocks alone); objects
    under the prefix that are neither a folder's config.json nor its blocks go to ``stray``."""
    import obstore

    folders: dict[str, _ObjectNamespace] = {}
    configs: dict[str, str] = {}
    by_folder: dict[str, list[dict]] = defaultdict(list)
    others: dict[str, int] = defaultdict(int)
    for chunk in obstore.list(store, prefix + "/", chunk_size=1000):
        for meta in chunk:
            path = meta["path"]
            block = parse_block(path, prefix)
            if block is not None:
                by_folder[block.folder].append(meta)
                continue
            folder = namespace_folder(path, prefix)
            if folder is not None:
                configs[folder] = path
                continue
            folder = folder_of(path, prefix)
            if folder is not None:
                others[folder] += 1
            if stray is not None:
                stray(path, "not a block object or config.json of its namespace folder" if folder is not None
                      else "not in a namespace folder (<model>_<digest16>/)")
    for folder in sorted(set(by_folder) | set(configs)):
        digest16 = folder.rsplit("_", 1)[1]
        parsed = (_read_config(store, configs[folder], digest16) if folder in configs
                  else ParsedConfig(None, None, None, f"{CONFIG_NAME} missing"))
        metas = sorted(by_folder.get(folder, []), key=lambda m: m["path"])
        folders[folder] = _ObjectNamespace(
            space=None, digest16=digest16, config=parsed.config, namespace=parsed.namespace,
            spec_version=parsed.spec_version, blocks=[m["path"] for m in metas], config_problem=parsed.problem,
            config_key=configs.get(folder), others=others.get(folder, 0), folder=folder,
            sizes={m["path"]: m["size"] for m in metas},
            written={m["path"]: m["last_modified"].timestamp() for m in metas})
    return list(folders.values())


def _read_config(store, path: str, digest16: str) -> ParsedConfig:
    """The folder's config.json, read up to :data:`CONFIG_MAX_BYTES` and one byte more, judged as a
    disk root's (a problem when unreadable, too long, or another namespace's)."""
    import obstore

    try:
        raw = obstore.get(store, path, options={"range": (0, CONFIG_MAX_BYTES + 1)}).bytes().to_bytes()
    except FileNotFoundError:
        return ParsedConfig(None, None, None, f"{CONFIG_NAME} missing")
    if len(raw) > CONFIG_MAX_BYTES:
        return ParsedConfig(None, None, None, f"{CONFIG_NAME} longer than {CONFIG_MAX_BYTES} bytes (not read)")
    return parse_config(raw, digest16, CONFIG_NAME, "its folder name")


def inspect_objects(target: ObjectTarget, *, now: float | None = None) -> Inventory:
    now = time.time() if now is None else now
    store = target.store()
    inventory = Inventory(root=target.shown, scanned_at=now, namespaces=[], store=S3.name)
    for ns in _discover(store, target.config.prefix, inventory.add_stray):
        summary = NamespaceInventory(
            prefix=ns.folder, model=ns.model or "?", digest16=ns.digest16, model_name=ns.model_name,
            layout=describe_config(ns.config) if ns.config is not None else None,
            config_problem=ns.config_problem,
            world=ns.world, older_spec=ns.older_spec)
        summary.complete_blocks = summary.block_files = len(ns.blocks)
        summary.stray_files = ns.others
        summary.block_bytes = sum(ns.sizes.values())
        for written in ns.written.values():
            summary.ages[age_bucket(now - written)] += 1
        summary.last_use = max(ns.written.values(), default=None)
        inventory.namespaces.append(summary)
    return inventory


def verify_objects(target: ObjectTarget, selectors: Sequence[str] = (), *, delete: bool = True,
                   auth: AuthConfig | None = None) -> VerifyReport:
    """Read and check every block object of the selected namespaces (by digest or model); delete
    the bad ones unless ``delete`` is False. As :func:`~kvtier.cachetools.remote.verify_remote`."""
    import obstore

    sealer = Sealer(auth) if auth is not None else None
    store = target.store()
    chosen = verified_namespaces(_discover(store, target.config.prefix), selectors, target.shown)
    report = VerifyReport(root=target.shown, namespaces=[ns.prefix for ns in chosen], store=S3.name)
    bad_action = S3.bad_action if delete else "left in place"
    for ns in chosen:
        why = ns.unchecked
        if why is not None or ns.namespace is None:
            report.problems.append(Problem(ns.prefix, f"{why}: its {S3.units(len(ns.blocks))} cannot be checked",
                                           "left in place"))
            continue
        rank_digests, most = ns.namespace.rank_digests(), ns.value_bound()
        bad: list[str] = []
        for path in ns.blocks:
            size = ns.sizes[path]
            if size > most:
                reason = (f"object of {size} bytes: more than the {most} bytes of this namespace's blocks "
                          f"(its {CONFIG_NAME}); not read")
            elif size % ns.world or size // ns.world <= HEADER_LEN:
                reason = f"object of {size} bytes is not {ns.world} block records (not read)"
            else:
                try:
                    value = obstore.get(store, path, options={"range": (0, size + 1)}).bytes().to_bytes()
                except FileNotFoundError:
                    report.vanished += 1
                    continue
                report.files_checked += 1
                report.bytes_checked += len(value)
                block = parse_block(path, target.config.prefix)
                reason = check_value(value, rank_digests, block.key if block else None, ns.world, sealer, report)
                if reason is None:
                    report.files_ok += 1
                    continue
            bad.append(path)
            report.problems.append(Problem(path, reason, bad_action))
        if delete:
            _delete(store, bad)
    return report


def _delete(store, paths: Sequence[str]) -> None:
    import obstore

    for begin in range(0, len(paths), DELETE_BATCH):
        obstore.delete(store, list(paths[begin:begin + DELETE_BATCH]))


def _not_sealed_under(store, paths: Sequence[str], key_id: bytes) -> list[str]:
    """The objects of ``paths`` whose first record is not sealed under fleet key ``key_id``."""
    import obstore

    out: list[str] = []
    for path in paths:
        try:
            head = obstore.get(store, path, options={"range": (0, HEADER_LEN)}).bytes().to_bytes()
        except FileNotFoundError:
            continue
        try:
            header = decode_header(head)
        except CorruptBlockError:
            out.append(path)
            continue
        if not (header.sealed and header.key_id == key_id):
            out.append(path)
    return out


def purge_objects(target: ObjectTarget, selection: PurgeSelection, *, dry_run: bool = False,
                  now: float | None = None) -> PurgeReport:
    """Delete what ``selection`` selects. There is no quarantine in a bucket (bad objects are
    deleted where they are found): ``--quarantine`` is a ValueError. ``--older-than`` goes by
    LastModified (last write). A folder's config.json goes only with the whole namespace
    (``--all``, ``--namespace``, ``--model``), and only if nothing else of it is left (no block, no
    stray object; listed again after its blocks went: an engine that wrote meanwhile keeps it)."""
    selection.validate(S3)
    now = time.time() if now is None else now
    store = target.store()
    report = PurgeReport(target.shown, dry_run, store=S3.name)
    for ns in purged_namespaces(_discover(store, target.config.prefix), selection, target.shown):
        result = NamespacePurge(ns.prefix)
        victims = list(ns.blocks)
        if selection.older_than is not None:
            victims = [path for path in victims if now - ns.written[path] > selection.older_than]
        if selection.retired_except is not None:
            victims = _not_sealed_under(store, victims, selection.retired_except)
        if not dry_run:
            _delete(store, victims)
        result.blocks = result.files = len(victims)
        result.bytes = sum(ns.sizes[path] for path in victims)
        whole = selection.whole_namespaces and len(victims) == len(ns.blocks) and not ns.others
        if whole and ns.config_key is not None:
            result.config_removed = True if dry_run else _drop_config(store, target.config.prefix, ns)
        report.namespaces.append(result)
    return report


def _drop_config(store, prefix: str, ns: _ObjectNamespace) -> bool:
    """Delete the folder's config.json if nothing else of the folder is left (listed now); True if
    it was deleted."""
    import obstore

    for chunk in obstore.list(store, f"{prefix}/{ns.folder}/", chunk_size=2):
        if any(meta["path"] != ns.config_key for meta in chunk):
            return False
    _delete(store, [ns.config_key])
    return True


__all__ = ["ObjectTarget", "inspect_objects", "is_s3", "purge_objects", "verify_objects"]
