"""The run directory's life: which directory a run uses, a lock while it runs, and its status.

One run owns one directory. `open_run_dir` (called once by every trainer, before anything is
written) decides it:

- a fresh run refuses a directory that already holds a run (it would overwrite `metrics.jsonl`,
  `final/`, and let `keep_last` delete the old run's checkpoints): the user resumes it
  (`--resume`), picks another `--output-dir`, or passes `--overwrite`, which *moves the old run
  aside* to `<dir>.replaced-<time>`; nothing is ever deleted;
- `--resume` continues the newest checkpoint that verifies (see `rlhf_core.checkpoint`); a run
  that finished with all its steps is not resumed (exit 2, nothing written) unless asked for
  more steps;
  checkpoints newer than the one resumed from (resuming an explicit older checkpoint) are renamed
  `checkpoint-<n>.superseded-<time>` so that a later `--resume auto` cannot pick them;
- `.lock` (pid, host, process start time) is created atomically (`O_EXCL`) and held until the
  run ends, so a second run into the same directory refuses; a lock whose process is gone (a
  SIGKILL, a crash) is stale and taken over with a note;
- `status.json` says what the run is doing: `running`, then `finished` (exit 0), `interrupted`
  (stopped by a signal, resumable) or `failed` (an error). A SIGKILLed run cannot write its
  status: it stays `running` with a dead lock, which `run_status` reports as `interrupted`.

`managed_run` wraps a trainer's `train(cfg, run)` so the status and lock are settled however it
ends. Only the main process writes; the decision is broadcast to the others.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from rlhf_core.checkpoint import (
    CHECKPOINT_RE,
    checkpoint_step,
    list_checkpoints,
    newest_valid_checkpoint,
    verify_checkpoint,
)
from rlhf_core.errors import UserError, exit_code_for
from rlhf_core.output_dir import make_dir

LOCK_FILE = ".lock"
STATUS_FILE = "status.json"
# what a run writes into its directory: any of these means the directory holds a run
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints", "final", "summary.json", STATUS_FILE)


def timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- the lock


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux /proc; None elsewhere), to tell a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 (starttime), after the command name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_lock(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None


def lock_is_live(holder: dict[str, Any] | None) -> bool:
    """Whether the process that wrote this lock still runs (a lock from another host is
    assumed live: we cannot look)."""
    if not holder:
        return False
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", -1))
    if pid <= 0 or not _alive(pid):
        return False
    recorded, now = holder.get("proc_start"), _process_start(pid)
    return recorded is None or now is None or recorded == now


def _describe_holder(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')})"


class RunLock:
    """`<run_dir>/.lock`, created with O_EXCL; a stale one (its process gone) is taken over."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.held = False
        self.info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _now(),
            "proc_start": _process_start(os.getpid()),
        }

    def acquire(self) -> None:
        make_dir(self.run_dir, what="run directory")  # a file there, a read-only place: one line
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read_lock(self.run_dir)
                if holder is None:  # being written this instant, or empty: look again
                    time.sleep(0.05)
                    holder = read_lock(self.run_dir)
                if lock_is_live(holder):
                    raise UserError(
                        f"{self.run_dir} is in use by another run: {_describe_holder(holder)}. "
                        "Wait for it to finish, or use another --output-dir"
                    ) from None
                print(
                    f"note: taking over the stale lock of {self.run_dir} "
                    f"({_describe_holder(holder or {})} is gone)",
                    file=sys.stderr,
                )
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(self.info) + "\n")
            self.held = True
            return
        raise UserError(f"{self.run_dir}: could not take the run lock {self.path}")

    def release(self) -> None:
        if self.held:
            holder = read_lock(self.run_dir)
            if holder is not None and holder.get("pid") == self.info["pid"]:
                self.path.unlink(missing_ok=True)
            self.held = False


# ----------------------------------------------------------------------------- status


def write_status(run_dir: Path, status: str, **fields: Any) -> None:
    """Atomically (re)write `status.json`, keeping the fields of the previous one."""
    path = Path(run_dir) / STATUS_FILE
    try:
        current = json.loads(path.read_text())
    except (OSError, ValueError):
        current = {}
    current.update(fields, status=status, updated=_now())
    tmp = path.with_name(f".{STATUS_FILE}.tmp")
    tmp.write_text(json.dumps(current, indent=2) + "\n")
    os.replace(tmp, path)


