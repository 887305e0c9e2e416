"""Reward model side by side: our `reward_models.train.train` against `trl.RewardTrainer`.

The workload is the DPO benchmark's (`benchmarks.workload`: `Workload` and `prepare`): the
same model (a Qwen3 with the real GPT-2 tokenizer, `tiny` or `small`), the same HH pairs that
neither trainer truncates, read in the same order, batch `batch_size` pairs, no accumulation,
AdamW (cosine, no warmup, no weight decay, clip 1.0), fp32, SDPA, CPU, `threads` torch threads.
The loss is Bradley-Terry, -log sigmoid(r_c - r_r), on a scalar head over the backbone's last
hidden state at the last token; both trainers run chosen and rejected rows in one forward.

  ours   `reward_models.train` as shipped (`BaseRewardModel`: `AutoModel` backbone + linear head)
         (`BaseRewardModel`: `AutoModel` backbone + linear head; each pair's prompt encoded once
         and read by both completions through the KV cache, `train.share_prompt: true`)
  ours-unshared  the same with `train.share_prompt: false`: chosen and rejected as two full
         rows, prompt encoded twice (what the shared prompt buys, measured alone)
  TRL    `RewardTrainer` on `AutoModelForSequenceClassification` (num_labels 1) loaded from the
         same directory, its defaults otherwise (its optimizer is `adamw_torch_fused`), with
         gradient checkpointing off and fp32 as ours; the worker checks that its tokenized rows
         equal ours

What is timed is `benchmarks.workload.StepClock`'s window: optimizer steps warmup_steps+1..steps in
full; tokens are the non-pad tokens of the rows each trainer feeds its model in those steps. Peak
RSS is the whole process's high-water mark and, separately, that of the timed steps.

    uv run --group bench python -m benchmarks.reward_model [--rounds 3] [--steps 32]
runs `prepare` once and then alternating fresh processes `ours` / `trl`, and writes
`benchmarks/results/<time>-reward_model.{json,md}` (not `latest.md`, which `benchmarks.run` owns).
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
    StepClock,
    Workload,
    arm_rows,
    clock_steps,
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

ARMS = ("ours", "trl", "ours-unshared")
# 32 steps of 4 pairs (128 HH pairs, 31 timed steps): at ~40 ms a step the DPO workload's 8 steps
# timed only ~0.3 s, and single rounds then varied by +-15%
STEPS = 32
LABELS = {
    "ours": "ours (as shipped)",
    "trl": "TRL RewardTrainer",
    "ours-unshared": "ours without the shared prompt (share_prompt: false)",
}


def prepare(w: Workload, workdir: Path) -> dict[str, Any]:
    """The DPO benchmark's pairs (`benchmarks.workload.prepare`), and the work of each arm."""
    info = prepare_pairs(w, workdir)
    expected = json.loads((workdir / "expected.json").read_text())["pairs"]
    return {**info, "work": work(w, expected, info["model_dir"])}


def work(w: Workload, pairs: list[dict[str, list[int]]], path: str) -> dict[str, Any]:
    """What each arm's backbone computes in the timed steps (`benchmarks.flops`: forward +
    backward; the scalar head, hidden x 1 per position, left out), from the batches each arm
    builds:

    - ours: the collate our trainer picks for this model (`reward_models.train.
      shared_prompt_collate`: on the CPU with SDPA, `pack_pairs` rows with attention pair by
      pair), each prompt once;
    - ours-unshared: `collate_pairs`, 2B right-padded rows, the whole L x L per row;
    - TRL: the same 2B right-padded rows (its collator pads chosen and rejected together)."""
    from transformers import AutoModel

    from benchmarks.flops import Shapes, segment_score_entries
    from rlhf_core.fastpath import speed_plan
    from rlhf_core.preference import PreferencePair, collate_pairs, pack_pairs

    backbone = AutoModel.from_pretrained(path, attn_implementation="sdpa")
    shapes = Shapes.of(backbone.config)
    row_tokens = speed_plan(backbone).row_tokens or None
    del backbone
    counts = {arm: {"positions": 0, "score_entries": 0} for arm in ARMS}
    for s in range(w.warmup_steps, w.steps):
        step = [PreferencePair(**p) for p in pairs[s * w.batch_size : (s + 1) * w.batch_size]]
        ours = pack_pairs(step, 0, row_tokens=row_tokens)
        rows, length = ours["input_ids"].shape
        counts["ours"]["positions"] += rows * length
        counts["ours"]["score_entries"] += (
            segment_score_entries(ours["segments"]) if row_tokens else rows * length**2
        )
        padded = collate_pairs(step, 0)["input_ids"]
        for arm in ("ours-unshared", "trl"):
            counts[arm]["positions"] += padded.numel()
            counts[arm]["score_entries"] += padded.shape[0] * padded.shape[1] ** 2
    for c in counts.values():
        c["gflop"] = shapes.train_gflop(c["positions"], 0, c["score_entries"])
    return {"shapes": dataclasses.asdict(shapes), "arms": counts}


