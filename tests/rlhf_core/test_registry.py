"""rlhf_core.registry.Registry: registration, lookup and the error messages."""

from __future__ import annotations

import pytest

from rlhf_core.registry import Registry, RegistryError


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
