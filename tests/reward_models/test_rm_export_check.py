"""A preference RM asked to export a sequence classifier with a pad = eos tokenizer is refused
before any data is built or any step runs (it used to fail only after training)."""

from __future__ import annotations

import warnings

import pytest
from conftest import REPO

from reward_models.train import main
from rlhf_core.errors import UserError


def test_pad_equals_eos_export_is_refused_before_the_first_step(tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        "--config", str(REPO / "configs/reward_models/tiny_preference.yaml"),
        "--set", "model.name_or_path=tiny-qwen3-gpt2",  # GPT-2 tokenizer: pad falls back to eos
        "--set", "train.export_sequence_classification=true",
        "--output-dir", str(run_dir),
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tokenizer loader warns that pad falls back to eos
        with pytest.raises(UserError, match=r"model tiny-qwen3-gpt2: .*pad = eos") as info:
            main(argv)
    assert "train.export_sequence_classification: false" in str(info.value)
    assert not run_dir.exists()  # nothing was trained or written
