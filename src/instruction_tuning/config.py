"""Configuration of supervised fine-tuning (SFT), loaded from YAML by `rlhf_core.config`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_core.bookkeeping import TrainerConfig, run_name
from rlhf_core.data import DataSource, TextDataConfig
from rlhf_core.loop import LoopConfig
from rlhf_core.models import ModelConfig
from rlhf_core.registry import registered_spec

LossSpec = registered_spec("instruction_tuning.losses:LOSSES", where="loss")


class SFTDataConfig(TextDataConfig):
    train: DataSource = Field(
        description="training rows: messages, prompt/completion, or reasoning-gym"
    )
    eval: DataSource | None = Field(None, description="held-out rows for loss and task accuracy")
    format: Literal["auto", "messages", "prompt_completion"] = Field(
        "auto",
        description="row format; auto = detected per row (rlhf_core.columns: prompt + "
        "completion, else messages)",
    )
    max_length: int = Field(512, gt=1, description="max prompt + completion tokens")


class SFTTrainConfig(LoopConfig):
    eval_max_new_tokens: int = Field(32, gt=0, description="generation budget for task accuracy")
    eval_sampled: bool = Field(True, description="also report sampled (T=1) exact match")
    packing: bool = Field(
        True,
        description="pack several examples into one row (positions restarting, attention "
        "blocked across examples; rlhf_core.layout) instead of padding each to the batch's "
        "longest; same loss. Causal models with SDPA or eager attention take a 4D mask; "
        "under flash attention all of a micro-batch's examples share one row, told apart by "
        "their position ids (varlen); others (T5) run padded rows",
    )


class SFTConfig(TrainerConfig):
    name: str = run_name("sft")
    model: ModelConfig = Field(description="policy to fine-tune")
    data: SFTDataConfig = Field(description="training and held-out data")
    loss: LossSpec = Field(
        default_factory=lambda: {"name": "nll"},
        description="loss name in instruction_tuning.losses.LOSSES and its keyword arguments",
    )
    train: SFTTrainConfig = Field(default_factory=SFTTrainConfig, description="loop settings")
