"""The shared-prompt forward of preference batches: the same rewards and gradients as encoding
prompt + completion as one row, with the prompt encoded once."""

from __future__ import annotations

import pytest
import torch

from reward_models.data import PreferencePair, batch_tokens, collate_pairs
from reward_models.models import preference_rewards
from rlhf_core.models import ModelConfig
from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel


def random_pairs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(6, 100, (n,), generator=g).tolist()

    return [PreferencePair(ids(p), ids(c), ids(r)) for p, c, r in lengths]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ScalarHeadModel.from_config(
        ModelConfig(name_or_path="tiny-qwen3"), ScalarHeadInfo(kind="preference"), "cpu"
    )


def test_shared_prompt_gives_the_same_rewards_and_gradients(model):
    # ragged prompts (left-padded as prefixes) and ragged completions (right-padded)
    pairs = random_pairs([(5, 3, 7), (9, 1, 4), (2, 6, 6), (12, 8, 2)])
    full, shared = collate_pairs(pairs, 0), collate_pairs(pairs, 0, share_prompt=True)
    assert shared["prompt_ids"].shape == (4, 12) and shared["input_ids"].shape == (8, 8)
    assert batch_tokens(full) == batch_tokens(shared) == int(full["attention_mask"].sum())
    grads = []
    for batch in (full, shared):
        model.zero_grad()
        chosen, rejected = preference_rewards(model, batch)
        # a loss that weights every pair differently, so a row mix-up would show
        weights = torch.arange(1.0, 5.0)
        (weights * torch.nn.functional.logsigmoid(chosen - rejected)).sum().backward()
        param_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        grads.append(([chosen.detach(), rejected.detach()], param_grads))
    (rewards_full, grads_full), (rewards_shared, grads_shared) = grads
    for a, b in zip(rewards_full, rewards_shared, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(grads_full) == len(grads_shared) > 0
    for a, b in zip(grads_full, grads_shared, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_batch_with_an_empty_prompt_is_collated_without_sharing():
    pairs = random_pairs([(0, 3, 4), (3, 2, 2)])
    batch = collate_pairs(pairs, 0, share_prompt=True)
    assert "prompt_ids" not in batch and batch["input_ids"].shape == (4, 5)


def test_shared_prefix_needs_whole_groups(model):
    ids = torch.ones(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of the prefixes"):
        model(ids, torch.ones_like(ids), prefix_ids=ids[:2], prefix_mask=torch.ones_like(ids[:2]))
