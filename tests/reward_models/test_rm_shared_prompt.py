"""The shared-prompt forwards of preference batches (one packed row per pair with a 4D mask, or
the KV cache): the same rewards and gradients as encoding prompt + completion as one row, with
the prompt encoded once."""

from __future__ import annotations

import pytest
import torch

from reward_models.models import BaseRewardModel, preference_rewards
from rlhf_core.models import ModelConfig
from rlhf_core.preference import PreferencePair, batch_tokens, collate_pairs, pack_pairs
from rlhf_core.scalar_head import ScalarHeadInfo


def random_pairs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(6, 100, (n,), generator=g).tolist()

    return [PreferencePair(ids(p), ids(c), ids(r)) for p, c, r in lengths]


def build_model(
    attention: str = "sdpa", pooling: str = "last", lm_likelihood: bool = False
) -> BaseRewardModel:
    torch.manual_seed(0)
    model = BaseRewardModel.from_config(
        ModelConfig(name_or_path="tiny-qwen3", attention=attention),
        ScalarHeadInfo(kind="preference", pooling=pooling, lm_likelihood=lm_likelihood),
        "cpu",
    )
    if lm_likelihood:
        with torch.no_grad():
            model.likelihood_weight.fill_(0.5)
    return model


@pytest.fixture(scope="module")
def model():
    return build_model()


# eager attention adds the mask to the scores: a boolean 4D mask there once gave wrong rewards;
# one_row: all pairs in one row, no padding (under CPU SDPA attention runs pair by pair);
# pooling mean / sum: every layout pools exactly the completion's tokens
@pytest.mark.parametrize(
    ("layout", "attention", "pooling"),
    [("cache", "sdpa", "last"), ("packed", "sdpa", "last"), ("packed", "eager", "last"),
     ("one_row", "sdpa", "last"), ("one_row", "eager", "last"),
     ("cache", "sdpa", "sum"), ("packed", "sdpa", "mean"), ("one_row", "sdpa", "sum"),
     ("packed", "eager", "sum"), ("cache", "sdpa", "sum+lm"), ("packed", "sdpa", "mean+lm"),
     ("one_row", "sdpa", "sum+lm"), ("packed", "eager", "sum+lm")],
)  # fmt: skip
def test_shared_prompt_gives_the_same_rewards_and_gradients(layout, attention, pooling):
    model = build_model(attention, pooling.removesuffix("+lm"), pooling.endswith("+lm"))
    # ragged prompts (left-padded as prefixes) and ragged completions (right-padded); packed,
    # the 6 pairs (15, 14, 14, 22, 5, 4 tokens) fill 4 rows of 22: [22] [15, 5] [14, 4] [14]
    pairs = random_pairs([(5, 3, 7), (9, 1, 4), (2, 6, 6), (12, 8, 2), (1, 2, 2), (2, 1, 1)])
    full = collate_pairs(pairs, 0)
    if layout == "cache":
        shared = collate_pairs(pairs, 0, share_prompt=True)
        assert shared["prompt_ids"].shape == (6, 12) and shared["input_ids"].shape == (12, 8)
    elif layout == "packed":
        shared = pack_pairs(pairs, 0)
        assert shared["input_ids"].shape == (4, 22)
        assert shared["attention_mask"].shape == (4, 1, 22, 22)
    else:
        shared = pack_pairs(pairs, 0, row_tokens=80)
        assert shared["input_ids"].shape == (1, 74) and len(shared["segments"]) == 6
    assert batch_tokens(full) == batch_tokens(shared) == int(full["attention_mask"].sum())
    grads = []
    for batch in (full, shared):
        model.zero_grad()
        chosen, rejected = preference_rewards(model, batch)
        # a loss that weights every pair differently, so a row mix-up would show
        weights = torch.arange(1.0, 7.0)
        (weights * torch.nn.functional.logsigmoid(chosen - rejected)).sum().backward()
        param_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        grads.append(([chosen.detach(), rejected.detach()], param_grads))
    (rewards_full, grads_full), (rewards_shared, grads_shared) = grads
    for a, b in zip(rewards_full, rewards_shared, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(grads_full) == len(grads_shared) > 0
    for a, b in zip(grads_full, grads_shared, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "sum"])
