"""`rlhf-lab quickstart`: SFT -> on-policy pairs -> reward model -> GRPO and RLOO-with-the-RM ->
DPO -> one evaluation of every checkpoint -> report.md and report.png. Offline, on the tiny world.

Every stage is the same trainer a user runs by hand with the YAML in `configs/quickstart/`
(listed in the README); the quickstart only points each stage at the previous stage's output
inside its own run dir, `outputs/quickstart-<timestamp>/<stage>/`.

The evaluation uses one set of held-out spell_backward prompts (seeds far from training) for every
checkpoint: greedy and sampled (T=1) exact match, the task's partial-credit score, mean length,
and the per-token KL (k3) to the SFT model on the sampled completions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_core.stop_signal import StopSignal

REPO_CONFIGS = Path("configs") / "quickstart"
HELDOUT = {
    "task": "spell_backward",
    "seed": 10_000_000,
    "config": {"min_word_len": 3, "max_word_len": 10},
}
PAIR_PROMPTS = {"task": "spell_backward", "config": HELDOUT["config"]}
EVAL_STAGES = ("sft", "grpo", "rloo_rm", "dpo")


def _config(name: str, cls: Any, overrides: list[str]) -> Any:
    from rlhf_core.config import load_config

    return load_config(cls, REPO_CONFIGS / f"{name}.yaml", overrides)


class StageInterrupted(Exception):
    """A stage stopped on SIGINT/SIGTERM after saving its checkpoint."""

    def __init__(self, stage: str, code: int) -> None:
        super().__init__(f"stage {stage} stopped by a signal (exit {code})")
        self.stage, self.code = stage, code


def _run(trainer: Any, cfg: Any, out: Path, config_name: str) -> dict[str, Any]:
    """Run one stage into `out`, or reuse it if it already finished (a `--resume` of the
    quickstart); a stage stopped part-way continues from its newest checkpoint."""
    from rlhf_core.config import RunArgs
    from rlhf_core.rundir import run_status

    summary = out / "summary.json"
    if summary.is_file() and run_status(out).get("status") == "finished":
        print(f"stage {config_name}: finished earlier, reusing {out}", file=sys.stderr)
        return json.loads(summary.read_text())
    resume = "auto" if out.exists() else None
    code = trainer(cfg, RunArgs(config_path=REPO_CONFIGS / f"{config_name}.yaml",
                                output_dir=out, resume=resume))  # fmt: skip
    if code in (130, 143):
        raise StageInterrupted(config_name, code)
    if code != 0:
        raise RuntimeError(f"stage {config_name} exited with {code}")
    return json.loads(summary.read_text())


def run_quickstart(
    out: Path, *, fast: bool = False, sft_from: Path | None = None, seed: int = 0,
    stop: StopSignal | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run every stage into `out`; returns the report's figures. `fast` shortens every stage
    (a CI smoke run of a minute or two: the figures are then not meaningful). `sft_from` reuses
    an SFT model directory instead of training stage 1. `seed` is every trainer's seed and the
    offset of the pairs' sampling seed (0: the shipped configs as they are); the prompts, the
    held-out set and its sampling seed stay the same, so seeds differ only in training. `stop`:
    the caller's `rlhf_core.checkpoint.StopSignal`; a signal it caught ends the run at the next
    stage (a trainer running then stops at its next step, after a checkpoint)."""
    from direct_alignment.config import DAConfig
    from direct_alignment.train import train as train_dpo
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train as train_sft
    from policy_gradients.config import PGConfig
    from policy_gradients.train import train as train_pg
    from reward_models.config import RMConfig
    from reward_models.train import train as train_rm
    from rlhf_lab.onpolicy import PairsConfig, build_pairs

    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    figures: dict[str, Any] = {"run_dir": str(out), "fast": fast, "seed": seed}
    seeded = [f"seed={seed}"] if seed else []

    def stage(name: str):
        if stop is not None and stop.requested:
            raise StageInterrupted(name, stop.exit_code)
        print(f"\n=== quickstart stage: {name} ===", file=sys.stderr, flush=True)
        return time.perf_counter()

    short = {
        "sft": ["train.max_steps=40"],
        "pairs": [
            "splits.train.prompts.reasoning_gym.size=64",
            "splits.eval.prompts.reasoning_gym.size=16",
        ],
        "rm": ["train.epochs=1"],
        "grpo": ["train.max_steps=6"],
        "rloo_rm": ["train.max_steps=3", "rollout.prompts_per_step=8"],
        "dpo": ["train.epochs=1"],
    }

    t0 = stage("sft")
    sft_dir = out / "sft"
    if sft_from is None:
        sft_cfg = _config("sft", SFTConfig, seeded + (short["sft"] if fast else []))
        _run(train_sft, sft_cfg, sft_dir, "sft")
    elif not (sft_dir / "final").is_dir():
        import shutil

        tmp = sft_dir / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(sft_from, tmp)
        tmp.rename(sft_dir / "final")
    sft_final = sft_dir / "final"
    times["sft"] = time.perf_counter() - t0

    t0 = stage("pairs (sample the SFT model, grade, pair)")
    pair_stats, stats_path = {}, out / "pairs" / "stats.json"
    if stats_path.is_file():  # built by an earlier, interrupted run of this quickstart
        pair_stats = json.loads(stats_path.read_text())
    else:
        pairs_over = [f"model.name_or_path={sft_final}"] + (short["pairs"] if fast else [])
        if seed:
            train_seed = _config("pairs", PairsConfig, []).splits["train"].seed
            pairs_over.append(f"splits.train.seed={train_seed + seed}")
        pair_stats = build_pairs(_config("pairs", PairsConfig, pairs_over), out / "pairs")
        stats_path.write_text(json.dumps(pair_stats, indent=2) + "\n")  # written last: done
    figures["pairs"] = pair_stats
    times["pairs"] = time.perf_counter() - t0

    t0 = stage("reward model (Bradley-Terry on the on-policy pairs)")
    on_pairs = [f"model.name_or_path={sft_final}", f"data.train.path={out / 'pairs/train.jsonl'}",
                f"data.eval.path={out / 'pairs/eval.jsonl'}"]  # fmt: skip
    rm_over = on_pairs + seeded + (short["rm"] if fast else [])
    figures["rm"] = _run(train_rm, _config("rm", RMConfig, rm_over), out / "rm", "rm")
    times["rm"] = time.perf_counter() - t0

    t0 = stage("GRPO with the verifiable reward")
    grpo_over = [f"model.name_or_path={sft_final}"] + seeded + (short["grpo"] if fast else [])
    figures["grpo"] = _run(train_pg, _config("grpo", PGConfig, grpo_over), out / "grpo", "grpo")
    times["grpo"] = time.perf_counter() - t0

    t0 = stage("RLOO with the learned reward model")
    rloo_over = [f"model.name_or_path={sft_final}", f"rewards.0.path={out / 'rm' / 'final'}"]
    rloo_over += seeded
    rloo_cfg = _config("rloo_rm", PGConfig, rloo_over + (short["rloo_rm"] if fast else []))
    figures["rloo_rm"] = _run(train_pg, rloo_cfg, out / "rloo_rm", "rloo_rm")
    figures["overoptimization"] = _overoptimization(out / "rloo_rm")
    times["rloo_rm"] = time.perf_counter() - t0

    t0 = stage("DPO on the on-policy pairs")
    dpo_over = on_pairs + seeded + (short["dpo"] if fast else [])
    figures["dpo"] = _run(train_dpo, _config("dpo", DAConfig, dpo_over), out / "dpo", "dpo")
    times["dpo"] = time.perf_counter() - t0

    t0 = stage("evaluate every checkpoint on the same held-out prompts")
    figures["eval"] = evaluate_checkpoints(out, size=64 if fast else 200)
    times["eval"] = time.perf_counter() - t0
    figures["times_s"] = times
    write_report(out, figures)
    return figures


