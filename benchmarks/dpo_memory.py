"""Where our DPO step's peak resident memory is, phase by phase, on the `benchmarks.dpo` workload.

Runs our trainer (`direct_alignment.train`, as `benchmarks.dpo` configures it) in this process
and closes a phase at each call the step makes: the policy forward (`pair_logps`), the
reference forward (`reference_pair_logps`, the policy's graph still held), the loss and
backward (until the next forward or the optimizer step), the optimizer step, and what runs
between steps (logging, the next step's collation). Each phase's peak is the kernel's
high-water mark of this process (VmHWM, restarted at every phase boundary through
/proc/self/clear_refs), so nothing is sampled or missed. Reported per phase: the median over
the steps after the first (the optimizer's state exists from then on) of the peak and of the RSS
at the phase's end, in MiB, and both above the RSS before the first step (model, reference,
imports). With `--micro-batch-size` the step's pairs run in micro-batches (one phase row per
micro-batch position).

`--attribute-step K` instead runs step K (0-based; K >= 1 so AdamW's state exists) under
`torch.profiler` with memory profiling and says what the step's largest live tensor memory is
made of: the profiler's categories (parameters, optimizer state, gradients, saved activations,
autograd's own buffers, temporaries) at the moment their sum peaks, the operators that created
the live tensors, and the step's peak RSS beside it; the difference is memory no tensor
accounts for (imports, Python objects, BLAS buffers, heap the allocator holds but cannot reuse).
It reads `torch.profiler._memory_profiler`, torch's memory-timeline machinery (private API).

    uv run --group bench python -m benchmarks.dpo_memory --model real --steps 4 \
        [--micro-batch-size 2] [--threads 1] [--attribute-step 2]

Writes `benchmarks/results/<stamp>-dpo-memory.{json,md}`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.measure import (
    machine,
    peak_rss_mb,
    phase_medians,
    reset_peak_rss,
    rss_mb,
    timestamp,
    write_results,
)
from benchmarks.workload import MODEL_CHOICES, Workload, prepare


def profile(w: Workload, workdir: Path) -> dict[str, Any]:
    """Run the workload's steps with phase boundaries; returns the phase records."""
    import direct_alignment.train as da_train
    from benchmarks.dpo import our_config
    from benchmarks.workload import run_our_trainer

    after_imports = rss_mb()
    records: list[dict[str, Any]] = []
    state: dict[str, Any] = {"step": 0, "phase": "setup", "micro": 0, "before_loop": None}

    def close(next_phase: str) -> None:
        records.append({
            "step": state["step"], "phase": state["phase"], "peak_mb": peak_rss_mb(),
            "rss_end_mb": rss_mb(),
        })  # fmt: skip
        reset_peak_rss()
        state["phase"] = next_phase

    original_logps = da_train.pair_logps
    original_reference = da_train.reference_pair_logps
    original_step = da_train.optimizer_step

    def policy_forward(model, batch):
        if state["before_loop"] is None:
            state["before_loop"] = rss_mb()
        close(f"policy forward {state['micro']}")
        out = original_logps(model, batch)
        close(f"(between forwards) {state['micro']}")
        return out

    def reference_forward(model, batch):
        close(f"reference forward {state['micro']}")
        out = original_reference(model, batch)
        close(f"loss + backward {state['micro']}")
        state["micro"] += 1
        return out

    def optimizer_step(*args, **kwargs):
        close("optimizer step")
        out = original_step(*args, **kwargs)
        close("between steps (logging, collation)")
        state["step"] += 1
        state["micro"] = 0
        return out

    da_train.pair_logps = policy_forward
    da_train.reference_pair_logps = reference_forward
    da_train.optimizer_step = optimizer_step
    reset_peak_rss()
    run_our_trainer(da_train, our_config(w, workdir), workdir, "benchmarks/dpo_memory.py")
    close("end")
    return {"after_imports_mb": after_imports, "before_loop_mb": state["before_loop"],
            "records": records}  # fmt: skip


