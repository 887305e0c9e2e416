"""The user's own reward-model data: a conversational preference file (prompt, chosen and
rejected as message lists) trains the RM through the command line; `data.overlong: drop` and
`data.strip_thinking` do what they do for the other trainers, counted in the summary; a file in
no layout is one clear error with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import metric_series, write_yaml

from reward_models.config import RMDataConfig
from reward_models.data import build_reward_data
from reward_models.train import main
from rlhf_core.errors import run_main
from rlhf_core.models import ModelConfig, load_tokenizer

WORDS = ["cat", "dog", "bird", "fish", "lamp", "tree", "rock", "star", "moon", "rain", "book",
         "door", "cake", "milk", "wolf", "frog"]  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def conversational_rows() -> list[dict]:
    """TRL's conversational preference layout: a system + user prompt, one assistant message per
    completion; every fourth chosen answer thinks first, the last rejected one is very long."""
    rows = []
    for i, word in enumerate(WORDS):
        chosen = word[::-1] if i % 4 else f"<think>reverse {word}</think>\n{word[::-1]}"
        rejected = word if i < len(WORDS) - 1 else " ".join([word] * 60)
        rows.append({
            "prompt": [{"role": "system", "content": "Spell words backwards."},
                       {"role": "user", "content": f"Spell {word} backwards."}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        })  # fmt: skip
    return rows


def rm_config(path: Path, **data) -> dict:
    return {
        "name": "own_rm",
        "seed": 0,
        "model": {"name_or_path": "tiny-qwen3"},
        "data": {"train": {"path": str(path)}, "max_length": 64, **data},
        "loss": {"name": "bradley_terry"},
        "train": {"batch_size": 4, "max_steps": 3, "threads": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "checkpoint": {"save_every": 0},
        "tracking": {"log_every": 1, "plot_every": 0},
    }


def test_a_conversational_preference_file_trains_the_rm_through_the_command_line(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", conversational_rows())
    config = write_yaml(tmp_path / "rm.yaml", rm_config(data, overlong="drop"))
    run = tmp_path / "run"
    assert run_main(main, ["--config", str(config), "--output-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    # 16 rows: the long one dropped, the 4 thinking answers stripped before tokenizing
    assert summary["train_examples"] == 15
    assert summary["train_data/dropped_overlong"] == 1
    assert summary["train_data/stripped_thinking"] == 4
    assert summary["train_data/truncated"] == 0
    losses = metric_series(run, "train/loss")
    assert sorted(losses) == [1, 2, 3] and all(torch.isfinite(torch.tensor(list(losses.values()))))
    assert (run / "final" / "scalar_head.json").is_file()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")


def build(tok, path: Path, kind: str = "preference", **data):
    cfg = RMDataConfig.model_validate({"train": {"path": str(path)}, "max_length": 64, **data})
    return build_reward_data(cfg.train, tok, kind=kind, data_cfg=cfg, where="data.train")


def test_overlong_drop_and_strip_thinking_on_preference_rows(tok, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", conversational_rows())
    cut = build(tok, path)
    assert len(cut.examples) == 16 and cut.counts["truncated"] == 1
    assert cut.counts["dropped_overlong"] == 0 and cut.counts["stripped_thinking"] == 4
    dropped = build(tok, path, overlong="drop")
    assert len(dropped.examples) == 15 and dropped.counts["truncated"] == 0
    assert dropped.counts["dropped_overlong"] == 1
    # the system message leads the prompt; a stripped answer is the answer alone
    assert "Spell words backwards." in tok.decode(cut.examples[0].prompt_ids)
    assert tok.decode(cut.examples[0].chosen_ids) == "tac<|end|>"
    kept = build(tok, path, strip_thinking=False)
    assert kept.counts["stripped_thinking"] == 0
    assert tok.decode(kept.examples[0].chosen_ids) == "<think>reverse cat</think>\ntac<|end|>"
    assert kept.examples[1].chosen_ids == cut.examples[1].chosen_ids  # no block: unchanged


def test_overlong_drop_and_strip_thinking_on_outcome_rows(tok, tmp_path):
    rows = [{"prompt": "2+2?", "completion": "<think>two and two</think>4", "label": True},
            {"prompt": "2+2?", "completion": "5", "label": False},
            {"prompt": "3+3?", "completion": "6 " * 80, "label": True}]  # fmt: skip
    path = write_jsonl(tmp_path / "orm.jsonl", rows)
    cfg = {"train": {"path": str(path)}, "format": "orm", "max_length": 48}
    data_cfg = RMDataConfig.model_validate(cfg)
    cut = build_reward_data(data_cfg.train, tok, kind="orm", data_cfg=data_cfg, where="t")
    assert len(cut.examples) == 3 and cut.counts["truncated"] == 1
    assert cut.counts["stripped_thinking"] == 1
    assert tok.decode(cut.examples[0].completion_ids) == "4<|end|>"
    data_cfg = RMDataConfig.model_validate({**cfg, "overlong": "drop", "strip_thinking": False})
    dropped = build_reward_data(data_cfg.train, tok, kind="orm", data_cfg=data_cfg, where="t")
    assert len(dropped.examples) == 2 and dropped.counts["dropped_overlong"] == 1
    assert dropped.counts["truncated"] == 0 and dropped.counts["stripped_thinking"] == 0
    assert "<think>" in tok.decode(dropped.examples[0].completion_ids)


def test_columns_rename_reward_model_rows(tok, tmp_path):
    rows = [{"q": f"Spell {w} backwards.", "good": w[::-1], "bad": w} for w in WORDS[:4]]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    data = build(tok, path, columns={"prompt": "q", "chosen": "good", "rejected": "bad"})
    assert len(data.examples) == 4 and tok.decode(data.examples[1].rejected_ids) == "dog<|end|>"


def test_a_file_in_no_layout_is_one_clear_error_and_writes_nothing(tmp_path, capsys):
    rows = [{"question": "q", "response_j": "good", "response_k": "bad"}] * 4
    data = write_jsonl(tmp_path / "se.jsonl", rows)
    config = write_yaml(tmp_path / "rm.yaml", rm_config(data))
    run = tmp_path / "run"
    assert run_main(main, ["--config", str(config), "--output-dir", str(run)]) == 2
    error = capsys.readouterr().err
    assert f"data.train ({data}[train]): row 0 is missing columns 'prompt', 'chosen', " in error
    assert "columns found: ['question', 'response_j', 'response_k']" in error
    assert "data.columns: {prompt: <your column>" in error and "Traceback" not in error
    assert not run.exists() or not any(run.iterdir())
