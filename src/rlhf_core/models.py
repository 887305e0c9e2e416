"""Loading policies, tokenizers and reference models: a hub id, a local directory or a tiny preset.

`ModelConfig` is the one model block every package uses. `name_or_path` is resolved as
  1. a tiny-world preset name (`rlhf_core.tiny.PRESETS`, built offline into a cache dir), else
  2. whatever `from_pretrained` accepts: a local directory or a hub id (downloads need network).
Both end in the same `from_pretrained` call.

dtype `auto`: bf16 on a CUDA device that supports it, else fp32. attention `auto`: flash-attn 2
when it is installed and the device is CUDA, else PyTorch SDPA.

Tokenizers: padding side is an explicit argument (left for generation, right for training); a
tokenizer without a pad token gets pad = eos with a warning, unless `pad_token` names one: then a
tokenizer whose pad is missing or equal to eos gets that token (added to its vocabulary if new),
and every model loaded with the same config has its embeddings resized to hold it (a GPT-2-style
model, pad = eos, can so export to `...ForSequenceClassification`). An encoder tokenizer with no
eos (BERT's WordPiece) uses its sep token as eos.

Reference policy: `ReferencePolicy(policy, mode="copy")` keeps a frozen deep copy; with a LoRA
policy, `mode="adapter"` runs the same model with the adapter disabled (no second copy of weights).
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field, model_validator

from rlhf_core.chat import ensure_chat_template, set_thinking
from rlhf_core.checkpoint import is_sharded_checkpoint
from rlhf_core.config import StrictModel
from rlhf_core.errors import EnvironmentFailure, UserError, UserFileNotFound
from rlhf_core.lean import apply_lean
from rlhf_core.logprobs import causal_lm_token_logprobs
from rlhf_core.quantization import (
    QuantizationConfig,
    keep_backward_through_4bit,
    quantized_load_kwargs,
    release_checkpoint_pages,
)
from rlhf_core.tiny import is_preset, preset_dir

if TYPE_CHECKING:
    from rlhf_core.distributed import Engine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: LoRA targets per `config.model_type` when `lora.target_modules` is not given.
LORA_TARGETS: dict[str, list[str]] = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    # T5 attention q/k/v/o and feed-forward wi/wo (T5 v1.1 / Flan-T5 gate: wi_0, wi_1)
    "t5": ["q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"],
}
LORA_TARGETS["mt5"] = LORA_TARGETS["umt5"] = LORA_TARGETS["t5"]
for _arch in ("qwen2", "qwen3", "qwen3_moe", "mistral", "gemma", "gemma2", "gemma3_text", "phi3"):
    LORA_TARGETS[_arch] = LORA_TARGETS["llama"]


class LoraConfig(StrictModel):
    r: int = Field(16, gt=0, description="LoRA rank")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input")
    target_modules: list[str] | None = Field(
        None, description="module names to adapt; null = the per-architecture default"
    )


class ModelConfig(StrictModel):
    name_or_path: str = Field(
        description="tiny preset name (e.g. tiny-qwen3), local model directory, or hub id"
    )
    tokenizer: str | None = Field(None, description="tokenizer dir/id if not the model's own")
    pad_token: str | None = Field(
        None,
        description="a distinct pad token (e.g. '<|pad|>') for a tokenizer that has none or pads "
        "with eos (GPT-2): added to the tokenizer if new, the model's embeddings resized to "
        "hold it; needed to export a reward model to ...ForSequenceClassification. null = keep "
        "the tokenizer's pad (eos if it has none)",
    )
    revision: str | None = Field(None, description="hub revision (branch, tag or commit)")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="weights dtype; auto = bf16 on capable CUDA, else fp32"
    )
    attention: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto", description="attention kernel; auto = flash-attn 2 if installed on CUDA, else sdpa"
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations to save memory")
    lean_activations: bool = Field(
        True,
        description="SwiGLU MLPs save 2 of their 4 intermediate-width activations and Llama/Qwen "
        "RMSNorms their input only, recomputing the rest in the backward (the same values; the "
        "MLP's gradients bitwise, the norm's to rounding; rlhf_core.lean)",
    )
    trust_remote_code: bool = Field(False, description="allow model code from the hub (unsafe)")
    chat_template: str | None = Field(
        None, description="Jinja chat template overriding the tokenizer's"
    )
    enable_thinking: bool | None = Field(
        None,
        description="Qwen3 thinking mode: passed to the chat template as enable_thinking (false "
        "renders an empty <think></think> block); null = the template's default",
    )
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter instead of all weights")
    quantization: QuantizationConfig | None = Field(
        None, description="load the base weights in 8 or 4 bits (bitsandbytes); with lora = QLoRA"
    )

    @model_validator(mode="after")
    def _quantized_weights_train_through_lora(self) -> ModelConfig:
        if self.quantization is not None and self.lora is None:
            raise ValueError(
                "model.quantization freezes the base weights in k bits: set model.lora too "
                "(QLoRA), or drop model.quantization to train all weights"
            )
        return self


def resolve_model_path(name_or_path: str) -> str:
    """A tiny preset name -> its built directory; anything else is passed through."""
    if is_preset(name_or_path):
        return str(preset_dir(name_or_path))
    # A hub id is "name" or "org/name" and may contain dots (Qwen/Qwen3-0.6B), so only an explicit
    # path (./x, /x, ~/x) or one with more than one "/" is known to be local.
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise UserFileNotFound(f"model directory not found: {name_or_path}")
    return name_or_path


@contextmanager
def loading(what: str, source: str) -> Iterator[None]:
    """Around a `from_pretrained` of `source`: files it cannot read (missing, not JSON, not UTF-8)
    or an unknown hub id are one line naming it (UserError), a hub it cannot reach is an
    EnvironmentFailure; `--debug` shows transformers' traceback."""
    try:
        yield
    except (UserError, EnvironmentFailure):
        raise
    except (OSError, ValueError) as exc:
        text = " ".join(str(exc).split())
        text = text if len(text) <= 200 else text[:200] + "..."
        if "couldn't connect" in text or "connection" in type(exc).__name__.lower():
            raise EnvironmentFailure(
                f"{what} {source!r}: the Hugging Face hub cannot be reached and the files are not "
                f"in the local cache ({text}); connect, or give a local directory"
            ) from None
        held = ""
        if Path(source).is_dir():  # say what the directory holds and what it should
            names = sorted(p.name for p in Path(source).iterdir())
            held = (f"; {source} holds {', '.join(names[:6]) if names else 'nothing'}; a model "
                    "directory holds config.json, the weights and the tokenizer files, as "
                    "save_pretrained writes them")  # fmt: skip
        raise UserError(
            f"{what} {source!r} could not be loaded: {type(exc).__name__}: {text}{held}"
        ) from None


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype != "auto":
        return DTYPES[cfg.dtype]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def resolve_attention(cfg: ModelConfig, device: torch.device) -> str:
    if cfg.attention != "auto":
        return cfg.attention
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_tokenizer(cfg: ModelConfig, *, padding_side: Literal["left", "right"]):
    """Load the tokenizer; set pad = eos (with a warning) if it has none; set the chat template."""
    from transformers import AutoTokenizer

    source = resolve_model_path(cfg.tokenizer or cfg.name_or_path)
    with loading("model.tokenizer" if cfg.tokenizer else "model.name_or_path", source):
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    if tokenizer.eos_token is None and tokenizer.sep_token is not None:
        tokenizer.eos_token = tokenizer.sep_token  # an encoder's (BERT): [SEP] ends a sequence
    if tokenizer.eos_token is None:
        raise UserError(f"tokenizer {source!r} has no eos token; set one in its tokenizer_config")
    if cfg.pad_token is not None:
        set_pad_token(tokenizer, cfg.pad_token, where=f"tokenizer {source!r}")
    if tokenizer.pad_token is None:
        warnings.warn(
            f"tokenizer {source!r} has no pad token; using eos {tokenizer.eos_token!r} as pad",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    ensure_chat_template(tokenizer, cfg.chat_template)
    set_thinking(tokenizer, cfg.enable_thinking)
    return tokenizer


def set_pad_token(tokenizer, pad_token: str, *, where: str) -> None:
    """Give `tokenizer` the distinct pad token `pad_token` (`ModelConfig.pad_token`), added as a
    special token if it is not in the vocabulary; a tokenizer with a distinct pad keeps it."""
    if tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return
    if pad_token == tokenizer.eos_token:
        raise UserError(
            f"model.pad_token {pad_token!r} is {where}'s eos token; name a distinct token"
        )
    tokenizer.add_special_tokens({"pad_token": pad_token})


def fit_embeddings_to_pad(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Resize `model`'s token embeddings (and a tied LM head) to hold the pad token that
    `cfg.pad_token` adds to its tokenizer; nothing when it fits already (a checkpoint saved
    resized, or a vocabulary padded past the tokenizer's size). New rows: transformers' mean
    resizing; the pad row never reaches a real token's output (pad positions are masked)."""
    if cfg.pad_token is None:
        return
    tokenizer = load_tokenizer(cfg, padding_side="right")
    rows = model.get_input_embeddings().weight.shape[0]
    if tokenizer.pad_token_id < rows:
        return
    if getattr(model, "is_quantized", False):
        raise UserError(
            f"model.pad_token {cfg.pad_token!r} needs the embeddings resized, which k-bit "
            "(model.quantization) weights cannot be; save the resized model unquantized first"
        )
    model.resize_token_embeddings(len(tokenizer))


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` in eval mode inside this context; its train/eval mode is restored after (also
    after an error)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def with_padding_side(tokenizer, side: Literal["left", "right"]):
    """A shallow copy of `tokenizer` with another padding side (the original is not changed)."""
    other = copy.copy(tokenizer)
    other.padding_side = side
    return other


def load_policy(
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    *,
    weights_from: str | Path | None = None,
):
    """Load a policy per `cfg` (LoRA applied if configured) on `device`: a causal LM
    (`AutoModelForCausalLM`), or an encoder-decoder one (`AutoModelForSeq2SeqLM`, e.g. T5) when
    the model's config says `is_encoder_decoder`; `rlhf_core.policy_model` runs either.

    `weights_from` loads full weights from another directory (a checkpoint), or, with LoRA, the
    base from `cfg.name_or_path` and the adapter from `weights_from`. A sharded checkpoint holds
    no Hugging Face weights: the base is loaded, and `rlhf_core.checkpoint.restore_checkpoint` reads
    the shards once the model is sharded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    device = torch.device(device)
    if weights_from is not None and is_sharded_checkpoint(weights_from):
        weights_from = None  # shards: loaded into the sharded model (rlhf_core.loop)
    base_path = resolve_model_path(cfg.name_or_path)
    full_path = str(weights_from) if (weights_from is not None and cfg.lora is None) else base_path
    with loading("model.name_or_path" if full_path == base_path else "weights", full_path):
        config = AutoConfig.from_pretrained(
            full_path, revision=cfg.revision if full_path == base_path else None,
            trust_remote_code=cfg.trust_remote_code,
        )  # fmt: skip
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model = load_pretrained(auto, cfg, full_path, device)
    if cfg.lora is not None:
        if weights_from is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(weights_from), is_trainable=True)
        else:
            task_type = "SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM"
            model = apply_lora(model, cfg.lora, task_type=task_type)
    return model


def load_pretrained(auto, cfg: ModelConfig, path: str, device: torch.device) -> torch.nn.Module:
    """`auto.from_pretrained(path)` (a transformers Auto class: causal LM, seq2seq LM, bare
    backbone) with `cfg`'s revision (for `cfg.name_or_path` itself, not another directory),
    dtype, attention and quantization, on `device`; QLoRA's backward hook, lean activations
    (`rlhf_core.lean`: SwiGLU MLPs and RMSNorms), gradient checkpointing and the embeddings
    resized for `cfg.pad_token` as configured. No adapter: the caller adds or loads one."""
    base_path = resolve_model_path(cfg.name_or_path)
    dtype = resolve_dtype(cfg, device)
    with loading("model.name_or_path" if path == base_path else "weights", path):
        model = auto.from_pretrained(
            path,
            revision=cfg.revision if path == base_path else None,
            dtype=dtype,
            attn_implementation=resolve_attention(cfg, device),
            trust_remote_code=cfg.trust_remote_code,
            **quantized_load_kwargs(cfg.quantization, dtype, device),
        )
    if not getattr(model, "is_quantized", False):  # a k-bit model is placed while loading
        model = model.to(device)
    else:  # its full-precision tensors out of the checkpoint's file mapping (CPU)
        release_checkpoint_pages(model)
    fit_embeddings_to_pad(model, cfg)
    if cfg.quantization is not None and cfg.lora is not None:  # QLoRA training
        keep_backward_through_4bit(model)
    if cfg.lean_activations:
        apply_lean(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def is_quantized(model: torch.nn.Module) -> bool:
    """True if `model` (or the base under its adapter) was loaded with k-bit weights."""
    return bool(getattr(model, "is_quantized", False) or getattr(
        getattr(model, "base_model", None), "is_quantized", False))  # fmt: skip


def apply_lora(model, lora: LoraConfig, *, task_type: str = "CAUSAL_LM"):
    """Wrap `model` in a peft LoRA adapter with per-architecture default target modules.

    `task_type` is peft's: CAUSAL_LM for a causal LM, SEQ_2_SEQ_LM for an encoder-decoder one
    (T5), FEATURE_EXTRACTION for a bare backbone
    (`AutoModel`, as under a scalar head)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = lora.target_modules or LORA_TARGETS.get(model.config.model_type, "all-linear")
    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type=task_type,
    )
    # `is_gradient_checkpointing` is a deprecated alias (FutureWarning) in transformers >= 5.
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        model.enable_input_require_grads()
    return get_peft_model(model, peft_cfg)


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


class ReferenceConfig(StrictModel):
    """The `reference:` block of the trainers with a reference policy pi_ref (direct alignment,
    policy gradients)."""

    mode: Literal["model", "adapter", "precomputed"] = Field(
        "model",
        description="model: a frozen copy of the starting policy; adapter: the LoRA policy with "
        "its adapter disabled (no copy); precomputed (direct alignment only): one pass before "
        "training, cached in the run dir, no reference held during training",
    )

    def check(self, models: list[ModelConfig], *, precomputed_ok: bool) -> None:
        """A config error for a mode these policies (or this trainer) cannot use."""
        if self.mode == "precomputed" and not precomputed_ok:
            raise UserError(
                "reference.mode 'precomputed' needs fixed completions to score once; this "
                "trainer samples new ones every step: use 'model' or 'adapter'"
            )
        if self.mode == "adapter":
            other = "'model' or 'precomputed'" if precomputed_ok else "'model'"
            for m in models:
                if m.lora is None:
                    raise UserError(
                        f"reference.mode 'adapter' needs LoRA: model {m.name_or_path!r} has no "
                        f"'lora' block (use mode {other} for full fine-tuning)"
                    )


class ReferencePolicy:
    """The frozen reference pi_ref: a deep copy (mode "copy") or the LoRA policy with its adapter
    disabled (mode "adapter", no second copy of the weights)."""

    def __init__(
        self, policy: torch.nn.Module, mode: Literal["copy", "adapter", "frozen"] = "copy"
    ) -> None:
        """mode "copy": deep-copy `policy` and freeze the copy; "frozen": freeze and use `policy`
        itself (a separately loaded reference model); "adapter": see the class docstring."""
        self.mode = mode
        if mode == "frozen":
            self._model = policy.requires_grad_(False).eval()
        elif mode == "adapter":
            if not is_peft_model(policy):
                raise UserError(
                    "reference mode 'adapter' needs a LoRA policy (set model.lora); "
                    "use mode 'copy' for full fine-tuning"
                )
            self._model = policy
        elif mode == "copy":
            self._model = copy.deepcopy(policy)
            self._model.requires_grad_(False)
            self._model.eval()
        else:
            raise UserError(
                f"unknown reference mode {mode!r}; expected 'copy', 'frozen' or 'adapter'"
            )

    @property
    def own_model(self) -> torch.nn.Module | None:
        """The reference's own weights when it holds a second model (modes copy and frozen)."""
        return None if self.mode == "adapter" else self._model

    @contextmanager
    def model(self) -> Iterator[torch.nn.Module]:
        """The module to run as pi_ref, in eval mode, inside this context."""
        ctx = self._model.disable_adapter() if self.mode == "adapter" else nullcontext()
        with eval_mode(self._model), ctx:
            yield self._model

    @torch.no_grad()
    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0
    ) -> torch.Tensor:
        """Next-token log-probs under pi_ref, (B, S - 1); see `causal_lm_token_logprobs`."""
        with self.model() as ref:
            return causal_lm_token_logprobs(ref, input_ids, attention_mask, temperature=temperature)


def load_reference(
    reference: ReferenceConfig, model: ModelConfig, policy: torch.nn.Module, engine: Engine
) -> ReferencePolicy:
    """pi_ref for `reference.mode`: the LoRA `policy` with its adapter disabled ("adapter"), or
    the starting policy `model` loaded again, frozen and placed by `engine` ("model" and
    "precomputed"; never the resumed weights, and without LoRA)."""
    if reference.mode == "adapter":
        return ReferencePolicy(policy, "adapter")
    start = load_policy(model.model_copy(update={"lora": None}), engine.accelerator.device)
    return ReferencePolicy(engine.prepare(start, trainable=False), "frozen")
