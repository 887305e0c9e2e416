"""`--model-index N` trains one entry of a `models:` list (one job per model), in the same run
dir the list run gives it; a bad index and a config without a list are one-line errors."""

from __future__ import annotations

import pytest
from conftest import REPO, write_yaml

from direct_alignment.train import main
from rlhf_core.config import ConfigError
from rlhf_core.errors import UserError


@pytest.fixture
def models_config(tiny_dpo_dict, tmp_path):
    tiny_dpo_dict.pop("model")
    tiny_dpo_dict["models"] = [
        {"name_or_path": str(tmp_path / "no-such-model")},
        {"name_or_path": "tiny-qwen3"},
    ]
    tiny_dpo_dict["train"]["max_steps"] = 1
    tiny_dpo_dict["data"]["eval"] = None
    return str(write_yaml(tmp_path / "models.yaml", tiny_dpo_dict))


def test_model_index_trains_only_that_entry(models_config, tmp_path):
    out = tmp_path / "runs"
    assert main(["--config", models_config, "--model-index", "1", "--output-dir", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["test_dpo-1-tiny-qwen3"]
    assert (out / "test_dpo-1-tiny-qwen3" / "final").is_dir()


def test_bad_model_index_is_a_user_error(models_config, tmp_path):
    with pytest.raises(UserError, match=r"--model-index 2: .* has 2 entries \(0\.\.1\)"):
        main(["--config", models_config, "--model-index", "2", "--dry-run"])


def test_model_index_needs_a_models_list(tmp_path):
    from instruction_tuning.train import main as sft_main

    sft = str(REPO / "configs/instruction_tuning/tiny_sft.yaml")
    with pytest.raises(ConfigError, match="--model-index: .* has no 'models:' list"):
        sft_main(["--config", sft, "--model-index", "0", "--dry-run"])
    dpo = str(REPO / "configs/direct_alignment/tiny_dpo.yaml")
    with pytest.raises(UserError, match="one 'model', not a 'models:' list"):
        main(["--config", dpo, "--model-index", "0", "--dry-run"])
