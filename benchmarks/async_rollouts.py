"""Asynchronous rollouts measured (issue 38 item 4): step rate, reward curve and the
sampler-trainer mismatch of `rollout.max_staleness` k = 0, 1, 2, with and without the decoupled
correction, each arm a fresh `policy_gradients.train` process (k > 0: trainer + generator).

Workloads (`--model`):
  tiny   the tiny world: configs/policy_gradients/tiny_grpo.yaml (GRPO, 2 PPO epochs, clip 0.2)
         from the tiny SFT model (`--sft DIR`, configs/instruction_tuning/tiny_sft.yaml's final/),
         spell_backward, `--prompts` x `--group` rows of `--tokens` new tokens per step
  real   the benchmarks' `real` model (`benchmarks.workload.model_dir("real")`: Qwen3-0.6B's
         proportions, hidden 512, 22 layers, 95M parameters, GPT-2 vocabulary), randomly
         initialised, the same GRPO config: the step rate is the measure (its reward stays ~0)

Arms (`--arms`, comma-separated): `k<N>` (max_staleness N), `+dec` (algorithm.correction
decoupled, no cap), `+p09` (rollout.top_p 0.9), `+bf16` (model.dtype bf16), `+t<N>` (this
arm's train.threads, e.g. `k0+t2`: the synchronous loop on both cores, the fair baseline for
k = 1's two one-thread processes). The arms of a round
run one after the other, rounds in alternating order (arm order reversed every other round), so
slow drift of the machine's load hits every arm alike. Per arm: the median seconds per step from
the third step on (the first includes the generator's start-up, the second its first wait),
the reward per step, the held-out sampled reward at the end, the mismatch metrics (means over
steps; ratio_max the max), the process tree's CPU seconds, and the load average before and
after. `--threads` (default 1) is every process's `train.threads`: k = 0 is one process on one
core's worth of threads, k > 0 a trainer and a generator with as many each (the spare core is
what overlap buys). `--threads 0` leaves it null (every free core; halved with a generator): on
a machine whose cores other jobs also use, two spinning OpenMP threads per process collapse
(measured below), so the default pins one.

    uv run python -m benchmarks.async_rollouts --model tiny --sft outputs/tiny_sft/final \
        --arms k0,k1,k2,k1+dec,k2+dec --steps 20 --rounds 1
    uv run python -m benchmarks.async_rollouts --model real --arms k0,k1,k2 --steps 8
    python -m benchmarks.async_rollouts --model real --task local --spaced --sft-steps 1000 \
        --tokens 24 --arms k0,k1 --steps 30 --eval-size 100   # on a GPU: learning, not just speed

`--sft-steps N` first trains the model by SFT on `--task local`'s rows (so the reward is not 0
throughout, as it is for a random-initialised model); `--spaced` spaces the letters, one GPT-2
token per letter (unspaced, a GPT-2-vocabulary model learns nothing: 0 exact match after 600
SFT steps of `tiny-qwen3-gpt2`, against 0.255 greedy spaced).

writes benchmarks/results/<time>-async-rollouts-<model>.{json,md} (and, with --plot, the reward
curves as a PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.measure import machine, timestamp, write_results

REPO = Path(__file__).resolve().parents[1]
MISMATCH = ("mismatch/k3", "mismatch/ratio_max", "mismatch/ratio_p99",
            "mismatch/outside_truncation")  # fmt: skip


def arm_config(arm: str, args: argparse.Namespace, model: str, seed: int) -> dict[str, Any]:
    cfg = yaml.safe_load((REPO / "configs/policy_gradients/tiny_grpo.yaml").read_text())
    parts = arm.split("+")
    cfg["name"] = f"async_{arm.replace('+', '_')}_seed{seed}"
    cfg["seed"] = seed
    cfg["model"] = {"name_or_path": model}
    if "bf16" in parts:
        cfg["model"]["dtype"] = "bf16"
    if args.task == "local":  # the same task from a file: no reasoning-gym (a bare GPU image)
        train = local_prompts(args.workdir, "train", 2000, 1, args.spaced)
        heldout = local_prompts(args.workdir, "eval", args.eval_size, 10_000_000, args.spaced)
        cfg["data"] = {"train": {"path": str(train)},
                       "eval": {"path": str(heldout)} if args.eval_size else None}  # fmt: skip
        cfg["rewards"] = [{"name": "exact_match", "weight": 1.0, "extract": "full"}]
    else:
        cfg["data"]["train"]["reasoning_gym"]["size"] = 2000
        if args.eval_size:
            cfg["data"]["eval"]["reasoning_gym"]["size"] = args.eval_size
        else:
            cfg["data"]["eval"] = None
    cfg["rollout"].update(prompts_per_step=args.prompts, group_size=args.group,
                          max_new_tokens=args.tokens, max_staleness=int(parts[0][1:]))  # fmt: skip
    if "p09" in parts:
        cfg["rollout"]["top_p"] = 0.9
    if "dec" in parts:
        cfg["algorithm"]["correction"] = {"name": "decoupled"}
    threads = next((int(p[1:]) for p in parts[1:] if p.startswith("t")), args.threads)
    cfg["train"].update(max_steps=args.steps, eval_every=0, micro_batch_size=256,
                        threads=threads)  # fmt: skip
    cfg["reference"] = {"mode": "model"}
    cfg["optim"]["warmup_steps"] = 0
    if args.rl_lr is not None:
        cfg["optim"]["lr"] = args.rl_lr
    cfg["checkpoint"] = {"save_every": 0, "save_final": False}
    cfg["tracking"] = {"log_every": 1, "plot_every": 1000}
    return cfg


def local_prompts(workdir: Path, split: str, size: int, seed: int, spaced: bool = False) -> Path:
    """`size` spell-backward rows ({"prompt", "answer"}) of random 3-10 letter words, as JSONL:
    `--task local`'s data (scored by exact match on the whole completion). `spaced`: the letters
    of word and answer separated by spaces ("c a t" -> "t a c"), so that a BPE vocabulary such as
    GPT-2's sees one token per letter and a model trained from scratch can learn the task."""
    import random

    path = workdir / f"spell_backward_{split}{size}{'_spaced' if spaced else ''}.jsonl"
    if not path.exists():
        rng = random.Random(seed)
        join = " ".join if spaced else "".join
        rows = []
        for _ in range(size):
            word = rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 10))
            rows.append({"prompt": f"Spell this word backward: {join(word)}",
                         "answer": join(word[::-1])})  # fmt: skip
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_trainer(module: str, config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """`python -m <module> --config <config> --output-dir <out>` in a fresh process, with src/
    on PYTHONPATH ahead of what is already there (carried site-packages on a GPU machine)."""
    paths = [str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    cmd = [sys.executable, "-m", module, "--config", str(config), "--output-dir", str(out)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)


def sft_first(args: argparse.Namespace, model: str, workdir: Path) -> tuple[str, dict[str, Any]]:
    """`--sft-steps N`: SFT `model` on `--task local`'s training rows for N steps
    (configs/instruction_tuning/tiny_sft.yaml's settings, `--sft-lr`), so that the arms start
    from a model whose sampled answers sometimes earn the reward (a random-initialised one's
    never do). Returns the SFT model's final/ directory and its held-out figures."""
    cfg = yaml.safe_load((REPO / "configs/instruction_tuning/tiny_sft.yaml").read_text())
    cfg["name"] = "async_sft"
    cfg["model"] = {"name_or_path": model}
    cfg["data"] = {
        "train": {"path": str(local_prompts(workdir, "train", 20_000, 1, args.spaced))},
        "eval": {"path": str(local_prompts(workdir, "sft_eval", 200, 30_000_000, args.spaced))},
        "columns": {"completion": "answer"},
        "max_length": 96,
    }
    cfg["train"].update(max_steps=args.sft_steps, eval_every=0, threads=args.threads,
                        eval_max_new_tokens=args.tokens)  # fmt: skip
    cfg["optim"]["lr"] = args.sft_lr
    cfg["checkpoint"] = {"save_every": 0, "save_final": True}
    path, out = workdir / "async_sft.yaml", workdir / "async_sft"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.perf_counter()
    proc = run_trainer("instruction_tuning.train", path, out)
    if proc.returncode != 0:
        raise RuntimeError(f"the SFT stage failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    figures = {k: summary.get(k) for k in ("eval/greedy_exact_match", "eval/sampled_exact_match",
                                           "final_train_loss")}  # fmt: skip
    return str(out / "final"), {
        "steps": args.sft_steps,
        "lr": args.sft_lr,
        "wall_s": round(time.perf_counter() - t0, 1),
        **figures,
    }


def run_arm(
    arm: str, args: argparse.Namespace, model: str, workdir: Path, seed: int
) -> dict[str, Any]:
    cfg = arm_config(arm, args, model, seed)
    path = workdir / f"{cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = workdir / f"{cfg['name']}-{time.time_ns()}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = run_trainer("policy_gradients.train", path, out)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"arm {arm} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "train/loss" in r]
    clock = [r["elapsed_s"] for r in train]
    steps = [b - a for a, b in zip(clock[1:], clock[2:], strict=False)]  # from the 3rd step on
    summary = json.loads((out / "summary.json").read_text())
    result: dict[str, Any] = {
        "arm": arm, "seed": seed, "wall_s": round(wall, 1),
        "cpu_s": round((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 1),
        "step_s_median": round(statistics.median(steps), 3) if steps else None,
        "step_s_each": [round(s, 3) for s in steps],
        "reward": [round(r["train/reward/total"], 4) for r in train],
        "eval_sampled_reward": summary.get("eval/sampled_reward"),
        "wait_s_mean": _mean([r.get("train/time/wait_rollouts_s") for r in train[2:]]),
        "generate_s_mean": _mean([r.get("train/time/generate_s") for r in train[2:]]),
        "train_s_mean": _mean([r.get("train/time/train_s") for r in train[2:]]),
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    for key in MISMATCH:
        values = [r[f"train/{key}"] for r in train if f"train/{key}" in r]
        if values:
            result[key] = max(values) if key.endswith("max") else statistics.fmean(values)
    return result


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 3) if values else None


def markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    lines = [
        f"# Asynchronous rollouts, `--model {payload['model']}` ({payload['when']})", "",
        f"`{payload['command']}`", "",
        f"CPU {m['cpu']} ({m['cpu_capability']}), {m['cores_available']} cores shared with other "
        f"jobs, load average at start {m['load_average_at_start']}. {payload['shape']}", "",
        "| arm | seed | round | s/step (median, step 3+) | wait s | generate s | train s | CPU s | "
        "reward first -> last 3 | eval sampled | k3 | ratio max | ratio p99 | outside top-p | "
        "load before/after |",
        "|---" * 15 + "|",
    ]  # fmt: skip
    if payload.get("sft"):
        s = payload["sft"]
        lines[4:4] = [f"The arms start from an SFT of that model on the task's rows: {s['steps']} "
                      f"steps at lr {s['lr']}, {s['wall_s']} s; held-out exact match greedy "
                      f"{_fmt(s['eval/greedy_exact_match'])}, sampled "
                      f"{_fmt(s['eval/sampled_exact_match'])}.", ""]  # fmt: skip
    for r in payload["runs"]:
        rew = r["reward"]
        tail = statistics.fmean(rew[-3:]) if rew else float("nan")
        lines.append(
            f"| {r['arm']} | {r.get('seed', 0)} | {r['round']} | {r['step_s_median']} | "
            f"{r['wait_s_mean']} | "
            f"{r['generate_s_mean']} | {r['train_s_mean']} | {r['cpu_s']} | "
            f"{rew[0] if rew else ''} -> {tail:.4f} | {_fmt(r.get('eval_sampled_reward'))} | "
            f"{_fmt(r.get('mismatch/k3'))} | {_fmt(r.get('mismatch/ratio_max'))} | "
            f"{_fmt(r.get('mismatch/ratio_p99'))} | {_fmt(r.get('mismatch/outside_truncation'))} "
            f"| {r['load_before']} / {r['load_after']} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    return "" if value is None else f"{value:.4g}"


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in payload["runs"]:
        ax.plot(range(1, len(r["reward"]) + 1), r["reward"], label=f"{r['arm']} (seed "
                f"{r.get('seed', 0)}, round {r['round']})", alpha=0.8)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("train reward (mean over the step's rollouts)")
    ax.set_title(f"max_staleness k, --model {payload['model']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "small", "real", "wide"), default="tiny",
                        help="tiny: the tiny SFT model (--sft); small, real, wide: "
                        "benchmarks.workload's shapes, randomly initialised")  # fmt: skip
    parser.add_argument("--sft", help="tiny: the tiny SFT model directory")
    parser.add_argument("--arms", default="k0,k1,k2,k1+dec,k2+dec")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="run seeds: every arm once per seed")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--task", choices=("reasoning_gym", "local"), default="reasoning_gym",
                        help="spell_backward from reasoning-gym, or the same task generated "
                        "here into JSONL files (for a machine without reasoning-gym)")  # fmt: skip
    parser.add_argument(
        "--spaced",
        action="store_true",
        help="--task local with spaced letters (one GPT-2 token per letter)",
    )
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="first SFT the model on the "
        "--task local rows for this many steps; the arms start from it",
    )
    parser.add_argument("--sft-lr", type=float, default=3e-4)
    parser.add_argument("--rl-lr", type=float, default=None,
                        help="the arms' optim.lr (default: tiny_grpo.yaml's)")  # fmt: skip
    parser.add_argument("--out", help="also copy the result files into this folder")
    parser.add_argument("--plot", help="write the reward curves to this PNG")
    parser.add_argument(
        "--threads", type=int, default=1, help="train.threads of every process (trainer and "
        "generator alike; 0 = null: all free cores, halved between trainer and generator)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.model == "tiny":
        if not args.sft:
            parser.error("--model tiny needs --sft (the tiny SFT model's final/ directory)")
        model = str(Path(args.sft).resolve())
    else:
        from benchmarks.workload import model_dir

        model = str(model_dir(args.model))
    if args.sft_steps < 0:
        parser.error(f"--sft-steps must be >= 0, got {args.sft_steps}")
    if (args.spaced or args.sft_steps) and args.task != "local":
        parser.error("--spaced and --sft-steps need --task local (the task as JSONL rows)")
    arms = args.arms.split(",")
    args.threads = args.threads or None
    payload: dict[str, Any] = {
        "model": args.model, "model_path": model, "when": timestamp(), "machine": machine(),
        "command": "uv run python -m benchmarks.async_rollouts " + " ".join(sys.argv[1:]),
        "task": args.task,
        "shape": f"GRPO (tiny_grpo.yaml: 2 PPO epochs, clip 0.2), {args.prompts} prompts x "
        f"{args.group} completions x {args.tokens} new tokens per step, {args.steps} steps, "
        f"train.threads {args.threads}, lr {args.rl_lr or 'as in tiny_grpo.yaml'}, no warmup."
        + (" Letters spaced." if args.spaced else ""),
        "runs": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        args.workdir = Path(tmp)
        if args.sft_steps:
            model, payload["sft"] = sft_first(args, model, Path(tmp))
            print(json.dumps({"sft": payload["sft"]}), flush=True)
        for round_ in range(args.rounds):
            order = [(seed, arm) for seed in args.seeds for arm in arms]
            for seed, arm in order if round_ % 2 == 0 else order[::-1]:
                result = {**run_arm(arm, args, model, Path(tmp), seed), "round": round_}
                payload["runs"].append(result)
                print(json.dumps({k: v for k, v in result.items() if k != "step_s_each"}),
                      flush=True)  # fmt: skip
    payload["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    stem = f"{payload['when']}-async-rollouts-{args.model}"
    json_path, md_path = write_results(stem, payload, markdown(payload), latest=False)
    if args.out:
        import shutil

        Path(args.out).mkdir(parents=True, exist_ok=True)
        for path in (json_path, md_path):
            shutil.copy(path, args.out)
    if args.plot:
        plot(payload, Path(args.plot))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
