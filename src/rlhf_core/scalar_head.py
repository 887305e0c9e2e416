"""Scalar-head models: a causal-LM backbone plus a linear head that scores every token.

`ScalarHeadModel` serves every model that maps a token sequence to scores instead of next-token
logits: the reward models of `reward_models` (preference, outcome, process) and PPO's value model.
`policy_gradients` loads a trained reward model from its directory through this module, so it
never imports `reward_models`.

    model(input_ids, attention_mask)          -> scores (B, T, head_dim), one per token
    pool_last_token(scores, attention_mask)   -> (B, head_dim) at each row's last non-pad token
    pool_completion(scores, mask, pooling)    -> (B, head_dim): last, mean or sum over the
                                                 completion tokens `mask` marks

The backbone is the causal LM's base model (`AutoModel`: no LM head), loaded per `ModelConfig`
(tiny preset, local directory or hub id; dtype; attention; LoRA; gradient checkpointing), and may
be frozen so only the head trains. The head is `nn.Linear(hidden, head_dim, bias=False)` with
N(0, 0.02^2) init, kept in float32 (hidden states are upcast before it); it has no bias so that it
is exactly transformers' `...ForSequenceClassification.score`. Position ids are derived from the
attention mask, so a sequence scores the same under left padding, right padding or none.

A saved model is a directory that plain transformers/peft can read:

    config.json + model.safetensors                   the backbone (`AutoModel.from_pretrained`)
    or adapter_config.json + adapter_model.safetensors a peft LoRA adapter on `base_model`
    scalar_head.safetensors                           the head, one tensor "weight" (head_dim, H)
    scalar_head.json                                  `ScalarHeadInfo`: kind, head_dim, chat
                                                      template, lengths, step separator, base model
    tokenizer files

`ScalarHeadModel.from_pretrained(dir)` loads that, or a transformers `...ForSequenceClassification`
directory (as kind "preference"); `export_sequence_classification` writes the latter.

Text is scored exactly as it was trained on (`rlhf_core.encoding`: `encode_completions`,
`encode_steps`): the prompt is rendered with the chat template and cut by the one truncation rule
(`max_length`, `max_prompt_length` recorded in `scalar_head.json`), the completion ends with eos;
a PRM completion is its steps, each followed by the one-token step separator, and is scored at
the separators. What `score` returns per row:

    preference, value   the head's scalar at the last token; a preference model trained with
                        `pooling: mean` or `sum` (recorded in scalar_head.json) reads the mean
                        or the sum of the head's scalars over the completion tokens (eos
                        included) instead: a token-level reward summed (or averaged) over the
                        completion, the same number its training loss saw; with `lm_likelihood`
                        each token's score also adds w * log p(token | what precedes it) under
                        the backbone's own tied LM head (w learned, saved as likelihood_weight)
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

import copy
import json
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from rlhf_core.chat import Messages, render_prompt
from rlhf_core.checkpoint import is_sharded_checkpoint
from rlhf_core.encoding import (
    EncodedCompletion,
    encode_completions,
    encode_segments,
    encode_steps,
    last_token_index,
    pad_sequences,
)
from rlhf_core.errors import UserError
from rlhf_core.models import (
    ModelConfig,
    apply_lora,
    is_peft_model,
    load_pretrained,
    load_tokenizer,
    resolve_attention,
    resolve_dtype,
    resolve_model_path,
)
from rlhf_core.quantization import (
    QuantizationConfig,
    quantized_load_kwargs,
    release_checkpoint_pages,
)

KINDS = ("preference", "orm", "prm", "segment", "value")
POOLINGS = ("last", "mean", "sum")
HEAD_WEIGHTS = "scalar_head.safetensors"
HEAD_CONFIG = "scalar_head.json"
FORMAT = "rlhf-lab scalar head v1"
HEAD_INIT_STD = 0.02


# ----------------------------------------------------------------------------- pooling


def pool_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values (B, T, ...) at each row's last set mask position -> (B, ...)."""
    if values.shape[:2] != attention_mask.shape:
        raise ValueError(
            f"pool_last_token: values {tuple(values.shape)} must start with the mask's shape "
            f"{tuple(attention_mask.shape)}"
        )
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, last_token_index(attention_mask).to(values.device)]


