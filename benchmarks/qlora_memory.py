"""Memory of LoRA on an fp32 base vs QLoRA on an NF4 base, on the CPU.

A Qwen3-shaped model (Qwen3-0.6B's widths and vocabulary, 8 of its 28 layers, random weights) is
built once into /tmp; each mode then loads it through rlhf_core.models with LoRA r=16 and runs
one AdamW step on 2 x 128 tokens, printing the weights' memory and the process's peak RSS.

    uv run python benchmarks/qlora_memory.py build
    uv run python benchmarks/qlora_memory.py fp32
    uv run python benchmarks/qlora_memory.py nf4
"""

from __future__ import annotations

import resource
import sys
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from rlhf_core.models import ModelConfig, load_policy

MODEL = Path("/tmp/qwen3_0p6b_widths_8_layers")


def main(mode: str) -> None:
    warnings.filterwarnings("ignore")
    if mode == "build":
        cfg = Qwen3Config(
            hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        )  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(MODEL)
        return
    cfg = ModelConfig(name_or_path=str(MODEL), lora={"r": 16})
    if mode == "nf4":
        cfg = ModelConfig(name_or_path=str(MODEL), lora={"r": 16}, quantization={"bits": 4})
    model = load_policy(cfg)
    weights = model.get_memory_footprint()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randint(0, 151936, (2, 128))
    model(x, labels=x).loss.backward()
    opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{mode}: weights {weights / 2**20:.0f} MiB, peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1])
