"""SFT side by side: our `instruction_tuning.train.train` against `trl.SFTTrainer`.

The workload is the DPO benchmark's (`benchmarks.workload`: `Workload` and `prepare`): the same
model (`--model real` is the headline: Qwen3-0.6B's proportions; `tiny` / `small` are
head-dominated), the same HH rows that neither trainer truncates, as prompt -> chosen reply
(the prompt rendered with our chat template, the completion followed by eos, the loss on the
completion tokens only), read in the same order, `batch_size` rows per step, no accumulation,
AdamW (cosine, no warmup, no weight decay, clip 1.0), fp32, SDPA, CPU, `threads` torch threads.

  ours              `instruction_tuning.train` as shipped on this branch (right-padded rows, the
                    LM head only on completion positions, fused with the log-softmax)
  TRL               `SFTTrainer` on the same directory (`AutoModelForCausalLM`), prompt-completion
                    rows (string prompt = our rendered prompt, so both see the same tokens; the
                    worker checks that its tokenized rows equal ours), `completion_only_loss`
                    (its default for such rows), no packing, padded batches
  TRL padding-free  the same with `padding_free=True`: each batch flattened into one row with
                    restarting `position_ids` (transformers builds a block-diagonal mask from them
                    under SDPA, so sequences do not see each other); the same rows per step

TRL's `packing=True` (BFD) is not an arm: it regroups the whole dataset into `max_length` rows,
so its steps would not hold the same rows as ours; padding-free is the part of it that keeps
the batches.

What is timed is `benchmarks.workload.StepClock`'s window: optimizer steps warmup_steps+1..steps;
tokens are the non-pad tokens of the rows (prompt + completion) each trainer feeds its model in
those steps. Peak RSS is the whole process's high-water mark and, separately, that of the timed
steps.

    uv run --group bench python -m benchmarks.sft --model real [--rounds 2] [--steps 8]
runs `prepare` once and then alternating fresh processes per arm, and writes
`benchmarks/results/<time>-sft.{json,md}`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.flops import per_cpu_second
from benchmarks.measure import (
    PeakRSS,
    machine,
    rss_mb,
    timestamp,
    write_result_file,
    write_results,
)
from benchmarks.workload import (
    MODEL_CHOICES,
    StepClock,
    Workload,
    arm_rows,
    clock_steps,
    count_batch_tokens,
    count_trl_tokens,
    last_logged_loss,
    model_dir,
    ratio_line,
    round_ratios,
    run_checks,
    run_our_trainer,
    run_rounds,
    start_trl_arm,
    trl_arguments,
    trl_clock,
    trl_inputs,
    worker_parser,
    worker_result,
)
from benchmarks.workload import prepare as prepare_pairs

ARMS = ("ours", "trl", "trl-padding-free")
LABELS = {
    "ours": "ours (instruction_tuning, as shipped)",
    "trl": "TRL SFTTrainer (padded)",
    "trl-padding-free": "TRL SFTTrainer (padding_free=True)",
}
STEPS = 8


def prepare(w: Workload, workdir: Path) -> dict[str, Any]:
    """The DPO benchmark's HH selection, written as SFT rows (prompt -> chosen) for both."""
    from rlhf_core.preference import preference_row

    info = prepare_pairs(w, workdir)
    ours = []
    for index, line in enumerate((workdir / "hh_subset.jsonl").read_text().splitlines()):
        prompt, chosen, _ = preference_row(json.loads(line), index, "hh", "hh_subset.jsonl")
        ours.append({"prompt": prompt, "completion": chosen})
    (workdir / "sft_ours.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours))
    trl = [json.loads(x) for x in (workdir / "trl_rows.jsonl").read_text().splitlines()]
    (workdir / "sft_trl.jsonl").write_text(
        "".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"]}) + "\n" for r in trl)
    )
    expected = json.loads((workdir / "expected.json").read_text())["pairs"]
    rows = [e["prompt_ids"] + e["chosen_ids"] for e in expected]
    step_tokens = [
        sum(len(r) for r in rows[s * w.batch_size : (s + 1) * w.batch_size]) for s in range(w.steps)
    ]
    (workdir / "sft_expected.json").write_text(json.dumps({"rows": rows}))
    split = [(e["prompt_ids"], e["chosen_ids"]) for e in expected]
    widths = [
        max(len(r) for r in rows[s * w.batch_size : (s + 1) * w.batch_size]) * w.batch_size
        for s in range(w.steps)
    ]
    return {
        "model_dir": info["model_dir"], "model": info["model"], "rows": len(rows),
        "step_tokens": step_tokens, "padding_share": 1 - sum(step_tokens) / sum(widths),
        "sequence_tokens_mean": sum(len(r) for r in rows) / len(rows),
        "work": work(w, split, info["model_dir"]),
    }  # fmt: skip


def work(w: Workload, rows: list[tuple[list[int], list[int]]], path: str) -> dict[str, Any]:
    """What each arm computes in the timed steps (`benchmarks.flops`): body positions, LM-head
    positions, attention score entries and forward + backward GFLOP, from the batches each
    arm builds.

    - ours: the batcher our trainer picks for this model (its speed plan,
      `rlhf_core.fastpath.speed_plan`), its rows, its attention segments, the head on
      completion targets;
    - TRL padded: `batch_size` rows of the step's longest row, the whole L x L per row, the head
      on every position (its fused head scores every position without Triton);
    - TRL padding-free: one row of all the step's tokens; transformers builds a block-diagonal
      mask from the restarting positions and SDPA computes the whole T x T of it."""
    from transformers import AutoModelForCausalLM

    from benchmarks.flops import Shapes, segment_score_entries
    from instruction_tuning.data import SFTExample, pack
    from rlhf_core.fastpath import speed_plan

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    shapes = Shapes.of(model.config)
    plan = speed_plan(model)
    assert plan.layout in ("mask", "segmented"), "the SFT benchmark's arm packs with a 4D mask"
    row_tokens = plan.row_tokens or None
    del model
    counts = {arm: {"positions": 0, "head_positions": 0, "score_entries": 0} for arm in ARMS}

    def add(arm: str, positions: int, head: int, scores: int) -> None:
        for key, value in zip(counts[arm], (positions, head, scores), strict=True):
            counts[arm][key] += value

    for s in range(w.warmup_steps, w.steps):
        step = rows[s * w.batch_size : (s + 1) * w.batch_size]
        examples = [SFTExample(list(p), list(c), "", "") for p, c in step]
        ours = pack(examples, 0, row_tokens=row_tokens)
        positions = ours["input_ids"].numel()
        if "segments" in ours:
            scores = segment_score_entries(ours["segments"])
        else:
            scores = ours["input_ids"].shape[0] * ours["input_ids"].shape[1] ** 2
        add("ours", positions, int(ours["targets"].numel()), scores)
        longest = max(len(p) + len(c) for p, c in step)
        add("trl", len(step) * longest, len(step) * (longest - 1), len(step) * longest**2)
        total = sum(len(p) + len(c) for p, c in step)
        add("trl-padding-free", total, total - 1, total**2)
    for c in counts.values():
        c["gflop"] = shapes.train_gflop(c["positions"], c["head_positions"], c["score_entries"])
    return {"shapes": dataclasses.asdict(shapes), "arms": counts}


def run_ours(w: Workload, workdir: Path) -> dict[str, Any]:
    memory = PeakRSS()

    import instruction_tuning.train as sft_train
    from instruction_tuning.config import SFTConfig

    after_imports = rss_mb()
    clock = StepClock(w.warmup_steps, memory)
    cfg = SFTConfig.model_validate({
        "name": "bench_sft", "seed": w.seed,
        "model": {"name_or_path": str(model_dir(w.model)), "dtype": w.dtype, "attention": "sdpa"},
        "data": {"train": {"path": str(workdir / "sft_ours.jsonl")},
                 "format": "prompt_completion", "max_length": w.max_length,
                 "max_prompt_length": w.max_prompt_length},
        "train": {"batch_size": w.batch_size, "max_steps": w.steps, "threads": w.threads,
                  "device": "cpu", "eval_every": 0, "evaluate": False},
        "optim": {"lr": w.lr, "schedule": "cosine", "warmup_steps": 0, "weight_decay": 0.0,
                  "max_grad_norm": 1.0, "master_weights": False},  # TRL's bf16 arm: pure bf16
        "checkpoint": {"save_every": 0, "save_final": False},
        "tracking": {"log_every": w.log_every},
    })  # fmt: skip
    original_logprobs = sft_train.sequence_logprobs

    def counted_logprobs(model, batch):  # a packed batch counts the rows it stands for
        count_batch_tokens(clock, batch)
        return original_logprobs(model, batch)

    clock_steps(sft_train, clock)
    sft_train.sequence_logprobs = counted_logprobs
    metrics = run_our_trainer(sft_train, cfg, workdir, "benchmarks/sft.py")
    return {
        **worker_result("ours", clock, memory, after_imports),
        "final_logged_loss": next((m["train/loss"] for m in reversed(metrics)
                                   if "train/loss" in m), None),
    }  # fmt: skip


def run_trl(w: Workload, workdir: Path, *, padding_free: bool = False) -> dict[str, Any]:
    memory, clock, after_imports, (SFTConfig, SFTTrainer) = start_trl_arm(
        w, "SFTConfig", "SFTTrainer"
    )
    path, tokenizer, dataset, out_dir = trl_inputs(w, workdir, "sft_trl.jsonl")
    # padding-free without packing refuses a max_length; the rows already fit it (prepare)
    args = SFTConfig(**trl_arguments(
        w, out_dir, max_length=None if padding_free else w.max_length, packing=False,
        padding_free=padding_free,
    ))  # fmt: skip

    trainer = SFTTrainer(
        model=path, args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[trl_clock(clock)],
    )  # fmt: skip
    expected = json.loads((workdir / "sft_expected.json").read_text())["rows"]
    data = trainer.train_dataset
    identical = len(data) == len(expected) and all(
        data[i]["input_ids"] == e for i, e in enumerate(expected)
    )
    count_trl_tokens(trainer, clock)
    trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    return {
        **worker_result(
            "trl-padding-free" if padding_free else "trl", clock, memory, after_imports
        ),
        "optimizer": str(args.optim),
        "tokens_identical_to_ours": identical,
        "final_logged_loss": last_logged_loss(trainer),
    }  # fmt: skip


def compare(w: Workload, rounds: int, timeout: float = 900) -> dict[str, Any]:
    """Prepare once, then `rounds` rounds of one fresh process per arm, rotating the order."""
    host = machine()
    prep, runs, arms, by_round = run_rounds(
        "benchmarks.sft", ARMS, w, rounds, timeout, "rlhf-bench-sft-"
    )
    ratios = {peer: round_ratios(by_round, "ours", peer) for peer in ARMS[1:]}
    fastest_trl = min(ratios[p]["tokens_per_s"] for p in ARMS[1:])
    done = prep["work"]["arms"]
    timed_tokens = sum(prep["step_tokens"][w.warmup_steps :])
    work_summary = {
        "trl_over_ours_gflop": {p: done[p]["gflop"] / done["ours"]["gflop"] for p in ARMS[1:]},
        "gflop_per_cpu_s": {
            a: per_cpu_second(done[a]["gflop"], timed_tokens, arms[a]["tokens_per_cpu_s"])
            for a in ARMS
        },
    }
    return {
        "machine": host, "workload": dataclasses.asdict(w), "prepare": prep, "runs": runs,
        "summary": {
            "arms": arms, "ratios_ours_over": ratios,
            "target_tokens_per_s_1_5x_over_fastest_trl": fastest_trl >= 1.5,
            "work": work_summary,
            **run_checks(w, prep, runs),
        },
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    w, s, m = result["workload"], result["summary"], result["prepare"]["model"]
    rounds = len({r["round"] for r in result["runs"]})
    same = s["tokens_identical"] and s["timed_tokens_match"]
    lines = [
        f"### SFT: ours vs `trl.SFTTrainer` {result['machine']['versions']['trl']}",
        "",
        f"Model `{w['model']}` ({m['parameters'] / 1e6:.1f}M parameters, hidden "
        f"{m['hidden_size']}, {m['layers']} layers, {w.get('dtype', 'fp32')}), HH prompt -> "
        f"chosen, {w['batch_size']} rows "
        f"per step ({result['prepare']['padding_share']:.0%} padding when padded), {w['steps']} "
        f"steps ({w['steps'] - w['warmup_steps']} timed), {w['threads']} thread(s), {rounds} "
        f"rounds; same tokens in every arm: {same}; load average {s['load_average_range']}.",
        "",
        "| arm | non-pad tokens/s (median, range) | tokens/CPU-s | peak RSS MiB (timed steps) "
        "| step s |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [*arm_rows(s["arms"], LABELS), ""]
    for peer in ARMS[1:]:
        lines.append(ratio_line("ours", LABELS[peer], s["ratios_ours_over"][peer]))
    done, ws = result["prepare"]["work"]["arms"], s["work"]
    lines += [
        "",
        "Work in the timed steps (`benchmarks.flops`: forward + backward; what each arm's batches "
        "make it compute) and the rate each arm did it at. The tokens/CPU-s ratio is the work "
        "ratio times the rate ratio: where the work ratio is below a target, only less work or "
        "a slower peer meets it.",
        "",
        "| arm | body positions | LM-head positions | attention score entries | GFLOP | "
        "TRL arm / ours GFLOP | GFLOP per CPU-s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arm in ARMS:
        c = done[arm]
        versus = f"{ws['trl_over_ours_gflop'][arm]:.2f}x" if arm != "ours" else ""
        lines.append(
            f"| {LABELS[arm]} | {c['positions']:,} | {c['head_positions']:,} | "
            f"{c['score_entries']:,} | {c['gflop']:.0f} | {versus} | "
            f"{ws['gflop_per_cpu_s'][arm]:.1f} |"
        )
    lines += [
        "",
        f"Target >= 1.5x TRL tokens/s (over its faster arm): "
        f"{s['target_tokens_per_s_1_5x_over_fastest_trl']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = worker_parser("python -m benchmarks.sft", __doc__, ARMS, rounds=2)
    parser.add_argument("--model", choices=MODEL_CHOICES, default="tiny")
    defaults = Workload(steps=STEPS)
    fields = ("batch_size", "steps", "max_length", "max_prompt_length", "threads")
    for field in fields:
        value = getattr(defaults, field)
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default=defaults.dtype,
        help="weights of every arm (bf16: trained as bf16, no autocast)",
    )
    args = parser.parse_args(argv)
    if args.command is not None:  # a measured worker process
        w = Workload.from_json(args.workload)
        workers = {"prepare": prepare, "ours": run_ours, "trl": run_trl,
                   "trl-padding-free": partial(run_trl, padding_free=True)}  # fmt: skip
        worker = workers[args.command]
        write_result_file(args.result, worker(w, args.workdir))
        return 0
    w = dataclasses.replace(defaults, model=args.model, dtype=args.dtype,
                            **{f: getattr(args, f) for f in fields})  # fmt: skip
    print(f"SFT vs TRL: {w}, {args.rounds} rounds", flush=True)
    result = compare(w, args.rounds)
    text = markdown(result)
    payload = {"sft": result, "command": sys.argv}
    paths = write_results(f"{timestamp()}-sft", payload, text, latest=False)
    print("\n" + text + f"\nwrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
