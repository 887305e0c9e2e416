"""Where our GRPO step's peak resident memory is, phase by phase, on the `benchmarks.grpo` workload.

Runs our trainer (`policy_gradients.train`, with the very config `benchmarks.grpo.run_ours`
builds: it is captured from that function, not copied) in this process and closes a phase at
each part of the step: generation (`generate_rollouts`), reward scoring (`CombinedReward`), the
experience (old/reference log-probs where the config needs them, none on-policy without KL, and
the advantages), the rollout bookkeeping up to the first training forward, then per micro-batch
the training forward (`completion_logprobs` in `train.py`), the loss, the backward
(`Accelerator.backward`) and what follows it, then the optimizer step and what runs between
steps (logging). Each phase's peak is the kernel's high-water mark of this process (VmHWM,
restarted at every phase boundary through /proc/self/clear_refs), so nothing is sampled or
missed. Reported per phase: the median over the steps after the first (the optimizer's state
exists from then on) of the peak and of the RSS at the phase's end, in MiB, and the peak above
the RSS before the first step (model, tokenizer, prompts, imports).

Also reported: per training micro-batch, the bytes the autograd graph saves for the backward
(`torch.autograd.graph.saved_tensors_hooks` around the training forward; parameters left out,
tensors deduplicated by their storage, each storage counted whole), the positions the model ran
on (the elements of its embedding lookups: the group's shared prompt once plus every
completion, padding included) and the bytes per position; and the persistent state: parameters,
gradients (at the optimizer step) and AdamW's state (after the first step), in MiB.

    uv run --group bench python -m benchmarks.grpo_memory --model real --steps 3 \
        [--micro-batch 32] [--threads 2] [--malloc-trim]

`--malloc-trim` hands glibc's free heap back at every boundary and records the RSS after it, so
the live memory and the retained heap can be told apart (the trims change the later peaks).

Writes `benchmarks/results/<stamp>-grpo-memory.{json,md}`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.measure import (
    machine,
    malloc_trim,
    median,
    peak_rss_mb,
    phase_medians,
    reset_peak_rss,
    rss_mb,
    timestamp,
    worker_env,
    write_results,
)
from benchmarks.workload import MODEL_CHOICES

MIB = 2**20


class _Captured(Exception):
    """Raised out of `benchmarks.grpo.run_ours` once it has built its config."""


def our_config(w: Any, workdir: Path) -> Any:
    """The `PGConfig` that `benchmarks.grpo.run_ours` runs `w` with: `run_ours` is called with
    its trainer runner replaced by one that keeps the config and stops; the wrappers `run_ours`
    installs on `policy_gradients.train` (its step clock, its token count) are taken off."""
    import benchmarks.grpo as grpo
    import policy_gradients.train as pg_train

    names = ("completion_logprobs", "optimizer_step")
    saved = {name: getattr(pg_train, name) for name in names}
    runner = grpo.run_our_trainer
    captured: dict[str, Any] = {}

    def capture(trainer, cfg, workdir, config_path):
        captured["cfg"] = cfg
        raise _Captured

    grpo.run_our_trainer = capture
    try:
        grpo.run_ours(w, workdir)
    except _Captured:
        pass
    finally:
        grpo.run_our_trainer = runner
        for name, value in saved.items():
            setattr(pg_train, name, value)
    return captured["cfg"]


def _storage_key(t: Any) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _tensor_bytes(tensors: list[Any]) -> int:
    """Bytes of `tensors`' storages, each storage once."""
    return sum(dict(_storage_key(t) for t in tensors if t is not None).values())


