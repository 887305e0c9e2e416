"""Direct alignment (offline preference) losses, chosen by name from the registry `LOSSES`.

Every loss reads one preference pair per row: a chosen and a rejected completion of one prompt,
given as per-sequence *summed* completion log-probs of shape (B,) under the policy and, for most
losses, a frozen reference model, plus completion token counts (B,) where a loss averages:

    pc, pr = log pi(y_c | x),     log pi(y_r | x)        policy_chosen_logps, policy_rejected_logps
    rc, rr = log pi_ref(y_c | x), log pi_ref(y_r | x)    ref_chosen_logps, ref_rejected_logps
    h      = (pc - rc) - (pr - rr)                       the DPO log-ratio margin
    avg    = sum / length                                per-token average, length = chosen_lengths
                                                         or rejected_lengths

    name      per-pair loss                                              reference  lengths
    dpo       -logsig(beta h)                                            yes        no
    rpo       -logsig(beta h) + alpha (-pc / length_c)                   yes        yes (NLL)
    cdpo      -(1 - eps) logsig(beta h) - eps logsig(-beta h)            yes        no
    robust    [(1 - eps)(-logsig(beta h)) - eps(-logsig(-beta h))]
              / (1 - 2 eps)                                              yes        no
    ipo       (h - 1 / (2 beta))^2  (averages with length_normalize)     yes        optional
    hinge     relu(1 - beta h)                                           yes        no
    simpo     -logsig(beta (avg_c - avg_r) - gamma)                      no         yes
    orpo      -avg_c - beta logsig(log_odds(avg_c) - log_odds(avg_r))    no         yes
    kto       batch-level reference point z, see `KTOPairLoss`           yes        no
    kto_unpaired  unpaired rows with labels, see `KTOLoss`                 yes        no
    apo_zero  (1 - sigmoid(beta (pc - rc))) + sigmoid(beta (pr - rr))    yes        no
    apo_down  sigmoid(beta (pc - rc)) + (1 - sigmoid(beta h))            yes        no

Calling `loss_fn(pc, pr, rc, rr, chosen_lengths=..., rejected_lengths=...)` returns
`(loss, metrics)`: `loss` is the batch mean of the per-pair losses (KTO: of its 2B per-response
terms) and `metrics` holds detached scalar tensors (no device sync): rewards/chosen,
rewards/rejected, rewards/margin, rewards/accuracy, logps/chosen, logps/rejected, plus a few
loss-specific ones. The rewards are beta times the per-response score the loss works on:
beta (pc - rc) for reference-based losses (per-token averages for `ipo` with length_normalize),
beta avg for the reference-free `simpo` and `orpo`. Everything is computed in the input dtype;
all log-prob tensors must share one floating dtype, and lengths are cast to it.

Not here: computing the log-probs (`rlhf_core.logprobs`), SLiC-HF's regulariser, sorted (AOT)
or running-mean (BCO) variants, f-divergence DPO, and a cross-process estimate of KTO's
reference point (it is the local batch mean). Lengths are not checked for being >= 1 (that
would need a device sync): a zero length gives a non-finite loss, which the train loop counts
and skips.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
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


class NoisyLabelLoss(DirectAlignmentLoss):
    """What the losses for labels flipped with probability eps (`label_smoothing`, TRL's name)
    share: their keywords, and eps checked to lie in [0, 0.5] (`eps_max_inclusive`) or
    [0, 0.5)."""

    needs_reference = True
    needs_lengths = False
    eps_max_inclusive = True

    def __init__(self, *, beta: float = 0.1, label_smoothing: float = 0.1) -> None:
        super().__init__(beta=beta)
        inclusive = self.eps_max_inclusive
        ok = 0 <= label_smoothing <= 0.5 if inclusive else 0 <= label_smoothing < 0.5
        self._require(
            ok, "label_smoothing", label_smoothing, "in [0, 0.5]" if inclusive else "in [0, 0.5)"
        )
        self.label_smoothing = float(label_smoothing)


@LOSSES.register("dpo")
class DPOLoss(DirectAlignmentLoss):
    """Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290), eq. 7.

        loss = -log sigmoid(beta * h),  h = (pc - rc) - (pr - rr)

    The Bradley-Terry likelihood of the preference under the implicit reward
    beta * log(pi / pi_ref). Default beta = 0.1 (paper and TRL).
    """

    needs_reference = True
    needs_lengths = False

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        return -F.logsigmoid(self.beta * (chosen - rejected))


@LOSSES.register("rpo")
class RPOLoss(DPOLoss):
    """DPO plus an NLL term on the chosen completion: Iterative Reasoning Preference Optimization
    (Pang et al. 2024, arXiv:2404.19733; TRL calls the weight `rpo_alpha`).

        loss = -log sigmoid(beta * h) + alpha * NLL_c,    NLL_c = -pc / |y_c|

    Differs from DPO by the length-normalised negative log-likelihood of the chosen completion,
    weighted by alpha. Plain DPO only moves the *margin* h, and can do so by lowering both
    completions' likelihoods ("likelihood displacement"); on reasoning tasks with on-policy pairs
    (chosen = a correct sample, rejected = a wrong one) that lowers accuracy, and the paper adds
    this term to keep the correct answers likely. alpha = 0 is DPO. Defaults: beta 0.1,
    alpha 1.0 (the paper's). The NLL is the per-pair mean, like the DPO term.
    """

    needs_reference = True
    needs_lengths = False  # the scores are DPO's; the lengths feed the NLL term only

    def __init__(self, *, beta: float = 0.1, alpha: float = 1.0) -> None:
        super().__init__(beta=beta)
        self._require(0 <= alpha < math.inf, "alpha", alpha, "a finite number >= 0")
        self.alpha = float(alpha)

    def _extra_term(
        self, policy_chosen_logps: torch.Tensor, chosen_lengths: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict]:
        what = "completion token counts, for the NLL term"
        lengths = self._needed("chosen_lengths", chosen_lengths, what)
        if lengths.shape != policy_chosen_logps.shape:
            raise ValueError(
                f"rpo loss: chosen_lengths {tuple(lengths.shape)} must match "
                f"policy_chosen_logps {tuple(policy_chosen_logps.shape)}"
            )
        nll = -policy_chosen_logps / lengths.to(policy_chosen_logps.dtype)
        return self.alpha * nll.mean(), {"rpo/nll": nll.detach().mean()}


@LOSSES.register("cdpo")
class ConservativeDPOLoss(NoisyLabelLoss):
    """Conservative DPO / label smoothing (Mitchell 2023, "A note on DPO with noisy preferences
    & relationship to IPO", https://ericmitchell.ai/cdpo.pdf; no arXiv id).

        loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)

    Differs from DPO by assuming each label is flipped with probability eps: the target
    preference probability is 1 - eps instead of 1, so the loss is minimised at a finite margin
    (beta * h = log((1 - eps) / eps)) instead of pushing h to infinity. eps = 0 is DPO.
    This is TRL's `loss_type="sigmoid"` with `label_smoothing=eps`; TRL's default eps is 0 (plain
    DPO), so a named cDPO defaults to eps = 0.1. Defaults: beta = 0.1, label_smoothing = 0.1,
    which must be in [0, 0.5].
    """

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        x = self.beta * (chosen - rejected)
        eps = self.label_smoothing
        return -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


@LOSSES.register("robust")
class RobustDPOLoss(NoisyLabelLoss):
    """Provably robust DPO (Ray Chowdhury, Kini & Natarajan 2024, arXiv:2403.00409).

        loss = [(1 - eps) * (-log sigmoid(beta * h)) - eps * (-log sigmoid(-beta * h))]
               / (1 - 2 * eps)

    Differs from DPO (and from cDPO) by de-biasing for labels flipped with probability eps: the
    expected loss under noisy labels equals the DPO loss under clean ones. Unlike cDPO it keeps
    pushing the margin up, and a single pair's loss can be negative. eps = 0 is DPO. Defaults:
    beta = 0.1, label_smoothing = 0.1 (TRL's name; TRL defaults to 0, i.e. DPO), which must be
    in [0, 0.5).
    """

    eps_max_inclusive = False

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        x = self.beta * (chosen - rejected)
        eps = self.label_smoothing
        return ((1 - eps) * -F.logsigmoid(x) - eps * -F.logsigmoid(-x)) / (1 - 2 * eps)


@LOSSES.register("ipo")
class IPOLoss(DirectAlignmentLoss):
    """Identity Preference Optimization (Azar et al. 2023, arXiv:2310.12036), eq. 17.

        loss = (h - 1 / (2 * beta))^2        beta is the paper's tau

    Differs from DPO by regressing the log-ratio margin onto a finite target 1 / (2 tau) instead
    of maximising a sigmoid likelihood, so it does not overfit deterministic preferences.
    By default h uses summed log-probs, as in the paper. `length_normalize=True` uses per-token
    averages, h = (avg_pc - avg_rc) - (avg_pr - avg_rr), which is what TRL's `loss_type="ipo"`
    does; it then needs the lengths (`needs_lengths` is set per instance from this flag).
    Defaults: beta = 0.1, length_normalize = False.
    """

    needs_reference = True
    needs_lengths = False

    def __init__(self, *, beta: float = 0.1, length_normalize: bool = False) -> None:
        super().__init__(beta=beta)
        self.length_normalize = bool(length_normalize)
        self.needs_lengths = self.length_normalize

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        return (chosen - rejected - 1 / (2 * self.beta)).square()


@LOSSES.register("hinge")
class HingeLoss(DirectAlignmentLoss):
    """Hinge loss of SLiC-HF (Zhao et al. 2023, arXiv:2305.10425), on DPO's margin.

        loss = relu(1 - beta * h)

    Differs from DPO by a hinge instead of a log-sigmoid: pairs with margin h >= 1 / beta give no
    gradient. SLiC-HF's own calibration loss uses the policy log-prob difference without a
    reference model and adds a cross-entropy regulariser; this is the reference-normalised form
    used by TRL's `loss_type="hinge"`, without the regulariser. Default beta = 0.1.
    """

    needs_reference = True
    needs_lengths = False

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        return torch.relu(1 - self.beta * (chosen - rejected))


@LOSSES.register("simpo")
class SimPOLoss(DirectAlignmentLoss):
    """Simple Preference Optimization (Meng, Xia & Chen 2024, arXiv:2405.14734).

        loss = -log sigmoid(beta * (avg_c - avg_r) - gamma),   avg = summed log-prob / length

    Differs from DPO by being reference-free (the implicit reward is the length-normalised
    policy log-prob beta * avg) and by a target reward margin gamma. `gamma` here is the margin
    itself, as in the paper's formula and TRL's `simpo_gamma`; the SimPO repository instead
    configures `gamma_beta_ratio` = gamma / beta. Defaults: beta = 2.0, gamma = 0.5 (the SimPO
    repository's beta = 2.0 with gamma_beta_ratio = 0.25).
    """

    needs_reference = False
    needs_lengths = True

    def __init__(self, *, beta: float = 2.0, gamma: float = 0.5) -> None:
        super().__init__(beta=beta)
        self._require(0 <= gamma < math.inf, "gamma", gamma, "a non-negative finite number")
        self.gamma = float(gamma)

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        return -F.logsigmoid(self.beta * (chosen - rejected) - self.gamma)


def _log_odds(avg_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) for p = exp(avg_logp), with avg_logp clamped to ORPO_MAX_AVG_LOGP."""
    avg_logp = avg_logp.clamp(max=ORPO_MAX_AVG_LOGP)
    return avg_logp - log1mexp(avg_logp)


@LOSSES.register("orpo")
class ORPOLoss(DirectAlignmentLoss):
    """Odds Ratio Preference Optimization (Hong, Lee & Thorne 2024, arXiv:2403.07691).

        loss = NLL_c - beta * log sigmoid(log_odds(avg_c) - log_odds(avg_r))
        NLL_c = -avg_c,  log_odds(a) = a - log(1 - exp(a)),  avg = summed log-prob / length

    Differs from DPO by being reference-free and by folding SFT into the objective: the NLL of
    the chosen completion plus an odds-ratio preference term weighted by beta (the paper's
    lambda; TRL also calls it beta). log(1 - exp(a)) uses `log1mexp`; averages above
    ORPO_MAX_AVG_LOGP = -1e-6 are clamped there in the odds term only (the NLL term uses the
    unclamped average). Default beta = 0.1 (TRL).
    """

    needs_reference = False
    needs_lengths = True

    def _losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        return -chosen - self.beta * F.logsigmoid(_log_odds(chosen) - _log_odds(rejected))

    def _extra_metrics(self, chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
        return {
            "orpo/nll": (-chosen).mean(),
            "orpo/log_odds_ratio": (_log_odds(chosen) - _log_odds(rejected)).mean(),
        }


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
