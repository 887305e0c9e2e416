"""Policy-gradient training end to end on the tiny world, from a partly trained SFT model."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, metric_series, tiny_pg_dict, write_yaml
from safetensors.torch import load_file

from policy_gradients.config import PGConfig
from policy_gradients.train import main, train
from rlhf_core.config import RunArgs


def algorithm_of(name: str) -> dict:
    """The algorithm block of a shipped YAML (the named presets)."""
    return yaml.safe_load((REPO / "configs" / "policy_gradients" / f"{name}.yaml").read_text())[
        "algorithm"
    ]


def run_cfg(data: dict, out: Path) -> int:
    return train(PGConfig.model_validate(data), RunArgs(Path("t.yaml"), output_dir=out))


ALGORITHMS = ["reinforce", "rloo", "ppo", "grpo", "dr_grpo", "gspo", "cispo", "dapo"]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_each_algorithm_runs_with_finite_loss_and_changes_the_policy(
    sft_checkpoint, tmp_path, name
):
    algorithm = algorithm_of(name)
    if algorithm["loss"].get("normalizer") == 1024:  # dr_grpo's constant: max_new_tokens here
        algorithm["loss"]["normalizer"] = 12
    data = tiny_pg_dict(sft_checkpoint, **algorithm)
    if name == "dapo":
        data["rewards"].append({"name": "overlong", "max_length": 12, "cache_length": 4})
    data["data"]["eval"] = None
    assert run_cfg(data, tmp_path / "run") == 0
    losses = metric_series(tmp_path / "run", "train/loss")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    start, final = (
        load_file(sft_checkpoint / "model.safetensors"),
        load_file(tmp_path / "run" / "final" / "model.safetensors"),
    )
    changed = [not torch.equal(final[k], start[k]) for k in final]
    assert all(changed), f"{changed.count(False)} tensors unchanged"
    if name == "ppo":
        assert (tmp_path / "run" / "final").is_dir()


def test_grpo_raises_the_training_reward(sft_checkpoint, tmp_path):
    """GRPO from the partly trained SFT model: 20 steps of 32 prompts x 8 completions, lr 1e-4
    (warm-up over the first 10 steps), clip 0.2, no KL, 2 updates per batch."""
    data = tiny_pg_dict(sft_checkpoint, **algorithm_of("grpo"))
    data["algorithm"]["loss"]["kl_beta"] = 0.0
    data["algorithm"]["ppo_epochs"] = 2
    data["rollout"].update(prompts_per_step=32, group_size=8, max_new_tokens=16)
    data["train"].update(max_steps=20, micro_batch_size=256, eval_every=0, threads=None)
    data["optim"].update(lr=1e-4, warmup_steps=10)
    data["data"]["eval"] = None
    assert run_cfg(data, tmp_path / "run") == 0
    reward = metric_series(tmp_path / "run", "train/reward/total")
    start, later = sum(reward[s] for s in (1, 2, 3)) / 3, sum(reward[s] for s in range(14, 21)) / 7
    # measured with this fixture (SFT in rows of max_length): the partial-credit reward goes from
    # 0.667 (steps 1-3) to 0.709 (steps 14-20), a rise of 0.042, most of it after the warm-up
    # (steps 1-10 alone rose 0.013; with the earlier segmented-rows fixture 10 steps gave 0.035)
    assert later - start > 0.02, (start, later)
    rows = (
        sqlite3.connect(tmp_path / "run" / "rollouts.sqlite")
        .execute("SELECT COUNT(*), COUNT(DISTINCT step), AVG(length) FROM rollouts")
        .fetchone()
    )
    assert rows[0] == 20 * 32 * 8 and rows[1] == 20 and rows[2] > 0


def test_eval_and_kl_reporting(sft_checkpoint, tmp_path):
    data = tiny_pg_dict(sft_checkpoint, **algorithm_of("grpo"))  # kl_beta 0.04 in the loss
    data["train"]["eval_every"] = 1
    assert run_cfg(data, tmp_path / "run") == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in (
        "eval/greedy_reasoning_gym",
        "eval/sampled_reasoning_gym_exact",
        "eval/sampled_kl_k3",
    ):
        assert 0 <= summary[key] < float("inf"), key
    # on-policy GRPO (one pass) skips the rollout-time old-log-prob forward, so the KL comes
    # from the loss's own metric (k3 of the current policy against the reference)
    kl = metric_series(tmp_path / "run", "train/loss/kl")
    assert kl[1] == pytest.approx(0.0, abs=1e-6)  # the first rollout is from pi_ref itself
    assert kl[2] > 0


def test_lora_policy_with_adapter_reference(sft_checkpoint, tmp_path):
    data = tiny_pg_dict(sft_checkpoint, **algorithm_of("grpo"))
    data["model"]["lora"] = {"r": 4, "alpha": 8}
    data["reference"] = {"mode": "adapter"}
    data["data"]["eval"] = None
    assert run_cfg(data, tmp_path / "run") == 0
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()


# SIGKILL + --resume of a PG run (two PPO epochs per step): tests/test_reliability.py's GRPO
# soak kills one ten times and checks the final weights and the rollout log.


def test_dry_run_and_config_errors(sft_checkpoint, tmp_path, capsys):
    data = tiny_pg_dict(sft_checkpoint, **algorithm_of("ppo"))
    path = write_yaml(tmp_path / "c.yaml", data)
    assert main(["--config", str(path), "--dry-run"]) == 0
    assert "ppo: GAEAdvantage + ClippedSurrogateLoss" in capsys.readouterr().out
    data["algorithm"]["value_loss"] = None
    path = write_yaml(tmp_path / "bad.yaml", data)
    from rlhf_core.config import ConfigError

    with pytest.raises(ConfigError, match="'gae' advantage needs algorithm.value_loss"):
        main(["--config", str(path), "--dry-run"])


def test_split_into_consecutive_nearly_equal_groups():
    from policy_gradients.update import split_into

    assert split_into(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_into(list(range(2)), 5) == [[0], [1]]
    assert split_into(list(range(4)), 1) == [[0, 1, 2, 3]]


def test_mini_batches_take_several_off_policy_steps_per_rollout_batch(sft_checkpoint, tmp_path):
    algorithm = {**algorithm_of("dapo"), "dynamic_sampling": False, "mini_batches": 2}
    data = tiny_pg_dict(sft_checkpoint, **algorithm)
    data["data"]["eval"] = None
    data["rewards"] = [{"name": "reasoning_gym", "extract": "full"}]
    data["optim"]["lr"] = 1e-3
    # 8 prompts x 4 = 32 rows = 4 micro-batches of 8 per pass -> 2 optimizer steps of 2 each
    data["train"].update(max_steps=2, micro_batch_size=8)
    data["checkpoint"].update(save_every=2)
    assert run_cfg(data, tmp_path / "run") == 0
    state = torch.load(
        tmp_path / "run/checkpoints/checkpoint-2/trainer_state.pt", weights_only=False
    )
    steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert steps == {4.0}  # 2 rollout batches x 2 mini-batch updates
    # the second update of a batch is off-policy: the ratio moves and the clip can act
    ratio = metric_series(tmp_path / "run", "train/loss/ratio_mean")
    assert all(abs(r - 1.0) > 1e-7 for r in ratio.values())
    with pytest.raises(ValueError, match=r"mini_batches \(5\) exceeds the micro-batches per pass"):
        run_cfg({**data, "algorithm": {**algorithm, "mini_batches": 5}}, tmp_path / "bad")


def test_rollout_log_holds_training_and_eval_rollouts(tmp_path):
    """2 GRPO steps with evaluation after step 1 and at the end: `rollouts` has every training
    sample with its epoch, prompt index and place in its group; `eval_rollouts` has every
    held-out completion of both evaluations (greedy and sampled)."""
    data = tiny_pg_dict("tiny-qwen3", **algorithm_of("grpo"))
    data["train"].update(eval_every=1)
    assert run_cfg(data, tmp_path / "run") == 0
    with sqlite3.connect(tmp_path / "run" / "rollouts.sqlite") as conn:
        train_rows = conn.execute(
            "SELECT step, epoch, prompt_index, rollout_index, advantage FROM rollouts"
        ).fetchall()
        eval_rows = conn.execute(
            "SELECT step, kind, COUNT(*), COUNT(DISTINCT prompt_index) FROM eval_rollouts "
            "GROUP BY step, kind ORDER BY step, kind"
        ).fetchall()
        indices = {r[1] for r in conn.execute("PRAGMA index_list(rollouts)")}
        eval_columns = [c[1] for c in conn.execute("PRAGMA table_info(eval_rollouts)")]
    assert len(train_rows) == 2 * 8 * 4
    groups: dict[tuple[int, int], list[int]] = {}
    for step, epoch, prompt_index, rollout_index, _ in train_rows:
        assert epoch == 0 and 0 <= prompt_index < 2000
        groups.setdefault((step, prompt_index), []).append(rollout_index)
    assert len(groups) == 2 * 8 and all(sorted(g) == [0, 1, 2, 3] for g in groups.values())
    assert eval_rows == [(1, "greedy", 16, 16), (1, "sampled", 16, 16),
                         (2, "greedy", 16, 16), (2, "sampled", 16, 16)]  # fmt: skip
    assert "rollouts_step" in indices and "advantage" not in eval_columns
