"""A name -> class registry, so configs choose losses, estimators and rewards by name.

    LOSSES = Registry("losses")

    @LOSSES.register("dpo")
    class DPOLoss(nn.Module): ...

    loss_cls = LOSSES.get("dpo")

Registering a name twice raises; asking for an unknown name raises and lists the registered names.
A registered class gets its name as the class attribute `name` (used in its error messages).

`Configurable` is the small base every registered loss and estimator shares: keyword checks whose
message names the class (`_require`), a repr listing its keywords, and `defaults`, with which a
subclass changes some of its parent's keyword defaults without repeating the constructor.

Configs name a registered class and its keyword arguments together, `{name: dpo, beta: 0.1}`;
`validate_spec` checks such a spec against the class's `__init__` signature (so a newly registered
loss is configurable with no config code), runs a `Configurable`'s own keyword checks (a failed
`_require` is a config error naming the field, e.g. `loss.beta`), and `build_from_spec`
instantiates it.

User code needs no wrapper script, in either of two ways:

    name: my_pkg.my_losses:MyDPO          # "module:attribute": imported, checked, used directly
    imports: [my_pkg.my_losses]           # a config's top-level list (or --import, repeatable):
    loss: {name: my_dpo}                  # imported before validation, so its @register runs

A `module:attribute` name must be a subclass of the registry's `base` (the package's base class);
`resolve_object` and `rlhf_core.user_modules.import_modules` raise `UserError` naming what was
tried. Modules are found on `sys.path`, which for `python -m ...` starts with the current
directory.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Generic, TypeVar

from pydantic import AfterValidator, ConfigDict, ValidationError, create_model

from rlhf_core.config import check_scalar_kind
from rlhf_core.errors import UserError
from rlhf_core.user_modules import import_module_named

T = TypeVar("T")


class RegistryError(UserError, KeyError):
    """An unknown or duplicate name in a registry (a user error; also a KeyError)."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly.
        return str(self.args[0])


class ArgumentError(UserError):
    """A registered class's own keyword check failed (`Configurable._require`); `arg` is the
    keyword, so a config error can name its field (`loss.beta`)."""

    def __init__(self, message: str, *, arg: str) -> None:
        super().__init__(message)
        self.arg = arg


class Registry(Generic[T]):
    """A named mapping from strings to registered objects (usually classes)."""

    def __init__(self, kind: str, base: type | None = None) -> None:
        self.kind = kind
        self.base = base  # what a "module:attribute" name must subclass; set by the package
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
            if isinstance(obj, type):
                obj.name = name  # type: ignore[attr-defined]
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Return the object registered under `name` or named by `module:attribute`; an unknown
        name raises listing the known names."""
        if isinstance(name, str) and ":" in name:
            return self._resolve(name)
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise RegistryError(
                f"unknown {self.kind} {name!r}; registered: {known}; for your own class give "
                "'module:ClassName' or list its module under 'imports:' (or --import MODULE)"
            ) from None

    def _resolve(self, name: str) -> T:
        obj = resolve_object(name, what=self.kind)
        if self.base is None:  # e.g. rewards: any class whose instances are called
            if not isinstance(obj, type):
                raise RegistryError(f"{self.kind} {name!r}: {obj!r} is not a class")
        elif not (isinstance(obj, type) and issubclass(obj, self.base)):
            base = f"{self.base.__module__}.{self.base.__qualname__}"
            raise RegistryError(
                f"{self.kind} {name!r}: {obj!r} is not a subclass of {base}; subclass it "
                "(see docs/extending/)"
            )
        return obj  # type: ignore[return-value]

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


class Configurable:
    """What every registered loss and estimator shares.

    `name` is set by `Registry.register` (an unregistered subclass keeps its base's label);
    `role` completes error messages ("dpo loss: beta must be ..."). Settings are keyword-only
    `__init__` arguments stored under their own names, so `extra_repr` (nn.Module's repr hook)
    can list them. A subclass that only changes defaults sets `defaults = {"eps_low": 3e-4}`
    instead of repeating its parent's constructor; its signature then shows the new defaults,
    which is what `validate_spec` and the generated configuration reference read.
    """

    name: typing.ClassVar[str] = "(unregistered)"
    role: typing.ClassVar[str] = "loss"
    defaults: typing.ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "defaults" in cls.__dict__:
            cls.__init__ = _with_defaults(cls.__init__, cls.defaults, cls.__qualname__)  # type: ignore[method-assign]

    def _require(self, ok: bool, arg: str, value: object, expected: str) -> None:
        if not ok:
            raise ArgumentError(
                f"{self.name} {self.role}: {arg} must be {expected}, got {value!r}", arg=arg
            )

    def extra_repr(self) -> str:
        return ", ".join(f"{p}={getattr(self, p)!r}" for p in keywords(type(self)))


def keywords(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword arguments of `cls.__init__` a config may set (no self, *args, **kwargs)."""
    return {
        p.name: p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _with_defaults(init: Callable, defaults: dict[str, Any], owner: str) -> Callable:
    """`init` with some keyword defaults replaced (see `Configurable.defaults`)."""
    signature = inspect.signature(init)
    unknown = sorted(set(defaults) - set(signature.parameters) - {"self"})
    if unknown:
        raise TypeError(f"{owner}.defaults: {', '.join(unknown)} are not keywords of its __init__")
    signature = signature.replace(
        parameters=[
            p.replace(default=defaults.get(p.name, p.default))
            for p in signature.parameters.values()
        ]
    )

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        init(*bound.args, **bound.kwargs)

    __init__.__signature__ = signature  # type: ignore[attr-defined]
    return __init__


def resolve_object(name: str, *, what: str = "object") -> Any:
    """The object named by `module:attribute` (attribute may be dotted); UserError naming what
    was tried when the module or the attribute is missing."""
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise UserError(f"{what} {name!r}: expected 'module:attribute', e.g. my_pkg.losses:MyDPO")
    obj = import_module_named(module_name, where=f"{what} {name!r}")
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in vars(obj) if not n.startswith("_")) if part else []
            raise UserError(
                f"{what} {name!r}: module {module_name!r} has no attribute {attr!r} "
                f"(it defines: {', '.join(public[:20]) or '(nothing public)'})"
            )
        obj = getattr(obj, part)
    return obj


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
    except UserError as exc:  # pydantic validators turn ValueErrors into config errors
        raise ValueError(f"{where}: {exc}") from None
    params = keywords(cls)
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
    checked = values.model_dump()
    if isinstance(cls, type) and issubclass(cls, Configurable):  # its own checks, at config time
        try:
            cls(**checked)
        except ArgumentError as exc:
            raise ValueError(f"{where}.{exc.arg}: {exc}") from None
    return {"name": name, **checked}


def registered_spec(registry: str, *, where: str) -> Any:
    """The type of a config field that holds a `{name: ..., **keywords}` spec of `registry`
    ("module:NAME"), checked by `validate_spec` when the config is validated. The registry is
    imported then, so a config module need not import its package's losses.

        loss: registered_spec("direct_alignment.losses:LOSSES", where="loss") = Field(...)
    """

    def check(spec: dict[str, Any]) -> dict[str, Any]:
        module, name = registry.split(":")
        return validate_spec(getattr(importlib.import_module(module), name), spec, where=where)

    return Annotated[dict[str, Any], AfterValidator(check)]


def build_from_spec(registry: Registry, spec: Mapping[str, Any]) -> Any:
    """Instantiate the class named by `spec["name"]` with the remaining keys as keywords."""
    return registry.get(spec["name"])(**{k: v for k, v in spec.items() if k != "name"})
