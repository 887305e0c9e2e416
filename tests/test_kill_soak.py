"""Kill-soak (issue 36, docs/reliability.md): SFT, DPO and GRPO single-process runs and a
2-process FSDP2 SFT run are each SIGKILLed N times, then resumed; the final weights (bit for
bit), every metrics line, every logged row (GRPO's rollout log, DPO's samples.jsonl) and
summary.json (clock fields aside) equal the uninterrupted run's, and the resumes leave nothing
half-written behind.

Each trainer cycles through its kinds of kill: a named point inside a write
(`rlhf_core.fault_points`: RLHF_KILL_AT="<point>:<n>" SIGKILLs the process at its nth hit of the
point) or a random moment of a training step, sent from here (a seeded delay after the attempt's
first new checkpoint); a kill after the final evaluation is logged, before final/, comes last.
What each kill left half-done (a checkpoint's temporary directory, a half-pruned checkpoint, the
rollout log's open transaction, ...) is recorded, and a named kill must leave what its point
promises.

    RLHF_SOAK_N=10 RLHF_SOAK_SEED=7 RLHF_SOAK_REPORT=soak.json \
        uv run pytest -s tests/test_kill_soak.py

N (kills per trainer) defaults to 1, the CI size, one named point each: SFT dies inside a
checkpoint write, DPO after its final evaluation, GRPO inside a rollout-log transaction, FSDP2
(rank 0 alone; torchrun stops rank 1) while pruning. N=2 adds a random kill (SFT, FSDP2), a kill
after the final evaluation (GRPO) or inside a checkpoint write (DPO). The seed defaults to a
fresh one; it is printed with the report and named in every failure, so a failing soak reruns
with RLHF_SOAK_SEED.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, tiny_pg_dict, write_yaml
from safetensors.torch import load_file
from test_multiprocess import free_port

N = int(os.environ.get("RLHF_SOAK_N", "1"))
SEED = int(os.environ.get("RLHF_SOAK_SEED") or random.SystemRandom().randrange(1_000_000))
REPORT = os.environ.get("RLHF_SOAK_REPORT")
RANDOM = "random"
FINAL = "final.evaluated:1"
#: metrics that are clocks, not results
TIMING = re.compile(r"elapsed|time|_per_s|throughput|wall")
_report: dict = {"seed": SEED, "kills_per_trainer": N, "trainers": {}}


@dataclass
class Soak:
    """One trainer's soak: its config, the kills it takes, what happened."""

    name: str
    module: str
    cfg: dict
    order: tuple[str, ...]  # its kills, cycled to N (FINAL, when in reach, comes last)
    nproc: int = 1
    kills: list[dict] = field(default_factory=list)

    def schedule(self) -> list[str]:
        others = [k for k in self.order if k != FINAL]
        kills = [others[i % len(others)] for i in range(N)]
        if FINAL in self.order and N > self.order.index(FINAL):
            kills[-1] = FINAL
        return kills


def steps_for(n: int) -> int:
    """Each kill moves the newest checkpoint on by 1 to 3 steps: room for all n."""
    return 2 * n + 4


def command(soak: Soak, out: Path, cfg_path: Path, *, resume: bool) -> list[str]:
    args = ["--resume", str(out)] if resume else ["--config", str(cfg_path), "--output-dir",
                                                   str(out)]  # fmt: skip
    runner = [sys.executable]
    if soak.nproc > 1:
        runner += ["-m", "torch.distributed.run", "--nproc_per_node", str(soak.nproc),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port())]  # fmt: skip
    return [*runner, "-m", soak.module, *args]


