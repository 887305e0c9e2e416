"""Run under `torch.distributed.run` (2 processes) by
tests/policy_gradients/test_pg_off_policy.py: each process adds its own micro-batches to a
`MismatchStats` and writes `metrics(gather_object)` to <out>/rank<r>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from policy_gradients.experience import Experience


def experiences(rank: int) -> list[Experience]:
    """Rank `rank`'s micro-batches: different sizes, rho spread around 1, some tokens outside."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for rows in (3 + rank, 2):
        mask = torch.rand(rows, 6, generator=g) > 0.25
        old = -torch.rand(rows, 6, generator=g, dtype=torch.float64) * 2
        mu = old + torch.randn(rows, 6, generator=g, dtype=torch.float64) * (0.2 + 0.3 * rank)
        out.append(Experience(
            sequence_ids=torch.zeros(rows, 8, dtype=torch.long),
            attention_mask=torch.ones(rows, 8, dtype=torch.long), action_mask=mask,
            log_probs_old=old, advantages=torch.zeros(rows, 6), log_probs_behaviour=mu.float(),
            outside_sampling_set=(torch.rand(rows, 6, generator=g) > 0.7).float(),
        ))  # fmt: skip
    return out


def main(out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    from policy_gradients.off_policy import MismatchStats

    rank = Accelerator(cpu=True).process_index  # gloo, as the trainers on CPU
    stats = MismatchStats()
    for experience in experiences(rank):
        stats.add(experience)
    (out / f"rank{rank}.json").write_text(json.dumps(stats.metrics(gather_object)))
    import torch.distributed as dist

    if dist.is_initialized():  # leave together: a rank exiting with gloo's threads alive aborts
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