def run_ours(w: Workload, workdir: Path, *, share_prompt: bool = True) -> dict[str, Any]:
    """Our trainer as shipped, or with the prompt encoded twice (`share_prompt=False`)."""
    memory = PeakRSS()

    import reward_models.train as rm_train
    from reward_models.config import RMConfig
    from rlhf_core.preference import batch_tokens

    after_imports = rss_mb()
    clock = StepClock(w.warmup_steps, memory)
    cfg = RMConfig.model_validate({
        "name": "bench", "seed": w.seed,
        "model": {"name_or_path": str(model_dir(w.model)), "dtype": w.dtype, "attention": "sdpa"},
        "data": {"train": {"path": str(workdir / "hh_subset.jsonl")}, "format": "hh",
                 "max_length": w.max_length, "max_prompt_length": w.max_prompt_length},
        "loss": {"name": "bradley_terry"},
        "train": {"batch_size": w.batch_size, "max_steps": w.steps, "threads": w.threads,
                  "device": "cpu", "eval_every": 0, "share_prompt": share_prompt},
        "optim": {"lr": w.lr, "schedule": "cosine", "warmup_steps": 0, "max_grad_norm": 1.0,
                  "master_weights": False},  # like TRL's bf16 arm: pure bf16
        "checkpoint": {"save_every": 0, "save_final": False},
        "tracking": {"log_every": w.log_every},
    })  # fmt: skip
    original_loss = rm_train.compute_loss

    def counted_loss(model, loss_fn, batch):
        # the full rows' non-pad tokens: a shared prompt counts once per completion reading it
        clock.add(batch_tokens(batch))
        return original_loss(model, loss_fn, batch)

    clock_steps(rm_train, clock)
    rm_train.compute_loss = counted_loss
    metrics = run_our_trainer(rm_train, cfg, workdir, "benchmarks/reward_model.py")
    return {
        **worker_result(
            "ours" if share_prompt else "ours-unshared", clock, memory, after_imports
        ),
        "final_logged_loss": metrics[-1].get("train/loss"),
    }  # fmt: skip


def run_trl(w: Workload, workdir: Path) -> dict[str, Any]:
    memory, clock, after_imports, (RewardConfig, RewardTrainer) = start_trl_arm(
        w, "RewardConfig", "RewardTrainer"
    )
    path, tokenizer, dataset, out_dir = trl_inputs(w, workdir, "trl_rows.jsonl")
    args = RewardConfig(**trl_arguments(w, out_dir))

    trainer = RewardTrainer(
        model=path, args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[trl_clock(clock)],
    )  # fmt: skip
    expected = json.loads((workdir / "expected.json").read_text())["pairs"]
    data = trainer.train_dataset
    identical = len(data) == len(expected) and all(
        data[i]["chosen_ids"] == e["prompt_ids"] + e["chosen_ids"]
        and data[i]["rejected_ids"] == e["prompt_ids"] + e["rejected_ids"]
        for i, e in enumerate(expected)
    )
    count_trl_tokens(trainer, clock)
    trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    return {
        **worker_result("trl", clock, memory, after_imports), "optimizer": str(args.optim),
        "tokens_identical_to_ours": identical,
        "final_logged_loss": last_logged_loss(trainer),
    }  # fmt: skip


