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


# ----------------------------------------------------------------------- any prompt set, an RM


@pytest.fixture(scope="module")
def gpt2_rm(tmp_path_factory):
    """A real scalar-head reward model on the tiny-gpt2 backbone (untrained; its head spread wide
    so samples never tie), saved as reward_models saves one."""
    import torch

    from rlhf_core.models import ModelConfig, load_tokenizer
    from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel

    torch.manual_seed(0)
    mcfg = ModelConfig(name_or_path="tiny-gpt2")
    tokenizer = load_tokenizer(mcfg, padding_side="right")
    rm = ScalarHeadModel.from_config(
        mcfg, ScalarHeadInfo(kind="preference", chat_template=tokenizer.chat_template)
    )
    torch.nn.init.normal_(rm.head.weight, std=1.0)
    rm.tokenizer = tokenizer
    out = tmp_path_factory.mktemp("gpt2_rm")
    rm.save_pretrained(out)
    return out


def _hh_compare(gpt2_rm, extra: list[str] = ()) -> CompareConfig:
    from conftest import REPO

    from rlhf_core.tiny import preset_dir

    base_set = [
        f"rewards=[{{name: reward_model, weight: 1.0, path: {gpt2_rm}}}]",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
        "train.micro_batch_size=4", "train.eval_size=4",  # each arm's own final evaluation
    ]  # fmt: skip
    return load_config(CompareConfig, REPO / "configs/compare_hh/compare.yaml", [
        f"sft_model={preset_dir('tiny-gpt2')}", f"reward_model={gpt2_rm}",
        f"set={json.dumps(base_set)}", "pairs=8", "pair_samples=2", "eval_size=6", *extra,
    ])  # fmt: skip


def test_fast_compare_on_hh_prompts_with_an_rm_only_reward(gpt2_rm, tmp_path, monkeypatch):
    """GPT-2 + HH at toy size: PPO and GRPO with the RM as their only reward, DPO on on-policy
    pairs the RM judged; every arm gets a finite RM mean score, win rate against the SFT model and
    KL; the SFT model against itself (the same samples) wins exactly half."""
    from conftest import REPO

    from rlhf_core.scalar_head import ScalarHeadModel

    monkeypatch.chdir(REPO)
    cfg = _hh_compare(gpt2_rm)
    cfg = cfg.model_copy(update={"algorithms": {k: cfg.algorithms[k] for k in ("ppo", "grpo")}})
    out = tmp_path / "cmp"
    report = run_compare(cfg, out, fast=True)
    assert list(report["runs"]) == ["sft", "ppo", "grpo", "dpo"]
    assert report["eval_prompts"] == 6 and report["verifiers"] == []
    for name, run in report["runs"].items():
        ev = run["eval"]
        for key in ("eval/sampled_rm", "eval/win_rate", "eval/win_rate_se", "eval/sampled_kl_k3"):
            assert math.isfinite(ev[key]), (name, key)
        assert 0.0 <= ev["eval/win_rate"] <= 1.0 and ev["eval/sampled_kl_k3"] >= 0
        assert "eval/sampled_rm_exact" not in ev  # a score, not a grade
    sft = report["runs"]["sft"]["eval"]
    assert sft["eval/win_rate"] == 0.5 and sft["eval/sampled_kl_k3"] == pytest.approx(0, abs=1e-6)
    # the DPO pairs: HH prompts (multi-turn ones as messages), chosen scored above rejected by
    # the reward model that judged them
    rows = [json.loads(x) for x in (out / "pairs" / "train.jsonl").read_text().splitlines()]
    assert rows and report["runs"]["dpo"]["pairs"] == len(rows)
    rm = ScalarHeadModel.from_pretrained(gpt2_rm)
    chosen = rm.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = rm.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert bool((chosen > rejected).all())
    # the held-out samples: one line per prompt with every model's completion and RM score
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and set(samples[0]) == {"prompt", "sft", "ppo", "grpo", "dpo"}
    assert samples[0]["prompt"].startswith("\n\nHuman:")
    text = (out / "compare.md").read_text()
    assert (
        "| RM score (sampled) | win rate vs SFT |" in text and "| ppo | policy_gradients |" in text
    )


def test_compare_refuses_heldout_prompts_that_overlap_training(gpt2_rm, tmp_path, monkeypatch):
    from conftest import REPO

    from rlhf_core.errors import UserError
    from rlhf_lab.compare import _heldout_sources

    monkeypatch.chdir(REPO)
    cfg = _hh_compare(gpt2_rm, ["eval_prompts={path: data/hh-rlhf/harmless-base-test.jsonl.gz, "
                                "offset: 1900}"])  # fmt: skip
    base = _pg_config(cfg, "base", None, tmp_path, fast=False)
    with pytest.raises(UserError, match="overlap the training prompts"):
        _heldout_sources(cfg, base, 200)
    # no reward model and no verifier: refused before anything trains
    no_judge = _hh_compare(gpt2_rm, ["reward_model=null"])
    with pytest.raises(UserError, match="need a judge"):
        run_compare(no_judge, tmp_path / "x", fast=True)
    assert not (tmp_path / "x" / "ppo").exists()
