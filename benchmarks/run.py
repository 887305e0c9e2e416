"""Run the side-by-side benchmarks and write `benchmarks/results/<time>.{json,md}` + `latest.md`.

    uv run --group bench python -m benchmarks.run                # everything below, in order
    uv run --group bench python -m benchmarks.run --only dpo --rounds 3
    uv run --group bench python -m benchmarks.run --only techniques
    uv run --group bench python -m benchmarks.run --only reward_model --only grpo
    uv run --group bench python -m benchmarks.run --only sft --model real --rounds 2
    uv run --group bench python -m benchmarks.run --only dpo --model wide --rounds 1
    uv run --group bench python -m benchmarks.run --only generation
    uv run --group bench python -m benchmarks.techniques --profile   # torch.profiler tables

Sections: dpo (vs trl.DPOTrainer), techniques (what each DPO technique buys), reward_model (vs
trl.RewardTrainer), sft (vs trl.SFTTrainer, padded and padding-free), grpo (vs trl.GRPOTrainer,
on the same --model), generation (our decode loop vs `generate`).

This process stays small (it never imports torch): every measurement runs in a fresh child
process (`benchmarks.dpo`, `benchmarks.techniques`), so each child's peak RSS is its own. See
docs/performance.md for the workload, what is timed, and the latest figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from benchmarks import dpo, grpo, reward_model, sft, techniques
from benchmarks.measure import RESULTS_DIR, machine, timestamp, write_results
from benchmarks.workload import MODEL_CHOICES, Workload

SECTIONS = ("dpo", "techniques", "reward_model", "sft", "grpo", "generation")


def main(argv: list[str] | None = None) -> int:
    defaults = Workload()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only this section")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per comparison")
    parser.add_argument(
        "--model", choices=MODEL_CHOICES, default=defaults.model,
        help="benchmark model (benchmarks.workload.BENCH_MODELS; real and wide: real proportions)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="pairs")
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="DPO, ours: pairs per forward/backward, gradients accumulated over the step's "
        "batch (same effective batch and loss; the TRL arm runs the batch in one forward "
        "unless --trl-micro-batches)",
    )
    parser.add_argument(
        "--trl-micro-batches",
        action="store_true",
        help="DPO, with --micro-batch-size: give the TRL arm the same micro-batches "
        "(per_device_train_batch_size and gradient accumulation), like for like",
    )
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--max-length", type=int, default=defaults.max_length)
    parser.add_argument("--max-prompt-length", type=int, default=defaults.max_prompt_length)
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default=defaults.dtype,
        help="weights of every arm (bf16: trained as bf16, no autocast, as on a GPU)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.trl_micro_batches and not args.micro_batch_size:
        parser.error("--trl-micro-batches needs --micro-batch-size")
    if args.trl_micro_batches and args.batch_size % args.micro_batch_size:
        parser.error(
            f"--trl-micro-batches: --micro-batch-size {args.micro_batch_size} must divide "
            f"--batch-size {args.batch_size} (TRL accumulates whole micro-batches)"
        )
    workload = dataclasses.replace(
        defaults, model=args.model, batch_size=args.batch_size, steps=args.steps,
        micro_batch_size=args.micro_batch_size, trl_micro_batches=args.trl_micro_batches,
        max_length=args.max_length, max_prompt_length=args.max_prompt_length,
        threads=args.threads, dtype=args.dtype,
    )  # fmt: skip
    sections = args.only or list(SECTIONS)
    stamp = timestamp()
    payload: dict = {"started": stamp, "machine": machine(), "command": sys.argv}
    tables: list[str] = [f"# Benchmarks {stamp}", ""]
    start = time.perf_counter()

    if "dpo" in sections:
        print(f"DPO vs TRL: {workload}, {args.rounds} rounds of {', '.join(dpo.ARMS)}", flush=True)
        payload["dpo"] = dpo.compare(workload, args.rounds)
        tables.append(dpo.markdown(payload["dpo"]))
    if "techniques" in sections:
        print(f"techniques: {workload.model}, {args.rounds} alternating rounds", flush=True)
        payload["techniques"] = techniques.compare(workload, args.rounds)
        tables.append(techniques.markdown(payload["techniques"]))

    if "reward_model" in sections:
        print(f"reward model vs TRL: {workload.model}, {args.rounds} rounds", flush=True)
        rm_workload = dataclasses.replace(workload, steps=max(workload.steps, reward_model.STEPS))
        payload["reward_model"] = reward_model.compare(rm_workload, args.rounds)
        tables.append(reward_model.markdown(payload["reward_model"]))
    if "sft" in sections:
        print(f"SFT vs TRL: {workload.model}, {args.rounds} rounds", flush=True)
        sft_workload = dataclasses.replace(workload, steps=max(workload.steps, sft.STEPS))
        payload["sft"] = sft.compare(sft_workload, args.rounds)
        tables.append(sft.markdown(payload["sft"]))
    if "grpo" in sections:
        g = dataclasses.replace(
            grpo.Workload(), threads=args.threads, model=args.model, dtype=args.dtype
        )
        print(f"GRPO vs TRL: {g}, {min(args.rounds, 2)} rounds", flush=True)
        payload["grpo"] = grpo.compare(g, min(args.rounds, 2))
        tables.append(grpo.markdown(payload["grpo"]))
    if "generation" in sections:  # a child process, so this one never imports torch
        import json
        import subprocess

        print("generation: decode vs generate", flush=True)
        before = set(RESULTS_DIR.glob("*-generation.json"))
        subprocess.run([sys.executable, "-m", "benchmarks.generation", "--threads",
                        str(args.threads)], check=True)  # fmt: skip
        (new,) = set(RESULTS_DIR.glob("*-generation.json")) - before
        payload["generation"] = json.loads(new.read_text())
        tables.append(new.with_suffix(".md").read_text())

    payload["total_wall_s"] = time.perf_counter() - start
    tables.append(f"Total benchmark wall time: {payload['total_wall_s']:.0f} s.\n")
    text = "\n".join(tables)
    json_path, md_path = write_results(stamp, payload, text)
    print("\n" + text)
    print(f"wrote {json_path} and {md_path} (and results/latest.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
