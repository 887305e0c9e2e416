"""The user's own preference data through the real command line: an orca_dpo_pairs-style file
({system, question, chosen, rejected}) trains DPO with `data.columns: {prompt: question}`; a
file in no layout is refused with one clear error and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import metric_series, write_yaml
from safetensors.torch import load_file

from direct_alignment.data import build_preference_data
from direct_alignment.train import main
from rlhf_core.columns import Columns
from rlhf_core.data import DataSource
from rlhf_core.errors import run_main
from rlhf_core.models import ModelConfig, load_tokenizer
from rlhf_core.tiny import preset_dir


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def orca_rows(n: int) -> list[dict]:
    """orca_dpo_pairs' columns: a system prompt (empty in some rows), the question, a chosen and a
    rejected answer."""
    return [
        {"system": "You answer with a number." if i % 2 else "", "question": f"What is {i} + {i}?",
         "chosen": f"{2 * i}", "rejected": f"{2 * i + 1} or so"}
        for i in range(n)
    ]  # fmt: skip


def dpo_config(path: Path, **data) -> dict:
    return {
        "name": "own_data",
        "seed": 0,
        "model": {"name_or_path": "tiny-qwen3"},
        "data": {"train": {"path": str(path)}, "max_length": 64, **data},
        "loss": {"name": "dpo", "beta": 0.1},
        "reference": {"mode": "model"},
        "train": {"batch_size": 4, "max_steps": 3, "threads": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "checkpoint": {"save_every": 0},
        "tracking": {"log_every": 1, "plot_every": 0},
    }


def test_an_orca_style_file_trains_dpo_through_the_command_line(tmp_path):
    data = write_jsonl(tmp_path / "orca.jsonl", orca_rows(16))
    config = write_yaml(tmp_path / "dpo.yaml", dpo_config(data, columns={"prompt": "question"}))
    run = tmp_path / "run"
    assert run_main(main, ["--config", str(config), "--output-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["train_pairs"] == 16 and summary["dropped_identical_pairs"] == 0
    losses = metric_series(run, "train/loss")
    assert sorted(losses) == [1, 2, 3] and all(torch.isfinite(torch.tensor(list(losses.values()))))
    start = load_file(preset_dir("tiny-qwen3") / "model.safetensors")
    final = load_file(run / "final" / "model.safetensors")
    assert all(not torch.equal(value, start[name]) for name, value in final.items())
    # the resolved config keeps the mapping; the system column reached the rendered prompt
    assert "question" in (run / "config.yaml").read_text()
    tok = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")
    pairs = build_preference_data(
        DataSource(path=str(data)), tok, fmt="auto", max_length=64, max_prompt_length=None,
        where="data.train", columns=Columns(prompt="question"),
    ).pairs  # fmt: skip
    assert "<|system|>" not in pairs[0].prompt_text  # row 0's system prompt is empty
    assert "You answer with a number." in pairs[1].prompt_text
    assert "What is 1 + 1?" in pairs[1].prompt_text
    assert tok.decode(pairs[1].chosen_ids) == "2<|end|>"


def test_a_file_in_no_layout_is_one_clear_error_and_writes_nothing(tmp_path, capsys):
    # stack-exchange-paired's columns, unmapped
    row = {"question": "q", "response_j": "good", "response_k": "bad"}
    data = write_jsonl(tmp_path / "se.jsonl", [row] * 4)
    config = write_yaml(tmp_path / "dpo.yaml", dpo_config(data))
    run = tmp_path / "run"
    assert run_main(main, ["--config", str(config), "--output-dir", str(run)]) == 2
    error = capsys.readouterr().err
    assert f"data.train ({data}[train]): row 0 is missing columns 'prompt', 'chosen', " in error
    assert "of layout preference (prompt + chosen + rejected)" in error
    assert "columns found: ['question', 'response_j', 'response_k']" in error
    assert "data.columns: {prompt: <your column>, chosen: " in error
    assert error.count("error:") == 1 and "Traceback" not in error
    assert not run.exists() or not any(run.iterdir())


def test_columns_rename_files_not_generated_rows():
    # data.columns describes the user's files; reasoning-gym rows are built in the standard keys
    tok = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")
    source = DataSource.model_validate(
        {"reasoning_gym": {"task": "spell_backward", "size": 4, "seed": 3}}
    )
    data = build_preference_data(
        source, tok, fmt="auto", max_length=64, max_prompt_length=None, where="data.train",
        columns=Columns(prompt="question"),
    )  # fmt: skip
    assert len(data.pairs) == 4
