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
