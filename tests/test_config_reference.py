"""docs/configuration.md is generated from the config classes; it must match the code."""

from __future__ import annotations

from rlhf_lab.config_reference import TARGET, main, render


def test_generated_configuration_reference_is_up_to_date():
    assert main(["--check"]) == 0, "run: uv run python -m rlhf_lab.config_reference"


def test_reference_lists_nested_keys_with_descriptions():
    text = render()
    assert "| `algorithm.ppo_epochs` |" in text and "| `rollout.group_size` |" in text
    assert "| `train.share_prompt` |" in text and "| `model.lora.r` |" in text
    assert TARGET.name == "configuration.md"


def test_reference_lists_each_registered_class_with_its_keywords():
    text = render()
    assert "| `dpo` | `DPOLoss` | `beta`: float = `0.1` |" in text
    # GSPO's paper defaults come from its `defaults`, read through the signature
    assert (
        "| `gspo` | `GSPOLoss` | `eps_low`: float = `0.0003`; `eps_high`: float = `0.0004`" in text
    )
    assert "### `algorithm.value_loss (policy_gradients)`" in text and "| `value` |" in text
    assert "## Token limits (every package)" in text and "max_length - len(completion)" in text
