"""Every trainer under `torchrun --nproc_per_node 2` (accelerate MULTI_CPU, gloo) against the same
config in one process with the same global batch: the per-step losses and the trained weights
agree within fp32 tolerance, only rank 0 writes, and a 2-process run resumes.

What makes the numbers equal: each process takes its slice of the global batch (whole groups
for GRPO), losses are normalised by the global batch's token/sequence counts and scaled by the
world size against DDP's gradient averaging, and GRPO's rollouts are seeded per prompt, so the
two processes sample exactly the completions one process samples.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, metric_series, tiny_pg_dict, write_yaml
from safetensors.torch import load_file


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(module: str, cfg: Path, out: Path, nproc: int, *extra: str) -> None:
    """`torchrun --nproc_per_node nproc -m module --config cfg --output-dir out`, or plain python
    for one process; fails the test with the output if it does not exit 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    args = ["-m", module, "--config", str(cfg), "--output-dir", str(out), *extra]
    if nproc > 1:
        runner = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                  "--master_addr", "127.0.0.1", "--master_port", str(free_port())]  # fmt: skip
        args = runner + args
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, (
        f"{module} x{nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )


def final_weights(run_dir: Path, name: str = "final") -> dict[str, torch.Tensor]:
    files = sorted((run_dir / name).glob("*.safetensors"))
    assert files, f"no weights in {run_dir / name}"
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def assert_same_run(one: Path, two: Path, loss_key: str, *, rtol: float = 1e-4) -> None:
    losses_1, losses_2 = metric_series(one, loss_key), metric_series(two, loss_key)
    assert losses_1.keys() == losses_2.keys() and len(losses_1) >= 2
    for step in losses_1:
        assert losses_2[step] == pytest.approx(losses_1[step], rel=rtol, abs=1e-6), step
    # fp32 tolerance *after Adam*: summing a batch in two halves changes gradients by ~1e-7
    # relative, and Adam's g / sqrt(v) turns that into up to ~1% of one update (lr 1e-3 here) on
    # the few entries whose gradient is near 0; measured max 3.3e-5, mean ~1e-8
    w1, w2 = final_weights(one), final_weights(two)
    assert w1.keys() == w2.keys()
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=1e-4, msg=key)
        assert (w2[key] - w1[key]).abs().mean() < 1e-6, key
    # rank 0 alone wrote the run dir: one metrics stream, with the world size in the summary
    summary = json.loads((two / "summary.json").read_text())
    assert (
        summary["processes"] == 2
        and json.loads((one / "summary.json").read_text())["processes"] == 1
    )
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if loss_key in r]
    assert steps == sorted(set(steps))  # no step logged twice


