"""A name -> class registry, so configs choose losses, estimators and rewards by name.

    LOSSES = Registry("losses")

    @LOSSES.register("dpo")
    class DPOLoss(nn.Module): ...

    loss_cls = LOSSES.get("dpo")

Registering a name twice raises; asking for an unknown name raises and lists the registered names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

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
