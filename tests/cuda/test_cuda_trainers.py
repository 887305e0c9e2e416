"""Every trainer runs 3 steps on CUDA in bf16 on a Qwen3-0.6B-shaped model (random init, built
from its config; `cuda_world`): SFT, reward model, DPO, GRPO and PPO on the vendored long-form
data, and the encoder-decoder T5 policy (the `tiny-t5-facts` preset) through SFT and GRPO. Each
run's losses are finite, no step is skipped, its speed plan has every CPU-only path off, and its
`final/` loads in plain transformers (the reward model through its scalar head)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cuda_world import DEVICE, REPO, build_causal_lm_dir, finite, needs_cuda

from rlhf_core.config import RunArgs

pytestmark = [pytest.mark.cuda, needs_cuda]

LONGFORM = REPO / "data" / "longform"
STEPS = 3
COMMON = {
    "seed": 0,
    "optim": {"lr": 1e-5, "warmup_steps": 0, "schedule": "constant"},
    "checkpoint": {"save_every": 0},
    "tracking": {"log_every": 1, "plot_every": 100},
}
TRAIN = {"max_steps": STEPS, "eval_every": 0}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return build_causal_lm_dir(tmp_path_factory.mktemp("qwen3") / "model")


def model(path: Path | str) -> dict:
    return {"name_or_path": str(path), "dtype": "bf16"}


def assert_run(run: Path) -> dict:
    """3 steps, none skipped, finite losses, the plan's CPU-only paths off on a GPU."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["skipped_steps"] == 0, summary
    losses = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in losses if "train/loss" in r]
    assert len(losses) == STEPS and finite(losses), losses
    speed = summary["speed"]
    assert speed["device"] == DEVICE.type and speed["dtype"] == "bfloat16", speed
    if DEVICE.type == "cuda":
        assert not speed["cpu_attention"] and not speed["grouped_decode"], speed
        assert not speed["lean_norms"] and speed["reserve_positions"] == 0, speed
        assert speed["layout"] != "segmented" and speed["row_tokens"] == 0, speed
        assert speed["allocator"] == "torch's (not glibc's)", speed  # glibc left alone
    return summary


def load_causal_lm(path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = AutoConfig.from_pretrained(path)
    cls = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    loaded = cls.from_pretrained(path, dtype=torch.float32)
    assert all(torch.isfinite(p).all() for p in loaded.parameters())


def test_sft(qwen3_dir, tmp_path):
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train

    cfg = SFTConfig.model_validate({
        **COMMON, "name": "cuda_sft", "model": model(qwen3_dir),
        "data": {"train": {"path": str(LONGFORM / "sft.jsonl"), "limit": 32},
                 "format": "prompt_completion", "max_length": 256},
        "train": {**TRAIN, "batch_size": 8},
    })  # fmt: skip
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    assert_run(tmp_path / "run")
    load_causal_lm(tmp_path / "run" / "final")


def test_reward_model(qwen3_dir, tmp_path):
    from reward_models.config import RMConfig
    from reward_models.train import train
    from rlhf_core.scalar_head import ScalarHeadModel

    cfg = RMConfig.model_validate({
        **COMMON, "name": "cuda_rm", "model": model(qwen3_dir),
        "data": {"train": {"path": str(LONGFORM / "preference.jsonl"), "limit": 32},
                 "format": "preference", "max_length": 256},
        "loss": {"name": "bradley_terry"},
        "train": {**TRAIN, "batch_size": 8},
    })  # fmt: skip
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    assert_run(tmp_path / "run")
    ScalarHeadModel.from_pretrained(tmp_path / "run" / "final")


def test_dpo(qwen3_dir, tmp_path):
    from direct_alignment.config import DAConfig
    from direct_alignment.train import train

    cfg = DAConfig.model_validate({
        **COMMON, "name": "cuda_dpo", "model": model(qwen3_dir),
        "data": {"train": {"path": str(LONGFORM / "preference.jsonl"), "limit": 32},
                 "max_length": 256},
        "loss": {"name": "dpo", "beta": 0.1}, "reference": {"mode": "model"},
        "train": {**TRAIN, "batch_size": 8},
    })  # fmt: skip
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    assert_run(tmp_path / "run")
    load_causal_lm(tmp_path / "run" / "final")


def pg_dict(name: str, model_path: Path | str, algorithm: str) -> dict:
    import yaml

    preset = yaml.safe_load(
        (REPO / "configs" / "policy_gradients" / f"{algorithm}.yaml").read_text()
    )
    algo = preset["algorithm"]
    algo["ppo_epochs"] = 1
    return {
        **COMMON, "name": name, "model": model(model_path),
        "data": {"train": {"path": str(LONGFORM / "prompts.jsonl"), "limit": 64},
                 "prompt_column": "prompt", "answer_column": "answer"},
        "rewards": [{"name": "exact_match"}],
        "algorithm": algo,
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16},
        "train": {**TRAIN, "micro_batch_size": 8},
        "reference": {"mode": "model"},
    }  # fmt: skip


@pytest.mark.parametrize("algorithm,staleness", [("grpo", 0), ("ppo", 0), ("grpo", 1)])
def test_policy_gradient(qwen3_dir, tmp_path, algorithm, staleness):
    """staleness 1: a generator process samples ahead on the GPU and its batches reach the
    trainer on the CPU (the first GPU run found them left there)."""
    from policy_gradients.config import PGConfig
    from policy_gradients.train import train

    data = pg_dict(f"cuda_{algorithm}_k{staleness}", qwen3_dir, algorithm)
    data["rollout"]["max_staleness"] = staleness
    cfg = PGConfig.model_validate(data)
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    assert_run(tmp_path / "run")
    load_causal_lm(tmp_path / "run" / "final")


def test_t5_policy_sft_and_grpo(tmp_path):
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train as train_sft
    from policy_gradients.config import PGConfig
    from policy_gradients.train import train as train_pg

    sft = SFTConfig.model_validate({
        **COMMON, "name": "cuda_t5_sft", "model": model("tiny-t5-facts"),
        "data": {"train": {"path": str(LONGFORM / "sft.jsonl"), "limit": 32},
                 "format": "prompt_completion", "max_length": 128},
        "train": {**TRAIN, "batch_size": 8},
    })  # fmt: skip
    assert train_sft(sft, RunArgs(Path("t.yaml"), output_dir=tmp_path / "sft")) == 0
    assert_run(tmp_path / "sft")
    load_causal_lm(tmp_path / "sft" / "final")
    data = pg_dict("cuda_t5_grpo", tmp_path / "sft" / "final", "grpo")
    data["algorithm"]["advantage"]["dense_reduction"] = "sum"
    assert (
        train_pg(PGConfig.model_validate(data), RunArgs(Path("t.yaml"), output_dir=tmp_path / "pg"))
        == 0
    )
    assert_run(tmp_path / "pg")
    load_causal_lm(tmp_path / "pg" / "final")
