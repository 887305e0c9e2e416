"""The completion-only NLL against an independent float64 cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from instruction_tuning.losses import LOSSES
from rlhf_core.logprobs import token_logprobs


def test_nll_equals_masked_cross_entropy_over_completion_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    mask = torch.tensor(
        [[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1]]
    ).bool()
    loss, metrics = LOSSES.get("nll")()(token_logprobs(logits, labels), mask, mask.sum())
    per_token = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none")
    expected = per_token[mask.reshape(-1)].mean()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    assert metrics["tokens"] == mask.sum()
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad[~mask].abs().sum() == 0  # prompt and padding positions get no gradient


def test_split_batches_sum_to_the_big_batch_loss():
    """Dividing by the step's total token count makes accumulation exact."""
    gen = torch.Generator().manual_seed(1)
    logps = -torch.rand(8, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(8, 5, generator=gen) > 0.3
    loss_fn = LOSSES.get("nll")()
    whole, _ = loss_fn(logps, mask, mask.sum())
    parts = sum(loss_fn(logps[i : i + 2], mask[i : i + 2], mask.sum())[0] for i in range(0, 8, 2))
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-12)
