"""The sampler is not the trainer: its mismatch, measured, and the corrections (registry
`CORRECTIONS`).

The rollout keeps, for every sampled token, its log-prob under the distribution the sampler drew
it from, mu (`Experience.log_probs_behaviour`: after temperature and top-k / top-p / min-p
truncation, in the sampler's dtype), beside the trainer's recomputed pi_old
(`Experience.log_probs_old`, the proximal policy of the update). With rho = pi_old / mu per
token, a correction turns (pi_old, mu) into a detached per-token weight w (B, T) on the policy
term of the loss (`PolicyLoss.forward(..., importance_weights=w)`; the KL and entropy terms are
not weighed):

    name        w_t                                                 paper
    tis         min(rho_t, cap)                                     Yao et al. 2025
    mis         rho * 1[low <= rho <= high],  rho = rho_t (token)   Liu, Li et al. 2025 (MIS),
                or rho = prod_t rho_t over the sequence (sequence)  IcePop (token level)
    decoupled   rho_t, or rho_t * 1[rho_t <= cap] with a cap        Hilton et al. 2021, AReaL

Tokens a mask removes weigh 0 but stay in the aggregation's token and sequence counts, so the
normalisers of a step do not depend on the correction. The algorithm pages
(docs/algorithms/tis.md, mis.md, decoupled_ppo.md) give the equations.

`MismatchStats` gathers, over a step's tokens, how far the two are apart: the k3 estimate of
KL(mu || pi_old), the max and 99th percentile of rho, and, with truncated sampling, the share of
sampled tokens outside the set the trainer's own distribution, truncated the same way, would
sample from (`outside_sampling_set`: one extra no-grad forward of up to `train.micro_batch_size`
rows per round, spread over the batch).

With asynchronous rollouts (`rollout.max_staleness` k, `policy_gradients.async_rollouts`) mu is
the sampler's copy of a policy up to k updates older than pi_old, and the mismatch metrics
measure the staleness too.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch

from policy_gradients.experience import Experience
from rlhf_core.generation import Sampling
from rlhf_core.kl import kl_estimate
from rlhf_core.logprobs import decoder_and_head, masked_mean, masked_sum
from rlhf_core.policy_model import is_encoder_decoder
from rlhf_core.registry import Configurable, Registry

CORRECTIONS: Registry[type[OffPolicyCorrection]] = Registry("off-policy correction")
Metrics = dict[str, torch.Tensor]


class OffPolicyCorrection(Configurable):
    """A per-token weight from the trainer's pi_old and the sampler's mu; subclasses implement
    `_weights(log_rho, mask)`."""

    role: ClassVar[str] = "correction"
    changes: ClassVar[str] = "masked"  # what `_weights` reports as changed: masked / truncated

    def __call__(self, experience: Experience) -> tuple[torch.Tensor, Metrics]:
        """(w (B, T) detached, 0 off the action mask; metrics: weight_mean, and the share of
        tokens truncated or masked), from `experience.log_probs_old` and
        `experience.log_probs_behaviour`."""
        mask = experience.action_mask.bool()
        shape = tuple(mask.shape)
        for arg in ("log_probs_old", "log_probs_behaviour"):
            value = getattr(experience, arg)
            if value is None or tuple(value.shape) != shape:
                got = None if value is None else tuple(value.shape)
                raise ValueError(
                    f"{self.name} correction needs experience.{arg} of the action_mask shape "
                    f"(B, T) = {shape}, got {got}"
                )
        old, behaviour = experience.log_probs_old.detach(), experience.log_probs_behaviour
        log_rho = torch.where(mask, old - behaviour.to(old.dtype), torch.zeros_like(old))
        weights, changed = self._weights(log_rho, mask)
        weights = torch.where(mask, weights, torch.zeros_like(weights))
        metrics = {
            "weight_mean": masked_mean(weights, mask),
            f"{self.changes}_fraction": masked_mean(changed.to(weights.dtype), mask),
        }
        return weights, metrics

    def _weights(
        self, log_rho: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w (B, T), bool (B, T) where the correction cut or masked rho) from log rho (0 off
        `mask`)."""
        raise NotImplementedError


CORRECTIONS.base = OffPolicyCorrection


def _require_cap(owner: Configurable, arg: str, value: float | None, none_ok: bool) -> None:
    ok = (value is None and none_ok) or (value is not None and 1 <= value < math.inf)
    expected = "a finite number >= 1" + (", or null for none" if none_ok else "")
    owner._require(ok, arg, value, expected)