def run_status(run_dir: Path) -> dict[str, Any]:
    """The true status of a run dir: `status.json`, with a dead lock's `running` read as
    `interrupted` (killed); for a run dir without `status.json` (older versions) a guess from
    its files (`summary.json` = finished; checkpoints only = interrupted)."""
    run_dir = Path(run_dir)
    try:
        status = json.loads((run_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        status = {}
    if not status:
        if (run_dir / "summary.json").is_file():
            return {"status": "finished", "inferred": True}
        return {"status": "interrupted" if list_checkpoints(run_dir / "checkpoints") else "failed",
                "inferred": True}  # fmt: skip
    if status.get("status") == "running" and not lock_is_live(read_lock(run_dir)):
        status = {**status, "status": "interrupted", "killed": True}
    return status


# ----------------------------------------------------------------------------- choosing the dir


def default_run_dir(package: str, name: str) -> Path:
    """A fresh `outputs/<package>/<name>-<timestamp>[-n]` that does not exist yet."""
    base = Path("outputs") / package
    candidate = base / f"{name}-{timestamp()}"
    suffix = 1
    while candidate.exists():
        candidate = base / f"{name}-{timestamp()}-{suffix}"
        suffix += 1
    return candidate


def holds_a_run(run_dir: Path) -> bool:
    return Path(run_dir).is_dir() and any((Path(run_dir) / m).exists() for m in RUN_MARKERS)


def move_aside(run_dir: Path) -> Path:
    """Rename an old run to `<dir>.replaced-<time>[-n]` (never delete it); returns the new path."""
    run_dir = Path(run_dir)
    target = run_dir.with_name(f"{run_dir.name}.replaced-{timestamp()}")
    n = 1
    while target.exists():
        target = run_dir.with_name(f"{run_dir.name}.replaced-{timestamp()}-{n}")
        n += 1
    os.replace(run_dir, target)
    return target


def supersede_newer(checkpoints_dir: Path, resumed: Path) -> list[Path]:
    """Rename checkpoints newer than `resumed` aside (`checkpoint-<n>.superseded-<time>`): the
    resumed run will write its own, and `--resume auto` must never pick the abandoned ones."""
    step = checkpoint_step(resumed)
    moved = []
    for path in Path(checkpoints_dir).iterdir() if Path(checkpoints_dir).is_dir() else []:
        match = CHECKPOINT_RE.match(path.name)
        if match and int(match.group(1)) > step:
            target = path.with_name(f"{path.name}.superseded-{timestamp()}")
            os.replace(path, target)
            moved.append(target)
    return moved


def find_resume(
    resume: str, *, package: str, name: str, output_dir: Path | None
) -> tuple[Path | None, Path | None]:
    """(run_dir, checkpoint) for `--resume auto|PATH`; (None, None) = nothing to resume.

    `auto` looks in `--output-dir` if given, else in the newest `outputs/<package>/<name>-*` run
    with a valid checkpoint. A PATH is a checkpoint directory or a run directory."""
    if resume == "auto":
        if output_dir is not None:
            runs = [Path(output_dir)]
        else:
            # only `<name>-<timestamp>[-n]` (see default_run_dir): "sft-*" must not match "sft-x-*"
            pattern = re.compile(re.escape(name) + r"-\d{8}-\d{6}(?:-\d+)?")
            base = Path("outputs") / package
            found = [p for p in base.glob("*") if p.is_dir() and pattern.fullmatch(p.name)]
            runs = sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
        for run_dir in runs:
            ckpt = newest_valid_checkpoint(run_dir / "checkpoints")
            if ckpt is not None:
                return run_dir, ckpt
        print(f"--resume auto: no complete checkpoint found for {package}/{name}; starting fresh")
        return (Path(output_dir) if output_dir is not None else None), None
    path = Path(resume)
    if CHECKPOINT_RE.match(path.name) and path.parent.name == "checkpoints":
        if not path.is_dir():
            raise UserError(f"--resume {resume}: no such checkpoint directory")
        problem = verify_checkpoint(path)
        if problem:
            raise UserError(f"--resume {resume}: the checkpoint is damaged: {problem}")
        return path.parent.parent, path
    if not path.is_dir():
        raise UserError(f"--resume {resume}: no such run or checkpoint directory")
    ckpt = newest_valid_checkpoint(path / "checkpoints")
    if ckpt is None:
        if holds_a_run(path):  # a run killed before its first checkpoint: start it again here
            print(f"--resume {resume}: no complete checkpoint yet; starting this run again")
            return path, None
        raise UserError(
            f"--resume {resume}: not a run directory (no config.yaml, metrics.jsonl or "
            "checkpoints/ inside) and not a checkpoint directory"
        )
    return path, ckpt


def _decide(
    run: Any, package: str, name: str, total_steps: int | None = None
) -> tuple[Path, Path | None, str | None]:
    """The main process's decision: (run_dir, checkpoint, message of a refusal or None)."""
    if run.resume is not None:
        run_dir, ckpt = find_resume(run.resume, package=package, name=name,
                                    output_dir=run.output_dir)  # fmt: skip
        if run_dir is None:
            run_dir = default_run_dir(package, name)
        done = checkpoint_step(ckpt) if ckpt is not None else None
        # finished = its status says so and final/ was written (a run SIGKILLed after its last
        # checkpoint, before final/, is resumed to write it)
        if (done is not None and total_steps is not None and done >= total_steps
                and run_status(run_dir).get("status") == "finished"
                and (run_dir / "final").is_dir()):  # fmt: skip
            return run_dir, None, (
                f"--resume {run.resume}: {run_dir} finished at step {done} of {total_steps} "
                "(train.max_steps): nothing to continue, and nothing was changed. To train "
                "further on purpose, resume with more steps (--set train.max_steps=N); for a "
                "new run use another --output-dir"
            )  # fmt: skip
    else:
        run_dir, ckpt = (Path(run.output_dir) if run.output_dir else None), None
        run_dir = run_dir or default_run_dir(package, name)
    holder = read_lock(run_dir)
    if lock_is_live(holder) and holder.get("pid") != os.getpid():
        return (
            run_dir,
            ckpt,
            (
                f"{run_dir} is in use by another run: {_describe_holder(holder)}. "
                "Wait for it to finish, or use another --output-dir"
            ),
        )
    if run.resume is None and holds_a_run(run_dir) and not getattr(run, "overwrite", False):
        status = run_status(run_dir).get("status", "unknown")
        return (
            run_dir,
            None,
            (
                f"{run_dir} already holds a run (status: {status}); starting a new run there "
                f"would overwrite it. Continue it with --resume {run_dir}, choose another "
                "--output-dir, or pass --overwrite to move the old run aside (it is kept as "
                f"{run_dir.name}.replaced-<time>)"
            ),
        )
    if run.resume is not None and ckpt is None and (Path(run_dir) / "summary.json").is_file():
        return (
            run_dir,
            None,
            (
                f"--resume: {run_dir} is a finished run with no checkpoint to continue from; "
                "start a new run in another --output-dir (or save checkpoints with "
                "checkpoint.save_every)"
            ),
        )
    return run_dir, ckpt, None


def open_run_dir(
    accelerator: Any, run: Any, *, package: str, name: str, total_steps: int | None = None
) -> tuple[Path, Path | None]:
    """Choose the run dir and checkpoint (see the module docstring); unless `run.dry_run`, take
    the lock and mark the run `running` (main process). Refusals are `UserError`s on every
    process; with `total_steps`, a `--resume` of a finished run whose checkpoint has them all is
    refused before anything is written. Returns (run_dir, checkpoint or None)."""
    is_main = accelerator is None or accelerator.is_main_process
    world = 1 if accelerator is None else accelerator.num_processes
    decision: list[Any] = [None]
    if is_main:
        decision = [_decide(run, package, name, total_steps)]
    if world > 1:
        from accelerate.utils import broadcast_object_list

        decision = broadcast_object_list(decision, from_process=0)
    run_dir, ckpt, refusal = decision[0]
    if refusal:
        raise UserError(refusal)
    if run.dry_run or not is_main:
        return Path(run_dir), ckpt
    run_dir = Path(run_dir)
    if ckpt is None and holds_a_run(run_dir):  # --overwrite, or a resume with no checkpoint
        old = move_aside(run_dir)
        print(f"moved the previous run in {run_dir} aside to {old}", file=sys.stderr)
    lock = RunLock(run_dir)
    lock.acquire()
    if ckpt is not None:
        moved = supersede_newer(run_dir / "checkpoints", ckpt)
        if moved:
            print(f"resuming {ckpt.name}: the newer checkpoints were renamed aside: "
                  + ", ".join(p.name for p in moved), file=sys.stderr)  # fmt: skip
    write_status(
        run_dir, "running", package=package, step=checkpoint_step(ckpt) if ckpt else 0,
        exit_code=None, pid=lock.info["pid"], host=lock.info["host"],
        started=lock.info["started"], error=None,
        command=[Path(sys.argv[0]).name, *sys.argv[1:]],
    )  # fmt: skip
    _ACTIVE.append((run_dir, lock))
    return run_dir, ckpt


# ----------------------------------------------------------------------------- settling a run

_ACTIVE: list[tuple[Path, RunLock]] = []


def _final_step(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        found = list_checkpoints(run_dir / "checkpoints")
        return checkpoint_step(found[-1]) if found else None


def settle_runs(depth: int, *, exit_code: int | None, error: BaseException | None) -> None:
    """Write the final status of, and unlock, every run opened since `depth`."""
    while len(_ACTIVE) > depth:
        run_dir, lock = _ACTIVE.pop()
        if error is not None:
            status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
            code = 130 if isinstance(error, KeyboardInterrupt) else exit_code_for(error)
            message = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        else:
            status = {0: "finished", 130: "interrupted", 143: "interrupted"}.get(
                exit_code or 0, "failed"
            )
            code, message = exit_code, None
        try:
            write_status(run_dir, status, exit_code=code, error=message, step=_final_step(run_dir))
        except OSError as exc:  # e.g. the disk is full: the lock is still released
            print(f"warning: could not write {run_dir / STATUS_FILE}: {exc}", file=sys.stderr)
        lock.release()


def managed_run(train_fn: Callable[..., int]) -> Callable[..., int]:
    """Decorator for a trainer's `train(cfg, run) -> exit code`: whatever way it ends (exit 0, a
    signal's 130/143, an exception), the runs it opened get their final `status.json` and their
    locks are released."""

    @functools.wraps(train_fn)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        depth = len(_ACTIVE)
        try:
            code = train_fn(*args, **kwargs)
        except BaseException as exc:
            settle_runs(depth, exit_code=None, error=exc)
            raise
        settle_runs(depth, exit_code=code, error=None)
        return code

    return wrapper


class RunOutcome:
    """What a `locked_run` block sets before it ends: its exit code (0 = finished)."""

    exit_code: int = 0


@contextlib.contextmanager
def locked_run(
    run_dir: Path, *, package: str, resume: bool = False, overwrite: bool = False
) -> Iterator[RunOutcome]:
    """Own `run_dir` for a pipeline of runs (`rlhf-lab quickstart`, `compare`): refuse a
    directory that holds another run unless `resume` (or `overwrite`: the old one is moved
    aside, as a trainer's), hold its lock, and settle `status.json` from the block's
    `RunOutcome.exit_code` or its exception."""
    run_dir = Path(run_dir)
    holder = read_lock(run_dir)
    if lock_is_live(holder):
        raise UserError(
            f"{run_dir} is in use by another run: {_describe_holder(holder)}. Wait for it to "
            "finish, or use another --output-dir"
        )
    if not resume and run_dir.is_dir() and any(run_dir.iterdir()):
        if not overwrite:
            raise UserError(
                f"{run_dir} already holds a run (status: {run_status(run_dir).get('status')}); "
                f"continue it with --resume {run_dir}, choose another --output-dir, or pass "
                f"--overwrite to move it aside (kept as {run_dir.name}.replaced-<time>)"
            )
        print(f"moved the previous run in {run_dir} aside to {move_aside(run_dir)}")
    lock = RunLock(run_dir)
    lock.acquire()
    write_status(run_dir, "running", package=package, step=None, exit_code=None,
                 pid=lock.info["pid"], host=lock.info["host"], started=lock.info["started"],
                 error=None, command=[Path(sys.argv[0]).name, *sys.argv[1:]])  # fmt: skip
    depth = len(_ACTIVE)
    _ACTIVE.append((run_dir, lock))
    outcome = RunOutcome()
    try:
        yield outcome
    except BaseException as exc:
        settle_runs(depth, exit_code=None, error=exc)
        raise
    settle_runs(depth, exit_code=outcome.exit_code, error=None)
