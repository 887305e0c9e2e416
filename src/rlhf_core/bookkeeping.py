"""The bookkeeping around every train loop, in one place (there is still no Trainer class).

A package's `train()` keeps its own loop, read top to bottom: batches, forward, loss, backward,
`rlhf_core.loop.optimizer_step`, what it logs. What is the same in all four trainers lives here:

  - `TrainerConfig`: the top-level settings every trainer's config shares (run name, seed,
    `optim:`, `checkpoint:`, `tracking:`);
  - `start_bookkeeping`: the data position (`EpochSampler`), the skipped-step count, best-model
    selection (`ModelSelector`) and the `Tracker`, resumed together from a checkpoint;
  - each step: `next_micro_batches` (this process's rows, in micro-batches); after it
    `log_step` (what every trainer logs, every `tracking.log_every` steps), `evaluate` (every
    `train.eval_every` steps; True = stop early), `checkpoint` (the checkpoint schedule and
    the stop after SIGINT/SIGTERM; or its parts `save_due`, `save`, `stopped`);
  - at the end: `finish` (the final evaluation logged, best/ and `final/`, `summary.json`),
    or its two halves `save_final_model` and `summarize`.

Not here: anything a trainer does differently (its models, batches, losses and metrics).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from pydantic import Field

from rlhf_core.checkpoint import (
    CheckpointConfig,
    restore_checkpoint,
    save_best,
    save_final,
    save_training_state,
)
from rlhf_core.config import RunArgs, RunConfig
from rlhf_core.data import EpochSampler
from rlhf_core.fault_points import fault_point
from rlhf_core.loop import Batch, SkippedSteps, announce_stop, micro_batches
from rlhf_core.optim import OptimConfig
from rlhf_core.selection import ModelSelector
from rlhf_core.stop_signal import StopSignal
from rlhf_core.tracking import Tracker, TrackingConfig

Facts = dict[str, Any]  # named figures: metrics, summary entries


RUN_NAME_HELP = "run name (the run dir is outputs/<package>/<name>-<time>)"


def run_name(default: str) -> Any:
    """The `name:` field of a package's config, with the package's default run name."""
    return Field(default, description=RUN_NAME_HELP)


class TrainerConfig(RunConfig):
    """The top-level fields every trainer's config has; a package's config extends it (and
    gives `name` its own default: `name: str = run_name("sft")`)."""

    name: str = Field(description=RUN_NAME_HELP)
    seed: int = Field(0, description="seed for init, data order and sampling")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer and schedule")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="saving")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="logging")


@dataclass
class Bookkeeping:
    """What a run keeps besides its models: the data position, skipped steps, best-model
    selection, the tracker, and what a checkpoint saves (`model`, `optimizer`, `scheduler`,
    `extra`: name -> (model, optimizer or None), e.g. PPO's value model)."""

    cfg: Any  # a TrainerConfig whose `train:` block extends rlhf_core.loop.BaseLoopConfig
    run: RunArgs
    package: str
    run_dir: Path
    accelerator: Accelerator
    total_steps: int
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: EpochSampler
    skips: SkippedSteps
    selector: ModelSelector
    tracker: Tracker
    threads: int = 1  # CPU threads in use (reported in the summary)
    start_step: int = 0
    restored: dict[str, Any] = field(default_factory=dict)  # the loop state a resume read
    extra: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]] = field(
        default_factory=dict
    )
    extra_schedulers: dict[str, Any] = field(default_factory=dict)  # name -> the extra's schedule

    def state_dict(self) -> dict[str, Any]:
        """The loop's state a checkpoint holds besides models, optimizers and the main schedule
        (the extra models' schedules are in it, as `<name>_scheduler`)."""
        return {
            "sampler": self.sampler.state_dict(),
            "skipped_steps": self.skips.total,
            "best": self.selector.state_dict(),
            **{f"{k}_scheduler": s.state_dict() for k, s in self.extra_schedulers.items()},
            # metrics.jsonl's lines now: a resume keeps exactly these (a final evaluation
            # logged after the last checkpoint is redone, not kept twice)
            "metrics_rows": len(self.tracker.history),
        }

    def save(self, step: int, extra_state: dict[str, Any] | None = None) -> None:
        """Write checkpoint-<step> (every process calls it; see `save_training_state`)."""
        save_training_state(
            self.accelerator, self.run_dir, step, model=self.model, tokenizer=self.tokenizer,
            optimizer=self.optimizer, scheduler=self.scheduler,
            state={**self.state_dict(), **(extra_state or {})},
            keep_last=self.cfg.checkpoint.keep_last,
            extra_models={k: m for k, (m, _) in self.extra.items()},
            extra_optimizers={k: o for k, (_, o) in self.extra.items() if o is not None},
        )  # fmt: skip

    def next_micro_batches(
        self,
        size: int,
        collate: Callable[[list[int]], Batch],
        *,
        tokens: Callable[[int], int] | None = None,
        budget: int = 0,
    ) -> list[tuple[list[int], Batch]]:
        """This process's share of the next step's `train.batch_size` rows (the seeded
        sampler's order, split across processes) in micro-batches of `size`, or with a token
        `budget` of up to that many tokens, each with `collate(rows)`
        (`rlhf_core.loop.micro_batches`)."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        rows = self.sampler.next_batch(self.cfg.train.batch_size)[rank::world]
        return micro_batches(rows, size, collate, tokens=tokens, budget=budget)

    def final_train_facts(self) -> Facts:
        """The summary's final train figures, read from the newest logged step (so also after a
        resume from the last step's checkpoint, which runs no step): `final_train_loss` and the
        trainer's own metrics as `final_train/<key>`, summed over processes as logged. Empty on
        the processes that do not log (they write no summary)."""
        rows = [r for r in self.tracker.history if "train/loss" in r]
        if not rows:
            return {}
        own = {k.removeprefix("train/"): v for k, v in rows[-1].items() if k.startswith("train/")}
        for basic in ("loss", "grad_norm", "lr", "epoch", "skipped_steps"):  # log_step's own
            own.pop(basic, None)
        own = {f"final_train/{k}": v for k, v in own.items()}
        return {"final_train_loss": rows[-1]["train/loss"], **own}

    def log_due(self, step: int) -> bool:
        """True every `tracking.log_every` steps and at the last step."""
        return step % self.cfg.tracking.log_every == 0 or step == self.total_steps

    def log_step(
        self, step: int, loss: torch.Tensor, grad_norm: float, metrics: dict[str, Any]
    ) -> None:
        """When `log_due(step)`: log what every supervised trainer logs after an optimizer step
        (loss, gradient norm, learning rate, epoch, skipped steps), then `metrics`, each as
        `train/<key>`: a tensor is this process's share, summed over processes here (every
        process calls this), a number is logged as it is."""
        if not self.log_due(step):
            return
        metrics = {
            k: self.accelerator.reduce(v, "sum").item() if isinstance(v, torch.Tensor) else v
            for k, v in metrics.items()
        }
        self.tracker.log(step, {
            "train/loss": loss.item(), "train/grad_norm": grad_norm,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/epoch": self.sampler.epoch_float, "train/skipped_steps": self.skips.total,
            **{f"train/{k}": v for k, v in metrics.items()},
        })  # fmt: skip

    def save_due(self, step: int) -> bool:
        """True every `checkpoint.save_every` steps."""
        every = self.cfg.checkpoint.save_every
        return bool(every) and step % every == 0

    def evaluate(self, step: int, run_eval: Any) -> bool:
        """Every `train.eval_every` steps but the last (the final evaluation follows): call
        `run_eval()`, log its metrics and let the selector save best/. True = stop early."""
        every = self.cfg.train.eval_every
        if not every or step % every or step >= self.total_steps:
            return False
        evaluation = run_eval()
        self.tracker.log(step, evaluation)
        return self.observe(step, evaluation)

    def observe(self, step: int, evaluation: Facts) -> bool:
        """Let the selector see an evaluation; on a new best write best/ and best.json
        (`rlhf_core.checkpoint.save_best`). True = stop early."""
        stop = self.selector.observe(step, evaluation)
        if self.selector.improved:
            model = self.model if self.selector.cfg.save_best else None
            save_best(self.accelerator, model, self.tokenizer, self.run_dir, self.selector.record())
        return stop

    def checkpoint(
        self, step: int, stop: StopSignal, extra_state: Callable[[], dict[str, Any]] | None = None
    ) -> int | None:
        """Save checkpoint-<step> when due (`checkpoint.save_every`) or after a stop signal,
        with `extra_state()` (the loop's own state, asked for only when saving); after a signal
        also `stopped`, and return its exit code (None: the loop goes on)."""
        if self.save_due(step) or stop.requested:
            self.save(step, extra_state() if extra_state is not None else None)
        return self.stopped(step, stop) if stop.requested else None

    def stopped(self, step: int, stop: StopSignal) -> int:
        """After a stop signal (the checkpoint already saved): the resume command, the curves,
        and the exit code (130 or 143)."""
        if self.accelerator.is_main_process:
            announce_stop(self.package, self.run, self.run_dir, stop.signum, step)
        self.tracker.plot()
        return stop.exit_code

    def save_final_model(self, step: int, final_eval: dict[str, float]) -> None:
        """Log the final evaluation, let the selector see it, write `final/` (when configured)."""
        if final_eval:
            self.tracker.log(step, final_eval)
        fault_point("final.evaluated")
        self.observe(step, final_eval)
        if self.cfg.checkpoint.save_final:
            save_final(self.accelerator, self.model, self.tokenizer, self.run_dir / "final")

    def summarize(self, step: int, facts: Facts, final_eval: Facts, engine_facts: Facts) -> Facts:
        """Write summary.json (the shared counts, the trainer's `facts`, the final evaluation,
        the engine's facts) and print it on the main process."""
        summary = self.tracker.finish({
            "steps": step, "skipped_steps": self.skips.total, "threads": self.threads,
            "processes": self.accelerator.num_processes, **self.selector.summary(), **facts,
            **final_eval, **engine_facts,
        })  # fmt: skip
        if self.accelerator.is_main_process:
            lines = "\n".join(f"  {k}: {v}" for k, v in summary.items())
            print(f"run dir: {self.run_dir}\n{lines}")
        return summary

    def finish(self, step: int, final_eval: Facts, facts: Facts, engine_facts: Facts) -> Facts:
        """`save_final_model`, then `summarize`."""
        self.save_final_model(step, final_eval)
        return self.summarize(step, facts, final_eval, engine_facts)


def start_bookkeeping(
    cfg: Any,
    run: RunArgs,
    *,
    package: str,
    run_dir: Path,
    ckpt: Path | None,
    accelerator: Accelerator,
    threads: int,
    num_rows: int,
    total_steps: int,
    has_eval: bool,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]] | None = None,
    extra_schedulers: dict[str, Any] | None = None,
) -> Bookkeeping:
    """A fresh `Bookkeeping` for `num_rows` training rows (seeded sampler), or, with `ckpt`,
    one resumed from it: optimizer, scheduler, RNGs, data position, skipped steps and the
    selector restored (`start_step` and `restored`, the loop state read, say where).
    `has_eval`: whether the run has held-out data; with `train.eval_every` it evaluates
    periodically, which best-model selection needs. `extra` (name -> (model, optimizer or
    None)) and `extra_schedulers` (name -> schedule) are more models trained beside `model`
    (PPO's value model), saved and restored with it."""
    sampler = EpochSampler(num_rows, cfg.seed)
    skips = SkippedSteps(cfg.optim.max_consecutive_skips)
    periodic_eval = has_eval and bool(cfg.train.eval_every)
    selector = ModelSelector(cfg.checkpoint.best, accelerator, periodic_eval=periodic_eval)
    step, restored = 0, {}
    if ckpt is not None:
        if accelerator.is_main_process:
            remove_partial_writes(run_dir)
        step, restored = restore_checkpoint(
            ckpt, optimizer=optimizer, scheduler=scheduler, sampler=sampler, model=model,
            extra=extra,
        )  # fmt: skip
        skips.total = restored["skipped_steps"]
        selector.load_state_dict(restored.get("best"))
        for key, schedule in (extra_schedulers or {}).items():
            schedule.load_state_dict(restored[f"{key}_scheduler"])
    tracker = Tracker(
        run_dir, cfg, cfg.tracking, total_steps=total_steps,
        resume_step=step if ckpt is not None else None, enabled=accelerator.is_main_process,
        keep_rows=restored.get("metrics_rows"),
    )  # fmt: skip
    return Bookkeeping(
        cfg=cfg, run=run, package=package, run_dir=run_dir, accelerator=accelerator,
        total_steps=total_steps, model=model, tokenizer=tokenizer, optimizer=optimizer,
        scheduler=scheduler, sampler=sampler, skips=skips, selector=selector, tracker=tracker,
        threads=threads, start_step=step, restored=restored, extra=dict(extra or {}),
        extra_schedulers=dict(extra_schedulers or {}),
    )  # fmt: skip


#: what a save killed part-way leaves in checkpoints/ (`rlhf_core.checkpoint`: a temporary or
#: staged checkpoint, one renamed aside to be deleted or replaced): never resumed, only space
PARTIAL_WRITES = (".tmp-checkpoint-*", ".deleting-checkpoint-*", ".old-checkpoint-*", ".sharded-*")


def remove_partial_writes(run_dir: Path) -> None:
    """On resume: delete what killed saves left (the run holds the directory's lock, so no
    save of its own is under way), each up to a checkpoint's size on disk."""
    for pattern in PARTIAL_WRITES:
        for path in sorted((run_dir / "checkpoints").glob(pattern)):
            print(f"note: removing {path}, left by a save that was killed", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)
