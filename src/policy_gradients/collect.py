"""One step's experience: rollouts -> rewards -> old/reference log-probs -> advantages.

`collect_experience` is the first half of a policy-gradient step, kept out of `train.py` so that
file reads as the loop. With DAPO's dynamic sampling (`dynamic_sampling.GroupFilter`) it
generates in rounds, keeps only groups whose rewards are not all equal, and stops once it has
`prompts_per_step` groups or `max_sampling_rounds` rounds. Each round becomes its own
`Experience` (rows of different rounds differ in width; the replay buffer never mixes them).

It is two halves: `sample_step` (draw prompts, generate, score: needs only the sampling policy)
and `digest_step` (the trainer's forwards, advantages, log rows). The synchronous loop runs both
with the current weights; with asynchronous rollouts a generator process runs `sample_step` with
older weights (`policy_gradients.async_rollouts`) and the trainer `digest_step`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object

from policy_gradients.advantages import last_token_rewards
from policy_gradients.dynamic_sampling import GroupFilter
from policy_gradients.episodes import EpisodeRunner, episode_records
from policy_gradients.experience import Experience
from policy_gradients.off_policy import outside_sampling_set
from policy_gradients.rewards import CombinedReward, RewardInput
from policy_gradients.rollout import (
    PromptSet,
    completion_logprobs,
    completion_values,
    generate_rollouts,
)
from rlhf_core.data import EpochSampler
from rlhf_core.kl import kl_estimate
from rlhf_core.logprobs import masked_mean, masked_sum
from rlhf_core.models import ReferencePolicy

if TYPE_CHECKING:
    from policy_gradients.config import PGConfig

# Seeds of a prompt's samples mix (run seed, step, round, place in the global batch) with these
# primes, so no two (step, round, place) triples of a run share a seed (for rounds < 1_009 and
# places < 100_003) and the rollouts do not depend on the number of processes.
STEP_PRIME = 1_000_003
ROUND_PRIME = 1_009
PLACE_PRIME = 100_003
# Group ids are unique over a run: step * GROUP_ID_STRIDE + the group's place in the step.
GROUP_ID_STRIDE = 100_000


def sample_seed(seed: int, step: int, round_: int, place: int) -> int:
    """The generation seed of the prompt at global `place` in round `round_` of `step`."""
    return ((seed * STEP_PRIME + step) * ROUND_PRIME + round_) * PLACE_PRIME + place


@dataclass
class Collected:
    experiences: list[Experience]
    metrics: dict[str, float]
    log_rows: list[tuple] = field(default_factory=list)
    # this process's raw sums over its completions and its counts, for `merge_rollout_metrics`
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    # dynamic sampling under several processes, when this process kept no group: one group it
    # dropped, to run a zero-weight forward/backward so the gradient all-reduce still meets
    filler: Experience | None = None
    # with an environment: the rollout log's `turns` rows (`policy_gradients.episodes`)
    turn_rows: list[tuple] = field(default_factory=list)


def rollout_metrics(
    sums: dict[str, float], counts: dict[str, int], times: dict[str, float]
) -> dict[str, float]:
    """Per-completion means of the rollout sums, the group counts and the phase times."""
    n = max(1, counts["completions"])
    return {
        **{k: v / n for k, v in sums.items()}, **times,
        "sampling/groups": counts["groups"], "sampling/dropped_groups": counts["dropped_groups"],
    }  # fmt: skip


def merge_rollout_metrics(collected: Collected, gathered: list[tuple[dict, dict]]) -> dict:
    """The metrics of every process's rollouts together (`gathered`: each process's
    (sums, counts)): means over all completions, counts summed; times stay this process's."""
    sums: dict[str, float] = {}
    counts = dict.fromkeys(collected.counts, 0)
    for part_sums, part_counts in gathered:
        for k, v in part_sums.items():
            sums[k] = sums.get(k, 0.0) + v
        for k, v in part_counts.items():
            counts[k] += v
    times = {k: v for k, v in collected.metrics.items() if k.startswith("time/")}
    return rollout_metrics(sums, counts, times)


def gather_collected(collected: Collected, world: int) -> list[tuple]:
    """Under several processes: every process's rollout-log rows (rank 0 writes them) and, into
    `collected.metrics`, the metrics of all processes' rollouts together. Every process calls it."""
    if world == 1:
        return collected.log_rows
    rows = gather_object(collected.log_rows)
    parts = gather_object([(collected.sums, collected.counts)])
    collected.metrics = merge_rollout_metrics(collected, parts)
    return rows


