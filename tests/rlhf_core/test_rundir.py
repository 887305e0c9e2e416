"""The run directory's life (rlhf_core.rundir): default names, `--resume` resolution, refusing a
directory that holds a run, `--overwrite` moving it aside, the lock, and status.json."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.checkpoint import STATE_FILE, write_manifest
from rlhf_core.config import RunArgs
from rlhf_core.errors import UserError
from rlhf_core.rundir import (
    LOCK_FILE,
    RunLock,
    default_run_dir,
    find_resume,
    locked_run,
    managed_run,
    open_run_dir,
    run_status,
)


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint directory that verifies: a loadable trainer_state.pt and its manifest."""
    ckpt = run_dir / "checkpoints" / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    torch.save({"step": step}, ckpt / STATE_FILE)
    write_manifest(ckpt, step)
    return ckpt


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_default_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = default_run_dir("pkg", "demo")
    assert first.parent == Path("outputs") / "pkg" and first.name.startswith("demo-")
    first.mkdir(parents=True)
    second = default_run_dir("pkg", "demo")  # same second: a suffix keeps it fresh
    assert second != first and not second.exists()
    # `--resume auto` recognises the names default_run_dir makes, with and without a suffix
    for run, step in ((first, 1), (second, 2)):
        ckpt = fake_checkpoint(run, step)
        os.utime(run, (2_000_000_000 + step, 2_000_000_000 + step))
        assert find_resume("auto", package="pkg", name="demo", output_dir=None) == (run, ckpt)


def test_find_resume_auto_with_output_dir(tmp_path, capsys):
    run = tmp_path / "run"
    assert find_resume("auto", package="pkg", name="demo", output_dir=run) == (run, None)
    assert "starting fresh" in capsys.readouterr().out
    fake_checkpoint(run, 2)
    newest = fake_checkpoint(run, 10)
    assert find_resume("auto", package="pkg", name="demo", output_dir=run) == (run, newest)


def test_find_resume_auto_finds_newest_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = Path("outputs") / "pkg"
    old = base / "demo-20240101-000000"
    new = base / "demo-20240102-000000"
    newest_empty = base / "demo-20240103-000000"  # killed before its first checkpoint
    other_pkg = Path("outputs") / "other" / "demo-20240104-000000"
    other_name = base / "demo-long-20240105-000000"  # another config whose name starts "demo-"
    fake_checkpoint(old, 5)
    ckpt = fake_checkpoint(new, 3)
    newest_empty.mkdir(parents=True)
    fake_checkpoint(other_pkg, 9)
    fake_checkpoint(other_name, 9)
    for i, run in enumerate([old, new, newest_empty, other_pkg, other_name]):
        os.utime(run, (1_700_000_000 + i, 1_700_000_000 + i))
    assert find_resume("auto", package="pkg", name="demo", output_dir=None) == (new, ckpt)
    assert find_resume("auto", package="pkg", name="nothing", output_dir=None) == (None, None)


def test_find_resume_explicit_paths(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, 4)
    ckpt = fake_checkpoint(run, 8)
    older = run / "checkpoints" / "checkpoint-4"  # that exact checkpoint, even if not the newest
    assert find_resume(str(older), package="p", name="n", output_dir=None) == (run, older)
    assert find_resume(str(run), package="p", name="n", output_dir=None) == (run, ckpt)


def test_find_resume_bad_paths_are_user_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a run directory"):
        find_resume(str(tmp_path / "empty"), package="p", name="n", output_dir=None)
    with pytest.raises(UserError, match="no such run or checkpoint directory"):
        find_resume(str(tmp_path / "missing"), package="p", name="n", output_dir=None)


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, capsys):
    run = tmp_path / "run"
    good = fake_checkpoint(run, 4)
    bad = fake_checkpoint(run, 8)
    state = bad / STATE_FILE
    state.write_bytes(state.read_bytes()[:-5])  # truncated after the manifest was written
    assert find_resume("auto", package="p", name="n", output_dir=run) == (run, good)
    assert "skipping damaged checkpoint" in capsys.readouterr().err
    with pytest.raises(UserError, match="damaged"):  # asked for by name: refused, not replaced
        find_resume(str(bad), package="p", name="n", output_dir=None)