def test_pooled_rewards_are_the_per_token_scores_of_the_completion_pooled(pooling):
    """The reward is the mean / sum of the head's scores at the completion's tokens of the
    prompt + completion row scored alone (the prompt's scores never count), in every layout."""
    model = build_model(pooling=pooling)
    pairs = random_pairs([(5, 3, 7), (9, 1, 4), (2, 6, 6)])
    expected = []
    with torch.no_grad():
        for side in ("chosen_ids", "rejected_ids"):
            for p in pairs:
                completion = getattr(p, side)
                ids = torch.tensor([p.prompt_ids + completion])
                scores = model(ids, torch.ones_like(ids))[0, len(p.prompt_ids) :, 0].double()
                expected.append(scores.mean() if pooling == "mean" else scores.sum())
        expected = torch.stack(expected).float()
        for batch in (collate_pairs(pairs, 0), collate_pairs(pairs, 0, share_prompt=True),
                      pack_pairs(pairs, 0), pack_pairs(pairs, 0, row_tokens=64)):  # fmt: skip
            chosen, rejected = preference_rewards(model, batch)
            torch.testing.assert_close(torch.cat([chosen, rejected]), expected,
                                       rtol=1e-5, atol=1e-5)  # fmt: skip


def test_pooled_rewards_differ_from_the_last_token_reward():
    """mean and sum are not the last token's score under another name."""
    pairs = random_pairs([(5, 3, 7), (9, 2, 4)])
    with torch.no_grad():
        rewards = {
            pooling: torch.cat(
                preference_rewards(build_model(pooling=pooling), pack_pairs(pairs, 0))
            )
            for pooling in ("last", "mean", "sum")
        }
    assert not torch.allclose(rewards["last"], rewards["mean"])
    assert not torch.allclose(rewards["mean"], rewards["sum"])


def test_a_batch_with_an_empty_prompt_is_collated_without_sharing():
    pairs = random_pairs([(0, 3, 4), (3, 2, 2)])
    batch = collate_pairs(pairs, 0, share_prompt=True)
    assert "prompt_ids" not in batch and batch["input_ids"].shape == (4, 5)


def test_shared_prefix_needs_whole_groups(model):
    ids = torch.ones(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of the prefixes"):
        model(ids, torch.ones_like(ids), prefix_ids=ids[:2], prefix_mask=torch.ones_like(ids[:2]))


def test_packed_mask_hides_the_chosen_tokens_from_the_rejected_ones_and_pairs_from_each_other():
    # 7, 10 and 3 tokens: row 0 holds the 10, row 1 the 7 then the 3
    pairs = random_pairs([(3, 2, 2), (4, 3, 3), (1, 1, 1)])
    batch = pack_pairs(pairs, 0)
    assert batch["input_ids"].shape == (2, 10)
    assert batch["input_ids"][1].tolist() == [
        *pairs[0].prompt_ids, *pairs[0].chosen_ids, *pairs[0].rejected_ids,
        *pairs[2].prompt_ids, *pairs[2].chosen_ids, *pairs[2].rejected_ids,
    ]  # fmt: skip
    allowed = batch["attention_mask"][1, 0].int().tolist()
    # row 1: positions 0-2 prompt, 3-4 chosen, 5-6 rejected of pair 0; 7, 8, 9 those of pair 2
    assert allowed[4] == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]  # chosen: causal within its pair
    assert allowed[6] == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0]  # rejected: the prompt and itself only
    assert allowed[9] == [0] * 7 + [1, 0, 1]  # pair 2's rejected token: its prompt and itself
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 3, 4, 3, 4, 0, 1, 1]
    # flat indices into the 2 x 10 positions, in the pairs' order
    assert batch["ends"].view(-1, 2).tolist() == [[14, 16], [6, 9], [18, 19]]
    assert batch_tokens(batch) == 7 + 3 + 10 + 4 + 3 + 1


