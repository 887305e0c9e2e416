"""Shared test helpers: small configs for the tiny world, written as real YAML files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_module(
    module: str, *args: str, cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run `python -m module args...` in a fresh interpreter (how users run trainers)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def tiny_sft_dict() -> dict:
    """A few-second SFT config on reasoning-gym spell_backward with the tiny-qwen3 preset."""
    rg = {"task": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 6}}
    return {
        "name": "test_sft",
        "seed": 0,
        "model": {"name_or_path": "tiny-qwen3"},
        "data": {
            "train": {"reasoning_gym": {**rg, "size": 256, "seed": 1}},
            "eval": {"reasoning_gym": {**rg, "size": 16, "seed": 10_000_000}},
            "max_length": 80,
        },
        "train": {
            "batch_size": 16,
            "max_steps": 6,
            "eval_every": 0,
            "eval_max_new_tokens": 8,
            "threads": 1,
        },
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "checkpoint": {"save_every": 0, "keep_last": 2},
        "tracking": {"log_every": 1, "plot_every": 100},
    }
