"""The second half of a policy-gradient step: the replay buffer's micro-batches, cut into
optimizer steps, and one clipped optimizer step on each.

Each of the `ppo_epochs` passes over the buffer splits its micro-batches into `mini_batches`
consecutive groups, one optimizer step each (`optimizer_groups`); the rows are shuffled when a
pass takes several steps and kept group by group when it takes one (fewer prompt forwards; the
order of an accumulated sum changes nothing but rounding). `policy_update` runs one step through
`rlhf_core.loop.accumulate_gradients` (PPO's value model trained beside the policy, by the same
backward): each loss is normalised by the step's token and sequence counts summed over all
processes, so the micro-batches and processes add up to the one-big-batch loss.

Not here: the rollouts and advantages (`collect.py`), the loss formulas (`losses.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator

from policy_gradients.dynamic_sampling import even_updates
from policy_gradients.experience import Experience, ReplayBuffer
from policy_gradients.off_policy import MismatchStats, OffPolicyCorrection
from policy_gradients.rollout import completion_logprobs, completion_values
from rlhf_core.distributed import Engine
from rlhf_core.errors import UserError
from rlhf_core.loop import (
    SkippedSteps,
    accumulate_gradients,
    check_engine_accumulation,
    optimizer_step,
)

if TYPE_CHECKING:
    from policy_gradients.config import PGConfig

Trained = tuple[torch.nn.Module, torch.optim.Optimizer, Any]  # (model, optimizer, scheduler)


def check_step_shape(cfg: PGConfig, accelerator: Accelerator) -> None:
    """Refuse a batch that does not split over the processes, more optimizer steps per pass than
    micro-batches, and accumulation the engine cannot do (before anything loads)."""
    alg, ro, t, world = cfg.algorithm, cfg.rollout, cfg.train, accelerator.num_processes
    if ro.prompts_per_step % world:
        raise UserError(f"rollout.prompts_per_step ({ro.prompts_per_step}) must divide by {world}")
    rows_per_rank = ro.prompts_per_step // world * ro.group_size
    micro_per_pass = -(-rows_per_rank // t.micro_batch_size)
    if alg.mini_batches > micro_per_pass and not alg.dynamic_sampling:  # (its rows vary)
        raise UserError(
            f"algorithm.mini_batches ({alg.mini_batches}) exceeds the micro-batches per pass and "
            f"process ({micro_per_pass} = {rows_per_rank} rows / train.micro_batch_size "
            f"{t.micro_batch_size}): lower it or train.micro_batch_size"
        )
    check_engine_accumulation(accelerator, -(-micro_per_pass // alg.mini_batches))


def split_into(batches: list, parts: int) -> list[list]:
    """`batches` cut into `parts` consecutive groups of (nearly) equal size, none empty."""
    parts = max(1, min(parts, len(batches)))
    size, extra = divmod(len(batches), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append(batches[start:end])
        start = end
    return out


def optimizer_groups(
    buffer: ReplayBuffer,
    cfg: PGConfig,
    *,
    step: int,
    epoch: int,
    accelerator: Accelerator,
    filler: Experience | None,
) -> list[tuple[list[Experience], float]]:
    """Pass `epoch` of `step` over the buffer: its micro-batches (seeded by run, step and pass)
    in groups, one optimizer step each, with each group's weight (0 for a stand-in that keeps a
    process short of rows in step with the others: `dynamic_sampling.even_updates`)."""
    alg = cfg.algorithm
    batches = buffer.micro_batches(
        cfg.train.micro_batch_size, seed=cfg.seed * 1_000_003 + step * 101 + epoch,
        shuffle=alg.mini_batches > 1,
    )  # fmt: skip
    groups = split_into(batches, alg.mini_batches)
    if accelerator.num_processes > 1 and alg.dynamic_sampling:  # as many steps everywhere
        return even_updates(accelerator, groups, batches, filler)
    return [(group, 1.0) for group in groups]


def policy_update(
    engine: Engine,
    group: list[Experience],
    weight: float,
    *,
    policy: Trained,
    value: Trained | None,
    loss_fn: Any,
    value_loss_fn: Any,
    cfg: PGConfig,
    skips: SkippedSteps,
    correction: OffPolicyCorrection | None = None,
    mismatch: MismatchStats | None = None,
) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """One optimizer step on `group` (micro-batches of the replay buffer) for the policy and,
    with PPO, the value model. Returns (the step's loss summed over processes, the policy's
    gradient norm, metrics): each metric is this process's share of the pass's average over its
    rows, in float64, to be summed over the step's updates and over processes. `weight` 0: a
    stand-in forward/backward that adds nothing (see `dynamic_sampling.even_updates`).
    `correction`: the off-policy weights on the policy term (`off_policy.CORRECTIONS`);
    `mismatch`: collects each micro-batch's pi_old and mu (pass it on one pass per step)."""
    accelerator, alg = engine.accelerator, cfg.algorithm
    model, value_model = policy[0], value[0] if value is not None else None
    local = torch.tensor([float(sum(mb.action_mask.sum() for mb in group)),
                          float(sum(len(mb) for mb in group))]) * weight  # fmt: skip
    total_tokens, total_sequences = accelerator.reduce(local.to(accelerator.device), "sum")
    norm = {"total_tokens": total_tokens.clamp(min=1),
            "total_sequences": total_sequences.clamp(min=1)}  # fmt: skip
    updates_per_step = alg.ppo_epochs * alg.mini_batches

    def loss_of(mb: Experience, rows: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        prompt_len = mb.sequence_ids.shape[1] - mb.action_mask.shape[1]
        logps, entropy = completion_logprobs(
            model, mb.sequence_ids, mb.attention_mask, prompt_len,
            temperature=cfg.rollout.temperature, with_entropy=True, action_mask=mb.action_mask,
        )  # fmt: skip
        if mb.log_probs_old is None:  # on-policy: pi_old = pi_theta, detached
            mb.log_probs_old = logps.detach()
        if mismatch is not None and weight > 0:
            mismatch.add(mb)
        if correction is None:
            loss, metrics = loss_fn(logps, mb, entropy=entropy, **norm)
        else:
            if mb.log_probs_behaviour is None:  # e.g. rollouts from a source that has none
                raise UserError(
                    f"algorithm.correction {correction.name!r} needs the sampler's log-probs, "
                    "and these rollouts have none (rollout.behaviour_logprobs)"
                )
            weights, c_metrics = correction(mb)
            loss, metrics = loss_fn(logps, mb, entropy=entropy, importance_weights=weights, **norm)
            metrics.update({f"correction/{k}": v for k, v in c_metrics.items()})
        if value_model is not None:
            values = completion_values(value_model, mb.sequence_ids, mb.attention_mask, prompt_len)
            v_loss, v_metrics = value_loss_fn(None, mb, values=values, **norm)
            metrics = {**metrics, **{f"value/{k}": v for k, v in v_metrics.items()}}
            loss = loss + alg.value_coef * v_loss
        share = len(mb) / float(total_sequences) / updates_per_step * weight
        return loss * weight, {k: v.double() * share for k, v in metrics.items()}

    batches = [(list(range(len(mb))), mb) for mb in group]
    step_loss, metrics = accumulate_gradients(
        engine, (model, value_model), batches, loss_of, step_rows=None
    )
    grad_norm, _ = optimizer_step(
        accelerator, *policy, max_grad_norm=cfg.optim.max_grad_norm, loss=step_loss, skips=skips
    )
    if value is not None:
        optimizer_step(accelerator, *value, max_grad_norm=cfg.optim.max_grad_norm, loss=step_loss)
    return step_loss, grad_norm, metrics