def experience_of(
    rows: torch.Tensor,
    *,
    rollouts: Any,
    total: torch.Tensor,
    parts: dict[str, torch.Tensor],
    group_ids: torch.Tensor,
    policy: torch.nn.Module,
    reference: ReferencePolicy | None,
    value_model: torch.nn.Module | None,
    estimator: Any,
    cfg: PGConfig,
) -> tuple[Experience, float]:
    """The `Experience` of some rows of one round's rollouts: old/reference log-probs, values,
    the KL-in-reward penalty and advantages; and the seconds the extra forwards took."""
    r, alg, ro = cfg.rollout, cfg.algorithm, rollouts
    device = next(policy.parameters()).device
    mask = ro.action_mask[rows].to(device)
    # on the trainer's device: a generator process's rollouts arrive on the CPU
    ids, attn = ro.sequence_ids[rows].to(device), ro.attention_mask[rows].to(device)
    t0 = time.perf_counter()
    lp_args = (ids, attn, ro.prompt_length)
    lp_kwargs = {"temperature": r.temperature, "action_mask": mask}
    # On-policy (one optimizer step per rollout batch): the policy being updated *is* the
    # sampling policy, so the loss uses its own log-probs detached as the old ones and this
    # extra forward is skipped (as TRL does). The KL in the reward needs pi_old before the
    # update, so it keeps the forward.
    old = None
    if alg.ppo_epochs * alg.mini_batches > 1 or alg.kl_in_reward.beta > 0:
        old = completion_logprobs(policy, *lp_args, **lp_kwargs)
    ref = None
    if reference is not None:
        with reference.model() as ref_model:
            ref = completion_logprobs(ref_model, *lp_args, **lp_kwargs)
    values = None
    if value_model is not None:  # V(s_t) for completion token t: the state before it
        values = completion_values(value_model, ids, attn, ro.prompt_length)
    behaviour = outside = None
    if ro.log_probs_behaviour is not None:  # the sampler's mu, beside the trainer's pi_old
        behaviour = ro.log_probs_behaviour[rows].to(device)
        if r.sampling().truncates:  # diagnostic: sampled tokens the trainer would not sample
            outside = outside_sampling_set(
                policy, ids, attn, ro.prompt_length, mask, r.sampling(),
                rows=cfg.train.micro_batch_size,
            )  # fmt: skip
    seconds = time.perf_counter() - t0
    reward = total[rows].to(device)
    if alg.kl_in_reward.beta > 0:
        kl_tok = kl_estimate(old, ref, alg.kl_in_reward.estimator) * mask
        if getattr(estimator, "needs_values", False) or reward.dim() == 2:
            dense = reward if reward.dim() == 2 else last_token_rewards(reward, mask.bool())
            reward = dense - alg.kl_in_reward.beta * kl_tok
        else:
            reward = reward - alg.kl_in_reward.beta * kl_tok.sum(-1)
    advantages, returns = estimator(
        reward, action_mask=mask, group_ids=group_ids[rows].to(device), values=values
    )
    experience = Experience(
        sequence_ids=ids, attention_mask=attn, action_mask=mask, log_probs_old=old,
        log_probs_ref=ref, values_old=values, advantages=advantages, returns=returns,
        rewards={k: v[rows] for k, v in parts.items()}, group_ids=group_ids[rows],
        log_probs_behaviour=behaviour, outside_sampling_set=outside,
    )  # fmt: skip
    return experience, seconds


@dataclass
class SampledRound:
    """One round of a step's sampling, before any forward of the trainer: the prompts drawn
    (`indices` into the prompt set, `positions` in the global batch, the sampler's `epoch`), the
    rollouts, their rewards (`total`, `parts`) and which groups dynamic sampling keeps."""

    indices: list[int]
    positions: list[int]
    epoch: int
    rollouts: Any  # rollout.Rollouts, or episodes' rollouts with an environment
    total: torch.Tensor
    parts: dict[str, torch.Tensor]
    keep: torch.Tensor  # (groups,) bool


@dataclass
class SampledStep:
    """What sampling one step leaves for the trainer (`sample_step`): its rounds, the weights'
    version that sampled them (training steps those weights had taken) and the seconds spent
    generating and scoring; with a generator process also the sampler's state after the step
    (`policy_gradients.async_rollouts`)."""

    step: int
    version: int
    rounds: list[SampledRound]
    times: dict[str, float]
    sampler: dict[str, int] | None = None