def test_a_padding_query_attends_to_itself_only():
    batch = pack_pairs(random_pairs([(3, 2, 2), (4, 3, 3)]), 0)  # 10 does not fit beside 7
    assert batch["input_ids"].shape == (2, 10)
    allowed = batch["attention_mask"][1, 0].int().tolist()
    assert allowed[8] == [0] * 8 + [1, 0]


def test_a_4d_mask_needs_position_ids(model):
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="needs explicit position_ids"):
        model(ids, torch.ones(1, 1, 3, 3, dtype=torch.bool))


def test_lm_likelihood_is_the_backbones_own_log_likelihood_of_the_completion():
    """With the head at zero and w = 1, a sum-pooled lm_likelihood reward is log p(completion |
    prompt) under the same weights loaded as transformers' causal LM, in every layout."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.models import resolve_model_path

    model = build_model(pooling="sum", lm_likelihood=True)
    with torch.no_grad():
        model.head.weight.zero_()
        model.likelihood_weight.fill_(1.0)
    lm = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny-qwen3"), dtype=torch.float64
    ).eval()
    pairs = random_pairs([(5, 3, 7), (9, 1, 4), (2, 6, 6)])
    expected = []
    with torch.no_grad():
        for side in ("chosen_ids", "rejected_ids"):
            for p in pairs:
                ids = torch.tensor([p.prompt_ids + getattr(p, side)])
                logps = lm(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
                expected.append(logps[len(p.prompt_ids) - 1 :].sum())
        expected = torch.stack(expected).float()
        for batch in (collate_pairs(pairs, 0), collate_pairs(pairs, 0, share_prompt=True),
                      pack_pairs(pairs, 0), pack_pairs(pairs, 0, row_tokens=64)):  # fmt: skip
            chosen, rejected = preference_rewards(model, batch)
            torch.testing.assert_close(torch.cat([chosen, rejected]), expected,
                                       rtol=1e-4, atol=1e-4)  # fmt: skip


def test_every_layout_keeps_a_sliding_window(tmp_path):
    """A backbone whose first layer attends to the last 4 positions only (as Mistral's, Gemma
    2/3's): every layout's rewards equal each prompt + completion scored in its own row."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.tiny import preset_dir

    source = preset_dir("tiny-qwen3")
    config = AutoConfig.from_pretrained(source)
    config.use_sliding_window, config.sliding_window = True, 4
    config.layer_types = ["sliding_attention", "full_attention"]
    AutoModelForCausalLM.from_pretrained(source, config=config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = BaseRewardModel.from_config(
        ModelConfig(name_or_path=str(tmp_path)), ScalarHeadInfo(kind="preference"), "cpu"
    )
    assert model.backbone.config.layer_types[0] == "sliding_attention"
    pairs = random_pairs([(5, 3, 7), (9, 1, 4), (2, 6, 6), (12, 8, 2)])
    with torch.no_grad():
        alone = torch.tensor([
            model(torch.tensor([p.prompt_ids + c]), torch.ones(1, len(p.prompt_ids + c)))[0, -1, 0]
            for c_side in ("chosen_ids", "rejected_ids") for p in pairs
            for c in [getattr(p, c_side)]
        ])  # fmt: skip
        for batch in (collate_pairs(pairs, 0, share_prompt=True), pack_pairs(pairs, 0),
                      pack_pairs(pairs, 0, row_tokens=64)):  # fmt: skip
            rewards = torch.cat(preference_rewards(model, batch))
            torch.testing.assert_close(rewards, alone, rtol=1e-5, atol=1e-5)
