"""SFT (instruction_tuning) and the DPO family (direct_alignment) train the tiny encoder-decoder
policy (tiny-t5-facts) through rlhf_core.policy_model: every tensor changes, the run records its
steps with finite losses, SFT's final evaluation runs, and DPO/IPO start at their zero-margin loss
(the policy is its reference) and move away from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import REPO, metric_series
from safetensors.torch import load_file

from rlhf_core.config import RunArgs
from rlhf_core.tiny import preset_dir

LONGFORM = REPO / "data" / "longform"
COMMON = {
    "seed": 0,
    "model": {"name_or_path": "tiny-t5-facts"},
    "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
    "checkpoint": {"save_every": 0},
    "tracking": {"log_every": 1, "plot_every": 100},
}


def assert_finished(run: Path, steps: int = 2) -> dict:
    """The run's own record: finished, `steps` steps none skipped; returns summary.json."""
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "finished" and status["exit_code"] == 0, status
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["skipped_steps"] == 0, summary
    assert math.isfinite(summary["final_train_loss"]), summary
    assert (run / "config.yaml").is_file() and (run / "curves.png").stat().st_size > 0
    return summary


def assert_every_tensor_changed(run: Path) -> None:
    start = load_file(preset_dir("tiny-t5-facts") / "model.safetensors")
    final = load_file(run / "final" / "model.safetensors")
    unchanged = [k for k in final if torch.equal(final[k], start[k])]
    assert not unchanged, unchanged
    losses = metric_series(run, "train/loss")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())


def test_t5_sft(tmp_path):
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train

    cfg = SFTConfig.model_validate({
        **COMMON, "name": "t5_sft",
        "data": {"train": {"path": str(LONGFORM / "sft.jsonl"), "limit": 32},
                 "eval": {"path": str(LONGFORM / "sft.jsonl"), "offset": 1990},
                 "format": "prompt_completion", "max_length": 128},
        "train": {"batch_size": 8, "max_steps": 2, "threads": 1, "eval_every": 0,
                  "eval_size": 4, "eval_max_new_tokens": 8, "eval_sampled": False},
    })  # fmt: skip
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    assert_every_tensor_changed(tmp_path / "run")
    summary = assert_finished(tmp_path / "run")
    assert summary["final_train_loss"] == metric_series(tmp_path / "run", "train/loss")[2]
    # the final held-out evaluation ran: a finite loss and greedy answers of 1..8 new tokens
    assert math.isfinite(summary["eval/loss"]) and 0 < summary["eval/greedy_length"] <= 8, summary


# the loss at a zero log-ratio margin (policy == reference): DPO log 2, IPO (1 / (2 beta))^2
ZERO_MARGIN_LOSS = {"dpo": math.log(2), "ipo": (1 / (2 * 0.1)) ** 2}


@pytest.mark.parametrize("loss", [{"name": "dpo", "beta": 0.1}, {"name": "ipo", "beta": 0.1}])
def test_t5_direct_alignment(tmp_path, loss):
    from direct_alignment.config import DAConfig
    from direct_alignment.train import train

    cfg = DAConfig.model_validate({
        **COMMON, "name": "t5_dpo",
        "data": {"train": {"path": str(LONGFORM / "preference.jsonl"), "limit": 16},
                 "max_length": 128},
        "loss": loss, "reference": {"mode": "model"},
        "train": {"batch_size": 8, "max_steps": 2, "threads": 1},
    })  # fmt: skip
    run = tmp_path / "run"
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=run)) == 0
    assert_every_tensor_changed(run)
    summary = assert_finished(run)
    assert summary["reference"] == "model" and summary["train_pairs"] == 16, summary
    margin, losses = metric_series(run, "train/rewards/margin"), metric_series(run, "train/loss")
    # step 1: the policy is the reference, so every margin is 0 and the loss is the formula's there
    assert abs(margin[1]) < 1e-4, margin
    assert losses[1] == pytest.approx(ZERO_MARGIN_LOSS[loss["name"]], rel=1e-4), losses
    assert abs(margin[2]) > 1e-3  # after one update the policy has moved away from the reference
    for side in ("chosen", "rejected"):
        logps = metric_series(run, f"train/logps/{side}")
        assert all(math.isfinite(v) and v < 0 for v in logps.values()), logps
