"""Process-level settings of `rlhf_core.runtime`: freed memory kept for the next step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf_core.loop import BaseLoopConfig
from rlhf_core.runtime import retain_freed_memory

# a step's worth of large allocations, freed and made again: minor page faults per round
PROBE = """
import json, resource, sys, torch
from rlhf_core.runtime import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else False
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(16 << 20) for _ in range(4)]  # 4 x 64 MiB, written
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_retained_memory_is_not_faulted_in_again_each_round():
    default, retained = probe("default"), probe("retain")
    assert retained["applied"] and not default["applied"]
    pages = 4 * (64 << 20) // 4096  # what 4 fresh 64 MiB tensors touch
    # glibc's default maps each block afresh and unmaps it on free: every round faults them in
    assert min(default["faults"]) > 0.9 * pages
    # retained, the heap grows over the first rounds (small allocations between the large
    # ones shift where they fit), then the same pages serve every round
    assert retained["faults"][0] > 0.9 * pages
    assert max(retained["faults"][-3:]) < 0.05 * pages


def test_it_is_on_by_default_for_cpu_training_and_can_be_switched_off():
    assert BaseLoopConfig().retain_freed_memory is True
    assert BaseLoopConfig(retain_freed_memory=False).retain_freed_memory is False
    assert retain_freed_memory() in (True, False)  # never raises, whatever the platform
