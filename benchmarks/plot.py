"""What drawing curves.png costs: `rlhf_core.tracking.plot_panels` against the drawing it replaced
(pyplot, a legend on every panel, `tight_layout`), same panels.

Every trainer redraws curves.png every `tracking.plot_every` metric lines and once at the end, in
its main loop. The panels are the families of real metric keys (33 panels for a GRPO run, 12
for an SFT run with held-out evaluation, 7 for a reward model), each curve `--steps` points
long. The arms alternate (old, new, old, ...) after one untimed warm-up each; medians of wall time.

    uv run python -m benchmarks.plot [--repeats 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

from benchmarks.measure import machine, median, timestamp, write_results
from rlhf_core.tracking import metric_family, plot_panels

GRPO = [
    "loss", "grad_norm", "lr", "epoch", "skipped_steps", "reward/reasoning_gym", "reward/total",
    "length/mean", "length/truncated", "time/generate_s", "time/score_s",
    "time/old_ref_values_s", "time/train_s", "sampling/groups", "sampling/dropped_groups",
    "loss/clip_fraction", "loss/entropy", "loss/kl", "loss/pg_loss", "loss/ratio_mean",
    "mismatch/k3", "mismatch/ratio_max", "mismatch/ratio_p99",
]  # fmt: skip
GRPO_EVAL = [
    "greedy_reward", "greedy_reasoning_gym", "greedy_reasoning_gym_exact", "greedy_length",
    "sampled_reward", "sampled_reasoning_gym", "sampled_reasoning_gym_exact", "sampled_length",
    "sampled_kl_k3", "reward",
]  # fmt: skip
SFT = ["loss", "grad_norm", "lr", "epoch", "skipped_steps", "tokens"]
SFT_EVAL = ["loss", "greedy_exact_match", "greedy_task_score", "greedy_length",
            "sampled_exact_match", "sampled_task_score", "sampled_length"]  # fmt: skip
RM = ["loss", "grad_norm", "lr", "epoch", "skipped_steps", "accuracy", "margin"]
RM_EVAL = ["loss", "accuracy", "margin"]

SHAPES = {
    "GRPO run": (GRPO, GRPO_EVAL),
    "SFT run with held-out evaluation": (SFT, SFT_EVAL),
    "reward model": (RM, RM_EVAL),
}


def panels_of(train: list[str], held_out: list[str], steps: int) -> dict:
    """The panels Tracker.plot draws for these metric keys, each logged at every step."""
    keys = [f"train/{k}" for k in train] + [f"eval/{k}" for k in held_out]
    panels: dict[str, dict] = {}
    for i, key in enumerate(keys):
        ys = [math.sin(s / 17 + i) + s / steps for s in range(1, steps + 1)]
        panels.setdefault(metric_family(key), {})[key] = (list(range(1, steps + 1)), ys)
    return {family: dict(sorted(lines.items())) for family, lines in sorted(panels.items())}


def old_plot_panels(panels: dict, png: Path) -> None:
    """The drawing before 2026-11-28, verbatim in effect: pyplot, a legend on every panel and
    `fig.tight_layout()`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items(), strict=False):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png, dpi=90, format="png")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (train, held_out) in SHAPES.items():
            panels = panels_of(train, held_out, args.steps)
            arms = {"old": old_plot_panels, "new": plot_panels}
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            for repeat in range(args.repeats + 1):
                for arm, draw in arms.items():
                    start = time.perf_counter()
                    draw(panels, Path(tmp) / f"{arm}.png")
                    if repeat:  # the first round warms up
                        times[arm].append(time.perf_counter() - start)
            old, new = median(times["old"]), median(times["new"])
            size = os.path.getsize(Path(tmp) / "new.png")
            rows.append({"shape": name, "panels": len(panels), "old_s": old, "new_s": new,
                         "ratio": old / new, "new_png_bytes": size})  # fmt: skip
            print(f"{name}: {len(panels)} panels, old {old:.2f} s, new {new:.2f} s, "
                  f"{old / new:.2f}x", flush=True)  # fmt: skip

    info = machine()
    md = [
        f"### curves.png: the previous drawing (pyplot, legends, tight_layout) vs plot_panels; "
        f"{args.steps} points a curve; median of {args.repeats}, alternating; CPU "
        f"{info['cpu_capability']}; load average {info['load_average_at_start']}",
        "",
        "| metric keys of | panels | old s | new s | old / new |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    md += [f"| {r['shape']} | {r['panels']} | {r['old_s']:.2f} | {r['new_s']:.2f} | "
           f"{r['ratio']:.2f}x |" for r in rows]  # fmt: skip
    md += ["", "`uv run python -m benchmarks.plot`", ""]
    stem = f"{timestamp()}-plot"
    write_results(stem, {"machine": info, "args": vars(args), "rows": rows}, "\n".join(md),
                  latest=False)  # fmt: skip
    print("\n".join(md))


if __name__ == "__main__":
    main()
