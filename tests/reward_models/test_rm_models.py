"""The scalar-head reward model: pooling under left and right padding, save -> load, the
sequence-classification export, LoRA / frozen backbones, and scoring text."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification

from reward_models.models import BaseRewardModel
from rlhf_core.encoding import last_token_index, pad_sequences
from rlhf_core.errors import UserError
from rlhf_core.models import LoraConfig, ModelConfig, load_tokenizer
from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel
from rlhf_core.scalar_head_format import HEAD_CONFIG
from rlhf_core.scalar_head_scoring import pool_last_token

PROMPTS = ["Spell this word backward: cat", "hi", [{"role": "user", "content": "Reverse: abcdef"}]]
COMPLETIONS = ["tac", "a much longer completion than the others", "fedcba"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")


def make(tok, kind="preference", head_dim=1, lora=None, seed=0, **info) -> BaseRewardModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(name_or_path="tiny-qwen3", lora=lora)
    model = BaseRewardModel.from_config(
        cfg, ScalarHeadInfo(kind=kind, head_dim=head_dim, chat_template=tok.chat_template,
                            max_length=64, **info)
    )  # fmt: skip
    model.tokenizer = tok
    with torch.no_grad():  # move LoRA away from the identity so the adapter matters
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model.eval()


def test_last_token_index_under_right_left_and_no_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 4, 0]
    values = torch.arange(20.0).reshape(4, 5)
    assert pool_last_token(values, mask.bool()).tolist() == [2.0, 9.0, 14.0, 15.0]
    with pytest.raises(ValueError, match=r"values \(4, 4\) must start with the mask's shape"):
        pool_last_token(values[:, :4], mask)


def test_pooled_scores_are_the_same_under_left_right_and_no_padding(tok):
    model = make(tok)
    seqs = [e.prompt_ids + e.completion_ids for e in model._encode(PROMPTS, COMPLETIONS)]
    assert len({len(s) for s in seqs}) == 3  # really padded
    with torch.no_grad():
        alone = torch.stack([model(torch.tensor([s]), torch.ones(1, len(s)))[0, -1, 0]
                             for s in seqs])  # fmt: skip
        for side in ("left", "right"):
            ids, mask = pad_sequences(seqs, tok.pad_token_id, side=side)
            pooled = pool_last_token(model(ids, mask), mask)[:, 0]
            torch.testing.assert_close(pooled, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.score(PROMPTS, COMPLETIONS), alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora", [None, LoraConfig(r=4, alpha=8)], ids=["full", "lora"])
def test_save_then_load_gives_identical_scores(tok, tmp_path, lora):
    model = make(tok, lora=lora)
    before = model.score(PROMPTS, COMPLETIONS, batch_size=2)
    model.save_pretrained(tmp_path / "rm")
    meta = json.loads((tmp_path / "rm" / HEAD_CONFIG).read_text())
    assert meta["kind"] == "preference" and meta["head_dim"] == 1
    assert meta["chat_template"] == tok.chat_template
    assert meta["backbone"] == ("adapter" if lora else "full")
    assert meta["base_model"] == ("tiny-qwen3" if lora else None)
    loaded = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    assert not loaded.training and loaded.is_adapter == (lora is not None)
    assert torch.equal(loaded.score(PROMPTS, COMPLETIONS, batch_size=2), before)
    if lora is None:  # the backbone is a plain transformers directory
        plain = AutoModel.from_pretrained(tmp_path / "rm")
        assert torch.equal(plain.embed_tokens.weight, model.backbone.embed_tokens.weight)


@pytest.mark.parametrize("lora", [None, LoraConfig(r=4, alpha=8)], ids=["full", "lora"])
def test_sequence_classification_export_gives_identical_scores(tok, tmp_path, lora):
    model = make(tok, lora=lora)
    out = model.export_sequence_classification(tmp_path / "seqcls")
    exported = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(exported).__name__ == "Qwen3ForSequenceClassification"
    assert exported.config.num_labels == 1 and exported.config.pad_token_id == tok.pad_token_id
    seqs = [e.prompt_ids + e.completion_ids for e in model._encode(PROMPTS, COMPLETIONS)]
    ids, mask = pad_sequences(seqs, tok.pad_token_id, side="right")
    with torch.no_grad():
        theirs = exported(input_ids=ids, attention_mask=mask).logits[:, 0]
        ours = pool_last_token(model(ids, mask), mask)[:, 0]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    # and it loads back through rlhf_core as a scalar-head model (how policy_gradients reads it)
    back = ScalarHeadModel.from_pretrained(out)
    torch.testing.assert_close(back.score(PROMPTS, COMPLETIONS), ours, rtol=0, atol=1e-6)


def test_export_refuses_what_it_cannot_export_faithfully(tok, tmp_path):
    with pytest.raises(ValueError, match="only preference models export"):
        make(tok, kind="orm").export_sequence_classification(tmp_path / "x")
    with pytest.warns(UserWarning, match="no pad token"):
        gpt2 = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3-gpt2"), padding_side="right")
    with pytest.raises(ValueError, match="pad = eos"):
        make(tok).export_sequence_classification(tmp_path / "y", tokenizer=gpt2)


@pytest.mark.parametrize("pooling", ["mean", "sum"])
def test_a_pooled_model_scores_text_as_it_was_trained_and_saves_its_pooling(tok, tmp_path, pooling):
    model = make(tok, pooling=pooling)
    encoded = model._encode(PROMPTS, COMPLETIONS)
    with torch.no_grad():  # each completion's token scores, alone in its row, pooled
        expected = []
        for e in encoded:
            ids = torch.tensor([e.prompt_ids + e.completion_ids])
            tokens = model(ids, torch.ones_like(ids))[0, len(e.prompt_ids) :, 0]
            expected.append(tokens.mean() if pooling == "mean" else tokens.sum())
    score = model.score(PROMPTS, COMPLETIONS, batch_size=2)
    torch.testing.assert_close(score, torch.stack(expected), rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path / "rm")
    assert json.loads((tmp_path / "rm" / HEAD_CONFIG).read_text())["pooling"] == pooling
    loaded = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    assert loaded.info.pooling == pooling
    assert torch.equal(loaded.score(PROMPTS, COMPLETIONS, batch_size=2), score)
    # transformers' sequence classifiers read the last token: an export would score differently
    with pytest.raises(UserError, match="pools .* over the completion"):
        model.export_sequence_classification(tmp_path / "seqcls")


def test_an_lm_likelihood_model_saves_its_weight_and_scores_the_same_after_loading(tok, tmp_path):
    model = make(tok, pooling="sum", lm_likelihood=True)
    with torch.no_grad():
        model.likelihood_weight.fill_(0.7)
    before = model.score(PROMPTS, COMPLETIONS, batch_size=2)
    model.save_pretrained(tmp_path / "rm")
    loaded = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    assert loaded.info.lm_likelihood and loaded.likelihood_weight.item() == pytest.approx(0.7)
    assert torch.equal(loaded.score(PROMPTS, COMPLETIONS, batch_size=2), before)
    with torch.no_grad():  # the feature really counts: w = 0 scores differently
        loaded.likelihood_weight.zero_()
    assert not torch.allclose(loaded.score(PROMPTS, COMPLETIONS), before)


def test_pooling_is_for_preference_models_only():
    with pytest.raises(ValueError, match="pooling 'sum' is for preference models only"):
        ScalarHeadInfo(kind="orm", pooling="sum")
    with pytest.raises(ValueError, match="pooling 'max'"):
        ScalarHeadInfo(kind="preference", pooling="max")
    with pytest.raises(ValueError, match="lm_likelihood is for preference models with pooling"):
        ScalarHeadInfo(kind="preference", lm_likelihood=True)


def test_frozen_backbone_trains_only_the_head(tok):
    torch.manual_seed(0)
    model = BaseRewardModel.from_config(
        ModelConfig(name_or_path="tiny-qwen3"), ScalarHeadInfo(kind="preference"),
        freeze_backbone=True,
    )  # fmt: skip
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["head.weight"]
    ids = torch.tensor([tok("abc")["input_ids"]])
    model(ids, torch.ones_like(ids)).sum().backward()
    assert model.head.weight.grad is not None
    with pytest.raises(ValueError, match="freeze_backbone and LoRA"):
        BaseRewardModel.from_config(
            ModelConfig(name_or_path="tiny-qwen3", lora=LoraConfig()),
            ScalarHeadInfo(kind="preference"), freeze_backbone=True,
        )  # fmt: skip


def test_head_init_std_and_shape(tok):
    model = make(tok, kind="prm", head_dim=3, step_separator="\n")
    assert model.head.weight.shape == (3, 128) and model.head.bias is None
    assert 0.015 < model.head.weight.std().item() < 0.025
    with pytest.raises(ValueError, match="kind 'prm' needs a step_separator"):
        ScalarHeadInfo(kind="prm", head_dim=3)
    with pytest.raises(ValueError, match="expected one of"):
        ScalarHeadInfo(kind="reward")


def test_orm_and_prm_scores(tok, tmp_path):
    orm = make(tok, kind="orm")
    logits = orm.pooled_scores(PROMPTS, COMPLETIONS)[:, 0]
    torch.testing.assert_close(orm.score(PROMPTS, COMPLETIONS), torch.sigmoid(logits))
    per_token = orm.token_scores(PROMPTS, COMPLETIONS)
    assert [len(t) for t in per_token] == [len(c) + 1 for c in COMPLETIONS]  # chars + eos
    torch.testing.assert_close(torch.stack([t[-1, 0] for t in per_token]), logits)

    prm = make(tok, kind="prm", head_dim=3, step_separator="\n")
    steps = [["a = 1", "b = 2", "so 3"], ["x"], ["one", "two"]]
    per_step = prm.step_scores(PROMPTS, steps)
    assert [len(p) for p in per_step] == [3, 1, 2]
    assert all(((p > 0) & (p < 1)).all() for p in per_step)
    as_text = prm.score(PROMPTS, ["\n".join(s) for s in steps])
    torch.testing.assert_close(as_text, torch.stack([p.min() for p in per_step]))
    prods = prm.score(PROMPTS, steps, step_reduction="prod")
    torch.testing.assert_close(prods, torch.stack([p.prod() for p in per_step]))
    prm.save_pretrained(tmp_path / "prm")
    again = ScalarHeadModel.from_pretrained(tmp_path / "prm").step_scores(PROMPTS, steps)
    assert all(torch.equal(a, b) for a, b in zip(again, per_step, strict=True))
