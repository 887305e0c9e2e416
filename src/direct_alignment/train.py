"""Direct alignment (DPO and its family) from preference pairs.

    uv run python -m direct_alignment.train --config configs/direct_alignment/dpo.yaml

Read top to bottom: config -> tokenizer and pairs -> policy, reference (frozen copy, disabled
adapter, or precomputed log-probs), optimizer, schedule -> the loop (chosen and rejected in one
concatenated forward per micro-batch; the loss is the mean over the step's pairs, so gradient
accumulation and processes give the one-big-batch update) -> eval, samples, checkpoints -> summary.
With `models:` several policies are trained one after another, each in its own run dir; a
failure is reported and the next model still runs.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from dataclasses import replace
from functools import partial

import torch

from direct_alignment.config import DAConfig
from direct_alignment.data import build_preference_data, build_unpaired_data
from direct_alignment.evaluate import evaluate_pairs, keep_samples_through, write_samples
from direct_alignment.losses import LOSSES, loss_inputs
from direct_alignment.reference import (
    load_reference_cache,
    pair_logps,
    precompute_reference,
    reference_pair_logps,
    save_reference_cache,
)
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
from rlhf_core.models import load_policy, load_reference, load_tokenizer
from rlhf_core.preference import collate_pairs, pack_pairs
from rlhf_core.registry import build_from_spec
from rlhf_core.rundir import managed_run, open_run_dir
from rlhf_core.runtime import seed_everything
from rlhf_core.stop_signal import StopSignal

PACKAGE = "direct_alignment"


def warn_kto_weights(loss_fn, examples) -> None:
    """KTO's paper recommends w_d * n_desirable / (w_u * n_undesirable) in [1, 4/3]."""
    n_d = sum(bool(e.label) for e in examples)
    n_u = len(examples) - n_d
    if n_d == 0 or n_u == 0:
        kind = "desirable" if n_u == 0 else "undesirable"
        warnings.warn(
            f"data.train: all {len(examples)} rows are {kind}; KTO then pushes one way only",
            stacklevel=2,
        )
        return
    ratio = loss_fn.desirable_weight * n_d / (loss_fn.undesirable_weight * n_u)
    if not 1.0 <= ratio <= 4 / 3:
        warnings.warn(
            f"kto_unpaired: desirable_weight * {n_d} desirable / (undesirable_weight * {n_u} "
            f"undesirable) = {ratio:.2f}, outside the paper's recommended [1, 4/3]; e.g. "
            f"desirable_weight {loss_fn.undesirable_weight * n_u / n_d:.3g} gives 1",
            stacklevel=2,
        )


