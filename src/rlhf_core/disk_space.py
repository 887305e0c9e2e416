"""Disk space for checkpoints: a warning before a save that will not fit, and a write that fails
(a full disk, no permission) reported as one line that says what to do.

`checkpoint.save_checkpoint` and `save_final` write inside `guarded_write`. Before the write,
when the free space is less than the newest checkpoint's size (the new one will be about as big,
and the old one is pruned only after the new one is in place), one line on stderr says so while
the run can still be stopped cleanly. When the write fails, the partial temporary directory is
removed (the previous checkpoints stay as they were) and a `CheckpointWriteError` (an
`EnvironmentFailure`: one line, exit code 1, no chained traceback) names the space needed, the
free space and the last good checkpoint. A full disk is recognised however it surfaces:
`OSError` errno 28 (ENOSPC) or 122 (EDQUOT), or the text of one wrapped by torch's writer or
safetensors, anywhere in the exception's chain.

Not here: freeing space (nothing is deleted to make room), disks other than the run dir's.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from rlhf_core.errors import EnvironmentFailure, exception_chain

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how a full disk reads once torch's writer or safetensors (Rust) has wrapped the OSError
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "StorageFull", "os error 28")


class CheckpointWriteError(EnvironmentFailure):
    """Writing a checkpoint (or `final/`) failed: what failed, the space it needs, the last good
    checkpoint (one line, exit code 1)."""


def directory_size(path: Path) -> int:
    """Bytes in the files below `path` (0 for a path that does not exist)."""
    total = 0
    for file in Path(path).rglob("*"):
        try:
            if file.is_file():
                total += file.stat().st_size
        except OSError:  # removed while we looked
            pass
    return total


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent), or None."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human(n: int) -> str:
    """Bytes for people: 1.2 MB, 340 kB (decimal units, as `df -H`)."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def warn_if_it_will_not_fit(directory: Path, what: str, previous: Path | None) -> None:
    """One line on stderr when `directory` has less free space than `previous` (the newest
    checkpoint) takes: `what` (checkpoint-<n>) will most likely not fit."""
    if previous is None:
        return
    needed, free = directory_size(previous), free_bytes(directory)
    if free is not None and free < needed:
        print(f"warning: {what} will likely not fit: it needs about {human(needed)} (the size of "
              f"{previous.name}) and {directory} has {human(free)} free; free up space now, or "
              f"the save will stop the run (the last checkpoint, {previous}, is kept)",
              file=sys.stderr, flush=True)  # fmt: skip


def disk_full_cause(exc: BaseException) -> BaseException | None:
    """The exception in `exc`'s chain (itself, what it was raised from or while handling) that
    says the disk is full, or None. (torch's writer raises "unexpected pos ..." while handling
    the OSError; safetensors puts "os error 28" in its own error's text.)"""
    for current in exception_chain(exc):
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current
        if any(text in str(current) for text in DISK_FULL_TEXT):
            return current
    return None


def is_disk_full(exc: BaseException) -> bool:
    return disk_full_cause(exc) is not None


@contextlib.contextmanager
def guarded_write(
    what: str, directory: Path, *, previous: Path | None, last_good: Callable[[], Path | None]
) -> Iterator[list[Path]]:
    """Around the write of `what` (checkpoint-<n>, final) into `directory`: warn first when it
    will not fit; on an error, remove the temporary directories the block appended to the list
    it was given, and raise a write failure as a `CheckpointWriteError` (anything else, an
    interrupt or a library error, goes on as it was). `previous`: the newest checkpoint before
    this save (its size is what the new one needs); `last_good()`: the newest that verifies."""
    partial: list[Path] = []
    warn_if_it_will_not_fit(directory, what, previous)
    try:
        yield partial
    except BaseException as exc:
        failure = None
        if isinstance(exc, Exception) and (is_disk_full(exc) or isinstance(exc, OSError)):
            failure = write_failure(exc, what, directory, partial=partial[-1] if partial else None,
                                    previous=previous, last_good=last_good())  # fmt: skip
        for path in partial:
            shutil.rmtree(path, ignore_errors=True)
        if failure is None:
            raise
        raise failure from None


def write_failure(
    exc: BaseException, what: str, directory: Path, *, partial: Path | None,
    previous: Path | None, last_good: Path | None,
) -> CheckpointWriteError:  # fmt: skip
    """The one-line error for `exc`, an OSError or a full disk, raised while writing `what` into
    `directory` (`partial`: the temporary directory written so far, still there)."""
    cause = disk_full_cause(exc) or exc
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    failed = f"could not write {what} in {directory}: {text}."
    resume = "There is no earlier checkpoint; the run has to start again." if last_good is None \
        else f"The last good checkpoint is {last_good} (continue with --resume " \
             f"{last_good.parent.parent})."  # fmt: skip
    if cause is exc and not is_disk_full(exc):
        return CheckpointWriteError(f"{failed} {resume}")
    written = directory_size(partial) if partial is not None else 0
    needed = max(directory_size(previous) if previous is not None else 0, written)
    size = f"about {human(needed)} (the size of {previous.name})" if previous is not None \
        else f"more than {human(needed)}"  # fmt: skip
    return CheckpointWriteError(
        f"{failed} The disk is full: {what} needs {size} of free space, and "
        f"{human(free_bytes(directory) or 0)} was left after {human(written)} of it was written; "
        f"the partial copy was removed. Free up space (or move the run to a larger disk) and "
        f"resume. {resume}"
    )
