"""DAPO's dynamic-sampling keep decision across processes (`dynamic_sampling.global_keep`):
each process keeps exactly the groups one process would keep from the same global batch."""

from __future__ import annotations

import random

import pytest

from policy_gradients.dynamic_sampling import global_keep


def one_process_keep(flags: list[bool], room: int) -> list[bool]:
    kept, out = 0, []
    for flag in flags:
        out.append(flag and kept < room)
        kept += out[-1]
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(20))
def test_every_process_keeps_its_share_of_what_one_process_keeps(world, seed):
    rng = random.Random(seed)
    batch = 12
    flags = [rng.random() < 0.5 for _ in range(batch)]
    room = rng.randint(0, batch)
    everyone = list(enumerate(flags))
    rng.shuffle(everyone)  # gathered in any order
    want = one_process_keep(flags, room)
    got = [False] * batch
    for rank in range(world):
        positions = list(range(batch))[rank::world]
        mine = global_keep([flags[p] for p in positions], positions, room, everyone)
        for p, keep in zip(positions, mine, strict=True):
            got[p] = keep
    assert got == want
    assert sum(got) == min(room, sum(flags))
