"""Reliability: a run never loses data, never ends green with a broken model, and every user
error is one clear line (docs/reliability.md maps each promise to its test here).

Cases (issue 12): 1 re-run into a run dir; 2 two runs at once; 3 non-finite gradients; 4 rollout
rows after kill/resume (the soak test); 5 the printed resume command; 6 coerced config values;
7 degenerate data; 8 unreadable files; 9 damaged checkpoints (fault injection); 10 disk full;
11 Ctrl-C in the quickstart (tests/rlhf_lab/test_quickstart.py); 12 exit code 2 and --debug.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_module, start_module, tiny_pg_dict, wait_for_checkpoint, write_yaml
from safetensors.torch import load_file

from rlhf_core.config import ConfigError, RunArgs, load_config
from rlhf_core.errors import UserError
from rlhf_core.loop import TrainingDiverged
from rlhf_core.rundir import LOCK_FILE, run_status


def sft_train(cfg_dict: dict, out: Path, tmp_path: Path, **run: object) -> int:
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train

    path = write_yaml(tmp_path / f"sft-{random.random()}.yaml", cfg_dict)
    cfg = load_config(SFTConfig, path)
    return train(cfg, RunArgs(config_path=path, output_dir=out, **run))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    (path,) = (run_dir / "final").glob("*.safetensors")
    return load_file(path)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


# ----------------------------------------------------------------------------- 1, 12


def test_a_rerun_into_a_run_dir_refuses_with_one_line_and_loses_nothing(tiny_sft_dict, tmp_path):
    tiny_sft_dict["train"]["max_steps"] = 4
    tiny_sft_dict["checkpoint"].update(save_every=2, keep_last=1)
    tiny_sft_dict["data"]["eval"] = None
    out = tmp_path / "run"
    assert sft_train(tiny_sft_dict, out, tmp_path) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # the same command again, from the command line: exit 2, one line, no traceback
    cfg_path = write_yaml(tmp_path / "again.yaml", {**tiny_sft_dict, "seed": 1})
    again = run_module("instruction_tuning.train", "--config", str(cfg_path), "--output-dir",
                       str(out), cwd=tmp_path)  # fmt: skip
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith("error: ")
    assert again.stderr.count("error: ") == 1 and "Traceback" not in again.stderr
    assert "already holds a run" in again.stderr and "--overwrite" in again.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # --debug shows where the refusal came from
    debug = run_module("instruction_tuning.train", "--config", str(cfg_path), "--output-dir",
                       str(out), "--debug", cwd=tmp_path)  # fmt: skip
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    # --overwrite keeps the old run whole, next to the new one; keep_last only prunes the new run
    tiny_sft_dict["train"]["max_steps"] = 6
    assert sft_train(tiny_sft_dict, out, tmp_path, overwrite=True) == 0
    (aside,) = tmp_path.glob("run.replaced-*")
    assert {p.relative_to(aside) for p in aside.rglob("*") if p.is_file()} >= {
        p.relative_to(out) for p in before
    }
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-6"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


# ----------------------------------------------------------------------------- 2


def test_a_second_run_into_a_live_run_dir_refuses(tiny_sft_dict, tmp_path):
    tiny_sft_dict["train"]["max_steps"] = 100_000
    tiny_sft_dict["checkpoint"].update(save_every=1, keep_last=1)
    cfg_path = write_yaml(tmp_path / "long.yaml", tiny_sft_dict)
    out = tmp_path / "run"
    proc = start_module("instruction_tuning.train", "--config", str(cfg_path), "--output-dir",
                        str(out), cwd=tmp_path)  # fmt: skip
    try:
        wait_for_checkpoint(proc, out / "checkpoints" / "checkpoint-1")
        lock = json.loads((out / LOCK_FILE).read_text())
        assert lock["pid"] == proc.pid
        for run in ({}, {"overwrite": True}, {"resume": "auto"}):
            with pytest.raises(UserError, match=f"in use by another run: pid {proc.pid}"):
                sft_train(tiny_sft_dict, out, tmp_path, **run)
        assert run_status(out)["status"] == "running"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert run_status(out)["status"] == "interrupted"  # killed: its lock is dead


# ----------------------------------------------------------------------------- 3


def test_a_non_finite_gradient_skips_the_step_bit_exactly():
    from accelerate import Accelerator

    from rlhf_core.loop import SkippedSteps, optimizer_step
    from rlhf_core.optim import OptimConfig, build_optimizer, build_scheduler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    cfg = OptimConfig(lr=1e-2, warmup_steps=2)
    optimizer, accelerator = build_optimizer(model, cfg), Accelerator(cpu=True)
    scheduler = build_scheduler(optimizer, cfg, 10)
    skips = SkippedSteps(limit=2)

    def step(scale: float) -> bool:
        loss = model(torch.ones(3, 4)).sum() * scale
        loss.backward()
        return optimizer_step(accelerator, model, optimizer, scheduler, max_grad_norm=None,
                              loss=loss.detach(), skips=skips)[1]  # fmt: skip

    assert not step(1.0)  # a real step, so the optimizer has state
    params = [p.detach().clone() for p in model.parameters()]
    opt_state = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state.items()}
    sched_state = dict(scheduler.state_dict())
    model[1].weight.register_hook(lambda g: g * float("inf"))  # a finite loss, inf gradient
    assert step(1.0)  # finite loss, inf gradient: skipped
    for p, p0 in zip(model.parameters(), params, strict=True):
        assert torch.equal(p.detach(), p0)
    for k, v in optimizer.state.items():
        assert all(torch.equal(t, opt_state[k][n]) for n, t in v.items())
    assert scheduler.state_dict() == sched_state and skips.total == 1
    with pytest.raises(TrainingDiverged, match="2 optimizer steps in a row were skipped"):
        step(1.0)


@pytest.mark.slow
def test_sft_with_an_exploding_lr_stops_with_exit_2_and_writes_no_broken_model(
    tiny_sft_dict, tmp_path
):
    tiny_sft_dict["optim"] = {"lr": 1e10, "warmup_steps": 0}
    tiny_sft_dict["train"]["max_steps"] = 30
    tiny_sft_dict["checkpoint"]["save_every"] = 1
    tiny_sft_dict["data"]["eval"] = None
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match="in a row were skipped"):
        sft_train(tiny_sft_dict, out, tmp_path)
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    assert run_status(out)["status"] == "failed"
    for ckpt in (out / "checkpoints").glob("checkpoint-*"):
        for tensor in load_file(next(ckpt.glob("*.safetensors"))).values():
            assert torch.isfinite(tensor).all()


@pytest.mark.slow
def test_dpo_with_an_absurd_beta_stops_instead_of_learning_nothing(tiny_dpo_dict, tmp_path):
    from direct_alignment.config import DAConfig
    from direct_alignment.train import train

    tiny_dpo_dict["loss"]["beta"] = 1e30
    tiny_dpo_dict["data"]["eval"] = None
    path = write_yaml(tmp_path / "dpo.yaml", tiny_dpo_dict)
    with pytest.raises(TrainingDiverged):
        train(load_config(DAConfig, path), RunArgs(config_path=path, output_dir=tmp_path / "r"))
    assert not (tmp_path / "r" / "final").exists()


# ----------------------------------------------------------------------------- 5


@pytest.mark.slow
def test_the_printed_resume_command_works_verbatim_and_guards_the_run(tiny_sft_dict, tmp_path):
    tiny_sft_dict["data"]["eval"] = None
    cfg_path = write_yaml(tmp_path / "sft.yaml", tiny_sft_dict)
    out = tmp_path / "run"
    sets = ["--set", "train.max_steps=100000", "--set", "checkpoint.save_every=2",
            "--set", "optim.lr=2e-3"]  # fmt: skip
    proc = start_module("instruction_tuning.train", "--config", str(cfg_path), *sets,
                        "--output-dir", str(out), cwd=tmp_path)  # fmt: skip
    wait_for_checkpoint(proc, out / "checkpoints" / "checkpoint-2")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    printed = re.search(r"Resume with:\n  (python -m .*)\n", proc.stdout.read()).group(1)
    assert printed == f"python -m instruction_tuning.train --resume {out}"
    step = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir())
    # a setting that changes the run's meaning is refused, naming it
    bad = run_module(*printed.split()[2:], "--set", "train.batch_size=8", cwd=tmp_path)
    assert bad.returncode == 2 and "train.batch_size: 16 -> 8" in bad.stderr
    # the printed command, verbatim, plus a safe change of the step budget
    resumed = run_module(*printed.split()[2:], "--set", f"train.max_steps={step + 2}",
                         cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 2e-3 and saved["checkpoint"]["save_every"] == 2
    assert run_status(out)["status"] == "finished"


# ----------------------------------------------------------------------------- 6


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"optim": {"lr": True}}, "expected a number, got the boolean True"),
        ({"optim": {"lr": float("inf")}}, "finite number"),
        ({"optim": {"lr": float("nan")}}, "finite number"),
        ({"optim": {"betas": [0.9, 1.0]}}, r"betas must each be in \[0, 1\)"),
        ({"train": {"eval_sampled": 1}}, "expected true or false, got the number 1"),
        ({"loss": {"name": "nope"}}, "unknown SFT loss 'nope'; registered: (.+, )?nll"),
    ],
)
def test_config_values_are_not_coerced(tiny_sft_dict, tmp_path, edit, message):
    from instruction_tuning.config import SFTConfig

    for block, values in edit.items():
        tiny_sft_dict[block] = {**tiny_sft_dict.get(block, {}), **values}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tiny_sft_dict))
    with pytest.raises(ConfigError, match=message):
        load_config(SFTConfig, path)


def test_yaml_words_for_booleans_and_infinity_are_refused_in_numbers(tiny_dpo_dict, tmp_path):
    from direct_alignment.config import DAConfig

    path = write_yaml(tmp_path / "dpo.yaml", tiny_dpo_dict)
    for text, message in (("lr: yes", "boolean True"), ("lr: .inf", "finite number"),
                          ("beta: on", "boolean True")):  # fmt: skip
        key = text.split(":")[0]
        raw = re.sub(rf"(?m)^(\s*){key}: .*$", rf"\g<1>{text}", path.read_text(), count=1)
        (tmp_path / "x.yaml").write_text(raw)
        with pytest.raises(ConfigError, match=message):
            load_config(DAConfig, tmp_path / "x.yaml")


def test_group_estimators_refuse_groups_of_one():
    from policy_gradients.config import PGConfig

    data = tiny_pg_dict(Path("tiny-qwen3"), name="grpo", advantage={"name": "grpo"},
                        loss={"name": "clipped"})  # fmt: skip
    data["rollout"]["group_size"] = 1
    with pytest.raises(ValueError, match="group_size 1.*always gets advantage 0"):
        PGConfig.model_validate(data)


def test_dry_run_catches_what_a_run_would_refuse(tiny_sft_dict, tmp_path):
    tiny_sft_dict["loss"] = {"name": "nope"}
    path = write_yaml(tmp_path / "sft.yaml", tiny_sft_dict)
    out = run_module("instruction_tuning.train", "--config", str(path), "--dry-run", cwd=tmp_path)
    assert out.returncode == 2 and "unknown SFT loss 'nope'" in out.stderr


# ----------------------------------------------------------------------------- 7


def test_degenerate_preference_data_is_refused_and_a_few_bad_rows_warned(tmp_path):
    from direct_alignment.data import build_preference_data
    from rlhf_core.data import DataSource
    from rlhf_core.models import ModelConfig, load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")
    rows = [{"prompt": f"q{i}", "chosen": "", "rejected": f"no {i}"} for i in range(8)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = DataSource(path=str(path))
    kwargs = {"fmt": "preference", "max_length": 64, "max_prompt_length": None, "where": "d"}
    with pytest.raises(UserError, match="8 of 8 rows have an empty 'chosen' completion"):
        build_preference_data(source, tokenizer, **kwargs)
    rows[1:] = [{**r, "chosen": f"yes {i}"} for i, r in enumerate(rows[1:])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="1 of 8 rows have an empty 'chosen' completion"):
        build_preference_data(source, tokenizer, **kwargs)


def test_sft_lengths_that_cut_every_prompt_to_one_token_are_refused():
    from instruction_tuning.data import build_sft_data
    from rlhf_core.data import DataSource
    from rlhf_core.models import ModelConfig, load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")
    source = DataSource(reasoning_gym={"task": "spell_backward", "size": 16, "seed": 1})
    with pytest.raises(UserError, match="16 of 16 rows have their prompt cut to a single token"):
        build_sft_data(source, tokenizer, fmt="auto", max_length=2, max_prompt_length=None,
                       where="data.train")  # fmt: skip


# ----------------------------------------------------------------------------- 8


def test_unreadable_inputs_name_the_file_and_line(tiny_sft_dict, tmp_path):
    from instruction_tuning.config import SFTConfig
    from rlhf_core.data import DataSource, load_rows

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(yaml.safe_dump(tiny_sft_dict).encode() + "# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(latin1))}: not UTF-8 text"):
        load_config(SFTConfig, latin1)
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": \n')
    with pytest.raises(UserError, match=rf"{re.escape(str(bad))}:2: not valid JSON"):
        load_rows(DataSource(path=str(bad)), field="data.train")
    (tmp_path / "adir.jsonl").mkdir()
    with pytest.raises(UserError, match="is a directory; give a data file inside it"):
        load_rows(DataSource(path=str(tmp_path / "adir.jsonl")), field="data.train")


# ----------------------------------------------------------------------------- 10


def test_disk_full_during_a_checkpoint_names_the_last_good_one(tmp_path, monkeypatch):
    from rlhf_core import checkpoint
    from rlhf_core.checkpoint import CheckpointWriteError, newest_valid_checkpoint, save_checkpoint
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

    model = load_policy(ModelConfig(name_or_path="tiny-qwen3"))
    tokenizer = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")
    optimizer = torch.optim.AdamW(model.parameters())
    args = {"model": model, "tokenizer": tokenizer, "optimizer": optimizer, "scheduler": None,
            "state": {}, "keep_last": 2}  # fmt: skip
    good = save_checkpoint(tmp_path / "checkpoints", 1, **args)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(tmp_path / "checkpoints", 2, **args)
    message = str(info.value)
    assert "could not write checkpoint-2" in message and "No space left on device" in message
    assert f"The last good checkpoint is {good}" in message
    monkeypatch.undo()
    assert newest_valid_checkpoint(tmp_path / "checkpoints") == good
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["checkpoint-1"]


def test_a_model_with_nan_weights_is_never_saved(tmp_path):
    from rlhf_core.checkpoint import NonFiniteModelError, save_checkpoint
    from rlhf_core.models import ModelConfig, load_policy

    model = load_policy(ModelConfig(name_or_path="tiny-qwen3"))
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteModelError, match="NaN/inf"):
        save_checkpoint(tmp_path, 1, model=model, tokenizer=None,
                        optimizer=torch.optim.AdamW(model.parameters()), scheduler=None,
                        state={}, keep_last=1)  # fmt: skip
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- 9: fault injection


def harness(out: Path, cfg_path: Path, tmp_path: Path, *, save_call: int, event: int):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "KILL_SAVE_CALL": str(save_call),
           "KILL_EVENT": str(event)}  # fmt: skip
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / "kill_inside_save.py"), "instruction_tuning.train",
         "--config", str(cfg_path), "--output-dir", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_kills_inside_checkpoint_saving_never_leave_a_torn_checkpoint(tiny_sft_dict, tmp_path):
    """SIGKILL at points spread over the third checkpoint save (writing model files, the
    trainer state, the manifest, the renames, pruning checkpoint-2); `--resume auto` must pick a
    whole checkpoint and end with weights equal to the uninterrupted run's."""
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train

    tiny_sft_dict["train"]["max_steps"] = 8
    tiny_sft_dict["data"]["eval"] = None
    tiny_sft_dict["checkpoint"].update(save_every=2, keep_last=2)
    cfg_path = write_yaml(tmp_path / "sft.yaml", tiny_sft_dict)
    ref = harness(tmp_path / "ref", cfg_path, tmp_path, save_call=3, event=10**12)
    assert ref.returncode == 0, ref.stderr[-2000:]
    total = int(re.search(r"SAVE_EVENTS (\d+)", ref.stdout).group(1))
    for k, fraction in enumerate((0.01, 0.3, 0.6, 0.9, 0.99, 0.9995)):
        out = tmp_path / f"killed-{k}"
        killed = harness(out, cfg_path, tmp_path, save_call=3, event=max(1, int(total * fraction)))
        assert killed.returncode == -signal.SIGKILL, (fraction, killed.stderr[-2000:])
        cfg = load_config(SFTConfig, cfg_path)
        assert train(cfg, RunArgs(config_path=cfg_path, output_dir=out, resume="auto")) == 0
        assert_same_weights(tmp_path / "ref", out)
        steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, 9))


