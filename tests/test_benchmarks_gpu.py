"""`python -m benchmarks.gpu` on a machine without CUDA refuses with a message (it used to start
a 0.6B-parameter model on the CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, run_module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only machines")
def test_gpu_benchmark_refuses_without_cuda():
    result = run_module("benchmarks.gpu", cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no CUDA device" in result.stderr and "--smoke" in result.stderr
