"""kvtier_redis behind vLLM's own TieringOffloadingManager, against a real redis-server, without an
engine (tests/support/native_rig.py): a second engine is served what the first stored, the first
lookup of an unknown key answers RETRY while kvtier probes the server, a server that stops costs
only misses, and kvtier's operator tools read what the tier wrote.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from support.native_rig import NativeRig, native_env  # noqa: F401  (pytest fixture)
from support.redis_server import redis_factory  # noqa: F401  (pytest fixture)
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvtier.cli.main import main


@pytest.fixture
def model(native_env):  # noqa: F811
    return native_env


def redis_tier(server) -> dict:
    return {"type": "kvtier_redis", "url": server.url(), "timeout_s": 0.5, "connect_timeout_s": 0.5}


def test_a_second_engine_is_served_from_redis(model, redis_factory):  # noqa: F811
    server = redis_factory()
    first = NativeRig(model, [redis_tier(server)])
    keys, rows = first.store_prompt(1, 3)

    second = NativeRig(model, [redis_tier(server)])
    context = ReqContext(req_id="probe")
    second.manager.on_new_request(context)
    assert second.manager.lookup(keys[0], context) is LookupResult.RETRY  # asks the server first
    second.manager.on_request_finished(context)
    assert second.fetch(keys) == second.stored_part(rows)
    first.close()
    second.close()


def test_a_stopped_server_costs_only_misses(model, redis_factory):  # noqa: F811
    server = redis_factory()
    rig = NativeRig(model, [redis_tier(server)])
    keys, rows = rig.store_prompt(2, 2)
    server.kill()
    rig.forget_cpu_tier()
    assert rig.fetch(keys) == [None, None]
    later, _ = rig.store_prompt(3, 2)  # stores fail or are dropped: no exception, no stall
    store = rig.tiers[0]._store
    assert store.counts["stores_dropped"] + store.counts["store_errors"] == 2
    rig.forget_cpu_tier()
    assert rig.fetch(later) == [None, None]
    rig.close()


def test_operator_tools_read_what_the_tier_wrote(model, redis_factory):  # noqa: F811
    server = redis_factory()
    rig = NativeRig(model, [redis_tier(server)])
    rig.store_prompt(4, 3)
    rig.close()
    runner = CliRunner()
    inspected = runner.invoke(main, ["inspect", server.url(), "--json"])
    assert inspected.exit_code == 0, inspected.output
    (space,) = json.loads(inspected.output)["namespaces"]
    assert space["model_name"] == str(model)
    verified = runner.invoke(main, ["verify", server.url()])
    assert verified.exit_code == 0 and "3" in verified.output, verified.output
    purged = runner.invoke(main, ["purge", server.url(), "--all"])
    assert purged.exit_code == 0, purged.output
