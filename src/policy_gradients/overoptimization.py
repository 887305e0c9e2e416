"""Reward over-optimisation: the learned (proxy) reward against a verifier's (gold) reward over a
run, as in Gao et al. 2022, "Scaling Laws for Reward Model Overoptimization" (arXiv:2210.10760).

Optimising a learned reward model R_proxy raises R_proxy steadily, while the true objective
R_gold first rises and then falls as the policy moves away from its start; Gao et al. plot both
against d = sqrt(KL(pi || pi_init)) (nats, per sequence). Where the reward block of a run holds
both a learned component (`reward_model`, `implicit_reward_model`) and a verifier
(`reasoning_gym`, `gsm8k`, `exact_match`), every step's rollouts already carry both scores
(`train/reward/<label>` in metrics.jsonl): a verifier with `weight: 0.0` is measured without
being trained on, e.g.

    rewards:
      - {name: reward_model, weight: 1.0, path: outputs/rm/final}
      - {name: reasoning_gym, weight: 0.0, extract: full, label: gold}

`write_overoptimization(run_dir, rewards)` (called by `policy_gradients.train` at the end of such
a run, or `python -m policy_gradients.overoptimization RUN_DIR` for any earlier run) writes

    overoptimization.json   per training step: step, kl_sequence (k3 estimate of KL(pi || pi_ref)
                            summed over the completion, mean over completions: the reference is
                            the starting policy), kl_token (per-token mean), proxy and gold
                            (mean over the step's rollouts, each learned / verifier component);
                            and the held-out evaluations' sampled scores where the run evaluated
    overoptimization.png    proxy and gold reward against the step and against sqrt(KL)

Not here: the fitted functional forms of Gao et al. (R = d(alpha - beta d) for best-of-n,
d(alpha - beta log d) for RL), and gold reward models (the gold score here is a verifier's).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

LEARNED = ("reward_model", "implicit_reward_model")
VERIFIERS = ("reasoning_gym", "gsm8k", "exact_match")
FILES = ("overoptimization.json", "overoptimization.png")


def reward_roles(rewards: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(proxy labels, gold labels) of a reward block: its learned and its verifier components."""
    proxy = [r.get("label") or r["name"] for r in rewards if r["name"] in LEARNED]
    gold = [r.get("label") or r["name"] for r in rewards if r["name"] in VERIFIERS]
    return proxy, gold


def overoptimization_series(
    history: list[dict[str, Any]], proxy: list[str], gold: list[str]
) -> dict[str, Any]:
    """The proxy/gold/KL series of a run's metrics lines (`history`), training and eval."""
    train: dict[str, list] = {"step": [], "kl_sequence": [], "kl_token": []}
    train |= {f"proxy/{p}": [] for p in proxy} | {f"gold/{g}": [] for g in gold}
    evals: dict[str, list] = {"step": [], "kl_token": []}
    evals |= {f"proxy/{p}": [] for p in proxy} | {f"gold/{g}": [] for g in gold}
    for row in history:
        if all(row.get(f"train/reward/{label}") is not None for label in proxy + gold):
            train["step"].append(row["step"])
            train["kl_sequence"].append(row.get("train/kl/k3_sequence"))
            train["kl_token"].append(row.get("train/kl/k3"))
            for role, labels in (("proxy", proxy), ("gold", gold)):
                for label in labels:
                    train[f"{role}/{label}"].append(row[f"train/reward/{label}"])
        if all(row.get(f"eval/sampled_{label}") is not None for label in proxy + gold):
            evals["step"].append(row["step"])
            evals["kl_token"].append(row.get("eval/sampled_kl_k3"))
            for role, labels in (("proxy", proxy), ("gold", gold)):
                for label in labels:
                    evals[f"{role}/{label}"].append(row[f"eval/sampled_{label}"])
    return {"proxy": proxy, "gold": gold, "train": train, "eval": evals}


def plot_overoptimization(series: dict[str, Any], png: Path) -> None:
    """Two panels: proxy (left axis) and gold (right axis) reward against the step, and against
    sqrt(sequence KL) where the run had a reference; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = series["train"], series["eval"]
    kl = train["kl_sequence"]
    has_kl = bool(kl) and all(v is not None for v in kl)
    xs = {"step": train["step"]}
    if has_kl:
        xs["sqrt(KL(pi || pi_ref)), nats per sequence"] = [math.sqrt(max(v, 0.0)) for v in kl]
    fig, axes = plt.subplots(1, len(xs), figsize=(6 * len(xs), 4), squeeze=False)
    for ax, (xlabel, x) in zip(axes[0], xs.items(), strict=True):
        right = ax.twinx()
        roles = ((ax, "proxy", ("C0", "C2", "C4")), (right, "gold", ("C1", "C3", "C5")))
        for axis, role, colours in roles:
            for k, label in enumerate(series[role]):
                colour = colours[k % 3]
                # against the step a line; against the (noisy, non-monotone) KL a scatter
                style = "-" if xlabel == "step" else "."
                ys = train[f"{role}/{label}"]
                axis.plot(x, ys, style, color=colour, label=f"{role}: {label}")
                if xlabel == "step" and evals["step"]:
                    axis.plot(evals["step"], evals[f"{role}/{label}"], "o", color=colour,
                              label=f"{role}: {label} (held-out, sampled)")  # fmt: skip
        ax.set_xlabel(xlabel)
        ax.set_ylabel("proxy (learned RM) reward")
        right.set_ylabel("gold (verifier) reward")
        lines = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle("reward over-optimisation: proxy vs gold (Gao et al. 2022)", fontsize=10)
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    os.replace(tmp, png)


def write_overoptimization(run_dir: Path, rewards: list[dict[str, Any]]) -> Path | None:
    """overoptimization.json and .png in `run_dir` from its metrics.jsonl, if the reward block
    has both a learned and a verifier component and the run logged them; else None."""
    proxy, gold = reward_roles(rewards)
    metrics = run_dir / "metrics.jsonl"
    if not proxy or not gold or not metrics.is_file():
        return None
    history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    series = overoptimization_series(history, proxy, gold)
    if not series["train"]["step"]:
        return None
    (run_dir / FILES[0]).write_text(json.dumps(series, indent=1) + "\n")
    plot_overoptimization(series, run_dir / FILES[1])
    return run_dir / FILES[1]


def main(argv: list[str] | None = None) -> int:
    import argparse

    import yaml

    from rlhf_core.errors import UserError

    parser = argparse.ArgumentParser(
        prog="python -m policy_gradients.overoptimization",
        description="proxy (learned) vs gold (verifier) reward of a policy-gradient run",
    )
    parser.add_argument("run_dir", type=Path, help="a policy_gradients run directory")
    args = parser.parse_args(argv)
    config = args.run_dir / "config.yaml"
    if not config.is_file():
        raise UserError(f"{args.run_dir}: not a run directory (no config.yaml)")
    rewards = yaml.safe_load(config.read_text()).get("rewards") or []
    proxy, gold = reward_roles(rewards)
    if not proxy or not gold:
        raise UserError(
            f"{config}: rewards needs a learned component ({', '.join(LEARNED)}) and a verifier "
            f"({', '.join(VERIFIERS)}; weight 0.0 measures it without training on it); has "
            f"{[r.get('label') or r['name'] for r in rewards]}"
        )
    png = write_overoptimization(args.run_dir, rewards)
    if png is None:
        raise UserError(f"{args.run_dir}/metrics.jsonl: no step logged both rewards")
    print(png)
    return 0


if __name__ == "__main__":
    from rlhf_core.errors import run_main

    sys.exit(run_main(main))
