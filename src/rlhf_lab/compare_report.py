"""What `rlhf-lab compare` writes beside its runs: `compare.md` (a row per run, and with several
seeds a row per algorithm: its per-seed values, mean, spread and gain over the SFT model) and
`compare.png` (the training-reward curves, and the held-out headline figure of every run with
each algorithm's spread across seeds).

The headline figure is the first verifier's sampled exact match (`eval/sampled_<label>_exact`),
else the reward model's win rate against the SFT model. An algorithm `improves` when its mean
gain over the SFT model is larger than its spread (max - min over seeds): with two seeds, both
runs are above the SFT model and the gap is wider than the disagreement between them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

RM_LABEL = "rm"  # the reward model's label in the evaluation's reward components


def _f(value: Any, spec: str = ".3f") -> str:
    if isinstance(value, int | float) and math.isfinite(value):
        return format(value, spec)
    return "n/a"


def headline(report: dict[str, Any]) -> tuple[str, str]:
    """(metric key, its name) of the figure each algorithm is judged by."""
    verifiers = report.get("verifiers") or []
    if verifiers:
        return f"eval/sampled_{verifiers[0]}_exact", f"sampled {verifiers[0]} exact"
    return "eval/win_rate", "win rate vs SFT"


def groups(report: dict[str, Any]) -> dict[str, list[str]]:
    """algorithm -> its run names (one per seed; a run without `algorithm` is its own group)."""
    out: dict[str, list[str]] = {}
    for name, r in report["runs"].items():
        if r.get("family") != "sft":
            out.setdefault(r.get("algorithm", name), []).append(name)
    return out


def seed_summary(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per algorithm over its seeds: the headline figure per seed, its mean, min, max and spread,
    the mean gain over the SFT model, and whether that gain is larger than the spread."""
    key, _ = headline(report)
    runs = report["runs"]
    sft = runs.get("sft", {}).get("eval", {}).get(key)
    out = {}
    for algorithm, names in groups(report).items():
        values = [runs[n].get("eval", {}).get(key) for n in names]
        if any(not isinstance(v, int | float) or not math.isfinite(v) for v in values):
            continue
        mean, lo, hi = sum(values) / len(values), min(values), max(values)
        gain = None if sft is None else mean - sft
        others = {}
        for k in ("eval/sampled_kl_k3", *(f"eval/greedy_{v}_exact" for v in report["verifiers"])):
            got = [runs[n].get("eval", {}).get(k) for n in names]
            if all(isinstance(v, int | float) for v in got):
                others[k] = sum(got) / len(got)
        out[algorithm] = {
            "family": runs[names[0]]["family"], "runs": names,
            "seeds": [runs[n].get("seed") for n in names], "values": values, "mean": mean,
            "min": lo, "max": hi, "spread": hi - lo, "gain": gain,
            "improves": gain is not None and gain > 0 and gain > hi - lo, "means": others,
            "wall_s": sum(runs[n].get("wall_s") or 0.0 for n in names),
        }  # fmt: skip
    return out


