"""The base of every direct alignment loss: `DirectAlignmentLoss` (input checks, per-response
scores, metrics), the registry `LOSSES`, `loss_inputs` and `log1mexp`. The formulas are in the
package docstring (`direct_alignment.losses`)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from rlhf_core.registry import Configurable, Registry

LOSSES: Registry[type[DirectAlignmentLoss]] = Registry("direct alignment loss")

# ORPO needs log(1 - p) with p = exp(avg) < 1; averages above this are clamped here (a per-token
# probability above 0.999999), which caps a log-odds at about 13.8 and stops the odds-term gradient.
ORPO_MAX_AVG_LOGP = -1e-6
_LN2 = math.log(2.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate for all x < 0 (Maechler 2012, "Accurately Computing
    log(1 - exp(-|a|))"): log(-expm1(x)) for x > -ln 2, log1p(-exp(x)) otherwise.

    Both branches are finite for x < 0; x >= 0 gives -inf or nan, so callers clamp first.
    """
    return torch.where(x > -_LN2, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def loss_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword inputs of a loss from a `collate_pairs` batch: both halves' completion
    lengths, and the labels of unpaired rows."""
    half = batch["lengths"].shape[0] // 2
    inputs = {
        "chosen_lengths": batch["lengths"][:half],
        "rejected_lengths": batch["lengths"][half:],
    }
    if "labels" in batch:
        inputs["labels"] = batch["labels"]
    return inputs


class DirectAlignmentLoss(Configurable, nn.Module):
    """Input checks, per-response scores and metrics shared by every direct alignment loss.

    A subclass sets `needs_reference` and `needs_lengths` and implements `_losses(chosen,
    rejected)`, which maps the (B,) scores of `scores` to per-pair losses. Configuration is by
    keyword only, stored under the keyword's own name (so `extra_repr` can show it); beta
    defaults to DPO's 0.1, and a loss with only beta declares no constructor.
    """

    name: ClassVar[str] = "direct alignment loss"  # replaced by the registered name
    needs_reference: ClassVar[bool]
    # Lengths are only ever used to turn summed log-probs into per-token averages. A class
    # attribute everywhere except `ipo`, which sets it per instance from `length_normalize`.
    needs_lengths: bool
    # Unpaired losses (KTO on labelled single completions) read the rows' labels instead of a
    # preference: `forward(..., labels=...)`, data from `data.format: unpaired`.
    unpaired: ClassVar[bool] = False
    # Whether a batch's loss is the mean of its per-pair losses, so that how a step's pairs are
    # split into forwards changes only rounding (not KTO: its reference point is a batch mean).
    mean_of_pairs: ClassVar[bool] = True

    def __init__(self, *, beta: float = 0.1) -> None:
        super().__init__()
        self._require(0 < beta < math.inf, "beta", beta, "a positive finite number")
        self.beta = float(beta)

    def forward(
        self,
        policy_chosen_logps: torch.Tensor,
        policy_rejected_logps: torch.Tensor,
        ref_chosen_logps: torch.Tensor | None = None,
        ref_rejected_logps: torch.Tensor | None = None,
        *,
        chosen_lengths: torch.Tensor | None = None,
        rejected_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Summed completion log-probs (B,) and token counts (B,) -> (mean loss, metrics)."""
        chosen, rejected = self.scores(
            policy_chosen_logps,
            policy_rejected_logps,
            ref_chosen_logps,
            ref_rejected_logps,
            chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths,
        )
        loss = self._losses(chosen, rejected).mean()
        extra, extra_metrics = self._extra_term(policy_chosen_logps, chosen_lengths)
        if extra is not None:
            loss = loss + extra
        c, r = chosen.detach(), rejected.detach()
        reward_c, reward_r = self.beta * c, self.beta * r
        metrics = {
            "rewards/chosen": reward_c.mean(),
            "rewards/rejected": reward_r.mean(),
            "rewards/margin": (reward_c - reward_r).mean(),
            "rewards/accuracy": (reward_c > reward_r).to(c.dtype).mean(),
            "logps/chosen": policy_chosen_logps.detach().mean(),
            "logps/rejected": policy_rejected_logps.detach().mean(),
            **self._extra_metrics(c, r),
            **extra_metrics,
        }
        return loss, metrics

    def scores(
        self,
        policy_chosen_logps: torch.Tensor,
        policy_rejected_logps: torch.Tensor,
        ref_chosen_logps: torch.Tensor | None = None,
        ref_rejected_logps: torch.Tensor | None = None,
        *,
        chosen_lengths: torch.Tensor | None = None,
        rejected_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Check the inputs and return the (B,) per-response scores the loss works on.

        Reference-based: pc - rc and pr - rr; divided by the lengths when `needs_lengths`
        (= avg_pc - avg_rc). Reference-free: avg_c and avg_r. Arguments a loss does not need are
        ignored.
        """
        logps = {
            "policy_chosen_logps": policy_chosen_logps,
            "policy_rejected_logps": policy_rejected_logps,
        }
        if self.needs_reference:
            what = "summed completion log-probs under the reference model"
            logps["ref_chosen_logps"] = self._needed("ref_chosen_logps", ref_chosen_logps, what)
            logps["ref_rejected_logps"] = self._needed(
                "ref_rejected_logps", ref_rejected_logps, what
            )
        lengths = {}
        if self.needs_lengths:
            what = "completion token counts"
            lengths["chosen_lengths"] = self._needed("chosen_lengths", chosen_lengths, what)
            lengths["rejected_lengths"] = self._needed("rejected_lengths", rejected_lengths, what)
        self._check_tensors(logps, lengths)

        chosen, rejected = policy_chosen_logps, policy_rejected_logps
        if self.needs_reference:
            chosen = chosen - logps["ref_chosen_logps"]
            rejected = rejected - logps["ref_rejected_logps"]
        if self.needs_lengths:
            chosen = chosen / lengths["chosen_lengths"].to(chosen.dtype)
            rejected = rejected / lengths["rejected_lengths"].to(rejected.dtype)
        return chosen, rejected

    def _needed(self, arg: str, value: torch.Tensor | None, what: str) -> torch.Tensor:
        if value is None:
            raise ValueError(
                f"{self.name} loss needs {arg} ({what}), got None "
                f"(needs_reference={self.needs_reference}, needs_lengths={self.needs_lengths})"
            )
        return value

    def _check_tensors(
        self, logps: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]
    ) -> None:
        named = {**logps, **lengths}
        for arg, value in named.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{self.name} loss: {arg} must be a torch.Tensor of shape (B,), "
                    f"got {type(value).__name__}"
                )
        shapes = {arg: tuple(value.shape) for arg, value in named.items()}
        first = shapes["policy_chosen_logps"]
        if len(first) != 1 or first[0] == 0 or any(s != first for s in shapes.values()):
            listed = ", ".join(f"{arg} {shape}" for arg, shape in shapes.items())
            raise ValueError(
                f"{self.name} loss: expected non-empty 1-D tensors of one shape (B,), got {listed}"
            )
        dtypes = {arg: value.dtype for arg, value in logps.items()}
        dtype = dtypes["policy_chosen_logps"]
        if not dtype.is_floating_point or any(d != dtype for d in dtypes.values()):
            listed = ", ".join(f"{arg} {d}" for arg, d in dtypes.items())
            raise ValueError(
                f"{self.name} loss: log-probs must share one floating dtype, got {listed}"
            )

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        """Per-pair losses (B,) from the (B,) scores; the batch loss is their mean."""
        raise NotImplementedError

    def _extra_metrics(self, chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
        """Loss-specific metrics from the detached scores; none by default."""
        return {}

    def _extra_term(
        self, policy_chosen_logps: torch.Tensor, chosen_lengths: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, dict]:
        """A term added to the batch loss outside the per-pair scores (RPO's NLL), with its
        metrics; none by default."""
        return None, {}


LOSSES.base = DirectAlignmentLoss  # what a "module:Class" name in a config must subclass
