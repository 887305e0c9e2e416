"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2): keep only the groups
whose rewards are not all equal, and generate again until the step has `prompts_per_step` of
them or `algorithm.max_sampling_rounds` rounds have run.

A group whose G completions all score the same has zero group-relative advantage: it adds no
gradient, only shrinks the batch the loss is averaged over. `collect_experience` generates in
rounds and asks a `GroupFilter` which groups of each round to keep.

Under several processes each process holds a slice of every round's groups. The keep decision is
global (`global_keep`): the first informative groups in the global batch's order, exactly those
one process would keep from the same batch, so the kept set does not depend on the process
count. The processes may then end a step with different numbers of groups, one even with none;
but every optimizer step needs one synchronised backward on every process (DDP's all-reduce), so
`even_updates` gives every process as many steps, a short one adding zero-weight stand-ins.

Not here: DAPO's other parts, configured elsewhere: the decoupled clip range (the `clipped`
loss's eps_low/eps_high, `losses`), token-level aggregation (`rlhf_core.logprobs.aggregate`),
and the overlong penalty (the `overlong` reward, `rewards`).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import gather_object


def global_keep(
    informative: list[bool], positions: list[int], room: int, everyone: list[tuple[int, bool]]
) -> list[bool]:
    """Which of this process's groups (at global `positions`, `informative` or not) to keep:
    those among the first `room` informative groups of the whole batch in global order, where
    `everyone` lists every process's (position, informative). One process keeps exactly these
    groups of the same batch, so the kept set does not depend on the process count."""
    chosen = [p for p, flag in sorted(everyone) if flag][:room]
    kept = set(chosen)
    return [flag and p in kept for p, flag in zip(positions, informative, strict=True)]


class GroupFilter:
    """One step's keep decisions, round after round: every process calls `keep` for each round
    (it gathers), and the step is `full` once all processes together kept `prompts_per_step`
    groups."""

    def __init__(self, prompts_per_step: int, group_size: int, world: int) -> None:
        self.prompts_per_step, self.group_size, self.world = prompts_per_step, group_size, world
        self.kept_everywhere = 0  # groups kept by all processes together

    def keep(self, total: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """(groups,) bool: which of this process's groups of a round to keep. `total` holds the
        round's rewards, (rows,) or per token (rows, T), a group's G rows consecutive;
        `positions` are the groups' places in the global batch."""
        grouped = (total if total.dim() == 1 else total.sum(-1)).view(-1, self.group_size)
        informative = (grouped.max(-1).values > grouped.min(-1).values).tolist()
        everyone = list(zip(positions, informative, strict=True))
        if self.world > 1:
            everyone = gather_object(everyone)
        room = self.prompts_per_step - self.kept_everywhere
        keep = torch.tensor(global_keep(informative, positions, room, everyone))
        self.kept_everywhere += min(room, sum(flag for _, flag in everyone))
        return keep

    @property
    def full(self) -> bool:
        return self.kept_everywhere >= self.prompts_per_step


def even_updates(
    accelerator: Any, groups: list[list], batches: list, filler: Any
) -> list[tuple[list, float]]:
    """(group, weight) pairs, as many on every process. With dynamic sampling the processes
    keep different numbers of groups, so one may have fewer micro-batches (or none) than the
    others' optimizer steps. Every step needs one synchronised backward on every process (DDP's
    all-reduce), so a process short of groups adds zero-weight stand-ins: one of its own
    micro-batches, or the dropped group `collect_experience` kept for this (`Collected.filler`).
    The gradients and losses are those of the real groups alone."""
    real = [g for g in groups if g]
    count = torch.tensor(len(real), device=accelerator.device)
    steps = max(1, int(accelerator.reduce(count, reduction="max")))
    stand_in = batches[:1] or [filler]
    return [(g, 1.0) for g in real] + [(stand_in, 0.0)] * (steps - len(real))
