"""k-bit weights through bitsandbytes: the config block, and what `from_pretrained` needs.

`QuantizationConfig` is `model.quantization` in every trainer's config. It becomes a transformers
`BitsAndBytesConfig`:

    bits 8   LLM.int8() (Dettmers et al. 2022, arXiv:2208.07339): int8 weights with outlier
             features kept in 16 bits (bitsandbytes `Linear8bitLt`)
    bits 4   4-bit NormalFloat with double quantisation of the scales (QLoRA, Dettmers et al.
             2023, arXiv:2305.14314; bitsandbytes `Linear4bit`), matmuls in `compute_dtype`

Quantised weights are frozen: a trainer with `model.quantization` must also set `model.lora`
(QLoRA: the adapter trains in full precision on top of the k-bit base). bitsandbytes >= 0.48 runs
both modes on the CPU as well as CUDA, so everything here is tested on the CPU.

Not here: GPTQ/AWQ, 8-bit optimizers, quantising a model that is already loaded.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from pydantic import Field

from rlhf_core.config import StrictModel

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class QuantizationConfig(StrictModel):
    bits: Literal[4, 8] = Field(description="8 = LLM.int8(); 4 = 4-bit (NF4 by default)")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type")
    double_quant: bool = Field(True, description="4-bit: also quantise the quantisation scales")
    compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="4-bit matmul dtype; auto = the model's dtype"
    )
    skip_modules: list[str] | None = Field(
        None, description="module names kept unquantised (e.g. [score]); null = the LM head"
    )


def bnb_config(q: QuantizationConfig, model_dtype: torch.dtype) -> Any:
    """The transformers `BitsAndBytesConfig` of `q`."""
    from transformers import BitsAndBytesConfig

    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=q.skip_modules)
    compute = model_dtype if q.compute_dtype == "auto" else COMPUTE_DTYPES[q.compute_dtype]
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant, bnb_4bit_compute_dtype=compute,
        llm_int8_skip_modules=q.skip_modules,
    )  # fmt: skip


def quantized_load_kwargs(
    q: QuantizationConfig | None, model_dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Extra `from_pretrained` keywords: the bnb config and the device placement (a quantised
    model is placed while loading; `.to(device)` is not allowed on it afterwards)."""
    if q is None:
        return {}
    # bitsandbytes logs a warning on every int8 matmul with float32 inputs (it casts to fp16)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    return {"quantization_config": bnb_config(q, model_dtype), "device_map": {"": device}}


def release_checkpoint_pages(model: torch.nn.Module) -> int:
    """Give a quantised CPU model's full-precision tensors their own memory; returns how many.

    transformers memory-maps a safetensors checkpoint, and the tensors bitsandbytes leaves in
    full precision (embedding, norms, an unquantised head) stay views of that mapping. Quantising
    read every page of the file, and a mapping keeps the pages it has read resident (counted in
    the process's RSS as RssFile) for as long as any view of it lives. Measured on Qwen3-0.6B's
    shape (`benchmarks/qlora_memory.py`): the whole 2.3 GiB fp32 file stayed resident beside
    0.8 GiB of NF4 weights, so QLoRA's peak RSS was above fp32 LoRA's. With owning copies the
    mapping closes. k-bit weights (`Params4bit`, `Int8Params`) already own theirs; GPU tensors
    are not views of the file."""
    copied, seen = 0, set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen or param.device.type != "cpu":
                continue
            seen.add(id(param))  # a tied embedding/head is one parameter: copy it once
            if type(param).__name__ not in ("Params4bit", "Int8Params"):
                param.data = param.data.clone()
                copied += 1
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.device.type == "cpu":
                module._buffers[name] = buffer.clone()
                copied += 1
    return copied


def quantized_linear_count(model: torch.nn.Module) -> dict[str, int]:
    """How many bitsandbytes layers a model holds: {"Linear8bitLt": n, "Linear4bit": m}."""
    counts: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name in ("Linear8bitLt", "Linear4bit"):
            counts[name] = counts.get(name, 0) + 1
    return counts


def folder_name(bits: int) -> str:
    """Where `rlhf-lab quantize` saves a model: quantized_int8 / quantized_nf4 (or _fp4)."""
    return {8: "quantized_int8", 4: "quantized_nf4"}[bits]


def keep_backward_through_4bit(model: torch.nn.Module) -> int:
    """Stop bitsandbytes' CPU inference repacking of 4-bit weights; returns the layers changed.

    On a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a `Linear4bit` weight the first time
    the layer runs in eval mode without gradients (e.g. a rollout), and from then on always uses
    its `gemv_4bit` kernel, which has no autograd: in training, no gradient flows back through
    the base layer to its input, so the LoRA weights of every earlier projection get zero
    gradient, silently (found by the QLoRA GRPO test: only o_proj/down_proj adapters moved).
    Training calls this; inference-only loads keep the faster kernel."""
    changed = 0
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed
