"""`model.pad_token`: a GPT-2-style reward model (pad = eos) gets a distinct pad token and resized
embeddings, trains, exports to `...ForSequenceClassification`, and plain transformers reads the
export with the same scores as the reward model's own `score`."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import REPO
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
)

from reward_models.config import RMConfig
from reward_models.train import train
from rlhf_core.chat import render_prompt
from rlhf_core.config import RunArgs, load_config
from rlhf_core.encoding import encode_completions, pad_sequences
from rlhf_core.errors import UserError
from rlhf_core.models import LoraConfig, ModelConfig, load_policy, load_tokenizer
from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel
from rlhf_core.tiny import ASSETS

PAD = "<|pad|>"
PROMPTS = ["Spell this word backward: cat", "hi", "Spell this word backward: window"]
COMPLETIONS = ["tac", "a much longer completion than the others here", "wodniw"]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """A tiny GPT-2-architecture causal LM built from config (seeded) with the vendored GPT-2
    tokenizer (50257 tokens, eos <|endoftext|>, no pad token), as a plain HF directory."""
    out = tmp_path_factory.mktemp("tiny-gpt2")
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "gpt2")
    assert tokenizer.pad_token is None and len(tokenizer) == 50257
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=256, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_pad_token_is_added_and_every_model_of_the_config_is_resized(gpt2_dir):
    cfg = ModelConfig(name_or_path=str(gpt2_dir), pad_token=PAD)
    tok = load_tokenizer(cfg, padding_side="right")
    assert tok.pad_token == PAD and tok.pad_token_id == 50257 != tok.eos_token_id
    policy = load_policy(cfg)
    assert policy.get_input_embeddings().weight.shape[0] == 50258
    assert policy.get_output_embeddings().weight is policy.get_input_embeddings().weight
    rm = ScalarHeadModel.from_config(cfg, ScalarHeadInfo(kind="preference"))
    assert rm.backbone.get_input_embeddings().weight.shape[0] == 50258
    # unset: pad falls back to eos and nothing is resized (as before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = load_tokenizer(ModelConfig(name_or_path=str(gpt2_dir)), padding_side="right")
    assert plain.pad_token_id == plain.eos_token_id and len(plain) == 50257
    with pytest.raises(UserError, match=r"model.pad_token '<\|endoftext\|>' is .*eos"):
        load_tokenizer(cfg.model_copy(update={"pad_token": "<|endoftext|>"}), padding_side="left")


def transformers_scores(directory: Path, prompts: list[str], completions: list[str]) -> list:
    """Scores of the exported directory read by plain transformers: the texts encoded as the
    reward model encodes them (chat template, eos), padded on the right with the pad token."""
    seq = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tok = AutoTokenizer.from_pretrained(directory)
    texts = [render_prompt(tok, p, where="prompt") for p in prompts]
    encoded = encode_completions(tok, texts, completions, max_length=64, max_prompt_length=24)
    ids, mask = pad_sequences([e.prompt_ids + e.completion_ids for e in encoded], tok.pad_token_id)
    assert (ids == tok.pad_token_id).any()  # the batch really is padded
    with torch.no_grad():
        return seq(input_ids=ids, attention_mask=mask).logits[:, 0]


def test_gpt2_rm_with_pad_token_exports_to_sequence_classification_with_the_same_scores(
    gpt2_dir, tmp_path
):
    path = REPO / "configs" / "reward_models" / "tiny_preference.yaml"
    overrides = [
        f"model.name_or_path={gpt2_dir}", f"model.pad_token={PAD}", "train.max_steps=3",
        "train.eval_every=0", "train.threads=1", "checkpoint.save_every=0",
    ]  # fmt: skip
    cfg = load_config(RMConfig, path, overrides)
    assert cfg.train.export_sequence_classification
    assert train(cfg, RunArgs(path, output_dir=tmp_path / "run")) == 0
    final, export = tmp_path / "run" / "final", tmp_path / "run" / "final-seqcls"
    config = json.loads((export / "config.json").read_text())
    assert config["pad_token_id"] == 50257 and config["vocab_size"] == 50258
    rm = ScalarHeadModel.from_pretrained(final)
    assert rm.tokenizer.pad_token == PAD
    ours = rm.score(PROMPTS, COMPLETIONS)
    theirs = transformers_scores(export, PROMPTS, COMPLETIONS)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert ours.std() > 0  # the rows score differently: a real comparison


def test_a_lora_rm_with_pad_token_reloads_onto_a_resized_base(gpt2_dir, tmp_path):
    """The adapter directory holds no embeddings: loading it resizes the base for the saved
    tokenizer's pad token again, so the padded batch scores as before saving."""
    cfg = ModelConfig(name_or_path=str(gpt2_dir), pad_token=PAD, lora=LoraConfig(r=4, alpha=8))
    tok = load_tokenizer(cfg, padding_side="right")
    torch.manual_seed(0)
    info = ScalarHeadInfo(kind="preference", chat_template=tok.chat_template, max_length=64)
    model = ScalarHeadModel.from_config(cfg, info)
    model.tokenizer = tok
    with torch.no_grad():  # move LoRA away from the identity so the adapter matters
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    before = model.eval().score(PROMPTS, COMPLETIONS)
    model.save_pretrained(tmp_path / "rm")
    assert (tmp_path / "rm" / "adapter_config.json").is_file()
    loaded = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    assert loaded.tokenizer.pad_token_id == 50257
    assert loaded.backbone.get_input_embeddings().weight.shape[0] == 50258
    torch.testing.assert_close(loaded.score(PROMPTS, COMPLETIONS), before, rtol=0, atol=1e-6)
