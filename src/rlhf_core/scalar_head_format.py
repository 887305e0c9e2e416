"""The reward-model directory format: what a scalar-head model (`rlhf_core.scalar_head`) writes
and reads, so that a saved reward, value or segment model scores text as it was trained to.

A saved model is a directory that plain transformers/peft can read:

    config.json + model.safetensors                   the backbone (`AutoModel.from_pretrained`)
    or adapter_config.json + adapter_model.safetensors a peft LoRA adapter on `base_model`
    scalar_head.safetensors                           the head, one tensor "weight" (head_dim, H)
                                                      (+ "likelihood_weight", a scalar, for an
                                                      `lm_likelihood` model)
    scalar_head.json                                  `ScalarHeadInfo`: kind, head_dim, chat
                                                      template, lengths, step separator, segment
                                                      level, pooling, base model, encoder_only,
                                                      plus "format" and "backbone" (full/adapter)
    tokenizer files

The backbone and the tokenizer are written by transformers itself; this module owns the two
`scalar_head.*` files (`write_head_files`, `read_head_info`, `read_head_tensors`). Unknown keys in
`scalar_head.json` are ignored on reading, and fields added later have defaults, so directories
written by older versions still load.

Not here: the model and its forward (`rlhf_core.scalar_head`), the transformers
`...ForSequenceClassification` export and import (`rlhf_core.sequence_classification`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

KINDS = ("preference", "orm", "prm", "segment", "value")
POOLINGS = ("last", "mean", "sum")
HEAD_WEIGHTS = "scalar_head.safetensors"
HEAD_CONFIG = "scalar_head.json"
FORMAT = "rlhf-lab scalar head v1"


@dataclass
class ScalarHeadInfo:
    """What `scalar_head.json` records, so a saved model scores text as it was trained to."""

    kind: str  # one of KINDS
    head_dim: int = 1
    chat_template: str | None = None
    max_length: int = 1024
    max_prompt_length: int | None = None
    step_separator: str | None = None  # PRM: the one-token text that ends every step
    segment_level: str | None = None  # segment: "sentence" or "subsentence"
    base_model: str | None = None  # LoRA: the model the adapter applies to (name_or_path)
    pooling: str = "last"  # preference: one of POOLINGS (the completion's tokens for mean/sum)
    lm_likelihood: bool = False  # preference: each token's score adds w * log p_LM(token)
    encoder_only: bool = False  # a bidirectional encoder backbone (BERT / DeBERTa / Longformer)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"scalar head kind {self.kind!r}: expected one of {KINDS}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"scalar head pooling {self.pooling!r}: expected one of {POOLINGS}")
        if self.pooling != "last" and self.kind != "preference":
            raise ValueError(
                f"scalar head pooling {self.pooling!r} is for preference models only "
                f"(kind {self.kind!r} reads the last token)"
            )
        if self.lm_likelihood and (self.kind != "preference" or self.pooling == "last"):
            raise ValueError(
                "scalar head lm_likelihood is for preference models with pooling mean or sum "
                f"(the completion's log-likelihood); got kind {self.kind!r}, pooling "
                f"{self.pooling!r}"
            )
        if self.lm_likelihood and self.encoder_only:
            raise ValueError(
                "scalar head lm_likelihood reads a causal language model; an encoder backbone "
                "has none"
            )
        if self.head_dim < 1:
            raise ValueError(f"scalar head: head_dim must be >= 1, got {self.head_dim}")
        if self.kind == "prm" and (self.step_separator is None or self.head_dim < 2):
            raise ValueError(
                "scalar head kind 'prm' needs a step_separator and head_dim >= 2 (step classes, "
                f"class 0 = negative); got {self.step_separator!r}, {self.head_dim}"
            )


def is_scalar_head_dir(path: str | Path) -> bool:
    """True if `path` holds a scalar-head model (its `scalar_head.json`)."""
    return (Path(path) / HEAD_CONFIG).is_file()


def write_head_files(
    path: str | Path,
    info: ScalarHeadInfo,
    weight: torch.Tensor,
    *,
    adapter: bool,
    likelihood_weight: torch.Tensor | None = None,
) -> None:
    """Write `scalar_head.safetensors` (the head `weight` (head_dim, H), and the likelihood
    weight if given, float32 on the CPU) and `scalar_head.json` (`info`, the format and whether
    the backbone beside it is a LoRA `adapter` or full weights) into `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {"weight": weight.detach().to("cpu", torch.float32).contiguous()}
    if likelihood_weight is not None:
        tensors["likelihood_weight"] = likelihood_weight.detach().to("cpu", torch.float32)
    save_file(tensors, str(path / HEAD_WEIGHTS))
    meta = {"format": FORMAT, "backbone": "adapter" if adapter else "full"}
    (path / HEAD_CONFIG).write_text(json.dumps({**meta, **asdict(info)}, indent=2) + "\n")


def read_head_info(path: str | Path) -> tuple[ScalarHeadInfo, bool]:
    """(`ScalarHeadInfo`, whether the backbone is a LoRA adapter) from `path/scalar_head.json`;
    an adapter model must name its base model."""
    file = Path(path) / HEAD_CONFIG
    raw = json.loads(file.read_text())
    known = {f.name for f in fields(ScalarHeadInfo)}
    info = ScalarHeadInfo(**{k: v for k, v in raw.items() if k in known})
    adapter = raw.get("backbone") == "adapter"
    if adapter and info.base_model is None:
        raise ValueError(f"{file}: an adapter model must name its base_model")
    return info, adapter


def read_head_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of `path/scalar_head.safetensors`: "weight" (head_dim, H), and for an
    `lm_likelihood` model "likelihood_weight"."""
    from safetensors.torch import load_file

    file = Path(path) / HEAD_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"no scalar head weights at {file}")
    return load_file(str(file))
