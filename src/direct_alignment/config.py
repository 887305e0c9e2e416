"""Configuration of direct alignment (DPO family) training, loaded from YAML.

The loss is named with its keyword arguments, `loss: {name: dpo, beta: 0.1}`; the spec is
checked against the registered class's signature and the resolved config shows every value
(defaults filled in).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.bookkeeping import TrainerConfig, run_name
from rlhf_core.data import DataSource, TextDataConfig
from rlhf_core.errors import UserError
from rlhf_core.loop import LoopConfig
from rlhf_core.models import ModelConfig, ReferenceConfig
from rlhf_core.registry import registered_spec

LossSpec = registered_spec("direct_alignment.losses:LOSSES", where="loss")


class PreferenceDataConfig(TextDataConfig):
    train: DataSource = Field(description="training pairs (file, hub id, or reasoning-gym)")
    eval: DataSource | None = Field(None, description="held-out pairs")
    format: Literal["auto", "preference", "hh", "ultrafeedback", "unpaired"] = Field(
        "auto",
        description="row format; auto = preference if a 'prompt' column exists, else hh; "
        "unpaired = {prompt, completion, label} rows for the kto_unpaired loss",
    )


class DATrainConfig(LoopConfig):
    samples_every: int = Field(0, ge=0, description="write sampled generations every k steps")
    num_samples: int = Field(4, ge=0, description="held-out prompts to sample each time")
    sample_max_new_tokens: int = Field(64, gt=0, description="length budget of those samples")
    packing: bool = Field(
        True,
        description="run each pair as one packed row segment [prompt | chosen | rejected] with a "
        "4D mask, the prompt encoded once for both completions and short pairs sharing a row "
        "(rlhf_core.layout; same log-probs); on CPU with SDPA a step's pairs share rows with no "
        "padding and attention runs pair by pair. Applies to causal models with SDPA or eager "
        "attention; under flash attention every completion with its prompt shares one row, "
        "told apart by position ids (varlen: no padding, the prompt encoded per completion); "
        "others (T5) run unpacked 2B rows",
    )


class DAConfig(TrainerConfig):
    name: str = run_name("dpo")
    model: ModelConfig | None = Field(None, description="the policy (and reference) to start from")
    models: list[ModelConfig] = Field(
        default_factory=list,
        description="several policies trained one after another, each in its own run dir",
    )
    data: PreferenceDataConfig = Field(description="training and held-out pairs")
    loss: LossSpec = Field(
        default_factory=lambda: {"name": "dpo"},
        description="loss name in direct_alignment.losses.LOSSES and its keyword arguments",
    )
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig, description="pi_ref")
    train: DATrainConfig = Field(default_factory=DATrainConfig, description="loop settings")

    @model_validator(mode="after")
    def _unpaired_loss_reads_unpaired_data(self) -> DAConfig:
        from direct_alignment.losses import LOSSES

        unpaired_loss = LOSSES.get(self.loss["name"]).unpaired
        if unpaired_loss != (self.data.format == "unpaired"):
            raise UserError(
                f"loss {self.loss['name']!r} reads "
                f"{'unpaired rows' if unpaired_loss else 'preference pairs'} but data.format is "
                f"{self.data.format!r}: use data.format 'unpaired' with loss 'kto_unpaired' "
                "(rows {prompt, completion, label}), or a pair format with a pairwise loss "
                "('kto' is KTO on pairs)"
            )
        if self.data.format == "unpaired" and self.data.overlong == "drop":
            raise ValueError("data.overlong 'drop' is for pairs; unpaired rows are truncated")
        return self

    @model_validator(mode="after")
    def _one_model_source(self) -> DAConfig:
        if (self.model is None) == (not self.models):
            raise UserError("give exactly one of 'model' (one policy) or 'models' (a list)")
        self.reference.check([self.model] if self.model else self.models, precomputed_ok=True)
        return self
