"""SFT end to end on the tiny world: it trains, accumulation is exact, bad input fails clearly,
and a run killed with SIGKILL then resumed reproduces the uninterrupted run bit for bit."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import (
    flash_attention_stand_in,
    metric_series,
    start_module,
    wait_for_checkpoint,
    write_yaml,
)
from transformers import AutoModelForCausalLM

from instruction_tuning.config import SFTConfig
from instruction_tuning.train import main, train
from rlhf_core.config import ConfigError, RunArgs
from rlhf_core.models import load_policy


def losses(run_dir: Path) -> dict[int, float]:
    return metric_series(run_dir, "train/loss")


def run_cfg(data: dict, out: Path) -> int:
    cfg = SFTConfig.model_validate(data)
    return train(cfg, RunArgs(config_path=Path("test.yaml"), output_dir=out))


def test_a_few_steps_change_every_parameter_and_write_the_run_dir(tiny_sft_dict, tmp_path):
    tiny_sft_dict["train"]["eval_every"] = 3
    tiny_sft_dict["tracking"]["plot_every"] = 4  # drawn at line 4 and at the end
    assert run_cfg(tiny_sft_dict, tmp_path / "run") == 0
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "curves.png", "final"):
        assert (run / name).exists(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["skipped_steps"] == 0
    assert all(torch.isfinite(torch.tensor(v)) for v in losses(run).values())
    for key in ("eval/loss", "eval/greedy_exact_match", "eval/sampled_task_score"):
        assert 0 <= summary[key] < float("inf")
    start = load_policy(SFTConfig.model_validate(tiny_sft_dict).model)
    trained = AutoModelForCausalLM.from_pretrained(run / "final")
    before = dict(start.named_parameters())
    for name, param in trained.named_parameters():
        assert not torch.equal(param, before[name]), f"{name} did not change"


def test_lora_run_trains_only_the_adapter(tiny_sft_dict, tmp_path):
    tiny_sft_dict["model"]["lora"] = {"r": 4, "alpha": 8}
    tiny_sft_dict["train"]["max_steps"] = 2
    tiny_sft_dict["data"]["eval"] = None
    assert run_cfg(tiny_sft_dict, tmp_path / "run") == 0
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()


def test_gradient_accumulation_equals_one_big_batch(tiny_sft_dict, tmp_path):
    tiny_sft_dict["data"]["eval"] = None
    tiny_sft_dict["train"]["max_steps"] = 3
    assert run_cfg(tiny_sft_dict, tmp_path / "big") == 0
    tiny_sft_dict["train"]["micro_batch_size"] = 4
    assert run_cfg(tiny_sft_dict, tmp_path / "acc") == 0
    big, acc = losses(tmp_path / "big"), losses(tmp_path / "acc")
    for step in big:
        assert abs(big[step] - acc[step]) < 1e-5
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "big" / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "acc" / "final").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def test_dry_run_trains_nothing(tiny_sft_dict, tmp_path, capsys):
    cfg_path = write_yaml(tmp_path / "sft.yaml", tiny_sft_dict)
    out = tmp_path / "run"
    assert main(["--config", str(cfg_path), "--output-dir", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "name: test_sft" in printed and "would run:  6 steps x 16 rows" in printed
    assert not out.exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["optim"].update(lrr=1e-3), r"unknown key 'optim.lrr'.*allowed keys here: lr,"),
        (lambda d: d["train"].update(batch_size="big"), r"field 'train.batch_size': expected int"),
        (lambda d: d["model"].update(dtype="fp8"), r"field 'model.dtype'"),
    ],
)
def test_bad_yaml_is_a_clear_error(tiny_sft_dict, tmp_path, edit, message):
    edit(tiny_sft_dict)
    cfg_path = write_yaml(tmp_path / "bad.yaml", tiny_sft_dict)
    with pytest.raises(ConfigError, match=message) as info:
        main(["--config", str(cfg_path), "--dry-run"])
    assert str(cfg_path) in str(info.value)


def test_missing_config_and_data_files_name_the_path(tiny_sft_dict, tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*missing.yaml"):
        main(["--config", str(tmp_path / "missing.yaml")])
    tiny_sft_dict["data"]["train"] = {"path": str(tmp_path / "nowhere.jsonl")}
    tiny_sft_dict["data"]["eval"] = None
    cfg_path = write_yaml(tmp_path / "sft.yaml", tiny_sft_dict)
    with pytest.raises(FileNotFoundError, match=r"data.train.path: data file not found"):
        main(["--config", str(cfg_path), "--dry-run"])


def test_set_overrides_reach_the_run(tiny_sft_dict, tmp_path, capsys):
    cfg_path = write_yaml(tmp_path / "sft.yaml", tiny_sft_dict)
    main(
        [
            "--config",
            str(cfg_path),
            "--set",
            "optim.lr=3e-4",
            "--set",
            "train.max_steps=2",
            "--dry-run",
        ]
    )
    printed = capsys.readouterr().out
    assert "lr: 0.0003" in printed and "would run:  2 steps" in printed


# ----------------------------------------------------------------------------- resume


def _resume_config(tiny_sft_dict: dict, tmp_path: Path) -> Path:
    tiny_sft_dict["data"]["eval"] = None
    tiny_sft_dict["train"].update(max_steps=40, batch_size=32)
    tiny_sft_dict["checkpoint"].update(save_every=5, keep_last=3)
    return write_yaml(tmp_path / "sft.yaml", tiny_sft_dict)


# SIGKILL + --resume auto of SFT: tests/test_reliability.py kills an SFT run at six points of a
# checkpoint save and tests/test_fsdp2.py a sharded one, each ending at the uninterrupted weights.


def test_sigterm_saves_and_exits_143(tiny_sft_dict, tmp_path):
    cfg_path = _resume_config(tiny_sft_dict, tmp_path)
    tiny_sft_dict["train"]["max_steps"] = 100_000
    cfg_path = write_yaml(tmp_path / "long.yaml", tiny_sft_dict)
    out = tmp_path / "run"
    proc = start_module(
        "instruction_tuning.train", "--config", str(cfg_path), "--output-dir", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    wait_for_checkpoint(proc, out / "checkpoints" / "checkpoint-5")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    output = proc.stdout.read()
    assert "checkpoint saved" in output and f"--resume {out}" in output
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved and all(name.startswith("checkpoint-") for name in saved)


def test_under_flash_attention_a_micro_batch_is_one_row_packed_by_position_ids(
    tiny_sft_dict, tmp_path, monkeypatch
):
    """A flash-attention model gets the varlen layout (`conftest.flash_attention_stand_in`: one
    row, no mask, positions restarting at 0), and the losses equal those of the run with SDPA
    and 4D-mask packing."""
    import instruction_tuning.train

    tiny_sft_dict["data"]["eval"] = None
    tiny_sft_dict["train"]["max_steps"] = 2
    assert run_cfg(tiny_sft_dict, tmp_path / "sdpa") == 0
    calls = flash_attention_stand_in(monkeypatch, instruction_tuning.train)
    assert run_cfg(tiny_sft_dict, tmp_path / "flat") == 0
    assert calls and set(calls) == {16}  # each forward: the step's 16 examples in one row
    sdpa, flat = losses(tmp_path / "sdpa"), losses(tmp_path / "flat")
    assert sdpa.keys() == flat.keys() == {1, 2}
    for step in sdpa:
        assert abs(sdpa[step] - flat[step]) < 1e-5, (step, sdpa[step], flat[step])
