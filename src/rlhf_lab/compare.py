"""`rlhf-lab compare --config configs/quickstart/compare.yaml`: every policy-gradient algorithm
(and, optionally, DPO-family losses) from the same SFT checkpoint, with the same budget and seeds,
evaluated on the same held-out prompts; one table and one plot of reward curves. Any prompt set,
judged by a verifier, a learned reward model, or both (configs/compare_hh/: GPT-2 on Anthropic
HH with a reward model trained on HH, docs/workflows/gpt2_hh.md).

How a run is put together, with nothing rewritten behind the YAML's back:

    policy gradients   the `base` config (model, data, rewards, rollout, train, optim: the shared
                       budget), its `algorithm` block replaced by the named preset's
                       (configs/policy_gradients/<name>.yaml), then the shared `set` overrides,
                       then the algorithm's own `set` (e.g. Dr. GRPO's normalizer = the base's
                       max_new_tokens, or an arm's own lr); model = the SFT checkpoint
    direct alignment   the `dpo_base` config trained on on-policy pairs sampled once from the SFT
                       model (`rlhf_lab.onpolicy`, `pair_samples` per prompt, at the base's
                       rollout length and temperature) on the base's training prompts (the first
                       `pairs`, and the next `pairs // 4` as the DPO runs' held-out pairs), its
                       `loss` block replaced by the preset's. The judge (`pairs_judge: auto`): the
                       verifier on reasoning-gym prompts, else the reward model (chosen = the
                       sample it scores highest, rejected = the lowest)

Each run is the package's own trainer writing its own run dir under
`outputs/compare-<time>/<name>/`; `compare.md` / `compare.json` / `compare.png` sit beside them.

The evaluation (`rlhf_lab.evaluate.evaluate_models`): `eval_size` held-out prompts
(`eval_prompts`, else the base's `data.eval`, read with the base's prompt format, columns and
template), one greedy and one sampled completion per prompt and model at the base's rollout
length and temperature (the same sampling seed for every model), scored by

    verifier      each `verifier` component (e.g. gsm8k): its mean and accuracy (share of 1.0)
    reward_model  its mean score, and the win rate against the SFT model: per prompt, this
                  model's sample against the SFT model's, both scored by it (a tie counts half)
    KL            per-token KL (k3 and k1) of the sampled completions to the SFT model

With `seeds: [0, 1]` (or `--seeds 0 1`) every run trains once per seed, into `<name>-seed<k>/`
(the DPO family's pairs are sampled once); the table adds a row per algorithm (its figure per
seed, mean, spread and gain over the SFT model) and the plot each algorithm's spread
(`rlhf_lab.compare_report`). `--resume` reuses the finished runs of an --output-dir.

With `jobs: N` (or `--jobs N`) the policy-gradient runs, then the DPO-family runs, then the
evaluation's models train or are evaluated N at a time in worker processes, each at `threads`
torch threads (default 1 when N > 1), the longest runs first (`rlhf_lab.compare_pool`); every
run's figures are those it gets alone at that thread count.
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

from rlhf_core.data import DataSource
from rlhf_core.errors import UserError, UserFileNotFound
from rlhf_lab.compare_config import (  # CompareConfig, _pg_config, _seeded: also imported from here
    CompareConfig,
    _da_config,
    _pg_config,
    _pg_cost,
    _seeded,
    run_threads,
)
from rlhf_lab.compare_pool import RunFailed
from rlhf_lab.compare_report import RM_LABEL, plot_curves, seed_summary, write_table

DEFAULT_CONFIG = Path("configs") / "quickstart" / "compare.yaml"


def _model_dir(path: str, field: str) -> Path:
    if not (Path(path) / "config.json").is_file():
        raise UserFileNotFound(f"{field}: {path} is not a model directory (no config.json)")
    return Path(path)


def _heldout_sources(cfg: CompareConfig, base: Any, size: int) -> DataSource:
    """The held-out prompts, checked to share no example with the training prompts."""
    from rlhf_core.data import check_heldout_seeds
    from rlhf_lab.onpolicy import sized

    source = cfg.eval_prompts or base.data.eval
    if source is None:
        raise UserError(
            f"compare: no held-out prompts: set eval_prompts, or data.eval in {cfg.base}"
        )
    source = sized(source, size)
    train = base.data.train
    check_heldout_seeds(train, source)
    if source.path is not None and (source.path, source.split) == (train.path, train.split):
        (a0, a1), (b0, b1) = [(d.offset, d.offset + (d.limit or math.inf)) for d in (train, source)]
        if a0 < b1 and b0 < a1:
            raise UserError(
                f"compare: the held-out prompts (rows {b0}..{b1} of {source.path}) overlap the "
                f"training prompts of {cfg.base} (rows {a0}..{a1}); set offset/limit so they "
                "are disjoint"
            )
    return source


def _tokens_generated(run_dir: Path) -> int | None:
    path = run_dir / "rollouts.sqlite"
    if not path.is_file():
        return None
    with sqlite3.connect(path) as conn:
        return int(conn.execute("SELECT COALESCE(SUM(length), 0) FROM rollouts").fetchone()[0])


def pairs_judge(cfg: CompareConfig, base: Any) -> str:
    """Who judges the DPO family's pairs: `pairs_judge`, with auto resolved (see the docstring)."""
    judge = cfg.pairs_judge
    if judge == "auto":
        rg = base.data.train.reasoning_gym is not None
        judge = "verifier" if cfg.verifier and rg else "reward_model"
    if judge == "reward_model" and cfg.reward_model is None:
        raise UserError(
            "compare: the DPO-family runs need a judge for their on-policy pairs: set "
            "reward_model (or a verifier, on reasoning-gym prompts)"
        )
    return judge


