"""A policy-gradient run whose reward block holds a learned reward model and a verifier writes
the proxy/gold reward series and the over-optimisation plot (Gao et al. 2022)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from conftest import metric_series, tiny_pg_dict

from policy_gradients.config import PGConfig
from policy_gradients.overoptimization import main as overoptimization_main
from policy_gradients.overoptimization import write_overoptimization
from policy_gradients.train import train
from rlhf_core.config import RunArgs


def test_rl_against_a_learned_rm_with_a_verifier_writes_proxy_and_gold(
    sft_checkpoint, tmp_path, capsys
):
    from rlhf_core.models import ModelConfig, load_tokenizer
    from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel

    torch.manual_seed(0)
    base = ModelConfig(name_or_path=str(sft_checkpoint))
    rm = ScalarHeadModel.from_config(base, ScalarHeadInfo(kind="preference", max_length=64))
    rm.tokenizer = load_tokenizer(base, padding_side="right")
    rm.save_pretrained(tmp_path / "rm")
    algorithm = {
        "name": "rloo", "advantage": {"name": "rloo"}, "ppo_epochs": 1,
        "loss": {"name": "clipped", "aggregation": "seq-mean-token-mean"},
        "kl_in_reward": {"beta": 0.1, "estimator": "k1"},
    }  # fmt: skip
    data = tiny_pg_dict(sft_checkpoint, **algorithm)
    data["rewards"] = [
        {"name": "reward_model", "weight": 1.0, "path": str(tmp_path / "rm"), "device": "cpu"},
        {"name": "reasoning_gym", "weight": 0.0, "extract": "full", "label": "gold"},
    ]
    data["data"]["eval"]["reasoning_gym"]["size"] = 8
    data["train"]["max_steps"] = 3
    run = tmp_path / "run"
    assert train(PGConfig.model_validate(data), RunArgs(Path("t.yaml"), output_dir=run)) == 0

    series = json.loads((run / "overoptimization.json").read_text())
    assert series["proxy"] == ["reward_model"] and series["gold"] == ["gold"]
    train_series = series["train"]
    assert train_series["step"] == [1, 2, 3]
    # the series are the logged rollout means; the gold verifier (weight 0) is measured only
    assert train_series["proxy/reward_model"] == list(
        metric_series(run, "train/reward/reward_model").values()
    )
    assert train_series["gold/gold"] == list(metric_series(run, "train/reward/gold").values())
    totals = list(metric_series(run, "train/reward/total").values())
    assert totals == train_series["proxy/reward_model"]
    assert 0 < sum(train_series["gold/gold"]) / 3 < 1  # partly right SFT model, partial credit
    # KL(pi || pi_ref) per sequence: 0 at the first step (pi = pi_ref), then positive
    kl = train_series["kl_sequence"]
    assert kl[0] == 0.0 and all(math.isfinite(v) and v >= 0 for v in kl) and kl[-1] > 0
    assert series["eval"]["step"] == [3]  # the final held-out evaluation
    png = run / "overoptimization.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # without a verifier in the block there is nothing to compare: no files
    assert write_overoptimization(tmp_path, data["rewards"][:1]) is None
    # any earlier run: the command redraws it from the run dir alone
    png.unlink()
    assert overoptimization_main([str(run)]) == 0
    assert png.is_file() and str(png) in capsys.readouterr().out