def _overoptimization(run_dir: Path) -> dict[str, Any] | None:
    """The RLOO stage's proxy/gold/KL series (written by the trainer), for the report."""
    path = run_dir / "overoptimization.json"
    if not path.is_file():
        return None
    series = json.loads(path.read_text())
    train = series["train"]
    proxy, gold = train[f"proxy/{series['proxy'][0]}"], train[f"gold/{series['gold'][0]}"]
    best = max(range(len(gold)), key=gold.__getitem__)
    kl = [v if v is not None else math.nan for v in train["kl_sequence"]]
    return {"proxy": proxy, "gold": gold, "kl": kl, "best_gold_step": train["step"][best]}


def evaluate_checkpoints(
    out: Path, *, size: int, stages: dict[str, Path] | None = None
) -> dict[str, dict[str, float]]:
    """Greedy/sampled exact match, partial credit, length and KL to SFT for each stage's model.

    `stages` maps a name to a model dir (default: the quickstart's stages under `out`); the one
    named `sft` is the KL reference and supplies the tokenizer."""
    import torch

    from policy_gradients.evaluate import evaluate_policy
    from policy_gradients.rewards import CombinedReward
    from policy_gradients.rollout import load_prompts
    from rlhf_core.data import DataSource
    from rlhf_core.models import ModelConfig, ReferencePolicy, load_policy, load_tokenizer

    if stages is None:
        stages = {name: out / name / "final" for name in EVAL_STAGES}
    sft_cfg = ModelConfig(name_or_path=str(stages["sft"]))
    tokenizer = load_tokenizer(sft_cfg, padding_side="left")
    prompts = load_prompts(
        DataSource.model_validate({"reasoning_gym": {**HELDOUT, "size": size}}), tokenizer,
        prompt_column="prompt", answer_column="answer", prompt_template="{question}",
        system_prompt=None, where="quickstart.eval",
    )  # fmt: skip
    reference = ReferencePolicy(load_policy(sft_cfg), "frozen")
    reward = CombinedReward([{"name": "reasoning_gym", "extract": "full", "label": "task"}])
    results = {}
    for name, path in stages.items():
        policy = load_policy(ModelConfig(name_or_path=str(path))).eval()
        with torch.no_grad():
            results[name] = evaluate_policy(
                policy, reference, tokenizer, prompts, reward, max_new_tokens=16,
                temperature=1.0, batch_size=64, seed=1234,
            )  # fmt: skip
    return results


