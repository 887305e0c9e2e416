"""Importing the user's own modules by name: a config's `imports:` list (or `--import MODULE`)
and the module half of a `module:attribute` name (`rlhf_core.registry.resolve_object`).

Below both `rlhf_core.config` (which imports a config's `imports:` before validating it) and
`rlhf_core.registry` (which resolves `module:attribute` names), so neither imports the other for
it. A module that is not found raises `UserError` naming it, where it was asked for, and where
Python looked. An error inside the user's module (a syntax error, an exception at import, an
import of a package that is missing) is a `UserCodeError`: a one-line header naming the module
and where it was asked for, then its own traceback (`rlhf_core.errors.run_main`). A module that
imports is recorded as the user's code (`register_user_module`) unless it is this library's or
an installed package's, so an exception its classes raise later, during training, is reported
the same way.
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from rlhf_core.errors import UserCodeError, UserError, register_user_module

# code under these directories is not the user's: this library's src/, installed packages, stdlib
NOT_USER_CODE = tuple(
    str(Path(p).resolve())
    for p in {str(Path(__file__).resolve().parents[1]),
              *(sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib"))}
)  # fmt: skip


def import_modules(modules: list[str], *, where: str = "imports") -> None:
    """Import each user module (so its `@REGISTRY.register(...)` decorators run); a module that
    cannot be imported raises UserError naming it and where it was looked for."""
    for module in modules:
        import_module_named(module, where=f"{where}: {module!r}")


def import_module_named(module: str, *, where: str) -> ModuleType:
    """`importlib.import_module(module)`, or a UserError that says `where` it was named."""
    if not isinstance(module, str) or not module.strip():
        raise UserError(f"{where}: expected a module name like my_pkg.my_losses")
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module + ".").startswith(exc.name + "."):  # it is missing
            first = sys.path[0] or "."
            raise UserError(
                f"{where}: module {exc.name!r} not found on sys.path (which starts with {first}); "
                "run from the directory that holds it, or add that directory to PYTHONPATH"
            ) from None
        raise _in_their_module(module, where, exc) from None  # it imports something missing
    except UserError:  # e.g. a name registered twice: our one-line message says it
        raise
    except Exception as exc:  # their code raised (or does not parse): keep its traceback
        raise _in_their_module(module, where, exc) from None
    file = getattr(imported, "__file__", None)
    if file and not str(Path(file).resolve()).startswith(NOT_USER_CODE):
        register_user_module(module, file)
    return imported


def _in_their_module(module: str, where: str, exc: BaseException) -> UserCodeError:
    """The one-line header over the traceback of an error raised while importing `module`."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    raised = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return UserCodeError(
        f"{where}: importing your module {module!r} raised {raised} (its traceback follows)", exc
    )
