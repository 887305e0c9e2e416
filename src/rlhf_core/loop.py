"""Steps every training loop shares, as plain functions (there is no Trainer class).

A package's `train.py` reads top to bottom and calls these for the parts that are the same
everywhere: process set-up (`start_accelerator`), how many steps (`plan_steps`), the optimizer
and its schedule (`start_optimizer`), the dry-run report, one step's micro-batches and their
accumulated gradients (`micro_batches`, `accumulate_gradients`), the clipped optimizer step that
skips non-finite losses, and the message after a stop signal. Saving and restoring are
`rlhf_core.checkpoint`'s; `rlhf_core.bookkeeping` calls them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from pydantic import BaseModel, Field
from torch.optim.lr_scheduler import LambdaLR

from rlhf_core.config import RunArgs, dump_config
from rlhf_core.distributed import Engine, EngineSettings
from rlhf_core.errors import UserError
from rlhf_core.fastpath import SpeedConfig, start_speed
from rlhf_core.models import resolve_model_path
from rlhf_core.optim import EmbeddingGradBuffer, OptimConfig, build_optimizer, build_scheduler
from rlhf_core.runtime import configure_threads, quiet_libraries


class BaseLoopConfig(EngineSettings):
    """Loop settings every trainer shares (its `train:` block extends this)."""

    eval_every: int = Field(0, ge=0, description="evaluate every k steps (and at the end); 0 = end")
    evaluate: bool = Field(
        True, description="false = no held-out evaluation at all, not even at the end"
    )
    eval_size: int | None = Field(None, gt=0, description="held-out rows to use; null = all")
    threads: int | None = Field(None, gt=0, description="CPU threads; null = free cores")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if available")
    speed: SpeedConfig = Field(
        default_factory=SpeedConfig,
        description="CPU fast paths, each on where it pays (rlhf_core.fastpath); false = off",
    )


class LoopConfig(BaseLoopConfig):
    """Loop settings shared by the supervised trainers (SFT, reward models, direct alignment)."""

    batch_size: int = Field(32, gt=0, description="rows per optimizer step (global)")
    micro_batch_size: int | None = Field(
        None, gt=0, description="rows per forward pass (gradient accumulation); null = batch_size"
    )
    max_steps: int | None = Field(None, gt=0, description="optimizer steps; null = from epochs")
    epochs: float = Field(1.0, gt=0, description="passes over the data when max_steps is null")


def start_engine(loop: Any) -> tuple[Accelerator, Engine, int]:
    """`start_accelerator`, then the run's `Engine` (`loop.engine`, `loop.fsdp`): how its models
    are placed across processes (rlhf_core.distributed), and the speed switches and allocator
    (`loop.speed`, rlhf_core.fastpath). Returns (accelerator, engine, threads)."""
    accelerator, threads = start_accelerator(loop)
    engine = Engine(accelerator, loop.engine, loop.fsdp)
    start_speed(loop.speed, accelerator.device.type, engine.name, loop.fsdp.cpu_mmap_threshold_mib)
    return accelerator, engine, threads


def start_accelerator(loop: BaseLoopConfig) -> tuple[Accelerator, int]:
    """Quiet the libraries, set CPU threads, and create the accelerate `Accelerator` (`loop`:
    the config's `train:` block)."""
    quiet_libraries()
    threads = configure_threads(loop.threads)
    use_cpu = loop.device == "cpu" or not torch.cuda.is_available()
    accelerator = Accelerator(cpu=use_cpu)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    refuse_sharded_parameters(accelerator.distributed_type, getattr(plugin, "zero_stage", None))
    return accelerator, threads


def refuse_sharded_parameters(engine: DistributedType, zero_stage: int | None) -> None:
    """A clear error, instead of a hang, for DeepSpeed ZeRO-3 (accelerate's `distributed_type`
    and DeepSpeed's ZeRO stage).

    ZeRO-3 shards the parameters inside DeepSpeed's engine, which these trainers do not drive
    (generation, evaluation and checkpoints would need its own gather and save calls). Sharded
    training is FSDP2 (`train.engine: fsdp2`, rlhf_core.distributed); DDP and ZeRO-2 keep full
    parameters on every process."""
    if engine == DistributedType.DEEPSPEED and zero_stage == 3:
        raise UserError(
            "DeepSpeed ZeRO-3 shards the parameters inside DeepSpeed's engine, which these "
            "trainers do not support: for sharded training use FSDP2 (train.engine: fsdp2 under "
            "torchrun, or configs/accelerate/fsdp2.yaml), or DeepSpeed ZeRO-2 "
            "(configs/accelerate/deepspeed_zero2.yaml)"
        )


def shared_run_dir(accelerator: Accelerator, run_dir: Path) -> Path:
    """The main process's run dir on every process (a timestamped default could otherwise
    differ by a second between processes)."""
    if accelerator.num_processes == 1:
        return run_dir
    from accelerate.utils import broadcast_object_list

    return Path(broadcast_object_list([str(run_dir)], from_process=0)[0])


def check_engine_accumulation(accelerator: Accelerator, micro_batches_per_step: int) -> None:
    """Our loops accumulate micro-batches themselves (DDP's `no_sync` between them). DeepSpeed's
    engine instead steps inside every `accelerator.backward`, so under DeepSpeed one optimizer
    step must be one micro-batch per process; refuse a config that would silently step more."""
    engine = str(getattr(accelerator, "distributed_type", ""))
    if "DEEPSPEED" in engine.upper() and micro_batches_per_step > 1:
        raise UserError(
            f"DeepSpeed steps the optimizer at every backward, but this config accumulates "
            f"{micro_batches_per_step} micro-batches per step and process: set "
            "train.micro_batch_size to the per-process batch (batch_size / processes) and use "
            "gradient checkpointing for memory, or launch with DDP/FSDP"
        )


def plan_steps(loop: LoopConfig, num_rows: int, accelerator: Accelerator) -> tuple[int, int]:
    """(micro_batch_size, total optimizer steps); checks the batch splits evenly over the
    micro-batches and processes, and that the engine lets the loop accumulate them."""
    micro, world = loop.micro_batch_size or loop.batch_size, accelerator.num_processes
    if loop.batch_size % (micro * world):
        raise UserError(
            f"train.batch_size ({loop.batch_size}) must be a multiple of micro_batch_size "
            f"({micro}) x processes ({world})"
        )
    check_engine_accumulation(accelerator, loop.batch_size // (micro * world))
    steps_per_epoch = math.ceil(num_rows / loop.batch_size)
    return micro, loop.max_steps or math.ceil(loop.epochs * steps_per_epoch)


def start_optimizer(
    engine: Engine, model: torch.nn.Module, optim: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over `model`'s trainable parameters, prepared for the engine (after the model was),
    and its learning-rate schedule over `total_steps` (rlhf_core.optim)."""
    optimizer = engine.prepare_optimizer(build_optimizer(model, optim, sharded=engine.sharded))
    return optimizer, build_scheduler(optimizer, optim, total_steps)


Batch = dict[str, torch.Tensor]  # one collated micro-batch: name -> tensor


def micro_batches(
    rows: list[int],
    size: int,
    collate: Callable[[list[int]], Batch],
    *,
    tokens: Callable[[int], int] | None = None,
    budget: int = 0,
) -> list[tuple[list[int], Batch]]:
    """This process's `rows` of one optimizer step in micro-batches of `size` rows: (the rows,
    `collate(rows)`) each, collated up front (on the CPU) so a loss can be normalised over all.

    With a token `budget` (and `tokens(row)`, a row's tokens as collated) consecutive rows are
    merged instead into micro-batches of up to `budget` tokens (at least one row each): fewer,
    larger forwards for packed rows (`SpeedPlan.fill_micro_batches`)."""
    if not budget:
        spans = [rows[s : s + size] for s in range(0, len(rows), size)]
    else:
        assert tokens is not None, "a token budget needs tokens(row)"
        spans, used = [], 0
        for row in rows:
            cost = tokens(row)
            if not spans or used + cost > budget:
                spans.append([])
                used = 0
            spans[-1].append(row)
            used += cost
    return [(span, collate(span)) for span in spans]


def accumulate_gradients(
    engine: Engine,
    model: torch.nn.Module | tuple[torch.nn.Module | None, ...],
    batches: list[tuple[list[int], Batch]],
    loss_of: Callable[[Batch, list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    *,
    step_rows: int | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The forward and backward passes of one optimizer step, its micro-batches in turn.

    Each batch moves to the device (a dict of tensors, or an object with `.to(device)` such as
    policy_gradients' `Experience`) and `loss_of(batch, rows)` returns its (loss, metrics); the
    gradients of `model` (or of each of several models trained by one loss, e.g. PPO's policy and
    value model; None skipped) are reduced across processes after the last micro-batch only
    (`engine.grad_sync`).
    With `step_rows` (the step's rows over all processes) a micro-batch's loss is a mean over its
    rows and counts with weight len(rows) / step_rows, so the weighted sum over micro-batches and
    processes is the mean over the step's rows, the one-big-batch loss; with None every loss is
    already normalised over the whole step (weight 1, e.g. SFT's loss over the step's tokens).
    DDP/FSDP average gradients over processes, so each backward is scaled by the process count to
    make them sum. Returns the step's loss, summed over processes, and this process's weighted
    metrics (reduce them over processes when logging)."""
    accelerator = engine.accelerator
    world, device = accelerator.num_processes, accelerator.device
    models = (model,) if isinstance(model, torch.nn.Module) else model
    step_loss = torch.zeros((), device=device)
    metrics: dict[str, torch.Tensor] = {}
    for i, (rows, batch) in enumerate(batches):
        weight = 1.0 if step_rows is None else len(rows) / step_rows
        if isinstance(batch, dict):
            batch = {k: v.to(device) for k, v in batch.items()}
        else:
            batch = batch.to(device)
        with ExitStack() as synced:
            for each in models:
                synced.enter_context(engine.grad_sync(each, sync=i == len(batches) - 1))
            loss, batch_metrics = loss_of(batch, rows)
            accelerator.backward(loss * weight * world)
        step_loss += loss.detach() * weight
        for key, value in batch_metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value * weight
    return accelerator.reduce(step_loss, reduction="sum"), metrics


def print_dry_run(
    cfg: BaseModel,
    tokenizer: Any,
    facts: dict[str, Any],
    *,
    engine: Engine,
    run_dir: Path,
    ckpt: Path | None,
) -> None:
    """What --dry-run prints: the resolved config, then what would run: the model (`cfg.model`)
    and tokenizer, the trainer's `facts`, where it would run (engine, device, processes), the
    run dir."""
    name = cfg.model.name_or_path  # type: ignore[attr-defined]
    accelerator = engine.accelerator
    facts = {
        "model": f"{name} -> {resolve_model_path(name)}",
        "tokenizer": f"{type(tokenizer).__name__}, vocab {len(tokenizer)}",
        **facts,
        "engine": f"{engine.name} on {accelerator.device}, {accelerator.num_processes} procs",
        "run dir": f"{run_dir}" + (f" (resuming {ckpt})" if ckpt else ""),
    }
    print(dump_config(cfg))
    width = max(len(k) for k in facts) + 1
    for key, value in facts.items():
        print(f"{key + ':':{width}} {value}")


def clip_grad_norm(
    accelerator: Accelerator, model: torch.nn.Module, max_norm: float | None
) -> float:
    """Clip the gradients to global L2 norm `max_norm` (None: measure only); returns the norm
    before clipping. A non-finite norm clips nothing: the caller skips that step.

    `torch.nn.utils.clip_grad_norm_` multiplies every gradient by min(1, max_norm / (norm +
    1e-6)) even when that factor is 1: a full pass over the gradients for nothing in the usual
    unclipped step. For plain and DDP training (gradients already reduced, no fp16 loss scaler)
    this computes the norm, then multiplies only when the factor is below 1, the same factor as
    torch's, so the result is identical. FSDP, DeepSpeed and loss scaling go through accelerate.
    """
    plain = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
    if accelerator.distributed_type not in plain or accelerator.scaler is not None:
        limit = float("inf") if max_norm is None else max_norm
        return float(accelerator.clip_grad_norm_(model.parameters(), limit))
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if max_norm is not None and bool(torch.isfinite(norm)) and max_norm / (norm + 1e-6) < 1.0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


class TrainingDiverged(UserError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


class SkippedSteps:
    """Counts optimizer steps skipped because the loss or the global gradient norm was NaN/inf.

    A skipped step leaves parameters, optimizer state and schedule exactly as they were. After
    `limit` skipped steps in a row the run stops with `TrainingDiverged` (exit code 2, no
    `final/`): a run that learns nothing must not end green. `total` is saved in checkpoints."""

    def __init__(self, limit: int, total: int = 0) -> None:
        self.limit = limit
        self.total = total
        self.in_a_row = 0

    def add(self, skipped: bool, *, loss: float, grad_norm: float) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise TrainingDiverged(
                f"{self.in_a_row} optimizer steps in a row were skipped because the loss or the "
                f"gradient norm was not finite (last: loss {loss:.4g}, grad norm {grad_norm:.4g}); "
                "the model is unchanged since the last good step and no final model was written. "
                "Lower optim.lr, check the loss settings (e.g. beta) and the data, or raise "
                "optim.max_consecutive_skips"
            )


def optimizer_step(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    max_grad_norm: float | None,
    loss: torch.Tensor,
    grad_buffer: EmbeddingGradBuffer | None = None,
    skips: SkippedSteps | None = None,
) -> tuple[float, bool]:
    """Clip and step if `loss` and the global gradient norm are finite; otherwise drop the
    gradients and leave parameters, optimizer state and schedule untouched. Returns (grad_norm,
    skipped); `skips` counts skipped steps (and stops a run that keeps skipping). A `grad_buffer`
    (`rlhf_core.optim.EmbeddingGradBuffer`) is re-zeroed and re-attached."""
    loss_value = float(loss)
    grad_norm = float("nan")
    skipped = not math.isfinite(loss_value)
    if not skipped:
        # the norm is needed to detect inf/NaN gradients even when nothing is clipped
        grad_norm = clip_grad_norm(accelerator, model, max_grad_norm)
        skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if grad_buffer is not None:
        grad_buffer.reset()
    if not skipped:
        scheduler.step()
    if skips is not None:
        skips.add(skipped, loss=loss_value, grad_norm=grad_norm)
    return grad_norm, skipped


def announce_stop(package: str, run: RunArgs, run_dir: Path, signum: int | None, step: int) -> None:
    """After a stop signal: the command that continues this run, verbatim (the run dir holds
    its resolved config, every --set included)."""
    print(
        f"stopped by signal {signum} at step {step}; checkpoint saved. Resume with:\n"
        f"  python -m {package}.train --resume {run_dir}",
        file=sys.stderr,
    )
