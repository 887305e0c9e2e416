"""User errors: one clear line, no traceback, exit code 2.

A *user error* is a mistake in what the user gave us (a config value, a data file, a path, a
resume request): the message names the file, field, row or shape and says what was expected.
Raise `UserError` (or `rlhf_core.config.ConfigError`, a subclass) for those. Anything else is a
library error and keeps its traceback.

Every command-line entry (`python -m <package>.train`, `rlhf-lab ...`) runs through
`run_main`, which prints a user error as `error: <message>` and returns 2; `--debug` or
`RLHF_LAB_DEBUG=1` shows the traceback too. An `EnvironmentFailure` (the machine refused: a
read-only location, no permission) is printed the same way and returns 1.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

EXIT_USER_ERROR = 2
EXIT_ENVIRONMENT = 1


class UserError(ValueError):
    """A mistake in the user's config, data, paths or command line (exit code 2, no traceback).

    Subclasses ValueError so code that already catches ValueError keeps working."""


class EnvironmentFailure(OSError):
    """The machine refused what a correct command asked (a read-only or unwritable location, a
    full disk): one line naming the path and what to do, exit code 1, no traceback."""


def debug_requested(argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("RLHF_LAB_DEBUG", "") not in ("", "0")


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Call `main(argv)`; a `UserError` becomes one line on stderr and exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        return main(argv)
    except UserError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except EnvironmentFailure as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ENVIRONMENT


class UserFileNotFound(UserError, FileNotFoundError):
    """A path the user gave does not exist (also a FileNotFoundError, for callers catching it)."""