def profile(w: Any, workdir: Path, trim: bool = False) -> dict[str, Any]:
    """Run the workload's steps with phase boundaries; returns the phase records. `trim`:
    `malloc_trim` at every boundary (after the phase's peak and end RSS are read), recorded as
    `rss_trimmed_mb`: the RSS without glibc's retained free heap, near the live memory."""
    import accelerate
    import torch

    import policy_gradients.collect as pg_collect
    import policy_gradients.rewards as pg_rewards
    import policy_gradients.train as pg_train
    from benchmarks.workload import run_our_trainer

    cfg = our_config(w, workdir)
    after_imports = rss_mb()
    records: list[dict[str, Any]] = []
    forwards: list[dict[str, Any]] = []  # one per training forward
    extra_forwards: list[dict[str, Any]] = []  # old / reference log-prob forwards, if any
    state: dict[str, Any] = {"step": 0, "phase": "setup", "micro": 0, "before_loop": None}
    persistent: dict[str, float] = {}

    def close(next_phase: str) -> None:
        records.append({
            "step": state["step"], "phase": state["phase"], "peak_mb": peak_rss_mb(),
            "rss_end_mb": rss_mb(),
        })  # fmt: skip
        if trim and malloc_trim():
            records[-1]["rss_trimmed_mb"] = rss_mb()
        reset_peak_rss()
        state["phase"] = next_phase

    original = {
        "generate": pg_collect.generate_rollouts,
        "experience": pg_collect.experience_of,
        "collect_logprobs": pg_collect.completion_logprobs,
        "reward": pg_rewards.CombinedReward.__call__,
        "train_logprobs": pg_train.completion_logprobs,
        "step": pg_train.optimizer_step,
        "backward": accelerate.Accelerator.backward,
    }

    def generate(*args, **kwargs):
        if state["before_loop"] is None:
            state["before_loop"] = rss_mb()
        close("generation (rollouts)")
        out = original["generate"](*args, **kwargs)
        close("reward inputs + scoring")
        return out

    def reward(self, batch):
        out = original["reward"](self, batch)
        close("experience (old/ref log-probs, advantages)")
        return out

    def experience(*args, **kwargs):
        out = original["experience"](*args, **kwargs)
        close("rollout bookkeeping (log rows, buffer)")
        return out

    def collect_logprobs(model, *args, **kwargs):  # old / reference forwards (no grad)
        extra_forwards.append({"step": state["step"]})
        return original["collect_logprobs"](model, *args, **kwargs)

    def train_logprobs(model, ids, attention_mask, *args, **kwargs):
        i = state["micro"]
        close(f"training forward {i}")
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}
        positions = [0]

        def pack(t):
            key, size = _storage_key(t)
            if key not in params:
                saved[key] = max(size, saved.get(key, 0))
            return t

        def count(module, inputs):
            positions[0] += inputs[0].numel()

        hooks = [m.register_forward_pre_hook(count) for m in model.modules()
                 if isinstance(m, torch.nn.Embedding)]  # fmt: skip
        start = rss_mb()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = original["train_logprobs"](model, ids, attention_mask, *args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        forwards.append({
            "step": state["step"], "micro": i, "rows": int(ids.shape[0]),
            "width": int(ids.shape[1]), "non_pad_tokens": int(attention_mask.sum()),
            "positions": positions[0], "saved_mb": sum(saved.values()) / MIB,
            "saved_tensors": len(saved), "rss_growth_mb": rss_mb() - start,
        })  # fmt: skip
        close(f"loss {i}")
        return out

    def backward(self, loss, **kwargs):
        i = state["micro"]
        close(f"backward {i}")
        out = original["backward"](self, loss, **kwargs)
        close(f"(after backward: metrics) {i}")
        state["micro"] += 1
        return out

    def optimizer_step(accelerator, model, optimizer, *args, **kwargs):
        close("optimizer step")
        if not persistent:
            params = list(model.parameters())
            persistent["parameters_mb"] = _tensor_bytes(params) / MIB
            persistent["gradients_mb"] = _tensor_bytes([p.grad for p in params]) / MIB
        out = original["step"](accelerator, model, optimizer, *args, **kwargs)
        if "adamw_state_mb" not in persistent:
            tensors = [v for s in optimizer.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor)]  # fmt: skip
            persistent["adamw_state_mb"] = _tensor_bytes(tensors) / MIB
            persistent["optimizer"] = type(getattr(optimizer, "optimizer", optimizer)).__name__
        close("between steps (logging)")
        state["step"] += 1
        state["micro"] = 0
        return out

    pg_collect.generate_rollouts = generate
    pg_collect.experience_of = experience
    pg_collect.completion_logprobs = collect_logprobs
    pg_rewards.CombinedReward.__call__ = reward
    pg_train.completion_logprobs = train_logprobs
    pg_train.optimizer_step = optimizer_step
    accelerate.Accelerator.backward = backward
    try:
        reset_peak_rss()
        run_our_trainer(pg_train, cfg, workdir, "benchmarks/grpo_memory.py")
        close("end")
    finally:
        pg_collect.generate_rollouts = original["generate"]
        pg_collect.experience_of = original["experience"]
        pg_collect.completion_logprobs = original["collect_logprobs"]
        pg_rewards.CombinedReward.__call__ = original["reward"]
        pg_train.completion_logprobs = original["train_logprobs"]
        pg_train.optimizer_step = original["step"]
        accelerate.Accelerator.backward = original["backward"]
    return {
        "after_imports_mb": after_imports, "before_loop_mb": state["before_loop"],
        "records": records, "training_forwards": forwards,
        "old_or_reference_forwards": len(extra_forwards), "persistent_mb": persistent,
    }  # fmt: skip


