"""Reward-model training: preference (Bradley-Terry), outcome (ORM) and process (PRM) models.

    uv run python -m reward_models.train --config configs/reward_models/preference.yaml

Read top to bottom: config -> the loss (it fixes the model kind, the head size and the data
format) -> tokenizer and examples -> the model (backbone + linear head; LoRA or a frozen backbone
optional), optimizer, schedule -> the loop (each optimizer step takes `batch_size` examples in
micro-batches; every loss is a mean of per-example losses, so weighting each micro-batch by its
share of the step gives the one-big-batch update across accumulation and processes; clip, skip
non-finite steps, log, evaluate every k steps, checkpoint, stop on SIGINT/SIGTERM) -> final
held-out figures, `final/` (a scalar-head directory `rlhf_core.scalar_head` loads; with
`train.export_sequence_classification` also `final-seqcls/`), summary.

Resuming restores model, optimizer, schedule, RNGs and data position, so a resumed run reproduces
the uninterrupted one exactly on CPU.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from reward_models.config import RMConfig
from reward_models.data import build_reward_data
from reward_models.evaluate import COLLATE, evaluate
from reward_models.losses import LOSSES
from reward_models.models import BaseRewardModel, compute_loss
from rlhf_core.bookkeeping import start_bookkeeping
from rlhf_core.config import RunArgs, parse_run_args
from rlhf_core.errors import UserError, run_main
from rlhf_core.fastpath import speed_plan
from rlhf_core.loop import (
    accumulate_gradients,
    optimizer_step,
    plan_steps,
    print_dry_run,
    start_engine,
    start_optimizer,
)
from rlhf_core.models import load_tokenizer
from rlhf_core.optim import maybe_embedding_grad_buffer
from rlhf_core.preference import collate_pairs, pack_pairs
from rlhf_core.registry import build_from_spec
from rlhf_core.rundir import managed_run, open_run_dir
from rlhf_core.runtime import seed_everything
from rlhf_core.sequence_classification import check_sequence_classification_export
from rlhf_core.stop_signal import StopSignal

PACKAGE = "reward_models"


def shared_prompt_collate(model: BaseRewardModel, gradient_checkpointing: bool):
    """How a preference batch shares each prompt between its two completions: one packed row
    per pair with a 4D mask (SDPA/eager attention), or the KV cache (flash-attention 2 takes
    2D masks only; the cache is off under gradient checkpointing, so then no sharing: None)."""
    attention = getattr(model.backbone.config, "_attn_implementation", "sdpa")
    if attention in ("sdpa", "eager"):
        plan = speed_plan(model.backbone)
        if plan.layout == "segmented":  # CPU SDPA: no padding, attention pair by pair
            return partial(pack_pairs, row_tokens=plan.row_tokens)
        return pack_pairs
    if not gradient_checkpointing:
        return partial(collate_pairs, share_prompt=True)
    return None


@managed_run
def train(cfg: RMConfig, run: RunArgs) -> int:
    """Train one reward model; returns the exit code (0, or 130/143 after a signal)."""
    accelerator, engine, threads = start_engine(cfg.train)
    if (
        engine.sharded
        and cfg.train.export_sequence_classification
        and not cfg.checkpoint.save_final
    ):
        raise UserError(
            "train.export_sequence_classification under engine fsdp2 exports from final/: "
            "set checkpoint.save_final: true"
        )
    if engine.sharded and cfg.lm_likelihood is not None:
        raise UserError(
            "lm_likelihood reads the tied LM head (the input embeddings) outside the backbone's "
            "forward, which engine fsdp2 shards; use engine single or ddp"
        )
    device, world = accelerator.device, accelerator.num_processes
    is_main = accelerator.is_main_process

    # --- loss, tokenizer and data
    loss_fn = build_from_spec(LOSSES, cfg.loss)
    kind, collate = loss_fn.kind, COLLATE[loss_fn.kind]
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    d, t = cfg.data, cfg.train
    if t.export_sequence_classification:  # fail now, not after training
        check_sequence_classification_export(tokenizer, where=f"model {cfg.model.name_or_path}")
    classes = loss_fn.head_dim
    train_data = build_reward_data(
        d.train, tokenizer, kind=kind, data_cfg=d, num_classes=classes, where="data.train"
    )
    eval_data = None
    if d.eval is not None and t.evaluate:
        eval_data = build_reward_data(
            d.eval, tokenizer, kind=kind, data_cfg=d, num_classes=classes, where="data.eval",
            limit=t.eval_size,
        )  # fmt: skip
    micro, total_steps = plan_steps(t, len(train_data.examples), accelerator)
    run_dir, ckpt = open_run_dir(accelerator, run, package=PACKAGE, name=cfg.name,
                                 total_steps=total_steps)  # fmt: skip

    if run.dry_run:
        print_dry_run(cfg, tokenizer, {
            "loss": f"{type(loss_fn).__name__} {cfg.loss}",
            "kind": f"{kind} (head {classes}; backbone "
            f"{'frozen' if cfg.freeze_backbone else 'LoRA' if cfg.model.lora else 'trained'})",
            "train examples": f"{train_data.describe()} from {d.train.describe()}",
            "eval examples": eval_data.describe() if eval_data else 0,
            "would run": f"{total_steps} steps x {t.batch_size} examples",
        }, engine=engine, run_dir=run_dir, ckpt=ckpt)  # fmt: skip
        return 0

    # --- model, optimizer, schedule
    seed_everything(cfg.seed)
    model = BaseRewardModel.for_config(cfg, loss_fn, tokenizer, device, weights_from=ckpt)
    if kind == "preference" and t.share_prompt:
        collate = shared_prompt_collate(model, cfg.model.gradient_checkpointing) or collate
    # packed pairs: a step's micro-batches merged into forwards of up to what a padded
    # micro-batch could hold (every loss here is a mean of per-example losses; the plan says when)
    packed = getattr(collate, "func", collate) is pack_pairs
    budget = speed_plan(model.backbone).pair_token_budget(micro, d.max_length) if packed else 0
    model.train()
    grad_buffer = maybe_embedding_grad_buffer(
        model.backbone, enabled=t.sparse_embedding_grad, processes=world
    )
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
    pad_id = tokenizer.pad_token_id
    engine_facts = engine.announce([model], [optimizer])

    def run_eval() -> dict[str, float]:
        if eval_data is None:
            return {}
        with engine.gathered(model) as whole:  # every process evaluates (the same numbers)
            return evaluate(whole, loss_fn, eval_data, pad_id=pad_id, batch_size=micro)

    # --- the loop
    def example_loss(batch: dict[str, torch.Tensor], _rows: list[int]) -> tuple[torch.Tensor, dict]:
        loss, batch_metrics, _ = compute_loss(model, loss_fn, batch)
        return loss, batch_metrics

    metrics: dict[str, torch.Tensor] = {}
    step_loss = torch.zeros(())
    with StopSignal() as stop:
        while step < total_steps:
            batches = book.next_micro_batches(
                micro,
                lambda rows: collate([train_data.examples[j] for j in rows], pad_id),
                tokens=lambda j: train_data.examples[j].packed_tokens,
                budget=budget,
            )
            # each micro-batch's loss counts with its share of the step's examples
            step_loss, metrics = accumulate_gradients(
                engine, model, batches, example_loss, step_rows=t.batch_size
            )
            grad_norm, _ = optimizer_step(
                accelerator, model, optimizer, scheduler,
                max_grad_norm=cfg.optim.max_grad_norm, loss=step_loss, grad_buffer=grad_buffer,
                skips=skips,
            )  # fmt: skip
            step += 1

            book.log_step(step, step_loss, grad_norm, metrics)  # every tracking.log_every steps
            if book.evaluate(step, run_eval):  # every train.eval_every steps
                break  # early stop: the final evaluation and final/ follow
            if (exit_code := book.checkpoint(step, stop)) is not None:
                return exit_code  # stopped by a signal, checkpoint saved

    # --- final evaluation, final/ (and final-seqcls/), summary
    final_eval = run_eval()
    book.save_final_model(step, final_eval)
    if t.export_sequence_classification and is_main:  # from final/ when saved (whole weights)
        whole = engine.unwrap(model)
        if cfg.checkpoint.save_final:
            whole = BaseRewardModel.from_pretrained(run_dir / "final", device=device)
        whole.export_sequence_classification(run_dir / "final-seqcls", tokenizer=tokenizer)
    book.summarize(step, {
        "kind": kind, "loss": cfg.loss, "train_examples": len(train_data.examples),
        **{f"train_data/{k}": v for k, v in train_data.counts.items()},
        **book.final_train_facts(),
    }, final_eval, engine_facts)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg, run = parse_run_args(
        argv, RMConfig, prog=f"python -m {PACKAGE}.train",
        description="Reward models: preference (Bradley-Terry), outcome (ORM), process (PRM)",
    )  # fmt: skip
    return train(cfg, run)


if __name__ == "__main__":
    sys.exit(run_main(main))
