"""Per-token policy-gradient losses (registry `LOSSES`) and PPO's value loss (`VALUE_LOSSES`).

Every loss reads the current policy's per-token log-probs `log_probs` (B, T) over completion
tokens and a `LossInputs` (B rows; an `Experience` is one) holding, aligned with them, the
`action_mask`, the `advantages` A, the sampling policy's log-probs `log_probs_old` and, where
needed, the reference log-probs, old values and returns; nothing else (no token ids or attention
mask), so a loss is callable from your own code with just those tensors:

    inputs = LossInputs(action_mask=mask, advantages=adv, log_probs_old=logp.detach())
    loss, metrics = LOSSES.get("clipped")()(logp, inputs)
 With rho = exp(logp - logp_old) and sg = stop-gradient:

    name     per-token loss                                                      defaults
    pg       -A logp                                                             -
    clipped  -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)                 eps 0.2 / 0.2
    gspo     -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A),                    eps 3e-4 / 4e-4
             s_i = exp(mean_t(logp - logp_old)), token form sg(s_i) exp(logp - sg(logp))
    cispo    -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A logp                    eps 1.0 / 4.0
    value    0.5 max((V - R)^2, (V_clip - R)^2),                                 eps_value 0.2
             V_clip = V_old + clip(V - V_old, -eps_value, eps_value)

The policy losses share the rest (`PolicyLoss`):

    loss_t  = policy_term_t + kl_beta * k(logp_t, logp_ref_t) - entropy_coef * H_t
    loss    = aggregate(loss_t, action_mask, aggregation)

k is the `rlhf_core.kl` estimator `kl_estimator` (KL *in the loss*, as GRPO; a KL *in the reward*
belongs to the caller's rewards); H is the per-token entropy the caller passes as `entropy`.
`aggregate` is `rlhf_core.logprobs.aggregate` (token-mean, seq-mean-token-mean,
seq-mean-token-sum-norm with a constant `normalizer`); `total_tokens` / `total_sequences` of the
whole optimizer step make micro-batch losses sum to the one-batch loss.

    loss, metrics = loss_fn(log_probs, inputs, total_tokens=..., total_sequences=...,
                            entropy=None, values=None)

`metrics` holds detached scalar tensors (no device sync), each computed on this micro-batch alone
(local means over its masked tokens, not shares of the step): pg_loss (the aggregated policy term),
ratio_mean, clip_fraction (clipped losses), kl (whenever log_probs_ref is given, even with
kl_beta = 0), entropy (when given); the value loss reports value_loss, value_clip_fraction,
value_mean. Everything is computed in the inputs' dtype.

Padding positions of the inputs may hold anything (even inf or nan): every input is replaced by 0
where action_mask is 0 before use, so neither the loss nor its gradient can pick them up.

`importance_weights=w` (B, T) multiplies the policy term by a detached weight: the off-policy
corrections of `policy_gradients.off_policy` (TIS, MIS, decoupled PPO) are such weights.

Not here: dual-clip PPO, SAPO/soft gates, token masks by entropy, and KL in the reward. Shapes
are checked on the host; values are not (that would need a device sync): a non-finite loss is
the train loop's to count and skip.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from policy_gradients.experience import LossInputs
from rlhf_core.kl import KLEstimator, kl_estimate
from rlhf_core.logprobs import AGGREGATION_MODES, AggregationMode, aggregate, masked_mean
from rlhf_core.registry import Configurable, Registry

LOSSES: Registry[type[PolicyLoss]] = Registry("policy loss")
# PPO's value loss trains the value model, not the policy: its own registry, so a value loss named
# as `algorithm.loss` (or a policy loss as `algorithm.value_loss`) is refused when the config loads.
VALUE_LOSSES: Registry[type[ValueLoss]] = Registry("value loss")

Metrics = dict[str, torch.Tensor]


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


class PolicyGradientLoss(Configurable, nn.Module):
    """Aggregation settings and input checks shared by the policy and value losses."""

    name: ClassVar[str] = "policy loss"  # replaced by the registered name
    needs_values: ClassVar[bool] = False
    needs_reference: bool = False  # set per instance by the policy losses (kl_beta > 0)

    def __init__(self, *, aggregation: AggregationMode, normalizer: float | None) -> None:
        super().__init__()
        self._require(
            aggregation in AGGREGATION_MODES,
            "aggregation",
            aggregation,
            f"one of {AGGREGATION_MODES}",
        )
        if aggregation == "seq-mean-token-sum-norm":
            self._require(
                normalizer is not None and 0 < normalizer < math.inf,
                "normalizer",
                normalizer,
                "a positive constant with aggregation 'seq-mean-token-sum-norm' "
                "(e.g. max_new_tokens)",
            )
        else:
            self._require(
                normalizer is None,
                "normalizer",
                normalizer,
                f"None with aggregation {aggregation!r} (only 'seq-mean-token-sum-norm' uses it)",
            )
        self.aggregation = aggregation
        self.normalizer = None if normalizer is None else float(normalizer)

    def _aggregate(
        self,
        loss: torch.Tensor,
        mask: torch.Tensor,
        total_tokens: torch.Tensor | float | None = None,
        total_sequences: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        return aggregate(
            loss,
            mask,
            self.aggregation,
            normalizer=self.normalizer,
            total_tokens=total_tokens,
            total_sequences=total_sequences,
        )

    def _checked(
        self, arg: str, value: torch.Tensor | None, shape: tuple, why: str
    ) -> torch.Tensor:
        """`value` as a (B, T) tensor of the action_mask shape, or a ValueError naming `arg`."""
        if value is None:
            raise ValueError(f"{self.name} loss needs {arg} {why}, got None")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{self.name} loss: {arg} must have the action_mask shape (B, T) = {shape}, "
                f"got {got}"
            )
        return value

    def _mask_and_input(
        self, experience: LossInputs, arg: str, value: torch.Tensor | None, why: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the action mask, the loss's floating (B, T) input `value` of its shape), or a
        ValueError naming `arg`."""
        mask = self._mask(experience)
        value = self._checked(arg, value, tuple(mask.shape), why)
        if not value.dtype.is_floating_point:
            raise ValueError(f"{self.name} loss: {arg} must be floating, got {value.dtype}")
        return mask, value

    def _mask(self, experience: LossInputs) -> torch.Tensor:
        mask = experience.action_mask
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"{self.name} loss: experience.action_mask must be (B, T), got {got}")
        return mask.bool()


