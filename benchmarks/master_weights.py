"""Does a bf16 model learn at a small learning rate? fp32 weights, bf16 weights stepped through
fp32 masters (`optim.master_weights: auto`, the default for bf16) and pure bf16 weights
(`master_weights: false`), side by side in one run.

Each arm continues the same SFT'd model (`benchmarks.async_rollouts.sft_first`: a benchmarks
shape SFT'd on spell_backward with spaced letters, fp32) for `--steps` more SFT steps at a
constant `--lr` on the same rows, and reports its train loss per step, the held-out loss and exact
match at the end, and the seconds per step (bf16 on a CPU without bf16 matmul units is slow:
compare the losses, not the times, across dtypes on such a machine).

`--step-shapes real,wide` also times the optimizer step alone on those shapes (randomly
initialised, bf16, every parameter trainable, a fixed random gradient): `torch.optim.AdamW` on the
bf16 weights against `MasterWeightAdamW`, alternating, the median of `--step-repeats` steps each.
That is what the masters add to a training step, whatever its forward and backward cost.

    uv run python -m benchmarks.master_weights --model small --sft-steps 250 --steps 60 --lr 1e-5 \
        --step-shapes real,wide

writes benchmarks/results/<time>-master-weights-<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.async_rollouts import REPO, local_prompts, run_trainer, sft_first
from benchmarks.measure import machine, timestamp, write_results

ARMS = {  # name: (model.dtype, optim.master_weights)
    "fp32": ("fp32", "auto"),
    "bf16+masters": ("bf16", "auto"),
    "bf16 pure": ("bf16", False),
}


def run_arm(name: str, args: argparse.Namespace, base: str, workdir: Path) -> dict[str, Any]:
    dtype, master = ARMS[name]
    cfg = yaml.safe_load((REPO / "configs/instruction_tuning/tiny_sft.yaml").read_text())
    cfg["name"] = "master_" + name.replace(" ", "_").replace("+", "_")
    cfg["model"] = {"name_or_path": base, "dtype": dtype}
    cfg["data"] = {
        # other rows than the SFT's (seed 2): the arms learn something new at the small lr
        "train": {"path": str(local_prompts(workdir, "more", 20_000, 2, True))},
        "eval": {"path": str(local_prompts(workdir, "sft_eval", 200, 30_000_000, True))},
        "columns": {"completion": "answer"},
        "max_length": 96,
    }
    cfg["train"].update(max_steps=args.steps, eval_every=0, threads=args.threads,
                        eval_max_new_tokens=24)  # fmt: skip
    cfg["optim"].update(lr=args.lr, schedule="constant", warmup_steps=0, master_weights=master)
    cfg["checkpoint"] = {"save_every": 0, "save_final": False}
    cfg["tracking"] = {"log_every": 1, "plot_every": 0}
    path, out = workdir / f"{cfg['name']}.yaml", workdir / cfg["name"]
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.perf_counter()
    proc = run_trainer("instruction_tuning.train", path, out)
    if proc.returncode != 0:
        raise RuntimeError(f"arm {name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "train/loss" in r]
    clock = [r["elapsed_s"] for r in train]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "arm": name, "dtype": dtype, "master_weights": master,
        "wall_s": round(time.perf_counter() - t0, 1),
        "step_s_median": round(statistics.median(b - a for a, b in zip(clock, clock[1:],
                                                                      strict=False)), 3),
        "loss": [round(r["train/loss"], 5) for r in train],
        "eval_loss": summary.get("eval/loss"),
        "eval_greedy_exact_match": summary.get("eval/greedy_exact_match"),
    }  # fmt: skip


def time_steps(shape: str, repeats: int, threads: int) -> dict[str, Any]:
    """Seconds of one optimizer step on `shape` in bf16: plain AdamW and MasterWeightAdamW
    side by side (alternating), after one warm-up step each (which creates the state)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.workload import model_dir
    from rlhf_core.optim import MasterWeightAdamW, OptimConfig, build_optimizer

    torch.set_num_threads(threads)
    arms = {}
    for name, master in (("bf16 pure", False), ("bf16+masters", "auto")):
        model = AutoModelForCausalLM.from_pretrained(model_dir(shape), dtype=torch.bfloat16)
        opt = build_optimizer(model, OptimConfig(lr=1e-6, master_weights=master))
        assert isinstance(opt, MasterWeightAdamW) == (master == "auto")
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()  # warm-up: the state
        arms[name] = (model, opt)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, (_, opt) in arms.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in arms["bf16 pure"][0].parameters())
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "shape": shape, "parameters": params,
        "step_s": {name: round(v, 4) for name, v in med.items()},
        "ratio": round(med["bf16+masters"] / med["bf16 pure"], 2),
        "state_bytes": {name: announced(opt) for name, (_, opt) in arms.items()},
    }  # fmt: skip


