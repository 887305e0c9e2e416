"""The offline tiny world: small tokenizers and Qwen3 model presets built from config.

Nothing here is a mock. A preset is a real `transformers` Qwen3 model (random, seeded init) plus a
real `tokenizers` tokenizer wrapped as a transformers fast tokenizer with a chat template, saved
as an ordinary Hugging Face directory and then loaded with `from_pretrained` exactly as a user
loads Qwen3-0.6B. Presets are built once, deterministically, into a cache directory
(`$RLHF_LAB_CACHE`, default `~/.cache/rlhf-lab`).

Tokenizers (all deterministic, no downloads):
  char      one token per printable ASCII character + newline/tab (~100 ids) plus special tokens
            <|pad|> <|end|> (eos / end of turn) <|user|> <|assistant|> <|system|> <|unk|>.
            Made for reasoning-gym `spell_backward`: a 50k vocabulary makes training ~25x and
            sampling ~29x slower on a CPU, for no gain on a character-level task.
  arith     byte-level BPE with single-digit pre-tokenization, ~300 ids, trained on a fixed
            reasoning-gym arithmetic corpus; for chain_sum / basic_arithmetic style tasks.
  gpt2      the real GPT-2 tokenizer (vendored, MIT), no pad token and no chat template, so
            the pad = eos and default-template paths are exercised as with a real hub model.
  facts     byte-level BPE, ~400 ids, trained on the synthetic long-form QA task of
            `rlhf_core.longform` (most words are one token), for Fine-Grained RLHF.

Presets (hidden 128, 2 layers, 4 heads, MLP 512, tied embeddings ~0.53M params, unless noted):
  tiny-qwen3 (char), tiny-qwen3-arith (arith), tiny-qwen3-gpt2 (gpt2, hidden 64, MLP 256),
  tiny-qwen3-facts (facts: the reward models of the long-form task), tiny-qwen3-facts-4l (the
  same with 4 layers, ~1.1M params: the factuality reward model's backbone, pre-trained first as
  a language model on the task's text).
  tiny-gpt2: a GPT-2-architecture `GPT2LMHeadModel` (gpt2 tokenizer; learned positions up to
  1024, GELU MLP 512, tied embeddings, no dropout; ~7.0M params, 6.4M of them the embedding), the
  policy of the GPT-2 + HH workflow (docs/workflows/gpt2_hh.md).
  tiny-t5-facts: an encoder-decoder `T5ForConditionalGeneration` (facts; d_model 64, 2 encoder +
  2 decoder layers, 4 heads, d_ff 256, tied embeddings, decoder start = pad as in T5), the
  encoder-decoder policy of `rlhf_core.policy_model`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ASSETS = Path(__file__).parent / "assets"
PAD, END, USER, ASSISTANT, SYSTEM, UNK = (
    "<|pad|>",
    "<|end|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|unk|>",
)
SPECIAL_TOKENS = [PAD, END, USER, ASSISTANT, SYSTEM, UNK]

#: Chat template of the tiny tokenizers: one special token per role, <|end|> closes a turn.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


@dataclass(frozen=True)
class TinyPreset:
    """Architecture and tokenizer of one tiny-world model."""

    tokenizer: str
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    seed: int = 0
    architecture: str = "qwen3"  # or "t5" (encoder-decoder), "gpt2"


PRESETS: dict[str, TinyPreset] = {
    "tiny-qwen3": TinyPreset(tokenizer="char"),
    "tiny-qwen3-arith": TinyPreset(tokenizer="arith"),
    "tiny-qwen3-gpt2": TinyPreset(
        tokenizer="gpt2", hidden_size=64, intermediate_size=256, max_position_embeddings=1024
    ),
    "tiny-qwen3-facts": TinyPreset(tokenizer="facts"),
    "tiny-qwen3-facts-4l": TinyPreset(tokenizer="facts", num_hidden_layers=4),
    "tiny-t5-facts": TinyPreset(
        tokenizer="facts", hidden_size=64, intermediate_size=256, architecture="t5"
    ),
    "tiny-gpt2": TinyPreset(tokenizer="gpt2", max_position_embeddings=1024, architecture="gpt2"),
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def cache_root() -> Path:
    return Path(os.environ.get("RLHF_LAB_CACHE", Path.home() / ".cache" / "rlhf-lab"))


# ----------------------------------------------------------------------------- tokenizers


def _wrap(tok, *, chat_template: str | None, eos: str, pad: str | None, unk: str | None):
    from transformers import PreTrainedTokenizerFast

    kwargs = {"eos_token": eos, "model_max_length": 4096}
    if pad is not None:
        kwargs["pad_token"] = pad
    if unk is not None:
        kwargs["unk_token"] = unk
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if chat_template is not None:
        wrapped.chat_template = chat_template
    return wrapped


def build_char_tokenizer():
    """One id per printable ASCII character (+ newline, tab) after the special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = ["\n", "\t"] + [c for c in string.printable if c not in "\n\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return _wrap(tok, chat_template=TINY_CHAT_TEMPLATE, eos=END, pad=PAD, unk=UNK)


def _arith_corpus() -> list[str]:
    import reasoning_gym

    texts = []
    for task in ("chain_sum", "basic_arithmetic"):
        for entry in reasoning_gym.create_dataset(task, size=1000, seed=1234):
            texts.append(f"{entry['question']}\n{entry['answer']}")
    return texts


def _byte_level_bpe(texts: Iterable[str], vocab_size: int, *, split_digits: bool):
    """A byte-level BPE tokenizer with the tiny chat template, trained on `texts`; with
    `split_digits` every digit is its own pre-token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split_digits:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok, chat_template=TINY_CHAT_TEMPLATE, eos=END, pad=PAD, unk=None)


def build_arith_tokenizer(vocab_size: int = 300):
    """Byte-level BPE (digits always split) trained on a fixed reasoning-gym arithmetic corpus."""
    return _byte_level_bpe(_arith_corpus(), vocab_size, split_digits=True)


def build_facts_tokenizer(vocab_size: int = 400):
    """Byte-level BPE trained on the synthetic long-form QA corpus (`rlhf_core.longform`)."""
    from rlhf_core.longform import corpus

    return _byte_level_bpe(corpus(), vocab_size, split_digits=False)


def build_gpt2_tokenizer():
    """The vendored real GPT-2 tokenizer, as shipped (no pad token, no chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSETS / "gpt2"))


