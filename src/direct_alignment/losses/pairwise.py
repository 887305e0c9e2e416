"""Pairwise losses on the DPO margin and its relatives: DPO, RPO, cDPO, robust DPO, IPO, hinge
(SLiC), and the reference-free SimPO and ORPO. Formulas: the package docstring."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from direct_alignment.losses.base import LOSSES, ORPO_MAX_AVG_LOGP, DirectAlignmentLoss, log1mexp


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
