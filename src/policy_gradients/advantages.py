"""Advantage estimators, chosen by name from the registry `ADVANTAGES`.

An estimator turns the rewards of one batch of rollouts into per-token advantages (B, T) aligned
with the completion tokens (and, for `gae`, value targets):

    advantages, returns = estimator(rewards, action_mask=m, group_ids=g, values=v)

    rewards      (B,) one scalar per completion, or (B, T) dense per-token rewards
    action_mask  (B, T) bool or 0/1: 1 on completion tokens through the first eos
    group_ids    (B,) integers; completions of one prompt share an id (group estimators)
    values       (B, T) value-model predictions at rollout time (`gae`)
    advantages   (B, T), exactly 0 where action_mask is 0
    returns      (B, T) value targets for `gae` (0 where action_mask is 0), None for the others

    name       advantage of completion i in group g (r: its scalar reward)     groups  values
    grpo       (r_i - mean_g r) / (std_g r + eps)   std unbiased (n - 1)       yes     no
    dr_grpo    r_i - mean_g r                                                  yes     no
    rloo       r_i - mean_{j in g, j != i} r_j                                 yes     no
    turn_grpo  per turn j: A_ij + lam sum_{k>j} A_ik, A_ij GRPO over turn j   yes     no
               (rewards per turn: dense (B, T), turns = runs of action_mask)
    reinforce  r_i  (minus the batch mean with baseline="batch_mean")          no      no
    gae        A_t = sum_l (gamma lam)^l delta_{t+l},
               delta_t = r_t + gamma V_{t+1} - V_t,  V after the last token = 0  no      yes

Sequence-level advantages are broadcast over the completion's tokens. The group estimators work
on scalar rewards; given dense (B, T) rewards they raise unless `dense_reduction="sum"` is set,
which sums each completion's rewards over its masked tokens first. `reinforce` turns dense rewards
into the reward-to-go sum_{t' >= t} r_t' (Williams' return with gamma = 1); `gae` takes dense
rewards as they are and puts a scalar reward on the last completion token (the last 1 of
action_mask). Rewards at positions where action_mask is 0 are ignored.

Statistics are taken over the units the rewards are given in: completions (B,) for scalar
rewards, masked tokens for per-token quantities. A completion whose action_mask row is all 0 still
has its scalar reward counted in its group's or the batch's statistics; its advantages are 0.

Estimators run once per policy step on the whole rollout batch (not per micro-batch), so they check
their inputs eagerly, including values that need a device sync (finite rewards, a 0/1 mask).

Not here: process-supervision advantages (DeepSeekMath section 4.1.3), batch-level std scaling
(TRL's scale_rewards="batch"), REINFORCE++'s global normalisation, KL penalties in the reward (the
caller adds them to the dense rewards), and dynamic sampling (the train loop drops groups).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, Literal

import torch

from rlhf_core.logprobs import masked_mean, masked_sum
from rlhf_core.registry import Configurable, Registry

ADVANTAGES: Registry[type[AdvantageEstimator]] = Registry("advantage estimator")

# Whitening is (x - mean) / sqrt(var + WHITEN_EPS) with the unbiased variance, as TRL's
# `masked_whiten` (PPO) does.
WHITEN_EPS = 1e-8

DenseReduction = Literal["sum"] | None


class AdvantageEstimator(Configurable):
    """Input checks and broadcasting shared by every estimator.

    A subclass sets `needs_groups` / `needs_values`, takes its settings as keyword-only
    `__init__` arguments stored under their own names, and implements `_estimate`. Arguments an
    estimator does not need (group_ids, values) are ignored.

    `sum_across_processes`: set by the trainer when several processes each hold a slice of one
    step's rollouts (a function summing a tensor over them); whitening then standardises with the
    mean and variance of the whole step's batch, as one process would, instead of its own slice.
    """

    sum_across_processes: Callable[[torch.Tensor], torch.Tensor] | None = None

    name: ClassVar[str] = "advantage estimator"  # replaced by the registered name
    role: ClassVar[str] = "advantage estimator"
    needs_groups: ClassVar[bool] = False
    needs_values: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def __call__(
        self,
        rewards: torch.Tensor,
        *,
        action_mask: torch.Tensor,
        group_ids: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rewards (B,) or (B, T) -> (advantages (B, T), returns (B, T) or None)."""
        mask = self._check_mask(action_mask)
        rewards = self._check_rewards(rewards, mask)
        if self.needs_groups:
            group_ids = self._check_groups(group_ids, mask.shape[0])
        if self.needs_values:
            values = self._check_values(values, mask, rewards.dtype)
        return self._estimate(rewards, mask, group_ids, values)

    def _estimate(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        group_ids: torch.Tensor | None,
        values: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    # ------------------------------------------------------------------ input checks

    def _error(self, message: str) -> ValueError:
        return ValueError(f"{self.name} advantage estimator: {message}")

    def _check_mask(self, action_mask: torch.Tensor) -> torch.Tensor:
        if not isinstance(action_mask, torch.Tensor) or action_mask.dim() != 2:
            shape = getattr(action_mask, "shape", type(action_mask).__name__)
            raise self._error(f"action_mask must be a (B, T) tensor, got {shape}")
        if action_mask.dtype != torch.bool and not bool(
            ((action_mask == 0) | (action_mask == 1)).all()
        ):
            raise self._error("action_mask must be bool or hold only 0 and 1")
        return action_mask.bool()

    def _check_rewards(self, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, width = mask.shape
        if not isinstance(rewards, torch.Tensor) or tuple(rewards.shape) not in (
            (batch,),
            (batch, width),
        ):
            shape = tuple(getattr(rewards, "shape", ())) or type(rewards).__name__
            raise self._error(
                f"rewards must have shape (B,) = ({batch},) or (B, T) = ({batch}, {width}) "
                f"to match action_mask, got {shape}"
            )
        if not rewards.dtype.is_floating_point:
            rewards = rewards.to(torch.get_default_dtype())
        if not bool(
            torch.isfinite(torch.where(self._reward_mask(rewards, mask), rewards, 0)).all()
        ):
            raise self._error("rewards must be finite (found nan or inf)")
        return rewards

    @staticmethod
    def _reward_mask(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return mask if rewards.dim() == 2 else torch.ones_like(rewards, dtype=torch.bool)

    def _check_groups(self, group_ids: torch.Tensor | None, batch: int) -> torch.Tensor:
        if group_ids is None:
            raise self._error(
                "needs group_ids (B,) (completions of one prompt share an id), got None"
            )
        if (
            not isinstance(group_ids, torch.Tensor)
            or tuple(group_ids.shape) != (batch,)
            or group_ids.dtype.is_floating_point
            or group_ids.dtype.is_complex
        ):
            desc = (
                f"{tuple(group_ids.shape)} {group_ids.dtype}"
                if isinstance(group_ids, torch.Tensor)
                else type(group_ids).__name__
            )
            raise self._error(
                f"group_ids must be an integer tensor of shape ({batch},), got {desc}"
            )
        return group_ids

    def _check_values(
        self, values: torch.Tensor | None, mask: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        if values is None:
            raise self._error("needs values (B, T) from the value model, got None")
        if not isinstance(values, torch.Tensor) or values.shape != mask.shape:
            shape = tuple(getattr(values, "shape", ())) or type(values).__name__
            raise self._error(
                f"values must have the action_mask shape {tuple(mask.shape)}, got {shape}"
            )
        if not bool(torch.isfinite(torch.where(mask, values, 0)).all()):
            raise self._error("values must be finite on completion tokens (found nan or inf)")
        return values.to(torch.promote_types(dtype, values.dtype))

    # ------------------------------------------------------------------ shared pieces

    @staticmethod
    def _broadcast(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Sequence advantages (B,) -> (B, T) on the completion tokens, 0 elsewhere."""
        return torch.where(mask, advantages[:, None], torch.zeros_like(advantages[:, None]))

    def _whiten(self, x: torch.Tensor, mask: torch.Tensor, what: str) -> torch.Tensor:
        """(x - mean) / sqrt(var + WHITEN_EPS) over positions where `mask` is true (unbiased
        variance), on every process's positions together (`sum_across_processes`); 0 elsewhere."""
        every = self.sum_across_processes or (lambda t: t)
        count = int(every(mask.sum().to(x.dtype)))
        if count < 2:
            raise self._error(f"whiten needs at least 2 {what} to estimate a variance, got {count}")
        mean = every(masked_sum(x, mask)) / count
        var = every(masked_sum((x - mean).square(), mask)) / (count - 1)
        return torch.where(mask, (x - mean) * torch.rsqrt(var + WHITEN_EPS), torch.zeros_like(x))


# ---------------------------------------------------------------------- group estimators


ADVANTAGES.base = AdvantageEstimator  # what a "module:Class" name in a config must subclass


def group_statistics(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per completion: its group's size n_g, sum and unbiased variance (0 for n_g = 1), each (B,).

    Group ids need not be contiguous or sorted. Sums go through a dense (groups x B) selection and
    a plain reduction, which is deterministic on every device and never uses TF32 matmuls.
    """
    _, index = torch.unique(group_ids, return_inverse=True)
    member = index[None, :] == torch.arange(int(index.max()) + 1, device=index.device)[:, None]
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    size = member.sum(dim=1).to(rewards.dtype)
    total = torch.where(member, rewards[None, :], zero).sum(dim=1)
    centered = rewards - (total / size)[index]
    squares = torch.where(member, centered[None, :].square(), zero).sum(dim=1)
    variance = torch.where(size > 1, squares / (size - 1).clamp(min=1), zero)
    return size[index], total[index], variance[index]


class GroupAdvantageEstimator(AdvantageEstimator):
    """Scalar-reward estimators that compare completions of the same prompt (`group_ids`)."""

    needs_groups = True

    def __init__(self, *, dense_reduction: DenseReduction = None) -> None:
        self._require(
            dense_reduction in (None, "sum"), "dense_reduction", dense_reduction, "'sum' or None"
        )
        self.dense_reduction = dense_reduction

    def _estimate(self, rewards, mask, group_ids, values):
        if rewards.dim() == 2:
            if self.dense_reduction is None:
                raise self._error(
                    f"got dense per-token rewards {tuple(rewards.shape)}, but group estimators "
                    "compare one scalar reward per completion; set dense_reduction: sum to sum "
                    "each completion's rewards over its tokens, or give (B,) rewards"
                )
            rewards = masked_sum(rewards, mask, dim=-1)
        return self._broadcast(self._sequence_advantages(rewards, group_ids), mask), None

    def _sequence_advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@ADVANTAGES.register("grpo")
class GRPOAdvantage(GroupAdvantageEstimator):
    """Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300),
    outcome supervision (section 4.1.2):

        A_i = (r_i - mean_g r) / (std_g r + eps)      for every token of completion i

    std is the unbiased (n - 1) standard deviation, as `torch.std` in TRL's GRPOTrainer; a group
    of one completion has std 0 and advantage 0. A group of equal rewards gives advantages of 0
    (up to rounding of the mean), not nan. Defaults: eps = 1e-6 (TRL uses 1e-4);
    scale_rewards = True. scale_rewards = False drops the division, which is Dr. GRPO's estimator
    (`dr_grpo`).
    """

    def __init__(
        self,
        *,
        eps: float = 1e-6,
        scale_rewards: bool = True,
        dense_reduction: DenseReduction = None,
    ) -> None:
        super().__init__(dense_reduction=dense_reduction)
        self._require(0 < eps < math.inf, "eps", eps, "a positive finite number")
        self.eps = float(eps)
        self.scale_rewards = bool(scale_rewards)

    def _sequence_advantages(self, rewards, group_ids):
        size, total, variance = group_statistics(rewards, group_ids)
        advantages = rewards - total / size
        if self.scale_rewards:
            advantages = advantages / (variance.sqrt() + self.eps)
        return advantages


@ADVANTAGES.register("dr_grpo")
class DrGRPOAdvantage(GroupAdvantageEstimator):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):

        A_i = r_i - mean_g r

    GRPO without the division by the group's std, which up-weights questions that are nearly
    always or never solved. (The paper's other change, a constant loss normaliser instead of
    per-sequence length averaging, is the aggregation mode `seq-mean-token-sum-norm`.)
    """

    def _sequence_advantages(self, rewards, group_ids):
        size, total, _ = group_statistics(rewards, group_ids)
        return rewards - total / size


@ADVANTAGES.register("rloo")
class RLOOAdvantage(GroupAdvantageEstimator):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740;
    Kool et al. 2019):

        A_i = r_i - 1/(n - 1) sum_{j in g, j != i} r_j  =  n / (n - 1) (r_i - mean_g r)

    Each completion's baseline is the mean reward of the other completions of its prompt, so the
    baseline is independent of the completion itself. Needs every group to have n >= 2.
    """

    def _sequence_advantages(self, rewards, group_ids):
        size, total, _ = group_statistics(rewards, group_ids)
        if bool((size < 2).any()):
            lonely = sorted(set(group_ids[size < 2].tolist()))
            raise self._error(
                f"leave-one-out needs at least 2 completions per group; group id(s) {lonely} have 1"
            )
        return rewards - (total - rewards) / (size - 1)


@ADVANTAGES.register("turn_grpo")
class TurnGRPOAdvantage(AdvantageEstimator):
    """Turn-level credit for multi-turn episodes: MT-GRPO (Zeng et al. 2025, "Reinforcing
    Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment", arXiv:2505.11821).

    The paper, for a tool turn and an answer turn, with turn reward R^T and outcome reward R^O:

        A_i(turn 1) = A^T_i + lam * A^O_i,    A_i(turn 2) = A^O_i,
        A^X_i = (R^X_i - mean_g R^X) / std_g R^X

    Here for any number of turns: with R_ij the reward of model turn j of episode i (the dense
    rewards summed over that turn's tokens; `environment` with `per_turn: true` puts each turn's
    reward on its last token; 0 for a turn the episode never reached) and
    A_ij = (R_ij - mean_g R_.j) / (std_g R_.j + eps) over i's group (std unbiased;
    scale_rewards = False drops the division),

        A_i(token in turn j) = A_ij + lam * sum_{k > j} A_ik

    A turn is a run of consecutive action_mask 1s (environment tokens between turns are 0).
    An episode that ends early earns 0 for the turns it missed, as the paper's outcome reward is
    0 for a trajectory without an answer: ending early (e.g. a reply that derails instead of
    finishing a broken call) is not a way around a later turn's reward. With one turn per
    episode this is `grpo`; with lam = 1 and scale_rewards = False the first turn gets exactly
    Dr. GRPO's advantage of the episode's summed reward. lam = 0 credits a turn with its own
    reward only.
    """

    needs_groups = True

    def __init__(self, *, lam: float = 1.0, eps: float = 1e-6, scale_rewards: bool = True) -> None:
        self._require(0 <= lam < math.inf, "lam", lam, "a finite number >= 0")
        self._require(0 < eps < math.inf, "eps", eps, "a positive finite number")
        self.lam, self.eps, self.scale_rewards = float(lam), float(eps), bool(scale_rewards)

    def _estimate(self, rewards, mask, group_ids, values):
        if rewards.dim() != 2:
            raise self._error(
                f"needs per-turn rewards (B, T), got {tuple(rewards.shape)}; give the "
                "environment reward per_turn: true"
            )
        starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
        turn = torch.where(mask, starts.long().cumsum(dim=1) - 1, -1)  # (B, T), -1 off turns
        turns = int(turn.max()) + 1 if bool(mask.any()) else 0
        one_hot = turn[:, :, None] == torch.arange(turns, device=mask.device)  # (B, T, J)
        per_turn = torch.where(one_hot, rewards[:, :, None], 0).sum(dim=1)  # R_ij (B, J), 0 if none
        advantage = torch.zeros_like(per_turn)
        for j in range(turns):
            size, total, variance = group_statistics(per_turn[:, j], group_ids)
            advantage[:, j] = per_turn[:, j] - total / size
            if self.scale_rewards:
                advantage[:, j] = advantage[:, j] / (variance.sqrt() + self.eps)
        later = advantage.flip(1).cumsum(dim=1).flip(1) - advantage  # sum_{k > j} A_ik
        credit = advantage + self.lam * later
        tokens = torch.where(one_hot, credit[:, None, :], 0).sum(dim=2)
        return torch.where(mask, tokens, torch.zeros_like(tokens)), None


# ---------------------------------------------------------------------- batch estimators


@ADVANTAGES.register("reinforce")
class ReinforceAdvantage(AdvantageEstimator):
    """REINFORCE (Williams 1992, "Simple statistical gradient-following algorithms"):

        A_i = r_i - b     (scalar rewards, for every token of completion i)
        A_t = G_t - b,    G_t = sum_{t' >= t} r_t'     (dense rewards: the reward-to-go)

    b = 0 with baseline="none"; with baseline="batch_mean", b is the batch mean of the rewards
    (over completions for scalar rewards, over masked tokens of G for dense ones; it includes the
    completion itself: use `rloo` for a leave-one-out baseline). whiten = True then standardises
    the advantages over the same units, (A - mean) / sqrt(var + 1e-8) with the unbiased
    variance. Defaults: baseline = "none", whiten = False.
    """

    def __init__(
        self,
        *,
        baseline: Literal["none", "batch_mean"] = "none",
        whiten: bool = False,
    ) -> None:
        self._require(
            baseline in ("none", "batch_mean"), "baseline", baseline, "'none' or 'batch_mean'"
        )
        self.baseline = baseline
        self.whiten = bool(whiten)

    def _estimate(self, rewards, mask, group_ids, values):
        if rewards.dim() == 1:
            units = torch.ones_like(rewards, dtype=torch.bool)
            advantages, what = rewards, "completions"
        else:
            units, what = mask, "completion tokens"
            advantages = reward_to_go(rewards, mask, gamma=1.0)
        if self.baseline == "batch_mean":
            advantages = advantages - masked_mean(advantages, units)
        if self.whiten:
            advantages = self._whiten(advantages, units, what)
        if advantages.dim() == 1:
            return self._broadcast(advantages, mask), None
        return torch.where(mask, advantages, torch.zeros_like(advantages)), None


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """G_t = sum_{t' >= t} gamma^(t' - t) r_t' over masked positions of each row (B, T); 0 where
    the mask is 0 (masked-out positions are skipped, not counted as steps)."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(mask[:, t], running, 0)
    return out


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar rewards (B,) placed on each row's last completion token (the last 1 of `mask`),
    (B, T); a row with no completion token gets no reward."""
    width = mask.shape[1]
    positions = torch.arange(width, device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1)  # -1: fully masked row
    return torch.where(
        positions == last[:, None], rewards[:, None], torch.zeros_like(rewards[:, None])
    )


@ADVANTAGES.register("gae")
class GAEAdvantage(AdvantageEstimator):
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438), as used by PPO
    for language models (one completion = one episode, one token = one step):

        delta_t = r_t + gamma V_{t+1} - V_t           (V after the last token = 0: the episode ends)
        A_t     = delta_t + gamma lam A_{t+1}          (= sum_l (gamma lam)^l delta_{t+l})
        R_t     = A_t + V_t                            (value targets, `returns`)

    Rewards are per token (B, T); a scalar reward (B,) sits on the last completion token. Steps
    are the masked tokens of a row in order (masked-out positions are skipped). whiten = True
    standardises the advantages over all masked tokens of the batch, (A - mean) / sqrt(var + 1e-8)
    with the unbiased variance (TRL's PPO `masked_whiten`), after the returns are taken from the
    raw advantages. Defaults: gamma = 1, lam = 0.95, whiten = True (TRL's PPO).
    """

    needs_values = True

    def __init__(self, *, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True) -> None:
        self._require(0 <= gamma <= 1, "gamma", gamma, "in [0, 1]")
        self._require(0 <= lam <= 1, "lam", lam, "in [0, 1]")
        self.gamma = float(gamma)
        self.lam = float(lam)
        self.whiten = bool(whiten)

    def _estimate(self, rewards, mask, group_ids, values):
        if rewards.dim() == 1:
            rewards = last_token_rewards(rewards, mask)
        rewards = rewards.to(values.dtype)
        advantages = torch.zeros_like(values)
        next_value = torch.zeros_like(values[:, 0])
        next_advantage = torch.zeros_like(values[:, 0])
        for t in reversed(range(values.shape[1])):
            step = mask[:, t]
            delta = rewards[:, t] + self.gamma * next_value - values[:, t]
            advantage = delta + self.gamma * self.lam * next_advantage
            advantages[:, t] = torch.where(step, advantage, 0)
            next_advantage = torch.where(step, advantage, next_advantage)
            next_value = torch.where(step, values[:, t], next_value)
        returns = torch.where(mask, advantages + values, torch.zeros_like(values))
        if self.whiten:
            advantages = self._whiten(advantages, mask, "completion tokens")
        return advantages, returns
