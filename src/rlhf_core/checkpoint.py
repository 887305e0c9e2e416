"""Atomic, resumable checkpoints and a signal-safe stop.

A checkpoint is `<run_dir>/checkpoints/checkpoint-<step>/`, a plain Hugging Face directory:

    config.json, model.safetensors     (or adapter_config.json + adapter_model.safetensors for LoRA)
    tokenizer files
    trainer_state.pt                   optimizer, scheduler, step, data position, RNG states

    manifest.json                      written last: every file's size and sha256

It loads with plain `AutoModelForCausalLM.from_pretrained(dir)` (or `PeftModel.from_pretrained`),
no rlhf-lab needed. It is written into a hidden temporary directory, its manifest written last,
and renamed into place, so a directory named `checkpoint-<step>` is complete when it appears;
`latest_checkpoint` ignores anything else. Re-saving a step renames the old directory aside
first, moves the new one in, and only then deletes the old, so no instant leaves a half-deleted
directory under the real name. Bytes can still rot after the rename (a disk error, a copy cut
short): `newest_valid_checkpoint` checks the manifest (sizes and checksums) and falls back to the
newest checkpoint that verifies, with a warning. A model with a non-finite parameter is never
written. `trainer_state.pt` holds only tensors and plain Python containers and is read with
`torch.load(..., weights_only=True)`.

`StopSignal` turns SIGINT/SIGTERM into a flag that the training loop checks at safe points (after
an optimizer step); the loop then saves, prints how to resume, and exits 130 (SIGINT) / 143
(SIGTERM).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
from pydantic import Field

from rlhf_core.config import StrictModel
from rlhf_core.errors import UserError
from rlhf_core.selection import SelectionConfig

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.pt"
#: a sharded (FSDP2) checkpoint's torch.distributed.checkpoint directory (model + optimizer)
SHARDED_DIR = "sharded"
MANIFEST_FILE = "manifest.json"


class CheckpointWriteError(UserError, OSError):
    """Writing a checkpoint failed (disk full, permissions): what failed, and the last good one."""


class NonFiniteModelError(RuntimeError):
    """The model to be saved holds NaN/inf parameters; nothing is written."""


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
    model: torch.nn.Module | None,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    state: dict[str, Any],
    keep_last: int,
    extra_models: dict[str, Any] | None = None,
    staged: dict[str, Path] | None = None,
    rng_per_rank: list[dict[str, Any]] | None = None,
) -> Path:
    """Write checkpoint-<step> atomically, then delete all but the newest `keep_last`.

    `extra_models` (e.g. {"value": value_model}) are saved with `save_pretrained` into
    subdirectories of the same checkpoint, inside the same atomic rename.

    `state` is the loop's own resumable state (data position, counters); it must contain only
    tensors, numbers, strings, lists and dicts.

    A sharded checkpoint (`rlhf_core.distributed`) passes `model=None, optimizer=None`, the
    directory every process wrote its shards into as `staged={SHARDED_DIR: dir}` (moved inside
    the same atomic rename; the manifest covers its files) and every process's RNG states as
    `rng_per_rank`.
    """
    checkpoints_dir = Path(checkpoints_dir)
    if model is not None:  # (a sharded model is checked by every process, rlhf_core.loop)
        assert_finite_parameters(model, where=f"checkpoint-{step}")
    for name, extra in (extra_models or {}).items():
        assert_finite_parameters(extra, where=f"checkpoint-{step}/{name}")
    final = checkpoints_dir / f"checkpoint-{step}"
    tmp: Path | None = None
    try:
        checkpoints_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-checkpoint-{step}-", dir=checkpoints_dir))
        if model is not None:
            model.save_pretrained(tmp, safe_serialization=True)
        for name, directory in (staged or {}).items():
            os.replace(directory, tmp / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, extra in (extra_models or {}).items():
            extra.save_pretrained(tmp / name)
        payload = {
            "step": step,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": capture_rng_state(),
            "state": state,
        }
        if rng_per_rank is not None:
            payload["rng_per_rank"] = rng_per_rank
        with open(tmp / STATE_FILE, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        write_manifest(tmp, step)
        replace_dir(tmp, final)
    except OSError as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        good = newest_valid_checkpoint(checkpoints_dir, quiet=True)
        raise CheckpointWriteError(
            f"could not write checkpoint-{step} in {checkpoints_dir}: {exc}. "
            + (
                f"The last good checkpoint is {good} (resume with --resume {good.parent.parent})"
                if good is not None
                else "There is no earlier checkpoint."
            )
        ) from exc
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(checkpoints_dir)[:-keep_last]:
        aside = old.with_name(f".deleting-{old.name}")  # never a half-deleted checkpoint-<n>
        os.replace(old, aside)
        shutil.rmtree(aside, ignore_errors=True)
    return final


def replace_dir(new: Path, final: Path) -> None:
    """Move `new` to `final`; an existing `final` is renamed aside first and deleted last, so a
    directory named `final` is always either the old one or the new one, whole."""
    if not final.exists():
        os.replace(new, final)
        return
    aside = final.with_name(f".old-{final.name}-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(final, aside)
    os.replace(new, final)
    shutil.rmtree(aside, ignore_errors=True)


def assert_finite_parameters(model: torch.nn.Module, *, where: str) -> None:
    """Refuse to save a model with a NaN/inf parameter (a run never writes a broken model)."""
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param.detach()).all()):
            raise NonFiniteModelError(
                f"{where}: parameter {name} holds NaN/inf values; refusing to save a broken model"
            )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, step: int) -> None:
    """`manifest.json`: size and sha256 of every file below `directory` (written last, fsynced)."""
    files = {}
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST_FILE:
            files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    with open(Path(directory) / MANIFEST_FILE, "w") as fh:
        json.dump({"step": step, "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def verify_checkpoint(directory: str | Path) -> str | None:
    """None if the checkpoint's files match its manifest, else what is wrong. A checkpoint from
    before manifests existed (no manifest.json) is accepted when trainer_state.pt loads."""
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file():
        return f"no {STATE_FILE}"
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        try:
            torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable state means not resumable
            return f"{STATE_FILE} does not load ({type(exc).__name__})"
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{MANIFEST_FILE} unreadable ({exc})"
    for rel, info in files.items():
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != info["size"]:
            return f"{rel} has {path.stat().st_size} bytes, the manifest says {info['size']}"
        if _sha256(path) != info["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def checkpoint_step(path: str | Path) -> int:
    match = CHECKPOINT_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"not a checkpoint directory name: {path}")
    return int(match.group(1))


def newest_valid_checkpoint(checkpoints_dir: str | Path, *, quiet: bool = False) -> Path | None:
    """The newest checkpoint whose files verify; a damaged newer one is skipped with a warning."""
    for path in reversed(list_checkpoints(checkpoints_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        if not quiet:
            print(f"warning: skipping damaged checkpoint {path}: {problem}; falling back to "
                  "the newest one that verifies", file=sys.stderr)  # fmt: skip
    return None


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


def is_sharded_checkpoint(checkpoint_dir: str | Path) -> bool:
    """True for a checkpoint whose weights are torch.distributed.checkpoint shards (no HF files),
    and for the absent subdirectory of such a checkpoint an extra model (e.g. `value`) would have
    in an unsharded one."""
    path = Path(checkpoint_dir)
    return (path / SHARDED_DIR).is_dir() or (
        not path.exists() and (path.parent / SHARDED_DIR).is_dir()
    )


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
    """Load optimizer/scheduler/RNG from a trainer_state payload; return the loop's own state.
    (A sharded checkpoint's optimizer is in its SHARDED_DIR; `rlhf_core.distributed` loads it.)"""
    if payload["optimizer"] is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    restore_rng_state(payload["rng"])
    return payload["state"]


# ----------------------------------------------------------------------------- signals


class StopSignal:
    """Context manager: SIGINT/SIGTERM set `requested` instead of killing the process.

    A second signal of the same kind restores the default behaviour (so Ctrl-C twice still kills).
    Nested in another StopSignal (a pipeline such as the quickstart holds one around the trainers
    it runs), it starts with the outer one's pending signal and hands its own back on exit, so a
    Ctrl-C is never lost between or inside stages. (Python's default handler raises
    KeyboardInterrupt wherever the main thread is, and one raised inside a `__del__`, such as a
    progress bar's while weights load, is printed as "Exception ignored" and dropped: the likely
    way the quickstart test once saw a Ctrl-C lost and the run exit 0.)
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
                continue
            outer = _stop_signal_of(self._previous[sig])
            if outer is not None and outer.signum is not None and self.signum is None:
                self.signum = outer.signum  # a signal that came before this block
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
            outer = _stop_signal_of(handler)
            if outer is not None and outer.signum is None and self.signum is not None:
                outer.signum = self.signum


def _stop_signal_of(handler: Any) -> StopSignal | None:
    """The StopSignal whose handler `handler` is, if it is one."""
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, StopSignal) else None