# ----------------------------------------------------------------------------- 4: GRPO soak


@pytest.mark.slow
def test_grpo_survives_random_sigkills_exactly(sft_checkpoint, tmp_path):
    """Ten SIGKILLs at random moments of a 16-step GRPO run with two PPO epochs a step (each
    while it trains, samples or writes a checkpoint), each followed by `--resume`: the final
    weights equal the uninterrupted run's and the rollout log holds exactly one set of rows per
    step."""
    data = tiny_pg_dict(sft_checkpoint, name="grpo", advantage={"name": "grpo"},
                        loss={"name": "clipped"})  # fmt: skip
    data["data"]["eval"] = None
    data["algorithm"]["ppo_epochs"] = 2  # the replay buffer's shuffles resume too
    data["train"]["max_steps"] = steps = 16
    data["checkpoint"].update(save_every=1, keep_last=2)
    cfg_path = write_yaml(tmp_path / "grpo.yaml", data)
    # the uninterrupted run, timed: start-up (to checkpoint-1) and the time of one step
    t0 = time.time()
    ref = start_module("policy_gradients.train", "--config", str(cfg_path), "--output-dir",
                       str(tmp_path / "ref"), cwd=tmp_path)  # fmt: skip
    wait_for_checkpoint(ref, tmp_path / "ref" / "checkpoints" / "checkpoint-1")
    first = time.time() - t0
    output, _ = ref.communicate(timeout=600)  # read the pipe, or a full one blocks the run
    assert ref.returncode == 0, output[-2000:]
    step_time = (time.time() - t0 - first) / (steps - 1)
    out, rng, kills = tmp_path / "soak", random.Random(0), 0
    args = ["--config", str(cfg_path), "--output-dir", str(out)]

    def newest() -> int:  # the newest whole checkpoint's step (0: none yet)
        done = [int(p.parent.name.split("-")[1]) for p in
                (out / "checkpoints").glob("checkpoint-*/trainer_state.pt")
                if p.parent.name.split("-")[1].isdigit()]  # fmt: skip
        return max(done, default=0)

    for _ in range(10):
        # each attempt gets past its start-up and one more step (so every attempt makes
        # progress, whatever the machine's load), then dies at a random moment of the next
        # step: while it samples, trains or writes its checkpoint
        proc = subprocess.Popen(
            [sys.executable, "-m", "policy_gradients.train", *args], cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        target, deadline = newest() + 1, time.time() + 600
        while newest() < target and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(step_time * rng.uniform(0.0, 0.9))
        args = ["--resume", str(out)]
        if proc.poll() is not None:  # it finished (or failed) before its kill
            assert proc.returncode == 0
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    if not (out / "final").exists():
        last = run_module("policy_gradients.train", *args, cwd=tmp_path)
        assert last.returncode == 0, last.stderr[-2000:]
    assert kills == 10
    assert_same_weights(tmp_path / "ref", out)

    def rows(run_dir: Path) -> list[tuple]:
        with sqlite3.connect(run_dir / "rollouts.sqlite") as conn:
            return sorted(conn.execute("SELECT step, prompt, completion FROM rollouts"))

    per_step: dict[int, int] = {}
    for step, *_ in rows(out):
        per_step[step] = per_step.get(step, 0) + 1
    assert per_step == dict.fromkeys(range(1, steps + 1), 8 * 4)
    assert rows(out) == rows(tmp_path / "ref")
