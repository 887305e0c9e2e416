"""Configuration of reward-model training (preference / ORM / PRM), loaded from YAML.

The loss is named with its keyword arguments, `loss: {name: bradley_terry, centering_eta: 0.01}`;
the spec is checked against the registered class's signature and the resolved config shows every
value. The loss decides the model kind (and so the data format and head size): `bradley_terry`
trains a preference model, `orm_bce` an outcome model, `prm_ce` a process model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reward_models.losses import LOSSES
from rlhf_core.bookkeeping import TrainerConfig, run_name
from rlhf_core.config import StrictModel
from rlhf_core.data import DataSource, TextDataConfig
from rlhf_core.encoding import MAX_PROMPT_LENGTH_HELP
from rlhf_core.errors import UserError
from rlhf_core.loop import LoopConfig
from rlhf_core.models import ModelConfig
from rlhf_core.preference import PREFERENCE_FORMATS
from rlhf_core.registry import registered_spec

FORMAT_NAMES = Literal[
    "auto", "preference", "ultrafeedback", "hh", "orm", "prm", "prm800k", "gsm8k", "segments"
]
# the formats each model kind reads (reward_models.data)
FORMATS = {
    "preference": PREFERENCE_FORMATS,
    "orm": ("auto", "orm", "gsm8k"),
    "prm": ("auto", "prm", "prm800k", "gsm8k"),
    "segment": ("auto", "segments"),
}


LossSpec = registered_spec("reward_models.losses:LOSSES", where="loss")


class BuilderConfig(StrictModel):
    """Options of `reward_models.build_data` when rows are built on the fly from a GSM8K file or
    a reasoning-gym task (the same as the command-line builder's)."""

    wrong: int = Field(3, ge=1, description="ORM: wrong answers per question")
    wrong_kinds: list[Literal["reverse", "swap", "replace", "other"]] = Field(
        default_factory=lambda: ["reverse", "swap", "replace", "other"],
        min_length=1,
        description="reasoning-gym text answers: how wrong answers are made (reversed, two "
        "neighbours swapped, one letter replaced, another example's answer)",
    )
    corruption: Literal["arithmetic", "copy"] = Field(
        "arithmetic",
        description="PRM (GSM8K): arithmetic = a calculation's result is wrong; copy = the stated "
        "result contradicts the step's own calculator annotation",
    )
    after_error: Literal["drop", "negative"] = Field(
        "drop", description="PRM: steps after the corrupted one: drop (PRM800K) or label -1"
    )
    gold: bool = Field(True, description="PRM: also include each all-correct reference solution")
    seed: int = Field(0, description="seed of the builder's random choices")


class RMDataConfig(TextDataConfig):
    train: DataSource = Field(description="training rows (file, hub id, or reasoning-gym)")
    eval: DataSource | None = Field(None, description="held-out rows")
    format: FORMAT_NAMES = Field(
        "auto",
        description="row format (see reward_models.data); auto = chosen from the columns; must "
        "suit the loss's kind",
    )
    max_length: int = Field(1024, gt=2, description="max prompt + completion tokens")
    max_prompt_length: int | None = Field(None, gt=0, description=MAX_PROMPT_LENGTH_HELP)
    strip_thinking: bool = Field(
        True,
        description="preference and ORM rows: remove <think>...</think> blocks from completions "
        "before training (counted as stripped_thinking), as RL's rewards strip them before "
        "scoring (policy_gradients strip_thinking), so the model learns to score the answer",
    )
    margin_column: str | list[str] | None = Field(
        None,
        description="preference margins (loss use_margin): a numeric column, or [a, b] for "
        "row[a] - row[b], e.g. [score_chosen, score_rejected]",
    )
    step_separator: str = Field(
        "\n", description="PRM: the one-token text after every step, where steps are scored"
    )
    segment_level: Literal["sentence", "subsentence"] = Field(
        "sentence",
        description="segment model (loss segment_ce): score each sentence or each sub-sentence "
        "(rlhf_core.segmentation); a row's labels must count that many segments",
    )
    neutral_label: Literal["positive", "negative"] = Field(
        "positive", description="PRM with 2 classes: what a PRM800K 0 (neutral) rating becomes"
    )
    builder: BuilderConfig = Field(
        default_factory=BuilderConfig, description="options of the on-the-fly data builders"
    )

    @model_validator(mode="after")
    def _margin_columns(self) -> RMDataConfig:
        if isinstance(self.margin_column, list) and len(self.margin_column) != 2:
            raise UserError("data.margin_column: a list must name exactly two columns [a, b]")
        return self


class RMTrainConfig(LoopConfig):
    export_sequence_classification: bool = Field(
        False,
        description="preference: also write <run_dir>/final-seqcls, a transformers "
        "AutoModelForSequenceClassification directory",
    )
    share_prompt: bool = Field(
        True,
        description="preference: encode each pair's prompt once for both completions, as one "
        "packed row [prompt | chosen | rejected] with a 4D mask (SDPA/eager) or through the KV "
        "cache (flash-attention 2; not with gradient checkpointing); same rewards, ~1/3 fewer "
        "tokens on HH",
    )
    sparse_embedding_grad: bool | None = Field(
        None,
        description="accumulate the input embedding's gradient from sparse row updates into one "
        "persistent dense buffer instead of a fresh dense (vocab, hidden) gradient per backward "
        "(same gradient; rlhf_core.optim.EmbeddingGradBuffer); null = on for one CPU process",
    )


class RMConfig(TrainerConfig):
    name: str = run_name("reward_model")
    model: ModelConfig = Field(description="the backbone: tiny preset, local dir or hub id")
    freeze_backbone: bool = Field(False, description="train the head only (not with LoRA)")
    encoder_only: bool = Field(
        False,
        description="the backbone is a bidirectional encoder (BERT / DeBERTa / Longformer "
        "family: a ...ForTokenClassification, ...ForSequenceClassification or ...ForMaskedLM "
        "checkpoint's encoder, or an encoder-decoder checkpoint's encoder such as a T5 "
        "policy's), so each token's score reads the whole sequence; recorded in "
        "scalar_head.json. Preference models need train.share_prompt: false",
    )
    pooling: Literal["last", "mean", "sum"] = Field(
        "last",
        description="preference: which of the head's per-token scores make the reward: the last "
        "token's (eos; what transformers' sequence classifiers read), or the mean or the sum "
        "over the completion's tokens (a token-level reward pooled; the prompt never counts). "
        "Recorded in scalar_head.json, so `score` and the RL rewards pool the same way",
    )
    lm_likelihood: float | None = Field(
        None,
        description="preference, pooling mean or sum: each completion token's score also adds "
        "w * log p(token | prompt, earlier tokens) under the backbone's own language model (its "
        "hidden state before the token through its tied input embeddings), w a learned scalar "
        "starting at this value; the reward then holds w * the completion's summed (or mean) "
        "log-likelihood. Initialised from an SFT policy it starts as that policy's likelihood, "
        "so RL against it also sharpens the policy toward its SFT modes. null = off",
    )
    data: RMDataConfig = Field(description="training and held-out rows")
    loss: LossSpec = Field(
        default_factory=lambda: {"name": "bradley_terry"},
        description="loss name in reward_models.losses.LOSSES and its keyword arguments",
    )
    train: RMTrainConfig = Field(default_factory=RMTrainConfig, description="loop settings")

    @property
    def kind(self) -> str:
        return LOSSES.get(self.loss["name"]).kind

    @model_validator(mode="after")
    def _consistent(self) -> RMConfig:
        kind = self.kind
        if self.data.format not in FORMATS[kind]:
            raise UserError(
                f"data.format {self.data.format!r} does not suit loss {self.loss['name']!r} "
                f"(a {kind} model); allowed: {', '.join(FORMATS[kind])}"
            )
        use_margin = bool(self.loss.get("use_margin"))
        if use_margin != (self.data.margin_column is not None):
            raise UserError(
                "loss.use_margin needs data.margin_column, and data.margin_column is only read "
                f"with loss.use_margin (got use_margin={use_margin}, "
                f"margin_column={self.data.margin_column!r})"
            )
        if self.freeze_backbone and self.model.lora is not None:
            raise UserError("freeze_backbone with model.lora: choose one (LoRA freezes the base)")
        if self.train.export_sequence_classification and kind != "preference":
            raise UserError("train.export_sequence_classification is for preference models only")
        if self.pooling != "last" and kind != "preference":
            raise UserError(
                f"pooling {self.pooling!r} is for preference models (loss bradley_terry); a "
                f"{kind} model reads its scores where its labels are"
            )
        if self.lm_likelihood is not None and self.pooling == "last":
            raise UserError(
                "lm_likelihood needs pooling: mean or sum (it adds each completion token's "
                "log-likelihood to that token's score; the last token alone is one token's)"
            )
        if self.encoder_only and (
            self.lm_likelihood is not None
            or (
                kind == "preference"
                and (self.train.share_prompt or self.train.export_sequence_classification)
            )
        ):
            raise UserError(
                "encoder_only: an encoder's tokens see the whole row, so a preference pair "
                "cannot share its prompt (set train.share_prompt: false); it has no causal LM "
                "(lm_likelihood) and no last-token sequence classifier to export to "
                "(train.export_sequence_classification: false)"
            )  # fmt: skip
        if self.pooling != "last" and self.train.export_sequence_classification:
            raise UserError(
                f"pooling {self.pooling!r} with train.export_sequence_classification: "
                "transformers' sequence classifiers read the last token only, so the export "
                "would score differently; use pooling: last or turn the export off"
            )
        return self
