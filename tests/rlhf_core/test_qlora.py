"""QLoRA: a 4-bit NF4 base (bitsandbytes) with a LoRA adapter, in the SFT, DPO, GRPO and RM
trainers. One step of each must update the adapter and nothing else: the optimizer holds state
for exactly the adapter's tensors, each moved, the saved model is an adapter, and the run records
one finished step with a finite loss and a nonzero gradient norm."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import metric_series, tiny_pg_dict
from safetensors.torch import load_file

from rlhf_core.config import RunArgs
from rlhf_core.models import ModelConfig, ReferencePolicy, load_policy

QLORA = {"name_or_path": "tiny-qwen3", "lora": {"r": 4, "alpha": 8},
         "quantization": {"bits": 4}}  # fmt: skip
ADAPTER_TENSORS = 2 * 7 * 2  # 2 layers x 7 projections x (lora_A, lora_B)


def test_qlora_model_has_4bit_base_and_trainable_adapter_only():
    model = load_policy(ModelConfig(**QLORA))
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    assert type(layer.base_layer).__name__ == "Linear4bit"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == ADAPTER_TENSORS and all("lora_" in n for n in trainable)
    ids = torch.tensor([[3, 4, 5, 6]])
    with ReferencePolicy(model, "adapter").model() as ref:  # the 4-bit base, adapter off
        base = ref(ids).logits
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    assert not torch.allclose(model(ids).logits, base)


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def test_qlora_model_holds_no_view_of_the_checkpoint_file():
    """The full-precision tensors bitsandbytes leaves (embedding, norms) are copied out of the
    memory-mapped checkpoint, so the mapping (every page of which quantising read) can close."""
    from rlhf_core.models import resolve_model_path

    checkpoint = Path(resolve_model_path("tiny-qwen3")).resolve() / "model.safetensors"
    plain = load_policy(ModelConfig(name_or_path="tiny-qwen3"))  # fp32: views of the file
    ranges = _mapped_ranges(checkpoint)
    inside = [n for n, p in plain.named_parameters()
              if any(a <= p.data_ptr() < b for a, b in ranges)]  # fmt: skip
    assert inside, "fp32 load no longer memory-maps the checkpoint: this test checks nothing"
    model = load_policy(ModelConfig(**QLORA))
    ranges = _mapped_ranges(checkpoint)
    inside = [n for n, p in model.named_parameters()
              if any(a <= p.data_ptr() < b for a, b in ranges)]  # fmt: skip
    assert inside == []


def test_quantization_without_lora_is_refused():
    with pytest.raises(ValueError, match="set model.lora too"):
        ModelConfig(name_or_path="tiny-qwen3", quantization={"bits": 4})


def _assert_one_finished_step(run_dir: Path) -> None:
    """The run says it finished one step, none skipped, with a finite loss and gradient norm."""
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["skipped_steps"] == 0, summary
    for key in ("train/loss", "train/grad_norm"):
        values = metric_series(run_dir, key)
        assert list(values) == [1] and math.isfinite(values[1]), (key, values)
    assert metric_series(run_dir, "train/grad_norm")[1] > 0  # the adapter got a gradient


def _assert_only_adapter_trained(run_dir: Path) -> None:
    _assert_one_finished_step(run_dir)
    ckpt = run_dir / "checkpoints" / "checkpoint-1"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    assert len(state) == ADAPTER_TENSORS  # no optimizer state for any base weight
    final = run_dir / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    saved = load_file(final / "adapter_model.safetensors")
    assert len(saved) == ADAPTER_TENSORS and all("lora_" in k for k in saved)
    # lora_B starts at zero (so lora_A has no gradient in step 1): every lora_B moved
    assert all(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)


def test_qlora_sft_step(tiny_sft_dict, tmp_path):
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train

    tiny_sft_dict.update(model=QLORA)
    tiny_sft_dict["train"].update(max_steps=1, evaluate=False)
    tiny_sft_dict["checkpoint"].update(save_every=1)
    cfg = SFTConfig.model_validate(tiny_sft_dict)
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path)) == 0
    _assert_only_adapter_trained(tmp_path)


def test_qlora_dpo_step_with_adapter_reference(tiny_dpo_dict, tmp_path):
    from direct_alignment.config import DAConfig
    from direct_alignment.train import train

    tiny_dpo_dict.update(model=QLORA, reference={"mode": "adapter"})
    tiny_dpo_dict["train"].update(max_steps=1, evaluate=False)
    tiny_dpo_dict["checkpoint"].update(save_every=1)
    cfg = DAConfig.model_validate(tiny_dpo_dict)
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path)) == 0
    _assert_only_adapter_trained(tmp_path)


def test_qlora_grpo_step_with_adapter_reference(tmp_path):
    from policy_gradients.config import PGConfig
    from policy_gradients.train import train

    data = tiny_pg_dict("tiny-qwen3", name="grpo", advantage={"name": "grpo"},
                        loss={"name": "clipped", "kl_beta": 0.05})  # fmt: skip
    data.update(model=QLORA)
    data["train"].update(max_steps=1, evaluate=False)
    data["reference"] = {"mode": "adapter"}
    data["checkpoint"].update(save_every=1)
    cfg = PGConfig.model_validate(data)
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path)) == 0
    _assert_only_adapter_trained(tmp_path)


def test_qlora_reward_model_step(tmp_path):
    from reward_models.config import RMConfig
    from reward_models.train import train

    rg = {"task": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 6}}
    cfg = RMConfig.model_validate({
        "name": "qlora_rm", "model": QLORA,
        "data": {"train": {"reasoning_gym": {**rg, "size": 32, "seed": 1}}, "max_length": 48},
        "train": {"batch_size": 8, "max_steps": 1, "threads": 1},
        "checkpoint": {"save_every": 1}, "tracking": {"log_every": 1, "plot_every": 0},
    })  # fmt: skip
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path)) == 0
    state = torch.load(tmp_path / "checkpoints" / "checkpoint-1" / "trainer_state.pt",
                       weights_only=True)["optimizer"]["state"]  # fmt: skip
    assert len(state) == ADAPTER_TENSORS + 1  # the adapter and the scalar head, no base weight
    _assert_one_finished_step(tmp_path)
    final = tmp_path / "final"  # the adapter and the scalar head, no full-precision base copy
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    saved = load_file(final / "adapter_model.safetensors")
    assert len(saved) == ADAPTER_TENSORS and all("lora_" in k for k in saved)
    assert all(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)
    head = load_file(final / "scalar_head.safetensors")
    assert head and all(torch.isfinite(v).all() for v in head.values())
