"""rlhf_core.config: YAML loading, `--set` overrides, validation errors and the run command line."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import Field

from rlhf_core.config import (
    ConfigError,
    RunArgs,
    StrictModel,
    apply_overrides,
    dump_config,
    load_config,
    parse_run_args,
    read_yaml,
    validate_config,
)

# ----------------------------------------------------------------------------- test schema


class OptimBlock(StrictModel):
    lr: float = 1e-3
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"


class LoraBlock(StrictModel):
    r: int = 8
    alpha: float = 16.0


class ModelBlock(StrictModel):
    name_or_path: str = "tiny"
    lora: LoraBlock | None = None


class DPOLoss(StrictModel):
    name: Literal["dpo"] = "dpo"
    beta: float = 0.1


class IPOLoss(StrictModel):
    name: Literal["ipo"] = "ipo"
    tau: float = 0.05
    label_smoothing: float = 0.0


LossBlock = Annotated[DPOLoss | IPOLoss, Field(discriminator="name")]


class TrainConfig(StrictModel):
    run_name: str  # required
    seed: int = 0
    tags: list[str] = Field(default_factory=list)
    optim: OptimBlock = Field(default_factory=OptimBlock)
    model: ModelBlock = Field(default_factory=ModelBlock)
    loss: LossBlock = Field(default_factory=DPOLoss)
    note: str | None = None


BASE_YAML = """\
run_name: demo
seed: 3
tags: [a, b]
optim:
  lr: 0.01
  betas: [0.8, 0.95]
model:
  name_or_path: tiny-qwen3
  lora: null
loss:
  name: ipo
  tau: 0.2
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config_error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, path, overrides)
    return str(info.value)


# ----------------------------------------------------------------------------- loading


def test_load_valid_config(tmp_path):
    cfg = load_config(TrainConfig, write(tmp_path, BASE_YAML))
    assert cfg.run_name == "demo"
    assert cfg.seed == 3
    assert cfg.tags == ["a", "b"]
    assert cfg.optim.lr == 0.01
    assert cfg.optim.betas == [0.8, 0.95]
    assert cfg.optim.warmup_steps == 0  # default filled in
    assert cfg.model.lora is None
    assert isinstance(cfg.loss, IPOLoss)
    assert cfg.loss.tau == 0.2


def test_discriminator_selects_member(tmp_path):
    cfg = load_config(TrainConfig, write(tmp_path, "run_name: x\nloss: {name: dpo, beta: 0.5}\n"))
    assert isinstance(cfg.loss, DPOLoss)
    assert cfg.loss.beta == 0.5


def test_empty_file_uses_defaults_but_required_key_is_reported(tmp_path):
    path = write(tmp_path, "")
    message = config_error(path)
    assert "missing required key 'run_name'" in message
    assert str(path) in message


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "does" / "not" / "exist.yaml"
    message = config_error(path)
    assert str(path) in message
    assert "not found" in message


def test_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        read_yaml(tmp_path)


def test_invalid_yaml_names_file(tmp_path):
    path = write(tmp_path, "run_name: [unclosed\n")
    message = config_error(path)
    assert str(path) in message
    assert "YAML" in message


