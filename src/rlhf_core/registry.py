"""A name -> class registry, so configs choose losses, estimators and rewards by name.

    LOSSES = Registry("losses")

    @LOSSES.register("dpo")
    class DPOLoss(nn.Module): ...

    loss_cls = LOSSES.get("dpo")

Registering a name twice raises; asking for an unknown name raises and lists the registered names.

Configs name a registered class and its keyword arguments together, `{name: dpo, beta: 0.1}`;
`validate_spec` checks such a spec against the class's `__init__` signature (so a newly registered
loss is configurable with no config code) and `build_from_spec` instantiates it.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from pydantic import ConfigDict, ValidationError, create_model

from rlhf_core.config import check_scalar_kind

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown or duplicate name in a registry."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly.
        return str(self.args[0])


class Registry(Generic[T]):
    """A named mapping from strings to registered objects (usually classes)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that registers an object under `name`; a duplicate name raises."""
        if not name or not isinstance(name, str):
            raise ValueError(
                f"{self.kind}: a registered name must be a non-empty string, got {name!r}"
            )

        def decorator(obj: T) -> T:
            if name in self._entries:
                raise RegistryError(
                    f"{self.kind}: the name {name!r} is already registered "
                    f"(by {self._entries[name]!r}); choose another name"
                )
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Return the object registered under `name`, or raise listing the known names."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise RegistryError(f"unknown {self.kind} {name!r}; registered: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


def validate_spec(registry: Registry, spec: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """Check a `{name: ..., **keyword arguments}` spec against the registered class's __init__.

    Returns the spec with every keyword filled in (defaults included), so the resolved config
    shows each value that will be used. Unknown names, unknown keys and wrong types raise
    ValueError naming `where`, the key and what is allowed.
    """
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ValueError(f"{where}: expected a mapping with a 'name' key, got {spec!r}")
    name = spec["name"]
    try:
        cls = registry.get(name)
    except RegistryError as exc:  # pydantic validators turn ValueErrors into config errors
        raise ValueError(f"{where}: {exc}") from None
    params = {
        p.name: p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    unknown = sorted(set(spec) - set(params) - {"name"})
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)} for {registry.kind} {name!r}; "
            f"allowed keys: name, {', '.join(params) or '(none)'}"
        )
    fields: dict[str, Any] = {}
    hints = typing.get_type_hints(cls.__init__)
    for pname, param in params.items():
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (hints.get(pname, Any), default)
    for key, value in spec.items():  # `beta: yes` is not 1.0
        if key in fields:
            try:
                check_scalar_kind(fields[key][0], value)
            except ValueError as exc:
                raise ValueError(f"{where}.{key} ({registry.kind} {name!r}): {exc}") from None
    model = create_model(
        f"{cls.__name__}Params",
        __config__=ConfigDict(extra="forbid", allow_inf_nan=False),
        **fields,
    )
    try:
        values = model.model_validate({k: v for k, v in spec.items() if k != "name"})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        )
        raise ValueError(f"{where} ({registry.kind} {name!r}): {problems}") from None
    return {"name": name, **values.model_dump()}


def build_from_spec(registry: Registry, spec: Mapping[str, Any]) -> Any:
    """Instantiate the class named by `spec["name"]` with the remaining keys as keywords."""
    return registry.get(spec["name"])(**{k: v for k, v in spec.items() if k != "name"})
