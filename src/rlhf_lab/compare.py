"""`rlhf-lab compare --config configs/quickstart/compare.yaml`: every policy-gradient algorithm
(and, optionally, DPO-family losses) from the same SFT checkpoint, with the same budget and seeds,
evaluated on the same held-out prompts; one table and one plot of reward curves.

How a run is put together, with nothing rewritten behind the YAML's back:

    policy gradients   the `base` config (model, data, rewards, rollout, train, optim: the shared
                       budget), its `algorithm` block replaced by the named preset's
                       (configs/policy_gradients/<name>.yaml), then the shared `set` overrides,
                       then the algorithm's own `set` (e.g. Dr. GRPO's normalizer = the base's
                       max_new_tokens); model = the SFT checkpoint
    direct alignment   the `dpo_base` config trained on on-policy pairs sampled once from the SFT
                       model (as the quickstart does), its `loss` block replaced by the preset's

Each run is the package's own trainer writing its own run dir under
`outputs/compare-<time>/<name>/`; `compare.md` / `compare.json` / `compare.png` sit beside them.
The evaluation is the quickstart's: greedy and sampled (T=1) exact match and partial credit,
length, and the per-token KL (k3) to the SFT model, on `eval_size` held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from rlhf_core.config import StrictModel
from rlhf_core.errors import UserFileNotFound

DEFAULT_CONFIG = Path("configs") / "quickstart" / "compare.yaml"


class RunSpec(StrictModel):
    preset: str = Field(
        description="a shipped config whose `algorithm` (policy gradients) or `loss` (direct "
        "alignment) block this run uses"
    )
    set: list[str] = Field(default_factory=list, description="overrides for this run only")


class CompareConfig(StrictModel):
    name: str = Field("compare", description="run name (the output dir is compare-<time>)")
    sft_model: str | None = Field(
        None, description="the SFT model dir every run starts from; null: train "
        "configs/quickstart/sft.yaml first",
    )  # fmt: skip
    base: str = Field(
        "configs/quickstart/grpo.yaml", description="policy-gradient config that sets the shared "
        "budget: model, data, rewards, rollout, train, optim",
    )  # fmt: skip
    set: list[str] = Field(
        default_factory=list, description="overrides applied to every policy-gradient run"
    )
    algorithms: dict[str, RunSpec] = Field(description="policy-gradient runs: name -> preset")
    dpo_base: str = Field(
        "configs/quickstart/dpo.yaml", description="direct-alignment config for the DPO family"
    )
    direct_alignment: dict[str, RunSpec] = Field(
        default_factory=dict, description="optional DPO-family runs: name -> loss preset"
    )
    pairs: int = Field(512, gt=0, description="training prompts for the on-policy pairs")
    eval_size: int = Field(200, gt=0, description="held-out prompts for the final evaluation")


def _pg_config(cfg: CompareConfig, name: str, spec: RunSpec, sft: Path, fast: bool):
    from policy_gradients.config import PGConfig
    from rlhf_core.config import apply_overrides, read_yaml, validate_config

    data = read_yaml(cfg.base)
    data["algorithm"] = read_yaml(spec.preset)["algorithm"]
    data["name"] = f"{cfg.name}_{name}"
    data["model"]["name_or_path"] = str(sft)
    overrides = [*cfg.set, *spec.set] + (["train.max_steps=2"] if fast else [])
    data = apply_overrides(data, overrides)
    source = f"{cfg.base} + algorithm of {spec.preset} (with --set {', '.join(overrides)})"
    return validate_config(PGConfig, data, source)


def _da_config(cfg: CompareConfig, name: str, spec: RunSpec, sft: Path, pairs: Path, fast: bool):
    from direct_alignment.config import DAConfig
    from rlhf_core.config import apply_overrides, read_yaml, validate_config

    data = read_yaml(cfg.dpo_base)
    data["loss"] = read_yaml(spec.preset)["loss"]
    data["name"] = f"{cfg.name}_{name}"
    data["model"]["name_or_path"] = str(sft)
    data["data"]["train"] = {"path": str(pairs / "train.jsonl")}
    data["data"]["eval"] = {"path": str(pairs / "eval.jsonl")}
    overrides = list(spec.set) + (["train.max_steps=2"] if fast else [])
    data = apply_overrides(data, overrides)
    return validate_config(DAConfig, data, f"{cfg.dpo_base} + loss of {spec.preset}")


def _tokens_generated(run_dir: Path) -> int | None:
    path = run_dir / "rollouts.sqlite"
    if not path.is_file():
        return None
    with sqlite3.connect(path) as conn:
        return int(conn.execute("SELECT COALESCE(SUM(length), 0) FROM rollouts").fetchone()[0])


def run_compare(cfg: CompareConfig, out: Path, *, fast: bool = False) -> dict[str, Any]:
    """Train every configured run into `out`, evaluate, write compare.{md,json,png}."""
    from direct_alignment.train import train as train_da
    from policy_gradients.train import train as train_pg
    from rlhf_core.config import RunArgs
    from rlhf_core.data import DataSource
    from rlhf_lab.onpolicy import build_onpolicy_pairs
    from rlhf_lab.quickstart import PAIR_PROMPTS, _config, _run, evaluate_checkpoints

    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}

    def banner(text: str) -> float:
        print(f"\n=== compare: {text} ===", file=sys.stderr, flush=True)
        return time.perf_counter()

    if cfg.sft_model is None:
        from instruction_tuning.config import SFTConfig
        from instruction_tuning.train import train as train_sft

        banner("SFT (configs/quickstart/sft.yaml)")
        sft_cfg = _config("sft", SFTConfig, ["train.max_steps=40"] if fast else [])
        _run(train_sft, sft_cfg, out / "sft", "sft")
        sft = out / "sft" / "final"
    else:
        sft = Path(cfg.sft_model)
        if not (sft / "config.json").is_file():
            raise UserFileNotFound(f"sft_model: {sft} is not a model directory (no config.json)")

    def train_one(trainer, run_cfg, base: str, name: str, spec: RunSpec) -> dict[str, Any]:
        """Run one trainer into out/<name>; its summary.json, plus the wall time."""
        t0 = banner(f"{name} ({spec.preset})")
        code = trainer(run_cfg, RunArgs(config_path=Path(base), output_dir=out / name))
        if code != 0:
            raise RuntimeError(f"compare: {name} exited with {code}")
        summary = json.loads((out / name / "summary.json").read_text())
        return {**summary, "wall_s": time.perf_counter() - t0}

    for name, spec in cfg.algorithms.items():
        pg_cfg = _pg_config(cfg, name, spec, sft, fast)
        summary = train_one(train_pg, pg_cfg, cfg.base, name, spec)
        results[name] = {
            "family": "policy_gradients", "wall_s": summary["wall_s"],
            "first_train_reward": summary.get("first_train_reward"),
            "last_train_reward": summary.get("last_train_reward"),
            "tokens_generated": _tokens_generated(out / name),
        }  # fmt: skip

    if cfg.direct_alignment:
        t0 = banner("on-policy pairs from the SFT model")
        pairs = out / "pairs"
        n = 64 if fast else cfg.pairs
        for split, seed, size in (("train", 1, n), ("eval", 20_000_000, max(8, n // 4))):
            source = DataSource.model_validate(
                {"reasoning_gym": {**PAIR_PROMPTS, "size": size, "seed": seed}}
            )
            build_onpolicy_pairs(sft, source, pairs / f"{split}.jsonl", samples=4,
                                 max_new_tokens=16, seed=seed)  # fmt: skip
        pair_s = time.perf_counter() - t0
        for name, spec in cfg.direct_alignment.items():
            da_cfg = _da_config(cfg, name, spec, sft, pairs, fast)
            summary = train_one(train_da, da_cfg, cfg.dpo_base, name, spec)
            results[name] = {
                "family": "direct_alignment", "wall_s": summary["wall_s"],
                "pairs_s": pair_s, "tokens_generated": None,
                "heldout_reward_accuracy": summary.get("eval/rewards/accuracy"),
            }  # fmt: skip

    banner("evaluate every checkpoint on the same held-out prompts")
    stages = {"sft": sft, **{name: out / name / "final" for name in results}}
    evaluation = evaluate_checkpoints(out, size=64 if fast else cfg.eval_size, stages=stages)
    for name, figures in evaluation.items():
        results.setdefault(name, {"family": "sft"})["eval"] = figures
    report = {"config": cfg.model_dump(), "fast": fast, "sft_model": str(sft), "runs": results}
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_table(out, report)
    plot_curves(out, report)
    return report


def _f(value: Any, spec: str = ".3f") -> str:
    if isinstance(value, int | float) and math.isfinite(value):
        return format(value, spec)
    return "n/a"


def write_table(out: Path, report: dict[str, Any]) -> None:
    runs = report["runs"]
    smoke = " (fast smoke run: the figures are not meaningful)" if report["fast"] else ""
    lines = [
        "# rlhf-lab compare", "", f"From `{report['sft_model']}`, run dir `{out}`{smoke}.", "",
        "| run | family | greedy exact | sampled exact | sampled partial credit | KL to SFT "
        "(k3/token) | train reward first -> last | tokens generated | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, r in runs.items():
        ev = r.get("eval", {})
        reward = "n/a"
        if r.get("first_train_reward") is not None:
            reward = f"{_f(r['first_train_reward'])} -> {_f(r['last_train_reward'])}"
        lines.append(
            f"| {name} | {r['family']} | {_f(ev.get('eval/greedy_task_exact'))} | "
            f"{_f(ev.get('eval/sampled_task_exact'))} | {_f(ev.get('eval/sampled_task'))} | "
            f"{_f(ev.get('eval/sampled_kl_k3'))} | {reward} | "
            f"{_f(r.get('tokens_generated'), 'd')} | {_f(r.get('wall_s'), '.0f')} |"
        )
    lines += ["", "![reward curves](compare.png)", ""]
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


def plot_curves(out: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    key = "train/reward/total"
    for name, r in report["runs"].items():
        metrics = out / name / "metrics.jsonl"
        if r["family"] != "policy_gradients" or not metrics.is_file():
            continue
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        pts = [(x["step"], x[key]) for x in rows if isinstance(x.get(key), int | float)]
        penalties = _penalties(out / name)
        label = name + (f" (incl. {', '.join(penalties)} penalty)" if penalties else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("mean training reward (total)")
    ax.set_title("policy-gradient algorithms from the same SFT model")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from rlhf_core.config import load_config
    from rlhf_core.rundir import locked_run
    from rlhf_core.tracking import timestamp

    parser = argparse.ArgumentParser(prog="rlhf-lab compare", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="compare YAML")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
        help="override a compare-config value",
    )  # fmt: skip
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="default outputs/compare-<time>"
    )
    parser.add_argument("--fast", action="store_true", help="2 steps per run: a smoke test")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    args = parser.parse_args(argv)
    cfg = load_config(CompareConfig, args.config, args.overrides)
    out = args.output_dir or Path("outputs") / f"{cfg.name}-{timestamp()}"
    with locked_run(out, package="compare"):
        run_compare(cfg, out, fast=args.fast)
    print(f"\ntable: {out / 'compare.md'}")
    return 0


if __name__ == "__main__":
    from rlhf_core.errors import run_main

    sys.exit(run_main(main))
