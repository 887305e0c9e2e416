"""Configuration of supervised fine-tuning (SFT), loaded from YAML by `rlhf_core.config`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.checkpoint import CheckpointConfig
from rlhf_core.config import StrictModel
from rlhf_core.data import DataSource, check_heldout_seeds
from rlhf_core.models import ModelConfig
from rlhf_core.optim import OptimConfig
from rlhf_core.tracking import TrackingConfig


class SFTDataConfig(StrictModel):
    train: DataSource = Field(
        description="training rows: messages, prompt/completion, or reasoning-gym"
    )
    eval: DataSource | None = Field(None, description="held-out rows for loss and task accuracy")
    format: Literal["auto", "messages", "prompt_completion"] = Field(
        "auto", description="row format; auto = 'messages' if that column exists"
    )
    max_length: int = Field(512, gt=1, description="max prompt + completion tokens")
    max_prompt_length: int | None = Field(
        None, gt=0, description="cut prompts to their last N tokens; null = max_length - completion"
    )

    @model_validator(mode="after")
    def _heldout_is_heldout(self) -> SFTDataConfig:
        check_heldout_seeds(self.train, self.eval)
        return self


class SFTTrainConfig(StrictModel):
    batch_size: int = Field(32, gt=0, description="sequences per optimizer step (global)")
    micro_batch_size: int | None = Field(
        None, gt=0, description="sequences per forward (gradient accumulation); null = batch_size"
    )
    max_steps: int | None = Field(None, gt=0, description="optimizer steps; null = from epochs")
    epochs: float = Field(1.0, gt=0, description="passes over the data when max_steps is null")
    eval_every: int = Field(
        0, ge=0, description="evaluate every k steps (and at the end); 0 = end only"
    )
    eval_size: int | None = Field(None, gt=0, description="held-out rows to evaluate; null = all")
    eval_max_new_tokens: int = Field(32, gt=0, description="generation budget for task accuracy")
    eval_sampled: bool = Field(True, description="also report sampled (T=1) exact match")
    loss: str = Field("nll", description="loss name in instruction_tuning.losses.LOSSES")
    threads: int | None = Field(None, gt=0, description="CPU threads; null = free cores")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if available")

    @model_validator(mode="after")
    def _micro_divides(self) -> SFTTrainConfig:
        micro = self.micro_batch_size or self.batch_size
        if self.batch_size % micro:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must be a multiple of "
                f"train.micro_batch_size ({micro})"
            )
        return self


class SFTConfig(StrictModel):
    name: str = Field(
        "sft", description="run name (the run dir is outputs/instruction_tuning/<name>-<time>)"
    )
    seed: int = Field(0, description="seed for init, data order and sampling")
    model: ModelConfig = Field(description="policy to fine-tune")
    data: SFTDataConfig = Field(description="training and held-out data")
    train: SFTTrainConfig = Field(default_factory=SFTTrainConfig, description="loop settings")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer and schedule")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="saving")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="logging")
