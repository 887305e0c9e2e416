"""Does the speed plan choose well on a shape? Our DPO arm (`benchmarks.dpo ours`) as planned
against the same run with one of the plan's CPU decisions switched off (`train.speed`,
`rlhf_core.fastpath.SpeedConfig`), on each `--model` shape, and TRL's DPO arm alongside.

A decision chosen well is one whose switch-off is slower: a ratio plan / switched-off above 1.
A ratio below 1 on some shape means the plan picked the slower path there (the rule was tuned
on another shape). Per shape: `benchmarks.dpo prepare` once, then `--rounds` rounds in which
every arm runs once as a fresh process, each pair of rounds in one order and then reversed
(the next pair rotated); medians, and speed ratios as medians of per-round ratios. Arms:

  plan              the run as shipped (the plan printed at start)
  no_segmented_rows  rows no longer than the longest pair instead of segmented rows
  no_cpu_attention   transformers' SDPA instead of our dispatch (short attention, a call per
                    segment; segmented rows need it, so this also means mask rows)
  no_lean_norms      the RMSNorms' own forward instead of the recomputing backward
  no_fill_micro_batches  `--micro-batch-size` pairs per forward instead of micro-batches merged
                    up to the tokens a padded micro-batch could hold
  plain              all four switched off: transformers' path on mask rows, one forward per
                    micro-batch
  trl                TRL's DPOTrainer on the same workload (`--trl`), for the like-for-like ratio

    RLHF_BENCH_RETAIN_FREED_MEMORY=1 uv run --group bench python -m benchmarks.speed_plan \
        --model real wide --dtype bf16 --threads 2 --rounds 2 --trl

writes benchmarks/results/<time>-speed-plan.{json,md}. `no_allocator` is not an arm: with
`RLHF_BENCH_RETAIN_FREED_MEMORY=1` every process keeps freed memory anyway (like for like).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from typing import Any

from benchmarks.measure import machine, run_worker, timestamp, write_results
from benchmarks.workload import MODEL_CHOICES, Workload

SWITCHES = ("segmented_rows", "cpu_attention", "lean_norms", "fill_micro_batches")


def arm_workload(base: Workload, arm: str) -> Workload:
    if arm in ("plan", "trl"):
        return base
    if arm == "plain":
        return dataclasses.replace(base, speed=dict.fromkeys(SWITCHES, False))
    return dataclasses.replace(base, speed={arm.removeprefix("no_"): False})


def arm_plan(w: Workload) -> str:
    """The decisions the arm's run takes (`rlhf_core.fastpath.plan_speed` on the shape's config,
    no model needed): what the table says each arm ran."""
    import torch
    from transformers import AutoConfig

    from benchmarks.workload import TORCH_DTYPES, model_dir
    from rlhf_core.fastpath import SpeedConfig, plan_speed

    config = AutoConfig.from_pretrained(model_dir(w.model))
    plan = plan_speed(config, device="cpu", dtype=getattr(torch, TORCH_DTYPES[w.dtype]),
                      attention="sdpa", speed=SpeedConfig(**w.speed))  # fmt: skip
    return (f"{plan.layout} rows, {'our' if plan.cpu_attention else 'transformers'} attention"
            f"{f' (short <= {plan.short_attention_keys} keys)' if plan.cpu_attention else ''}, "
            f"{'lean' if plan.lean_norms else 'plain'} norms, micro-batches "
            f"{'filled' if plan.fill_micro_batches else 'as configured'}")  # fmt: skip


def measure_shape(base: Workload, arms: list[str], rounds: int, timeout: float) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-plan-") as tmp:
        common = ["--workdir", tmp]
        run_worker("benchmarks.dpo", ["prepare", "--workload", base.to_json(), *common],
                   threads=base.threads, timeout=timeout)  # fmt: skip
        for r in range(rounds):
            shift = (r // 2) % len(arms)  # rounds in pairs: an order, then the same reversed
            order = arms[shift:] + arms[:shift]
            for arm in order[::-1] if r % 2 else order:
                w = arm_workload(base, arm)
                what = "trl" if arm == "trl" else "ours"
                out = run_worker("benchmarks.dpo", [what, "--workload", w.to_json(), *common],
                                 threads=base.threads, timeout=timeout)  # fmt: skip
                runs.append({"arm": arm, "round": r, **out})
                print(f"  {base.model} round {r + 1}/{rounds} {arm:16s} "
                      f"{out['tokens_per_s']:7.1f} tok/s (load {out['load_average_before']})",
                      flush=True)  # fmt: skip
    summary: dict[str, Any] = {}
    for arm in arms:
        mine = [x for x in runs if x["arm"] == arm]
        per_round = []
        for x in mine:
            plan = next(y for y in runs if y["arm"] == "plan" and y["round"] == x["round"])
            per_round.append(plan["tokens_per_s"] / x["tokens_per_s"])
        summary[arm] = {
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in mine),
            "tokens_per_cpu_s": statistics.median(x["tokens_per_cpu_s"] for x in mine),
            "plan_over_arm": statistics.median(per_round),
            "plan_over_arm_each": [round(v, 3) for v in per_round],
            "decisions": "TRL's DPOTrainer" if arm == "trl" else arm_plan(arm_workload(base, arm)),
        }
    return {"workload": dataclasses.asdict(base), "runs": runs, "summary": summary}


def markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    lines = [f"# The speed plan's decisions, switched off one at a time ({payload['when']})", "",
             f"`{payload['command']}`", "",
             f"CPU {m['cpu']} (capability {m['cpu_capability']}), {m['cores_available']} cores, "
             f"load average at start {m['load_average_at_start']}.", "",
             "| shape | arm | what it ran | tokens/s (median) | per CPU-second | plan / arm "
             "(median; rounds) |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for shape, res in payload["shapes"].items():
        for arm, s in res["summary"].items():
            each = ", ".join(f"{v:.3f}" for v in s["plan_over_arm_each"])
            lines.append(
                f"| {shape} | {arm} | {s['decisions']} | {s['tokens_per_s']:.1f} | "
                f"{s['tokens_per_cpu_s']:.1f} | {s['plan_over_arm']:.3f} ({each}) |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=MODEL_CHOICES, default=["real", "wide"])
    choices = ["plan", *(f"no_{s}" for s in SWITCHES), "plain"]
    parser.add_argument("--arms", nargs="+", default=choices, choices=choices)
    parser.add_argument("--trl", action="store_true", help="TRL's DPO arm in every round too")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    arms = list(dict.fromkeys(["plan", *args.arms])) + (["trl"] if args.trl else [])
    payload: dict[str, Any] = {
        "when": timestamp(), "machine": machine(), "shapes": {},
        "command": "uv run --group bench python -m benchmarks.speed_plan " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    for shape in args.model:
        base = Workload(model=shape, steps=args.steps, micro_batch_size=args.micro_batch_size,
                        trl_micro_batches=True, threads=args.threads, dtype=args.dtype)  # fmt: skip
        payload["shapes"][shape] = measure_shape(base, arms, args.rounds, args.timeout)
    json_path, md_path = write_results(f"{payload['when']}-speed-plan", payload,
                                       markdown(payload), latest=False)  # fmt: skip
    print(markdown(payload))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