def announced(opt: Any) -> int:
    from rlhf_core.optim import announced_state_bytes

    return announced_state_bytes(opt)


def window(losses: list[float], part: slice) -> float:
    return statistics.fmean(losses[part])


def markdown(payload: dict[str, Any]) -> str:
    m, s = payload["machine"], payload["sft"]
    n = len(payload["runs"][0]["loss"])
    k = max(1, n // 5)
    lines = [
        f"# bf16 at a small lr: fp32 masters against pure bf16 (`--model {payload['model']}`, "
        f"{payload['when']})", "", f"`{payload['command']}`", "",
        f"CPU {m['cpu']} ({m['cpu_capability']}), {m['cores_available']} cores. The base: "
        f"{s['steps']} SFT steps at lr {s['lr']} (fp32), held-out greedy exact match "
        f"{s['eval/greedy_exact_match']:.3f}. Each arm: {n} more steps at a constant lr "
        f"{payload['lr']} on other rows of the task.", "",
        f"| arm | train loss, first {k} steps | last {k} steps | held-out loss | held-out greedy "
        "exact match | s/step |", "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in payload["runs"]:
        lines.append(
            f"| {r['arm']} | {window(r['loss'], slice(0, k)):.4f} | "
            f"{window(r['loss'], slice(-k, None)):.4f} | {r['eval_loss']:.4f} | "
            f"{r['eval_greedy_exact_match']:.3f} | {r['step_s_median']} |"
        )
    if payload.get("optimizer_steps"):
        lines += ["", "The optimizer step alone, bf16, every parameter trainable (median of "
                  f"{payload['step_repeats']} alternating steps):", "",
                  "| shape | parameters | AdamW on bf16 s | MasterWeightAdamW s | ratio | state "
                  "MiB, pure / masters |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in payload["optimizer_steps"]:
            st, b = r["step_s"], r["state_bytes"]
            lines.append(
                f"| {r['shape']} | {r['parameters'] / 1e6:.1f}M | {st['bf16 pure']} | "
                f"{st['bf16+masters']} | {r['ratio']}x | {b['bf16 pure'] / 2**20:.0f} / "
                f"{b['bf16+masters'] / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("small", "real", "wide"), default="small")
    parser.add_argument("--sft-steps", type=int, default=250)
    parser.add_argument("--sft-lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--step-shapes",
        default="",
        help="comma-separated benchmarks shapes whose optimizer step to time",
    )
    parser.add_argument("--step-repeats", type=int, default=7)
    args = parser.parse_args()
    if args.sft_steps < 1 or args.steps < 2:
        parser.error("--sft-steps must be >= 1 and --steps >= 2")
    from benchmarks.workload import model_dir

    args.spaced, args.tokens = True, 24  # what sft_first reads
    payload: dict[str, Any] = {
        "model": args.model, "when": timestamp(), "machine": machine(), "lr": args.lr,
        "command": "uv run python -m benchmarks.master_weights " + " ".join(sys.argv[1:]),
        "runs": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="master-weights-") as tmp:
        args.workdir = Path(tmp)
        base, payload["sft"] = sft_first(args, str(model_dir(args.model)), Path(tmp))
        print(json.dumps({"sft": payload["sft"]}), flush=True)
        for name in ARMS:
            result = run_arm(name, args, base, Path(tmp))
            payload["runs"].append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "loss"}), flush=True)
    payload["step_repeats"] = args.step_repeats
    payload["optimizer_steps"] = [
        time_steps(shape, args.step_repeats, args.threads)
        for shape in filter(None, args.step_shapes.split(","))
    ]
    stem = f"{payload['when']}-master-weights-{args.model}"
    json_path, md_path = write_results(stem, payload, markdown(payload), latest=False)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