@CORRECTIONS.register("tis")
class TruncatedImportanceSampling(OffPolicyCorrection):
    """Token-level truncated importance sampling (TIS; Yao, Liu et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training", fengyao.notion.site/off-policy-rl;
    Ionides 2008 for truncated IS):

        rho_t = pi_old(y_t) / mu(y_t)            w_t = min(rho_t, cap)

    The trainer's gradient is taken on samples of the sampler mu; rho_t corrects it back to
    pi_old, truncated at `cap` to bound its variance (a small bias). Default cap 2 (the paper's
    C = 2)."""

    changes = "truncated"

    def __init__(self, *, cap: float = 2.0) -> None:
        _require_cap(self, "cap", cap, none_ok=False)
        self.cap = float(cap)

    def _weights(self, log_rho, mask):
        rho = log_rho.exp()
        return rho.clamp(max=self.cap), rho > self.cap


@CORRECTIONS.register("mis")
class MaskedImportanceSampling(OffPolicyCorrection):
    """Masked importance sampling (MIS; Liu, Li et al. 2025, "When speed kills stability:
    demystifying RL collapse from the training-inference mismatch"; the token level is IcePop's
    M(k), Ling Team 2025, arXiv:2510.18855):

        token:     rho_t = pi_old(y_t) / mu(y_t)                 w_t = rho_t 1[low <= rho_t <= high]
        sequence:  rho   = prod_{t in y} pi_old(y_t) / mu(y_t)    w_t = rho 1[low <= rho <= high]

    Unlike TIS, a token (or, at sequence level, a whole completion) whose ratio leaves
    [low, high] is dropped instead of cut to the bound: such tokens are where the sampler and the
    trainer disagree most, and their truncated gradient is still biased. Defaults: token level,
    [0.5, 2]."""

    def __init__(
        self, *, level: Literal["token", "sequence"] = "token", low: float = 0.5,
        high: float = 2.0,
    ) -> None:  # fmt: skip
        self._require(level in ("token", "sequence"), "level", level, "'token' or 'sequence'")
        self._require(0 <= low <= 1, "low", low, "in [0, 1] (rho = 1, on-policy, is kept)")
        _require_cap(self, "high", high, none_ok=False)
        self._require(low < high, "low", low, f"below high ({high})")
        self.level, self.low, self.high = level, float(low), float(high)

    def _weights(self, log_rho, mask):
        if self.level == "sequence":  # fully masked row: rho = 1
            log_rho = masked_sum(log_rho, mask, dim=-1)[:, None].expand_as(log_rho)
        rho = log_rho.exp()
        keep = (rho >= self.low) & (rho <= self.high)
        return torch.where(keep, rho, torch.zeros_like(rho)), ~keep


@CORRECTIONS.register("decoupled")
class DecoupledPPO(OffPolicyCorrection):
    """The decoupled PPO objective (Hilton, Cobbe, Schulman 2021, "Batch size-invariance for
    policy optimization", arXiv:2110.00641, eq. 2; AReaL, Fu et al. 2025, arXiv:2505.24298,
    eq. 5): the behaviour policy mu that sampled the data, the proximal policy pi_prox the trust
    region is centred on, and the current policy pi_theta are three different policies:

        loss_t = -(pi_prox(y_t) / mu(y_t)) min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
        r_t    = pi_theta(y_t) / pi_prox(y_t)

    Here pi_prox is the trainer's pi_old (`Experience.log_probs_old`, the policy at the start of
    the step) and the loss (`clipped`, `gspo`, `cispo`) is the min/clip term, so the correction
    is the weight w_t = pi_prox / mu. `cap` (AReaL's behaviour importance weight cap): tokens
    with w_t above it are dropped (w_t = 0); null (the default, the paper's form) keeps every
    weight. With the `pg` loss it is importance-weighted REINFORCE."""

    def __init__(self, *, cap: float | None = None) -> None:
        _require_cap(self, "cap", cap, none_ok=True)
        self.cap = None if cap is None else float(cap)

    def _weights(self, log_rho, mask):
        rho = log_rho.exp()
        if self.cap is None:
            return rho, torch.zeros_like(mask)
        over = rho > self.cap
        return torch.where(over, torch.zeros_like(rho), rho), over