def compare(w: Workload, rounds: int, timeout: float = 900) -> dict[str, Any]:
    """Prepare once, then `rounds` rounds of one fresh process per arm, alternating the order."""
    host = machine()
    prep, runs, arms, by_round = run_rounds(
        "benchmarks.reward_model", ARMS, w, rounds, timeout, "rlhf-bench-rm-"
    )
    for a in ARMS:
        if a != "trl":
            arms[a]["ratio_over_trl"] = round_ratios(by_round, a, "trl")
    ratios = arms["ours"]["ratio_over_trl"]
    target = 2.0 if w.model == "real" else 1.5  # issue 15's at real proportions
    done = prep["work"]["arms"]
    timed_tokens = sum(prep["step_tokens"][w.warmup_steps :])
    work_summary = {
        "trl_over_gflop": {a: done["trl"]["gflop"] / done[a]["gflop"] for a in ARMS},
        "gflop_per_cpu_s": {
            a: per_cpu_second(done[a]["gflop"], timed_tokens, arms[a]["tokens_per_cpu_s"])
            for a in ARMS
        },
    }
    return {
        "machine": host, "workload": dataclasses.asdict(w), "prepare": prep, "runs": runs,
        "summary": {
            "arms": arms, "ratios_ours_over_trl": ratios,
            "target_tokens_per_s": target,
            "target_tokens_per_s_met": ratios["tokens_per_s"] >= target,
            "work": work_summary,
            **run_checks(w, prep, runs),
        },
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    w, s, m = result["workload"], result["summary"], result["prepare"]["model"]
    rounds = len({r["round"] for r in result["runs"]})
    same = s["tokens_identical"] and s["timed_tokens_match"]
    lines = [
        f"### Reward model: ours vs `trl.RewardTrainer` {result['machine']['versions']['trl']}",
        "",
        f"Model `{w['model']}` ({m['parameters'] / 1e6:.1f}M parameters, hidden "
        f"{m['hidden_size']}, {m['layers']} layers, {w.get('dtype', 'fp32')}), "
        f"{w['batch_size']} pairs per step, "
        f"{w['steps']} steps ({w['steps'] - w['warmup_steps']} timed), {w['threads']} thread(s), "
        f"{rounds} rounds; same tokens in both: {same}; "
        f"load average {s['load_average_range']}.",
        "",
        "| arm | tokens/s (median, range) | tokens/CPU-s | peak RSS MiB (timed steps) | step s |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [*arm_rows(s["arms"], LABELS), ""]
    for arm in ("ours", "ours-unshared"):
        lines.append(ratio_line(LABELS[arm], "TRL", s["arms"][arm]["ratio_over_trl"]))
    done, ws = result["prepare"]["work"]["arms"], s["work"]
    lines += [
        "",
        "Work in the timed steps (`benchmarks.flops`: the backbone's forward + backward; the "
        "scalar head left out) and the rate each arm did it at; the tokens/CPU-s ratio is the "
        "work ratio times the rate ratio.",
        "",
        "| arm | body positions | attention score entries | GFLOP | TRL / arm GFLOP "
        "| GFLOP per CPU-s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {LABELS[a]} | {done[a]['positions']:,} | {done[a]['score_entries']:,} | "
            f"{done[a]['gflop']:.0f} | {ws['trl_over_gflop'][a]:.2f}x | "
            f"{ws['gflop_per_cpu_s'][a]:.1f} |"
            for a in ARMS
        ),
    ]
    lines += ["", f"Target >= {s['target_tokens_per_s']}x TRL tokens/s (as shipped): "
              f"{'met' if s['target_tokens_per_s_met'] else 'NOT met'}.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = worker_parser("python -m benchmarks.reward_model", __doc__, ARMS, rounds=3)
    defaults = Workload(steps=STEPS)
    for field in ("model", "batch_size", "steps", "max_length", "max_prompt_length", "threads"):
        value = getattr(defaults, field)
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default=defaults.dtype,
        help="weights of both arms (bf16: trained as bf16, no autocast)",
    )
    args = parser.parse_args(argv)
    if args.command is not None:  # a measured worker process
        w = Workload.from_json(args.workload)
        worker = {"prepare": prepare, "ours": run_ours, "trl": run_trl,
                  "ours-unshared": partial(run_ours, share_prompt=False)}[args.command]  # fmt: skip
        write_result_file(args.result, worker(w, args.workdir))
        return 0
    w = dataclasses.replace(defaults, **{
        f: getattr(args, f)
        for f in ("model", "batch_size", "steps", "max_length", "max_prompt_length", "threads",
                  "dtype")
    })  # fmt: skip
    print(f"reward model vs TRL: {w}, {args.rounds} rounds", flush=True)
    result = compare(w, args.rounds)
    text = markdown(result)
    payload = {"reward_model": result, "command": sys.argv}
    paths = write_results(f"{timestamp()}-reward_model", payload, text, latest=False)
    print("\n" + text + f"\nwrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
