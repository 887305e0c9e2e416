"""Asynchronous rollouts (`rollout.max_staleness: k`): a generator process samples ahead while
the trainer trains.

    step s's batch is sampled with the weights of version max(0, s - k)

(version v = the weights after v training steps). While the trainer trains step t, the
generator samples the batches of steps t+1 .. t+k, the last one with the weights the trainer
started step t from, so no batch waits for the step before it. The schedule is fixed, not "as
fresh as the generator happens to find": a run's numbers do not depend on timing, a resume
redoes exactly what the killed run would have done, and k = 0 is the synchronous loop.

    trainer    train 0 | publish v1 | train 1 | publish v2 | train 2 ...
    generator  (k = 1) sample 1 with v0 | sample 2 with v1 | sample 3 with v2 ...

The generator (`_generator_main`, a spawned process, one per run) owns its own copy of the
policy, the tokenizer, the training prompts, the reward components and the prompt sampler; it
runs `collect.sample_step` (draw prompts, generate with the behaviour log-probs, score; dynamic
sampling's rounds too) and sends each step's `SampledStep`, serialised as plain tensors, to the
trainer. The trainer runs `collect.digest_step` on it with its current weights (pi_old, the
reference, PPO's values, advantages) and trains as before. Weights flow back through
`rlhf_core.weight_sync.WeightChannel` (shared memory, k + 1 slots: the trainer writes version
t + 1 over version t - k only once batch t, the last that needed it, was sampled).

A checkpoint at step t holds the queue: the batches of steps t .. t+k-1, sampled with weights
older than the checkpoint's, which a resume could not sample again; each batch carries the
prompt sampler's state after it, so the generator resumes drawing where the last queued batch
ended. The samples themselves are seeded by (run seed, step, round, place in the batch)
(`collect.sample_seed`), so the sampler's position is the generator's whole random state.

Limits: one trainer process (`train.engine: single`); no multi-turn environments; a learned
reward model is loaded by both processes. With `train.threads` null each process takes half
the free cores.
"""

from __future__ import annotations

import collections
import io
import multiprocessing
import os
import queue
import signal
import traceback
from dataclasses import fields
from typing import Any

import torch

from policy_gradients.collect import SampledRound, SampledStep, sample_step
from policy_gradients.config import PGConfig
from policy_gradients.rollout import Rollouts
from rlhf_core.errors import UserError
from rlhf_core.weight_sync import WeightChannel

POLL_S = 1.0  # how often a waiting process checks that its peer is alive


def plain_step(sampled: SampledStep) -> dict[str, Any]:
    """`sampled` as tensors and plain containers (what a checkpoint may hold: torch.load with
    weights_only), for the queue between the processes and for the checkpoint."""
    rounds = []
    for part in sampled.rounds:
        ro = {f.name: getattr(part.rollouts, f.name) for f in fields(Rollouts)}
        rounds.append({
            "indices": part.indices, "positions": part.positions, "epoch": part.epoch,
            "rollouts": ro, "total": part.total, "parts": part.parts, "keep": part.keep,
        })  # fmt: skip
    return {"step": sampled.step, "version": sampled.version, "rounds": rounds,
            "times": sampled.times, "sampler": sampled.sampler}  # fmt: skip


def step_from_plain(plain: dict[str, Any]) -> SampledStep:
    rounds = [SampledRound(**{**r, "rollouts": Rollouts(**r["rollouts"])}) for r in plain["rounds"]]
    return SampledStep(step=plain["step"], version=plain["version"], rounds=rounds,
                       times=dict(plain["times"]), sampler=plain["sampler"])  # fmt: skip