def attribute(w: Workload, workdir: Path, step: int) -> dict[str, Any]:
    """Run the workload with step `step` under the memory profiler; the live tensor memory at
    its peak by category and by creating operator, and the step's peak RSS."""
    from collections import Counter

    import torch
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Action, MemoryProfileTimeline

    import direct_alignment.train as da_train
    from benchmarks.dpo import our_config
    from benchmarks.workload import run_our_trainer

    after_imports = rss_mb()
    state: dict[str, Any] = {"calls": 0}
    original_accumulate, original_step = da_train.accumulate_gradients, da_train.optimizer_step

    def accumulate(*args, **kwargs):
        if state["calls"] == step:
            state["rss_before_mb"] = rss_mb()
            reset_peak_rss()
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                record_shapes=True, with_stack=True,
            )  # fmt: skip
            prof.__enter__()
            state["prof"] = prof
        state["calls"] += 1
        return original_accumulate(*args, **kwargs)

    def optimizer_step(*args, **kwargs):
        out = original_step(*args, **kwargs)
        if "prof" in state and "peak_rss_mb" not in state:
            state["prof"].__exit__(None, None, None)
            state["peak_rss_mb"] = peak_rss_mb()
        return out

    da_train.accumulate_gradients, da_train.optimizer_step = accumulate, optimizer_step
    run_our_trainer(da_train, our_config(w, workdir), workdir, "benchmarks/dpo_memory.py")
    if "prof" not in state:
        raise SystemExit(f"--attribute-step {step}: the run has only {state['calls']} steps")
    profile = state["prof"]._memory_profile()
    categories = ["unknown" if c is None else c.name.lower() for c in _CATEGORY_TO_INDEX]
    times, sizes = MemoryProfileTimeline(profile)._coalesce_timeline("cpu")
    totals = [sum(row) for row in sizes]
    at = max(range(len(totals)), key=totals.__getitem__)
    by_category = {name: sizes[at][i + 1] / 2**20 for i, name in enumerate(categories)}
    creator: dict[Any, str] = {}  # tensor -> the operator that allocated it
    for node in profile._data_flow_graph.flow_nodes:
        for key in [*node.outputs, *node.intermediates]:
            creator.setdefault(key, node._event.name)
    live: dict[Any, tuple[int, int]] = {}
    peak_ns = times[at] * 1000  # the timeline is in us, the events in ns
    for t, action, (key, version), size in profile.timeline:
        if t > peak_ns:
            break
        if key.device.type != "cpu":
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            live[key] = (size, version)
        elif action == Action.DESTROY:
            live.pop(key, None)
    by_op: Counter = Counter()
    for key, (size, version) in live.items():
        category = profile._categories.get(key, version)
        name = "unknown" if category is None else category.name.lower()
        by_op[(name, creator.get(key, "(before the step)"))] += size
    tensors_mb = totals[at] / 2**20
    return {
        "step": step, "after_imports_mb": after_imports,
        "rss_before_step_mb": state["rss_before_mb"], "step_peak_rss_mb": state["peak_rss_mb"],
        "tensor_peak_mb": tensors_mb, "tensor_peak_by_category_mb": by_category,
        "live_at_tensor_peak_by_op_mb": [
            {"category": c, "op": op, "mb": b / 2**20} for (c, op), b in by_op.most_common(16)
        ],
    }  # fmt: skip


