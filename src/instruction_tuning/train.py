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

import sys
from functools import partial

import torch

from instruction_tuning.config import SFTConfig
from instruction_tuning.data import build_sft_data, collate, pack
from instruction_tuning.evaluate import evaluate
from instruction_tuning.losses import LOSSES
from rlhf_core.bookkeeping import start_bookkeeping
from rlhf_core.config import RunArgs, parse_run_args
from rlhf_core.errors import run_main
from rlhf_core.fastpath import speed_plan
from rlhf_core.loop import (
    accumulate_gradients,
    optimizer_step,
    plan_steps,
    print_dry_run,
    start_engine,
    start_optimizer,
)
from rlhf_core.models import load_policy, load_tokenizer
from rlhf_core.registry import build_from_spec
from rlhf_core.rundir import managed_run, open_run_dir
from rlhf_core.runtime import seed_everything
from rlhf_core.sequences import sequence_logprobs
from rlhf_core.stop_signal import StopSignal

PACKAGE = "instruction_tuning"


@managed_run
def train(cfg: SFTConfig, run: RunArgs) -> int:
    """Run SFT as configured; returns the process exit code (0, or 130/143 after a signal)."""
    accelerator, engine, threads = start_engine(cfg.train)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes

    # --- tokenizer and data
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    d, t = cfg.data, cfg.train
    train_data = build_sft_data(
        d.train, tokenizer, fmt=d.format, max_length=d.max_length,
        max_prompt_length=d.max_prompt_length, where="data.train", overlong=d.overlong,
        columns=d.columns,
    )  # fmt: skip
    eval_data = None
    if d.eval is not None and t.evaluate:
        eval_data = build_sft_data(
            d.eval, tokenizer, fmt=d.format, max_length=d.max_length,
            max_prompt_length=d.max_prompt_length, where="data.eval", limit=t.eval_size,
            exclude_prompts={e.prompt_text for e in train_data.examples}, overlong=d.overlong,
            columns=d.columns,
        )  # fmt: skip
    micro, total_steps = plan_steps(t, len(train_data.examples), accelerator)
    run_dir, ckpt = open_run_dir(accelerator, run, package=PACKAGE, name=cfg.name,
                                 total_steps=total_steps)  # fmt: skip

    if run.dry_run:
        print_dry_run(cfg, tokenizer, {
            "train rows": f"{len(train_data.examples)} ({d.train.describe()})",
            "eval rows": len(eval_data.examples) if eval_data else 0,
            "would run": f"{total_steps} steps x {t.batch_size} rows",
        }, engine=engine, run_dir=run_dir, ckpt=ckpt)  # fmt: skip
        return 0

    # --- model, optimizer, schedule
    seed_everything(cfg.seed)
    model = load_policy(cfg.model, device, weights_from=ckpt)
    model.train()
    model = engine.prepare(model)  # sharded (fsdp2) or DDP-wrapped; the optimizer comes after
    optimizer, scheduler = start_optimizer(engine, model, cfg.optim, total_steps)
    # data position, skipped steps, best model, tracker: fresh, or resumed from ckpt
    book = start_bookkeeping(
        cfg, run, package=PACKAGE, accelerator=accelerator, threads=threads, run_dir=run_dir,
        ckpt=ckpt, num_rows=len(train_data.examples), total_steps=total_steps,
        has_eval=eval_data is not None,
        model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
    )  # fmt: skip
    step, skips = book.start_step, book.skips
    loss_fn = build_from_spec(LOSSES, cfg.loss)
    engine_facts = engine.announce([model], [optimizer])

    def run_eval() -> dict[str, float]:
        if eval_data is None:
            return {}
        with engine.gathered(model) as whole:  # every process evaluates its share
            return evaluate(
                whole, tokenizer, eval_data, batch_size=max(micro, 64), seed=cfg.seed + step,
                max_new_tokens=t.eval_max_new_tokens, sampled=t.eval_sampled, shard=(rank, world),
                packing=t.packing,
            )  # fmt: skip

    # --- the loop
    pad_id = tokenizer.pad_token_id
    # examples packed several to a row where the attention takes a 4D mask (on CPU SDPA, rows
    # with no padding and attention computed example by example), in one row by position ids
    # under flash attention (varlen), else padded rows
    plan = speed_plan(model)
    batcher = {
        "segmented": partial(pack, row_tokens=plan.row_tokens), "mask": pack,
        "flat": partial(pack, flat=True), "padded": collate,
    }[plan.layout if t.packing else "padded"]  # fmt: skip
    step_loss = torch.zeros(())

    def nll(batch: dict[str, torch.Tensor], _rows: list[int]) -> tuple[torch.Tensor, dict]:
        return loss_fn(sequence_logprobs(model, batch), batch["loss_mask"], num_tokens)

    with StopSignal() as stop:
        while step < total_steps:
            batches = book.next_micro_batches(
                micro, lambda rows: batcher([train_data.examples[i] for i in rows], pad_id)
            )
            # the loss is normalised by the step's completion tokens over all processes
            local_tokens = sum(b["loss_mask"].sum() for _, b in batches).to(device)
            num_tokens = accelerator.reduce(local_tokens, reduction="sum").clamp(min=1)
            step_loss, _ = accumulate_gradients(engine, model, batches, nll, step_rows=None)
            grad_norm, _ = optimizer_step(
                accelerator, model, optimizer, scheduler,
                max_grad_norm=cfg.optim.max_grad_norm, loss=step_loss, skips=skips,
            )  # fmt: skip
            step += 1

            book.log_step(step, step_loss, grad_norm, {"tokens": num_tokens.item()})
            if book.evaluate(step, run_eval):  # every train.eval_every steps
                break  # early stop: the final evaluation and final/ follow
            if (exit_code := book.checkpoint(step, stop)) is not None:
                return exit_code  # stopped by a signal, checkpoint saved

    # --- final evaluation, final/ and summary
    book.finish(step, run_eval(), {
        "train_rows": len(train_data.examples),
        "truncated_completions": train_data.truncated_completions,
        "dropped_overlong": train_data.dropped_overlong,
        "final_train_loss": book.final_train_facts().get("final_train_loss"),
    }, engine_facts)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg, run = parse_run_args(
        argv, SFTConfig, prog=f"python -m {PACKAGE}.train", description="Supervised fine-tuning"
    )
    return train(cfg, run)


if __name__ == "__main__":
    sys.exit(run_main(main))
