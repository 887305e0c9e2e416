"""Checkpoints, in one place: atomic save and restore of a run, sharded (FSDP2) state, `final/`
and `best/`.

A checkpoint is `<run_dir>/checkpoints/checkpoint-<step>/`, a plain Hugging Face directory:

    config.json, model.safetensors     (or adapter_config.json + adapter_model.safetensors for LoRA)
    tokenizer files
    trainer_state.pt                   optimizer, scheduler, step, data position, RNG states
    sharded/                           instead of the weights, for a sharded (FSDP2) model
    manifest.json                      written last: every file's size and sha256

It loads with plain `AutoModelForCausalLM.from_pretrained(dir)` (or `PeftModel.from_pretrained`).
It is written into a hidden temporary directory and renamed into place, so a directory named
`checkpoint-<step>` is complete when it appears; re-saving a step renames the old one aside
first and deletes it last. Bytes can still rot after the rename: `newest_valid_checkpoint`
checks the manifest and falls back to the newest checkpoint that verifies, with a warning. A
model with a non-finite parameter is never written. A save that will not fit is warned first; a
failed write (a full disk) leaves no partial directory and stops the run with one line naming
the space needed and the last good checkpoint (`rlhf_core.disk_space`). `trainer_state.pt`
holds only tensors and plain containers, read with `torch.load(..., weights_only=True)`.

The train loops call, on every process: `save_training_state` (checkpoint-<step>; a sharded
model's shards written by every process with torch.distributed.checkpoint, the rest by the main
process), `restore_checkpoint`, `save_final` (`final/`, a sharded model gathered onto the main
process first) and `save_best` (`best/`, when `rlhf_core.selection` says so).

Not here: which run directory and checkpoint a run uses (`rlhf_core.rundir`), when a model is
best (`rlhf_core.selection`), the stop after SIGINT/SIGTERM (`rlhf_core.stop_signal`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from pydantic import Field

from rlhf_core.config import StrictModel
from rlhf_core.disk_space import CheckpointWriteError, guarded_write  # noqa: F401 (its home)
from rlhf_core.distributed import is_sharded, local_tensor
from rlhf_core.errors import UserError
from rlhf_core.fault_points import fault_point
from rlhf_core.runtime import capture_rng_state, restore_rng_state
from rlhf_core.selection import SelectionConfig

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.pt"
#: a sharded (FSDP2) checkpoint's torch.distributed.checkpoint directory (model + optimizer)
SHARDED_DIR = "sharded"
MANIFEST_FILE = "manifest.json"


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
    """Write checkpoint-<step> atomically (the main process), then delete all but the newest
    `keep_last`. `extra_models` (e.g. {"value": value_model}) go into subdirectories, inside the
    same rename. `state` is the loop's own state (data position, counters): only tensors,
    numbers, strings, lists and dicts. A sharded checkpoint passes `model=None, optimizer=None`,
    the directory every process wrote its shards into as `staged={SHARDED_DIR: dir}` (moved in,
    covered by the manifest) and every process's RNG states as `rng_per_rank`."""
    checkpoints_dir = Path(checkpoints_dir)
    if model is not None:  # (a sharded model is checked by every process: save_training_state)
        assert_finite_parameters(model, where=f"checkpoint-{step}")
    for name, extra in (extra_models or {}).items():
        assert_finite_parameters(extra, where=f"checkpoint-{step}/{name}")
    final = checkpoints_dir / f"checkpoint-{step}"
    # a failed write: tmp removed, the previous checkpoints kept, a full disk one line (exit 1)
    with guarded_write(final.name, checkpoints_dir, previous=latest_checkpoint(checkpoints_dir),
                       last_good=lambda: newest_valid_checkpoint(checkpoints_dir, quiet=True),
                       ) as partial:  # fmt: skip
        checkpoints_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-checkpoint-{step}-", dir=checkpoints_dir))
        partial.append(tmp)
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
        fault_point("checkpoint.staged")
        write_manifest(tmp, step)
        replace_dir(tmp, final)
    for old in list_checkpoints(checkpoints_dir)[:-keep_last]:
        aside = old.with_name(f".deleting-{old.name}")  # never a half-deleted checkpoint-<n>
        os.replace(old, aside)
        fault_point("checkpoint.prune")
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
    (A sharded checkpoint's optimizer is in its SHARDED_DIR; `restore_checkpoint` loads it.)"""
    if payload["optimizer"] is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None and payload.get("scheduler") is not None:
        scheduler.load_state_dict(payload["scheduler"])
    restore_rng_state(payload["rng"])
    return payload["state"]


# ----------------------------------------------------------------------------- a run's state


def save_training_state(
    accelerator: Accelerator,
    run_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    keep_last: int,
    extra_models: dict[str, torch.nn.Module] | None = None,
    extra_optimizers: dict[str, torch.optim.Optimizer] | None = None,
) -> None:
    """All processes sync; the main process writes checkpoint-<step> atomically. A sharded
    (FSDP2) model: every process writes its shards of the models and optimizers
    (`extra_optimizers` pairs with `extra_models` by key) into a staging directory, to which the
    main process adds the trainer state, with every process's RNGs, and renames it into place.
    Unsharded, an extra optimizer's state is saved in the loop state as `<key>_optimizer`."""
    if is_sharded(model):
        staging = run_dir / "checkpoints" / f".sharded-{step}"
        if accelerator.is_main_process:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        staging = Path(broadcast_object_list([str(staging)], from_process=0)[0])
        assert_finite_shards(accelerator, [model, *(extra_models or {}).values()], step)
        models = {"policy": (model, optimizer)}
        for key, extra in (extra_models or {}).items():
            models[key] = (extra, (extra_optimizers or {}).get(key))
        save_sharded(staging, models)
        rngs = gather_object([capture_rng_state()])
        if accelerator.is_main_process:
            save_checkpoint(
                run_dir / "checkpoints", step, model=None, tokenizer=tokenizer, optimizer=None,
                scheduler=scheduler, state=state, keep_last=keep_last,
                staged={SHARDED_DIR: staging}, rng_per_rank=rngs,
            )  # fmt: skip
        accelerator.wait_for_everyone()
        return
    for key, extra_opt in (extra_optimizers or {}).items():
        state = {**state, f"{key}_optimizer": extra_opt.state_dict()}
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_checkpoint(
            run_dir / "checkpoints", step, model=accelerator.unwrap_model(model),
            tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, state=state,
            keep_last=keep_last,
            extra_models={k: accelerator.unwrap_model(m) for k, m in (extra_models or {}).items()},
        )  # fmt: skip


def restore_checkpoint(
    ckpt: Path,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampler: Any,
    model: torch.nn.Module | None = None,
    extra: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Load optimizer, scheduler, RNGs and the data position (`sampler`, an `EpochSampler`);
    return (step, the loop's state). `extra` maps a name to (model, optimizer or None), as
    `save_training_state`'s `extra_models` / `extra_optimizers`: their optimizers are restored
    too. A sharded checkpoint also restores the (sharded) `model` and `extra` models from its
    shards, and each process's own RNGs."""
    payload = load_trainer_state(ckpt)
    if is_sharded_checkpoint(ckpt):
        if model is None or not is_sharded(model):
            raise UserError(
                f"{ckpt} is a sharded (FSDP2) checkpoint: resume it with train.engine fsdp2"
            )
        models = {"policy": (model, optimizer), **(extra or {})}
        load_sharded(ckpt / SHARDED_DIR, models)
    state = restore_training_state(payload, optimizer=optimizer, scheduler=scheduler)
    for key, (_, extra_opt) in (extra or {}).items():
        if extra_opt is not None and f"{key}_optimizer" in state:  # unsharded: in the state
            extra_opt.load_state_dict(state[f"{key}_optimizer"])
    if "rng_per_rank" in payload:
        restore_rng_state(payload["rng_per_rank"][torch.distributed.get_rank()])
    sampler.load_state_dict(state["sampler"])
    print(f"resumed from {ckpt} at step {payload['step']}", file=sys.stderr)
    return payload["step"], state


def assert_finite_shards(
    accelerator: Accelerator, models: list[torch.nn.Module], where: str | int
) -> None:
    """`assert_finite_parameters` for sharded models: every process checks its own shards and
    all of them learn whether any was not finite (every process must call it)."""
    bad = [
        name for m in models for name, p in m.named_parameters()
        if not bool(torch.isfinite(local_tensor(p.detach())).all())
    ]  # fmt: skip
    flag = accelerator.reduce(torch.tensor(float(bool(bad)), device=accelerator.device), "sum")
    if float(flag) > 0:
        named = f"parameter {bad[0]} holds" if bad else "a parameter shard on another process holds"
        raise NonFiniteModelError(
            f"{where}: {named} NaN/inf values; refusing to save a broken model"
        )


# ----------------------------------------------------------------------------- sharded state

Models = dict[str, tuple[torch.nn.Module, "torch.optim.Optimizer | None"]]  # name -> both


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A sharded model's whole state dict, gathered onto rank 0 in CPU memory (empty on the
    other ranks); every process must call it. Keys are the model's own (no wrapper prefix)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    # a tied parameter (an LM head sharing the input embedding) once, under its first name, as
    # save_pretrained writes it from an unsharded model
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            state.pop(name, None)
        seen.add(id(param))
    return state


def _sharded_state(models: Models) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state: dict[str, Any] = {}
    for key, (model, opt) in models.items():
        msd, osd = get_state_dict(model, [opt] if opt is not None else [])
        state[f"{key}.model"] = msd
        if opt is not None:
            state[f"{key}.optimizer"] = osd
    return state


def save_sharded(directory: Path, models: Models) -> None:
    """Every process writes its shards of `models` to `directory` (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(models), checkpoint_id=str(directory))


def load_sharded(directory: Path, models: Models) -> None:
    """Read what `save_sharded` wrote into the (already sharded) models and optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _sharded_state(models)
    dcp.load(state, checkpoint_id=str(directory))
    for key, (model, opt) in models.items():
        set_state_dict(
            model, [opt] if opt is not None else [], model_state_dict=state[f"{key}.model"],
            optim_state_dict=state.get(f"{key}.optimizer", {}),
        )  # fmt: skip


# ----------------------------------------------------------------------------- final/ and best/


def save_final(
    accelerator: Accelerator, model: torch.nn.Module, tokenizer: Any, path: Path
) -> None:
    """The trained model as a plain Hugging Face directory (written by the main process; a
    sharded model's full state dict is gathered onto it first, every process taking part)."""
    accelerator.wait_for_everyone()
    sharded, state = is_sharded(model), None
    if sharded:
        assert_finite_shards(accelerator, [model], str(path))
        state = full_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = model if sharded else accelerator.unwrap_model(model)
        if not sharded:
            assert_finite_parameters(unwrapped, where=str(path))
        tmp, checkpoints = path.with_name(f".tmp-{path.name}"), path.parent / "checkpoints"
        shutil.rmtree(tmp, ignore_errors=True)
        with guarded_write(path.name, path.parent, previous=None, last_good=lambda: (
                newest_valid_checkpoint(checkpoints, quiet=True))) as partial:  # fmt: skip
            partial.append(tmp)
            unwrapped.save_pretrained(tmp, state_dict=state)
            tokenizer.save_pretrained(tmp)
        replace_dir(tmp, path)
    if sharded:
        accelerator.wait_for_everyone()


def save_best(
    accelerator: Accelerator,
    model: torch.nn.Module | None,
    tokenizer: Any,
    run_dir: Path,
    record: dict[str, Any],
) -> None:
    """After an improvement (`rlhf_core.selection.ModelSelector.improved`): `<run_dir>/best/` as
    `save_final` writes `final/` (skipped when `model` is None: `checkpoint.best.save_best`
    false), and `<run_dir>/best.json`, the selector's `record()`. Every process calls it."""
    if model is not None:
        save_final(accelerator, model, tokenizer, run_dir / "best")
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "best.json").write_text(json.dumps(record) + "\n")
