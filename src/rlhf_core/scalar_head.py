"""Scalar-head models: a transformer backbone plus a linear head that scores every token.

`ScalarHeadModel` serves every model that maps a token sequence to scores instead of next-token
logits: the reward models of `reward_models` (preference, outcome, process, segment) and PPO's
value model. `policy_gradients` loads a trained reward model from its directory through this
module, so it never imports `reward_models`.

    model(input_ids, attention_mask)          -> scores (B, T, head_dim), one per token
    model.score(prompts, completions)         -> (B,) one reward per row (the text methods and
                                                 pooling: `rlhf_core.scalar_head_scoring`)

The backbone is a base model (`AutoModel`: no LM head), loaded per `ModelConfig` (tiny preset,
local directory or hub id; dtype; attention; LoRA; gradient checkpointing; `pad_token`), and may
be frozen so only the head trains. It is a causal LM's (Qwen, Llama, GPT-2 ...), an
encoder-decoder's (T5: the encoder reads the prompt, the decoder positions are scored; with
`share_encoder`, another model's encoder reads it, e.g. the PPO policy's), or, with
`info.encoder_only`, a bidirectional encoder's (BERT / DeBERTa / Longformer family; a
`...ForTokenClassification`, `...ForSequenceClassification` or `...ForMaskedLM` checkpoint's
encoder; its pooler, unused by a per-token head, is dropped; or an encoder-decoder checkpoint's
encoder alone, e.g. a T5 policy's as `T5EncoderModel`): every token's score then reads the
whole sequence, as in Fine-Grained RLHF's Longformer token classifiers. The head is
`nn.Linear(hidden, head_dim, bias=False)` with N(0, 0.02^2) init, kept in float32 (hidden states
are upcast before it); it has no bias so that it is exactly transformers'
`...ForSequenceClassification.score`. A causal backbone's position ids are derived from the
attention mask, so a sequence scores the same under left padding, right padding or none; an
encoder's come from the model itself (rows are right-padded).

The saved directory and `scalar_head.json` are `rlhf_core.scalar_head_format`;
`ScalarHeadModel.from_pretrained(dir)` loads that, or a transformers `...ForSequenceClassification`
directory (as kind "preference"; `rlhf_core.sequence_classification`, which also exports one).

Text is scored exactly as it was trained on (the chat template, the truncation lengths and the
step separator recorded in `scalar_head.json`). What `score` returns per row:

    preference, value   the head's scalar at the last token; a preference model trained with
                        `pooling: mean` or `sum` reads the mean or the sum of the head's
                        scalars over the completion tokens (eos included) instead; with
                        `lm_likelihood` each token's score also adds w * log p(token | what
                        precedes it) under the backbone's tied LM head (`rlhf_core.lm_likelihood`)
    orm                 P(correct) = sigmoid(the logit at the last token)
    prm                 min (or prod, or last) over steps of P(step is not an error), where
                        P(not an error) = 1 - softmax(step logits)[0] (class 0 = negative)
    segment             no single reward: `segment_scores` gives the class logits at the token
                        that ends each sentence or sub-sentence (`rlhf_core.segmentation`;
                        class 0 = no error), Fine-Grained RLHF's token-level reward models

Not here: losses (each package owns its own), the packed-rows and shared-prefix forwards of
reward-model training (`reward_models.models`), text encoding (`rlhf_core.encoding`),
multi-objective heads beyond `pooled_scores`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from rlhf_core.checkpoint import is_sharded_checkpoint
from rlhf_core.lm_likelihood import add_lm_likelihood, check_tied_lm_head, previous_positions
from rlhf_core.models import (
    ModelConfig,
    apply_lora,
    is_peft_model,
    load_pretrained,
    load_tokenizer,
    resolve_model_path,
)
from rlhf_core.quantization import QuantizationConfig
from rlhf_core.scalar_head_format import (
    ScalarHeadInfo,
    is_scalar_head_dir,
    read_head_info,
    read_head_tensors,
    write_head_files,
)
from rlhf_core.scalar_head_scoring import TextScoring
from rlhf_core.sequence_classification import load_sequence_classification

HEAD_INIT_STD = 0.02


# ----------------------------------------------------------------------------- the model


def load_backbone(
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    *,
    weights_from: str | Path | None = None,
    encoder_only: bool = False,
) -> nn.Module:
    """The base model (`AutoModel`: no LM head, no pooler) of the model `cfg` names, on `device`.

    `weights_from` is a saved directory: a peft adapter there is loaded onto `cfg.name_or_path`
    (trainable); full weights there replace the base. Without it, `cfg.lora` adds a fresh adapter.
    """
    from peft import PeftModel
    from transformers import AutoModel, AutoModelForTextEncoding

    device = torch.device(device)
    adapter = weights_from is not None and (Path(weights_from) / "adapter_config.json").is_file()
    base_path = resolve_model_path(cfg.name_or_path)
    path = str(weights_from) if (weights_from is not None and not adapter) else base_path
    auto = AutoModel
    if encoder_only and _is_encoder_decoder(base_path):
        auto = AutoModelForTextEncoding  # T5: its encoder alone (T5EncoderModel)
    model = load_pretrained(auto, cfg, path, device)
    if encoder_only and getattr(model, "pooler", None) is not None:
        model.pooler = None  # BERT / RoBERTa / Longformer: a token head never reads the pooler
    if adapter:
        model = PeftModel.from_pretrained(model, str(weights_from), is_trainable=True)
    elif cfg.lora is not None:
        model = apply_lora(model, cfg.lora, task_type="FEATURE_EXTRACTION")
    return model


def _is_encoder_decoder(path: str) -> bool:
    """An encoder-decoder checkpoint (T5), or the encoder of one saved alone (T5EncoderModel,
    whose saved config no longer says encoder-decoder)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    return bool(getattr(config, "is_encoder_decoder", False)) or any(
        a.endswith("EncoderModel") for a in archs
    )


