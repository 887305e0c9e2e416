"""User errors: one clear line, no traceback, exit code 2; environment failures: exit code 1.

A *user error* is a mistake in what the user gave us (a config value, a data file, a path, a
resume request): the message names the file, field, row or shape and says what was expected.
Raise `UserError` (or `rlhf_core.config.ConfigError`, a subclass) for those. Anything else is a
library error and keeps its traceback.

Every command-line entry (`python -m <package>.train`, `rlhf-lab ...`) runs through
`run_main`, which prints a user error as `error: <message>` and returns 2; `--debug` or
`RLHF_LAB_DEBUG=1` shows the traceback too. An `EnvironmentFailure` (the machine refused: a
read-only location, no permission, a full disk) is printed the same way and returns 1, and so is
any other `OSError` that says the machine refused (a full disk or quota, a read-only filesystem,
no permission, an I/O error), wherever it was raised: one line with what to do.

An exception raised inside the user's own code (a module of `imports:` / `--import`, or of a
`module:attribute` name) is theirs to read: `run_main` prints a one-line header naming their
module, then the traceback from their first frame on (all of it with `--debug`), and returns 2.
`rlhf_core.user_modules` records which files are theirs (`register_user_module`).
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

EXIT_USER_ERROR = 2
EXIT_ENVIRONMENT = 1
#: what an OSError says when the machine refuses a correct command, and what the user can do
REFUSALS = {
    errno.ENOSPC: "free up space (or move the run to a larger disk); a run resumes from its last "
    "checkpoint with --resume RUN_DIR",
    errno.EROFS: "choose a writable location",
    errno.EACCES: "choose a location you may write to, or fix its permissions",
    errno.EIO: "the disk reported an I/O error; check it",
}
REFUSALS[errno.EDQUOT] = REFUSALS[errno.ENOSPC]
REFUSALS[errno.EPERM] = REFUSALS[errno.EACCES]

_debug_depth = 0  # > 0 inside a run_main that was given --debug (a nested run_main inherits it)
_user_files: dict[str, str] = {}  # a user module's file, or its package's directory -> its name


class UserError(ValueError):
    """A mistake in the user's config, data, paths or command line (exit code 2, no traceback).

    Subclasses ValueError so code that already catches ValueError keeps working."""


class EnvironmentFailure(OSError):
    """The machine refused what a correct command asked (a read-only or unwritable location, a
    full disk): one line naming the path and what to do, exit code 1, no traceback."""


class UserCodeError(Exception):
    """The user's own module raised `original` (while being imported): reported as `header`, then
    the original's traceback (exit code 2). Not a ValueError, so pydantic never swallows it."""

    def __init__(self, header: str, original: BaseException) -> None:
        super().__init__(header)
        self.header, self.original = header, original


def debug_requested(argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return (
        _debug_depth > 0
        or "--debug" in argv
        or os.environ.get("RLHF_LAB_DEBUG", "") not in ("", "0")
    )


def register_user_module(name: str, file: str | None) -> None:
    """Remember that `file` (a module's `__file__`) is the user's code, named `name`; a package's
    `__init__.py` stands for its whole directory."""
    if file:
        path = Path(file).resolve()
        _user_files[str(path.parent if path.name == "__init__.py" else path)] = name


def user_module_of(filename: str) -> str | None:
    """The name of the user module `filename` belongs to, or None for code that is not theirs."""
    path = Path(filename).resolve()
    for candidate in (path, *path.parents):
        if str(candidate) in _user_files:
            return _user_files[str(candidate)]
    return None


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what it was raised from or while handling, and so on (each once)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def machine_refusal(error: BaseException) -> OSError | None:
    """The OSError in `error`'s chain that says the machine refused (`REFUSALS`), or None."""
    return next((e for e in exception_chain(error)
                 if isinstance(e, OSError) and e.errno in REFUSALS), None)  # fmt: skip


def exit_code_for(error: BaseException) -> int:
    """The exit code `run_main` gives `error` (also written to a run's status.json)."""
    if isinstance(error, EnvironmentFailure):
        return EXIT_ENVIRONMENT
    if isinstance(error, UserError | UserCodeError):
        return EXIT_USER_ERROR
    if machine_refusal(error) is not None:
        return EXIT_ENVIRONMENT
    if _raising_user_frame(error) is not None:
        return EXIT_USER_ERROR
    return EXIT_ENVIRONMENT  # an EnvironmentFailure, or a library error (Python's own 1)


def _raising_user_frame(error: BaseException) -> tuple[str, traceback.FrameSummary] | None:
    """(module, frame) of the innermost frame of `error`'s traceback that is the user's code."""
    found = None
    if _user_files:
        for frame in traceback.extract_tb(error.__traceback__):
            module = user_module_of(frame.filename)
            if module is not None:
                found = (module, frame)
    return found


def print_user_traceback(error: BaseException, *, full: bool) -> None:
    """`error`'s traceback from the first frame that is not ours (src/, importlib) on; all
    of it, with chained exceptions, when `full`."""
    if full:
        traceback.print_exception(error, file=sys.stderr)
        return
    frames = traceback.extract_tb(error.__traceback__)
    ours = (str(Path(__file__).parents[1]), str(Path(importlib.__file__).parent), "<frozen ")
    start = next((i for i, f in enumerate(frames) if not f.filename.startswith(ours)), None)
    lines = []  # a SyntaxError has no frame of theirs: only its own lines (file, line, caret)
    if start is not None:
        lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames[start:])]
    lines += traceback.format_exception_only(type(error), error)
    sys.stderr.write("".join(lines))


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Call `main(argv)`; a `UserError` becomes one line on stderr and exit code 2, an
    `EnvironmentFailure` one line and exit code 1, an error in the user's own code a header line
    and its traceback (exit code 2). Anything else keeps its traceback."""
    global _debug_depth
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    _debug_depth += debug
    try:
        return main(argv)
    except (UserError, EnvironmentFailure) as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    except UserCodeError as exc:
        print(f"error: {exc.header}", file=sys.stderr)
        print_user_traceback(exc.original, full=debug)
        return EXIT_USER_ERROR
    except Exception as exc:
        if (refused := machine_refusal(exc)) is not None:  # the machine's, wherever it came from
            if debug:
                traceback.print_exc()
            print(f"error: {refused}; {REFUSALS[refused.errno]}", file=sys.stderr)
            return EXIT_ENVIRONMENT
        if (raised := _raising_user_frame(exc)) is None:
            raise  # a library error: its traceback, exit 1
        module, frame = raised
        print(f"error: your module {module!r} raised {type(exc).__name__} in {frame.name} "
              f"({frame.filename}:{frame.lineno}); its traceback:", file=sys.stderr)  # fmt: skip
        print_user_traceback(exc, full=True)
        return EXIT_USER_ERROR
    finally:
        _debug_depth -= debug


class UserFileNotFound(UserError, FileNotFoundError):
    """A path the user gave does not exist (also a FileNotFoundError, for callers catching it)."""
