"""What the `cuda` tests share: the device they run on, the skip reason where there is none, and
the Qwen3-0.6B-shaped model directory the trainers load (random init, built from the config in
`benchmarks.gpu`; nothing downloaded).

On a CPU-only machine every `cuda` test skips with `NO_CUDA`. `RLHF_CUDA_TESTS_ON_CPU=1` runs
them on the CPU instead, at the tiny shape of `benchmarks.gpu.SMOKE`: a check of the tests'
own code before a GPU is lent, not a result (docs/gpu_proof.md)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ON_CPU = os.environ.get("RLHF_CUDA_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
NO_CUDA = (
    "needs a CUDA device (torch.cuda.is_available() is False); run on a GPU machine with "
    "`bash scripts/gpu_proof.sh` (or RLHF_CUDA_TESTS_ON_CPU=1 to check the tests on the CPU)"
)
needs_cuda = pytest.mark.skipif(not (HAS_CUDA or ON_CPU), reason=NO_CUDA)
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
#: the training tests' model: Qwen3-0.6B's shape on a GPU, the smoke shape on the CPU check
SHAPE = "qwen3-0.6b" if HAS_CUDA else "smoke"


def benchmarks_gpu():
    """`benchmarks/gpu.py` loaded from its file (the repository root is not on sys.path under
    pytest): the model shapes live there once."""
    import importlib.util
    import sys

    if "benchmarks.gpu" in sys.modules:
        return sys.modules["benchmarks.gpu"]
    spec = importlib.util.spec_from_file_location("_gpu_bench", REPO / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def model_spec() -> dict:
    gpu = benchmarks_gpu()
    return gpu.QWEN3_0P6B if SHAPE == "qwen3-0.6b" else gpu.SMOKE


def build_causal_lm_dir(target: Path) -> Path:
    """A Hugging Face directory: a Qwen3 causal LM of `model_spec()`'s shape (seeded random
    init, bf16) with the vendored GPT-2 tokenizer (50,257 ids inside the model's vocabulary;
    no pad token and no chat template, as the `tiny-qwen3-gpt2` preset). bos/eos are the
    tokenizer's end of text, so generation stops where the tokenizer says."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.tiny import preset_dir

    tokenizer = AutoTokenizer.from_pretrained(preset_dir("tiny-qwen3-gpt2"))
    spec = {k: v for k, v in model_spec().items() if k != "architectures"}
    spec["vocab_size"] = max(spec["vocab_size"], len(tokenizer))
    spec.update(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def finite(values) -> bool:
    return all(math.isfinite(float(v)) for v in values)
