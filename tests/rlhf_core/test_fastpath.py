"""The speed seam (`rlhf_core.fastpath`): the plan's decisions for the tiny world, the benchmarks'
real-proportion shapes and a CUDA device (no GPU needed: the plan reads a config, a device name
and a dtype), every decision switched off from the config, and the plan in summary.json."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from conftest import REPO
from transformers import Qwen3Config

import rlhf_core.fastpath as fastpath
from rlhf_core.fastpath import SpeedConfig, choose_allocator, plan_speed, speed_plan
from rlhf_core.lean import LEAN_RMSNORM_CLASSES
from rlhf_core.models import ModelConfig, load_policy


def bench_models() -> dict[str, dict[str, int]]:
    """`benchmarks.workload.BENCH_MODELS`, read from its source (the benchmarks package is not
    importable under pytest: see tests/test_benchmark_flops.py)."""
    tree = ast.parse((REPO / "benchmarks/workload.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "BENCH_MODELS":
            return ast.literal_eval(node.value)
    raise AssertionError("BENCH_MODELS not found in benchmarks/workload.py")


def bench_config(name: str) -> Qwen3Config:
    shape = bench_models()[name]
    heads = shape["num_attention_heads"]
    return Qwen3Config(vocab_size=50_000, head_dim=shape["hidden_size"] // heads, **shape)


def cpu_plan(config, dtype=torch.bfloat16, attention="sdpa", **switches):
    return plan_speed(
        config, device="cpu", dtype=dtype, attention=attention, speed=SpeedConfig(**switches),
        allocator="retain",
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _run_switches(monkeypatch):
    """A trainer run sets the process's switches; restore them after each test."""
    monkeypatch.setattr(fastpath, "_RUN", fastpath._RUN)
    monkeypatch.setattr(fastpath, "_ALLOCATOR", fastpath._ALLOCATOR)


def test_the_tiny_world_keeps_max_length_rows_and_our_cpu_attention():
    model = load_policy(ModelConfig(name_or_path="tiny-qwen3", attention="sdpa"), "cpu")
    plan = speed_plan(model)
    # width 128: a group's extra attention call costs more than the padding it saves
    assert plan.device == "cpu" and plan.dtype == "float32"
    assert plan.layout == "mask" and plan.row_tokens == 0
    assert plan.cpu_attention and plan.short_attention_keys == fastpath.SHORT_ATTENTION_KEYS
    assert not plan.grouped_decode  # no grouped heads to fold
    assert plan.reserve_positions == fastpath.RESERVE_POSITIONS and plan.lean_norms
    assert plan.segment_call_units == fastpath.SEGMENT_CALL_UNITS