@torch.no_grad()
def sample_step(
    *,
    step: int,
    version: int,
    policy: torch.nn.Module,
    tokenizer,
    prompts: PromptSet,
    sampler: EpochSampler,
    prompts_per_step: int,
    rank: int,
    world: int,
    cfg: PGConfig,
    reward_fn: CombinedReward,
    environment: EpisodeRunner | None = None,
) -> SampledStep:
    """The first half of `collect_experience`: draw the step's prompts, sample and score their
    completions with `policy` (round after round under dynamic sampling, until it keeps
    `prompts_per_step` groups or `max_sampling_rounds` rounds). Needs no model of the trainer's
    but the sampling policy, so a generator process runs it with older weights."""
    r, alg = cfg.rollout, cfg.algorithm
    rounds_out: list[SampledRound] = []
    t_gen = t_score = 0.0
    rounds = alg.max_sampling_rounds if alg.dynamic_sampling else 1
    sampling = GroupFilter(prompts_per_step, r.group_size, world) if alg.dynamic_sampling else None
    for round_ in range(rounds):
        # every rank draws the same global batch and keeps its own slice of whole groups; each
        # prompt's samples are seeded by (seed, step, round, its place in the global batch), so
        # the rollouts are the same whatever the number of processes
        positions = list(range(prompts_per_step))[rank::world]
        indices = sampler.next_batch(prompts_per_step)[rank::world]
        epoch = sampler.epoch
        items = [prompts.items[i] for i in indices]
        seeds = [sample_seed(cfg.seed, step, round_, p) for p in positions]
        t0 = time.perf_counter()
        if environment is None:
            ro = generate_rollouts(
                policy, tokenizer, [it["prompt"] for it in items], group_size=r.group_size,
                max_new_tokens=r.max_new_tokens, sampling=r.sampling(), seeds=seeds,
                behaviour_logprobs=r.behaviour_logprobs,
            )  # fmt: skip
        else:  # multi-turn episodes: model and environment turns (policy_gradients.episodes)
            ro = environment.rollouts(
                policy, tokenizer, items, group_size=r.group_size,
                max_new_tokens=r.max_new_tokens, sampling=r.sampling(), seeds=seeds,
                behaviour_logprobs=r.behaviour_logprobs,
            )  # fmt: skip
        t1 = time.perf_counter()
        total, parts = reward_fn(reward_input(ro, items, prompts, tokenizer, r.group_size,
                                              environment is not None))  # fmt: skip
        t_score += time.perf_counter() - t1
        t_gen += t1 - t0
        keep = torch.ones(len(items), dtype=torch.bool)
        if sampling is not None:  # DAPO: only groups whose rewards differ
            keep = sampling.keep(total, positions)
        rounds_out.append(SampledRound(indices, positions, epoch, ro, total, parts, keep))
        if sampling is not None and sampling.full:
            break
    times = {"time/generate_s": t_gen, "time/score_s": t_score}
    return SampledStep(step=step, version=version, rounds=rounds_out, times=times)


def reward_input(
    ro: Any, items: list[dict], prompts: PromptSet, tokenizer, group_size: int, episodes: bool
) -> RewardInput:
    """What the reward components read of one round: each completion beside its prompt item."""
    rep_items = [it for it in items for _ in range(group_size)]
    return RewardInput(
        prompts=[it["prompt"] for it in rep_items], completions=ro.completions,
        items=rep_items, lengths=ro.action_mask.sum(-1).cpu(), action_mask=ro.action_mask.cpu(),
        scorer=prompts.scorer, completion_ids=ro.completion_token_ids(),
        tokenizer=tokenizer, environment_rewards=ro.rewards if episodes else None,
        environment_turn_rewards=ro.turn_rewards() if episodes else None,
    )  # fmt: skip


@torch.no_grad()
def collect_experience(
    *,
    step: int,
    policy: torch.nn.Module,
    reference: ReferencePolicy | None,
    tokenizer,
    prompts: PromptSet,
    sampler: EpochSampler,
    prompts_per_step: int,
    rank: int,
    world: int,
    cfg: PGConfig,
    reward_fn: CombinedReward,
    estimator: Any,
    value_model: torch.nn.Module | None = None,
    environment: EpisodeRunner | None = None,
) -> Collected:
    """One synchronous step's experience: `sample_step` with the current `policy` (version
    `step`), then `digest_step`."""
    sampled = sample_step(
        step=step, version=step, policy=policy, tokenizer=tokenizer, prompts=prompts,
        sampler=sampler, prompts_per_step=prompts_per_step, rank=rank, world=world, cfg=cfg,
        reward_fn=reward_fn, environment=environment,
    )  # fmt: skip
    return digest_step(
        sampled, policy=policy, reference=reference, prompts=prompts, world=world, cfg=cfg,
        estimator=estimator, value_model=value_model, environment=environment,
    )  # fmt: skip


