"""Best-checkpoint selection and early stopping (`checkpoint.best`, rlhf_core.selection)."""

from __future__ import annotations

import json

import pytest
from accelerate import Accelerator
from conftest import write_yaml

from rlhf_core.errors import UserError
from rlhf_core.selection import ModelSelector, SelectionConfig


def test_best_and_patience_follow_the_metric():
    """The decision alone (best/ and best.json are written by rlhf_core.checkpoint.save_best,
    tested in test_checkpoint.py; the DPO run below checks both together)."""
    cfg = SelectionConfig(metric="eval/loss", mode="min", min_delta=0.05, patience=3)
    selector = ModelSelector(cfg, Accelerator(cpu=True), periodic_eval=True)
    stops, improved = [], []
    for step, value in [(1, 1.0), (2, 0.8), (3, 0.85), (4, 0.79), (5, 0.9)]:
        stops.append(selector.observe(step, {"eval/loss": value}))
        improved.append(selector.improved)
    # 0.79 beats 0.8 by less than min_delta: three evaluations without improvement after step 2
    assert stops == [False, False, False, False, True]
    assert improved == [True, True, False, False, False]
    assert selector.record() == {"step": 2, "metric": "eval/loss", "value": 0.8}
    assert selector.summary()["early_stopped_at"] == 5
    assert not selector.observe(5, {"eval/loss": 0.1}) and not selector.improved  # seen step
    again = ModelSelector(cfg, Accelerator(cpu=True), periodic_eval=True)
    again.load_state_dict(selector.state_dict())  # resumed runs keep best and patience
    assert again.best == 0.8 and again.bad_evals == 3
    maximise = ModelSelector(
        SelectionConfig(metric="eval/acc", mode="max"), Accelerator(cpu=True), periodic_eval=True
    )
    for step, value in [(1, 0.2), (2, 0.5), (3, 0.4)]:
        assert not maximise.observe(step, {"eval/acc": value})
    assert maximise.best_step == 2  # never stops without patience


def test_selection_errors_name_the_fix():
    with pytest.raises(UserError, match="needs periodic held-out evaluation: set train.eval_every"):
        ModelSelector(SelectionConfig(metric="eval/loss"), None, periodic_eval=False)
    selector = ModelSelector(
        SelectionConfig(metric="eval/los"), Accelerator(cpu=True), periodic_eval=True
    )
    with pytest.raises(UserError, match=r"'eval/los' is not among .*: eval/accuracy, eval/loss"):
        selector.observe(1, {"eval/loss": 1.0, "eval/accuracy": 0.5})
    with pytest.raises(ValueError, match="patience needs checkpoint.best.metric"):
        SelectionConfig(patience=2)


def test_dpo_stops_early_and_keeps_best(tiny_dpo_dict, tmp_path):
    from direct_alignment.train import main

    tiny_dpo_dict["train"].update(max_steps=8, eval_every=1)
    # nothing beats the first evaluation by 1000: patience 2 stops after step 3
    tiny_dpo_dict["checkpoint"]["best"] = {
        "metric": "eval/rewards/accuracy", "mode": "max", "min_delta": 1000.0, "patience": 2
    }  # fmt: skip
    path = write_yaml(tmp_path / "dpo.yaml", tiny_dpo_dict)
    run_dir = tmp_path / "run"
    assert main(["--config", str(path), "--output-dir", str(run_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["early_stopped_at"] == 3
    assert summary["best/step"] == 1 and summary["best/metric"] == "eval/rewards/accuracy"
    assert json.loads((run_dir / "best.json").read_text())["step"] == 1
    assert (run_dir / "best" / "config.json").is_file() and (run_dir / "final").is_dir()