def table_columns(report: dict[str, Any]) -> list[tuple[str, Any]]:
    """(header, cell of a run) for the held-out figures this report has."""
    columns: list[tuple[str, Any]] = []
    if report.get("reward_model"):
        columns += [
            ("RM score (sampled)", lambda r, ev: _f(ev.get(f"eval/sampled_{RM_LABEL}"))),
            ("win rate vs SFT", lambda r, ev: f"{_f(ev.get('eval/win_rate'), '.2f')} "
             f"± {_f(ev.get('eval/win_rate_se'), '.2f')}"),
        ]  # fmt: skip
    for label in report.get("verifiers", []):
        columns += [
            (f"greedy {label} exact", lambda r, ev, k=label: _f(ev.get(f"eval/greedy_{k}_exact"))),
            (f"sampled {label} exact",
             lambda r, ev, k=label: _f(ev.get(f"eval/sampled_{k}_exact"))),
            (f"sampled {label} mean", lambda r, ev, k=label: _f(ev.get(f"eval/sampled_{k}"))),
        ]  # fmt: skip
    columns += [
        ("KL to SFT (k3/token)", lambda r, ev: _f(ev.get("eval/sampled_kl_k3"))),
        ("length (sampled)", lambda r, ev: _f(ev.get("eval/sampled_length"), ".1f")),
        ("train reward first -> last", lambda r, ev: "n/a" if r.get("first_train_reward") is None
         else f"{_f(r['first_train_reward'])} -> {_f(r['last_train_reward'])}"),
        ("tokens generated", lambda r, ev: _f(r.get("tokens_generated"), "d")),
        ("wall s", lambda r, ev: _f(r.get("wall_s"), ".0f")),
    ]  # fmt: skip
    return columns


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The per-algorithm table (several seeds only)."""
    summary = report.get("summary") or {}
    if not report.get("seeds") or not summary:
        return []
    _, what = headline(report)
    sft = report["runs"].get("sft", {}).get("eval", {}).get(headline(report)[0])
    greedy = [f"eval/greedy_{v}_exact" for v in report["verifiers"][:1]]
    lines = [
        f"## Per algorithm over seeds {report['seeds']} (SFT {what}: {_f(sft)})", "",
        "`improves`: the mean gain over the SFT model is larger than the spread (max - min) "
        "across seeds.", "",
        f"| algorithm | family | {what} per seed | mean | spread | gain over SFT | improves "
        + "".join(f"| greedy {v} exact (mean) " for v in report["verifiers"][:1])
        + "| KL to SFT (mean) | wall s (all seeds) |",
        "|---|---|---|---|---|---|---|" + "---|" * len(greedy) + "---|---|",
    ]  # fmt: skip
    for algorithm, s in summary.items():
        per_seed = ", ".join(_f(v) for v in s["values"])
        gain = "n/a" if s["gain"] is None else f"{s['gain']:+.3f}"
        cells = [algorithm, s["family"], per_seed, _f(s["mean"]), _f(s["spread"]), gain,
                 "yes" if s["improves"] else "**no**",
                 *(_f(s["means"].get(k)) for k in greedy),
                 _f(s["means"].get("eval/sampled_kl_k3")), _f(s["wall_s"], ".0f")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _wall_line(report: dict[str, Any]) -> list[str]:
    """The compare's own wall time (this invocation: with --resume, not the reused runs') and
    how many runs it ran at once."""
    if report.get("wall_s") is None:
        return []
    m, s = divmod(round(report["wall_s"]), 60)
    threads = report.get("threads")
    each = "the trainers' default threads" if threads is None else f"{threads} torch thread(s)"
    resumed = "; resumed, reusing finished runs" if report.get("resumed") else ""
    jobs = report.get("jobs", 1)
    return [f"Wall time {m}:{s:02d} ({jobs} run(s) at a time, {each} each{resumed}).", ""]


def write_table(out: Path, report: dict[str, Any]) -> None:
    runs = report["runs"]
    smoke = " (fast smoke run: the figures are not meaningful)" if report["fast"] else ""
    columns = table_columns(report)
    n = report.get("eval_prompts")
    seeds = f"; seeds {report['seeds']}" if report.get("seeds") else ""
    lines = [
        "# rlhf-lab compare", "",
        f"From `{report['sft_model']}`, run dir `{out}`{smoke}; {n} held-out prompts{seeds}.", "",
        *_wall_line(report),
        *summary_lines(report),
        "| run | family | " + " | ".join(h for h, _ in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]  # fmt: skip
    for name, r in runs.items():
        ev = r.get("eval", {})
        cells = " | ".join(cell(r, ev) for _, cell in columns)
        lines.append(f"| {name} | {r['family']} | {cells} |")
    lines += ["", "![reward curves and held-out results](compare.png)", ""]
    text = "\n".join(lines)
    (out / "compare.md").write_text(text)
    print(text, flush=True)


def _penalties(run_dir: Path) -> list[str]:
    """The labels of a run's weighted reward components that are penalties (their class declares
    `penalty`, e.g. DAPO's overlong shaping): its total reward includes them, so its curve is
    not comparable as is with runs that have none."""
    import yaml

    from policy_gradients.rewards import REWARDS

    path = run_dir / "config.yaml"
    specs = (yaml.safe_load(path.read_text()) or {}).get("rewards") if path.is_file() else None
    return [
        s.get("label") or s["name"] for s in specs or []
        if s.get("name") in REWARDS and getattr(REWARDS.get(s["name"]), "penalty", False)
        and s.get("weight", 1.0) != 0
    ]  # fmt: skip


def _curve(run_dir: Path, key: str) -> dict[int, float]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return {}
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {x["step"]: x[key] for x in rows if isinstance(x.get(key), int | float)}


def plot_curves(out: Path, report: dict[str, Any]) -> None:
    """Left: each policy-gradient algorithm's training reward per step (several seeds: their mean,
    the band from min to max). Right, when the runs were evaluated: the headline figure per
    algorithm, each seed a dot and a bar from min to max, the SFT model as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, what = headline(report)
    runs = report["runs"]
    evaluated = any(key in r.get("eval", {}) for r in runs.values())
    fig, axes = plt.subplots(1, 2 if evaluated else 1, figsize=(14 if evaluated else 8, 5))
    ax = axes[0] if evaluated else axes
    for algorithm, names in groups(report).items():
        if runs[names[0]]["family"] != "policy_gradients":
            continue
        curves = [c for c in (_curve(out / n, "train/reward/total") for n in names) if c]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not steps:
            continue
        penalties = _penalties(out / names[0])
        label = algorithm + (f" (incl. {', '.join(penalties)} penalty)" if penalties else "")
        mean = [sum(c[s] for c in curves) / len(curves) for s in steps]
        (line,) = ax.plot(steps, mean, label=label)
        if len(curves) > 1:
            lo, hi = ([f(c[s] for c in curves) for s in steps] for f in (min, max))
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    band = "\n(mean over seeds, band: min-max)" if report.get("seeds") else ""
    ax.set_ylabel("mean training reward (total)" + band)
    ax.set_title("policy-gradient algorithms from the same SFT model")
    ax.legend(fontsize=8)
    if evaluated:
        _plot_heldout(axes[1], report, key, what)
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=90)
    plt.close(fig)


def _plot_heldout(ax: Any, report: dict[str, Any], key: str, what: str) -> None:
    runs = report["runs"]
    names = list(groups(report).items())
    for i, (_, members) in enumerate(names):
        values = [runs[n]["eval"][key] for n in members if key in runs[n].get("eval", {})]
        if not values:
            continue
        color = "C0" if runs[members[0]]["family"] == "policy_gradients" else "C1"
        ax.vlines(i, min(values), max(values), color=color, linewidth=3, alpha=0.5)
        ax.scatter([i] * len(values), values, color=color, s=18, zorder=3)
    sft = runs.get("sft", {}).get("eval", {}).get(key)
    if isinstance(sft, int | float):
        ax.axhline(sft, color="gray", linestyle="--", linewidth=1, label=f"SFT {sft:.3f}")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(names)), [n for n, _ in names], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(f"held-out {what}")
    ax.set_title(f"held-out {what}: each seed a dot, bar = min-max")