ROWS = [
    ("greedy exact match", "eval/greedy_task_exact"),
    ("sampled exact match (T=1)", "eval/sampled_task_exact"),
    ("greedy partial credit", "eval/greedy_task"),
    ("sampled partial credit", "eval/sampled_task"),
    ("mean length (sampled)", "eval/sampled_length"),
    ("KL to SFT (k3, per token)", "eval/sampled_kl_k3"),
]


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "n/a"


def write_report(out: Path, figures: dict[str, Any]) -> None:
    """report.md (tables of stages, figures and wall times) and report.png."""
    ev, times, rm = figures["eval"], figures["times_s"], figures["rm"]
    pairs, grpo, rloo, dpo = figures["pairs"], figures["grpo"], figures["rloo_rm"], figures["dpo"]
    smoke = " (fast smoke run: the figures are not meaningful)" if figures["fast"] else ""
    seed = f"; seed {figures['seed']}" if figures.get("seed") else ""
    lines = ["# rlhf-lab quickstart report", "", f"Run dir: `{out}`{seed}{smoke}", ""]
    lines += ["## Held-out evaluation (the same prompts for every checkpoint)", ""]
    lines += ["| metric | " + " | ".join(EVAL_STAGES) + " |", "|---" * (len(EVAL_STAGES) + 1) + "|"]
    for label, key in ROWS:
        cells = " | ".join(_fmt(ev[s].get(key)) for s in EVAL_STAGES)
        lines.append(f"| {label} | {cells} |")
    table_end = len(lines)
    notes = {
        "sft": "partly trained policy: the start of every later stage",
        "pairs": f"{pairs['train']['pairs']} train pairs from {pairs['train']['prompts']} prompts "
        f"(sample accuracy {_fmt(pairs['train']['sample_accuracy'])}), "
        f"{pairs['eval']['pairs']} held-out pairs",
        "rm": f"held-out pairwise accuracy {_fmt(rm.get('eval/accuracy'))}",
        "grpo": f"train reward {_fmt(grpo.get('first_train_reward'))} -> "
        f"{_fmt(grpo.get('last_train_reward'))}",
        "rloo_rm": f"learned reward {_fmt(rloo.get('first_train_reward'))} -> "
        f"{_fmt(rloo.get('last_train_reward'))}",
        "dpo": f"loss {(dpo.get('loss') or {}).get('name', 'dpo')}; reward accuracy: train "
        f"{_fmt(dpo.get('final_train/rewards/accuracy'))}, "
        f"held-out {_fmt(dpo.get('eval/rewards/accuracy'))}",
        "eval": f"{len(EVAL_STAGES)} checkpoints",
    }
    lines += ["", "## Stages", "", "| stage | wall time (s) | figures |", "|---|---|---|"]
    lines += [f"| {name} | {secs:.1f} | {notes.get(name, '')} |" for name, secs in times.items()]
    total = sum(times.values())
    lines += [f"| **total** | {total:.1f} | |", "", "## Against the targets", ""]
    key = "eval/sampled_task_exact"
    base = ev["sft"][key]
    partial = "eval/sampled_task"
    targets = {"grpo": 10.0, "rloo_rm": 5.0}  # points of sampled exact match over SFT
    for name in ("grpo", "rloo_rm", "dpo"):
        delta = 100 * (ev[name][key] - base)
        partial_delta = 100 * (ev[name][partial] - ev["sft"][partial])
        target, verdict = targets.get(name), ""
        if target is not None and delta < target and name == "rloo_rm":
            verdict = (
                f"; target missed on this run. The learned reward model is right on "
                f"{_fmt(rm.get('eval/accuracy'))} of held-out pairs; RL against it bought "
                f"sampled partial credit {partial_delta:+.1f} points: the RM rewards more than "
                "exact answers (reward over-optimisation, Gao et al. 2022, below)"
            )
        elif target is not None and delta < target:
            verdict = f"; target missed on this run (partial credit {partial_delta:+.1f} points)"
        elif delta <= 0:
            verdict = f" (no improvement on this run; partial credit {partial_delta:+.1f} points)"
        shown = f" (target +{target:.0f})" if target is not None else ""
        lines.append(
            f"- {name} vs SFT, sampled exact match: {_fmt(base)} -> {_fmt(ev[name][key])} "
            f"({delta:+.1f} points){shown}{verdict}"
        )
    accuracy = rm.get("eval/accuracy")
    missed = "; target missed on this run" if accuracy is not None and accuracy < 0.8 else ""
    lines.append(
        f"- reward model held-out pairwise accuracy: {_fmt(accuracy)} (target >= 0.80){missed}"
    )
    lines.append(f"- total wall time: {total:.0f} s (target <= 600 s on 2 CPU cores)")
    over = figures.get("overoptimization")
    if over:
        lines += ["", "## Reward over-optimisation (RLOO against the learned reward model)", ""]
        lines += [
            f"Proxy = the learned RM's reward, gold = the verifier's exact match on the same "
            f"training rollouts (weight 0: measured, not optimised), per step; KL = k3 estimate "
            f"of KL(pi || SFT) per sequence (Gao et al. 2022). Proxy {_fmt(over['proxy'][0])} -> "
            f"{_fmt(over['proxy'][-1])}, gold {_fmt(over['gold'][0])} -> "
            f"{_fmt(over['gold'][-1])} (best {_fmt(max(over['gold']))} at step "
            f"{over['best_gold_step']}), KL {_fmt(over['kl'][-1])} nats at the end.",
            "", "![over-optimisation](rloo_rm/overoptimization.png)",
        ]  # fmt: skip
    lines += ["", "![report](report.png)", ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "figures.json").write_text(json.dumps(figures, indent=2, default=str) + "\n")
    _plot(out, figures)
    print("\n".join(lines[:table_end]), flush=True)


