"""The rule for every directory or file a command writes that is not a trainer's run dir
(`rlhf-lab pairs`, `quantize`, `eval --output`, `runs snapshot`): nothing is overwritten.

`claim_output_path` refuses a non-empty target (or an existing file target) with one line naming
it and `--overwrite`; with `--overwrite` the old one is *moved aside* to `<name>.old-<time>`,
never deleted. The trainers' run dirs follow the same rule through `rlhf_core.rundir` (kept as
`<dir>.replaced-<time>`). `make_dir` creates a directory and turns what the machine refuses (a
read-only or unwritable location) into an `EnvironmentFailure` (one line, exit 1) and a path
that is an existing file into a `UserError` (one line, exit 2).
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

from rlhf_core.errors import EnvironmentFailure, UserError


def make_dir(path: Path, *, what: str = "output directory") -> None:
    """`mkdir -p path`, with one-line errors for a file in the way and an unwritable place."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is a file, not a directory; give a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file somewhere above it
        raise UserError(
            f"{what} {path}: a file is in the way of this path; give a directory path"
        ) from None
    except OSError as exc:
        raise EnvironmentFailure(
            f"cannot create {what} {path}: {exc.strerror or exc}; choose a writable location"
        ) from None


def _aside(path: Path) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target, n = path.with_name(f"{path.name}.old-{stamp}"), 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.old-{stamp}-{n}"), n + 1
    return target


def check_output_path(path: Path, *, overwrite: bool, command: str, is_file: bool = False) -> None:
    """Refuse (UserError) what `claim_output_path` would refuse, without changing anything: a
    command calls this before its work, so a refusal comes first, not after minutes."""
    path = Path(path)
    if is_file:
        if path.is_dir():
            raise UserError(f"{command}: {path} is a directory; give a file path")
        if path.exists() and not overwrite:
            raise UserError(
                f"{command}: {path} already exists; choose another path, or pass --overwrite "
                f"to move it aside (kept as {path.name}.old-<time>)"
            )
        return
    if path.exists() and not path.is_dir():
        raise UserError(f"{command}: {path} is a file, not a directory; give a directory path")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(
            f"{command}: {path} already holds files; choose another directory, or pass "
            f"--overwrite to move the old one aside (kept as {path.name}.old-<time>)"
        )


def claim_output_path(
    path: Path, *, overwrite: bool, command: str, is_file: bool = False
) -> Path | None:
    """Make `path` ready to write: a directory (created, empty) or, with `is_file`, a file's place
    (its parent created). A non-empty directory or an existing file is refused unless
    `overwrite`, which moves it to `<name>.old-<time>`. Returns where the old one went, or None."""
    path = Path(path)
    check_output_path(path, overwrite=overwrite, command=command, is_file=is_file)
    moved = None
    if path.exists() and (is_file or any(path.iterdir())):
        moved = _aside(path)
        try:
            os.replace(path, moved)
        except OSError as exc:
            raise EnvironmentFailure(
                f"{command}: cannot move {path} aside to {moved}: {exc.strerror or exc}"
            ) from None
        print(f"{command}: moved the previous {path} aside to {moved}")
    make_dir(path.parent if is_file else path, what=f"{command} output")
    return moved
