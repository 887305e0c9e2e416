"""Configuration of supervised fine-tuning (SFT), loaded from YAML by `rlhf_core.config`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.checkpoint import CheckpointConfig
from rlhf_core.config import RunConfig, StrictModel
from rlhf_core.data import DataSource, check_heldout_seeds
from rlhf_core.encoding import MAX_PROMPT_LENGTH_HELP
from rlhf_core.loop import LoopConfig
from rlhf_core.models import ModelConfig
from rlhf_core.optim import OptimConfig
from rlhf_core.registry import registered_spec
from rlhf_core.tracking import TrackingConfig

LossSpec = registered_spec("instruction_tuning.losses:LOSSES", where="loss")


class SFTDataConfig(StrictModel):
    train: DataSource = Field(
        description="training rows: messages, prompt/completion, or reasoning-gym"
    )
    eval: DataSource | None = Field(None, description="held-out rows for loss and task accuracy")
    format: Literal["auto", "messages", "prompt_completion"] = Field(
        "auto", description="row format; auto = 'messages' if that column exists"
    )
    max_length: int = Field(512, gt=1, description="max prompt + completion tokens")
    max_prompt_length: int | None = Field(None, gt=0, description=MAX_PROMPT_LENGTH_HELP)
    overlong: Literal["truncate", "drop"] = Field(
        "truncate",
        description="a row longer than the length limits: truncate it (counted as truncated) or "
        "drop it (counted as dropped_overlong in the summary)",
    )

    @model_validator(mode="after")
    def _heldout_is_heldout(self) -> SFTDataConfig:
        check_heldout_seeds(self.train, self.eval)
        return self


class SFTTrainConfig(LoopConfig):
    eval_max_new_tokens: int = Field(32, gt=0, description="generation budget for task accuracy")
    eval_sampled: bool = Field(True, description="also report sampled (T=1) exact match")
    packing: bool = Field(
        True,
        description="pack several examples into one row (positions restarting, attention "
        "blocked across examples; rlhf_core.packing) instead of padding each to the batch's "
        "longest; same loss. Applies to causal models with SDPA or eager attention; others "
        "(flash-attention 2, T5) run padded rows",
    )


class SFTConfig(RunConfig):
    name: str = Field(
        "sft", description="run name (the run dir is outputs/instruction_tuning/<name>-<time>)"
    )
    seed: int = Field(0, description="seed for init, data order and sampling")
    model: ModelConfig = Field(description="policy to fine-tune")
    data: SFTDataConfig = Field(description="training and held-out data")
    loss: LossSpec = Field(
        default_factory=lambda: {"name": "nll"},
        description="loss name in instruction_tuning.losses.LOSSES and its keyword arguments",
    )
    train: SFTTrainConfig = Field(default_factory=SFTTrainConfig, description="loop settings")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer and schedule")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="saving")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="logging")
