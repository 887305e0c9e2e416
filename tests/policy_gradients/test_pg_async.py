"""Asynchronous rollouts (`rollout.max_staleness`, policy_gradients.async_rollouts; issue 38):
the generator process at k = 0 trains bit for bit as the synchronous loop does; k = 1 runs as 2
processes, logs the weights' version of every rollout and resumes exactly after SIGKILLs; bad
settings are one-line errors; the shared-memory weight channel copies bit for bit."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import time

import psutil
import pytest
import test_kill_soak
import torch
import yaml
from conftest import REPO, tiny_pg_dict, write_yaml
from test_kill_soak import RANDOM, Soak, final_weights, logged_rows, metrics, soak_and_compare

from policy_gradients.config import PGConfig
from policy_gradients.train import main as pg_main
from rlhf_core.config import validate_config
from rlhf_core.errors import UserError
from rlhf_core.models import ModelConfig, load_policy
from rlhf_core.weight_sync import WeightChannel


def grpo_dict(max_steps: int = 4, **rollout) -> dict:
    cfg = tiny_pg_dict("tiny-qwen3", name="grpo", advantage={"name": "grpo"},
                       loss={"name": "clipped"})  # fmt: skip
    cfg["data"]["train"]["reasoning_gym"]["size"] = 200
    cfg["data"]["eval"]["reasoning_gym"]["size"] = 4
    cfg["rollout"].update(prompts_per_step=4, group_size=4, max_new_tokens=8, **rollout)
    cfg["train"].update(max_steps=max_steps, micro_batch_size=8)
    cfg["optim"]["lr"] = 1e-3
    return cfg


def run(cfg: dict, out, tmp_path) -> None:
    path = write_yaml(tmp_path / f"{out.name}.yaml", cfg)
    assert pg_main(["--config", str(path), "--output-dir", str(out)]) == 0


def versions(run_dir) -> list[tuple[int, int]]:
    """(step, policy_version) of every training rollout, distinct, in order."""
    with sqlite3.connect(run_dir / "rollouts.sqlite") as conn:
        rows = conn.execute("SELECT DISTINCT step, policy_version FROM rollouts ORDER BY step")
        return rows.fetchall()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("change", "message"), [
    ({"rollout": {"max_staleness": -1}}, r"rollout\.max_staleness -1: expected an integer >= 0"),
    ({"rollout": {"max_staleness": 1, "generator": "inline"}},
     r"rollout\.generator inline with rollout\.max_staleness 1"),
    ({"rollout": {"behaviour_logprobs": False},
      "algorithm": {"correction": {"name": "decoupled"}}},
     r"algorithm\.correction 'decoupled' .* rollout\.behaviour_logprobs is false"),
])  # fmt: skip
def test_bad_async_settings_are_one_line_errors(change, message):
    cfg = grpo_dict()
    for block, values in change.items():
        cfg[block].update(values)
    with pytest.raises(UserError) as err:
        validate_config(PGConfig, cfg, "run.yaml")
    lines = str(err.value).splitlines()
    assert lines[0] == "run.yaml: invalid config" and len(lines) == 2, lines  # one line: the field
    assert re.search(message, lines[1]), lines[1]


def test_weight_channel_copies_bit_for_bit_into_its_slots():
    torch.manual_seed(0)
    a, b = load_policy(ModelConfig(name_or_path="tiny-qwen3")), None
    channel = WeightChannel(a, slots=2)
    channel.publish(0, a)
    before = {n: p.detach().clone() for n, p in a.named_parameters()}
    with torch.no_grad():
        for p in a.parameters():
            p.add_(torch.randn_like(p))
    channel.publish(1, a)  # slot 1: version 0 stays in slot 0
    torch.manual_seed(1)
    b = load_policy(ModelConfig(name_or_path="tiny-qwen3"))
    channel.load(0, b)
    assert all(torch.equal(p, before[n]) for n, p in b.named_parameters())
    channel.load(3, b)  # version 3 is slot 1
    assert all(torch.equal(p, dict(a.named_parameters())[n]) for n, p in b.named_parameters())
    assert channel.bytes == 2 * sum(p.numel() * 4 for p in a.parameters())


# ----------------------------------------------------------------------------- k = 0


#: keys only a generator process logs
ASYNC_ONLY = {"train/sampling/policy_lag"}


@pytest.mark.slow
def test_generator_process_at_staleness_0_trains_bit_for_bit_as_the_synchronous_loop(tmp_path):
    """`rollout.generator: process` at k = 0: weights through shared memory, rollouts sampled
    and scored in the other process, the trainer digesting them: the final weights, every
    rollout row and every metric of the inline loop, bit for bit."""
    inline, process = tmp_path / "inline", tmp_path / "process"
    run(grpo_dict(), inline, tmp_path)
    run(grpo_dict(generator="process"), process, tmp_path)
    w_inline, w_process = final_weights(inline), final_weights(process)
    assert w_inline.keys() == w_process.keys()
    assert all(torch.equal(w_inline[k], w_process[k]) for k in w_inline)
    assert logged_rows(inline) == logged_rows(process)
    strip = [{k: v for k, v in r.items() if k not in ASYNC_ONLY} for r in metrics(process)]
    assert strip == metrics(inline)
    assert versions(process) == [(s, s - 1) for s in range(1, 5)]  # sampled by version step-1
    lags = [r["train/sampling/policy_lag"] for r in metrics(process) if "train/loss" in r]
    assert lags == [0, 0, 0, 0]


# ----------------------------------------------------------------------------- k = 1, k = 2


def generator_pid(log_path) -> int | None:
    found = re.search(r"rollout generator: process (\d+)", open(log_path).read())
    return int(found.group(1)) if found else None


@pytest.mark.slow
@pytest.mark.parametrize(("k", "kills"), [
    (1, ("checkpoint.staged:2", RANDOM, "rollout_log.insert:3")),
    (2, ("checkpoint.staged:3",)),
])  # fmt: skip
def test_stale_rollouts_resume_exactly_after_sigkills(k, kills, tmp_path, monkeypatch):
    """Trainer + generator process at max_staleness k, SIGKILLed at named points (the trainer
    alone dies: its generator must notice and exit) and at a random moment (both die), resumed
    from each checkpoint with its queue of batches sampled by older weights: weights, metrics,
    rollout rows (with their policy versions) and summary equal the uninterrupted run's."""
    monkeypatch.setattr(test_kill_soak, "N", len(kills))
    cfg = grpo_dict(max_steps=8, max_staleness=k)
    cfg["checkpoint"] = {"save_every": 1, "keep_last": 2}
    cfg["train"]["eval_every"] = 4

    class FixedSoak(Soak):
        def schedule(self) -> list[str]:
            return list(kills)

    soak = FixedSoak(f"async_k{k}", "policy_gradients.train", cfg, kills)
    soak_and_compare(soak, tmp_path)
    # the generators of the killed attempts are gone (a named kill hit the trainer alone)
    for attempt in range(len(kills)):
        pid = generator_pid(tmp_path / f"soak-attempt-{attempt}.log")
        assert pid is not None, attempt
        deadline = time.time() + 120
        while psutil.pid_exists(pid) and time.time() < deadline:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.5)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
    ref = tmp_path / "ref"
    assert versions(ref) == [(s, max(0, s - 1 - k)) for s in range(1, 9)]
    lags = [r["train/sampling/policy_lag"] for r in metrics(ref) if "train/loss" in r]
    assert lags == [min(s, k) for s in range(8)]
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["steps"] == 8