def test_non_mapping_top_level(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    message = config_error(path)
    assert str(path) in message
    assert "list" in message


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_top_level_key(tmp_path):
    path = write(tmp_path, BASE_YAML + "sede: 4\n")
    message = config_error(path)
    assert "unknown key 'sede'" in message
    assert str(path) in message
    for key in ("run_name", "seed", "tags", "optim", "model", "loss", "note"):
        assert key in message.split("allowed keys here:")[1]


def test_unknown_nested_key(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("  lr: 0.01", "  lr: 0.01\n  learning_rate: 1"))
    message = config_error(path)
    assert "unknown key 'optim.learning_rate'" in message
    assert str(path) in message
    allowed = message.split("allowed keys here:")[1]
    assert "lr, betas, warmup_steps, schedule" in allowed
    assert "run_name" not in allowed  # only the keys of the block where the typo is


def test_unknown_key_in_optional_submodel(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("lora: null", "lora: {r: 4, rank: 4}"))
    message = config_error(path)
    assert "unknown key 'model.lora.rank'" in message
    assert "allowed keys here: r, alpha" in message


def test_unknown_key_in_discriminated_union_member(tmp_path):
    # `beta` belongs to dpo, not to the chosen ipo member
    path = write(tmp_path, BASE_YAML.replace("  tau: 0.2", "  tau: 0.2\n  beta: 0.1"))
    message = config_error(path)
    assert "unknown key 'loss.beta'" in message  # the path as written, without the tag
    assert "allowed keys here: name, tau, label_smoothing" in message
    assert str(path) in message


def test_unknown_key_in_other_union_member(tmp_path):
    path = write(tmp_path, "run_name: x\nloss: {name: dpo, tau: 0.1}\n")
    message = config_error(path)
    assert "unknown key 'loss.tau'" in message
    assert "allowed keys here: name, beta" in message


def test_unknown_discriminator_value(tmp_path):
    path = write(tmp_path, "run_name: x\nloss: {name: kto}\n")
    message = config_error(path)
    assert "'loss'" in message
    assert "kto" in message
    assert "dpo" in message and "ipo" in message


def test_all_errors_reported_together(tmp_path):
    path = write(tmp_path, BASE_YAML + "bogus: 1\n" + "note: [1]\n")
    message = config_error(path)
    assert "unknown key 'bogus'" in message
    assert "field 'note'" in message


# ----------------------------------------------------------------------------- wrong types


def test_wrong_type_names_path_type_and_value(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("lr: 0.01", "lr: fast"))
    message = config_error(path)
    assert "field 'optim.lr'" in message
    assert "expected float" in message
    assert "'fast'" in message
    assert str(path) in message


def test_wrong_type_int_field(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("seed: 3", "seed: 1.5"))
    message = config_error(path)
    assert "field 'seed'" in message
    assert "expected int" in message
    assert "1.5" in message


def test_wrong_type_inside_list(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("[0.8, 0.95]", "[0.8, high]"))
    message = config_error(path)
    assert "field 'optim.betas.1'" in message
    assert "expected float" in message
    assert "'high'" in message


def test_wrong_type_list_field(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("tags: [a, b]", "tags: 7"))
    message = config_error(path)
    assert "field 'tags'" in message
    assert "expected list[str]" in message
    assert "7 (int)" in message


def test_wrong_type_in_union_member(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("tau: 0.2", "tau: big"))
    message = config_error(path)
    assert "field 'loss.tau'" in message
    assert "expected float" in message
    assert "'big'" in message


def test_wrong_type_optional_submodel(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("lora: null", "lora: 5"))
    message = config_error(path)
    assert "field 'model.lora'" in message
    assert "LoraBlock | null" in message


def test_literal_field_rejects_other_value(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("  lr: 0.01", "  lr: 0.01\n  schedule: linear"))
    message = config_error(path)
    assert "field 'optim.schedule'" in message
    assert "'linear'" in message


def test_validate_assignment_is_on():
    cfg = validate_config(TrainConfig, {"run_name": "x"})
    with pytest.raises(ValueError):
        cfg.seed = "not an int"


def test_validate_config_uses_source_name():
    with pytest.raises(ConfigError, match=r"^my-source: invalid config"):
        validate_config(TrainConfig, {"run_name": "x", "zzz": 1}, source="my-source")


# ----------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("override", "getter", "expected"),
    [
        ("seed=42", lambda c: c.seed, 42),
        ("optim.lr=3e-4", lambda c: c.optim.lr, 3e-4),
        ("optim.lr=0.5", lambda c: c.optim.lr, 0.5),
        ("optim.warmup_steps=10", lambda c: c.optim.warmup_steps, 10),
        ("model.name_or_path=some/model", lambda c: c.model.name_or_path, "some/model"),
        ("note=hello world", lambda c: c.note, "hello world"),
        ("note=null", lambda c: c.note, None),
        ("tags=[x, y, z]", lambda c: c.tags, ["x", "y", "z"]),
        ("loss.tau=1", lambda c: c.loss.tau, 1.0),
    ],
)
def test_override_values(tmp_path, override, getter, expected):
    cfg = load_config(TrainConfig, write(tmp_path, BASE_YAML), [override])
    value = getter(cfg)
    assert value == expected
    assert type(value) is type(expected)


