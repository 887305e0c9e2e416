"""DPO side by side: our `direct_alignment.train.train` against `trl.DPOTrainer` on one workload.

The workload (identical for both, checked token by token):
  model       a Qwen3 built from config with the real GPT-2 tokenizer (vocab 50,257), fp32, SDPA:
              `tiny` = the preset `tiny-qwen3-gpt2` (hidden 64, 2 layers, 3.3M parameters, 96% of
              them in the tied embedding / LM head), or `small` (hidden 256, 4 layers, MLP 768,
              16.3M parameters, a bigger transformer body), or at real proportions (LM head ~27%
              of forward FLOPs) `real` (hidden 512, 22 layers, GQA 8/4) or `wide` (hidden 768,
              16 layers, GQA 12/3), built once into the rlhf-lab cache
  data        the first `pairs` pairs of the vendored Anthropic HH harmless-base test split whose
              prompt fits `max_prompt_length` and whose longest sequence fits `max_length`, so
              neither trainer truncates anything (TRL 1.16 has no prompt-length limit and truncates
              prompt+completion from the end, we keep the end of the prompt: with no truncation
              the sequences are the same); our chat rendering of the HH turns is given to TRL as
              plain prompt/chosen/rejected strings, and the TRL worker checks that its tokenized
              pairs equal ours
  order       one epoch: `steps x batch_size == pairs`; TRL reads the rows in the order of our
              sampler's first epoch with `train_sampling_strategy="sequential"`, so both see the
              same batches, padded (right) to each batch's longest row
  training    batch `batch_size` pairs, no accumulation, AdamW lr 1e-6 (cosine, no warmup, no
              weight decay, clip 1.0), DPO sigmoid loss beta 0.1, the reference a separate frozen
              copy loaded from the same directory (TRL's default for ref_model=None without peft;
              our `reference.mode: model`), no eval, no checkpoints, logging every 10 steps,
              `threads` torch threads (default 1), CPU
  threads     1 by default because the 2-core machine this was built on is shared: with other
              jobs running, 2 OpenMP threads made the same DPO step 2-6x slower than 1 thread
              (threads wait at every operator's barrier for a descheduled partner), which
              measures the neighbours, not the trainers. `--threads 2` on a quiet machine.
  TRL         its defaults otherwise, except gradient checkpointing off and fp32 (its DPOConfig
              defaults are on / bf16; ours are off / fp32 on CPU). Its default optimizer is
              `adamw_torch_fused`; ours is torch AdamW (fused only on CUDA).

What is timed: from the end of optimizer step `warmup_steps` to the end of the last optimizer
step, i.e. steps warmup_steps+1..steps in full (collation, forwards, backward, optimizer, logging)
and nothing before (imports, model and data loading, tokenization, optimizer creation, the first
step's lazy initialisation). Tokens: the non-pad tokens (attention_mask sum) of the chosen and
rejected rows fed to the policy in those steps, counted where each trainer hands the batch to its
forward (our `pair_logps`, TRL's `training_step`); ours packs each pair as [prompt | chosen |
rejected] (`train.packing`, on by default), and its tokens are counted as the 2B rows the packed
rows stand for (`rlhf_core.layout.unpacked_tokens`), so both trainers count the same tokens.
Peak RSS: the whole process's high-water mark
(VmHWM = ru_maxrss), and separately the peak during the timed steps (the mark is reset at the
window's start). CPU seconds (user + kernel, all threads) over the same window are recorded too:
they do not count time spent waiting for a core on a loaded machine.

    python -m benchmarks.dpo prepare|ours|trl --workload JSON --workdir DIR --result FILE
is how `benchmarks.run` starts each measured process; run `python -m benchmarks.run --only dpo`.
The workload, `prepare` and the step clock live in `benchmarks.workload` (the reward-model and
techniques benchmarks use them too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.measure import (
    PeakRSS,
    machine,
    median,
    rss_mb,
    run_worker,
    spread,
    write_result_file,
)
from benchmarks.workload import (
    StepClock,
    Workload,
    clock_steps,
    count_batch_tokens,
    count_trl_tokens,
    model_dir,
    prepare,
    run_our_trainer,
    start_trl_arm,
    trl_arguments,
    trl_clock,
    trl_inputs,
    worker_result,
)

# ----------------------------------------------------------------------------- the two workers


def our_config(w: Workload, workdir: Path) -> Any:
    """Our DAConfig for the workload (the run's pairs in `workdir`, written by `prepare`)."""
    from direct_alignment.config import DAConfig, DATrainConfig, PreferenceDataConfig
    from rlhf_core.checkpoint import CheckpointConfig
    from rlhf_core.data import DataSource
    from rlhf_core.models import ModelConfig
    from rlhf_core.optim import OptimConfig
    from rlhf_core.tracking import TrackingConfig

    return DAConfig(
        name="bench",
        seed=w.seed,
        model=ModelConfig(name_or_path=str(model_dir(w.model)), dtype=w.dtype, attention="sdpa"),
        data=PreferenceDataConfig(
            train=DataSource(path=str(workdir / "hh_subset.jsonl")), format="hh",
            max_length=w.max_length, max_prompt_length=w.max_prompt_length,
        ),
        loss={"name": "dpo", "beta": w.beta},
        reference={"mode": "model"},
        train=DATrainConfig(
            batch_size=w.batch_size, micro_batch_size=w.micro_batch_size, max_steps=w.steps,
            threads=w.threads, device="cpu", eval_every=0, samples_every=0, speed=w.speed,
        ),
        # master_weights off: TRL's bf16 arm steps its bf16 weights directly (pure bf16)
        optim=OptimConfig(
            lr=w.lr, schedule="cosine", warmup_steps=0, max_grad_norm=1.0, master_weights=False
        ),
        checkpoint=CheckpointConfig(save_every=0, save_final=False),
        tracking=TrackingConfig(log_every=w.log_every),
    )  # fmt: skip


def run_ours(w: Workload, workdir: Path) -> dict[str, Any]:
    """Our trainer as shipped."""
    memory = PeakRSS()

    import direct_alignment.train as da_train

    after_imports = rss_mb()
    clock = StepClock(w.warmup_steps, memory)
    cfg = our_config(w, workdir)

    original_logps = da_train.pair_logps

    def counted_logps(model, batch):  # a packed batch counts the 2B rows it stands for
        count_batch_tokens(clock, batch)
        return original_logps(model, batch)

    clock_steps(da_train, clock)
    da_train.pair_logps = counted_logps
    metrics = run_our_trainer(da_train, cfg, workdir, "benchmarks/dpo.py")
    return {
        **worker_result("ours", clock, memory, after_imports),
        "peak_rss_setup_mb": memory.phases.get("setup_and_warmup"),
        "rss_reset_supported": memory.resettable,
        "final_logged_loss": metrics[-1].get("train/loss"),
    }


def run_trl(w: Workload, workdir: Path) -> dict[str, Any]:
    memory, clock, after_imports, (DPOConfig, DPOTrainer) = start_trl_arm(
        w, "DPOConfig", "DPOTrainer"
    )
    path, tokenizer, dataset, out_dir = trl_inputs(w, workdir, "trl_rows.jsonl")
    accumulate = {}
    if w.trl_micro_batches and w.micro_batch_size:  # the same micro-batches as ours
        accumulate = {
            "per_device_train_batch_size": w.micro_batch_size,
            "gradient_accumulation_steps": w.batch_size // w.micro_batch_size,
        }
    args = DPOConfig(**trl_arguments(w, out_dir, beta=w.beta, loss_type=["sigmoid"], **accumulate))

    trainer = DPOTrainer(
        path, ref_model=None, args=args, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[trl_clock(clock)],
    )  # fmt: skip
    identical = _same_tokens(trainer.train_dataset, workdir)
    count_trl_tokens(trainer, clock)
    result = trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    return {
        **worker_result("trl", clock, memory, after_imports),
        "peak_rss_setup_mb": memory.phases.get("setup_and_warmup"),
        "rss_reset_supported": memory.resettable,
        "optimizer": str(args.optim),
        "tokens_identical_to_ours": identical,
        "mean_train_loss": result.training_loss,
        "train_runtime_s": result.metrics.get("train_runtime"),
    }


def _same_tokens(dataset, workdir: Path) -> bool:
    """Whether TRL's tokenized rows equal our pipeline's token ids, row by row."""
    expected = json.loads((workdir / "expected.json").read_text())["pairs"]
    if len(dataset) != len(expected):
        return False
    cols = {k: dataset[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
    return all(all(cols[k][i] == e[k] for k in cols) for i, e in enumerate(expected))


# ----------------------------------------------------------------------------- the comparison

#: The measured arms: ours as shipped and TRL.
ARMS = ("ours", "trl")
LABELS = {"ours": "ours (as shipped)", "trl": "TRL DPOTrainer"}


def compare(
    w: Workload, rounds: int, *, arms: tuple[str, ...] = ARMS, timeout: float = 900
) -> dict[str, Any]:
    """Prepare once, then `rounds` rounds of one fresh process per arm; the order of the arms
    rotates from round to round, so no arm always runs first or last."""
    host = machine()
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-dpo-") as tmp:
        workdir = Path(tmp)
        common = ["--workload", w.to_json(), "--workdir", str(workdir)]
        prep = run_worker(
            "benchmarks.dpo", ["prepare", *common], threads=w.threads, timeout=timeout
        )
        runs: list[dict[str, Any]] = []
        for r in range(rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            if r % 2:
                order = order[::-1]
            for impl in order:
                out = run_worker(
                    "benchmarks.dpo", [impl, *common], threads=w.threads, timeout=timeout
                )
                out["round"] = r
                runs.append(out)
                print(
                    f"  round {r + 1}/{rounds} {impl:10s}: {out['tokens_per_s']:7.1f} tok/s, "
                    f"peak RSS {out['peak_rss_mb']:6.0f} MiB "
                    f"(timed steps {out['peak_rss_timed_mb']:.0f}), "
                    f"process {out['process_wall_s']:.0f} s",
                    flush=True,
                )
    return {
        "machine": host, "workload": asdict(w), "prepare": prep, "runs": runs,
        "summary": summarize(prep, runs),
    }  # fmt: skip


def summarize(prep: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per arm, and per-round ratios against TRL (each round's runs ran back to back)."""
    keys = ("tokens_per_s", "tokens_per_cpu_s", "system_share_of_cpu", "peak_rss_mb",
            "peak_rss_timed_mb", "rss_after_imports_mb", "step_s_median", "to_first_step_end_s",
            "process_wall_s")  # fmt: skip
    arms = [a for a in ARMS if any(r["impl"] == a for r in runs)]
    out: dict[str, Any] = {"arms": {}}
    for arm in arms:
        rs = [r for r in runs if r["impl"] == arm]
        out["arms"][arm] = {k: median([r[k] for r in rs]) for k in keys}
        for key in ("tokens_per_s", "tokens_per_cpu_s", "peak_rss_mb"):
            out["arms"][arm][f"{key}_range"] = spread([r[key] for r in rs])
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["impl"]] = r
    for arm in arms:
        if arm == "trl" or "trl" not in arms:
            continue
        for key in ("tokens_per_s", "tokens_per_cpu_s", "peak_rss_mb", "peak_rss_timed_mb"):
            out["arms"][arm][f"ratio_{key}"] = median(
                [p[arm][key] / p["trl"][key] for p in by_round.values() if arm in p and "trl" in p]
            )
        # issue 15's targets at real proportions (`real`, `wide`); the tiny model's were 2x, 60%
        real = prep["model"]["name"] in ("real", "wide")
        speed, memory = (2.5, 0.50) if real else (2.0, 0.60)
        out["arms"][arm]["targets_met"] = {
            f"tokens_per_s >= {speed}x": out["arms"][arm]["ratio_tokens_per_s"] >= speed,
            f"peak_rss <= {memory:.0%}": out["arms"][arm]["ratio_peak_rss_mb"] <= memory,
        }
    timed_from = runs[0]["steps"] - runs[0]["timed_steps"]
    out["timed_tokens_expected"] = sum(prep["step_tokens"][timed_from:])
    out["timed_tokens_match"] = all(r["timed_tokens"] == out["timed_tokens_expected"] for r in runs)
    out["tokens_identical"] = all(r.get("tokens_identical_to_ours", True) for r in runs)
    out["load_average_range"] = spread([r["load_average_before"] for r in runs])
    return out


def micro_note(w: dict[str, Any]) -> str:
    """What the table says about ours' micro-batches (absent in results from before the option)."""
    micro = w.get("micro_batch_size")
    if micro is None or micro == w["batch_size"]:
        return " (one forward per step in both arms)"
    trl = (
        f"TRL: the same (`per_device_train_batch_size={micro}`, gradient accumulation)"
        if w.get("trl_micro_batches")
        else "TRL: one forward per step"
    )
    return (
        f" (ours: micro-batches of {micro} pairs, gradients accumulated, same effective batch "
        f"and loss; {trl})"
    )


def markdown(result: dict[str, Any]) -> str:
    """The result table (also printed and written to results/latest.md)."""
    w, s, p = result["workload"], result["summary"], result["prepare"]
    m, arms = p["model"], s["arms"]
    rounds = len({r["round"] for r in result["runs"]})

    def ratio(arm: str, key: str, fmt: str) -> str:
        value = arms[arm].get(f"ratio_{key}")
        return "" if value is None else format(value, fmt)

    lines = [
        f"### DPO: ours vs `trl.DPOTrainer` {result['machine']['versions']['trl']}",
        "",
        f"Model `{w['model']}`: Qwen3 from config, {m['parameters'] / 1e6:.1f}M parameters (hidden "
        f"{m['hidden_size']}, {m['layers']} layers, MLP {m['intermediate_size']}), GPT-2 "
        f"tokenizer (vocab {m['vocab_size']}). {p['pairs']} HH harmless-base pairs, batch "
        f"{w['batch_size']} pairs{micro_note(w)}, {w['steps']} optimizer steps "
        f"({w['steps'] - w['warmup_steps']} timed), max_length {w['max_length']}, "
        f"max_prompt_length {w['max_prompt_length']}, {w.get('dtype', 'fp32')}, "
        f"{w['threads']} torch threads, CPU ({result['machine']['cpu']}, "
        f"{result['machine']['cores_available']} cores). Medians of {rounds} rounds, one fresh "
        "process per run, arm order rotating per round; min-max in brackets; ratios are medians "
        "of per-round ratios.",
        "",
        "| | non-pad tokens/s | vs TRL | tokens per CPU-second | vs TRL | peak RSS MiB | vs TRL "
        "| peak RSS in timed steps | RSS after imports | kernel share of CPU time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arm in arms:
        a, x = arms[arm], "x" if arm != "trl" else ""
        lines.append(
            f"| {LABELS[arm]} | {a['tokens_per_s']:.0f} ({a['tokens_per_s_range']}) | "
            f"{ratio(arm, 'tokens_per_s', '.2f')}{x} | {a['tokens_per_cpu_s']:.0f} "
            f"({a['tokens_per_cpu_s_range']}) | {ratio(arm, 'tokens_per_cpu_s', '.2f')}{x} | "
            f"{a['peak_rss_mb']:.0f} ({a['peak_rss_mb_range']}) | "
            f"{ratio(arm, 'peak_rss_mb', '.0%')} | {a['peak_rss_timed_mb']:.0f} | "
            f"{a['rss_after_imports_mb']:.0f} | {a['system_share_of_cpu']:.0%} |"
        )
    lines.append("")
    for arm in arms:
        if "targets_met" in arms[arm]:
            met = ", ".join(
                f"{k}: {'met' if v else 'NOT met'}" for k, v in arms[arm]["targets_met"].items()
            )
            lines.append(f"- {LABELS[arm]}: {met}")
    lines += [
        f"- Timed non-pad tokens per run: {s['timed_tokens_expected']} (equal in every run: "
        f"{s['timed_tokens_match']}); TRL's tokenized pairs identical to ours: "
        f"{s['tokens_identical']}.",
        f"- Batches: {p['padding_share']:.0%} of the padded positions are padding; completion "
        f"tokens are {p['completion_token_share']:.0%} of the non-pad tokens.",
        f"- 1-minute load average when each run started: {s['load_average_range']}. The "
        "machine is shared: wall-clock tokens/s (the target's unit) moves with other work; "
        "tokens per CPU-second (user + kernel time of all the process's threads) does not count "
        "time the process waits for a core, so it moves less.",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- worker entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dpo")
    parser.add_argument("what", choices=["prepare", *ARMS])
    parser.add_argument("--workload", required=True, help="Workload as JSON")
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--result", required=True, type=Path)
    args = parser.parse_args(argv)
    w = Workload.from_json(args.workload)
    if args.what == "prepare":
        out = prepare(w, args.workdir)
    else:
        run = run_trl if args.what == "trl" else run_ours
        with operator_profile(os.environ.get(PROFILE_ENV)):
            out = run(w, args.workdir)
    write_result_file(args.result, out)


#: `RLHF_BENCH_PROFILE=FILE` in a worker's environment: the whole arm (loading included) runs
#: under torch.profiler and FILE gets its operator table as JSON (per operator: calls, self CPU
#: time, FLOPs where torch counts them), to compare where each trainer's time goes. Profiling
#: costs time per operator call, so a profiled run's tokens/s is not a measurement.
PROFILE_ENV = "RLHF_BENCH_PROFILE"


@contextmanager
def operator_profile(path: str | None):
    if not path:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        yield
    table = [
        {"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
         "cpu_ms": e.cpu_time_total / 1e3, "flops": e.flops}
        for e in prof.key_averages()
    ]  # fmt: skip
    table.sort(key=lambda r: -r["self_cpu_ms"])
    Path(path).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
