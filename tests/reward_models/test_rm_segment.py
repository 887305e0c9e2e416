"""Token-level (segment) reward models: data format, and learning above the majority baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO

from reward_models.config import RMConfig
from reward_models.data import build_reward_data
from reward_models.train import train
from rlhf_core.config import RunArgs, load_config
from rlhf_core.models import load_tokenizer

CONFIG = REPO / "configs" / "reward_models" / "tiny_segment_factuality.yaml"


def test_segment_rows_are_scored_at_each_segment_end(tmp_path):
    cfg = load_config(RMConfig, CONFIG)
    tok = load_tokenizer(cfg.model, padding_side="right")
    rows = [{"prompt": "Tell me about Ada.", "completion": "Ada has a cat. Dr. No eats 3.5 figs!",
             "labels": [0, 1]}]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = cfg.data.train.model_copy(update={"path": str(path), "limit": None})
    data = build_reward_data(source, tok, kind="segment", data_cfg=cfg.data, num_classes=2,
                             where="data.train")  # fmt: skip
    (example,) = data.examples
    ends = [tok.decode(example.completion_ids[: e + 1]) for e in example.step_ends]
    assert ends == ["Ada has a cat.", "Ada has a cat. Dr. No eats 3.5 figs!"]
    assert example.step_classes == [0, 1]
    rows[0]["labels"] = [0, 1, 0]
    path.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match=r"row 0 column 'labels': expected 2 labels, one per"):
        build_reward_data(source, tok, kind="segment", data_cfg=cfg.data, num_classes=2,
                          where="data.train")  # fmt: skip


def test_segment_reward_model_beats_the_majority_baseline(tmp_path):
    """Measured: after 40 steps of 16 rows, held-out error F1 ~0.9-1.0 (sentence-level
    factuality, 27% of sentences wrong); the majority baseline ("no error") has F1 0. From
    random init at lr 3e-3 (the config's 3e-4 is for a start from the pre-trained backbone)."""
    cfg = load_config(RMConfig, CONFIG, [
        "data.train.limit=640", "data.eval.limit=100", "train.batch_size=16",
        "train.max_steps=40", "train.eval_every=0", "tracking.log_every=40",
        "optim.lr=3e-3", "optim.warmup_steps=10",
    ])  # fmt: skip
    assert train(cfg, RunArgs(config_path=CONFIG, output_dir=tmp_path / "run")) == 0
    summary = json.loads((Path(tmp_path / "run") / "summary.json").read_text())
    assert summary["eval/majority_error_f1"] == 0.0
    assert summary["eval/error_f1"] > 0.6, summary
    assert summary["eval/segment_accuracy"] > summary["eval/majority_accuracy"] + 0.1