def test_override_3e_minus_4_is_float_after_validation(tmp_path):
    # PyYAML reads "3e-4" (no dot) as a string; validation must still make it a float
    cfg = load_config(TrainConfig, write(tmp_path, BASE_YAML), ["optim.lr=3e-4"])
    assert isinstance(cfg.optim.lr, float)
    assert cfg.optim.lr == pytest.approx(3e-4, rel=0, abs=0)


def test_override_scalars_parsed_as_yaml():
    data = apply_overrides(
        {},
        ["a=1", "b=2.5", "c=null", "d=true", "e=text", "f='7'", "g=", "h=[1, 2]", "i={x: 1}"],
    )
    assert data == {
        "a": 1,
        "b": 2.5,
        "c": None,
        "d": True,
        "e": "text",
        "f": "7",
        "g": "",
        "h": [1, 2],
        "i": {"x": 1},
    }
    assert type(data["a"]) is int
    assert type(data["b"]) is float


def test_override_value_may_contain_equals():
    assert apply_overrides({}, ["note=a=b"]) == {"note": "a=b"}


def test_override_creates_nested_mappings_and_replaces_null(tmp_path):
    cfg = load_config(TrainConfig, write(tmp_path, BASE_YAML), ["model.lora.r=4"])
    assert cfg.model.lora == LoraBlock(r=4)


def test_override_sets_optional_submodel_to_null(tmp_path):
    path = write(tmp_path, BASE_YAML.replace("lora: null", "lora: {r: 2}"))
    assert load_config(TrainConfig, path).model.lora == LoraBlock(r=2)
    assert load_config(TrainConfig, path, ["model.lora=null"]).model.lora is None


def test_override_switches_union_member(tmp_path):
    cfg = load_config(
        TrainConfig, write(tmp_path, BASE_YAML), ["loss={name: dpo}", "loss.beta=0.25"]
    )
    assert cfg.loss == DPOLoss(beta=0.25)


def test_overrides_apply_in_order(tmp_path):
    path = write(tmp_path, BASE_YAML)
    assert load_config(TrainConfig, path, ["seed=1", "seed=2", "seed=5"]).seed == 5
    assert load_config(TrainConfig, path, ["seed=5", "seed=1"]).seed == 1
    cfg = load_config(TrainConfig, path, ["model.lora={r: 3}", "model.lora.alpha=6"])
    assert cfg.model.lora == LoraBlock(r=3, alpha=6.0)
    cfg = load_config(TrainConfig, path, ["model.lora.alpha=6", "model.lora=null"])
    assert cfg.model.lora is None


def test_override_does_not_touch_other_keys(tmp_path):
    cfg = load_config(TrainConfig, write(tmp_path, BASE_YAML), ["optim.lr=0.5"])
    assert cfg.optim.betas == [0.8, 0.95]
    assert cfg.seed == 3


def test_override_of_unknown_key_fails_naming_key(tmp_path):
    path = write(tmp_path, BASE_YAML)
    message = config_error(path, ["optim.lrate=0.1"])
    assert "unknown key 'optim.lrate'" in message
    assert "optim.lrate=0.1" in message  # the source mentions the override
    assert str(path) in message


def test_override_of_unknown_top_level_block_fails(tmp_path):
    message = config_error(write(tmp_path, BASE_YAML), ["trainer.steps=3"])
    assert "unknown key 'trainer'" in message


def test_override_wrong_type_fails(tmp_path):
    message = config_error(write(tmp_path, BASE_YAML), ["seed=abc"])
    assert "field 'seed'" in message
    assert "expected int" in message
    assert "'abc'" in message


@pytest.mark.parametrize("bad", ["seed", "=3", "optim..lr=1", ".lr=1"])
def test_malformed_override_raises(bad):
    with pytest.raises(ConfigError, match="--set"):
        apply_overrides({}, [bad])


def test_override_through_a_scalar_raises():
    with pytest.raises(ConfigError, match=r"'seed' is a int, not a mapping"):
        apply_overrides({"seed": 3}, ["seed.x=1"])


def test_override_invalid_yaml_value_raises():
    with pytest.raises(ConfigError, match="not valid YAML"):
        apply_overrides({}, ["a=[1, 2"])


