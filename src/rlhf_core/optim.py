"""Optimizer and learning-rate schedule shared by every trainer.

AdamW with decoupled weight decay on matrices only (biases, norms and embeddings' 1-D params get
none); torch's fused kernel on CPU and CUDA. Schedules: linear warmup to the peak, then cosine or
linear decay to `min_lr_ratio x lr`, or constant.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch.optim.lr_scheduler import LambdaLR

from rlhf_core.config import StrictModel


class OptimConfig(StrictModel):
    lr: float = Field(1e-5, gt=0, description="peak learning rate")
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW decoupled weight decay (matrices only)"
    )
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: float | None = Field(
        1.0, description="clip the global grad norm; null = no clip"
    )
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay shape")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr as a fraction of the peak")


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # the fused kernel exists for CUDA and (torch >= 2.4) CPU: ~6x faster optimizer step on CPU
    params = decay + no_decay
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
