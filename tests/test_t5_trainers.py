"""SFT (instruction_tuning) and the DPO family (direct_alignment) train the tiny encoder-decoder
policy (tiny-t5-facts) through rlhf_core.policy_model, with every tensor changing."""

from __future__ import annotations

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
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    assert_every_tensor_changed(tmp_path / "run")
