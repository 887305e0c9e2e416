"""`rlhf-lab quantize` on a tiny reward model and the tiny SFT policy, in 8 and 4 bits: the
saved folder loads with plain transformers and the report's figures are in range."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from rlhf_lab import cli

SPELL = {"task": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 8}}


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory) -> Path:
    """The shipped tiny preference RM recipe, shortened to 40 steps (held-out accuracy ~0.8)."""
    from reward_models.config import RMConfig
    from reward_models.train import train
    from rlhf_core.config import RunArgs, load_config

    out = tmp_path_factory.mktemp("rm")
    path = REPO / "configs" / "reward_models" / "tiny_preference.yaml"
    cfg = load_config(RMConfig, path, ["train.max_steps=40", "checkpoint.save_every=0",
                                       "train.export_sequence_classification=false"])  # fmt: skip
    assert train(cfg, RunArgs(config_path=path, output_dir=out)) == 0
    return out / "final"


def _quantize(capsys, *args: str) -> dict:
    assert cli.main(["quantize", *args]) == 0
    capsys.readouterr()
    out = Path(args[args.index("--model") + 1]).parent / (
        "quantized_int8" if args[args.index("--bits") + 1] == "8" else "quantized_nf4"
    )
    return json.loads((out / "quantize_report.json").read_text()) | {"dir": out}


@pytest.mark.parametrize("bits", ["8", "4"])
def test_quantized_reward_model_keeps_its_preferences(tiny_rm, capsys, bits):
    from rlhf_core.scalar_head import ScalarHeadModel

    report = _quantize(capsys, "--model", str(tiny_rm), "--bits", bits, "--limit", "64")
    assert report["pairs"] == 64 and report["accuracy_before"] > 0.7
    assert abs(report["accuracy_after"] - report["accuracy_before"]) <= 0.05
    assert report["preference_agreement"] >= 0.9
    assert 0 < report["mean_abs_delta_in_reward_std"] < 0.2
    layer = "Linear8bitLt" if bits == "8" else "Linear4bit"
    assert report["quantized_layers"][layer] == 14  # every linear layer of the 2-layer backbone
    assert report["disk_bytes_after"] < 0.5 * report["disk_bytes_before"]
    assert report["memory_bytes_after"] < 0.5 * report["memory_bytes_before"]
    assert (report["dir"] / "quantize_report.md").is_file()
    reloaded = ScalarHeadModel.from_pretrained(report["dir"])  # the saved k-bit directory
    assert type(reloaded.backbone.layers[0].mlp.down_proj).__name__ == layer


@pytest.mark.parametrize("bits", ["8", "4"])
def test_quantized_policy_stays_close(sft_checkpoint, tmp_path, capsys, bits):
    from transformers import AutoModelForCausalLM

    cfg = tmp_path / "eval.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"eval": {"reasoning_gym": {
        **SPELL, "size": 64, "seed": 10_000_000}}}}))  # fmt: skip
    model = tmp_path / "policy"
    import shutil

    shutil.copytree(sft_checkpoint, model)
    report = _quantize(capsys, "--model", str(model), "--bits", bits, "--eval-config", str(cfg),
                       "--max-new-tokens", "12")  # fmt: skip
    assert report["prompts"] == 64 and report["kl_tokens"] > 64
    assert 0 < report["kl_per_token"] < (0.05 if bits == "8" else 0.5)
    assert report["greedy_task_exact_before"] > 0.3  # the SFT model is partly right
    tolerance = 0.15 if bits == "8" else 0.25
    assert abs(report["greedy_task_after"] - report["greedy_task_before"]) < tolerance
    plain = AutoModelForCausalLM.from_pretrained(report["dir"])  # plain transformers
    layer = "Linear8bitLt" if bits == "8" else "Linear4bit"
    assert type(plain.model.layers[0].mlp.down_proj).__name__ == layer
