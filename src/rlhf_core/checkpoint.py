"""Atomic, resumable checkpoints and a signal-safe stop.

A checkpoint is `<run_dir>/checkpoints/checkpoint-<step>/`, a plain Hugging Face directory:

    config.json, model.safetensors     (or adapter_config.json + adapter_model.safetensors for LoRA)
    tokenizer files
    trainer_state.pt                   optimizer, scheduler, step, data position, RNG states

It loads with plain `AutoModelForCausalLM.from_pretrained(dir)` (or `PeftModel.from_pretrained`),
no rlhf-lab needed. It is written into a hidden temporary directory and renamed into place, so a
directory named `checkpoint-<step>` is always complete; `latest_checkpoint` ignores anything else.
`trainer_state.pt` holds only tensors and plain Python containers and is read with
`torch.load(..., weights_only=True)`.

`StopSignal` turns SIGINT/SIGTERM into a flag that the training loop checks at safe points (after
an optimizer step); the loop then saves, prints how to resume, and exits 130 (SIGINT) / 143
(SIGTERM).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
from pydantic import Field

from rlhf_core.config import StrictModel
from rlhf_core.selection import SelectionConfig

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.pt"


class CheckpointConfig(StrictModel):
    save_every: int = Field(
        0, ge=0, description="save a checkpoint every k optimizer steps; 0 = off"
    )
    keep_last: int = Field(2, ge=1, description="how many most recent checkpoints to keep")
    save_final: bool = Field(True, description="save the final model to <run_dir>/final")
    best: SelectionConfig = Field(
        default_factory=SelectionConfig,
        description="best-checkpoint selection (<run_dir>/best/) and early stopping on a "
        "held-out metric (rlhf_core.selection)",
    )


# ----------------------------------------------------------------------------- RNG


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
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- save / load


def save_checkpoint(
    checkpoints_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    keep_last: int,
    extra_models: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint-<step> atomically, then delete all but the newest `keep_last`.

    `extra_models` (e.g. {"value": value_model}) are saved with `save_pretrained` into
    subdirectories of the same checkpoint, inside the same atomic rename.

    `state` is the loop's own resumable state (data position, counters); it must contain only
    tensors, numbers, strings, lists and dicts.
    """
    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-checkpoint-{step}-", dir=checkpoints_dir))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, extra in (extra_models or {}).items():
            extra.save_pretrained(tmp / name)
        payload = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": capture_rng_state(),
            "state": state,
        }
        with open(tmp / STATE_FILE, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(checkpoints_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Complete checkpoints under `checkpoints_dir`, oldest first."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for child in checkpoints_dir.iterdir():
        match = CHECKPOINT_RE.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    found = list_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def load_trainer_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Read trainer_state.pt with weights_only=True (no arbitrary code runs)."""
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"not a complete checkpoint (no {STATE_FILE}): {checkpoint_dir}")
    return torch.load(path, map_location="cpu", weights_only=True)


def restore_training_state(
    payload: dict[str, Any], *, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict[str, Any]:
    """Load optimizer/scheduler/RNG from a trainer_state payload; return the loop's own state."""
    optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    restore_rng_state(payload["rng"])
    return payload["state"]


# ----------------------------------------------------------------------------- signals


class StopSignal:
    """Context manager: SIGINT/SIGTERM set `requested` instead of killing the process.

    A second signal of the same kind restores the default behaviour (so Ctrl-C twice still kills).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
