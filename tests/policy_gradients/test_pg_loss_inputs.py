"""A policy-gradient loss needs only the tensors it reads: `LossInputs`, no token ids."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policy_gradients.experience import Experience, LossInputs
from policy_gradients.losses import LOSSES, VALUE_LOSSES

F64 = torch.float64


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    logp = -torch.rand(3, 4, generator=g, dtype=F64) - 0.1
    return {
        "action_mask": mask,
        "logp": logp,
        "log_probs_old": logp - 0.3 * torch.randn(3, 4, generator=g, dtype=F64),
        "advantages": torch.randn(3, 4, generator=g, dtype=F64),
        "log_probs_ref": logp + 0.2 * torch.randn(3, 4, generator=g, dtype=F64),
        "values_old": torch.randn(3, 4, generator=g, dtype=F64),
        "returns": torch.randn(3, 4, generator=g, dtype=F64),
    }


def test_loss_inputs_are_exactly_what_the_losses_read():
    names = {f.name for f in dataclasses.fields(LossInputs)}
    assert names == {
        "action_mask", "advantages", "log_probs_old", "log_probs_ref", "values_old", "returns"
    }  # fmt: skip
    assert issubclass(Experience, LossInputs)


@pytest.mark.parametrize("name", ["pg", "clipped", "gspo", "cispo"])
def test_policy_loss_from_loss_inputs_equals_from_experience(name):
    d = _tensors()
    loss_fn = LOSSES.get(name)(kl_beta=0.05)
    keep = ("action_mask", "advantages", "log_probs_old", "log_probs_ref")
    inputs = LossInputs(**{k: d[k] for k in keep})
    exp = Experience(
        **{k: d[k] for k in keep},
        sequence_ids=torch.zeros(3, 6, dtype=torch.long),
        attention_mask=torch.ones(3, 6, dtype=torch.long),
    )
    logp = d["logp"].clone().requires_grad_(True)
    loss, metrics = loss_fn(logp, inputs)
    loss.backward()
    grad = logp.grad.clone()
    logp.grad = None
    loss_exp, metrics_exp = loss_fn(logp, exp)
    loss_exp.backward()
    torch.testing.assert_close(loss, loss_exp, rtol=0, atol=0)
    torch.testing.assert_close(grad, logp.grad, rtol=0, atol=0)
    assert metrics.keys() == metrics_exp.keys() and "kl" in metrics


def test_value_loss_needs_only_mask_old_values_and_returns():
    d = _tensors()
    inputs = LossInputs(
        action_mask=d["action_mask"], values_old=d["values_old"], returns=d["returns"]
    )
    values = torch.randn(3, 4, dtype=F64, requires_grad=True)
    loss, _ = VALUE_LOSSES.get("value")()(None, inputs, values=values)
    loss.backward()
    assert torch.isfinite(loss) and values.grad[~d["action_mask"]].abs().sum() == 0


def test_a_missing_field_is_named():
    d = _tensors()
    with pytest.raises(ValueError, match=r"needs experience.advantages"):
        inputs = LossInputs(action_mask=d["action_mask"], log_probs_old=d["log_probs_old"])
        LOSSES.get("pg")()(d["logp"], inputs)
