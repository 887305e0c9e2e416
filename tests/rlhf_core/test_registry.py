"""rlhf_core.registry.Registry: registration, lookup and the error messages."""

from __future__ import annotations

import inspect

import pytest

from rlhf_core.registry import Configurable, Registry, RegistryError, validate_spec


def make_registry() -> Registry:
    reg: Registry = Registry("losses")

    @reg.register("dpo")
    class DPO:
        pass

    @reg.register("ipo")
    class IPO:
        pass

    return reg


def test_register_returns_object_and_get_finds_it():
    reg: Registry = Registry("things")

    class Thing:
        pass

    returned = reg.register("thing")(Thing)
    assert returned is Thing  # usable as a decorator that leaves the class unchanged
    assert reg.get("thing") is Thing


def test_register_non_class_objects():
    reg: Registry = Registry("fns")
    reg.register("double")(lambda x: 2 * x)
    assert reg.get("double")(21) == 42


def test_duplicate_name_raises_naming_the_name():
    reg = make_registry()

    class Other:
        pass

    with pytest.raises(RegistryError) as info:
        reg.register("dpo")(Other)
    message = str(info.value)
    assert "'dpo'" in message
    assert "losses" in message
    # the original entry is untouched
    assert reg.get("dpo").__name__ == "DPO"
    assert len(reg) == 2


def test_registry_error_is_a_key_error_with_plain_message():
    reg = make_registry()
    with pytest.raises(KeyError) as info:
        reg.get("nope")
    # KeyError normally repr()s its message; RegistryError shows it plainly
    assert not str(info.value).startswith('"')


def test_unknown_name_lists_registered_names():
    reg = make_registry()
    with pytest.raises(RegistryError) as info:
        reg.get("kto")
    message = str(info.value)
    assert "'kto'" in message
    assert "dpo" in message and "ipo" in message
    assert "losses" in message


def test_unknown_name_in_empty_registry():
    reg: Registry = Registry("rewards")
    with pytest.raises(RegistryError, match=r"rewards 'x'.*\(none\)"):
        reg.get("x")


def test_contains_names_iter_len():
    reg = make_registry()
    assert "dpo" in reg
    assert "ipo" in reg
    assert "kto" not in reg
    assert 3 not in reg
    assert reg.names() == ["dpo", "ipo"]
    assert list(reg) == ["dpo", "ipo"]
    assert len(reg) == 2
    assert "dpo" in repr(reg)


def test_names_are_sorted_regardless_of_registration_order():
    reg: Registry = Registry("x")
    for name in ["zeta", "alpha", "mid"]:
        reg.register(name)(object())
    assert reg.names() == ["alpha", "mid", "zeta"]


def test_registries_are_independent():
    a: Registry = Registry("a")
    b: Registry = Registry("b")
    a.register("same")(1)
    b.register("same")(2)
    assert a.get("same") == 1
    assert b.get("same") == 2


@pytest.mark.parametrize("bad", ["", None, 3])
def test_invalid_name_raises(bad):
    reg: Registry = Registry("x")
    with pytest.raises(ValueError):
        reg.register(bad)


def test_registering_a_class_sets_its_name():
    reg: Registry = Registry("losses")

    @reg.register("mine")
    class Mine(Configurable):
        def __init__(self, *, beta: float = 0.1) -> None:
            self._require(beta > 0, "beta", beta, "positive")
            self.beta = beta

    assert Mine.name == "mine"
    with pytest.raises(ValueError, match="mine loss: beta must be positive, got -1"):
        Mine(beta=-1)
    assert Mine(beta=0.5).extra_repr() == "beta=0.5"


def test_defaults_change_the_parents_defaults_and_signature():
    class Parent(Configurable):
        def __init__(self, *, eps_low: float, eps_high: float = 0.2) -> None:
            self.eps_low, self.eps_high = eps_low, eps_high

    class Child(Parent):
        defaults = {"eps_low": 3e-4, "eps_high": 4e-4}

    child = Child()
    assert (child.eps_low, child.eps_high) == (3e-4, 4e-4)
    assert (Child(eps_high=1.0).eps_low, Child(eps_high=1.0).eps_high) == (3e-4, 1.0)
    params = inspect.signature(Child.__init__).parameters
    assert (params["eps_low"].default, params["eps_high"].default) == (3e-4, 4e-4)
    assert validate_spec(_registry_of(Child), {"name": "c"}, where="x") == {
        "name": "c", "eps_low": 3e-4, "eps_high": 4e-4,
    }  # fmt: skip
    with pytest.raises(TypeError, match="unexpected keyword"):
        Child(beta=1.0)
    with pytest.raises(TypeError, match="gamma are not keywords"):

        class Bad(Parent):
            defaults = {"gamma": 1.0}


def _registry_of(cls: type) -> Registry:
    reg: Registry = Registry("losses")
    reg.register("c")(cls)
    return reg