def to_bytes(plain: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def split_threads(threads: int | None) -> int:
    """Each process's torch threads: `train.threads`, or half the free cores (at least 1)."""
    from rlhf_core.runtime import available_cores

    return threads if threads is not None else max(1, available_cores() // 2)


class GeneratorFailed(RuntimeError):
    """The generator process raised, or died."""


class RolloutGenerator:
    """The trainer's side: starts the generator process, publishes weights, takes batches.

    `start_step`: the first step to train; `queued` (when `resumed`): the checkpoint's queue,
    plain batches of steps start_step .. start_step+k-1, or [] on a fresh start;
    `sampler_state`: the prompt sampler's state after step start_step - 1 (the trainer's,
    `Bookkeeping.sampler`)."""

    def __init__(
        self, cfg: PGConfig, policy: torch.nn.Module, *, start_step: int,
        sampler_state: dict[str, int], queued: list[dict[str, Any]], threads: int,
        device: torch.device, resumed: bool,
    ) -> None:  # fmt: skip
        self.k, self.max_steps = cfg.rollout.max_staleness, cfg.train.max_steps
        if [q["step"] for q in queued] != list(range(start_step, start_step + len(queued))):
            raise UserError(
                f"resume: the checkpoint's rollout queue holds steps {[q['step'] for q in queued]}"
                f", expected {start_step} .. {start_step + self.k - 1} (rollout.max_staleness "
                f"{self.k}); resume with the max_staleness the run was saved with"
            )
        if resumed and len(queued) != self.ahead(start_step):
            raise UserError(
                f"resume: the checkpoint queued {len(queued)} batches but rollout.max_staleness is "
                f"{self.k}; resume with the max_staleness the run was saved with"
            )
        self.ready: collections.deque[dict[str, Any]] = collections.deque(queued)
        self.channel = WeightChannel(policy, slots=self.k + 1)
        ctx = multiprocessing.get_context("spawn")
        self.versions, self.results = ctx.Queue(), ctx.Queue()
        self.publish(start_step, policy)
        first = start_step + len(queued)
        sampler = queued[-1]["sampler"] if queued else sampler_state
        self.process = ctx.Process(
            target=_generator_main, name="rollout-generator", daemon=True,
            args=(cfg, self.channel, self.versions, self.results, first, sampler, threads,
                  str(device)),
        )  # fmt: skip
        self.process.start()
        print(f"rollout generator: process {self.process.pid}, max_staleness {self.k}, "
              f"weights {self.channel.bytes / 2**20:.1f} MiB x {self.k + 1} slots in shared "
              f"memory, {threads} threads each", flush=True)  # fmt: skip

    def publish(self, version: int, policy: torch.nn.Module) -> None:
        """The weights after `version` training steps, for the batches that need them."""
        self.channel.publish(version, policy)
        self.versions.put(version)

    def _receive(self) -> dict[str, Any]:
        while True:
            try:
                item = self.results.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise GeneratorFailed(
                        f"the rollout generator process exited (code {self.process.exitcode}) "
                        "without sending its batch"
                    ) from None
                continue
            if isinstance(item, str):  # the generator's error, with its traceback
                raise GeneratorFailed(f"the rollout generator failed:\n{item}")
            return from_bytes(item)

    def take(self, step: int) -> SampledStep:
        """The batch of `step` (waits for it)."""
        plain = self.ready.popleft() if self.ready else self._receive()
        if plain["step"] != step:
            raise GeneratorFailed(f"expected the batch of step {step}, got step {plain['step']}")
        return step_from_plain(plain)

    def ahead(self, step: int) -> int:
        """How many batches checkpoint-`step` queues: steps step .. step+k-1, up to the last."""
        return max(0, min(self.k, self.max_steps - step))

    def state(self, step: int) -> list[dict[str, Any]]:
        """For checkpoint-`step`, after `publish(step)`: the batches of steps step .. step+k-1
        (waits until they are sampled; their weights are older than the checkpoint's)."""
        while len(self.ready) < self.ahead(step):
            self.ready.append(self._receive())
        return list(self.ready)[: self.ahead(step)]

    def close(self) -> None:
        """Stop the generator (it may be sampling a batch no step will take)."""
        if self.process.is_alive():
            self.versions.put(None)
            self.process.join(timeout=5 * POLL_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        for q in (self.versions, self.results):
            q.cancel_join_thread()
            q.close()


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is not None and parent.is_alive()


def _generator_main(
    cfg: PGConfig, channel: WeightChannel, versions: Any, results: Any, first: int,
    sampler_state: dict[str, int], threads: int, device: str,
) -> None:  # fmt: skip
    """The generator process: sample steps first, first + 1, ... (see the module docstring).
    Exits when told (None), when the trainer is gone, or after the last step's batch."""
    # a stop signal (Ctrl-C reaches the whole process group) is the trainer's to handle: it
    # checkpoints, which needs this process's queue, then stops it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _generate(cfg, channel, versions, results, first, sampler_state, threads, device)
    except BaseException:  # noqa: BLE001 - the trainer raises it
        results.put(traceback.format_exc())
    results.close()
    results.join_thread()


def _generate(
    cfg: PGConfig, channel: WeightChannel, versions: Any, results: Any, first: int,
    sampler_state: dict[str, int], threads: int, device: str,
) -> None:  # fmt: skip
    from policy_gradients.rewards import CombinedReward
    from policy_gradients.rollout import load_prompts
    from rlhf_core.data import EpochSampler
    from rlhf_core.fastpath import announce_plan, start_speed
    from rlhf_core.models import load_policy, load_tokenizer
    from rlhf_core.runtime import configure_threads, quiet_libraries, seed_everything
    from rlhf_core.user_modules import import_modules

    quiet_libraries()
    configure_threads(threads)
    import_modules(list(cfg.imports or []))
    t = cfg.train
    start_speed(t.speed, torch.device(device).type, "single", t.fsdp.cpu_mmap_threshold_mib)
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.model, padding_side="left")
    prompts = load_prompts(cfg.data.train, tokenizer, where="data.train", **cfg.prompt_args())
    reward_fn = CombinedReward(cfg.rewards, strip_thinking=cfg.strip_thinking)
    for component, model in reward_fn.models():
        component.model = model.requires_grad_(False)
    policy = load_policy(cfg.model, device).train()
    announce_plan([policy])  # the trainer's speed plan, applied to this copy of its model
    sampler = EpochSampler(len(prompts.items), cfg.seed)
    sampler.load_state_dict(sampler_state)
    k, latest, loaded = cfg.rollout.max_staleness, -1, None
    for step in range(first, t.max_steps):
        need = max(0, step - k)
        while latest < need:  # wait for the weights of version `need`
            try:
                version = versions.get(timeout=POLL_S)
            except queue.Empty:
                if not _parent_alive():
                    os._exit(0)  # the trainer is gone (killed): nothing left to sample for
                continue
            if version is None:
                return
            latest = version
        if loaded != need:
            channel.load(need, policy)
            loaded = need
        sampled = sample_step(
            step=step, version=need, policy=policy, tokenizer=tokenizer, prompts=prompts,
            sampler=sampler, prompts_per_step=cfg.rollout.prompts_per_step, rank=0, world=1,
            cfg=cfg, reward_fn=reward_fn,
        )  # fmt: skip
        sampled.sampler = sampler.state_dict()
        results.put(to_bytes(plain_step(sampled)))
    while _parent_alive():  # every batch sent; wait to be stopped (the queue's data must stay
        try:  # readable until the trainer has taken it)
            if versions.get(timeout=POLL_S) is None:
                return
        except queue.Empty:
            continue
