"""Every shipped YAML under configs/ validates against its package's config class."""

from __future__ import annotations

import importlib

import pytest
from conftest import REPO

from rlhf_core.config import load_config

CONFIG_CLASSES = {
    "instruction_tuning": "instruction_tuning.config:SFTConfig",
    "direct_alignment": "direct_alignment.config:DAConfig",
    "policy_gradients": "policy_gradients.config:PGConfig",
    "reward_models": "reward_models.config:RMConfig",
}

#: configs/quickstart/ mixes packages: one class per file
QUICKSTART = {
    "sft": "instruction_tuning.config:SFTConfig",
    "rm": "reward_models.config:RMConfig",
    "grpo": "policy_gradients.config:PGConfig",
    "rloo_rm": "policy_gradients.config:PGConfig",
    "dpo": "direct_alignment.config:DAConfig",
    "compare": "rlhf_lab.compare:CompareConfig",
    "pairs": "rlhf_lab.onpolicy:PairsConfig",
}
#: configs/compare_hh/ (the GPT-2 + HH workflow) mixes packages too
COMPARE_HH = {k: QUICKSTART[k] for k in ("sft", "rm", "grpo", "dpo", "compare")}
MIXED = {"quickstart": QUICKSTART, "compare_hh": COMPARE_HH}

SHIPPED = sorted(p for p in (REPO / "configs").rglob("*.yaml") if p.parent.name != "accelerate")


def config_class(path) -> str:
    if path.parent.name in MIXED:
        return MIXED[path.parent.name][path.stem]
    return CONFIG_CLASSES[path.parent.name]


def test_every_config_directory_is_known():
    dirs = {p.parent.name for p in (REPO / "configs").rglob("*.yaml")}
    assert dirs <= set(CONFIG_CLASSES) | {"accelerate", *MIXED}, dirs - set(CONFIG_CLASSES)
    assert SHIPPED, "no configs found"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_config_validates(path):
    module, cls = config_class(path).split(":")
    load_config(getattr(importlib.import_module(module), cls), path)


def test_cli_front_door_dispatches_to_the_trainer(capsys):
    from rlhf_lab.cli import main

    cfg = REPO / "configs" / "instruction_tuning" / "tiny_sft.yaml"
    assert main(["sft", "--config", str(cfg), "--set", "train.max_steps=1", "--dry-run"]) == 0
    assert "would run:  1 steps" in capsys.readouterr().out
    assert main(["nope"]) == 2


ACCELERATE = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_shipped_accelerate_config_loads(path):
    """configs/accelerate/*.yaml parse as accelerate's own launch configs (no GPU needed)."""
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.distributed_type in {"MULTI_GPU", "DEEPSPEED", "FSDP"}
    # FSDP2's bf16 is the trainer's train.fsdp.mixed_precision (accelerate never wraps the model)
    bf16 = "no" if cfg.distributed_type == "FSDP" else "bf16"
    assert cfg.mixed_precision == bf16 and cfg.num_processes > 1


def test_accelerate_configs_are_shipped():
    # ZeRO-3 is refused at startup (rlhf_core.loop); FSDP2 is rlhf_core.distributed's fsdp2
    assert {p.stem for p in ACCELERATE} == {"ddp", "deepspeed_zero2", "fsdp2"}


@pytest.mark.parametrize(
    ("engine", "zero_stage", "refused"),
    [("FSDP", None, None), ("DEEPSPEED", 3, "DeepSpeed ZeRO-3"), ("DEEPSPEED", 2, None),
     ("MULTI_GPU", None, None), ("NO", None, None)],
)  # fmt: skip
def test_zero3_is_refused_with_a_message(engine, zero_stage, refused):
    # none of these engines can start on a CPU (accelerate turns an FSDP config into MULTI_CPU
    # there), so the guard is checked on the values start_accelerator reads from accelerate;
    # FSDP passes: the trainers shard with fully_shard themselves (rlhf_core.distributed)
    from accelerate.utils import DistributedType

    from rlhf_core.loop import refuse_sharded_parameters

    if refused is None:
        refuse_sharded_parameters(DistributedType[engine], zero_stage)
    else:
        with pytest.raises(ValueError, match=rf"{refused} shards the parameters.*fsdp2"):
            refuse_sharded_parameters(DistributedType[engine], zero_stage)


def test_value_loss_named_as_the_policy_loss_is_refused_at_config_time():
    from policy_gradients.config import PGConfig
    from rlhf_core.config import ConfigError

    path = REPO / "configs" / "policy_gradients" / "ppo.yaml"
    with pytest.raises(ConfigError, match="unknown policy loss 'value'"):
        load_config(PGConfig, path, ["algorithm.loss={name: value}"])


def test_one_reference_block_for_direct_alignment_and_policy_gradients():
    from direct_alignment.config import DAConfig
    from policy_gradients.config import PGConfig
    from rlhf_core.config import ConfigError

    pg = REPO / "configs" / "policy_gradients" / "grpo.yaml"
    assert load_config(PGConfig, pg).reference.mode == "model"
    with pytest.raises(ConfigError, match="'precomputed' needs fixed completions"):
        load_config(PGConfig, pg, ["reference.mode=precomputed"])
    with pytest.raises(ConfigError, match="'adapter' needs LoRA.*use mode 'model' for"):
        load_config(PGConfig, pg, ["reference.mode=adapter"])
    with pytest.raises(ConfigError, match="train.reference"):  # the old place is refused
        load_config(PGConfig, pg, ["train.reference=copy"])
    da = REPO / "configs" / "direct_alignment" / "dpo.yaml"
    assert load_config(DAConfig, da, ["reference.mode=precomputed"]).reference.mode == "precomputed"
    with pytest.raises(ConfigError, match="'adapter' needs LoRA.*'model' or 'precomputed'"):
        load_config(DAConfig, da, ["reference.mode=adapter"])


def test_the_loss_is_a_top_level_spec_in_sft_too():
    from instruction_tuning.config import SFTConfig
    from rlhf_core.config import ConfigError

    path = REPO / "configs" / "instruction_tuning" / "tiny_sft.yaml"
    assert load_config(SFTConfig, path).loss == {"name": "nll"}
    with pytest.raises(ConfigError, match="train.loss"):
        load_config(SFTConfig, path, ["train.loss=nll"])