def _plot(out: Path, figures: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ev = figures["eval"]
    xs = range(len(EVAL_STAGES))
    for offset, (label, key) in zip((-0.2, 0.0, 0.2), ROWS[:3], strict=True):
        axes[0].bar(
            [x + offset for x in xs], [ev[s][key] for s in EVAL_STAGES], width=0.2, label=label
        )
    axes[0].set_xticks(list(xs), EVAL_STAGES)
    axes[0].set_title("held-out accuracy per stage")
    axes[0].legend(fontsize=7)
    key = "train/reward/total"
    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    axes[1].plot([p[0] for p in pts], [p[1] for p in pts])
    axes[1].set_title("GRPO train reward (verifier)")
    axes[1].set_xlabel("step")
    # RLOO against the learned RM: proxy (what it optimises) vs gold (the verifier, weight 0)
    over = out / "rloo_rm" / "overoptimization.json"
    ax = axes[2]
    if over.is_file():
        series = json.loads(over.read_text())
        train, right = series["train"], ax.twinx()
        for axis, role, colour in ((ax, "proxy", "C0"), (right, "gold", "C1")):
            label = series[role][0]
            axis.plot(train["step"], train[f"{role}/{label}"], color=colour, label=role)
            axis.set_ylabel(f"{role}: {label}", color=colour)
        ax.set_title("RLOO + learned RM: proxy vs gold reward")
    ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "report.png", dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from rlhf_core.errors import UserError
    from rlhf_core.rundir import locked_run
    from rlhf_core.stop_signal import StopSignal
    from rlhf_core.tracking import timestamp

    parser = argparse.ArgumentParser(prog="rlhf-lab quickstart", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="default outputs/quickstart-<time>"
    )
    parser.add_argument("--fast", action="store_true", help="a 1-2 minute smoke run (CI)")
    parser.add_argument(
        "--sft-from", type=Path, default=None, help="reuse this SFT model dir (skip stage 1)"
    )
    parser.add_argument(
        "--resume", nargs="?", const="latest", default=None, metavar="DIR",
        help="continue an interrupted quickstart (default: the newest outputs/quickstart-*): "
        "finished stages are reused, a stage stopped part-way continues from its checkpoint",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=0,
        help="every trainer's seed (0: the shipped configs); the data and held-out set stay fixed",
    )  # fmt: skip
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    args = parser.parse_args(argv)
    if args.resume is not None:
        out = Path(args.resume) if args.resume != "latest" else _latest_quickstart()
        saved = out / "quickstart.json"
        if not saved.is_file():
            raise UserError(f"--resume {out}: not a quickstart run dir (no quickstart.json)")
        options = json.loads(saved.read_text())
        if args.fast or args.sft_from or args.seed:
            raise UserError("--resume uses the run's own options; drop --fast/--sft-from/--seed")
    else:
        out = args.output_dir or Path("outputs") / f"quickstart-{timestamp()}"
        options = {"fast": args.fast, "sft_from": str(args.sft_from) if args.sft_from else None,
                   "seed": args.seed}  # fmt: skip
    with locked_run(out, package="quickstart", resume=args.resume is not None) as outcome:
        (out / "quickstart.json").write_text(json.dumps(options) + "\n")
        try:
            with StopSignal() as stop:  # Ctrl-C: the stage running stops at a checkpoint
                run_quickstart(
                    out,
                    fast=options["fast"],
                    sft_from=Path(options["sft_from"]) if options["sft_from"] else None,
                    seed=options.get("seed", 0),
                    stop=stop,
                )  # a signal during the evaluation or the report: they finish, exit 0
        except (StageInterrupted, KeyboardInterrupt) as exc:
            outcome.exit_code = exc.code if isinstance(exc, StageInterrupted) else 130
            print(f"\nquickstart interrupted; continue it with:\n  rlhf-lab quickstart "
                  f"--resume {out}", file=sys.stderr)  # fmt: skip
            return outcome.exit_code
    print(f"\nreport: {out / 'report.md'}")
    return 0


def _latest_quickstart() -> Path:
    from rlhf_core.errors import UserError

    runs = sorted(Path("outputs").glob("quickstart-*"), key=lambda p: p.stat().st_mtime)
    runs = [p for p in runs if (p / "quickstart.json").is_file()]
    if not runs:
        raise UserError("--resume: no outputs/quickstart-* run to continue; pass its directory")
    return runs[-1]


if __name__ == "__main__":
    from rlhf_core.errors import run_main

    sys.exit(run_main(main))