class ScalarHeadModel(TextScoring, nn.Module):
    """A backbone plus a linear head hidden -> head_dim; see the module docstring.

    `forward` returns scores only; losses live in the packages. `tokenizer` (optional) is what
    the text methods (`score`, `segment_scores` ...: `rlhf_core.scalar_head_scoring`) use;
    `from_pretrained` sets it.
    """

    def __init__(self, backbone: nn.Module, info: ScalarHeadInfo, *, tokenizer: Any = None):
        super().__init__()
        self.backbone = backbone
        self.info = info
        self.tokenizer = tokenizer
        hidden = backbone.config.get_text_config().hidden_size
        device = next(backbone.parameters()).device
        self.head = nn.Linear(hidden, info.head_dim, bias=False, device=device)
        nn.init.normal_(self.head.weight, std=HEAD_INIT_STD)
        self._shared_encoder: list[nn.Module] = []  # a list: not a submodule (`share_encoder`)
        if info.encoder_only and getattr(backbone, "decoder", None) is not None:
            raise ValueError(
                f"encoder_only: {type(backbone).__name__} has a decoder; encoder_only is for "
                "bidirectional encoders (BERT / DeBERTa / Longformer family, or an "
                "encoder-decoder checkpoint's encoder: load_backbone)"
            )
        if info.lm_likelihood:  # w of w * log p_LM(token); set by the trainer or load_head
            check_tied_lm_head(backbone)
            self.likelihood_weight = nn.Parameter(torch.zeros((), device=device))

    # --- building and saving

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        info: ScalarHeadInfo,
        device: torch.device | str = "cpu",
        *,
        weights_from: str | Path | None = None,
        freeze_backbone: bool = False,
    ) -> ScalarHeadModel:
        """A new model on `cfg`'s backbone (head drawn from torch's global RNG), or, with
        `weights_from`, the backbone/adapter and head saved there (resuming a checkpoint)."""
        if freeze_backbone and cfg.lora is not None:
            raise ValueError("freeze_backbone and LoRA: choose one (LoRA freezes the base already)")
        if cfg.lora is not None and info.base_model is None:
            info = replace(info, base_model=cfg.name_or_path)
        if weights_from is not None and is_sharded_checkpoint(weights_from):
            weights_from = None  # shards: read into the sharded model (rlhf_core.loop)
        backbone = load_backbone(
            cfg, device, weights_from=weights_from, encoder_only=info.encoder_only
        )
        model = cls(backbone, info)
        if freeze_backbone:
            model.backbone.requires_grad_(False)
        if weights_from is not None:
            model.load_head(weights_from)
        return model

    def load_head(self, directory: str | Path) -> None:
        """The head (and likelihood weight) saved in `directory` (`scalar_head.safetensors`)."""
        tensors = read_head_tensors(directory)
        weight = tensors["weight"]
        if self.info.lm_likelihood:
            if "likelihood_weight" not in tensors:
                raise ValueError(f"{directory}: lm_likelihood model without 'likelihood_weight'")
            with torch.no_grad():
                self.likelihood_weight.copy_(tensors["likelihood_weight"])
        if weight.shape != self.head.weight.shape:
            raise ValueError(
                f"{directory}: head weight is {tuple(weight.shape)}, this model needs "
                f"{tuple(self.head.weight.shape)} (head_dim, hidden)"
            )
        with torch.no_grad():
            self.head.weight.copy_(weight)

    def save_pretrained(
        self,
        path: str | Path,
        safe_serialization: bool = True,
        state_dict: dict[str, torch.Tensor] | None = None,
        **_: Any,
    ) -> None:
        """Write the directory of `rlhf_core.scalar_head_format` (tokenizer too, if set).
        `state_dict` (this model's keys: backbone.*, head.weight) replaces the module's own
        tensors, e.g. a sharded model's gathered state (`rlhf_core.distributed`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        backbone_state, head = None, self.head.weight
        likelihood = getattr(self, "likelihood_weight", None)
        if state_dict is not None:
            backbone_state = {
                k.removeprefix("backbone."): v for k, v in state_dict.items()
                if k.startswith("backbone.")
            }  # fmt: skip
            head = state_dict["head.weight"]
            likelihood = state_dict.get("likelihood_weight", likelihood)
        self.backbone.save_pretrained(
            path, safe_serialization=safe_serialization, state_dict=backbone_state
        )
        write_head_files(
            path, self.info, head, adapter=self.is_adapter, likelihood_weight=likelihood
        )
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto",
        attention: Literal["auto", "flash_attention_2", "sdpa", "eager"] = "auto",
        quantization: QuantizationConfig | None = None,
    ) -> ScalarHeadModel:
        """Load a saved scalar-head directory or a `...ForSequenceClassification` directory, in
        eval mode with its tokenizer attached; `quantization` loads the backbone in k bits (the
        head stays float32)."""
        path = Path(path)
        if not is_scalar_head_dir(path):
            backbone, info, tokenizer, weight = load_sequence_classification(
                path, device, dtype, attention, quantization
            )
            model = cls(backbone, info, tokenizer=tokenizer)
            with torch.no_grad():
                model.head.weight.copy_(weight)
            return model.eval().requires_grad_(False)
        info, adapter = read_head_info(path)
        base = info.base_model if adapter else str(path)
        tok_source = str(path) if (path / "tokenizer_config.json").is_file() else base
        tok_cfg = ModelConfig(name_or_path=tok_source, chat_template=info.chat_template)
        tokenizer = load_tokenizer(tok_cfg, padding_side="right")
        # inference only: k-bit weights without the LoRA that training them would need; a LoRA
        # base gets its pad token again (`ModelConfig.pad_token`: a no-op where it has it)
        pad = tokenizer.pad_token if tokenizer.pad_token_id != tokenizer.eos_token_id else None
        cfg = ModelConfig(name_or_path=base, dtype=dtype, attention=attention,
                          pad_token=pad if adapter else None)  # fmt: skip
        cfg = cfg.model_copy(update={"quantization": quantization})
        model = cls.from_config(cfg, info, device, weights_from=path)
        model.tokenizer = tokenizer
        return model.eval().requires_grad_(False)

    def share_encoder(self, encoder: nn.Module) -> None:
        """Read the prompt through `encoder` (another model's, e.g. the T5 policy's:
        `rlhf_core.policy_model.share_policy_encoder`) instead of the backbone's own, whose
        layers are dropped. `encoder` stays that model's: not a submodule here, so this model's
        parameters, optimizer and saved directory leave it out, while gradients through it reach
        its owner's parameters. Encoder-decoder backbones only."""
        if not self.backbone.config.is_encoder_decoder:
            raise ValueError("share_encoder: the backbone has no encoder of its own to replace")
        own = self.backbone.get_encoder()
        if hasattr(own, "block"):  # T5: drop the unused layers (a reloaded copy is re-shared)
            own.block = nn.ModuleList()
        self._shared_encoder = [encoder]

    # --- the forward pass

    @property
    def is_adapter(self) -> bool:
        return is_peft_model(self.backbone)

    @property
    def backbone_frozen(self) -> bool:
        return not any(p.requires_grad for p in self.backbone.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        decoder_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores of every position, (B, T, head_dim), float32. Padding positions hold garbage.

        A causal backbone's position ids come from the attention mask, so left or right padding
        scores the same; an encoder (`info.encoder_only`) makes its own. An encoder-decoder
        backbone reads `input_ids` with its encoder and scores the positions of
        `decoder_input_ids` (B, T). (`reward_models.models.BaseRewardModel` adds the packed
        and shared-prefix forwards that reward-model training uses.)"""
        if decoder_input_ids is not None:
            extra = {"decoder_input_ids": decoder_input_ids, "use_cache": False}
            if self._shared_encoder:
                encoder = self._shared_encoder[0]
                encoded = encoder(input_ids=input_ids, attention_mask=attention_mask)
                extra["encoder_outputs"] = (encoded.last_hidden_state,)
        elif self.info.encoder_only:
            extra = {}
        else:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            extra = {"position_ids": position_ids, "use_cache": False}
        with self._grad_context():
            hidden = self.backbone(
                input_ids=input_ids, attention_mask=attention_mask, **extra
            ).last_hidden_state
        scores = self.head(hidden.to(self.head.weight.dtype))
        if self.info.lm_likelihood:  # each token is predicted from the position before it
            previous, predicted = previous_positions(hidden)
            scores = add_lm_likelihood(
                scores, self.likelihood_weight, self.backbone, previous, input_ids, predicted
            )
        return scores

    def _grad_context(self) -> Any:
        """No autograd graph through a frozen backbone (only the head trains)."""
        return torch.no_grad() if self.backbone_frozen else nullcontext()
