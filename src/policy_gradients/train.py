"""Policy-gradient RL from verifiable or learned rewards: REINFORCE, RLOO, PPO, GRPO, Dr. GRPO,
GSPO, CISPO, DAPO, each a YAML combination of advantage estimator, per-token loss, aggregation
and KL placement.

    uv run python -m policy_gradients.train --config configs/policy_gradients/grpo.yaml

One step, top to bottom: sample prompts -> generate `group_size` completions each (KV cache,
left padding) -> score with the reward components -> old and reference log-probs of the
sampling distribution -> advantages (`collect.py`) -> `ppo_epochs` passes over the replay buffer
in micro-batches, each pass `mini_batches` clipped optimizer steps (each step's loss is
normalised over that step's tokens/sequences, so accumulation equals one big batch; the rows are
shuffled when a pass takes several steps, kept group by group when it takes one) -> log
(rewards, KL, entropy, clip fraction, lengths, time split) -> held-out eval every k steps ->
checkpoint.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import torch
from accelerate.utils import gather_object

from policy_gradients.advantages import ADVANTAGES
from policy_gradients.collect import collect_experience, merge_rollout_metrics
from policy_gradients.config import PGConfig
from policy_gradients.evaluate import evaluate_policy
from policy_gradients.experience import ReplayBuffer
from policy_gradients.losses import LOSSES, VALUE_LOSSES
from policy_gradients.overoptimization import write_overoptimization
from policy_gradients.rewards import CombinedReward
from policy_gradients.rollout import (
    RolloutLog,
    completion_logprobs,
    completion_values,
    load_prompts,
)
from rlhf_core.bookkeeping import start_bookkeeping
from rlhf_core.config import RunArgs, parse_run_args
from rlhf_core.errors import UserError, run_main
from rlhf_core.loop import (
    check_engine_accumulation,
    optimizer_step,
    print_dry_run,
    start_engine,
    start_optimizer,
)
from rlhf_core.models import load_policy, load_reference, load_tokenizer
from rlhf_core.registry import build_from_spec
from rlhf_core.rundir import managed_run, open_run_dir
from rlhf_core.runtime import seed_everything
from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel
from rlhf_core.stop_signal import StopSignal

PACKAGE = "policy_gradients"


def split_into(batches: list, parts: int) -> list[list]:
    """`batches` cut into `parts` consecutive groups of (nearly) equal size, none empty."""
    parts = max(1, min(parts, len(batches)))
    size, extra = divmod(len(batches), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append(batches[start:end])
        start = end
    return out


def even_updates(
    accelerator, groups: list[list], batches: list, filler
) -> list[tuple[list, float]]:
    """(group, weight) pairs, as many on every process. With dynamic sampling the processes
    keep different numbers of groups, so one may have fewer micro-batches (or none) than the
    others' optimizer steps. Every step needs one synchronised backward on every process (DDP's
    all-reduce), so a process short of groups adds zero-weight stand-ins: one of its own
    micro-batches, or the dropped group `collect_experience` kept for this (`Collected.filler`).
    The gradients and losses are those of the real groups alone."""
    real = [g for g in groups if g]
    count = torch.tensor(len(real), device=accelerator.device)
    steps = max(1, int(accelerator.reduce(count, reduction="max")))
    stand_in = batches[:1] or [filler]
    return [(g, 1.0) for g in real] + [(stand_in, 0.0)] * (steps - len(real))


@managed_run
def train(cfg: PGConfig, run: RunArgs) -> int:
    """Run RL as configured; returns the exit code (0, or 130/143 after a signal)."""
    accelerator, engine, threads = start_engine(cfg.train)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    is_main = accelerator.is_main_process
    alg, ro, t = cfg.algorithm, cfg.rollout, cfg.train
    if ro.prompts_per_step % world:
        raise UserError(f"rollout.prompts_per_step ({ro.prompts_per_step}) must divide by {world}")
    rows_per_rank = ro.prompts_per_step // world * ro.group_size
    micro_per_pass = -(-rows_per_rank // t.micro_batch_size)
    if alg.mini_batches > micro_per_pass and not alg.dynamic_sampling:  # (its rows vary)
        raise UserError(
            f"algorithm.mini_batches ({alg.mini_batches}) exceeds the micro-batches per pass and "
            f"process ({micro_per_pass} = {rows_per_rank} rows / train.micro_batch_size "
            f"{t.micro_batch_size}): lower it or train.micro_batch_size"
        )
    check_engine_accumulation(accelerator, -(-micro_per_pass // alg.mini_batches))

    # --- tokenizer, prompts, rewards, algorithm parts
    tokenizer = load_tokenizer(cfg.model, padding_side="left")
    d = cfg.data
    prompt_args = {
        "prompt_column": d.prompt_column, "answer_column": d.answer_column,
        "prompt_template": d.prompt_template, "system_prompt": d.system_prompt,
    }  # fmt: skip
    train_prompts = load_prompts(d.train, tokenizer, where="data.train", **prompt_args)
    eval_prompts = None
    if d.eval is not None and t.evaluate:
        eval_prompts = load_prompts(
            d.eval, tokenizer, where="data.eval", limit=t.eval_size, **prompt_args
        )
    reward_fn = CombinedReward(cfg.rewards, strip_thinking=cfg.strip_thinking)
    estimator = build_from_spec(ADVANTAGES, alg.advantage)
    if world > 1 and not alg.dynamic_sampling:  # whiten over the whole step's batch (one call
        # per process per step; dynamic sampling's rounds differ between processes: per slice)
        estimator.sum_across_processes = partial(accelerator.reduce, reduction="sum")
    loss_fn = build_from_spec(LOSSES, alg.loss)
    value_loss_fn = build_from_spec(VALUE_LOSSES, alg.value_loss) if alg.value_loss else None
    needs_reference = loss_fn.needs_reference or alg.kl_in_reward.beta > 0
    run_dir, ckpt = open_run_dir(accelerator, run, package=PACKAGE, name=cfg.name)

    if run.dry_run:
        print_dry_run(cfg, tokenizer, {
            "algorithm": f"{alg.name}: {type(estimator).__name__} + {type(loss_fn).__name__}",
            "reference": cfg.reference.mode if needs_reference else "none (no KL term)",
            "rewards": ", ".join(f"{r['weight']} x {r['label']}" for r in cfg.rewards),
            "train prompts": f"{len(train_prompts.items)} ({d.train.describe()})",
            "eval prompts": len(eval_prompts.items) if eval_prompts else 0,
            "would run": f"{t.max_steps} steps x {ro.prompts_per_step} prompts x "
            f"{ro.group_size} completions",
        }, engine=engine, run_dir=run_dir, ckpt=ckpt)  # fmt: skip
        return 0

    # --- policy, reference, optimizer
    seed_everything(cfg.seed)
    policy = engine.prepare(load_policy(cfg.model, device, weights_from=ckpt).train())
    reference = None
    if needs_reference:  # the starting weights, never the resumed ones
        reference = load_reference(cfg.reference, cfg.model, policy, engine)
    # learned rewards: sharded at rest like the reference, gathered while they score
    for component, model in reward_fn.models():
        component.model = engine.prepare(model.requires_grad_(False), trainable=False)
    reward_models = [component.model for component, _ in reward_fn.models()]
    value_model = value_opt = value_sched = None
    if value_loss_fn is not None:  # PPO: backbone + scalar head, from the policy's start
        value_model = ScalarHeadModel.from_config(
            cfg.value_model or cfg.model, ScalarHeadInfo(kind="value"), device,
            weights_from=ckpt / "value" if ckpt is not None else None,
        ).train()  # fmt: skip
        value_model = engine.prepare(value_model)
    updates_per_step = alg.ppo_epochs * alg.mini_batches
    total_updates = t.max_steps * updates_per_step
    optimizer, scheduler = start_optimizer(engine, policy, cfg.optim, total_updates)
    if value_model is not None:
        value_opt, value_sched = start_optimizer(engine, value_model, cfg.optim, total_updates)
    # data position, skipped steps, best model, tracker: fresh, or resumed from ckpt
    book = start_bookkeeping(
        cfg, run, package=PACKAGE, accelerator=accelerator, threads=threads, run_dir=run_dir,
        ckpt=ckpt, num_rows=len(train_prompts.items), total_steps=t.max_steps,
        has_eval=cfg.data.eval is not None,
        model=policy, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
        extra={"value": (value_model, value_opt)} if value_model is not None else None,
    )  # fmt: skip
    step, sampler, skips, tracker = book.start_step, book.sampler, book.skips, book.tracker
    if ckpt is not None and value_model is not None:
        value_sched.load_state_dict(book.restored["value_scheduler"])
    rollout_log = RolloutLog(
        run_dir / "rollouts.sqlite", enabled=is_main, resume_step=step if ckpt else None
    )
    buffer = ReplayBuffer()
    held = [policy, reference.own_model if reference else None, value_model]
    engine_facts = engine.announce(
        [m for m in [*held, *reward_models] if m is not None],
        [optimizer] + ([value_opt] if value_opt is not None else []),
    )

    def run_eval() -> dict[str, float]:
        if eval_prompts is None:
            return {}
        # every process evaluates all prompts (the same numbers), its models gathered
        rows: list[tuple] = []
        with engine.gathered_all(*held[:2], *reward_models) as (whole, *_):
            results = evaluate_policy(
                whole, reference, tokenizer, eval_prompts, reward_fn,
                max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
                batch_size=max(t.micro_batch_size, 32), seed=cfg.seed + step, log_rows=rows,
            )  # fmt: skip
        rollout_log.write_eval([(step, *row) for row in rows])
        return results

    def save() -> None:
        rollout_log.flush()
        value = {"value_scheduler": value_sched.state_dict()} if value_sched is not None else None
        book.save(step, extra_state=value)

    def update(
        group: list, sums: dict[str, float], weight: float = 1.0
    ) -> tuple[torch.Tensor, float, bool]:
        """One optimizer step on `group` (micro-batches of the replay buffer) with gradient
        accumulation; the loss is normalised by the group's global token/sequence counts, so
        the micro-batch losses sum to the one-big-batch loss. Metrics go into `sums` as this
        update's share of the step's average. `weight` 0: a stand-in forward/backward that adds
        nothing, for a process with no rows in this step (see `even_updates`)."""
        local = torch.tensor([float(sum(mb.action_mask.sum() for mb in group)),
                              float(sum(len(mb) for mb in group))]) * weight  # fmt: skip
        total_tokens, total_sequences = accelerator.reduce(local.to(device), reduction="sum")
        norm = {"total_tokens": total_tokens.clamp(min=1),
                "total_sequences": total_sequences.clamp(min=1)}  # fmt: skip
        step_loss = torch.zeros((), device=device)
        for i, mb in enumerate(group):
            sync = i == len(group) - 1
            with engine.grad_sync(policy, sync), engine.grad_sync(value_model, sync):
                logps, entropy = completion_logprobs(
                    policy, mb.sequence_ids, mb.attention_mask,
                    mb.sequence_ids.shape[1] - mb.action_mask.shape[1],
                    temperature=ro.temperature, with_entropy=True, action_mask=mb.action_mask,
                )  # fmt: skip
                if mb.log_probs_old is None:  # on-policy: pi_old = pi_theta, detached
                    mb.log_probs_old = logps.detach()
                loss, metrics = loss_fn(logps, mb, entropy=entropy, **norm)
                if value_model is not None:
                    prompt_len = mb.sequence_ids.shape[1] - mb.action_mask.shape[1]
                    values = completion_values(
                        value_model, mb.sequence_ids, mb.attention_mask, prompt_len
                    )
                    v_loss, v_metrics = value_loss_fn(None, mb, values=values, **norm)
                    metrics = {**metrics, **{f"value/{k}": v for k, v in v_metrics.items()}}
                    loss = loss + alg.value_coef * v_loss
                accelerator.backward(loss * world * weight)
            step_loss += loss.detach() * weight
            share = len(mb) / float(total_sequences) / updates_per_step * weight
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value) * share
        step_loss = accelerator.reduce(step_loss, reduction="sum")
        grad_norm, was_skipped = optimizer_step(
            accelerator, policy, optimizer, scheduler,
            max_grad_norm=cfg.optim.max_grad_norm, loss=step_loss, skips=skips,
        )  # fmt: skip
        if value_model is not None:
            optimizer_step(
                accelerator, value_model, value_opt, value_sched,
                max_grad_norm=cfg.optim.max_grad_norm, loss=step_loss,
            )  # fmt: skip
        return step_loss, grad_norm, was_skipped

    # --- the loop
    with StopSignal() as stop:
        while step < t.max_steps:
            # each process generates its own prompts' rollouts, its models gathered
            with engine.gathered_all(*held, *reward_models) as (whole, _, whole_value, *_):
                collected = collect_experience(
                    step=step, policy=whole, reference=reference, tokenizer=tokenizer,
                    prompts=train_prompts, sampler=sampler, prompts_per_step=ro.prompts_per_step,
                    rank=rank, world=world, cfg=cfg, reward_fn=reward_fn, estimator=estimator,
                    value_model=whole_value,
                )  # fmt: skip
            # every rank's rollouts, written by rank 0 alone, and their metrics together
            rows = gather_object(collected.log_rows) if world > 1 else collected.log_rows
            rollout_log.write(rows)
            if world > 1:
                parts = gather_object([(collected.sums, collected.counts)])
                collected.metrics = merge_rollout_metrics(collected, parts)
            for experience in collected.experiences:
                buffer.add(experience)
            t_train = time.perf_counter()
            sums: dict[str, float] = {}
            for epoch in range(alg.ppo_epochs):
                # one optimizer step per pass: keep each group's rows together (fewer prompt
                # forwards; the order of an accumulated sum changes nothing but rounding)
                batches = buffer.micro_batches(
                    t.micro_batch_size, seed=cfg.seed * 1_000_003 + step * 101 + epoch,
                    shuffle=alg.mini_batches > 1,
                )  # fmt: skip
                groups = split_into(batches, alg.mini_batches)  # one optimizer step each
                if world > 1 and alg.dynamic_sampling:  # as many steps on every process
                    weighted = even_updates(accelerator, groups, batches, collected.filler)
                else:
                    weighted = [(group, 1.0) for group in groups]
                for group, weight in weighted:
                    step_loss, grad_norm, _ = update(group, sums, weight)
            buffer.clear()
            step += 1

            if step % cfg.tracking.log_every == 0 or step == t.max_steps:
                # each process holds its rows' share of the step's loss components: sum them
                sums = {k: accelerator.reduce(torch.tensor(v, device=device), reduction="sum")
                        .item() for k, v in sorted(sums.items())}  # fmt: skip
                tracker.log(step, {
                    "train/loss": step_loss.item(), "train/grad_norm": grad_norm,
                    "train/lr": scheduler.get_last_lr()[0], "train/skipped_steps": skips.total,
                    **{f"train/{k}": v for k, v in collected.metrics.items()},
                    **{f"train/loss/{k}": v for k, v in sums.items()},
                    "train/time/train_s": time.perf_counter() - t_train,
                })  # fmt: skip
            if book.evaluate(step, run_eval):  # every train.eval_every steps
                break  # early stop: the final evaluation and final/ follow
            if book.save_due(step):
                save()
            if stop.requested:
                save()
                rollout_log.close()
                return book.stopped(step, stop)

    # --- final evaluation, final/ and summary
    final_eval = run_eval()
    rollout_log.close()
    book.save_final_model(step, final_eval)
    first = [r for r in tracker.history if "train/reward/total" in r]
    book.summarize(step, {
        "algorithm": alg.name, "train_prompts": len(train_prompts.items),
        "first_train_reward": first[0]["train/reward/total"] if first else None,
        "last_train_reward": first[-1]["train/reward/total"] if first else None,
    }, final_eval, engine_facts)  # fmt: skip
    if is_main:  # a learned and a verifier reward: proxy vs gold (Gao et al. 2022)
        write_overoptimization(run_dir, cfg.rewards)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg, run = parse_run_args(
        argv, PGConfig, prog=f"python -m {PACKAGE}.train", description="Policy-gradient RL"
    )
    return train(cfg, run)


if __name__ == "__main__":
    sys.exit(run_main(main))