def test_dpo_two_processes_equal_one(tiny_dpo_dict, tmp_path):
    data = tiny_dpo_dict
    data["data"]["eval"] = None
    data["train"].update(batch_size=8, micro_batch_size=4, max_steps=3)
    cfg = write_yaml(tmp_path / "dpo.yaml", data)
    launch("direct_alignment.train", cfg, tmp_path / "one", 1)
    launch("direct_alignment.train", cfg, tmp_path / "two", 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", "train/loss")


def test_reward_model_two_processes_equal_one_and_resume(tmp_path):
    import yaml

    data = yaml.safe_load((REPO / "configs/reward_models/tiny_preference.yaml").read_text())
    data["data"]["eval"] = None
    data["train"].update(batch_size=8, micro_batch_size=4, max_steps=4, eval_every=0)
    data["train"]["export_sequence_classification"] = False
    data["checkpoint"] = {"save_every": 2, "keep_last": 2}
    data["tracking"] = {"log_every": 1}
    cfg = write_yaml(tmp_path / "rm.yaml", data)
    launch("reward_models.train", cfg, tmp_path / "one", 1)
    launch("reward_models.train", cfg, tmp_path / "two", 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", "train/loss")
    # resume under 2 processes from a copy of the 2-process run cut back to its step-2
    # checkpoint (as if killed after it): the same end point
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "checkpoint-4")
    assert (resumed / "checkpoints" / "checkpoint-2" / "trainer_state.pt").is_file()
    launch("reward_models.train", cfg, resumed, 2, "--resume", "auto")
    w_two, w_resumed = final_weights(tmp_path / "two"), final_weights(tmp_path / "resumed")
    for key in w_two:
        torch.testing.assert_close(w_resumed[key], w_two[key], rtol=1e-5, atol=1e-6, msg=key)


def rollouts(run: Path) -> list[tuple]:
    """The rollout log's (step, prompt, completion) rows, sorted."""
    with sqlite3.connect(run / "rollouts.sqlite") as conn:
        return sorted(conn.execute("SELECT step, prompt, completion FROM rollouts"))


def test_grpo_two_processes_equal_one(tmp_path):
    import yaml

    algorithm = yaml.safe_load((REPO / "configs/policy_gradients/grpo.yaml").read_text())
    algorithm = {**algorithm["algorithm"], "ppo_epochs": 2}  # GRPO, KL k3 in the loss, 2 passes
    data = tiny_pg_dict("tiny-qwen3", **algorithm)
    data["data"]["eval"] = None
    data["rollout"].update(prompts_per_step=4, group_size=4, max_new_tokens=8)
    data["train"].update(max_steps=2, micro_batch_size=4)
    data["optim"]["lr"] = 1e-3
    cfg = write_yaml(tmp_path / "grpo.yaml", data)
    launch("policy_gradients.train", cfg, tmp_path / "one", 1)
    launch("policy_gradients.train", cfg, tmp_path / "two", 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", "train/loss")
    # the same rollouts were sampled: one rollout log, written by rank 0 alone, equal to the
    # one-process run's
    assert rollouts(tmp_path / "two") == rollouts(tmp_path / "one")
    assert len(rollouts(tmp_path / "one")) == 2 * 4 * 4
    # the logged rollout metrics cover every process's completions (they once were rank 0's)
    for key in ("train/reward/total", "train/length/mean", "train/sampling/groups"):
        one, two = (metric_series(tmp_path / r, key) for r in ("one", "two"))
        assert one.keys() == two.keys() and all(abs(one[k] - two[k]) < 1e-9 for k in one), key


def test_dapo_dynamic_sampling_two_processes_equal_one(tmp_path):
    # the keep decision is global (the first informative groups of the whole batch), so the
    # processes keep uneven numbers of groups, and a process short of groups runs zero-weight
    # stand-ins so every optimizer step meets in DDP's all-reduce
    import yaml

    algorithm = yaml.safe_load((REPO / "configs/policy_gradients/dapo.yaml").read_text())
    # one optimizer step per batch: with several, each process shuffles its own rows into the
    # mini-batches, so the steps' contents differ from one process's (equal only in total)
    algorithm = {**algorithm["algorithm"], "mini_batches": 1, "max_sampling_rounds": 3}
    data = tiny_pg_dict("tiny-qwen3", **algorithm)
    data["data"]["eval"] = None
    data["rollout"].update(prompts_per_step=8, group_size=4, max_new_tokens=8)
    data["train"].update(max_steps=2, micro_batch_size=4)
    data["optim"]["lr"] = 1e-3
    cfg = write_yaml(tmp_path / "dapo.yaml", data)
    launch("policy_gradients.train", cfg, tmp_path / "one", 1)
    launch("policy_gradients.train", cfg, tmp_path / "two", 2)
    kept = rollouts(tmp_path / "one")
    assert rollouts(tmp_path / "two") == kept  # the same groups kept, in the same rounds
    for key in ("train/sampling/groups", "train/sampling/dropped_groups", "train/reward/total"):
        one, two = (metric_series(tmp_path / r, key) for r in ("one", "two"))
        assert one.keys() == two.keys() and all(two[k] == pytest.approx(one[k]) for k in one), key
    groups = metric_series(tmp_path / "one", "train/sampling/groups")
    dropped = metric_series(tmp_path / "one", "train/sampling/dropped_groups")
    assert any(v > 0 for v in dropped.values()) and any(v > 0 for v in groups.values())
    assert_same_run(tmp_path / "one", tmp_path / "two", "train/loss")
    # several optimizer steps per batch (uneven micro-batches per process) run through too
    cfg = write_yaml(
        tmp_path / "dapo4.yaml", {**data, "algorithm": {**algorithm, "mini_batches": 4}}
    )
    launch("policy_gradients.train", cfg, tmp_path / "four", 2)
    assert len(metric_series(tmp_path / "four", "train/loss")) == 2