def attribution_markdown(w: dict[str, Any], a: dict[str, Any]) -> str:
    micro = w["micro_batch_size"] or w["batch_size"]
    lines = [
        f"### What our DPO step's memory peak is made of (model `{w['model']}`, step {a['step']})",
        "",
        f"Batch {w['batch_size']} pairs in micro-batches of {micro}, {w.get('dtype', 'fp32')}, "
        f"{w['threads']} torch "
        f"threads, under `torch.profiler` (profile_memory). Live tensor memory peaks at "
        f"{a['tensor_peak_mb']:.0f} MiB. RSS here (after imports {a['after_imports_mb']:.0f} MiB, "
        f"before the step {a['rss_before_step_mb']:.0f}, the step's peak "
        f"{a['step_peak_rss_mb']:.0f}) includes the profiler's own records: compare the tensor "
        f"figures with the peak RSS of a run without `--attribute-step` (the phase table); the "
        f"difference is memory no tensor holds (imports, Python objects, BLAS buffers, heap the "
        f"allocator keeps).",
        "",
        "| live tensors at the peak, by category | MiB |",
        "| --- | ---: |",
    ]
    for name, mb in sorted(a["tensor_peak_by_category_mb"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {mb:.1f} |")
    lines += ["", "| category | created by | MiB |", "| --- | --- | ---: |"]
    for row in a["live_at_tensor_peak_by_op_mb"]:
        if row["mb"] >= 0.5:
            lines.append(f"| {row['category']} | `{row['op']}` | {row['mb']:.1f} |")
    return "\n".join([*lines, ""])


def summarize(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Per phase (in step order): median peak and end RSS over the steps after the first."""
    return phase_medians(out["records"], out["before_loop_mb"])


def markdown(result: dict[str, Any]) -> str:
    w, out = result["workload"], result["profile"]
    micro = w["micro_batch_size"] or w["batch_size"]
    lines = [
        f"### DPO peak memory by phase (ours, model `{w['model']}`)",
        "",
        f"Batch {w['batch_size']} pairs in micro-batches of {micro}, {w['steps']} steps "
        f"(medians over steps 2..{w['steps']}), {w.get('dtype', 'fp32')}, {w['threads']} torch "
        f"threads. RSS after "
        f"imports {out['after_imports_mb']:.0f} MiB; before the first step (policy, reference, "
        f"data) {out['before_loop_mb']:.0f} MiB.",
        "",
        "| phase | peak RSS MiB | above loop start | RSS at its end MiB |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in result["phases"]:
        lines.append(
            f"| {row['phase']} | {row['peak_mb']:.0f} | {row['peak_above_loop_start_mb']:+.0f} "
            f"| {row['rss_end_mb']:.0f} |"
        )
    overall = max(r["peak_mb"] for r in out["records"])
    lines += ["", f"Peak of the whole run: {overall:.0f} MiB.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dpo_memory", description=__doc__)
    parser.add_argument("--model", choices=MODEL_CHOICES, default="real")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--attribute-step", type=int, default=None)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    if args.attribute_step is not None and not 1 <= args.attribute_step < args.steps:
        parser.error(f"--attribute-step must be in 1..{args.steps - 1} (AdamW's state exists "
                     f"from the second step on), got {args.attribute_step}")  # fmt: skip
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    w = Workload(model=args.model, steps=args.steps, batch_size=args.batch_size,
                 micro_batch_size=args.micro_batch_size, threads=args.threads,
                 dtype=args.dtype)  # fmt: skip
    if args.attribute_step is not None:
        with tempfile.TemporaryDirectory() as tmp:
            prepare(w, Path(tmp))
            a = attribute(w, Path(tmp), args.attribute_step)
        result = {"workload": w.__dict__, "machine": machine(), "attribution": a}
        text = attribution_markdown(w.__dict__, a)
        print(text)
        json_path, _ = write_results(f"{timestamp()}-dpo-memory-attribution", result, text,
                                     latest=False)  # fmt: skip
        print(f"wrote {json_path}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        prepare(w, Path(tmp))
        out = profile(w, Path(tmp))
    result = {"workload": w.__dict__, "machine": machine(), "profile": out,
              "phases": summarize(out)}  # fmt: skip
    text = markdown(result)
    print(text)
    json_path, _ = write_results(f"{timestamp()}-dpo-memory", result, text, latest=False)
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
