"""Config: OffloadingConnector keys accepted with their meaning; every error names the key."""

import logging
import os
import stat

import pytest

from kvtier.core.config import ConfigError, KVTierConfig, SpecName, parse_max_offload_tokens
from kvtier.policy.base import PolicyName


def test_minimal_config_has_documented_defaults():
    config = KVTierConfig.from_extra_config({"cpu_bytes_to_use": 10**9})
    assert config.cpu_bytes_to_use == 10**9
    assert config.eviction_policy is PolicyName.LRU
    assert config.store_threshold == 0 and config.max_tracker_size == 64_000
    assert config.offload_prompt_only is True and config.spec_name is SpecName.CPU
    assert config.store_loaded_elsewhere is False and config.keep_tiers_on_reset is False
    assert config.disk is None and config.block_size is None


def test_offloading_connector_keys_with_fs_tier(tmp_path):
    config = KVTierConfig.from_extra_config(
        {
            "cpu_bytes_to_use": 2**30,
            "block_size": 256,
            "eviction_policy": "arc",
            "store_threshold": 2,
            "max_tracker_size": 10,
            "offload_prompt_only": False,
            "spec_name": "TieringOffloadingSpec",
            "self_describing_kv_events": True,
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(tmp_path / "kv"), "n_read_threads": 4, "n_write_threads": 2,
                 "capacity_bytes": 10**9}
            ],
        }
    )
    assert config.eviction_policy is PolicyName.ARC and config.block_size == 256
    assert config.disk.root_dir == tmp_path / "kv" and config.disk.n_read_threads == 4
    assert config.disk.capacity_bytes == 10**9 and (tmp_path / "kv").is_dir()
    assert config.offload_block_tokens(128) == 256


def test_fs_tier_without_spec_name_implies_tiering_and_default_capacity(tmp_path):
    config = KVTierConfig.from_extra_config(
        {"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}]}
    )
    assert config.spec_name is SpecName.TIERING
    assert config.disk.capacity_bytes > 0 and config.disk.n_write_threads == 16


@pytest.mark.parametrize(
    "extra, names",
    [
        ({}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1, "cpu_byte_to_use": 1}, "cpu_byte_to_use"),
        ({"cpu_bytes_to_use": "8GB"}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1, "eviction_policy": "fifo"}, "eviction_policy"),
        ({"cpu_bytes_to_use": 1, "store_threshold": -1}, "store_threshold"),
        ({"cpu_bytes_to_use": 1, "offload_prompt_only": "yes"}, "offload_prompt_only"),
        ({"cpu_bytes_to_use": 1, "store_loaded_elsewhere": 1}, "store_loaded_elsewhere"),
        ({"cpu_bytes_to_use": 1, "keep_tiers_on_reset": "no"}, "keep_tiers_on_reset"),
        ({"cpu_bytes_to_use": 1, "spec_name": "Nope"}, "spec_name"),
        ({"cpu_bytes_to_use": 1, "secondary_tiers": {"type": "fs"}}, "secondary_tiers"),
        ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "gcs"}]}, "secondary_tiers[0].type"),
        ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "fs"}]}, "secondary_tiers[0].root_dir"),
        ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "fs", "root_dir": "/tmp", "size": 1}]}, "size"),
        (
            {"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "fs", "root_dir": "/tmp", "n_read_threads": 0}]},
            "secondary_tiers[0].n_read_threads",
        ),
        (
            {"cpu_bytes_to_use": 1, "spec_name": "CPUOffloadingSpec",
             "secondary_tiers": [{"type": "fs", "root_dir": "/tmp"}]},
            "spec_name",
        ),
    ],
)
def test_bad_config_names_the_key(extra, names):
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        KVTierConfig.from_extra_config(extra)


def test_unwritable_root_dir_is_rejected(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="root_dir"):
        KVTierConfig.from_extra_config(
            {"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "fs", "root_dir": str(blocker / "sub")}]}
        )


@pytest.mark.parametrize("group_access, mode", [(False, 0o700), (True, 0o2770)])
def test_a_missing_root_and_its_parents_are_created_owner_only_whatever_the_umask(tmp_path, group_access, mode):
    """docs/security.md: directories kvtier creates are 0700 (2770 with group_access); the root the
    connector creates at start-up was the umask's 0755 before."""
    root = tmp_path / "new" / "parent" / "kv"
    old = os.umask(0o022)
    try:
        config = KVTierConfig.from_extra_config({"cpu_bytes_to_use": 1, "secondary_tiers": [
            {"type": "fs", "root_dir": str(root), "capacity_bytes": 1, "group_access": group_access}]})
    finally:
        os.umask(old)
    assert config.disk.root_dir == root
    for made in (tmp_path / "new", tmp_path / "new" / "parent", root):
        assert stat.S_IMODE(made.stat().st_mode) == mode, (made, oct(made.stat().st_mode))


def test_checking_a_config_creates_nothing(tmp_path):
    """create_dirs=False (kvtier serve before vLLM starts, kvtier doctor): a missing root must be
    creatable, and nothing is made; one that cannot be created is refused, naming what is in the way."""
    root = tmp_path / "new" / "kv"
    config = KVTierConfig.from_extra_config(
        {"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}, create_dirs=False)
    assert config.disk.root_dir == root and config.disk.capacity_bytes > 0  # the free space where it will be
    assert not (tmp_path / "new").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=f"cannot be created: {blocker} is not a directory"):
        KVTierConfig.from_extra_config({"cpu_bytes_to_use": 1, "secondary_tiers": [
            {"type": "fs", "root_dir": str(blocker / "a" / "kv")}]}, create_dirs=False)


def test_block_size_must_be_a_multiple_of_the_engine_block():
    config = KVTierConfig.from_extra_config({"cpu_bytes_to_use": 1, "block_size": 200})
    with pytest.raises(ConfigError, match="block_size.*multiple.*256"):
        config.offload_block_tokens(128)


def test_config_is_frozen():
    config = KVTierConfig.from_extra_config({"cpu_bytes_to_use": 1})
    with pytest.raises(Exception):
        config.cpu_bytes_to_use = 2


@pytest.mark.parametrize("raw, expected", [(0, 0), (512, 512), (None, None)])
def test_max_offload_tokens_valid(raw, expected):
    assert parse_max_offload_tokens({"max_offload_tokens": raw} if raw is not None else None) == expected


@pytest.mark.parametrize("raw", [True, -1, 1.5, "10"])
def test_max_offload_tokens_invalid_warns_and_means_no_cap(raw, caplog):
    with caplog.at_level(logging.WARNING):
        assert parse_max_offload_tokens({"max_offload_tokens": raw}, "req-1") is None
    assert "max_offload_tokens" in caplog.text and "req-1" in caplog.text