# ----------------------------------------------------------------------------- command line


def test_parse_run_args_full(tmp_path):
    path = write(tmp_path, BASE_YAML)
    cfg, run = parse_run_args(
        [
            "--config",
            str(path),
            "--set",
            "seed=9",
            "--set",
            "optim.lr=3e-4",
            "--set",
            "seed=10",
            "--output-dir",
            str(tmp_path / "run"),
            "--resume",
            "--dry-run",
        ],
        TrainConfig,
        prog="test",
    )
    assert isinstance(cfg, TrainConfig)
    assert cfg.seed == 10
    assert cfg.optim.lr == 3e-4
    assert isinstance(run, RunArgs)
    assert run.config_path == path
    assert run.overrides == ["seed=9", "optim.lr=3e-4", "seed=10"]
    assert run.output_dir == tmp_path / "run"
    assert isinstance(run.output_dir, Path)
    assert run.resume == "auto"
    assert run.dry_run is True


def test_parse_run_args_defaults(tmp_path):
    path = write(tmp_path, BASE_YAML)
    cfg, run = parse_run_args(["--config", str(path)], TrainConfig, prog="test")
    assert cfg == load_config(TrainConfig, path)
    assert run.overrides == []
    assert run.output_dir is None
    assert run.resume is None
    assert run.dry_run is False


def test_parse_run_args_resume_path(tmp_path):
    path = write(tmp_path, BASE_YAML)
    ckpt = str(tmp_path / "runs" / "checkpoint-10")
    _, run = parse_run_args(["--resume", ckpt, "--config", str(path)], TrainConfig, prog="t")
    assert run.resume == ckpt
    _, run = parse_run_args(["--config", str(path), "--resume", "auto"], TrainConfig, prog="t")
    assert run.resume == "auto"


def test_parse_run_args_requires_config():
    # --config may be left out only with --resume RUN_DIR (the run's saved config.yaml)
    with pytest.raises(ConfigError, match=r"--config FILE is required \(or --resume RUN_DIR"):
        parse_run_args([], TrainConfig, prog="t")


def test_parse_run_args_propagates_config_errors(tmp_path):
    path = write(tmp_path, BASE_YAML)
    with pytest.raises(ConfigError, match="unknown key 'optim.nope'"):
        parse_run_args(["--config", str(path), "--set", "optim.nope=1"], TrainConfig, prog="t")
    with pytest.raises(ConfigError, match="missing.yaml"):
        parse_run_args(["--config", str(tmp_path / "missing.yaml")], TrainConfig, prog="t")


# ----------------------------------------------------------------------------- dump


def test_dump_config_round_trips(tmp_path):
    path = write(tmp_path, BASE_YAML)
    cfg = load_config(TrainConfig, path, ["model.lora.r=4", "note=hi", "optim.lr=3e-4"])
    dumped = dump_config(cfg)
    again = load_config(TrainConfig, write(tmp_path, dumped, "dumped.yaml"))
    assert again == cfg
    assert again.model_dump() == cfg.model_dump()
    assert isinstance(again.loss, IPOLoss)
    # the dump is the fully resolved config: defaults are written out
    assert "warmup_steps: 0" in dumped
    assert "label_smoothing: 0.0" in dumped
    # and it keeps the declared field order
    assert dumped.index("run_name") < dumped.index("seed") < dumped.index("optim")


def test_dump_config_default_union_member_round_trips(tmp_path):
    cfg = validate_config(TrainConfig, {"run_name": "x"})
    again = load_config(TrainConfig, write(tmp_path, dump_config(cfg)))
    assert again == cfg
    assert isinstance(again.loss, DPOLoss)


def test_set_indexes_lists_by_number():
    from rlhf_core.config import apply_overrides

    data = {"rewards": [{"name": "a", "weight": 1.0}, {"name": "b"}]}
    apply_overrides(data, ["rewards.1.weight=0.5", "rewards.0.name=c"])
    assert data == {"rewards": [{"name": "c", "weight": 1.0}, {"name": "b", "weight": 0.5}]}
    with pytest.raises(ConfigError, match=r"'rewards' is a list of 2 items; use an index 0..1"):
        apply_overrides(data, ["rewards.5.weight=1"])