def start(soak: Soak, out: Path, cfg_path: Path, *, resume: bool, kill_at: str = ""):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1",
           "RLHF_KILL_AT": kill_at}  # fmt: skip
    log = open(out.parent / f"{out.name}-attempt-{len(soak.kills)}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(command(soak, out, cfg_path, resume=resume), cwd=out.parent, env=env,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    proc.log_path = log.name
    log.close()
    return proc


def finish(soak: Soak, out: Path, cfg_path: Path, *, resume: bool) -> None:
    """Run to the end: one process in this one (its `main`, as the command line calls it: no
    start-up to pay), several under torchrun."""
    if soak.nproc == 1:
        argv = command(soak, out, cfg_path, resume=resume)[3:]  # after `python -m module`
        assert importlib.import_module(soak.module).main(argv) == 0, (soak.name, SEED)
        return
    proc = start(soak, out, cfg_path, resume=resume)
    assert proc.wait(timeout=600) == 0, failure(soak, proc)


def failure(soak: Soak, proc) -> str:
    tail = Path(proc.log_path).read_text()[-4000:]
    return f"{soak.name} (RLHF_SOAK_SEED={SEED}), exit {proc.returncode}:\n{tail}"


def newest(out: Path) -> int:
    """The newest whole checkpoint's step (0: none yet)."""
    steps = [int(p.parent.name.split("-")[1]) for p in
             (out / "checkpoints").glob("checkpoint-*/trainer_state.pt")
             if p.parent.name.split("-")[1].isdigit()]  # fmt: skip
    return max(steps, default=0)


def kill_all(proc) -> None:
    """SIGKILL the trainer and, under torchrun, every worker (each in a session of its own)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(family, timeout=60)
    proc.wait(timeout=60)


#: what a kill leaves half-done, by where it landed (checkpoints/ globs; then the run dir's)
PARTIAL = (
    (".tmp-checkpoint-*", "checkpoint write (temporary dir)"),
    (".deleting-*", "checkpoint pruning (renamed aside)"),
    (".sharded-*", "sharded save (staged shards)"),
    (".old-*", "checkpoint swap"),
)


def left_behind(out: Path) -> set[str]:
    """What the run dir holds half-done: the writes a kill interrupted."""
    found = {what for pattern, what in PARTIAL if any((out / "checkpoints").glob(pattern))}
    journal = out / "rollouts.sqlite-journal"
    if journal.is_file() and journal.stat().st_size > 0:
        found.add("rollout-log transaction (hot journal)")
    if (out / ".tmp-final").exists():
        found.add("final/ write")
    if after_final_evaluation(out):
        found.add("after the final evaluation, before final/ and summary.json")
    return found


def after_final_evaluation(out: Path) -> bool:
    """Every step checkpointed and its evaluation logged, no final/ and no summary.json."""
    last = steps_for(N)
    return (newest(out) == last and not (out / "final").exists()
            and not (out / "summary.json").exists()
            and any(r["step"] == last and any(k.startswith("eval/") for k in r)
                    for r in metrics(out)))  # fmt: skip


#: what a kill at each named point must leave
EVIDENCE = {
    "checkpoint.staged": "checkpoint write (temporary dir)",
    "checkpoint.prune": "checkpoint pruning (renamed aside)",
    "rollout_log.insert": "rollout-log transaction (hot journal)",
    "final.evaluated": "after the final evaluation, before final/ and summary.json",
}


def soak_run(soak: Soak, out: Path, cfg_path: Path, step_time: float, rng: random.Random) -> None:
    """Start, kill, resume N times (each attempt dies at its scheduled point), then finish."""
    resume = False
    for kill in soak.schedule():
        before = newest(out) if resume else 0
        proc = start(soak, out, cfg_path, resume=resume, kill_at="" if kill == RANDOM else kill)
        record = {"kill": kill, "from_checkpoint": before}
        if kill == RANDOM:
            # past its start-up and one more step (so every attempt makes progress whatever the
            # load), then a random moment of the next step: sampling, training or saving
            deadline = time.time() + 600
            while newest(out) <= before and proc.poll() is None and time.time() < deadline:
                time.sleep(0.005)
            seen, delay = newest(out), step_time * rng.uniform(0.0, 0.9)
            time.sleep(delay)
            record["kill"] = f"random, {delay:.3f} s after checkpoint-{seen} appeared"
            assert proc.poll() is None, failure(soak, proc)  # it must not end before its kill
            kill_all(proc)
        else:
            proc.wait(timeout=600)
            kill_all(proc)  # a worker torchrun has not stopped yet
            if soak.nproc == 1:
                assert proc.returncode == -signal.SIGKILL, failure(soak, proc)
            else:
                assert proc.returncode != 0, failure(soak, proc)
        # where it landed: what it left half-done (the attempt, resumed, first removed what an
        # earlier kill left: `remove_partial_writes`, and SQLite rolls a hot journal back)
        record["landed"] = sorted(left_behind(out)) or ["between writes"]
        record["checkpoint_after"] = newest(out)
        if kill != RANDOM:
            expected = EVIDENCE[kill.split(":")[0]]
            assert expected in record["landed"], (soak.name, SEED, record)
        assert not (out / "summary.json").exists(), (soak.name, SEED, record)
        soak.kills.append(record)
        resume = True
    finish(soak, out, cfg_path, resume=True)
    # the resumes removed what the kills left half-done (a checkpoint's worth of disk each)
    assert not left_behind(out), (soak.name, SEED, left_behind(out))


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not TIMING.search(k)} for r in rows]


def logged_rows(run_dir: Path) -> dict[str, list]:
    """Every row a run logs besides metrics: the rollout log's two tables, samples.jsonl."""
    rows: dict[str, list] = {}
    if (run_dir / "rollouts.sqlite").is_file():
        with sqlite3.connect(run_dir / "rollouts.sqlite") as conn:
            for table in ("rollouts", "eval_rollouts", "turns"):
                rows[table] = list(conn.execute(f"SELECT * FROM {table} ORDER BY rowid"))
    if (run_dir / "samples.jsonl").is_file():
        rows["samples"] = (run_dir / "samples.jsonl").read_text().splitlines()
    return rows


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted((run_dir / "final").glob("*.safetensors")):
        out.update(load_file(path))
    assert out, f"no weights in {run_dir / 'final'}"
    return out


def soak_and_compare(soak: Soak, tmp_path: Path) -> None:
    cfg_path = write_yaml(tmp_path / f"{soak.name}.yaml", soak.cfg)
    ref, out = tmp_path / "ref", tmp_path / "soak"
    t0 = time.time()
    finish(soak, ref, cfg_path, resume=False)
    ref_s = time.time() - t0
    # a step's time, from the uninterrupted run's clock
    clock = [r for r in (json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in r]  # fmt: skip
    step_time = (clock[-1]["elapsed_s"] - clock[0]["elapsed_s"]) / (len(clock) - 1)
    rng = random.Random(f"{SEED}-{soak.name}")
    t0 = time.time()
    try:
        soak_run(soak, out, cfg_path, step_time, rng)
    finally:
        _report["trainers"][soak.name] = {
            "steps": soak.cfg["train"]["max_steps"], "processes": soak.nproc,
            "uninterrupted_s": round(ref_s, 1), "soak_s": round(time.time() - t0, 1),
            "step_s": round(step_time, 3), "kills": soak.kills,
        }  # fmt: skip
        write_report()
    assert len(soak.kills) == N
    # the end point: weights bit for bit, every metrics line, every logged row
    w_ref, w_out = final_weights(ref), final_weights(out)
    assert w_ref.keys() == w_out.keys()
    for key in w_ref:
        assert torch.equal(w_ref[key], w_out[key]), (soak.name, SEED, key)
    assert metrics(out) == metrics(ref), (soak.name, SEED)
    assert logged_rows(out) == logged_rows(ref), (soak.name, SEED)
    assert summary(out) == summary(ref), (soak.name, SEED)
    assert json.loads((out / "status.json").read_text())["status"] == "finished"


def summary(run_dir: Path) -> dict:
    facts = json.loads((run_dir / "summary.json").read_text())
    return {k: v for k, v in facts.items() if not TIMING.search(k)}


def write_report() -> None:
    landed = Counter(w for t in _report["trainers"].values() for k in t["kills"]
                     for w in k["landed"])  # fmt: skip
    named = Counter(k["kill"] for t in _report["trainers"].values() for k in t["kills"]
                    if not k["kill"].startswith(RANDOM))  # fmt: skip
    _report["named_kills"], _report["landed"] = dict(named), dict(landed)
    text = json.dumps(_report, indent=1)
    print(f"\nkill-soak report (RLHF_SOAK_SEED={SEED}):\n{text}", file=sys.stderr)
    if REPORT:
        Path(REPORT).write_text(text + "\n")


# ----------------------------------------------------------------------------- the four runs


def checkpoint_every_step(cfg: dict) -> dict:
    cfg["train"]["max_steps"] = steps_for(N)
    cfg["checkpoint"] = {"save_every": 1, "keep_last": 2}
    return cfg


@pytest.mark.slow
def test_sft_survives_sigkills(tiny_sft_dict, tmp_path):
    cfg = checkpoint_every_step(tiny_sft_dict)
    cfg["data"]["eval"]["reasoning_gym"]["size"] = 8  # the final evaluation only
    soak = Soak("sft", "instruction_tuning.train", cfg,
                ("checkpoint.staged:2", RANDOM, "checkpoint.prune:1", FINAL))  # fmt: skip
    soak_and_compare(soak, tmp_path)


@pytest.mark.slow
def test_dpo_survives_sigkills(tiny_dpo_dict, tmp_path):
    cfg = checkpoint_every_step(tiny_dpo_dict)
    cfg["data"]["eval"]["reasoning_gym"]["size"] = 8
    cfg["train"].update(samples_every=1, num_samples=2, sample_max_new_tokens=4)
    soak = Soak("dpo", "direct_alignment.train", cfg,
                (FINAL, "checkpoint.staged:2", RANDOM, "checkpoint.prune:1"))  # fmt: skip
    soak_and_compare(soak, tmp_path)


@pytest.mark.slow
def test_grpo_survives_sigkills(tmp_path):
    cfg = tiny_pg_dict("tiny-qwen3", name="grpo", advantage={"name": "grpo"},
                       loss={"name": "clipped"})  # fmt: skip
    cfg = checkpoint_every_step(cfg)
    cfg["data"]["eval"]["reasoning_gym"]["size"] = 4
    cfg["rollout"].update(prompts_per_step=4, group_size=4, max_new_tokens=8)
    cfg["train"].update(eval_every=2, micro_batch_size=8)
    cfg["optim"]["lr"] = 1e-3
    soak = Soak("grpo", "policy_gradients.train", cfg,
                ("rollout_log.insert:3", FINAL, RANDOM, "checkpoint.staged:2"))  # fmt: skip
    soak_and_compare(soak, tmp_path)
    rewards = [r.get("train/reward/total", 0) for r in metrics(tmp_path / "ref")]
    assert any(r > 0 for r in rewards)  # the policy learned from something: a real test


@pytest.mark.slow
def test_fsdp2_sft_survives_sigkills(tiny_sft_dict, tmp_path):
    cfg = checkpoint_every_step(tiny_sft_dict)
    cfg["data"]["eval"] = None
    cfg["train"].update(micro_batch_size=4, engine="fsdp2")
    soak = Soak("fsdp2_sft", "instruction_tuning.train", cfg,
                ("checkpoint.prune:1", RANDOM, "checkpoint.staged:2"), nproc=2)  # fmt: skip
    soak_and_compare(soak, tmp_path)
