"""Process-level set-up shared by the trainers: seeds, CPU threads, quiet libraries, the device.

`configure_threads`: torch's default is one thread per core it can see, which oversubscribes when
several processes share a machine; we use the cores this process may actually run on
(`os.sched_getaffinity`) divided by the local world size, unless the config names a number.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


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
    """Silence per-call progress bars and advisory logs of transformers/datasets."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