@torch.no_grad()
def outside_sampling_set(
    model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
    action_mask: torch.Tensor, sampling: Sampling, *, rows: int,
) -> torch.Tensor | None:  # fmt: skip
    """float (B, T): 1 where the sampled completion token lies outside the set the trainer's
    distribution, warped by `sampling` (`Sampling.warp`: temperature, top-k, top-p, min-p), would
    sample from, 0 inside, NaN where not measured (off `action_mask`, and the rows left out).

    A diagnostic with a bounded cost: at most `rows` rows, spread evenly over the batch (every
    ceil(B / rows)-th), in one no-grad forward (model in eval mode), the LM head run on their
    completion positions only and `Sampling.warp` on ~4M logits at a time. None for an
    encoder-decoder policy (not measured)."""
    if is_encoder_decoder(model):
        return None
    picked_rows = torch.arange(0, ids.shape[0], -(-ids.shape[0] // max(1, rows)))
    part_ids = ids[picked_rows]
    mask = attention_mask[picked_rows].long()
    select = action_mask[picked_rows].bool()
    args = {"input_ids": part_ids, "attention_mask": mask, "use_cache": False,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}  # fmt: skip
    parts = decoder_and_head(model)
    was_training = model.training
    model.eval()
    try:
        if parts is None:
            source, head = model(**args).logits[:, prompt_length - 1 : -1][select], None
        else:  # hidden states (N, H), the head applied a chunk at a time below
            hidden = parts[0](**args).last_hidden_state[:, prompt_length - 1 : -1]
            source, head = hidden[select], parts[1]
    finally:
        model.train(was_training)
    tokens = part_ids[:, prompt_length:][select]
    flags = torch.empty(tokens.shape, dtype=torch.float32, device=tokens.device)
    chunk = max(1, (1 << 22) // (head.out_features if head is not None else source.shape[-1]))
    for lo in range(0, source.shape[0], chunk):
        z = source[lo : lo + chunk]
        warped = sampling.warp(head(z) if head is not None else z)
        picked = warped.gather(-1, tokens[lo : lo + chunk, None]).squeeze(-1)
        flags[lo : lo + chunk] = (picked == float("-inf")).float()
    measured = torch.full(select.shape, float("nan"), device=flags.device)
    measured[select] = flags
    outside = torch.full(action_mask.shape, float("nan"), device=flags.device)
    outside[picked_rows] = measured
    return outside


class MismatchStats:
    """The sampler-trainer mismatch over one step's tokens: `add` each micro-batch once (after
    its pi_old is known), then `metrics()`:

        mismatch/k3                   mean_t k3 = rho_t - 1 - log rho_t, rho_t = pi_old / mu:
                                      the k3 estimate of KL(mu || pi_old) (`rlhf_core.kl`)
        mismatch/ratio_max            max_t rho_t
        mismatch/ratio_p99            the 99th percentile of rho_t (nearest rank)
        mismatch/outside_truncation   share of sampled tokens outside the trainer's truncated
                                      sampling set (with top_p < 1: its top-p set), over the
                                      rows the rollouts measured (`outside_sampling_set`)

    Under several processes `metrics(gather)` pools every process's tokens (`gather`: accelerate's
    `gather_object`; every process calls it), so all report the same numbers."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def add(self, experience: Experience) -> None:
        """A micro-batch whose log_probs_old and log_probs_behaviour are set (skipped
        otherwise), with its `outside_sampling_set` when measured. Kept on its device until
        `metrics` (no host sync per micro-batch)."""
        old, behaviour = experience.log_probs_old, experience.log_probs_behaviour
        if old is None or behaviour is None:
            return
        log_rho = old.detach().double() - behaviour.double()
        self.parts.append((log_rho, experience.action_mask.bool(),
                           experience.outside_sampling_set))  # fmt: skip

    def metrics(self, gather=None) -> dict[str, float]:
        log_rho = [x[keep].cpu() for x, keep, _ in self.parts]
        outside = [o[keep & ~o.isnan()].cpu() for _, keep, o in self.parts if o is not None]
        if gather is not None:
            log_rho, outside = gather(log_rho), gather(outside)
        if not log_rho or sum(x.numel() for x in log_rho) == 0:
            return {}
        log_rho = torch.cat(log_rho)
        zeros = torch.zeros_like(log_rho)
        rank = max(1, math.ceil(0.99 * log_rho.numel()))
        out = {
            "mismatch/k3": float(kl_estimate(zeros - log_rho, zeros, "k3").mean()),
            "mismatch/ratio_max": math.exp(float(log_rho.max())),
            "mismatch/ratio_p99": math.exp(float(log_rho.kthvalue(rank).values)),
        }
        if outside and sum(o.numel() for o in outside):
            out["mismatch/outside_truncation"] = float(torch.cat(outside).double().mean())
        return out
