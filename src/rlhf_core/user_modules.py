"""Importing the user's own modules by name: a config's `imports:` list (or `--import MODULE`)
and the module half of a `module:attribute` name (`rlhf_core.registry.resolve_object`).

Below both `rlhf_core.config` (which imports a config's `imports:` before validating it) and
`rlhf_core.registry` (which resolves `module:attribute` names), so neither imports the other for
it. A module that is not found raises `UserError` naming it, where it was asked for, and where
Python looked; an error inside the user's module keeps its own traceback.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from rlhf_core.errors import UserError


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
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):  # the module itself is missing
            first = sys.path[0] or "."
            raise UserError(
                f"{where}: module {exc.name!r} not found on sys.path (which starts with {first}); "
                "run from the directory that holds it, or add that directory to PYTHONPATH"
            ) from None
        raise  # the user's module imports something missing: keep its traceback