def test_real_proportion_shapes_take_segmented_rows_and_keys_by_their_gqa_ratio():
    real = bench_config("real")
    plan = cpu_plan(real)
    assert plan.layout == "segmented" and plan.row_tokens == fastpath.SEGMENTED_ROW_TOKENS
    # 8 query heads over 4 key/value heads: the measured 128 keys
    assert plan.short_attention_keys == 128 and plan.grouped_decode
    assert fastpath.layer_token_macs(real) == 512 * 64 * (2 * 8 + 2 * 4) + 3 * 512 * 1536
    # a shape it was not tuned on: wider, shallower, GQA 4 (12 / 3 heads): segmented rows, and
    # the same key limit (a limit shrinking with GQA, 90 keys here, was slower than 128)
    other = bench_models().get("wide") or {
        "hidden_size": 768, "num_hidden_layers": 16, "num_attention_heads": 12,
        "num_key_value_heads": 3, "intermediate_size": 2304,
    }  # fmt: skip
    plan = cpu_plan(Qwen3Config(vocab_size=50_000, head_dim=64, **other))
    assert plan.layout == "segmented" and plan.short_attention_keys == 128 and plan.grouped_decode
    # depth does not enter: padding and calls are both per layer
    deep = bench_config("real")
    deep.num_hidden_layers = 44
    assert cpu_plan(deep) == cpu_plan(real)
    # the break-even sits between the tiny world's width and `small`'s
    tiny = Qwen3Config(hidden_size=128, intermediate_size=512, head_dim=32,
                       num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    assert cpu_plan(tiny).layout == "mask"
    assert cpu_plan(bench_config("small")).layout == "segmented"


def test_on_cuda_every_cpu_rule_is_off():
    for name in ("real", "small"):
        plan = plan_speed(
            bench_config(name), device="cuda", dtype=torch.bfloat16, attention="sdpa",
            speed=SpeedConfig(),
        )  # fmt: skip
        assert plan.layout == "mask" and plan.row_tokens == 0  # packed rows, no segments
        assert not plan.cpu_attention and not plan.dispatch and plan.short_attention_keys == 0
        assert not plan.grouped_decode and plan.reserve_positions == 0 and not plan.lean_norms
        assert not plan.fill_micro_batches and plan.pair_token_budget(4, 512) == 0
        assert plan.allocator == "torch's (not glibc's)"
    flash = plan_speed(bench_config("real"), device="cuda", dtype=torch.bfloat16,
                       attention="flash_attention_2", speed=SpeedConfig())  # fmt: skip
    assert flash.layout == "flat"
    for engine in ("single", "fsdp2"):  # torch's caching allocator: glibc left alone
        policy = choose_allocator(
            "cuda", engine, enabled=True, mmap_threshold_mib=0.125, glibc=True
        )
        assert policy == "torch's (not glibc's)"


def test_allocator_has_one_owner_and_one_policy():
    # under FSDP2 on the CPU the fixed mmap threshold alone (keeping freed memory turns mmap
    # off, which would cancel it); otherwise freed memory kept; the switch turns both off
    def choose(engine, **kw):
        return choose_allocator("cpu", engine, **{"enabled": True, "mmap_threshold_mib": 0.125,
                                                  "glibc": True, **kw})  # fmt: skip

    assert choose("fsdp2") == "mmap-threshold 0.125 MiB"
    assert choose("fsdp2", mmap_threshold_mib=None) == "glibc defaults"
    assert choose("single") == choose("ddp") == "retain"
    assert choose("single", enabled=False) == choose("fsdp2", enabled=False) == "glibc defaults"
    assert choose("single", glibc=False) == "glibc defaults"


@pytest.mark.parametrize(
    "switch, off",
    [
        ("segmented_rows", lambda p: p.layout == "mask" and p.row_tokens == 0 and p.cpu_attention),
        ("cpu_attention", lambda p: p.layout == "mask" and not p.cpu_attention
         and p.short_attention_keys == 0 and p.grouped_decode),
        ("grouped_decode", lambda p: not p.grouped_decode and p.cpu_attention),
        ("reserved_cache", lambda p: p.reserve_positions == 0),
        ("lean_norms", lambda p: not p.lean_norms),
        ("fill_micro_batches", lambda p: not p.fill_micro_batches
         and p.pair_token_budget(2, 256) == 0),
    ],
)  # fmt: skip
def test_each_decision_switches_off_from_the_config(switch, off):
    config = bench_config("real")
    on = cpu_plan(config)
    assert not off(on)
    assert off(cpu_plan(config, **{switch: False}))


def test_lean_norms_off_restore_the_modules_own_forward():
    model = load_policy(ModelConfig(name_or_path="tiny-qwen3", attention="sdpa"), "cpu")
    norms = [m for m in model.modules() if type(m).__name__ in LEAN_RMSNORM_CLASSES]
    assert norms and all("forward" in vars(m) for m in norms)  # patched by load_policy
    fastpath.start_speed(SpeedConfig(lean_norms=False, allocator=False), "cpu", "single", None)
    plan = fastpath.announce_plan([model])
    assert not plan.lean_norms and plan.allocator == "glibc defaults"
    assert not any("forward" in vars(m) for m in norms)


def test_the_plan_is_printed_and_written_to_summary_json(tiny_sft_dict, tmp_path, capsys):
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train
    from rlhf_core.config import RunArgs

    tiny_sft_dict["train"].update(max_steps=1, evaluate=False, speed={"reserved_cache": False})
    out = tmp_path / "run"
    cfg = SFTConfig.model_validate(tiny_sft_dict)
    assert train(cfg, RunArgs(config_path=Path("t.yaml"), output_dir=out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    speed = summary["speed"]
    assert speed["layout"] == "mask" and speed["device"] == "cpu"
    assert speed["reserve_positions"] == 0 and speed["cpu_attention"] is True
    assert "speed plan (cpu, float32): layout mask" in capsys.readouterr().out
