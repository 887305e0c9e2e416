"""A shortened quickstart end to end: every stage runs, every figure is finite, the report is
written, and GRPO's training reward rose."""

from __future__ import annotations

import json
import math

from rlhf_lab.quickstart import EVAL_STAGES, run_quickstart


def _finite(value) -> bool:
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, int | float):
        return math.isfinite(value)
    return True


def test_fast_quickstart_runs_every_stage(sft_checkpoint, tmp_path, monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)  # the stage configs are read from configs/quickstart/
    out = tmp_path / "qs"
    figures = run_quickstart(out, fast=True, sft_from=sft_checkpoint)
    for stage in ("sft", "rm", "grpo", "rloo_rm", "dpo"):
        assert (out / stage / "final").is_dir(), stage
    assert (out / "report.md").is_file() and (out / "report.png").stat().st_size > 0
    assert set(figures["eval"]) == set(EVAL_STAGES)
    assert _finite(figures["eval"]) and _finite(figures["times_s"])
    assert figures["pairs"]["train"]["pairs"] > 0
    assert 0 <= figures["rm"]["eval/accuracy"] <= 1
    saved = json.loads((out / "figures.json").read_text())
    assert saved["eval"]["sft"]["eval/sampled_kl_k3"] == 0.0  # the SFT model against itself
    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    reward = {r["step"]: r["train/reward/total"] for r in rows if "train/reward/total" in r}
    # measured from this SFT model: step 1 ~0.68, steps 4-6 ~0.70-0.76 in every run
    assert sum(reward[s] for s in (4, 5, 6)) / 3 > reward[1]
