"""Memory of LoRA on an fp32 base vs QLoRA on an NF4 base, on the CPU, load and training apart.

A model with Qwen3-0.6B's shape (its widths, 151,936-token vocabulary, tied embedding and, by
default, all 28 layers; random weights) is built once into /tmp. Each mode then runs in a fresh
process: it loads the model through `rlhf_core.models.load_policy` with LoRA r=16 on every linear
layer of the blocks, and runs `--steps` AdamW steps on 2 x 128 tokens. Printed per mode:

  weights       `get_memory_footprint()`: the model's parameters and buffers as loaded
  load peak     the process's peak RSS up to the end of loading (includes the checkpoint's
                file pages while they are read, and the fp32 tensors before quantisation)
  train peak    the peak RSS over the training steps alone (the high-water mark is reset after
                loading, `/proc/self/clear_refs`), what a long run holds
  step s        seconds per training step (the first step excluded)

    uv run python benchmarks/qlora_memory.py build [--layers 28]
    uv run python benchmarks/qlora_memory.py fp32
    uv run python benchmarks/qlora_memory.py nf4
    uv run python benchmarks/qlora_memory.py both     # the two modes, one process each

The 4-bit weights are bitsandbytes' (`Linear4bit`, NF4 with double quantisation); on CPU each
forward dequantises one layer's weight at a time, so the saving is the blocks' linear weights
(the embedding stays fp32: bitsandbytes does not quantise `nn.Embedding`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

MODEL = Path("/tmp/qwen3_0p6b_shape")


def build(layers: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(MODEL / f"layers{layers}")


def measure(mode: str, layers: int, steps: int) -> dict[str, float]:
    """Load and train in this process; returns the figures (MiB and seconds)."""
    warnings.filterwarnings("ignore")
    import torch

    from benchmarks.measure import peak_rss_mb, reset_peak_rss
    from rlhf_core.models import ModelConfig, load_policy

    quantization = {"bits": 4} if mode == "nf4" else None
    cfg = ModelConfig(
        name_or_path=str(MODEL / f"layers{layers}"), lora={"r": 16}, quantization=quantization
    )
    model = load_policy(cfg)
    weights = model.get_memory_footprint() / 2**20
    load_peak = peak_rss_mb()
    if not reset_peak_rss():
        raise RuntimeError("this kernel does not let the RSS high-water mark be reset")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        x = torch.randint(0, 151936, (2, 128), generator=generator)
        t0 = time.perf_counter()
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {
        "weights_mb": weights, "load_peak_mb": load_peak, "train_peak_mb": peak_rss_mb(),
        "step_s": sum(times[1:]) / max(1, len(times) - 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["build", "fp32", "nf4", "both"])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.mode == "build":
        build(args.layers)
        return
    modes = ["fp32", "nf4"] if args.mode == "both" else [args.mode]
    results = {}
    for mode in modes:
        if args.mode == "both":  # a fresh process per mode: peaks do not carry over
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.qlora_memory", mode, "--layers",
                 str(args.layers), "--steps", str(args.steps)],
                check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            results[mode] = json.loads(out.strip().splitlines()[-1])
        else:
            results[mode] = measure(mode, args.layers, args.steps)
            print(json.dumps(results[mode]))
    if args.mode == "both":
        print(f"Qwen3-0.6B shape, {args.layers} layers, LoRA r=16, {args.steps} steps of 2 x 128")
        print("| mode | weights MiB | load peak MiB | train peak MiB | step s |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for mode, r in results.items():
            print(
                f"| {mode} | {r['weights_mb']:.0f} | {r['load_peak_mb']:.0f} | "
                f"{r['train_peak_mb']:.0f} | {r['step_s']:.2f} |"
            )
        f, q = results["fp32"], results["nf4"]
        print(
            f"nf4 / fp32: weights {q['weights_mb'] / f['weights_mb']:.2f}, train peak "
            f"{q['train_peak_mb'] / f['train_peak_mb']:.2f}, step time "
            f"{q['step_s'] / f['step_s']:.2f}"
        )


if __name__ == "__main__":
    main()
