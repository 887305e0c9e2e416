"""Scalar-head models: a causal-LM backbone plus a linear head that scores every token.

`ScalarHeadModel` serves every model that maps a token sequence to scores instead of next-token
logits: the reward models of `reward_models` (preference, outcome, process) and PPO's value model.
`policy_gradients` loads a trained reward model from its directory through this module, so it
never imports `reward_models`.

    model(input_ids, attention_mask)          -> scores (B, T, head_dim), one per token
    pool_last_token(scores, attention_mask)   -> (B, head_dim) at each row's last non-pad token

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

Text is scored exactly as it was trained on (`encode_completions`, `encode_steps`): the prompt is
rendered with the chat template and keeps its last `max_prompt_length` tokens, the completion ends
with eos and is cut to fit `max_length`; a PRM completion is its steps, each followed by the
one-token step separator, and is scored at the separators. What `score` returns per row:

    preference, value   the head's scalar at the last token
    orm                 P(correct) = sigmoid(the logit at the last token)
    prm                 min (or prod, or last) over steps of P(step is not an error), where
                        P(not an error) = 1 - softmax(step logits)[0] (class 0 = negative)

Not here: losses (each package owns its own), sequence packing, multi-objective heads beyond
`pooled_scores`.
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
from rlhf_core.models import (
    ModelConfig,
    apply_lora,
    is_peft_model,
    load_tokenizer,
    resolve_attention,
    resolve_dtype,
    resolve_model_path,
)
from rlhf_core.quantization import (
    QuantizationConfig,
    keep_backward_through_4bit,
    quantized_load_kwargs,
)

KINDS = ("preference", "orm", "prm", "value")
HEAD_WEIGHTS = "scalar_head.safetensors"
HEAD_CONFIG = "scalar_head.json"
FORMAT = "rlhf-lab scalar head v1"
HEAD_INIT_STD = 0.02


# ----------------------------------------------------------------------------- pooling


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last position whose mask is set; right or left padding alike.

    `attention_mask` is (B, T), bool or 0/1. A row with no set position gets index 0.
    """
    if attention_mask.dim() != 2:
        raise ValueError(
            f"last_token_index: expected a (B, T) mask, got shape {tuple(attention_mask.shape)}"
        )
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.ne(0)).argmax(-1)


def pool_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values (B, T, ...) at each row's last set mask position -> (B, ...)."""
    if values.shape[:2] != attention_mask.shape:
        raise ValueError(
            f"pool_last_token: values {tuple(values.shape)} must start with the mask's shape "
            f"{tuple(attention_mask.shape)}"
        )
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, last_token_index(attention_mask).to(values.device)]


# ----------------------------------------------------------------------------- encoding


