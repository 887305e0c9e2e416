"""Losses that anchor each response's score to a reference point rather than only the pair's
margin: KTO (paired and unpaired) and APO (zero and down). Formulas: the package docstring."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from direct_alignment.losses.base import LOSSES, DirectAlignmentLoss


def _kto_reference_points(
    chosen: torch.Tensor, rejected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """z_c, z_r = clamp(batch mean of the log-ratios, min=0), detached (no gradient through z)."""
    return chosen.mean().clamp(min=0).detach(), rejected.mean().clamp(min=0).detach()


class _KTOBase(DirectAlignmentLoss):
    """The configuration both KTO losses share: beta and the weights of desirable and
    undesirable completions (the paper's lambda_D, lambda_U)."""

    needs_reference = True
    needs_lengths = False
    mean_of_pairs = False  # the reference point z is a batch statistic

    def __init__(
        self,
        *,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
    ) -> None:
        super().__init__(beta=beta)
        for arg, value in (
            ("desirable_weight", desirable_weight),
            ("undesirable_weight", undesirable_weight),
        ):
            self._require(0 < value < math.inf, arg, value, "a positive finite number")
        self.desirable_weight = float(desirable_weight)
        self.undesirable_weight = float(undesirable_weight)


@LOSSES.register("kto")
class KTOPairLoss(_KTOBase):
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306), paired form.

        z_c = max(0, mean_batch(pc - rc)),  z_r = max(0, mean_batch(pr - rr))    (no gradient)
        desirable_i   = w_d * (1 - sigmoid(beta * ((pc_i - rc_i) - z_r)))
        undesirable_i = w_u * (1 - sigmoid(beta * (z_c - (pr_i - rr_i))))
        loss = mean of the 2B terms [desirable_1..B, undesirable_1..B]

    Differs from DPO by scoring each completion on its own against a reference point z (a KL
    estimate) instead of comparing the two completions of a pair; the chosen completion is
    "desirable", the rejected one "undesirable". The paper estimates z from mismatched
    (prompt, completion) pairs; here, following TRL's paired KTO on DPO-style data, z is a batch
    estimate: the desirable terms use the rejected half's mean log-ratio z_r and the undesirable
    terms the chosen half's z_c. As in the paper, no gradient flows through z. Because z is a
    batch statistic, the loss of a batch is not the mean of per-pair losses. Defaults: beta = 0.1,
    desirable_weight = 1, undesirable_weight = 1 (the paper's lambda_D, lambda_U).
    """

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        z_chosen, z_rejected = _kto_reference_points(chosen, rejected)
        # 1 - sigmoid(x) written as sigmoid(-x): exact for large x, no cancellation.
        desirable = self.desirable_weight * torch.sigmoid(-self.beta * (chosen - z_rejected))
        undesirable = self.undesirable_weight * torch.sigmoid(-self.beta * (z_chosen - rejected))
        return torch.cat([desirable, undesirable])

    def _extra_metrics(self, chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
        z_chosen, z_rejected = _kto_reference_points(chosen, rejected)
        return {"kto/kl_chosen": z_chosen, "kto/kl_rejected": z_rejected}


@LOSSES.register("kto_unpaired")
class KTOLoss(_KTOBase):
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv:2402.01306), eq. 8, on
    unpaired data: each row is one completion y of prompt x with a binary label (desirable or
    not), plus a completion y' of another prompt for the reference point (`data.format:
    unpaired` builds both; the loss reads them as the "chosen" and "rejected" halves).

        r_i = p_i - r_ref_i                                   log pi/pi_ref of (x_i, y_i)
        z0  = max(0, mean_batch(p'_i - r_ref'_i))             KL estimate from mismatched
                                                              (x_i, y'_i), no gradient
        desirable_i   = w_d * (1 - sigmoid(beta * (r_i - z0)))
        undesirable_i = w_u * (1 - sigmoid(beta * (z0 - r_i)))
        loss = batch mean of the terms, each row by its label

    Differs from the paired `kto` by needing no pairs at all, only thumbs-up / thumbs-down
    feedback, and by estimating z0 as the paper does: from (prompt, completion) combinations that
    were never generated together, here a fixed partner per example from another prompt (so
    the precomputed reference mode can cache it). z0 is the micro-batch estimate, not averaged
    across processes (TRL averages it across processes). The paper recommends weights with
    w_d * n_desirable / (w_u * n_undesirable) in [1, 4/3]; the trainer warns outside that range.
    Defaults: beta = 0.1, w_d = w_u = 1.

    Call: `loss_fn(p, p_kl, r_ref, r_ref_kl, labels=...)` with `labels` (B,) bool.
    """

    unpaired: ClassVar[bool] = True

    def forward(
        self,
        policy_logps: torch.Tensor,
        policy_kl_logps: torch.Tensor,
        ref_logps: torch.Tensor | None = None,
        ref_kl_logps: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        chosen_lengths: torch.Tensor | None = None,
        rejected_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed completion log-probs (B,) of the rows and of their mismatched KL rows, and
        the rows' labels (B,) bool -> (mean loss, metrics)."""
        ratio, kl_ratio = self.scores(policy_logps, policy_kl_logps, ref_logps, ref_kl_logps)
        if not isinstance(labels, torch.Tensor) or labels.shape != ratio.shape:
            got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else labels
            raise ValueError(f"{self.name} loss: labels must be a (B,) bool tensor, got {got}")
        desirable = labels.bool()
        z0 = kl_ratio.mean().clamp(min=0).detach()
        # 1 - sigmoid(x) written as sigmoid(-x): exact for large x, no cancellation
        losses = torch.where(
            desirable,
            self.desirable_weight * torch.sigmoid(-self.beta * (ratio - z0)),
            self.undesirable_weight * torch.sigmoid(-self.beta * (z0 - ratio)),
        )
        rewards = self.beta * ratio.detach()
        d = desirable.to(rewards.dtype)
        n_d, n_u = d.sum(), (1 - d).sum()
        metrics = {
            # means over the batch's desirable / undesirable rows (0 where it has none)
            "rewards/desirable": (rewards * d).sum() / n_d.clamp(min=1),
            "rewards/undesirable": (rewards * (1 - d)).sum() / n_u.clamp(min=1),
            "rewards/desirable_fraction": d.mean(),
            # rows on the side of the reference point their label asks for
            "rewards/accuracy": ((ratio.detach() > z0) == desirable).to(rewards.dtype).mean(),
            "logps/policy": policy_logps.detach().mean(),
            "kto/kl": z0,
        }
        return losses.mean(), metrics


@LOSSES.register("apo_zero")
class APOZeroLoss(DirectAlignmentLoss):
    """Anchored Preference Optimization, APO-zero (D'Oosterlinck et al. 2024, arXiv:2408.06266),
    eq. 7.

        loss = (1 - sigmoid(beta * (pc - rc))) + sigmoid(beta * (pr - rr))

    Differs from DPO by anchoring each completion's log-ratio separately instead of only their
    difference: it raises the chosen likelihood and lowers the rejected one. For chosen outputs
    better than the model's own. Default beta = 0.1 (TRL).
    """

    needs_reference = True
    needs_lengths = False

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        # 1 - sigmoid(x) written as sigmoid(-x): exact for large x, no cancellation.
        return torch.sigmoid(-self.beta * chosen) + torch.sigmoid(self.beta * rejected)


@LOSSES.register("apo_down")
class APODownLoss(DirectAlignmentLoss):
    """Anchored Preference Optimization, APO-down (D'Oosterlinck et al. 2024, arXiv:2408.06266),
    eq. 8.

        loss = sigmoid(beta * (pc - rc)) + (1 - sigmoid(beta * h))

    Differs from DPO by also anchoring the chosen log-ratio: it lowers the chosen likelihood and
    lowers the rejected one more (the second term is DPO's margin in sigmoid form). For chosen
    outputs worse than the model's own. Default beta = 0.1 (TRL).
    """

    needs_reference = True
    needs_lengths = False

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        # 1 - sigmoid(x) written as sigmoid(-x): exact for large x, no cancellation.
        return torch.sigmoid(self.beta * chosen) + torch.sigmoid(-self.beta * (chosen - rejected))
