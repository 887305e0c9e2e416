"""A scalar-head reward model as a transformers `...ForSequenceClassification` directory, and back.

    export_sequence_classification(model, out_dir)   write one: num_labels = head_dim, `score` =
                                                     the head, a LoRA adapter merged in,
                                                     pad_token_id set, the tokenizer beside it
    check_sequence_classification_export(tokenizer)  the refusal trainers raise before training
    load_sequence_classification(path, ...)          read one back as the parts of a preference
                                                     scalar-head model (backbone, info, tokenizer,
                                                     head weight)

transformers' sequence classifiers of decoder-only models (Llama, Qwen, GPT-2 ...) read the
score head at each row's last token that is not pad. Our sequences end with eos, so a tokenizer
whose pad token is its eos cannot be exported faithfully (the classifier would read the token
before the final eos): that is refused, and `model.pad_token` (`rlhf_core.models.ModelConfig`)
gives such a model a distinct pad token before training. Only last-token (`pooling: last`),
causal-backbone preference models export; their exported scores equal `score` (tested).

Not here: the scalar-head directory format (`rlhf_core.scalar_head_format`), the model
(`rlhf_core.scalar_head`), encoder classifiers (BERT-style `...ForSequenceClassification` pools
the first token through a pooler layer, which a scalar head has no counterpart of).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from rlhf_core.errors import UserError
from rlhf_core.models import (
    ModelConfig,
    is_peft_model,
    load_tokenizer,
    resolve_attention,
    resolve_dtype,
)
from rlhf_core.quantization import (
    QuantizationConfig,
    quantized_load_kwargs,
    release_checkpoint_pages,
)
from rlhf_core.scalar_head_format import HEAD_CONFIG, ScalarHeadInfo


def check_sequence_classification_export(tokenizer: Any, *, where: str = "") -> None:
    """Raise UserError if `tokenizer` cannot give a faithful sequence-classification export (no
    pad token, or pad = eos); trainers call this before their first step."""
    prefix = f"{where}: " if where else ""
    if tokenizer is None or tokenizer.pad_token_id is None:
        raise UserError(
            f"{prefix}export_sequence_classification needs a tokenizer with a pad token"
        )
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise UserError(
            f"{prefix}export_sequence_classification: the tokenizer's pad token is its eos token "
            f"(pad = eos = {tokenizer.eos_token!r}); transformers' sequence classifiers pool at "
            "the last non-pad token, which would be the token before each sequence's final eos. "
            "Set model.pad_token (e.g. '<|pad|>': a distinct pad token is added and the "
            "embeddings resized), use a tokenizer with a distinct pad token, or set "
            "train.export_sequence_classification: false (the reward model directory itself is "
            "unaffected)."
        )


def export_sequence_classification(
    model: nn.Module, out_dir: str | Path, *, tokenizer: Any = None
) -> Path:
    """Write the scalar-head `model` (`rlhf_core.scalar_head.ScalarHeadModel`) as a transformers
    `...ForSequenceClassification` directory with its tokenizer; see the module docstring."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    check_sequence_classification_export(tokenizer)
    if model.info.pooling != "last":
        raise UserError(
            f"export_sequence_classification: this reward model pools {model.info.pooling!r} "
            "over the completion's tokens; transformers' sequence classifiers read the last "
            "token only, so the export would score differently. Use pooling: last to export."
        )
    if model.info.encoder_only:
        raise UserError(
            "export_sequence_classification: an encoder's sequence classifier (BERT / DeBERTa / "
            "Longformer) reads the first token through a pooler layer, not the last token as "
            "this reward model does; the export would score differently"
        )
    backbone = model.backbone
    if is_peft_model(backbone):
        backbone = copy.deepcopy(backbone).merge_and_unload()
    config = copy.deepcopy(backbone.config)
    config.num_labels = model.info.head_dim
    config.pad_token_id = tokenizer.pad_token_id
    config.get_text_config().pad_token_id = tokenizer.pad_token_id
    config.architectures = None
    dtype = next(backbone.parameters()).dtype
    seq = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    getattr(seq, seq.base_model_prefix).load_state_dict(backbone.state_dict())
    with torch.no_grad():
        seq.score.weight.copy_(model.head.weight.to(dtype))
    out_dir = Path(out_dir)
    seq.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_sequence_classification(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto",
    attention: Literal["auto", "flash_attention_2", "sdpa", "eager"] = "auto",
    quantization: QuantizationConfig | None = None,
) -> tuple[nn.Module, ScalarHeadInfo, Any, torch.Tensor]:
    """(backbone, info, tokenizer, head weight (num_labels, H)) of the transformers
    `...ForSequenceClassification` directory `path`, as a preference model reading the last
    token; `quantization` loads the backbone in k bits (the score head stays full precision)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path))
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        raise UserError(
            f"{path}: neither a scalar-head directory (no {HEAD_CONFIG}) nor a "
            f"...ForSequenceClassification model (architectures: {config.architectures}); "
            "give a reward model saved by reward_models"
        )
    cfg = ModelConfig(name_or_path=str(path), dtype=dtype, attention=attention)
    device = torch.device(device)
    if quantization is not None:  # the score head stays in full precision
        quantization = quantization.model_copy(update={"skip_modules": ["score"]})
    torch_dtype = resolve_dtype(cfg, device)
    seq = AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch_dtype, attn_implementation=resolve_attention(cfg, device),
        **quantized_load_kwargs(quantization, torch_dtype, device),
    )  # fmt: skip
    if not getattr(seq, "is_quantized", False):
        seq = seq.to(device)
    else:  # its full-precision tensors out of the checkpoint's file mapping (CPU)
        release_checkpoint_pages(seq)
    score = getattr(seq, "score", None)
    if not isinstance(score, nn.Linear):
        raise ValueError(
            f"{path}: {type(seq).__name__} has no linear `score` head read at the last token "
            "(an encoder classifier pools its first token instead); not supported"
        )
    if score.bias is not None:
        raise ValueError(f"{path}: a score head with a bias is not supported")
    tokenizer = load_tokenizer(cfg, padding_side="right")
    info = ScalarHeadInfo(
        kind="preference", head_dim=seq.config.num_labels,
        chat_template=tokenizer.chat_template, max_length=tokenizer.model_max_length,
    )  # fmt: skip
    return getattr(seq, seq.base_model_prefix), info, tokenizer, score.weight.detach()