def build_compare_pairs(
    cfg: CompareConfig, base: Any, sft: Path, out: Path, n: int
) -> dict[str, dict[str, float]]:
    """On-policy pairs from the SFT model on the base's prompts (rendered as the base renders
    them), judged by the verifier or the reward model; writes out/{train,eval}.jsonl."""
    from rlhf_core.models import ModelConfig
    from rlhf_lab.onpolicy import PairsConfig, PairSplit, build_pairs, pair_splits

    splits, judge = pair_splits(base.data.train, n), pairs_judge(cfg, base)
    pairs_cfg = PairsConfig(
        model=ModelConfig(name_or_path=str(sft)),
        splits={k: PairSplit(prompts=src, seed=seed) for k, (src, seed) in splits.items()},
        samples=cfg.pair_samples, max_new_tokens=base.rollout.max_new_tokens,
        temperature=base.rollout.temperature, judge=judge,
        reward_model=cfg.reward_model if judge == "reward_model" else None,
    )  # fmt: skip
    prompt_args = {k: v for k, v in base.prompt_args().items() if k != "answer_needed_by"}
    return build_pairs(pairs_cfg, out, prompt_args=prompt_args)


def evaluate_compare(
    cfg: CompareConfig, base: Any, stages: dict[str, Path], size: int
) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, Any]]]]:
    """Every stage on the held-out prompts (see the module docstring); `stages["sft"]` is the
    KL reference, the win-rate baseline and the tokenizer."""
    from policy_gradients.rewards import CombinedReward, answer_needed_by
    from policy_gradients.rollout import load_prompts
    from rlhf_core.models import ModelConfig, load_tokenizer
    from rlhf_lab.evaluate import evaluate_models

    specs = list(cfg.verifier)
    if cfg.reward_model is not None:
        specs.append({"name": "reward_model", "path": cfg.reward_model, "label": RM_LABEL})
    if not specs:
        raise UserError("compare: nothing to evaluate with: set reward_model and/or verifier")
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(stages["sft"])), padding_side="left")
    args = {**base.prompt_args(), "answer_needed_by": answer_needed_by(specs)}
    source = _heldout_sources(cfg, base, size)
    prompts = load_prompts(source, tokenizer, where="compare eval_prompts", **args)
    reward = CombinedReward(specs, strip_thinking=base.strip_thinking)
    return evaluate_models(
        stages, "sft", prompts, tokenizer, reward,
        win_label=RM_LABEL if cfg.reward_model is not None else None,
        max_new_tokens=base.rollout.max_new_tokens, temperature=base.rollout.temperature,
    )  # fmt: skip


def _evaluate_part(
    cfg: CompareConfig, base: Any, stages: dict[str, Path], size: int, threads: int | None
) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, Any]]]]:
    """`evaluate_compare` at `threads` torch threads (in a worker process)."""
    from rlhf_core.runtime import configure_threads

    if threads is not None:
        configure_threads(threads)
    return evaluate_compare(cfg, base, stages, size)


