"""kvtier's connector against vLLM's MultiConnector, without an engine (the real-engine cases are in
tests/e2e/test_multi_e2e.py): vLLM's own MultiConnector class rebuilds kvtier's stats by name, and the
parts of MultiConnector kvtier's behaviour as a child rests on are the same in vLLM 0.32 (installed)
and 0.33 (its released files, scripts/fetch_vllm033.sh), so an upgrade that changes them fails here
instead of silently (docs/multiconnector.md says what each one means for kvtier).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

MULTI = "distributed/kv_transfer/kv_connector/v1/multi_connector.py"
VLLM033 = Path(sys.prefix) / "kvtier-vllm-0.33.0" / "vllm"

RELIED_ON = (
    "get_num_new_matched_tokens",  # every child asked in order; the first with hits is the loader
    "update_state_after_alloc",  # the others get 0 external tokens
    "get_external_cache_hit_sources",  # the loader's sources only
    "build_connector_meta",  # each child's own metadata
    "bind_connector_metadata",
    "handle_preemptions",
    "update_connector_output",  # each child's own worker metadata
    "build_connector_worker_meta",
    "get_transfer_results",  # finished_sending counted per child (extra_async_saves); failed_recving unioned
    "_aggregate_request_finished",  # delayed frees counted per child; kv_transfer_params merged
    "request_finished_all_groups",
    "take_events",  # every child's KV events, in child order
    "reset_cache",  # every child's
    "get_kv_connector_stats",  # stats keyed by the child's class name
    "build_kv_connector_stats",  # ... rebuilt by that name through KVConnectorFactory
    "build_prom_metrics",  # Prometheus metrics per child class
    "all_children_support_hma",
    "_get_connector_classes_and_configs",  # each child's own kv_transfer_config (a shallow copy of VllmConfig)
)


def test_multiconnector_rebuilds_kvtiers_stats_by_name():
    """vLLM's logging process rebuilds a MultiConnector's stats from each child's class name; an
    unregistered KVTierConnector stopped the engine at the first stats interval (ValueError)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvtier.core.stats import KVTierStats
    from kvtier.vllm.connector import KVTierConnector  # (importing it registers its name)
    from kvtier.vllm.metadata import KVTierConnectorStats
    from kvtier.vllm.native.plugin import register

    register()  # kvtier's plugin, run in every vLLM process, registers it too: no error
    register()
    assert KVConnectorFactory.get_connector_class_by_name("KVTierConnector") is KVTierConnector
    sent = KVTierStats(lookups=3, hit_tokens_host=96).as_dict()  # what crosses processes: plain dicts
    rebuilt = MultiConnector.build_kv_connector_stats(data={"KVTierConnector": sent})
    assert isinstance(rebuilt.data["KVTierConnector"], KVTierConnectorStats)
    assert rebuilt.reduce()["KVTierConnector"]["hit_tokens_host"] == 96


def _methods(path: Path) -> dict[str, str]:
    module = ast.parse(path.read_text())
    (cls,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "MultiConnector"]
    return {n.name: ast.dump(n) for n in cls.body if isinstance(n, ast.FunctionDef)}


def test_what_kvtier_relies_on_in_multiconnector_is_unchanged_in_033():
    import vllm

    if not (VLLM033.parent / ".complete").is_file():
        pytest.fail(f"vLLM 0.33's released files are not at {VLLM033.parent}: run scripts/install.sh --test",
                    pytrace=False)
    ours = _methods(Path(vllm.__file__).parent / MULTI)
    theirs = _methods(VLLM033 / MULTI)
    changed = [name for name in RELIED_ON if ours.get(name) != theirs.get(name)]
    assert not [name for name in RELIED_ON if name not in ours], "0.32's MultiConnector lost a method"
    assert not changed, f"vLLM 0.33 changed MultiConnector.{changed}: check docs/multiconnector.md against it"


DOCS = Path(__file__).resolve().parent.parent / "docs" / "multiconnector.md"


def recipe_lines() -> list[list[str]]:
    """The command lines of docs/multiconnector.md's disaggregated-prefill recipe (its first
    indented block after the heading), as argv lists."""
    import shlex

    text = DOCS.read_text().split("## Disaggregated prefill", 1)[1]
    block = []
    for line in text.splitlines()[1:]:
        if line.startswith("    ") or (block and not line.strip()):
            block.append(line[4:])
        elif block:
            break
    commands = "\n".join(line for line in block if not line.lstrip().startswith("#")).replace("\\\n", " ")
    return [shlex.split(command) for command in commands.split("\n\n") if command.strip()]


def test_the_disaggregated_prefill_recipe_is_well_formed_for_vllm_and_doctor():
    """Checked by construction only (NIXL needs CUDA): vLLM's own config classes and connector factory
    accept both lines of the recipe, and kvtier doctor finds no error and no warning in them."""
    import json

    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvtier.doctor.audit import audit
    from kvtier.vllm.connector import KVTierConnector

    lines = recipe_lines()
    assert len(lines) == 2, lines  # prefill, decode
    for argv in lines:
        transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        config = KVTransferConfig(**transfer)
        children = config.kv_connector_extra_config["connectors"]
        classes = [KVConnectorFactory.get_connector_class(KVTransferConfig(**c, engine_id="e")) for c in children]
        assert [c.__name__ for c in classes] == ["NixlPullConnector", "KVTierConnector"]  # (NixlConnector's class)
        assert classes[1] is KVTierConnector and config.kv_load_failure_policy == "recompute"
        assert MultiConnector.all_children_support_hma(config)
        assert not MultiConnector.requires_piecewise_for_cudagraph(config.kv_connector_extra_config)
        findings = [(f.severity, f.code, f.title) for f in audit(argv) if f.severity != "info"]
        assert not findings, findings