LOSSES.base = PolicyGradientLoss  # what a "module:Class" name in a config must subclass


class PolicyLoss(PolicyGradientLoss):
    """The shared body of the policy losses: a subclass implements `_policy_term`; this class
    adds the KL and entropy terms, aggregates, and reports metrics.

    Configuration (keyword only, also for every subclass):
        aggregation    how per-token losses become a scalar (`rlhf_core.logprobs.aggregate`)
        normalizer     the constant for 'seq-mean-token-sum-norm' (None otherwise)
        kl_beta        weight of the per-token KL to the reference in the loss; > 0 makes
                       `needs_reference` true and requires experience.log_probs_ref
        kl_estimator   which `rlhf_core.kl` estimator: "k1", "k2" or "k3" (GRPO uses k3)
        entropy_coef   weight of the entropy bonus; > 0 requires `entropy` (B, T) in forward
    """

    def __init__(
        self,
        *,
        aggregation: AggregationMode = "token-mean",
        normalizer: float | None = None,
        kl_beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        entropy_coef: float = 0.0,
    ) -> None:
        super().__init__(aggregation=aggregation, normalizer=normalizer)
        self._require(0 <= kl_beta < math.inf, "kl_beta", kl_beta, "a finite number >= 0")
        self._require(
            kl_estimator in ("k1", "k2", "k3"), "kl_estimator", kl_estimator, "'k1', 'k2' or 'k3'"
        )
        self._require(
            0 <= entropy_coef < math.inf, "entropy_coef", entropy_coef, "a finite number >= 0"
        )
        self.kl_beta = float(kl_beta)
        self.kl_estimator = kl_estimator
        self.entropy_coef = float(entropy_coef)
        self.needs_reference = self.kl_beta > 0

    def forward(
        self,
        log_probs: torch.Tensor,
        experience: LossInputs,
        *,
        total_tokens: torch.Tensor | float | None = None,
        total_sequences: torch.Tensor | float | None = None,
        entropy: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        importance_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        """log_probs (B, T) under the current policy -> (scalar loss, metrics). `values` is
        accepted for a uniform call signature and ignored by the policy losses.
        `importance_weights` (B, T): a per-token weight on the policy term, detached (an
        off-policy correction, `policy_gradients.off_policy`); None leaves the loss as it is."""
        why = "(B, T) under the current policy"
        mask, log_probs = self._mask_and_input(experience, "log_probs", log_probs, why)
        shape = tuple(mask.shape)
        old = self._checked(
            "experience.log_probs_old", experience.log_probs_old, shape, "(B, T) of the sampler"
        )
        advantages = self._checked("experience.advantages", experience.advantages, shape, "(B, T)")
        ref = experience.log_probs_ref
        if self.kl_beta > 0:
            why = f"(B, T) for the KL term (kl_beta={self.kl_beta})"
            ref = self._checked("experience.log_probs_ref", ref, shape, why)
        elif ref is not None:
            ref = self._checked("experience.log_probs_ref", ref, shape, "(B, T)")
        if self.entropy_coef > 0:
            why = f"(B, T) per-token entropies for the bonus (entropy_coef={self.entropy_coef})"
            entropy = self._checked("entropy", entropy, shape, why)
        elif entropy is not None:
            entropy = self._checked("entropy", entropy, shape, "(B, T)")

        # Padding may hold anything; zero it so neither values nor gradients can pick it up.
        logp = _zero_outside(log_probs, mask)
        log_ratio = logp - _zero_outside(old, mask).detach()
        advantages = _zero_outside(advantages, mask).detach()
        policy, ratio, clipped = self._policy_term(logp, log_ratio, advantages, mask)
        if importance_weights is not None:
            w = self._checked("importance_weights", importance_weights, shape, "(B, T)")
            policy = _zero_outside(w, mask).detach() * policy

        loss = policy
        metrics: Metrics = {}
        if ref is not None:
            kl = kl_estimate(logp, _zero_outside(ref, mask).detach(), self.kl_estimator)
            if self.kl_beta > 0:
                loss = loss + self.kl_beta * kl
            metrics["kl"] = masked_mean(kl.detach(), mask)
        if entropy is not None:
            entropy = _zero_outside(entropy, mask)
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * entropy
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
        total = self._aggregate(loss, mask, total_tokens, total_sequences)

        metrics["pg_loss"] = self._aggregate(policy.detach(), mask)
        metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
        if clipped is not None:
            metrics["clip_fraction"] = masked_mean(clipped.to(logp.dtype), mask)
        return total, metrics

    def _policy_term(
        self,
        logp: torch.Tensor,
        log_ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per-token policy loss (B, T), the importance ratio it uses (B, T), and where clipping
        binds (bool (B, T)) or None. Inputs are 0 outside `mask`; `log_ratio` = logp - logp_old
        with logp_old detached; `advantages` detached."""
        raise NotImplementedError


def _ppo_clip(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A), and where the clip binds (the
    clipped term is the smaller one, so the token's gradient is 0)."""
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    binds = ((ratio < 1 - eps_low) & (advantages < 0)) | ((ratio > 1 + eps_high) & (advantages > 0))
    return loss, binds.detach()


@LOSSES.register("pg")
class VanillaPolicyGradientLoss(PolicyLoss):
    """Vanilla policy gradient / REINFORCE (Williams 1992):

        loss_t = -A_t logp_t

    No importance ratio and no clipping: the estimator is only unbiased on-policy (one gradient
    step per rollout batch). `ratio_mean` is still reported to show how far the policy moved.
    """

    def _policy_term(self, logp, log_ratio, advantages, mask):
        return -advantages * logp, log_ratio.exp(), None


class ClippedPolicyLoss(PolicyLoss):
    """A policy loss with a trust region on the importance ratio: [1 - eps_low, 1 + eps_high].

    Holds and checks the clip range for `clipped`, `gspo` and `cispo`, which differ in what they
    clip (`_policy_term`) and in their papers' defaults (each sets `defaults`). eps_low is in
    [0, 1] (the lower bound 1 - eps_low stays >= 0); eps_high is any finite number >= 0.
    """

    def __init__(
        self,
        *,
        eps_low: float,
        eps_high: float,
        aggregation: AggregationMode = "token-mean",
        normalizer: float | None = None,
        kl_beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        entropy_coef: float = 0.0,
    ) -> None:
        super().__init__(
            aggregation=aggregation,
            normalizer=normalizer,
            kl_beta=kl_beta,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
        )
        self._require(0 <= eps_low <= 1, "eps_low", eps_low, "in [0, 1] (lower bound 1 - eps_low)")
        self._require(0 <= eps_high < math.inf, "eps_high", eps_high, "a finite number >= 0")
        self.eps_low = float(eps_low)
        self.eps_high = float(eps_high)


@LOSSES.register("clipped")
class ClippedSurrogateLoss(ClippedPolicyLoss):
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7), with DAPO's
    decoupled clip range "clip-higher" (Yu et al. 2025, arXiv:2503.14476):

        rho_t  = exp(logp_t - logp_old_t)
        loss_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)

    Defaults eps_low = eps_high = 0.2 (PPO); DAPO uses eps_high = 0.28. GRPO is this loss with
    group advantages, seq-mean-token-mean aggregation and a k3 KL in the loss. clip_fraction is
    the fraction of tokens whose clip binds (rho < 1 - eps_low with A < 0, or rho > 1 + eps_high
    with A > 0), i.e. whose gradient is zeroed.
    """

    defaults = {"eps_low": 0.2, "eps_high": 0.2}

    def _policy_term(self, logp, log_ratio, advantages, mask):
        ratio = log_ratio.exp()
        loss, binds = _ppo_clip(ratio, advantages, self.eps_low, self.eps_high)
        return loss, ratio, binds


@LOSSES.register("gspo")
class GSPOLoss(ClippedPolicyLoss):
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071), GSPO-token form:

        s_i     = exp( mean_{t in y_i} (logp_t - logp_old_t) )        the sequence ratio
        s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t))                  = s_i in value
        loss_t  = -min(s_{i,t} A_t, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_t)

    The whole sequence is clipped or not, by its length-normalised likelihood ratio, instead of
    each token by its own ratio (PPO/GRPO). With sequence-level advantages (A_t = A_i, GSPO's
    setting) and seq-mean-token-mean aggregation the gradient is exactly GSPO's sequence-level
    one, s_i A_i mean_t grad logp_t; per-token advantages give GSPO-token. Defaults from the
    paper (section 5.1): eps_low = 3e-4, eps_high = 4e-4, aggregation seq-mean-token-mean (the
    paper's 1/G sum_i over sequences of length-normalised terms). With one token per completion
    it equals `clipped`. clip_fraction counts tokens whose (sequence) clip binds.
    """

    defaults = {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq-mean-token-mean"}

    def _policy_term(self, logp, log_ratio, advantages, mask):
        log_s = masked_mean(log_ratio, mask, dim=-1)  # fully masked row: 0, i.e. s = 1
        ratio = torch.exp(log_s.detach()[:, None] + logp - logp.detach())
        loss, binds = _ppo_clip(ratio, advantages, self.eps_low, self.eps_high)
        return loss, ratio, binds


@LOSSES.register("cispo")
class CISPOLoss(ClippedPolicyLoss):
    """Clipped IS-weight Policy Optimization (MiniMax-M1, MiniMax 2025, arXiv:2506.13585, eq. 4):

        rho_t  = exp(logp_t - logp_old_t)
        loss_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A_t logp_t

    Unlike PPO, which zeroes the gradient of tokens whose ratio leaves the trust region, CISPO
    truncates the importance weight and keeps every token's gradient (a REINFORCE gradient with
    a truncated IS weight). The paper sets no lower bound ("eps_low large") and tunes only
    eps_high without publishing a value; defaults here: eps_low = 1.0 (lower bound 0, never binds
    since rho > 0) and eps_high = 4.0 (upper bound 5, ScaleRL's eps_max, Khatri et al. 2025,
    arXiv:2510.13786, as TRL recommends). The paper normalises by the batch's token count:
    aggregation token-mean (the default). clip_fraction counts tokens whose weight is truncated.
    """

    defaults = {"eps_low": 1.0, "eps_high": 4.0}

    def _policy_term(self, logp, log_ratio, advantages, mask):
        ratio = log_ratio.exp()
        weight = ratio.detach().clamp(1 - self.eps_low, 1 + self.eps_high)
        truncated = (ratio < 1 - self.eps_low) | (ratio > 1 + self.eps_high)
        return -weight * advantages * logp, ratio, truncated.detach()


@VALUE_LOSSES.register("value")
class ValueLoss(PolicyGradientLoss):
    """PPO's clipped value loss (Schulman et al. 2017, arXiv:1707.06347; the clipped form of
    OpenAI baselines' PPO2, as in InstructGPT/TRL PPO):

        V_clip_t = V_old_t + clip(V_t - V_old_t, -eps_value, eps_value)
        loss_t   = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)

    V are the current value predictions (`values` keyword, (B, T)), V_old = experience.values_old
    and R = experience.returns (from `gae`). eps_value = None gives the unclipped
    0.5 (V - R)^2. Defaults: eps_value = 0.2 (TRL's cliprange_value), aggregation token-mean.
    `log_probs` is not used (pass None or anything). value_clip_fraction is the fraction of
    tokens where the clipped term is the larger one.
    """

    needs_values = True

    def __init__(
        self,
        *,
        eps_value: float | None = 0.2,
        aggregation: AggregationMode = "token-mean",
        normalizer: float | None = None,
    ) -> None:
        super().__init__(aggregation=aggregation, normalizer=normalizer)
        self._require(
            eps_value is None or 0 <= eps_value < math.inf,
            "eps_value",
            eps_value,
            "a finite number >= 0, or None for no clipping",
        )
        self.eps_value = None if eps_value is None else float(eps_value)

    def forward(
        self,
        log_probs: torch.Tensor | None,
        experience: LossInputs,
        *,
        total_tokens: torch.Tensor | float | None = None,
        total_sequences: torch.Tensor | float | None = None,
        entropy: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
        """values (B, T) from the value model -> (scalar loss, metrics)."""
        why = "(B, T) current value predictions"
        mask, values = self._mask_and_input(experience, "values", values, why)
        shape = tuple(mask.shape)
        old = self._checked(
            "experience.values_old", experience.values_old, shape, "(B, T) value-model outputs"
        )
        returns = self._checked(
            "experience.returns", experience.returns, shape, "(B, T) value targets"
        )

        v = _zero_outside(values, mask)
        v_old = _zero_outside(old, mask).detach()
        r = _zero_outside(returns, mask).detach()
        error = (v - r).square()
        if self.eps_value is None:
            loss = 0.5 * error
            clipped = torch.zeros_like(mask)
        else:
            v_clip = v_old + (v - v_old).clamp(-self.eps_value, self.eps_value)
            error_clipped = (v_clip - r).square()
            loss = 0.5 * torch.maximum(error, error_clipped)
            clipped = (error_clipped > error).detach()
        total = self._aggregate(loss, mask, total_tokens, total_sequences)
        metrics = {
            "value_loss": self._aggregate(loss.detach(), mask),
            "value_clip_fraction": masked_mean(clipped.to(v.dtype), mask),
            "value_mean": masked_mean(v.detach(), mask),
        }
        return total, metrics