# ----------------------------------------------------------------------------- open_run_dir


@managed_run
def fake_train(run: RunArgs, *, code: int = 0, error: BaseException | None = None) -> int:
    """What a trainer does with its run dir: open it, write into it, end with `code`."""
    run_dir, _ = open_run_dir(None, run, package="pkg", name="demo")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    if error is not None:
        raise error
    if code == 0:
        (run_dir / "summary.json").write_text(json.dumps({"steps": 1}))
    return code


def test_a_new_run_refuses_a_directory_holding_a_run(tmp_path):
    run_dir = tmp_path / "run"
    assert fake_train(RunArgs(None, output_dir=run_dir)) == 0
    assert run_status(run_dir)["status"] == "finished"
    assert not (run_dir / LOCK_FILE).exists()  # released
    with pytest.raises(UserError, match=r"already holds a run.*--resume.*--overwrite"):
        fake_train(RunArgs(None, output_dir=run_dir))
    assert json.loads((run_dir / "summary.json").read_text()) == {"steps": 1}  # untouched
    # --overwrite moves the old run aside, whole, and starts fresh
    assert fake_train(RunArgs(None, output_dir=run_dir, overwrite=True)) == 0
    (aside,) = tmp_path.glob("run.replaced-*")
    assert (aside / "summary.json").is_file() and (aside / "metrics.jsonl").is_file()


def test_status_follows_how_the_run_ends(tmp_path):
    assert fake_train(RunArgs(None, output_dir=tmp_path / "a"), code=130) == 130
    assert run_status(tmp_path / "a")["status"] == "interrupted"
    with pytest.raises(RuntimeError):
        fake_train(RunArgs(None, output_dir=tmp_path / "b"), error=RuntimeError("boom"))
    status = run_status(tmp_path / "b")
    assert status["status"] == "failed" and "boom" in status["error"]
    assert not (tmp_path / "b" / LOCK_FILE).exists()


def test_a_live_lock_refuses_and_a_stale_one_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    live = {"pid": os.getppid(), "host": socket.gethostname(), "started": "x"}
    (run_dir / LOCK_FILE).write_text(json.dumps(live))
    with pytest.raises(UserError, match="in use by another run"):
        open_run_dir(None, RunArgs(None, output_dir=run_dir), package="p", name="n")
    with pytest.raises(UserError, match="in use by another run"):
        RunLock(run_dir).acquire()
    stale = {"pid": dead_pid(), "host": socket.gethostname(), "started": "x"}
    (run_dir / LOCK_FILE).write_text(json.dumps(stale))
    lock = RunLock(run_dir)
    lock.acquire()
    assert "stale lock" in capsys.readouterr().err
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run_dir / LOCK_FILE).exists()


def test_a_killed_run_reads_as_interrupted(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps({"status": "running"}))
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
    assert run_status(run_dir)["status"] == "interrupted"


def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside(tmp_path):
    run_dir = tmp_path / "run"
    older = fake_checkpoint(run_dir, 2)
    fake_checkpoint(run_dir, 4)
    run = RunArgs(None, resume=str(older))
    assert open_run_dir(None, run, package="p", name="n") == (run_dir, older)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names[0] == "checkpoint-2" and names[1].startswith("checkpoint-4.superseded-")
    assert find_resume("auto", package="p", name="n", output_dir=run_dir) == (run_dir, older)


def test_locked_run_for_pipelines(tmp_path):
    out = tmp_path / "qs"
    with locked_run(out, package="quickstart") as outcome:
        assert (out / LOCK_FILE).is_file()
        (out / "report.md").write_text("x")
        outcome.exit_code = 130
    assert run_status(out)["status"] == "interrupted"
    with pytest.raises(UserError, match="already holds a run"):
        with locked_run(out, package="quickstart"):
            pass
    with locked_run(out, package="quickstart", resume=True):
        pass
    assert run_status(out)["status"] == "finished"