@torch.no_grad()
def digest_step(
    sampled: SampledStep,
    *,
    policy: torch.nn.Module,
    reference: ReferencePolicy | None,
    prompts: PromptSet,
    world: int,
    cfg: PGConfig,
    estimator: Any,
    value_model: torch.nn.Module | None = None,
    environment: EpisodeRunner | None = None,
) -> Collected:
    """The second half: the trainer's `policy` (pi_old), the reference and value model score
    the kept rows of each round (`experience_of`), advantages, log rows (tagged with the
    sampling weights' version) and the rollout metrics."""
    r, step = cfg.rollout, sampled.step
    experiences, log_rows, turn_rows = [], [], []
    sums: dict[str, float] = {}
    counts = {"groups": 0, "completions": 0, "dropped_groups": 0}
    t_logprobs = 0.0
    filler = None
    for part in sampled.rounds:
        ro, total, parts, keep, indices = part.rollouts, part.total, part.parts, part.keep, \
            part.indices  # fmt: skip
        rep_prompts = [prompts.items[i]["prompt"] for i in indices for _ in range(r.group_size)]
        lengths = ro.action_mask.sum(-1)
        group_ids = torch.arange(len(indices)).repeat_interleave(r.group_size)
        group_ids = group_ids + step * GROUP_ID_STRIDE
        if cfg.algorithm.dynamic_sampling:
            counts["dropped_groups"] += int((~keep).sum())

        round_state = {
            "rollouts": ro, "total": total, "parts": parts, "group_ids": group_ids,
            "policy": policy, "reference": reference, "value_model": value_model,
            "estimator": estimator, "cfg": cfg,
        }  # fmt: skip
        rows = keep.repeat_interleave(r.group_size).nonzero().squeeze(-1)
        if len(rows) == 0:
            if world > 1 and not experiences and filler is None:  # see Collected.filler
                filler, _ = experience_of(torch.arange(r.group_size), **round_state)
            continue
        experience, seconds = experience_of(rows, **round_state)
        t_logprobs += seconds
        experiences.append(experience)
        mask, advantages = experience.action_mask, experience.advantages
        old, ref = experience.log_probs_old, experience.log_probs_ref

        seq_adv = masked_mean(advantages, mask, dim=-1)
        for j, row in enumerate(rows.tolist()):
            components = json.dumps({k: float(v[row].sum()) for k, v in parts.items()})
            # logged under the optimizer step they train (1-based, as in metrics.jsonl): a
            # resume from checkpoint-N keeps rows of steps <= N and redoes the rest
            log_rows.append((
                step + 1, part.epoch, indices[row // r.group_size], row % r.group_size,
                rep_prompts[row], ro.completions[row], float(total[row].sum()), components,
                float(seq_adv[j]), int(lengths[row]), int(ro.truncated[row]), sampled.version,
            ))  # fmt: skip
        if environment is not None:  # per-episode figures, and every turn for the log
            env_sums, turns = episode_records(
                ro, rows.tolist(), step=step + 1, prompt_indices=indices, group_ids=group_ids,
                group_size=r.group_size,
            )  # fmt: skip
            turn_rows += turns
            for key, value in env_sums.items():
                sums[key] = sums.get(key, 0.0) + value
        counts["groups"] += int(keep.sum())
        counts["completions"] += len(rows)
        for key, value in parts.items():
            sums[f"reward/{key}"] = sums.get(f"reward/{key}", 0.0) + float(value[rows].sum())
        sums["reward/total"] = sums.get("reward/total", 0.0) + float(total[rows].sum())
        sums["length/mean"] = sums.get("length/mean", 0.0) + float(lengths[rows].sum())
        sums["length/truncated"] = sums.get("length/truncated", 0.0) + float(
            ro.truncated[rows].sum()
        )
        if ref is not None and old is not None:  # KL(pi || pi_ref): per token, per sequence
            kl_tok = kl_estimate(old, ref, "k3")
            sums["kl/k3"] = sums.get("kl/k3", 0.0) + float(masked_mean(kl_tok, mask, dim=-1).sum())
            sums["kl/k3_sequence"] = sums.get("kl/k3_sequence", 0.0) + float(
                masked_sum(kl_tok, mask)
            )
    times = {**sampled.times, "time/old_ref_values_s": t_logprobs}
    return Collected(
        experiences=experiences, metrics=rollout_metrics(sums, counts, times), log_rows=log_rows,
        sums=sums, counts=counts, filler=None if experiences else filler, turn_rows=turn_rows,
    )  # fmt: skip
