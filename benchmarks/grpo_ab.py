"""One change's own effect on our GRPO step: our arm of `benchmarks.grpo` run from an older
commit and from this tree, in alternating fresh processes on the same prepared workload.

    uv run --group bench python -m benchmarks.grpo_ab --base 9ef3055 --pairs 3 \\
        --model real --micro-batch 32 --dtype bf16 --threads 2 --steps 4

The older commit is checked out with `git worktree` into a temporary folder and its `src` put
first on the worker's PYTHONPATH. The benchmark's own code (the workload, the timing, the
worker) is this tree's for both arms, so only the library differs. Each pair runs both arms
back to back, the order alternating, and the ratio is the median of the per-pair ratios: on a
machine whose speed drifts by 10-20% over an hour (this one's does), a pair sees the same hour.

Reported per arm: the median s/step, the time split (generate, train), tokens per CPU-second
and the peak RSS; and base / this tree for the step time and, per pair, for each phase: a
change to one phase leaves the other's ratio at 1.00x unless the machine's speed moved within
the pair. `--threads 2 --steps 4` is the side-by-side's (`benchmarks.grpo`) setting; the
defaults are the workload's (1 thread, 6 steps).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.grpo import Workload
from benchmarks.measure import (
    REPO_ROOT,
    machine,
    median,
    run_worker,
    spread,
    timestamp,
    write_results,
)
from benchmarks.workload import MODEL_CHOICES

ARMS = ("base", "head")


def compare(w: Workload, base: str, pairs: int, timeout: float = 900) -> dict[str, Any]:
    """`pairs` pairs of fresh `ours` workers, one from `base`'s tree and one from this one."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{base}^{{commit}}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if commit.returncode != 0:
        raise SystemExit(f"--base {base!r}: not a commit of {REPO_ROOT} ({commit.stderr.strip()})")
    sha = commit.stdout.strip()
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-ab-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), sha],
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
        )
        try:
            workdir = Path(tmp) / "work"
            workdir.mkdir()
            common = ["--workload", w.to_json(), "--workdir", str(workdir)]
            run_worker("benchmarks.grpo", ["prepare", *common], threads=w.threads, timeout=timeout)
            for pair in range(pairs):
                for arm in ARMS if pair % 2 == 0 else ARMS[::-1]:
                    env = {"PYTHONPATH": str(tree / "src")} if arm == "base" else None
                    out = run_worker(
                        "benchmarks.grpo",
                        ["ours", *common],
                        threads=w.threads,
                        timeout=timeout,
                        env=env,
                    )
                    out.update(arm=arm, pair=pair)
                    runs.append(out)
                    phases = {
                        k.rsplit("/", 1)[-1]: round(v, 2)
                        for k, v in out["phase_s_mean"].items()
                        if v
                    }
                    print(
                        f"  pair {pair + 1}/{pairs} {arm}: {out['step_s_median']:.3f} s/step "
                        f"{phases}, peak RSS {out['peak_rss_mb']:.0f} MiB",
                        flush=True,
                    )
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)],
                cwd=REPO_ROOT,
                check=False,
                capture_output=True,
            )
    arms: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        arms[arm] = {
            "step_s_median": median([r["step_s_median"] for r in mine]),
            "step_s_range": spread([r["step_s_median"] for r in mine]),
            "tokens_per_cpu_s": median([r["tokens_per_cpu_s"] for r in mine]),
            "peak_rss_mb": median([r["peak_rss_mb"] for r in mine]),
            "phase_s_mean": {
                k: median([r["phase_s_mean"][k] for r in mine]) for k in mine[0]["phase_s_mean"]
            },
        }
    step = {(r["pair"], r["arm"]): r["step_s_median"] for r in runs}
    ratios = [step[(p, "base")] / step[(p, "head")] for p in range(pairs)]
    phase = {(r["pair"], r["arm"]): r["phase_s_mean"] for r in runs}
    phase_ratios = {  # a phase the change does not touch shows the machine's drift in a pair
        name.rsplit("/", 1)[-1]: [phase[(p, "base")][name] / phase[(p, "head")][name]
                                  for p in range(pairs)]
        for name in runs[0]["phase_s_mean"]
        if name.endswith(("generate_s", "train_s"))
    }  # fmt: skip
    return {
        "machine": machine(),
        "workload": w.__dict__,
        "base": sha,
        "head": head + (" with uncommitted changes in src" if dirty else ""),
        "runs": runs,
        "summary": {
            "arms": arms,
            "speedup_per_pair": ratios,
            "speedup": median(ratios),
            "phase_speedup_per_pair": phase_ratios,
        },  # fmt: skip
    }


def markdown(result: dict[str, Any]) -> str:
    w, s = result["workload"], result["summary"]
    lines = [
        f"### GRPO, our arm before and after: `{result['base'][:10]}` (base) vs "
        f"`{result['head'][:10]}{result['head'][40:]}` (head)",
        "",
        f"Model `{w['model']}`, {w['prompts_per_step']} prompts x {w['group_size']} completions x "
        f"{w['max_new_tokens']} tokens, micro-batches of {w['micro_batch'] or 'all'} rows, "
        f"{w['dtype']}, {w['threads']} threads; {w['steps']} steps per process "
        "(the first untimed); "
        f"{len(s['speedup_per_pair'])} pairs, alternating order.",
        "",
        "| arm | s/step (median, range) | generate s | train s | tokens/CPU-s | peak RSS MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for arm in ARMS:
        a = s["arms"][arm]
        phase = {k.rsplit("/", 1)[-1]: v for k, v in a["phase_s_mean"].items()}
        lines.append(
            f"| {arm} | {a['step_s_median']:.3f} ({a['step_s_range']}) | "
            f"{phase.get('generate_s', 0):.2f} | {phase.get('train_s', 0):.2f} | "
            f"{a['tokens_per_cpu_s']:.0f} | {a['peak_rss_mb']:.0f} |"
        )
    per_pair = ", ".join(f"{r:.2f}x" for r in s["speedup_per_pair"])
    lines += ["", f"head / base step rate (median of pairs): **{s['speedup']:.2f}x** ({per_pair})."]
    for name, values in s.get("phase_speedup_per_pair", {}).items():
        each = ", ".join(f"{r:.2f}x" for r in values)
        lines.append(f"- {name}: base / head per pair {each} (median {median(values):.2f}x)")
    if s.get("phase_speedup_per_pair"):
        lines.append(
            "\nA phase the change does not touch should stay near 1.00x in every pair; where it "
            "moves, the machine's speed moved between the two runs of that pair."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.grpo_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base", required=True, help="the commit to compare this tree against")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--model", choices=MODEL_CHOICES, default="real")
    defaults = Workload()
    fields = (
        "prompts_per_step",
        "group_size",
        "max_new_tokens",
        "steps",
        "threads",
        "micro_batch",
        "dtype",
    )
    for field in fields:
        value = getattr(defaults, field)
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs {args.pairs}: expected at least 1")
    w = replace(defaults, model=args.model, **{f: getattr(args, f) for f in fields})
    print(f"GRPO A/B: {args.base} vs this tree, {w}, {args.pairs} pairs", flush=True)
    result = compare(w, args.base, args.pairs)
    text = markdown(result)
    paths = write_results(
        f"{timestamp()}-grpo-ab", {"grpo_ab": result, "command": sys.argv}, text, latest=False
    )
    print("\n" + text + f"\nwrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