def evaluate_all(
    cfg: CompareConfig, base: Any, stages: dict[str, Path], size: int, out: Path
) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, Any]]]]:
    """`evaluate_compare` of every stage; with jobs > 1 the models are split over the workers,
    each evaluating the SFT model too (the KL reference and win-rate baseline), with the same
    sampling seed per model, so the figures are those of one evaluation."""
    from rlhf_lab.compare_pool import in_workers

    names = [name for name in stages if name != "sft"]
    parts = [names[i :: cfg.jobs] for i in range(cfg.jobs) if names[i :: cfg.jobs]]
    if len(parts) < 2:
        return evaluate_compare(cfg, base, stages, size)
    threads = run_threads(cfg)
    tasks = {}
    for i, part in enumerate(parts):
        models = {"sft": stages["sft"], **{n: stages[n] for n in part}}
        tasks[f"evaluate-{i}"] = (_evaluate_part, (cfg, base, models, size, threads))
    done = in_workers(tasks, out / "logs", cfg.jobs)
    figures = {k: v for part in done.values() for k, v in part[0].items()}
    samples = {k: v for part in done.values() for k, v in part[1].items()}
    return {n: figures[n] for n in stages}, {n: samples[n] for n in stages}


def run_compare(
    cfg: CompareConfig, out: Path, *, fast: bool = False, resume: bool = False
) -> dict[str, Any]:
    """Train every configured run into `out`, evaluate, write compare.{md,json,png}. With
    `resume`, runs (and pairs) that finished earlier in `out` are reused, a run stopped part-way
    continues from its newest checkpoint. `cfg.jobs` runs at a time (rlhf_lab.compare_pool)."""
    from rlhf_core.config import load_config
    from rlhf_core.runtime import configure_threads
    from rlhf_lab.compare_pool import Run, train_runs

    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    phases: dict[str, float] = {}
    threads = run_threads(cfg)
    if threads is not None:  # the pairs and a one-job evaluation run in this process
        configure_threads(threads)

    def banner(text: str) -> float:
        print(f"\n=== compare: {text} ===", file=sys.stderr, flush=True)
        return time.perf_counter()

    if cfg.reward_model is not None:
        _model_dir(cfg.reward_model, "reward_model")
    if cfg.sft_model is None:
        from instruction_tuning.config import SFTConfig
        from instruction_tuning.train import train as train_sft
        from rlhf_lab.quickstart import _run

        t0 = banner(f"SFT ({cfg.sft_config})")
        sft_set = (["train.max_steps=40"] if fast else []) + (
            [] if threads is None else [f"train.threads={threads}"]
        )
        _run(train_sft, load_config(SFTConfig, cfg.sft_config, sft_set), out / "sft", "sft")
        sft, phases["sft"] = out / "sft" / "final", time.perf_counter() - t0
    else:
        sft = _model_dir(cfg.sft_model, "sft_model")
    base = _pg_config(cfg, "base", None, sft, fast)
    eval_size = min(cfg.eval_size, 64) if fast else cfg.eval_size
    _heldout_sources(cfg, base, eval_size)  # fail before training, not after
    if cfg.direct_alignment:
        pairs_judge(cfg, base)

    pg_runs = []
    for (algorithm, spec), (name, seed) in (
        (a, s) for a in cfg.algorithms.items() for s in _seeded(cfg, a[0])
    ):
        pg_cfg = _pg_config(cfg, name, spec, sft, fast, seed)
        pg_runs.append(Run(name, "policy_gradients", pg_cfg, cfg.base, spec.preset,
                           _pg_cost(pg_cfg)))  # fmt: skip
        results[name] = {"family": "policy_gradients", "algorithm": algorithm, "seed": pg_cfg.seed}
    t0 = banner(f"{len(pg_runs)} policy-gradient runs, {cfg.jobs} at a time")
    for name, summary in train_runs(pg_runs, out, resume=resume, jobs=cfg.jobs).items():
        results[name].update({
            "wall_s": summary["wall_s"],
            "first_train_reward": summary.get("first_train_reward"),
            "last_train_reward": summary.get("last_train_reward"),
            "tokens_generated": _tokens_generated(out / name),
        })  # fmt: skip
    phases["policy_gradients"] = time.perf_counter() - t0

    if cfg.direct_alignment:
        t0 = banner("on-policy pairs from the SFT model")
        n = min(cfg.pairs, 64) if fast else cfg.pairs
        if resume and (out / "pairs" / "summary.json").is_file():
            pair_stats = json.loads((out / "pairs" / "summary.json").read_text())
        else:
            pair_stats = build_compare_pairs(cfg, base, sft, out / "pairs", n)
        pair_s = phases["pairs"] = time.perf_counter() - t0
        da_runs = []
        for (algorithm, spec), (name, seed) in (
            (a, s) for a in cfg.direct_alignment.items() for s in _seeded(cfg, a[0])
        ):
            da_cfg = _da_config(cfg, name, spec, sft, out / "pairs", fast, seed)
            da_runs.append(Run(name, "direct_alignment", da_cfg, cfg.dpo_base, spec.preset))
            results[name] = {"family": "direct_alignment", "algorithm": algorithm,
                             "seed": da_cfg.seed}  # fmt: skip
        t0 = banner(f"{len(da_runs)} direct-alignment runs, {cfg.jobs} at a time")
        for name, summary in train_runs(da_runs, out, resume=resume, jobs=cfg.jobs).items():
            results[name].update({
                "wall_s": summary["wall_s"],
                "pairs_s": pair_s, "pairs": pair_stats["train"]["pairs"],
                "tokens_generated": None,
                "heldout_reward_accuracy": summary.get("eval/rewards/accuracy"),
            })  # fmt: skip
        phases["direct_alignment"] = time.perf_counter() - t0

    t0 = banner("evaluate every checkpoint on the same held-out prompts")
    stages = {"sft": sft, **{name: out / name / "final" for name in results}}
    evaluation, samples = evaluate_all(cfg, base, stages, eval_size, out)
    phases["evaluation"] = time.perf_counter() - t0
    for name, figures in evaluation.items():
        results.setdefault(name, {"family": "sft"})["eval"] = figures
    results = {"sft": results.pop("sft"), **results}
    (out / "samples.jsonl").write_text("".join(  # each held-out prompt's sampled completions
        json.dumps({"prompt": rows[0]["prompt"], **{
            name: {"completion": row["completion"], "scores": row["scores"]}
            for name, row in zip(samples, rows, strict=True)
        }}) + "\n" for rows in zip(*samples.values(), strict=True)
    ))  # fmt: skip
    report = {
        "config": cfg.model_dump(), "fast": fast, "sft_model": str(sft), "eval_prompts":
        len(samples["sft"]), "verifiers": [s["label"] for s in cfg.verifier],
        "reward_model": cfg.reward_model, "seeds": cfg.seeds, "jobs": cfg.jobs,
        "threads": threads, "resumed": resume, "phases_s": phases, "runs": results,
    }  # fmt: skip
    report["summary"] = seed_summary(report)
    report["wall_s"] = time.perf_counter() - start
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_table(out, report)
    plot_curves(out, report)
    return report


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
    parser.add_argument(
        "--fast", action="store_true", help="2 steps per run, <= 64 pairs and held-out prompts"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, metavar="K",
        help="train every run once per seed (sets the YAML's seeds)",
    )  # fmt: skip
    parser.add_argument(
        "--jobs", type=int, default=None, metavar="N",
        help="train N runs at once, each in its own process (sets the YAML's jobs)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=None, metavar="T",
        help="torch threads per run (sets the YAML's threads; default 1 when jobs > 1)",
    )  # fmt: skip
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    parser.add_argument("--overwrite", action="store_true", help="move an old --output-dir aside")
    parser.add_argument(
        "--resume", action="store_true", help="continue --output-dir: reuse its finished runs"
    )
    args = parser.parse_args(argv)
    seeds = [] if args.seeds is None else [f"seeds={json.dumps(args.seeds)}"]
    seeds += [
        f"{k}={v}" for k, v in (("jobs", args.jobs), ("threads", args.threads)) if v is not None
    ]
    cfg = load_config(CompareConfig, args.config, [*args.overrides, *seeds])
    out = args.output_dir or Path("outputs") / f"{cfg.name}-{timestamp()}"
    with locked_run(out, package="compare", resume=args.resume, overwrite=args.overwrite) as o:
        try:
            run_compare(cfg, out, fast=args.fast, resume=args.resume)
        except RunFailed as exc:  # each failed run's traceback is in its log
            print(f"error: {exc}", file=sys.stderr)
            o.exit_code = 1
            return 1
    print(f"\ntable: {out / 'compare.md'}")
    return 0


if __name__ == "__main__":
    from rlhf_core.errors import run_main

    sys.exit(run_main(main))