def pool_completion(values: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """values (B, T, ...) pooled over the positions `mask` (B, T) marks -> (B, ...): the last
    marked position, or the mean or sum over the marked positions (a row with none: 0 for sum,
    nan for mean, an error for last). Unmarked positions (padding: garbage) never enter."""
    if pooling == "last":
        return pool_last_token(values, mask)
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r}: expected one of {POOLINGS}")
    if values.shape[:2] != mask.shape:
        raise ValueError(
            f"pool_completion: values {tuple(values.shape)} must start with the mask's shape "
            f"{tuple(mask.shape)}"
        )
    keep = mask.bool().view(*mask.shape, *([1] * (values.dim() - 2)))
    total = torch.where(keep, values, torch.zeros((), dtype=values.dtype)).sum(1)
    return total / keep.sum(1).to(values.dtype) if pooling == "mean" else total


# ----------------------------------------------------------------------------- the model


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
        if self.head_dim < 1:
            raise ValueError(f"scalar head: head_dim must be >= 1, got {self.head_dim}")
        if self.kind == "prm" and (self.step_separator is None or self.head_dim < 2):
            raise ValueError(
                "scalar head kind 'prm' needs a step_separator and head_dim >= 2 (step classes, "
                f"class 0 = negative); got {self.step_separator!r}, {self.head_dim}"
            )


def load_backbone(
    cfg: ModelConfig, device: torch.device | str = "cpu", *, weights_from: str | Path | None = None
) -> nn.Module:
    """The base model (no LM head) of the causal LM `cfg` names, on `device`.

    `weights_from` is a saved directory: a peft adapter there is loaded onto `cfg.name_or_path`
    (trainable); full weights there replace the base. Without it, `cfg.lora` adds a fresh adapter.
    """
    from transformers import AutoModel

    device = torch.device(device)
    adapter = weights_from is not None and (Path(weights_from) / "adapter_config.json").is_file()
    base_path = resolve_model_path(cfg.name_or_path)
    path = str(weights_from) if (weights_from is not None and not adapter) else base_path
    model = load_pretrained(AutoModel, cfg, path, device)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(weights_from), is_trainable=True)
    elif cfg.lora is not None:
        model = apply_lora(model, cfg.lora, task_type="FEATURE_EXTRACTION")
    return model


