"""User code from the config and the command line: `imports:`, `--import`, `module:Class` specs.

In-process checks of the registry and config plumbing; docs/extending/ pages are trained end to
end through `python -m <package>.train` by tests/test_extending_docs.py."""

from __future__ import annotations

import sys
import textwrap

import pytest
import yaml

from direct_alignment.config import DAConfig
from direct_alignment.losses import LOSSES, DirectAlignmentLoss
from policy_gradients.advantages import ADVANTAGES
from rlhf_core.config import ConfigError, load_config, parse_run_args
from rlhf_core.errors import UserError
from rlhf_core.registry import Registry, RegistryError, resolve_object

USER_MODULE = """
import torch.nn.functional as F
from direct_alignment.losses import LOSSES, DirectAlignmentLoss

class {cls}(DirectAlignmentLoss):
    needs_reference = True
    needs_lengths = False

    def __init__(self, *, beta: float = 0.1, tilt: float = 0.0) -> None:
        super().__init__(beta=beta)
        self.tilt = tilt

    def _losses(self, chosen, rejected):
        return -F.logsigmoid(self.beta * (chosen - rejected) - self.tilt)

LOSSES.register("{name}")({cls})

class NotALoss:
    pass
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh user module `<mod>` on sys.path registering `<name>`; returns (mod, name, cls)."""
    n = len(LOSSES)
    mod, name, cls = f"user_losses_{tmp_path.name}", f"user_dpo_{n}", "TiltedDPO"
    (tmp_path / f"{mod}.py").write_text(USER_MODULE.format(cls=cls, name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield mod, name, cls
    sys.modules.pop(mod, None)
    LOSSES._entries.pop(name, None)


def _config_file(tmp_path, loss: dict, **top) -> str:
    data = {
        **top,
        "model": {"name_or_path": "tiny-qwen3"},
        "data": {"train": {"reasoning_gym": {"task": "spell_backward", "size": 8, "seed": 1}}},
        "loss": loss,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_yaml_imports_register_before_validation(tmp_path, user_module):
    mod, name, _ = user_module
    cfg = load_config(DAConfig, _config_file(tmp_path, {"name": name, "tilt": 0.5}, imports=[mod]))
    assert cfg.imports == [mod]
    # the spec was checked against the user's signature: defaults are filled in
    assert cfg.loss == {"name": name, "beta": 0.1, "tilt": 0.5}


def test_command_line_import_is_recorded_in_the_config(tmp_path, user_module):
    mod, name, _ = user_module
    path = _config_file(tmp_path, {"name": name})
    with pytest.raises(ConfigError, match=f"unknown direct alignment loss '{name}'.*--import"):
        load_config(DAConfig, path)
    cfg, _ = parse_run_args(["--config", path, "--import", mod], DAConfig, prog="t")
    assert cfg.imports == [mod] and cfg.loss["name"] == name


def test_module_colon_class_spec_needs_no_import(tmp_path, user_module):
    mod, _, cls = user_module
    cfg = load_config(DAConfig, _config_file(tmp_path, {"name": f"{mod}:{cls}", "beta": 0.2}))
    loss_cls = LOSSES.get(cfg.loss["name"])
    assert loss_cls.__name__ == cls and issubclass(loss_cls, DirectAlignmentLoss)
    assert cfg.loss == {"name": f"{mod}:{cls}", "beta": 0.2, "tilt": 0.0}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{mod}:Missing", "module '{mod}' has no attribute 'Missing'.*TiltedDPO"),
        ("{mod}:NotALoss", "is not a subclass of direct_alignment.losses.base.DirectAlignmentLoss"),
        ("no_such_module_xyz:Loss", "module 'no_such_module_xyz' not found on sys.path"),
        ("{mod}:", "expected 'module:attribute'"),
    ],
)
def test_spec_errors_name_what_was_tried(tmp_path, user_module, spec, message):
    mod = user_module[0]
    path = _config_file(tmp_path, {"name": spec.format(mod=mod)})
    with pytest.raises(ConfigError, match=message.format(mod=mod)) as info:
        load_config(DAConfig, path)
    assert "field 'loss': loss: direct alignment loss" in str(info.value)
    assert "Value error" not in str(info.value)


def test_missing_import_is_one_user_error(tmp_path):
    path = _config_file(tmp_path, {"name": "dpo"}, imports=["no_such_module_xyz"])
    with pytest.raises(UserError, match="imports: 'no_such_module_xyz': module .* not found"):
        load_config(DAConfig, path)


def test_a_broken_user_module_keeps_its_own_traceback(tmp_path, monkeypatch):
    """A user module that itself imports something missing is a bug in that module: its
    ModuleNotFoundError is kept (with the user's line, under a header naming the module:
    `UserCodeError`), not a misleading 'not found'."""
    from rlhf_core.errors import UserCodeError

    (tmp_path / "broken_user_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _config_file(tmp_path, {"name": "dpo"}, imports=["broken_user_mod"])
    with pytest.raises(UserCodeError, match="'broken_user_mod' raised ModuleNotFoundError") as info:
        load_config(DAConfig, path)
    assert isinstance(info.value.original, ModuleNotFoundError)
    assert info.value.original.name == "no_such_dependency_xyz"


def test_every_package_registry_names_its_base():
    from policy_gradients.losses import LOSSES as PG_LOSSES
    from policy_gradients.losses import PolicyGradientLoss
    from reward_models.losses import LOSSES as RM_LOSSES
    from reward_models.losses import RewardLoss

    assert LOSSES.base is DirectAlignmentLoss
    assert PG_LOSSES.base is PolicyGradientLoss
    assert RM_LOSSES.base is RewardLoss
    assert ADVANTAGES.get("policy_gradients.advantages:GRPOAdvantage") is ADVANTAGES.get("grpo")
    with pytest.raises(RegistryError, match="not a subclass of .*AdvantageEstimator"):
        ADVANTAGES.get("policy_gradients.losses:ValueLoss")


def test_resolve_object_dotted_attribute_and_registry_error_is_a_user_error():
    assert resolve_object("textwrap:dedent") is textwrap.dedent
    reg: Registry = Registry("thing")
    with pytest.raises(UserError):
        reg.get("nope")
    with pytest.raises(KeyError):  # still a KeyError for code that caught it before
        reg.get("nope")
