"""Monte-Carlo estimators of KL(pi || pi_ref) from tokens sampled from pi.

Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html). With
d = log pi(x) - log pi_ref(x) for x ~ pi, and r = pi_ref(x) / pi(x) = exp(-d):

    k1 = d                      unbiased, high variance, can be negative per sample
    k2 = d^2 / 2                biased (exact to second order), always >= 0
    k3 = (r - 1) - log r        unbiased, always >= 0, low variance  = exp(-d) - 1 + d

All take per-token log-probs of shape (B, T) (or any shape) and return the same shape; masking and
averaging are the caller's choice (see `rlhf_core.logprobs.aggregate`).
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]


def kl_k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref."""
    return logp - logp_ref


def kl_k2(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2."""
    return 0.5 * (logp - logp_ref).square()


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3 = exp(-d) - 1 + d, d = log pi - log pi_ref (Schulman's unbiased, non-negative form)."""
    d = logp - logp_ref
    # expm1 keeps precision when d is near 0, where exp(-d) - 1 would cancel.
    return torch.expm1(-d) + d


_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-sample KL estimate with the named estimator ("k1", "k2" or "k3")."""
    if logp.shape != logp_ref.shape:
        raise ValueError(
            f"kl_estimate: logp has shape {tuple(logp.shape)} but logp_ref has "
            f"{tuple(logp_ref.shape)}; they must match"
        )
    try:
        fn = _ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; expected one of k1, k2, k3"
        ) from None
    return fn(logp, logp_ref)