TOKENIZER_BUILDERS = {
    "char": build_char_tokenizer,
    "arith": build_arith_tokenizer,
    "gpt2": build_gpt2_tokenizer,
    "facts": build_facts_tokenizer,
}


# ----------------------------------------------------------------------------- models


def build_tiny_t5(preset: TinyPreset, eos_id: int, pad_id: int, vocab_size: int):
    """A seeded, randomly initialised T5 encoder-decoder (decoder start token = pad, as T5)."""
    from transformers import AutoModelForSeq2SeqLM, T5Config

    config = T5Config(
        vocab_size=vocab_size,
        d_model=preset.hidden_size,
        d_kv=preset.hidden_size // preset.num_attention_heads,
        d_ff=preset.intermediate_size,
        num_layers=preset.num_hidden_layers,
        num_decoder_layers=preset.num_hidden_layers,
        num_heads=preset.num_attention_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.0,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        decoder_start_token_id=pad_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        return AutoModelForSeq2SeqLM.from_config(config, dtype=torch.float32)


def build_tiny_gpt2(preset: TinyPreset, eos_id: int, vocab_size: int):
    """A seeded, randomly initialised GPT-2 causal LM (dropout off: RL scores the same tokens
    in rollout and update; bos = eos = pad as in GPT-2)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(
        vocab_size=vocab_size, n_positions=preset.max_position_embeddings,
        n_embd=preset.hidden_size, n_layer=preset.num_hidden_layers,
        n_head=preset.num_attention_heads, n_inner=preset.intermediate_size,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build_tiny_model(preset: TinyPreset, tokenizer):
    """A seeded, randomly initialised Qwen3 causal LM (or T5 or GPT-2, per
    `preset.architecture`) sized for the tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token is not None else eos_id
    if preset.architecture == "t5":
        model = build_tiny_t5(preset, eos_id, pad_id, len(tokenizer))
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = pad_id
        model.generation_config.decoder_start_token_id = pad_id
        return model
    if preset.architecture == "gpt2":
        model = build_tiny_gpt2(preset, eos_id, len(tokenizer))
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = pad_id
        return model
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.hidden_size // preset.num_attention_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    return model


def preset_dir(name: str) -> Path:
    """Build the preset `name` into the cache once (atomically) and return its directory."""
    if name not in PRESETS:
        raise KeyError(f"unknown tiny preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    import transformers

    fields = asdict(preset)
    if fields["architecture"] == "qwen3":  # keeps the cache keys of the presets made before T5
        del fields["architecture"]
    spec = json.dumps({"preset": fields, "format": 1, "tf": transformers.__version__})
    digest = hashlib.sha256(spec.encode()).hexdigest()[:10]
    target = cache_root() / "tiny" / f"{name}-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        tokenizer = TOKENIZER_BUILDERS[preset.tokenizer]()
        model = build_tiny_model(preset, tokenizer)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "rlhf_lab_preset.json").write_text(spec + "\n")
        try:
            os.replace(tmp, target)  # atomic; loses the race harmlessly if another process won
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
