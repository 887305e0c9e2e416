"""The allocator policy of the speed plan (`rlhf_core.fastpath`): freed memory kept for the next
step on the CPU, one owner for glibc's settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf_core.loop import BaseLoopConfig

# a step's worth of large allocations, freed and made again: minor page faults per round;
# "retain" calls the function, "loop-on" / "loop-off" start a trainer's accelerator on the CPU
PROBE = """
import json, resource, sys, torch
from rlhf_core.fastpath import SpeedConfig, allocator_policy, retain_freed_memory
from rlhf_core.loop import BaseLoopConfig, start_engine
mode = sys.argv[1]
applied = retain_freed_memory() if mode == "retain" else None
if mode.startswith("loop"):
    speed = SpeedConfig(allocator=mode == "loop-on")
    start_engine(BaseLoopConfig(device="cpu", speed=speed))
    applied = allocator_policy()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(16 << 20) for _ in range(4)]  # 4 x 64 MiB, written
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""
PAGES = 4 * (64 << 20) // 4096  # what 4 fresh 64 MiB tensors touch


def probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def faulted_every_round(result: dict) -> bool:
    """glibc's default maps each block afresh and unmaps it on free: every round faults them."""
    return min(result["faults"]) > 0.9 * PAGES


def settles(result: dict) -> bool:
    """Retained, the heap grows over the first rounds (small allocations between the large ones
    shift where they fit), then the same pages serve every round."""
    return result["faults"][0] > 0.9 * PAGES and max(result["faults"][-3:]) < 0.05 * PAGES


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")


@linux_only
def test_retained_memory_is_not_faulted_in_again_each_round():
    default, retained = probe("default"), probe("retain")
    assert retained["applied"] is True
    assert faulted_every_round(default) and settles(retained)


@linux_only
def test_a_cpu_trainer_retains_freed_memory_unless_switched_off():
    # `start_engine` (every trainer's first step) applies the plan's allocator policy, which
    # `train.speed.allocator` switches off
    assert BaseLoopConfig().speed.allocator is True
    on, off = probe("loop-on"), probe("loop-off")
    assert on["applied"] == "retain" and off["applied"] == "glibc defaults"
    assert settles(on) and faulted_every_round(off)


QUIET = """
import json, os, sys
from rlhf_core.runtime import quiet_libraries
quiet_libraries()
before = "datasets" in sys.modules
import datasets, transformers
print(json.dumps({"imported_before": before,
                  "datasets": datasets.utils.logging.get_verbosity(),
                  "bars": datasets.is_progress_bar_enabled(),
                  "transformers": transformers.utils.logging.get_verbosity()}))
"""


@pytest.mark.parametrize("user_level", [None, "info"])
def test_quiet_libraries_silences_datasets_without_importing_it(user_level):
    """quiet_libraries() leaves datasets unimported (its import costs a trainer ~0.6 s) and it is
    quiet when a data file loads it later; a user's own DATASETS_VERBOSITY is kept."""
    import logging
    import os

    ours = ("DATASETS_VERBOSITY", "HF_DATASETS_DISABLE_PROGRESS_BARS")
    env = {k: v for k, v in os.environ.items() if k not in ours}
    if user_level:
        env["DATASETS_VERBOSITY"] = user_level
    out = subprocess.run([sys.executable, "-c", QUIET], capture_output=True, text=True, env=env,
                         check=True).stdout  # fmt: skip
    got = json.loads(out.strip().splitlines()[-1])
    assert got["imported_before"] is False
    assert got["datasets"] == (logging.INFO if user_level else logging.ERROR)
    assert got["bars"] is False and got["transformers"] == logging.ERROR