def summarize(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Per phase (in step order): median peak and end RSS over the steps after the first."""
    return phase_medians(out["records"], out["before_loop_mb"])


def summarize_forwards(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Per micro-batch position: medians over the steps after the first."""
    later = [f for f in out["training_forwards"] if f["step"] >= 1] or out["training_forwards"]
    rows = []
    for i in sorted({f["micro"] for f in later}):
        mine = [f for f in later if f["micro"] == i]
        keys = ("rows", "width", "non_pad_tokens", "positions", "saved_mb", "rss_growth_mb")
        row = {k: median([f[k] for f in mine]) for k in keys}
        row["micro"] = i
        row["saved_kib_per_position"] = row["saved_mb"] * 1024 / max(row["positions"], 1)
        rows.append(row)
    return rows


def markdown(result: dict[str, Any]) -> str:
    w, out = result["workload"], result["profile"]
    batch = w["prompts_per_step"] * w["group_size"]
    micro = w["micro_batch"] or batch
    trimmed = all("rss_trimmed_mb" in row for row in result["phases"])
    lines = [
        f"### GRPO peak memory by phase (ours, model `{w['model']}`)",
        "",
        f"{w['prompts_per_step']} prompts x {w['group_size']} completions = {batch} rows per "
        f"step in micro-batches of {micro}, {w['max_new_tokens']} max new tokens, {w['steps']} "
        f"steps (medians over steps 2..{w['steps']}), fp32, {w['threads']} torch threads. RSS "
        f"after imports {out['after_imports_mb']:.0f} MiB; before the first step (policy, "
        f"tokenizer, prompts) {out['before_loop_mb']:.0f} MiB. Old/reference log-prob forwards "
        f"in the run: {out['old_or_reference_forwards']}."
        + (" `malloc_trim` at every phase boundary (after its peak and end RSS are read); "
           "'trimmed': the RSS after it, near the live memory." if trimmed else ""),
        "",
        "| phase | peak RSS MiB | above loop start | RSS at its end MiB |"
        + (" trimmed MiB |" if trimmed else ""),
        "| --- | ---: | ---: | ---: |" + (" ---: |" if trimmed else ""),
    ]  # fmt: skip
    for row in result["phases"]:
        lines.append(
            f"| {row['phase']} | {row['peak_mb']:.0f} | {row['peak_above_loop_start_mb']:+.0f} "
            f"| {row['rss_end_mb']:.0f} |" + (f" {row['rss_trimmed_mb']:.0f} |" if trimmed else "")
        )
    overall = max(r["peak_mb"] for r in out["records"])
    lines += [
        "",
        f"Peak of the whole run: {overall:.0f} MiB.",
        "",
        "Training forwards (saved activations: what autograd keeps for the backward, parameters "
        "left out, each storage once; positions: the embedding lookups, i.e. each distinct "
        "prompt once plus every completion position, padding included):",
        "",
        "| micro-batch | rows | width | non-pad tokens | positions | saved MiB | KiB/position "
        "| RSS growth over the forward MiB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for f in result["forwards"]:
        lines.append(
            f"| {f['micro']} | {f['rows']:.0f} | {f['width']:.0f} | {f['non_pad_tokens']:.0f} "
            f"| {f['positions']:.0f} | {f['saved_mb']:.0f} | {f['saved_kib_per_position']:.1f} "
            f"| {f['rss_growth_mb']:.0f} |"
        )
    p = out["persistent_mb"]
    lines += [
        "",
        f"Persistent state: parameters {p['parameters_mb']:.0f} MiB, gradients "
        f"{p['gradients_mb']:.0f} MiB, {p['optimizer']} state {p['adamw_state_mb']:.0f} MiB.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo_memory", description=__doc__)
    parser.add_argument("--model", choices=MODEL_CHOICES, default="real")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--malloc-trim", action="store_true",
        help="malloc_trim at every phase boundary: the RSS without glibc's retained free heap",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for key, value in worker_env(args.threads).items():  # as benchmarks.grpo's worker processes
        os.environ.setdefault(key, value)
    from benchmarks.grpo import Workload

    w = Workload(model=args.model, steps=args.steps, threads=args.threads,
                 micro_batch=args.micro_batch)  # fmt: skip
    if w.micro_batch < 0 or (w.micro_batch and w.batch % w.micro_batch):
        parser.error(f"--micro-batch {w.micro_batch} must divide the batch of {w.batch} rows")
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-grpo-memory-") as tmp:
        out = profile(w, Path(tmp), trim=args.malloc_trim)
    result = {
        "workload": w.__dict__, "malloc_trim": args.malloc_trim, "machine": machine(),
        "profile": out, "phases": summarize(out), "forwards": summarize_forwards(out),
    }  # fmt: skip
    text = markdown(result)
    print(text)
    json_path, _ = write_results(f"{timestamp()}-grpo-memory", result, text, latest=False)
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