@managed_run
def train(cfg: DAConfig, run: RunArgs) -> int:
    """Train one policy (cfg.model); returns the exit code (0, or 130/143 after a signal)."""
    assert cfg.model is not None
    accelerator, engine, threads = start_engine(cfg.train)
    device = accelerator.device
    is_main = accelerator.is_main_process

    # --- tokenizer and data
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    d, t = cfg.data, cfg.train
    lengths = {"max_length": d.max_length, "max_prompt_length": d.max_prompt_length}
    if d.format == "unpaired":  # labelled single completions (KTO), as pairs with a label
        build = partial(build_unpaired_data, columns=d.columns)
    else:
        build = partial(build_preference_data, fmt=d.format, overlong=d.overlong, columns=d.columns)
    train_data = build(d.train, tokenizer, where="data.train", **lengths)
    eval_data = None
    if d.eval is not None and t.evaluate:
        eval_data = build(d.eval, tokenizer, where="data.eval", limit=t.eval_size, **lengths)
    micro, total_steps = plan_steps(t, len(train_data.pairs), accelerator)
    loss_fn = build_from_spec(LOSSES, cfg.loss)
    if loss_fn.unpaired:
        warn_kto_weights(loss_fn, train_data.pairs)
    run_dir, ckpt = open_run_dir(accelerator, run, package=PACKAGE, name=cfg.name,
                                 total_steps=total_steps)  # fmt: skip
    ref_mode = cfg.reference.mode if loss_fn.needs_reference else "none (reference-free loss)"

    if run.dry_run:
        print_dry_run(cfg, tokenizer, {
            "loss": f"{type(loss_fn).__name__} {cfg.loss}", "reference": ref_mode,
            "train pairs": f"{len(train_data.pairs)} ({d.train.describe()}; dropped identical "
            f"{train_data.dropped_identical}, truncated {train_data.truncated})",
            "eval pairs": len(eval_data.pairs) if eval_data else 0,
            "would run": f"{total_steps} steps x {t.batch_size} pairs",
        }, engine=engine, run_dir=run_dir, ckpt=ckpt)  # fmt: skip
        return 0

    # --- policy and reference
    seed_everything(cfg.seed)
    policy = engine.prepare(load_policy(cfg.model, device, weights_from=ckpt).train())
    pad_id = tokenizer.pad_token_id
    # pairs as packed rows, each prompt encoded once, where the attention takes a 4D mask (on
    # CPU SDPA, rows with no padding and attention computed group by group); under flash
    # attention every completion with its prompt in one row by position ids (varlen)
    plan = speed_plan(policy)
    collate = {
        "segmented": partial(pack_pairs, row_tokens=plan.row_tokens), "mask": pack_pairs,
        "flat": partial(pack_pairs, flat=True), "padded": collate_pairs,
    }[plan.layout if t.packing else "padded"]  # fmt: skip
    # packed pairs: a step's micro-batches merged into forwards of up to what a padded
    # micro-batch could hold (exact for per-pair losses up to rounding; the plan says when)
    merge = t.packing and loss_fn.mean_of_pairs
    budget = plan.pair_token_budget(micro, d.max_length) if merge else 0
    reference, ref_cache = None, None
    if loss_fn.needs_reference:
        reference = load_reference(cfg.reference, cfg.model, policy, engine)
        if cfg.reference.mode == "precomputed":
            cache_path = run_dir / "reference_logps.pt"
            splits = {"train": train_data.pairs, "eval": eval_data.pairs if eval_data else []}
            if ckpt is not None and cache_path.is_file():
                ref_cache = load_reference_cache(cache_path, {k: len(v) for k, v in splits.items()})
            else:
                ref_cache = {
                    k: precompute_reference(
                        reference, v, pad_id=pad_id, batch_size=micro, device=device,
                        collate=collate,
                    ) if v else torch.zeros(0, 2)
                    for k, v in splits.items()
                }  # fmt: skip
                if is_main:
                    run_dir.mkdir(parents=True, exist_ok=True)
                    save_reference_cache(cache_path, ref_cache)
            reference = None  # nothing held during training

    def ref_logps(split: str, batch: dict, rows) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if ref_cache is not None:
            cached = ref_cache[split][rows].to(device)
            return cached[:, 0], cached[:, 1]
        if reference is not None:
            return reference_pair_logps(reference, batch)
        return None, None

    optimizer, scheduler = start_optimizer(engine, policy, cfg.optim, total_steps)
    # data position, skipped steps, best model, tracker: fresh, or resumed from ckpt
    book = start_bookkeeping(
        cfg, run, package=PACKAGE, accelerator=accelerator, threads=threads, run_dir=run_dir,
        ckpt=ckpt, num_rows=len(train_data.pairs), total_steps=total_steps,
        has_eval=eval_data is not None,
        model=policy, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
    )  # fmt: skip
    step, skips = book.start_step, book.skips
    if ckpt is not None and is_main:  # samples.jsonl as it was at the checkpoint
        keep_samples_through(run_dir / "samples.jsonl", step)

    engine_facts = engine.announce(
        [policy, *([reference.own_model] if reference and reference.own_model else [])],
        [optimizer],
    )

    def run_eval() -> dict[str, float]:
        if eval_data is None:
            return {}
        # every process evaluates all pairs (a sharded reference's forwards stay in step)
        with engine.gathered(policy) as whole:
            return evaluate_pairs(
                whole, loss_fn, eval_data.pairs,
                lambda batch, rows: ref_logps("eval", batch, rows) if loss_fn.needs_reference
                else (None, None), pad_id=pad_id, batch_size=micro, collate=collate,
            )  # fmt: skip

    # --- the loop
    def pair_loss(batch: dict[str, torch.Tensor], rows: list[int]) -> tuple[torch.Tensor, dict]:
        chosen, rejected = pair_logps(policy, batch)
        ref_c, ref_r = ref_logps("train", batch, rows)
        return loss_fn(chosen, rejected, ref_c, ref_r, **loss_inputs(batch))

    metrics: dict[str, torch.Tensor] = {}
    with StopSignal() as stop:
        while step < total_steps:
            batches = book.next_micro_batches(
                micro,
                lambda rows: collate([train_data.pairs[j] for j in rows], pad_id),
                tokens=lambda j: train_data.pairs[j].packed_tokens,
                budget=budget,
            )
            # each micro-batch's loss counts with its share of the step's pairs
            step_loss, metrics = accumulate_gradients(
                engine, policy, batches, pair_loss, step_rows=t.batch_size
            )
            grad_norm, _ = optimizer_step(
                accelerator, policy, optimizer, scheduler,
                max_grad_norm=cfg.optim.max_grad_norm, loss=step_loss, skips=skips,
            )  # fmt: skip
            step += 1

            book.log_step(step, step_loss, grad_norm, metrics)  # every tracking.log_every steps
            if book.evaluate(step, run_eval):  # every train.eval_every steps
                break  # early stop: the final evaluation and final/ follow
            if t.samples_every and step % t.samples_every == 0 and eval_data:
                with engine.gathered(policy) as whole:  # every process samples; rank 0 writes
                    write_samples(
                        whole, tokenizer, eval_data.pairs[: t.num_samples],
                        run_dir / "samples.jsonl" if is_main else None, step=step,
                        max_new_tokens=t.sample_max_new_tokens, seed=cfg.seed + step,
                    )  # fmt: skip
            if (exit_code := book.checkpoint(step, stop)) is not None:
                return exit_code  # stopped by a signal, checkpoint saved

    # --- final evaluation, final/ and summary
    book.finish(step, run_eval(), {
        "loss": cfg.loss, "reference": ref_mode, "train_pairs": len(train_data.pairs),
        "dropped_identical_pairs": train_data.dropped_identical,
        "truncated_pairs": train_data.truncated,
        "dropped_overlong": train_data.dropped_overlong, **book.final_train_facts(),
    }, engine_facts)  # fmt: skip
    return 0