class ScalarHeadModel(nn.Module):
    """A backbone plus a linear head hidden -> head_dim; see the module docstring.

    `forward` returns scores only; losses live in the packages. `tokenizer` (optional) is what
    `score`, `token_scores` and `step_scores` use; `from_pretrained` sets it.
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
        if info.lm_likelihood:  # w of w * log p_LM(token); set by the trainer or load_head
            text_config = backbone.config.get_text_config()
            if not getattr(text_config, "tie_word_embeddings", False):
                raise ValueError(
                    f"lm_likelihood reads the backbone's language model through its input "
                    f"embeddings (tied LM head); {text_config.model_type} "
                    f"{getattr(text_config, '_name_or_path', '')!r} unties them"
                )
            if backbone.config.is_encoder_decoder:
                raise ValueError("lm_likelihood: decoder-only backbones only")
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
        model = cls(load_backbone(cfg, device, weights_from=weights_from), info)
        if freeze_backbone:
            model.backbone.requires_grad_(False)
        if weights_from is not None:
            model.load_head(weights_from)
        return model

    def load_head(self, directory: str | Path) -> None:
        from safetensors.torch import load_file

        path = Path(directory) / HEAD_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(f"no scalar head weights at {path}")
        tensors = load_file(str(path))
        weight = tensors["weight"]
        if self.info.lm_likelihood:
            if "likelihood_weight" not in tensors:
                raise ValueError(f"{path}: lm_likelihood model without 'likelihood_weight'")
            with torch.no_grad():
                self.likelihood_weight.copy_(tensors["likelihood_weight"])
        if weight.shape != self.head.weight.shape:
            raise ValueError(
                f"{path}: head weight is {tuple(weight.shape)}, this model needs "
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
        """Write the directory described in the module docstring (tokenizer too, if set).
        `state_dict` (this model's keys: backbone.*, head.weight) replaces the module's own
        tensors, e.g. a sharded model's gathered state (`rlhf_core.distributed`)."""
        from safetensors.torch import save_file

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
        tensors = {"weight": head.detach().to("cpu", torch.float32).contiguous()}
        if likelihood is not None:
            tensors["likelihood_weight"] = likelihood.detach().to("cpu", torch.float32)
        save_file(tensors, str(path / HEAD_WEIGHTS))
        meta = {"format": FORMAT, "backbone": "adapter" if self.is_adapter else "full"}
        (path / HEAD_CONFIG).write_text(json.dumps({**meta, **asdict(self.info)}, indent=2) + "\n")
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
        if not (path / HEAD_CONFIG).is_file():
            return cls._from_sequence_classification(path, device, dtype, attention, quantization)
        raw = json.loads((path / HEAD_CONFIG).read_text())
        known = {f.name for f in fields(ScalarHeadInfo)}
        info = ScalarHeadInfo(**{k: v for k, v in raw.items() if k in known})
        adapter = raw.get("backbone") == "adapter"
        if adapter and info.base_model is None:
            raise ValueError(f"{path / HEAD_CONFIG}: an adapter model must name its base_model")
        base = info.base_model if adapter else str(path)
        cfg = ModelConfig(name_or_path=base, dtype=dtype, attention=attention)
        # inference only: k-bit weights without the LoRA that training them would need
        cfg = cfg.model_copy(update={"quantization": quantization})
        model = cls.from_config(cfg, info, device, weights_from=path)
        tok_source = str(path) if (path / "tokenizer_config.json").is_file() else base
        tok_cfg = ModelConfig(name_or_path=tok_source, chat_template=info.chat_template)
        model.tokenizer = load_tokenizer(tok_cfg, padding_side="right")
        return model.eval().requires_grad_(False)

    @classmethod
    def _from_sequence_classification(
        cls, path, device, dtype, attention, quantization=None
    ) -> ScalarHeadModel:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        config = AutoConfig.from_pretrained(str(path))
        if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
            raise ValueError(
                f"{path}: neither a scalar-head directory (no {HEAD_CONFIG}) nor a "
                f"...ForSequenceClassification model (architectures: {config.architectures})"
            )
        cfg = ModelConfig(name_or_path=str(path), dtype=dtype, attention=attention)
        device = torch.device(device)
        if quantization is not None:  # the score head stays in full precision
            quantization = quantization.model_copy(update={"skip_modules": ["score"]})
        dtype = resolve_dtype(cfg, device)
        seq = AutoModelForSequenceClassification.from_pretrained(
            str(path), dtype=dtype, attn_implementation=resolve_attention(cfg, device),
            **quantized_load_kwargs(quantization, dtype, device),
        )  # fmt: skip
        if not getattr(seq, "is_quantized", False):
            seq = seq.to(device)
        else:  # its full-precision tensors out of the checkpoint's file mapping (CPU)
            release_checkpoint_pages(seq)
        if getattr(seq.score, "bias", None) is not None:
            raise ValueError(f"{path}: a score head with a bias is not supported")
        tokenizer = load_tokenizer(cfg, padding_side="right")
        info = ScalarHeadInfo(
            kind="preference", head_dim=seq.config.num_labels,
            chat_template=tokenizer.chat_template, max_length=tokenizer.model_max_length,
        )  # fmt: skip
        model = cls(getattr(seq, seq.base_model_prefix), info, tokenizer=tokenizer)
        with torch.no_grad():
            model.head.weight.copy_(seq.score.weight)
        return model.eval().requires_grad_(False)

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

        Position ids come from the attention mask, so left or right padding scores the same.
        An encoder-decoder backbone reads `input_ids` with its encoder and scores the positions
        of `decoder_input_ids` (B, T). (`reward_models.models.BaseRewardModel` adds the packed
        and shared-prefix forwards that reward-model training uses.)"""
        if decoder_input_ids is not None:
            extra = {"decoder_input_ids": decoder_input_ids}
        else:
            extra = {"position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0)}
        with self._grad_context():
            hidden = self.backbone(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra
            ).last_hidden_state
        scores = self.head(hidden.to(self.head.weight.dtype))
        if self.info.lm_likelihood:  # each token is predicted from the position before it
            previous = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
            first = torch.arange(input_ids.shape[1], device=input_ids.device) == 0
            scores = self.add_lm_likelihood(
                scores, previous, input_ids, ~first.expand_as(input_ids)
            )
        return scores

    def add_lm_likelihood(
        self,
        scores: torch.Tensor,
        previous: torch.Tensor,
        input_ids: torch.Tensor,
        predicted: torch.Tensor,
    ) -> torch.Tensor:
        """scores (B, T, 1) + w * log p(input_ids | previous): `previous` (B, T, H) is the hidden
        state each token is predicted from (the position before it in its own sequence), read
        through the backbone's tied LM head (its input embeddings), at the positions `predicted`
        (B, T) marks (elsewhere 0: a sequence's first token). Fused: no (B, T, V) logits."""
        from types import SimpleNamespace

        from rlhf_core.logprobs import linear_token_logprobs

        embedding = self.backbone.get_input_embeddings().weight
        lm_head = SimpleNamespace(weight=embedding, bias=None)  # the tied LM head
        logps = torch.zeros(input_ids.shape, dtype=scores.dtype, device=scores.device)
        picked = linear_token_logprobs(previous[predicted], lm_head, input_ids[predicted])
        logps = logps.masked_scatter(predicted, picked.to(scores.dtype))
        return scores + self.likelihood_weight * logps[..., None]

    def _grad_context(self) -> Any:
        """No autograd graph through a frozen backbone (only the head trains)."""
        return torch.no_grad() if self.backbone_frozen else nullcontext()

    # --- scoring text

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("no tokenizer: set model.tokenizer (from_pretrained sets it)")
        return self.tokenizer

    @torch.no_grad()
    def _run(self, sequences: list[list[int]], batch_size: int) -> list[torch.Tensor]:
        """Per-token scores (len_i, head_dim) on the CPU for each sequence, batched by length."""
        tokenizer = self._require_tokenizer()
        device = self.head.weight.device
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
        was_training = self.training
        self.eval()
        try:
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                ids, mask = pad_sequences([sequences[i] for i in rows], tokenizer.pad_token_id)
                scores = self(ids.to(device), mask.to(device)).float().cpu()
                for b, i in enumerate(rows):
                    out[i] = scores[b, : len(sequences[i])]
        finally:
            self.train(was_training)
        return out

    def _encode(
        self, prompts: list[str | Messages], completions: list[str]
    ) -> list[EncodedCompletion]:
        tokenizer = self._require_tokenizer()
        texts = [render_prompt(tokenizer, p, where=f"prompts[{i}]") for i, p in enumerate(prompts)]
        return encode_completions(
            tokenizer, texts, list(completions), max_length=self.info.max_length,
            max_prompt_length=self.info.max_prompt_length,
        )  # fmt: skip

    def pooled_scores(
        self, prompts: list[str | Messages], completions: list[str], *, batch_size: int = 16
    ) -> torch.Tensor:
        """The head's raw output at each sequence's last token, (B, head_dim); with
        `info.pooling` mean or sum, its mean or sum over the completion's tokens."""
        encoded = self._encode(prompts, completions)
        scores = self._run([e.prompt_ids + e.completion_ids for e in encoded], batch_size)
        if not scores:
            return torch.zeros(0, self.info.head_dim)
        if self.info.pooling == "last":
            return torch.stack([s[-1] for s in scores])
        return torch.stack([
            pool_completion(s[None, len(e.prompt_ids) :], torch.ones(1, len(s) - len(e.prompt_ids)),
                            self.info.pooling)[0]
            for s, e in zip(scores, encoded, strict=True)
        ])  # fmt: skip

    def token_scores(
        self, prompts: list[str | Messages], completions: list[str], *, batch_size: int = 16
    ) -> list[torch.Tensor]:
        """The head's raw output at every completion token (eos included), (len_i, head_dim)."""
        encoded = self._encode(prompts, completions)
        scores = self._run([e.prompt_ids + e.completion_ids for e in encoded], batch_size)
        return [s[len(e.prompt_ids) :] for s, e in zip(scores, encoded, strict=True)]

    def step_scores(
        self, prompts: list[str | Messages], steps: list[list[str]], *, batch_size: int = 16
    ) -> list[torch.Tensor]:
        """PRM: P(step is not an error) at each kept step's separator, (n_steps_i,)."""
        if self.info.kind != "prm":
            raise ValueError(f"step_scores needs a 'prm' model, this one is {self.info.kind!r}")
        tokenizer = self._require_tokenizer()
        texts = [render_prompt(tokenizer, p, where=f"prompts[{i}]") for i, p in enumerate(prompts)]
        encoded = encode_steps(
            tokenizer, texts, [list(s) for s in steps], separator=self.info.step_separator,
            max_length=self.info.max_length, max_prompt_length=self.info.max_prompt_length,
        )  # fmt: skip
        scores = self._run([e.prompt_ids + e.completion_ids for e in encoded], batch_size)
        out = []
        for s, e in zip(scores, encoded, strict=True):
            at_ends = s[[len(e.prompt_ids) + j for j in e.step_ends]]
            out.append(1 - at_ends.softmax(-1)[:, 0])
        return out

    def segment_scores(
        self, prompts: list[str | Messages], completions: list[str], *, batch_size: int = 16
    ) -> list[torch.Tensor]:
        """Segment model: the class logits (n_i, head_dim) at the token ending each segment of
        each completion, in the order of `segment(completion, info.segment_level)`; segments cut
        off by `max_length` get no row."""
        if self.info.kind != "segment":
            raise ValueError(
                f"segment_scores needs a 'segment' model, this one is {self.info.kind!r}"
            )
        tokenizer = self._require_tokenizer()
        texts = [render_prompt(tokenizer, p, where=f"prompts[{i}]") for i, p in enumerate(prompts)]
        encoded = encode_segments(
            tokenizer, texts, list(completions), level=self.info.segment_level,
            max_length=self.info.max_length, max_prompt_length=self.info.max_prompt_length,
        )  # fmt: skip
        scores = self._run([e.prompt_ids + e.completion_ids for e in encoded], batch_size)
        return [
            s[[len(e.prompt_ids) + j for j in e.step_ends]]
            for s, e in zip(scores, encoded, strict=True)
        ]

    def split_steps(self, completion: str) -> list[str]:
        """A PRM completion given as one string, split at the step separator (empty steps go)."""
        return [s for s in completion.split(self.info.step_separator) if s.strip()]

    def score(
        self,
        prompts: list[str | Messages],
        completions: list[str] | list[list[str]],
        *,
        batch_size: int = 16,
        step_reduction: Literal["min", "prod", "last"] = "min",
    ) -> torch.Tensor:
        """One reward per (prompt, completion), (B,); see the module docstring for each kind.

        PRM completions may be step lists or strings (split at the step separator); a completion
        with no steps scores 1.0 (no step is an error)."""
        kind = self.info.kind
        if kind == "segment":
            raise ValueError(
                "score: a 'segment' model has one score per segment; use segment_scores"
            )
        if kind == "prm":
            steps = [self.split_steps(c) if isinstance(c, str) else c for c in completions]
            per_step = self.step_scores(prompts, steps, batch_size=batch_size)
            reduce = {"min": lambda p: p.min(), "prod": lambda p: p.prod(), "last": lambda p: p[-1]}
            if step_reduction not in reduce:
                raise ValueError(f"step_reduction {step_reduction!r}: expected min, prod or last")
            return torch.stack(
                [reduce[step_reduction](p) if len(p) else torch.tensor(1.0) for p in per_step]
            )
        if self.info.head_dim != 1:
            raise ValueError(
                f"score: a {kind!r} model with head_dim {self.info.head_dim} has no single "
                "reward; use pooled_scores"
            )
        pooled = self.pooled_scores(prompts, list(completions), batch_size=batch_size)[:, 0]
        return torch.sigmoid(pooled) if kind == "orm" else pooled


# ----------------------------------------------------------------------------- export


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
            "Use a tokenizer with a distinct pad token, or set "
            "train.export_sequence_classification: false (the reward model directory itself is "
            "unaffected)."
        )


def export_sequence_classification(
    model: ScalarHeadModel, out_dir: str | Path, *, tokenizer: Any = None
) -> Path:
    """Write `model` as a transformers `...ForSequenceClassification` directory (num_labels =
    head_dim, `score` = the head, a LoRA adapter merged in, pad_token_id set so transformers'
    pooling finds each row's last non-pad token) with its tokenizer.

    transformers pools at the last token that is not pad, and our sequences end with eos, so a
    tokenizer whose pad is eos cannot be exported faithfully: that raises.
    """
    from transformers import AutoModelForSequenceClassification

    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    check_sequence_classification_export(tokenizer)
    if model.info.pooling != "last":
        raise UserError(
            f"export_sequence_classification: this reward model pools {model.info.pooling!r} "
            "over the completion's tokens; transformers' sequence classifiers read the last "
            "token only, so the export would score differently. Use pooling: last to export."
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
