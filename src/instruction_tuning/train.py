"""Supervised fine-tuning (SFT) with a completion-only loss.

    uv run python -m instruction_tuning.train --config configs/instruction_tuning/tiny_sft.yaml

Read top to bottom: config -> tokenizer and data -> model, optimizer, schedule (accelerate for
devices and processes) -> the loop (accumulate micro-batches, clip, step, log, evaluate,
checkpoint, stop on SIGINT/SIGTERM) -> final eval and summary.

Each optimizer step takes `batch_size` rows from a seeded per-epoch permutation (split across
processes), in micro-batches of `micro_batch_size`, and normalises the summed token NLL by the
step's total completion tokens across all micro-batches and processes, so the update equals the
one-big-batch update. Resuming restores model, optimizer, schedule, RNGs and data position, so a
resumed run reproduces the uninterrupted one exactly on CPU.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext

import torch
from accelerate import Accelerator

from instruction_tuning.config import SFTConfig
from instruction_tuning.data import build_sft_data, collate
from instruction_tuning.evaluate import evaluate
from instruction_tuning.losses import LOSSES
from rlhf_core.checkpoint import (
    StopSignal,
    load_trainer_state,
    restore_training_state,
    save_checkpoint,
)
from rlhf_core.config import RunArgs, dump_config, parse_run_args
from rlhf_core.data import EpochSampler
from rlhf_core.logprobs import causal_lm_token_logprobs
from rlhf_core.models import load_causal_lm, load_tokenizer, resolve_model_path
from rlhf_core.optim import build_optimizer, build_scheduler
from rlhf_core.runtime import configure_threads, quiet_libraries, seed_everything
from rlhf_core.tracking import Tracker, new_run_dir, resolve_resume

PACKAGE = "instruction_tuning"


def train(cfg: SFTConfig, run: RunArgs) -> int:
    """Run SFT as configured; returns the process exit code (0, or 130/143 after a signal)."""
    quiet_libraries()
    threads = configure_threads(cfg.train.threads)
    use_cpu = cfg.train.device == "cpu" or not torch.cuda.is_available()
    accelerator = Accelerator(cpu=use_cpu)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    is_main = accelerator.is_main_process

    # --- tokenizer and data
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    d = cfg.data
    train_data = build_sft_data(
        d.train, tokenizer, fmt=d.format, max_length=d.max_length,
        max_prompt_length=d.max_prompt_length, where="data.train",
    )  # fmt: skip
    eval_data = None
    if d.eval is not None:
        eval_data = build_sft_data(
            d.eval, tokenizer, fmt=d.format, max_length=d.max_length,
            max_prompt_length=d.max_prompt_length, where="data.eval", limit=cfg.train.eval_size,
            exclude_prompts={e.prompt_text for e in train_data.examples},
        )  # fmt: skip
    t = cfg.train
    micro = t.micro_batch_size or t.batch_size
    if t.batch_size % (micro * world):
        raise ValueError(
            f"train.batch_size ({t.batch_size}) must be a multiple of micro_batch_size ({micro}) "
            f"x processes ({world})"
        )
    steps_per_epoch = math.ceil(len(train_data.examples) / t.batch_size)
    total_steps = t.max_steps or math.ceil(t.epochs * steps_per_epoch)

    run_dir, ckpt = resolve_resume(
        run.resume, package=PACKAGE, name=cfg.name, output_dir=run.output_dir
    )
    run_dir = run_dir or new_run_dir(PACKAGE, cfg.name, run.output_dir)

    if run.dry_run:
        print(dump_config(cfg))
        print(
            f"model:      {cfg.model.name_or_path} -> {resolve_model_path(cfg.model.name_or_path)}"
        )
        print(f"tokenizer:  {type(tokenizer).__name__}, vocab {len(tokenizer)}")
        print(f"train rows: {len(train_data.examples)} ({d.train.describe()})")
        print(f"eval rows:  {len(eval_data.examples) if eval_data else 0}")
        print(f"would run:  {total_steps} steps x {t.batch_size} rows on {device} ({world} procs)")
        print(f"run dir:    {run_dir}" + (f" (resuming {ckpt})" if ckpt else ""))
        return 0

    # --- model, optimizer, schedule
    seed_everything(cfg.seed)
    model = load_causal_lm(cfg.model, device, weights_from=ckpt)
    model.train()
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    sampler = EpochSampler(len(train_data.examples), cfg.seed)
    step, skipped = 0, 0
    if ckpt is not None:
        payload = load_trainer_state(ckpt)
        state = restore_training_state(payload, optimizer=optimizer, scheduler=scheduler)
        sampler.load_state_dict(state["sampler"])
        step, skipped = payload["step"], state["skipped_steps"]
        if is_main:
            print(f"resumed from {ckpt} at step {step}", file=sys.stderr)
    tracker = Tracker(
        run_dir, cfg, cfg.tracking, total_steps=total_steps, resume_step=step if ckpt else None,
        enabled=is_main,
    )  # fmt: skip
    loss_fn = LOSSES.get(t.loss)()

    def run_eval() -> dict[str, float]:
        if eval_data is None or not is_main:
            return {}
        return evaluate(
            accelerator.unwrap_model(model), tokenizer, eval_data, batch_size=max(micro, 64),
            max_new_tokens=t.eval_max_new_tokens, sampled=t.eval_sampled, seed=cfg.seed + step,
        )  # fmt: skip

    def save() -> None:
        accelerator.wait_for_everyone()
        if is_main:
            save_checkpoint(
                run_dir / "checkpoints", step, model=accelerator.unwrap_model(model),
                tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                state={"sampler": sampler.state_dict(), "skipped_steps": skipped},
                keep_last=cfg.checkpoint.keep_last,
            )  # fmt: skip

    # --- the loop
    pad_id = tokenizer.pad_token_id
    with StopSignal() as stop:
        while step < total_steps:
            indices = sampler.next_batch(t.batch_size)[rank::world]
            batches = [
                collate([train_data.examples[i] for i in indices[s : s + micro]], pad_id)
                for s in range(0, len(indices), micro)
            ]  # fmt: skip
            local_tokens = sum(b["loss_mask"].sum() for b in batches).to(device)
            num_tokens = accelerator.reduce(local_tokens, reduction="sum").clamp(min=1)
            step_loss = torch.zeros((), device=device)
            for i, batch in enumerate(batches):
                batch = {k: v.to(device) for k, v in batch.items()}
                sync = i == len(batches) - 1
                with nullcontext() if sync else accelerator.no_sync(model):
                    logps = causal_lm_token_logprobs(
                        model, batch["input_ids"], batch["attention_mask"]
                    )
                    loss, _ = loss_fn(logps, batch["loss_mask"], num_tokens)
                    # DDP averages gradients over processes; scale so they sum (loss is /global N)
                    accelerator.backward(loss * world)
                step_loss += loss.detach()
            step_loss = accelerator.reduce(step_loss, reduction="sum")
            if not torch.isfinite(step_loss):
                skipped += 1  # counted and reported, never applied
                optimizer.zero_grad(set_to_none=True)
            else:
                grad_norm = (
                    accelerator.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
                    if cfg.optim.max_grad_norm is not None
                    else torch.tensor(float("nan"))
                )
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1

            if step % cfg.tracking.log_every == 0 or step == total_steps:
                tracker.log(step, {
                    "train/loss": step_loss.item(), "train/grad_norm": float(grad_norm),
                    "train/lr": scheduler.get_last_lr()[0], "train/epoch": sampler.epoch_float,
                    "train/tokens": num_tokens.item(), "train/skipped_steps": skipped,
                })  # fmt: skip
            if t.eval_every and step % t.eval_every == 0 and step < total_steps:
                tracker.log(step, run_eval())
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
                save()
            if stop.requested:
                save()
                if is_main:
                    print(
                        f"stopped by signal {stop.signum} at step {step}; checkpoint saved. Resume "
                        f"with: python -m {PACKAGE}.train --config {run.config_path} "
                        f"--output-dir {run_dir} --resume auto",
                        file=sys.stderr,
                    )
                tracker.plot()
                return stop.exit_code

    # --- final evaluation and model
    final_eval = run_eval()
    if final_eval:
        tracker.log(step, final_eval)
    if cfg.checkpoint.save_final and is_main:
        accelerator.unwrap_model(model).save_pretrained(run_dir / "final")
        tokenizer.save_pretrained(run_dir / "final")
    summary = tracker.finish({
        "steps": step, "skipped_steps": skipped, "threads": threads, "processes": world,
        "train_rows": len(train_data.examples),
        "truncated_completions": train_data.truncated_completions,
        "final_train_loss": step_loss.item() if total_steps else None, **final_eval,
    })  # fmt: skip
    if is_main:
        print(f"run dir: {run_dir}\n" + "\n".join(f"  {k}: {v}" for k, v in summary.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg, run = parse_run_args(
        argv, SFTConfig, prog=f"python -m {PACKAGE}.train", description="Supervised fine-tuning"
    )
    return train(cfg, run)


if __name__ == "__main__":
    sys.exit(main())
