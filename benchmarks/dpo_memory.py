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

    uv run --group bench python -m benchmarks.dpo_memory --model real --steps 4 \
        [--micro-batch-size 2] [--threads 1]

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
    median,
    peak_rss_mb,
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


def summarize(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Per phase (in step order): median peak and end RSS over the steps after the first."""
    later = [r for r in out["records"] if r["step"] >= 1 and r["phase"] != "end"]
    names = list(dict.fromkeys(r["phase"] for r in later))
    rows = []
    for name in names:
        mine = [r for r in later if r["phase"] == name]
        peak, end = median([r["peak_mb"] for r in mine]), median([r["rss_end_mb"] for r in mine])
        rows.append({"phase": name, "peak_mb": peak, "rss_end_mb": end,
                     "peak_above_loop_start_mb": peak - out["before_loop_mb"]})  # fmt: skip
    return rows


def markdown(result: dict[str, Any]) -> str:
    w, out = result["workload"], result["profile"]
    micro = w["micro_batch_size"] or w["batch_size"]
    lines = [
        f"### DPO peak memory by phase (ours, model `{w['model']}`)",
        "",
        f"Batch {w['batch_size']} pairs in micro-batches of {micro}, {w['steps']} steps "
        f"(medians over steps 2..{w['steps']}), fp32, {w['threads']} torch threads. RSS after "
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
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    w = Workload(model=args.model, steps=args.steps, batch_size=args.batch_size,
                 micro_batch_size=args.micro_batch_size, threads=args.threads)  # fmt: skip
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
