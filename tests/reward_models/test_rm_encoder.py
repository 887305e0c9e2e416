"""Encoder reward models (`encoder_only`): a BERT-family `...ForTokenClassification` /
`...ForSequenceClassification` checkpoint's encoder under the scalar head, as Fine-Grained RLHF's
token-level reward models are. A tiny BERT built from config (seeded) with the long-form task's
tokenizer, offline; trained as a segment, preference and outcome model, and used as a segment
reward inside fine-grained PPO of the tiny T5 policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, metric_series
from safetensors.torch import load_file
from transformers import (
    AutoModelForTokenClassification,
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
)

from policy_gradients.config import PGConfig
from policy_gradients.train import train as train_pg
from reward_models.config import RMConfig
from reward_models.train import train as train_rm
from rlhf_core.config import ConfigError, RunArgs, load_config
from rlhf_core.encoding import pad_sequences
from rlhf_core.errors import UserError
from rlhf_core.models import ModelConfig, load_tokenizer
from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel

FACTS = ModelConfig(name_or_path="tiny-qwen3-facts")  # its tokenizer: the long-form task's
NO_EXPORT = "train.export_sequence_classification=false"


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> dict[str, Path]:
    """The same seeded tiny BERT encoder saved as a token classifier and as a sequence
    classifier (2 labels), each with the facts tokenizer: plain Hugging Face directories."""
    tok = load_tokenizer(FACTS, padding_side="right")
    config = BertConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    token = BertForTokenClassification(config)
    sequence = BertForSequenceClassification(config)  # the same encoder, its own pooler + head
    missing, _ = sequence.bert.load_state_dict(token.bert.state_dict(), strict=False)
    assert all(k.startswith("pooler.") for k in missing)
    out = {}
    for name, model in (("token", token), ("sequence", sequence)):
        out[name] = tmp_path_factory.mktemp(f"bert-{name}")
        model.save_pretrained(out[name])
        tok.save_pretrained(out[name])
    return out


def encoder_rm(path: Path, **info) -> ScalarHeadModel:
    tok = load_tokenizer(ModelConfig(name_or_path=str(path)), padding_side="right")
    info = ScalarHeadInfo(encoder_only=True, chat_template=tok.chat_template, **info)
    model = ScalarHeadModel.from_config(ModelConfig(name_or_path=str(path)), info)
    model.tokenizer = tok
    return model.eval()


def test_the_encoder_head_is_the_token_classifier_and_reads_the_whole_row(tiny_bert):
    model = encoder_rm(tiny_bert["token"], kind="segment", head_dim=2, segment_level="sentence")
    assert model.backbone.pooler is None  # dropped: a token head never reads it
    plain = AutoModelForTokenClassification.from_pretrained(tiny_bert["token"]).eval()
    with torch.no_grad():
        model.head.weight.copy_(plain.classifier.weight)
    tok = model.tokenizer
    rows = [tok("Mira lives in Oslo. She has a cat.")["input_ids"], tok("Hi.")["input_ids"]]
    ids, mask = pad_sequences(rows, tok.pad_token_id)
    with torch.no_grad():
        ours = model(ids, mask)
        theirs = plain(input_ids=ids, attention_mask=mask).logits - plain.classifier.bias
        alone = model(ids[1:, : len(rows[1])], mask[1:, : len(rows[1])])
        changed = ids.clone()
        last = len(rows[0]) - 1
        changed[0, last] = (ids[0, last] + 1) % len(tok)  # the last token only
        after = model(changed, mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1, : len(rows[1])], alone[0], rtol=0, atol=1e-5)
    # bidirectional: a later token moves the first token's scores (a causal model's would not)
    assert not torch.allclose(after[0, 0], ours[0, 0])


def test_a_sequence_classifier_checkpoint_serves_too_and_saves_as_an_encoder(tiny_bert, tmp_path):
    from_token = encoder_rm(tiny_bert["token"], kind="orm")
    from_sequence = encoder_rm(tiny_bert["sequence"], kind="orm")
    token_state = from_token.backbone.state_dict()
    assert token_state.keys() == from_sequence.backbone.state_dict().keys()
    for key, value in from_sequence.backbone.state_dict().items():
        assert torch.equal(value, token_state[key]), key  # the same encoder under either head
    prompts, completions = ["Tell me about Mira."] * 2, ["Mira lives in Oslo.", "Mira has a cat."]
    before = from_sequence.score(prompts, completions)
    from_sequence.save_pretrained(tmp_path / "rm")
    assert json.loads((tmp_path / "rm" / "scalar_head.json").read_text())["encoder_only"]
    loaded = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    assert loaded.info.encoder_only and torch.equal(loaded.score(prompts, completions), before)


def rm_config(name: str, bert: Path, *overrides: str) -> RMConfig:
    quiet = [
        "train.eval_every=0",
        "train.threads=1",
        "checkpoint.save_every=0",
        "tracking.log_every=1",
    ]
    path = REPO / "configs" / "reward_models" / f"{name}.yaml"
    return load_config(RMConfig, path, [f"model.name_or_path={bert}", "encoder_only=true",
                                        *quiet, *overrides])  # fmt: skip


def test_an_encoder_preference_pair_is_never_prompt_shared(tiny_bert):
    with pytest.raises((UserError, ConfigError), match="train.share_prompt: false"):
        rm_config("tiny_preference", tiny_bert["token"], NO_EXPORT)


@pytest.mark.parametrize(
    "name, overrides",
    [("tiny_preference", ["train.share_prompt=false", NO_EXPORT]),
     ("tiny_orm", [])],
    ids=["preference", "orm"],
)  # fmt: skip
def test_encoder_preference_and_outcome_models_train(tiny_bert, tmp_path, name, overrides):
    cfg = rm_config(name, tiny_bert["token"], "train.max_steps=3", *overrides)
    assert train_rm(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    losses = metric_series(tmp_path / "run", "train/loss")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    start = load_file(tiny_bert["token"] / "model.safetensors")
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    for key, value in final.items():  # every encoder tensor trained
        assert not torch.equal(value, start[f"bert.{key}"]), key


@pytest.fixture(scope="module")
def encoder_segment_rm(tiny_bert, tmp_path_factory) -> Path:
    """A segment (relevance, per sub-sentence) reward model on the tiny BERT, trained a few steps
    by `reward_models` on the long-form task as configs/reward_models/tiny_segment_relevance.yaml
    trains the causal one."""
    out = tmp_path_factory.mktemp("encoder_segment_rm")
    cfg = rm_config("tiny_segment_relevance", tiny_bert["token"], "train.max_steps=4",
                    "data.train.limit=128", "data.eval.limit=32")  # fmt: skip
    assert train_rm(cfg, RunArgs(Path("t.yaml"), output_dir=out)) == 0
    return out / "final"


def test_an_encoder_segment_rm_rewards_fine_grained_ppo(encoder_segment_rm, tmp_path):
    rm = ScalarHeadModel.from_pretrained(encoder_segment_rm)
    assert rm.info.kind == "segment" and rm.info.encoder_only
    assert rm.backbone.config.model_type == "bert"
    data = {
        "name": "encoder_fine_grained_ppo", "seed": 0,
        "model": {"name_or_path": "tiny-t5-facts"},
        "data": {"train": {"path": str(REPO / "data" / "longform" / "prompts.jsonl"),
                           "limit": 32},
                 "prompt_column": "prompt", "answer_column": "answer"},
        "rewards": [{"name": "segment_reward_model", "label": "relevance", "weight": 1.0,
                     "path": str(encoder_segment_rm)}],
        "algorithm": {
            "name": "ppo", "advantage": {"name": "gae", "gamma": 1.0, "lam": 0.95},
            "loss": {"name": "clipped", "aggregation": "token-mean", "kl_beta": 0.0},
            "kl_in_reward": {"beta": 0.05, "estimator": "k1"},
            "value_loss": {"name": "value", "eps_value": 0.2}, "value_coef": 0.5,
            "ppo_epochs": 1, "dynamic_sampling": False,
        },
        "rollout": {"prompts_per_step": 8, "group_size": 1, "max_new_tokens": 16},
        "train": {"max_steps": 2, "micro_batch_size": 8, "threads": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"save_every": 0}, "tracking": {"log_every": 1, "plot_every": 0},
    }  # fmt: skip
    run = tmp_path / "run"
    assert train_pg(PGConfig.model_validate(data), RunArgs(Path("t.yaml"), output_dir=run)) == 0
    losses = metric_series(run, "train/loss")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    rewards = metric_series(run, "train/reward/relevance")
    # each segment's expected class reward, -P(irrelevant), summed over segments: below 0
    assert len(rewards) == 2 and all(r < 0 for r in rewards.values())


def test_an_encoder_decoder_checkpoint_serves_its_encoder(tmp_path):
    """encoder_only on a T5 directory (e.g. the SFT policy) loads its encoder alone
    (`T5EncoderModel`, no decoder), scores every token from the whole row, and saves / reloads
    as the same model."""
    from rlhf_core.tiny import preset_dir

    t5 = preset_dir("tiny-t5-facts")
    model = encoder_rm(t5, kind="segment", head_dim=2, segment_level="sentence", max_length=96)
    assert type(model.backbone).__name__ == "T5EncoderModel"
    assert getattr(model.backbone, "decoder", None) is None
    prompts = [[{"role": "user", "content": "Tell me about Ada. Notes: Ada has a cat."}]] * 2
    completions = ["Ada has a cat. Ada eats rice.", "Ada has a dog. Ada eats rice."]
    before = model.segment_scores(prompts, completions)
    assert [tuple(x.shape) for x in before] == [(2, 2), (2, 2)]
    assert not torch.equal(before[0][1], before[1][1])  # the second sentence reads the first
    model.save_pretrained(tmp_path / "rm")
    loaded = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    assert type(loaded.backbone).__name__ == "T5EncoderModel" and loaded.info.encoder_only
    for a, b in zip(loaded.segment_scores(prompts, completions), before, strict=True):
        torch.testing.assert_close(a, b)
