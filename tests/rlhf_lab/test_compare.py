"""`rlhf-lab compare` shortened: two policy-gradient presets and one DPO-family loss from the same
SFT model; every run trains and is evaluated, and the table, JSON and plot are written."""

from __future__ import annotations

import json
import math

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_lab.compare import CompareConfig, _pg_config, run_compare


def test_fast_compare_runs_each_configured_algorithm(sft_checkpoint, tmp_path, monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)
    cfg = load_config(CompareConfig, REPO / "configs/quickstart/compare.yaml", [
        f"sft_model={sft_checkpoint}", "eval_size=16",
    ])  # fmt: skip
    cfg = cfg.model_copy(update={
        "algorithms": {k: cfg.algorithms[k] for k in ("rloo", "dr_grpo")},
        "direct_alignment": {"ipo": cfg.direct_alignment["ipo"]},
    })  # fmt: skip
    out = tmp_path / "cmp"
    report = run_compare(cfg, out, fast=True)
    assert set(report["runs"]) == {"sft", "rloo", "dr_grpo", "ipo"}
    for name in ("rloo", "dr_grpo", "ipo"):
        run = report["runs"][name]
        assert (out / name / "final" / "config.json").is_file()
        assert math.isfinite(run["eval"]["eval/sampled_task"]), name
        assert run["eval"]["eval/sampled_kl_k3"] >= 0
    assert report["runs"]["rloo"]["tokens_generated"] > 0
    assert report["runs"]["ipo"]["tokens_generated"] is None
    # the run used the preset's algorithm block plus the YAML's overrides, nothing else
    saved = json.loads(json.dumps(report["config"]))
    assert saved["algorithms"]["dr_grpo"]["set"] == ["algorithm.loss.normalizer=16"]
    text = (out / "compare.md").read_text()
    assert "| dr_grpo | policy_gradients |" in text and (out / "compare.png").stat().st_size > 0


def test_compare_run_config_is_the_preset_algorithm_on_the_base(tmp_path, monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)
    cfg = load_config(CompareConfig, REPO / "configs/quickstart/compare.yaml")
    pg = _pg_config(cfg, "gspo", cfg.algorithms["gspo"], tmp_path / "sft", fast=False)
    assert pg.algorithm.loss["name"] == "gspo" and pg.rollout.max_new_tokens == 16
    assert pg.train.max_steps == 20 and pg.optim.lr == 1e-4 and pg.name == "compare_gspo"
    bad = cfg.model_copy(update={"set": ["algorithm.loss.no_such_key=1"]})
    with pytest.raises(ConfigError):
        _pg_config(bad, "gspo", cfg.algorithms["gspo"], tmp_path / "sft", fast=False)
