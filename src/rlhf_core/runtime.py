"""Process-level set-up shared by the trainers: seeds and the RNGs' state (saved in checkpoints),
CPU threads, quiet libraries, the device.

`configure_threads`: torch's default is one thread per core it can see, which oversubscribes when
several processes share a machine; we use the cores this process may actually run on
(`os.sched_getaffinity`) divided by the local world size, unless the config names a number.
glibc's allocator settings are the speed plan's (`rlhf_core.fastpath.start_speed`).
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def capture_rng_state() -> dict[str, Any]:
    """Every RNG the loop may touch (python, numpy, torch CPU/CUDA) as weights_only-safe data."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [
            np_kind,
            torch.from_numpy(np_keys.astype(np.int64)),
            np_pos,
            np_has_gauss,
            np_gauss,
        ],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every RNG to a `capture_rng_state` result."""
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op threads; None = free cores / local processes. Returns the number."""
    if threads is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, available_cores() // max(1, local))
    torch.set_num_threads(threads)
    return threads


def quiet_libraries() -> None:
    """Silence per-call progress bars and advisory logs of transformers/datasets. datasets is
    told through the environment variables it reads when imported, so a run that never loads a
    data file (reasoning-gym rows, the tiny world) does not pay its import (with pandas'); a
    user's own setting of them is kept."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if "datasets" in sys.modules:  # imported already: its settings were read; set them now
        import datasets

        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