@dataclass
class EncodedCompletion:
    """Token ids of one prompt and its completion (ending with eos unless truncated)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    truncated: bool  # the completion lost tokens to max_length
    prompt_truncated: bool = False  # the prompt lost its start to max_prompt_length


@dataclass
class EncodedSteps:
    """Token ids of one prompt and a step-by-step completion: each step, then the separator."""

    prompt_ids: list[int]
    completion_ids: list[int]
    step_ends: list[int]  # index in completion_ids of each kept step's separator token
    dropped_steps: int  # steps that did not fit in max_length (a cut first step counts too)


def tokenize_texts(tokenizer: Any, texts: list[str], chunk: int = 1024) -> list[list[int]]:
    """Token ids of each text, no special tokens added, in batches of `chunk`."""
    out: list[list[int]] = []
    for start in range(0, len(texts), chunk):
        out.extend(tokenizer(texts[start : start + chunk], add_special_tokens=False)["input_ids"])
    return out


def _prompt_budget(max_length: int, max_prompt_length: int | None) -> int:
    return max_prompt_length or max_length // 2


def encode_completions(
    tokenizer: Any,
    prompt_texts: list[str],
    completions: list[str],
    *,
    max_length: int,
    max_prompt_length: int | None = None,
) -> list[EncodedCompletion]:
    """Tokenize rendered prompts and completions (+ eos) and truncate.

    The prompt keeps its last `max_prompt_length` tokens (default max_length // 2); the completion
    is then cut to the room left (at least one token). Both cuts are flagged per example.
    """
    if len(prompt_texts) != len(completions):
        raise ValueError(f"{len(prompt_texts)} prompts but {len(completions)} completions")
    keep = _prompt_budget(max_length, max_prompt_length)
    eos = tokenizer.eos_token_id
    out = []
    for p_ids, c_ids in zip(
        tokenize_texts(tokenizer, prompt_texts), tokenize_texts(tokenizer, completions), strict=True
    ):
        cut = len(p_ids) > keep
        p_ids = p_ids[-keep:]
        room = max(1, max_length - len(p_ids))
        full = c_ids + [eos]
        out.append(EncodedCompletion(p_ids, full[:room], len(full) > room, cut))
    return out


def separator_token_id(tokenizer: Any, separator: str) -> int:
    """The id of a step separator, which must be exactly one token under `tokenizer`."""
    ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(
            f"step separator {separator!r} is {len(ids)} tokens {ids} under this tokenizer; it "
            "must be exactly one token (choose e.g. '\\n' or a special token)"
        )
    return ids[0]


def encode_steps(
    tokenizer: Any,
    prompt_texts: list[str],
    steps: list[list[str]],
    *,
    separator: str,
    max_length: int,
    max_prompt_length: int | None = None,
) -> list[EncodedSteps]:
    """Tokenize rendered prompts and step lists: completion = step_1 sep step_2 sep ... step_n sep.

    Each step is tokenized on its own, so every separator is exactly one token at a known place.
    The prompt keeps its last `max_prompt_length` tokens; whole steps are kept while they fit in
    `max_length`; if even the first does not fit it is cut (and counted as dropped).
    """
    if len(prompt_texts) != len(steps):
        raise ValueError(f"{len(prompt_texts)} prompts but {len(steps)} step lists")
    sep = separator_token_id(tokenizer, separator)
    keep = _prompt_budget(max_length, max_prompt_length)
    flat = tokenize_texts(tokenizer, [s for row in steps for s in row])
    out, cursor = [], 0
    for p_ids in tokenize_texts(tokenizer, prompt_texts):
        n = len(steps[len(out)])
        row_steps, cursor = flat[cursor : cursor + n], cursor + n
        p_ids = p_ids[-keep:]
        room = max(2, max_length - len(p_ids))
        ids: list[int] = []
        ends: list[int] = []
        for step_ids in row_steps:
            if len(ids) + len(step_ids) + 1 > room:
                break
            ids.extend(step_ids + [sep])
            ends.append(len(ids) - 1)
        dropped = n - len(ends)
        if not ends and row_steps:  # the first step alone is too long: keep its start
            ids = row_steps[0][: room - 1] + [sep]
            ends = [len(ids) - 1]
        out.append(EncodedSteps(p_ids, ids, ends, dropped))
    return out


def pad_sequences(
    sequences: list[list[int]], pad_id: int, *, side: Literal["left", "right"] = "right"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T_max), padded on `side`."""
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for b, seq in enumerate(sequences):
        cols = slice(0, len(seq)) if side == "right" else slice(longest - len(seq), longest)
        input_ids[b, cols] = torch.tensor(seq, dtype=torch.long)
        attention_mask[b, cols] = 1
    return input_ids, attention_mask


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
    base_model: str | None = None  # LoRA: the model the adapter applies to (name_or_path)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"scalar head kind {self.kind!r}: expected one of {KINDS}")
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
    dtype = resolve_dtype(cfg, device)
    model = AutoModel.from_pretrained(
        path,
        revision=cfg.revision if path == base_path else None,
        dtype=dtype,
        attn_implementation=resolve_attention(cfg, device),
        trust_remote_code=cfg.trust_remote_code,
        **quantized_load_kwargs(cfg.quantization, dtype, device),
    )
    if not getattr(model, "is_quantized", False):  # a k-bit model is placed while loading
        model = model.to(device)
    if cfg.quantization is not None and cfg.lora is not None:  # QLoRA training
        keep_backward_through_4bit(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
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
        weight = load_file(str(path))["weight"]
        if weight.shape != self.head.weight.shape:
            raise ValueError(
                f"{path}: head weight is {tuple(weight.shape)}, this model needs "
                f"{tuple(self.head.weight.shape)} (head_dim, hidden)"
            )
        with torch.no_grad():
            self.head.weight.copy_(weight)

    def save_pretrained(self, path: str | Path, safe_serialization: bool = True, **_: Any) -> None:
        """Write the directory described in the module docstring (tokenizer too, if set)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(path, safe_serialization=safe_serialization)
        weight = self.head.weight.detach().to("cpu", torch.float32).contiguous()
        save_file({"weight": weight}, str(path / HEAD_WEIGHTS))
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

    def additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A 4D boolean mask (True = may attend) as the additive mask transformers passes on
        untouched: 0 where allowed, the dtype's minimum elsewhere, in the backbone's dtype.
        Eager attention adds the mask to the scores (a boolean one would add 0/1: wrong), and
        SDPA would otherwise convert a boolean mask in every layer's forward and backward."""
        dtype = self.backbone.get_input_embeddings().weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed.bool(), torch.finfo(dtype).min)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
        prefix_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores of every position, (B, T, head_dim), float32. Padding positions hold garbage.

        Packed rows: `attention_mask` may be a 4D boolean mask (B, 1, T, T), True where a query
        may attend to a key, with explicit `position_ids` (B, T); several sequences then share
        one row (SDPA and eager attention; flash-attention 2 takes 2D masks only). A preference
        pair packs as [prompt | chosen | rejected] with the rejected tokens blind to the chosen
        ones and positions restarting after the prompt (`reward_models.data.pack_pairs`).

        Shared prefix: with `prefix_ids` / `prefix_mask` (Bp, P), left-padded, the rows of
        `input_ids` (B = Bp x r, right-padded) are continuations of those prefixes, r per prefix
        and grouped (rows b*r ... b*r + r - 1 continue prefix b). The prefix runs once, its keys
        and values are repeated for the r continuations, and the continuations attend to them
        through the KV cache; gradients flow through the cache into the prefix. The scores are
        those of the continuation tokens only, equal (up to float rounding; tested) to scoring
        prefix + continuation as one row. A preference batch shares each prompt between its
        chosen and rejected completions this way (Wang et al. 2024, "Accelerating Direct
        Preference Optimization with Prefix Sharing"), so the prompt is encoded once, not twice.
        """
        grad = torch.no_grad() if self.backbone_frozen else nullcontext()
        if attention_mask.dim() == 4:
            if position_ids is None:
                raise ValueError("a 4D attention mask (packed rows) needs explicit position_ids")
            with grad:
                hidden = self.backbone(
                    input_ids=input_ids, attention_mask=self.additive_mask(attention_mask),
                    position_ids=position_ids, use_cache=False,
                ).last_hidden_state  # fmt: skip
            return self.head(hidden.to(self.head.weight.dtype))
        if prefix_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            with grad:
                hidden = self.backbone(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=False,
                ).last_hidden_state
            return self.head(hidden.to(self.head.weight.dtype))
        if prefix_mask is None or input_ids.shape[0] % prefix_ids.shape[0]:
            raise ValueError(
                f"shared prefix: need prefix_mask and a row count ({input_ids.shape[0]}) that is "
                f"a multiple of the prefixes' ({prefix_ids.shape[0]})"
            )
        repeats = input_ids.shape[0] // prefix_ids.shape[0]
        prefix_mask = prefix_mask.long()
        prefix_positions = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
        starts = prefix_mask.sum(-1, keepdim=True).repeat_interleave(repeats, 0)
        positions = starts + (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        mask = torch.cat([prefix_mask.repeat_interleave(repeats, 0), attention_mask.long()], 1)
        with grad:
            # one embedding lookup for both passes: a second one would cost a second dense
            # (vocab x hidden) embedding gradient in the backward
            embed = self.backbone.get_input_embeddings()
            both = embed(torch.cat([prefix_ids.reshape(-1), input_ids.reshape(-1)]))
            n = prefix_ids.numel()
            cache = self.backbone(
                inputs_embeds=both[:n].view(*prefix_ids.shape, -1), attention_mask=prefix_mask,
                position_ids=prefix_positions, use_cache=True,
            ).past_key_values  # fmt: skip
            cache.batch_repeat_interleave(repeats)
            hidden = self.backbone(
                inputs_embeds=both[n:].view(*input_ids.shape, -1), attention_mask=mask,
                position_ids=positions, past_key_values=cache, use_cache=True,
            ).last_hidden_state  # fmt: skip
        return self.head(hidden.to(self.head.weight.dtype))

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
        """The head's raw output at each sequence's last token, (B, head_dim)."""
        encoded = self._encode(prompts, completions)
        scores = self._run([e.prompt_ids + e.completion_ids for e in encoded], batch_size)
        if not scores:
            return torch.zeros(0, self.info.head_dim)
        return torch.stack([s[-1] for s in scores])

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
    if tokenizer is None or tokenizer.pad_token_id is None:
        raise ValueError("export_sequence_classification needs a tokenizer with a pad token")
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(
            f"export_sequence_classification: pad = eos ({tokenizer.eos_token!r}); transformers "
            "would pool at the token before each sequence's final eos. Use a tokenizer with a "
            "distinct pad token."
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