# ----------------------------------------------------------------------------- the algorithms


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reinforce", "rloo", "ppo", "dapo"])
def test_each_algorithm_trains_on_stale_rollouts(name, tmp_path):
    """REINFORCE, RLOO, PPO (value model, KL in the reward, the decoupled correction over its 4
    epochs) and DAPO (dynamic sampling's rounds in the generator) at max_staleness 1: the run
    finishes, its losses are finite and every rollout is logged with the version that sampled
    it (GRPO: the kill-soak above)."""
    algorithm = yaml.safe_load((REPO / "configs/policy_gradients" / f"{name}.yaml").read_text())
    cfg = tiny_pg_dict("tiny-qwen3", **algorithm["algorithm"])
    if name == "ppo":
        cfg["algorithm"]["correction"] = {"name": "decoupled", "cap": 5.0}
    if name == "dapo":
        cfg["rewards"].append({"name": "overlong", "max_length": 8, "cache_length": 4})
    cfg["data"]["train"]["reasoning_gym"]["size"] = 200
    cfg["data"]["eval"] = None
    cfg["rollout"].update(prompts_per_step=4, group_size=4, max_new_tokens=8, max_staleness=1)
    cfg["train"].update(max_steps=3, micro_batch_size=8)
    out = tmp_path / name
    run(cfg, out, tmp_path)
    train = [r for r in metrics(out) if "train/loss" in r]
    assert len(train) == 3 and all(math.isfinite(r["train/loss"]) for r in train)
    assert [r["train/sampling/policy_lag"] for r in train] == [0, 1, 1]
    logged = versions(out)  # dynamic sampling logs only the groups it kept
    assert logged and all(v == max(0, s - 2) for s, v in logged), logged
    if name != "dapo":
        assert [s for s, _ in logged] == [1, 2, 3]
    if name == "ppo":
        assert all("train/loss/correction/weight_mean" in r for r in train)
