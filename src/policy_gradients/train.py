"""Policy-gradient RL from verifiable or learned rewards: REINFORCE, RLOO, PPO, GRPO, Dr. GRPO,
GSPO, CISPO, DAPO, each a YAML combination of advantage estimator, per-token loss, aggregation
and KL placement.

    uv run python -m policy_gradients.train --config configs/policy_gradients/grpo.yaml

One step, top to bottom: sample prompts -> generate `group_size` completions each (KV cache,
left padding) -> score with the reward components -> old and reference log-probs of the
sampling distribution -> advantages (`collect.py`; DAPO's dynamic sampling in
`dynamic_sampling.py`) -> `ppo_epochs` passes over the replay buffer in micro-batches, each pass
`mini_batches` clipped optimizer steps (`update.py`: each step's loss is normalised over that
step's tokens/sequences, so accumulation equals one big batch; an off-policy correction weighs
the policy term, `off_policy.py`) -> log (rewards, KL, entropy, clip fraction, lengths, the
sampler-trainer mismatch, time split) -> held-out eval every k steps -> checkpoint. With
`rollout.max_staleness` k > 0 the first half runs ahead in a generator process with weights at
most k steps old (`async_rollouts.py`); the trainer publishes its weights after every step. The
bookkeeping (data position, logging, best/, checkpoints, the stop after a signal, final/) is
`rlhf_core.bookkeeping`'s, as in every trainer.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object

from policy_gradients.advantages import ADVANTAGES
from policy_gradients.async_rollouts import RolloutGenerator, split_threads
from policy_gradients.collect import collect_experience, digest_step, gather_collected
from policy_gradients.config import PGConfig
from policy_gradients.episodes import EpisodeRunner, evaluate_episodes, gather_rows
from policy_gradients.evaluate import evaluate_policy
from policy_gradients.experience import ReplayBuffer
from policy_gradients.losses import LOSSES, VALUE_LOSSES
from policy_gradients.off_policy import CORRECTIONS, MismatchStats
from policy_gradients.overoptimization import write_overoptimization
from policy_gradients.rewards import CombinedReward
from policy_gradients.rollout import RolloutLog, load_prompts
from policy_gradients.update import check_step_shape, optimizer_groups, policy_update
from rlhf_core.bookkeeping import start_bookkeeping
from rlhf_core.config import RunArgs, parse_run_args
from rlhf_core.distributed import Engine
from rlhf_core.errors import UserError, run_main
from rlhf_core.loop import print_dry_run, start_engine, start_optimizer
from rlhf_core.models import ReferencePolicy, load_policy, load_reference, load_tokenizer
from rlhf_core.policy_model import share_policy_encoder
from rlhf_core.registry import build_from_spec
from rlhf_core.rundir import managed_run, open_run_dir
from rlhf_core.runtime import configure_threads, seed_everything
from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel
from rlhf_core.stop_signal import StopSignal

PACKAGE = "policy_gradients"


@dataclass
class Models:
    """The models of a run: the policy, the frozen reference (None without a KL term), the
    learned rewards' models and PPO's value model (None without a value loss)."""

    policy: torch.nn.Module
    reference: ReferencePolicy | None
    rewards: list[torch.nn.Module]
    value: torch.nn.Module | None

    @property
    def held(self) -> list[torch.nn.Module | None]:
        """Policy, the reference's own model (None when it shares the policy's), value model."""
        own = self.reference.own_model if self.reference is not None else None
        return [self.policy, own, self.value]

    @property
    def every(self) -> list[torch.nn.Module]:
        """Every model the run holds (the engine reports their bytes)."""
        return [m for m in [*self.held, *self.rewards] if m is not None]


def load_models(
    cfg: PGConfig, engine: Engine, ckpt: Path | None, reward_fn: CombinedReward, *,
    needs_reference: bool, needs_value: bool,
) -> Models:  # fmt: skip
    """The policy (resumed from `ckpt`), the reference (the starting weights, never the resumed
    ones), the learned rewards (sharded at rest like the reference, gathered while they score)
    and the value model (backbone + scalar head, from the policy's start), prepared for `engine`."""
    device = engine.accelerator.device
    policy = engine.prepare(load_policy(cfg.model, device, weights_from=ckpt).train())
    reference = None
    if needs_reference:
        reference = load_reference(cfg.reference, cfg.model, policy, engine)
    for component, model in reward_fn.models():
        component.model = engine.prepare(model.requires_grad_(False), trainable=False)
    value = None
    if needs_value:
        value = ScalarHeadModel.from_config(
            cfg.value_model or cfg.model, ScalarHeadInfo(kind="value"), device,
            weights_from=ckpt / "value" if ckpt is not None else None,
        ).train()  # fmt: skip
        if cfg.value_shares_policy_encoder:
            if engine.world > 1:
                raise UserError(
                    "value_shares_policy_encoder: single process only (the value "
                    f"model would not own the encoder it runs; world {engine.world})"
                )
            share_policy_encoder(value, policy)
        value = engine.prepare(value)
    return Models(policy, reference, [c.model for c, _ in reward_fn.models()], value)


@contextmanager
def closing_generator(generator: RolloutGenerator | None) -> Iterator[None]:
    """Stop the generator process when the loop ends, however it ends."""
    try:
        yield
    finally:
        if generator is not None:
            generator.close()


@managed_run
def train(cfg: PGConfig, run: RunArgs) -> int:
    """Run RL as configured; returns the exit code (0, or 130/143 after a signal)."""
    accelerator, engine, threads = start_engine(cfg.train)
    rank, world = accelerator.process_index, accelerator.num_processes
    alg, ro, t, d = cfg.algorithm, cfg.rollout, cfg.train, cfg.data
    check_step_shape(cfg, accelerator)
    if ro.uses_generator_process:  # asynchronous rollouts (policy_gradients.async_rollouts)
        if world > 1:
            raise UserError(
                f"rollout.max_staleness {ro.max_staleness} / rollout.generator {ro.generator}: "
                f"the generator process feeds one trainer process, this run has {world}"
            )
        threads = configure_threads(split_threads(t.threads))  # the generator gets as many

    # --- tokenizer, prompts, rewards, algorithm parts
    tokenizer = load_tokenizer(cfg.model, padding_side="left")
    args = cfg.prompt_args()
    train_prompts = load_prompts(d.train, tokenizer, where="data.train", **args)
    eval_prompts = None
    if d.eval is not None and t.evaluate:
        eval_prompts = load_prompts(d.eval, tokenizer, where="data.eval", limit=t.eval_size, **args)
    reward_fn = CombinedReward(cfg.rewards, strip_thinking=cfg.strip_thinking)
    environment = EpisodeRunner.from_config(cfg.environment)  # None: one completion per prompt
    estimator = build_from_spec(ADVANTAGES, alg.advantage)
    if world > 1 and not alg.dynamic_sampling:  # whiten over the whole step's batch (one call
        # per process per step; dynamic sampling's rounds differ between processes: per slice)
        estimator.sum_across_processes = partial(accelerator.reduce, reduction="sum")
    loss_fn = build_from_spec(LOSSES, alg.loss)
    value_loss_fn = build_from_spec(VALUE_LOSSES, alg.value_loss) if alg.value_loss else None
    correction = build_from_spec(CORRECTIONS, alg.correction) if alg.correction else None
    needs_reference = loss_fn.needs_reference or alg.kl_in_reward.beta > 0
    run_dir, ckpt = open_run_dir(accelerator, run, package=PACKAGE, name=cfg.name,
                                 total_steps=t.max_steps)  # fmt: skip

    if run.dry_run:
        print_dry_run(cfg, tokenizer, {
            "algorithm": f"{alg.name}: {type(estimator).__name__} + {type(loss_fn).__name__}",
            "reference": cfg.reference.mode if needs_reference else "none (no KL term)",
            "rewards": ", ".join(f"{r['weight']} x {r['label']}" for r in cfg.rewards),
            "environment": cfg.environment.env["name"] if cfg.environment else "none",
            "train prompts": f"{len(train_prompts.items)} ({d.train.describe()})",
            "eval prompts": len(eval_prompts.items) if eval_prompts else 0,
            "would run": f"{t.max_steps} steps x {ro.prompts_per_step} prompts x "
            f"{ro.group_size} completions",
        }, engine=engine, run_dir=run_dir, ckpt=ckpt)  # fmt: skip
        return 0

    # --- models, optimizers, bookkeeping (data position, skips, best/, tracker): fresh or resumed
    seed_everything(cfg.seed)
    models = load_models(cfg, engine, ckpt, reward_fn, needs_reference=needs_reference,
                         needs_value=value_loss_fn is not None)  # fmt: skip
    total_updates = t.max_steps * alg.ppo_epochs * alg.mini_batches
    policy = (models.policy, *start_optimizer(engine, models.policy, cfg.optim, total_updates))
    value = None
    if models.value is not None:
        value = (models.value, *start_optimizer(engine, models.value, cfg.optim, total_updates))
    book = start_bookkeeping(
        cfg, run, package=PACKAGE, accelerator=accelerator, threads=threads, run_dir=run_dir,
        ckpt=ckpt, num_rows=len(train_prompts.items), total_steps=t.max_steps,
        has_eval=d.eval is not None, model=policy[0], tokenizer=tokenizer, optimizer=policy[1],
        scheduler=policy[2], extra={"value": value[:2]} if value else None,
        extra_schedulers={"value": value[2]} if value else None,
    )  # fmt: skip
    step = book.start_step
    rollout_log = RolloutLog(run_dir / "rollouts.sqlite", enabled=accelerator.is_main_process,
                             resume_step=step if ckpt else None)  # fmt: skip
    buffer = ReplayBuffer()
    engine_facts = engine.announce(models.every, [policy[1]] + ([value[1]] if value else []))
    queued = book.restored.get("rollout_queue", [])
    generator = None
    if ro.uses_generator_process:  # samples ahead, from weights at most max_staleness steps old
        generator = RolloutGenerator(
            cfg, engine.unwrap(policy[0]), start_step=step, queued=queued, threads=threads,
            sampler_state=book.sampler.state_dict(), device=accelerator.device,
            resumed=ckpt is not None,
        )  # fmt: skip
    elif queued:
        raise UserError(
            f"resume: {ckpt} holds {len(queued)} batches sampled ahead with older weights "
            "(asynchronous rollouts); resume with the rollout.max_staleness it was saved with"
        )

    def run_eval() -> dict[str, float]:
        if eval_prompts is None:
            return {}
        # every process evaluates all prompts (the same numbers), its models gathered
        rows: list[tuple] = []
        with engine.gathered_all(*models.held[:2], *models.rewards) as (whole, *_):
            if environment is not None:  # held-out episodes: success, turns, tool calls
                results = evaluate_episodes(
                    environment, whole, tokenizer, eval_prompts.items, log_rows=rows,
                    max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
                    batch_size=max(t.micro_batch_size, 32), seed=cfg.seed + step,
                )  # fmt: skip
            else:
                results = evaluate_policy(
                    whole, models.reference, tokenizer, eval_prompts, reward_fn,
                    max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
                    batch_size=max(t.micro_batch_size, 32), seed=cfg.seed + step, log_rows=rows,
                )  # fmt: skip
        rollout_log.write_eval([(step, *row) for row in rows])
        return results

    def collect() -> tuple[Any, dict[str, float]]:
        """The step's experience: sampled here now, or taken from the generator process."""
        if generator is None:  # each process its own prompts' rollouts, its models gathered
            with engine.gathered_all(*models.held, *models.rewards) as (whole, _, whole_value, *_):
                return collect_experience(
                    step=step, policy=whole, reference=models.reference, tokenizer=tokenizer,
                    prompts=train_prompts, sampler=book.sampler, rank=rank, world=world,
                    prompts_per_step=ro.prompts_per_step, cfg=cfg, reward_fn=reward_fn,
                    estimator=estimator, value_model=whole_value, environment=environment,
                ), {}  # fmt: skip
        t_wait = time.perf_counter()
        sampled = generator.take(step)
        waited = time.perf_counter() - t_wait
        book.sampler.load_state_dict(sampled.sampler)  # the data position after this batch
        collected = digest_step(
            sampled, policy=models.policy, reference=models.reference, prompts=train_prompts,
            world=1, cfg=cfg, estimator=estimator, value_model=models.value,
        )  # fmt: skip
        return collected, {"time/wait_rollouts_s": waited,
                           "sampling/policy_lag": step - sampled.version}  # fmt: skip

    def loop_state() -> dict[str, Any]:  # the generator's queue, in every checkpoint
        return {"rollout_queue": generator.state(step)} if generator is not None else {}

    # --- the loop
    with StopSignal() as stop, closing_generator(generator):
        while step < t.max_steps:
            collected, async_metrics = collect()
            # every rank's rollouts, written by rank 0 alone, and their metrics together
            rollout_log.write(gather_collected(collected, world))
            if environment is not None:  # every episode's turns, every process's
                rollout_log.write_turns(gather_rows(collected.turn_rows, world))
            for experience in collected.experiences:
                buffer.add(experience)
            t_train, sums, mismatch = time.perf_counter(), {}, MismatchStats()
            for epoch in range(alg.ppo_epochs):
                groups = optimizer_groups(
                    buffer, cfg, step=step, epoch=epoch, accelerator=accelerator,
                    filler=collected.filler,
                )  # fmt: skip
                for group, weight in groups:
                    step_loss, grad_norm, metrics = policy_update(
                        engine, group, weight, policy=policy, value=value, loss_fn=loss_fn,
                        value_loss_fn=value_loss_fn, cfg=cfg, skips=book.skips,
                        correction=correction, mismatch=mismatch if epoch == 0 else None,
                    )  # fmt: skip
                    for key, v in metrics.items():  # this process's share, summed over updates
                        sums[key] = sums.get(key, 0.0) + v
            buffer.clear()
            step += 1
            if generator is not None:  # the weights of version `step`, for the batches needing them
                generator.publish(step, engine.unwrap(policy[0]))

            # the loss components are each process's share of the step's average: log_step sums
            book.log_step(step, step_loss, grad_norm, {
                **collected.metrics, **{f"loss/{k}": v.float() for k, v in sorted(sums.items())},
                **mismatch.metrics(gather_object if world > 1 else None),  # sampler vs trainer
                "time/train_s": time.perf_counter() - t_train, **async_metrics,
            })  # fmt: skip
            if book.evaluate(step, run_eval):  # every train.eval_every steps
                break  # early stop: the final evaluation and final/ follow
            if book.save_due(step) or stop.requested:  # a resume keeps the rollout rows up to
                rollout_log.flush(step)  # its checkpoint's step: on disk before the checkpoint is
            if (exit_code := book.checkpoint(step, stop, loop_state)) is not None:
                rollout_log.close()
                return exit_code  # stopped by a signal, checkpoint saved

    # --- final evaluation, final/ and summary
    final_eval = run_eval()
    rollout_log.close()
    first = [r for r in book.tracker.history if "train/reward/total" in r]
    book.finish(step, final_eval, {
        "algorithm": alg.name, "train_prompts": len(train_prompts.items),
        "first_train_reward": first[0]["train/reward/total"] if first else None,
        "last_train_reward": first[-1]["train/reward/total"] if first else None,
    }, engine_facts)  # fmt: skip
    if accelerator.is_main_process:  # a learned and a verifier reward: proxy vs gold (Gao 2022)
        write_overoptimization(run_dir, cfg.rewards)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg, run = parse_run_args(
        argv, PGConfig, prog=f"python -m {PACKAGE}.train", description="Policy-gradient RL"
    )
    return train(cfg, run)


if __name__ == "__main__":
    sys.exit(run_main(main))