def train_all(cfg: DAConfig, run: RunArgs) -> int:
    """Train `cfg.model`, or each of `cfg.models` in turn (continuing after a failure), or with
    `--model-index N` only `cfg.models[N]` (same run-dir label as in the list run)."""
    if cfg.model is not None:
        if run.model_index is not None:
            raise UserError("--model-index: the config has one 'model', not a 'models:' list")
        return train(cfg, run)
    indices = range(len(cfg.models))
    if run.model_index is not None:
        if not 0 <= run.model_index < len(cfg.models):
            raise UserError(
                f"--model-index {run.model_index}: the config's 'models:' list has "
                f"{len(cfg.models)} entries (0..{len(cfg.models) - 1})"
            )
        indices = [run.model_index]
    failed: list[str] = []
    for i in indices:
        model = cfg.models[i]
        label = f"{cfg.name}-{i}-{model.name_or_path.replace('/', '_')}"
        one = cfg.model_copy(update={"model": model, "models": [], "name": label})
        out = run.output_dir / label if run.output_dir is not None else None
        if run.model_index is not None:  # one model: its failure is the command's own
            return train(one, replace(run, output_dir=out, model_index=None))
        try:
            code = train(one, replace(run, output_dir=out))
        except UserError as exc:  # report and go on with the next model
            print(f"error: {exc}", file=sys.stderr)
            code = 2
        except Exception:
            traceback.print_exc()
            code = 1
        if code != 0:
            failed.append(f"{model.name_or_path} (exit {code})")
        if code in (130, 143):
            break
    print(f"trained {len(cfg.models) - len(failed)}/{len(cfg.models)} models" + (
        f"; failed: {', '.join(failed)}" if failed else ""))  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    cfg, run = parse_run_args(
        argv,
        DAConfig,
        prog=f"python -m {PACKAGE}.train",
        description="Direct alignment (DPO family)",
    )
    return train_all(cfg, run)


if __name__ == "__main__":
    sys.exit(run_main(main))
