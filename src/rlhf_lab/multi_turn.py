"""Multi-turn RL in the tiny world: SFT on a few worked trajectories, then GRPO against the
environment, held-out success and tool-call validity before and after, over seeds.

    uv run python -m rlhf_lab.multi_turn --env calculator --seeds 0 1 2 --output-dir outputs/mt

Environments (`policy_gradients.environments`): `calculator` (two-digit products with the
calculator tool: a `<tool_call>`, the tool's result, then `<answer>`) and `guess` (a number from
1 to 8 over up to 4 guesses, "higher" / "lower" after each). Per seed: SFT of `tiny-qwen3` on
`--sft-trajectories` worked episodes (one prompt/completion row per assistant turn, the earlier
turns rendered exactly as the episode rollout renders them; `--sft-seed N`: one SFT model, of
seed N, for every GRPO seed), held-out episodes of the SFT model,
then `configs/policy_gradients/tiny_<env>_grpo.yaml` from it, its own held-out evaluation at the
end. Held-out: each prompt greedily and `--eval-samples` times sampled, the SFT and the GRPO model
on the same random streams (`--eval-seed N`: the same for every seed, so a shared SFT model is
evaluated once), paired episode by episode. Writes `<out>/<env>/report.md` (a table, the paired
differences with bootstrap intervals, the training trends) and `report.png` (held-out success
before and after GRPO, the training reward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ENVS = {"calculator": "tiny_calculator_grpo", "guess": "tiny_guess_grpo"}
GUESS_HIGH = 8


def worked_calculator(row: dict[str, str]) -> list[dict[str, str]]:
    """The worked episode of a product row: a calculator call, its result, the answer."""
    expression = row["prompt"].removesuffix("=?")
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}},
                      separators=(",", ":"))  # fmt: skip
    return [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "name": "calculator", "content": row["answer"]},
        {"role": "assistant", "content": f"<answer>{row['answer']}</answer>"},
    ]


def worked_guess(row: dict[str, str]) -> list[dict[str, str]]:
    """The worked episode of a guessing row: bisection, told higher or lower."""
    secret, low, high = int(row["answer"]), 1, GUESS_HIGH
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        guess = (low + high) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return messages
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
        messages.append({"role": "user", "content": "higher" if guess < secret else "lower"})


def sft_rows(episodes: list[list[dict[str, str]]], tool_role: str) -> list[dict[str, Any]]:
    """One prompt/completion row per assistant turn; tool results rendered as the rollout does."""
    from policy_gradients.episodes import shown_messages

    rows = []
    for messages in episodes:
        shown = shown_messages(messages, tool_role)
        for i, m in enumerate(shown):
            if m["role"] == "assistant":
                rows.append({"prompt": shown[:i], "completion": m["content"]})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_data(out: Path, env: str, *, train: int, held_out: int, worked: int) -> None:
    from policy_gradients.environments import arithmetic_rows, guess_rows

    make = arithmetic_rows if env == "calculator" else guess_rows
    kwargs = {} if env == "calculator" else {"high": GUESS_HIGH}
    write_jsonl(out / "train.jsonl", make(train, seed=1, **kwargs))
    write_jsonl(out / "eval.jsonl", make(held_out, seed=10_000_000, **kwargs))
    demos = make(worked, seed=777, **kwargs)
    worker = worked_calculator if env == "calculator" else worked_guess
    write_jsonl(out / "sft.jsonl", sft_rows([worker(r) for r in demos], "user"))


def sft_config(out: Path, seed: int, steps: int, threads: int | None = None) -> Any:
    from instruction_tuning.config import SFTConfig

    return SFTConfig.model_validate({
        "name": f"multi_turn_sft_{seed}", "seed": seed, "model": {"name_or_path": "tiny-qwen3"},
        "data": {"train": {"path": str(out / "sft.jsonl")}, "max_length": 224},
        "train": {"batch_size": 32, "max_steps": steps, "eval_every": 0, "threads": threads},
        "optim": {"lr": 1.0e-3, "warmup_steps": 10, "weight_decay": 0.0},
        "checkpoint": {"save_every": 0, "keep_last": 1}, "tracking": {"log_every": 10},
    })  # fmt: skip


def held_out(cfg: Any, model_dir: Path, seed: int, samples: int = 1) -> dict[str, Any]:
    """Held-out episodes of the model in `model_dir`, as the GRPO run evaluates them
    (`evaluate_episodes`): each prompt once greedily and `samples` times at the config's
    temperature, pass k with seed `seed + 1000 k` (pass 0 is the trainer's own sampled pass), so
    two models evaluated with one seed draw from the same random streams: a paired comparison.
    Returns the `eval/<kind>_*` figures and `episodes`: per kind, one record per episode, [prompt
    index, success, tool calls, invalid tool calls, model turns]."""
    from policy_gradients.episodes import EpisodeRunner, evaluate_episodes
    from policy_gradients.rollout import load_prompts
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

    model_cfg = ModelConfig(name_or_path=str(model_dir))
    tokenizer = load_tokenizer(model_cfg, padding_side="left")
    prompts = load_prompts(cfg.data.eval, tokenizer, where="data.eval", limit=cfg.train.eval_size,
                           **cfg.prompt_args())  # fmt: skip
    runner, policy = EpisodeRunner.from_config(cfg.environment), load_policy(model_cfg)
    passes = [("greedy", seed)] + [("sampled", seed + 1000 * k) for k in range(samples)]
    episodes: list[dict[str, float]] = []
    for kind, pass_seed in passes:
        evaluate_episodes(
            runner, policy, tokenizer, prompts.items, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, batch_size=100, seed=pass_seed, kinds=(kind,),
            records=episodes,
        )  # fmt: skip
    results: dict[str, Any] = {"episodes": {}}
    for kind in ("greedy", "sampled"):
        records = [[e["index"], e["success"], e.get("env/tool_calls", 0.0),
                    e.get("env/invalid_tool_calls", 0.0), e["env/turns"]]
                   for e in episodes if e["kind"] == kind]  # fmt: skip
        results["episodes"][kind] = records
        results.update({f"eval/{kind}_{key}": v for key, v in episode_figures(records).items()})
    return results


def episode_figures(records: list[list[float]]) -> dict[str, float]:
    """Success, turns and (with tools) the share of valid calls of `held_out` records."""
    n = max(1, len(records))
    out = {"success": sum(r[1] for r in records) / n, "turns": sum(r[4] for r in records) / n}
    calls = sum(r[2] for r in records)
    if calls:
        out["tool_call_valid"] = 1.0 - sum(r[3] for r in records) / calls
        # the share of episodes that made a call that ran: not raised by calling less
        out["valid_call_episodes"] = sum(r[2] - r[3] > 0 for r in records) / n
    return out


def paired_difference(
    before: list[list[float]], after: list[list[float]], key: str, *, draws: int = 2000
) -> tuple[float, float, float]:
    """`after` minus `before` of an `episode_figures` figure over the same episodes' seeds, and
    a 95% interval from a bootstrap over prompts (each prompt's episodes drawn together)."""
    import random

    prompts = sorted({r[0] for r in before})
    by_prompt = {p: ([r for r in before if r[0] == p], [r for r in after if r[0] == p])
                 for p in prompts}  # fmt: skip
    diff = episode_figures(after)[key] - episode_figures(before)[key]
    rng, diffs = random.Random(0), []
    for _ in range(draws):
        drawn = [by_prompt[rng.choice(prompts)] for _ in prompts]
        b = episode_figures([r for pair in drawn for r in pair[0]])
        a = episode_figures([r for pair in drawn for r in pair[1]])
        if key in a and key in b:
            diffs.append(a[key] - b[key])
    diffs.sort()
    return diff, diffs[int(0.025 * len(diffs))], diffs[int(0.975 * len(diffs)) - 1]


def run_seed(
    out: Path,
    env: str,
    seed: int,
    *,
    sft_steps: int,
    grpo_steps: int | None,
    grpo_set: list[str],
    threads: int | None = None,
    sft_seed: int | None = None,
    eval_seed: int | None = None,
    eval_samples: int = 1,
) -> dict:
    from instruction_tuning.train import train as train_sft
    from policy_gradients.config import PGConfig
    from policy_gradients.train import train as train_pg
    from rlhf_core.config import RunArgs, load_config

    sft_seed = seed if sft_seed is None else sft_seed
    eval_seed = seed if eval_seed is None else eval_seed
    sft_dir, grpo_dir = out / f"sft-seed{sft_seed}", out / f"grpo-seed{seed}"
    if not (sft_dir / "final").is_dir():
        cfg = sft_config(out, sft_seed, sft_steps, threads)
        code = train_sft(cfg, RunArgs(None, output_dir=sft_dir))
        if code != 0:
            raise RuntimeError(f"SFT seed {sft_seed} exited with {code}")
    path = Path("configs") / "policy_gradients" / f"{ENVS[env]}.yaml"
    cfg = load_config(PGConfig, path, [
        f"model.name_or_path={sft_dir / 'final'}", f"data.train.path={out / 'train.jsonl'}",
        f"data.eval.path={out / 'eval.jsonl'}", f"seed={seed}",
        *([f"train.max_steps={grpo_steps}"] if grpo_steps else []),
        *([f"train.threads={threads}"] if threads else []), *grpo_set,
    ])  # fmt: skip
    before = cached_held_out(cfg, sft_dir, eval_seed, eval_samples)
    print(f"seed {seed} SFT held-out: {json.dumps(figures(before))}", flush=True)
    if not (grpo_dir / "summary.json").is_file():
        code = train_pg(cfg, RunArgs(config_path=path, output_dir=grpo_dir))
        if code != 0:
            raise RuntimeError(f"GRPO seed {seed} exited with {code}")
    after = cached_held_out(cfg, grpo_dir, eval_seed, eval_samples)
    print(f"seed {seed} GRPO held-out: {json.dumps(figures(after))}", flush=True)
    return {"seed": seed, "sft_seed": sft_seed, "eval_seed": eval_seed, "sft": before,
            "grpo": after}  # fmt: skip


def cached_held_out(cfg: Any, run_dir: Path, seed: int, samples: int) -> dict[str, Any]:
    """`held_out` of `run_dir/final`, kept in `run_dir/held_out-<seed>x<samples>.json` (one SFT
    model evaluated once for every GRPO seed that shares its evaluation seed; delete the file to
    evaluate again, as a finished GRPO run is kept)."""
    path = run_dir / f"held_out-{seed}x{samples}.json"
    if path.is_file():
        return json.loads(path.read_text())
    results = held_out(cfg, run_dir / "final", seed, samples)
    path.write_text(json.dumps(results) + "\n")
    return results


def figures(results: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in results.items() if k.startswith("eval/")}


COLUMNS = ("greedy_success", "sampled_success", "sampled_tool_call_valid",
           "sampled_valid_call_episodes", "sampled_turns")  # fmt: skip


def write_report(out: Path, env: str, results: list[dict], command: str) -> None:
    for r in results:  # from the episodes' records (cached evaluations predate this figure)
        for stage in ("sft", "grpo"):
            found = episode_figures(r[stage]["episodes"]["sampled"])
            if "valid_call_episodes" in found:
                r[stage]["eval/sampled_valid_call_episodes"] = found["valid_call_episodes"]
    keys = [k for k in COLUMNS if f"eval/{k}" in results[0]["sft"]]
    lines = [f"# Multi-turn GRPO, tiny world: {env}", "", f"`{command}`", "",
             "| seed | stage | " + " | ".join(keys) + " |",
             "|---|---|" + "---|" * len(keys)]  # fmt: skip
    for r in results:
        for stage in ("sft", "grpo"):
            cells = [f"{r[stage][f'eval/{k}']:.3f}" for k in keys]
            lines.append(f"| {r['seed']} | {stage} | " + " | ".join(cells) + " |")
    for stage in ("sft", "grpo"):
        cells = []
        for k in keys:
            xs = [r[stage][f"eval/{k}"] for r in results]
            spread = statistics.stdev(xs) if len(xs) > 1 else 0.0
            cells.append(f"{statistics.mean(xs):.3f} ± {spread:.3f}")
        lines.append(f"| mean ± sd | {stage} | " + " | ".join(cells) + " |")
    lines += ["", "GRPO minus SFT on the same held-out episodes' seeds (paired), with a 95% "
              "interval from a bootstrap over prompts:", ""]  # fmt: skip
    for r in results:
        cells = []
        for kind, key in (("greedy", "success"), ("sampled", "success"),
                          ("sampled", "tool_call_valid"),
                          ("sampled", "valid_call_episodes")):  # fmt: skip
            before, after = r["sft"]["episodes"][kind], r["grpo"]["episodes"][kind]
            if key in episode_figures(before):
                diff, low, high = paired_difference(before, after, key)
                cells.append(f"{kind} {key} {diff:+.3f} [{low:+.3f}, {high:+.3f}]")
        n = len(r["sft"]["episodes"]["sampled"])
        lines.append(f"- seed {r['seed']} ({n} sampled episodes): " + ", ".join(cells))
    lines += ["", "Training episodes (rollout log and metrics.jsonl, first 5 steps -> last 5):", ""]
    for r in results:
        lines.append(f"- seed {r['seed']}: " + training_trend(out / f"grpo-seed{r['seed']}"))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    summary = [{**r, "sft": figures(r["sft"]), "grpo": figures(r["grpo"])} for r in results]
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(out, results)


def training_trend(run_dir: Path) -> str:
    """A GRPO run's training reward, invalid calls, truncation and entropy over its first and
    last 5 steps, the groups with a nonzero advantage, and its last KL to the reference."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in rows if "train/reward/total" in x]

    def mean(key: str, part: list[dict]) -> float:
        return statistics.mean(x.get(key, 0.0) for x in part)

    cells = []
    for label, key in (("reward", "train/reward/total"), ("invalid calls",
                       "train/env/invalid_tool_calls"), ("truncated", "train/length/truncated"),
                       ("entropy", "train/loss/entropy")):  # fmt: skip
        if any(key in x for x in rows):
            cells.append(f"{label} {mean(key, rows[:5]):.3f} -> {mean(key, rows[-5:]):.3f}")
    cells.append(f"KL at the last step {rows[-1].get('train/loss/kl', 0.0):.4f}")
    cells.append(f"groups with a nonzero advantage {advantage_share(run_dir):.2f}")
    return ", ".join(cells)


def advantage_share(run_dir: Path) -> float:
    """The share of a GRPO run's training groups (step, prompt) whose episodes did not all get
    the same reward, i.e. that had a nonzero advantage (its rollout log)."""
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(run_dir / "rollouts.sqlite")) as db:
        (share,) = db.execute(
            "SELECT avg(nonzero) FROM (SELECT max(abs(advantage)) > 0 AS nonzero FROM rollouts "
            "GROUP BY step, prompt_index)"
        ).fetchone()  # fmt: skip
    return float(share or 0.0)


def _plot(out: Path, results: list[dict]) -> None:
    """Held-out sampled success (and, with tools, the share of valid calls): the SFT model at
    step 0 and the GRPO model at its last step on the same episodes' seeds (the table's figures),
    the trainer's own evaluations in between; and the training reward per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("sampled_success", "sampled_tool_call_valid")
            if f"eval/{k}" in results[0]["sft"]]  # fmt: skip
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(5.5 * (len(keys) + 1), 4), squeeze=False)
    for r in results:
        metrics = out / f"grpo-seed{r['seed']}" / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        last = max(x["step"] for x in rows)
        for ax, key in zip(axes[0], keys, strict=False):
            line = ax.plot([0, last], [r["sft"][f"eval/{key}"], r["grpo"][f"eval/{key}"]],
                           marker="o", label=f"seed {r['seed']}")  # fmt: skip
            between = [(x["step"], x[f"eval/{key}"]) for x in rows
                       if f"eval/{key}" in x and x["step"] < last]  # fmt: skip
            if between:
                ax.plot(*zip(*between, strict=True), "x", color=line[0].get_color(), alpha=0.6)
        reward = [(x["step"], x["train/reward/total"]) for x in rows if "train/reward/total" in x]
        axes[0][-1].plot(*zip(*reward, strict=True), alpha=0.8, label=f"seed {r['seed']}")
    for ax, key in zip(axes[0], keys, strict=False):
        ax.set_xlabel("GRPO step (0 = the SFT model; x: the trainer's own evaluations)")
        ax.set_ylabel("held-out " + ("success" if key.endswith("success") else "valid tool calls")
                      + " (sampled)")  # fmt: skip
        ax.legend()
    axes[0][-1].set_xlabel("GRPO step")
    axes[0][-1].set_ylabel("training reward (mean of the step's episodes)")
    axes[0][-1].legend()
    fig.tight_layout()
    fig.savefig(out / "report.png", dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_lab.multi_turn",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--env", choices=sorted(ENVS), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--output-dir", type=Path, default=Path("outputs") / "multi_turn")
    parser.add_argument("--sft-trajectories", type=int, default=64, help="worked episodes")
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--grpo-steps", type=int, default=None,
                        help="GRPO steps; default: the config's train.max_steps")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per trainer")
    parser.add_argument(
        "--sft-seed",
        type=int,
        default=None,
        help="one SFT model (this seed) for every GRPO seed; default: one per seed",
    )
    parser.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the GRPO config (repeatable)")  # fmt: skip
    parser.add_argument("--eval-seed", type=int, default=None,
                        help="sampling seed of every held-out evaluation; default: the "
                        "GRPO seed (a shared SFT model is evaluated once per seed)")  # fmt: skip
    parser.add_argument("--eval-samples", type=int, default=1,
                        help="sampled held-out episodes per prompt")  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads:  # the held-out evaluations run in this process too
        import torch

        torch.set_num_threads(args.threads)
    out = args.output_dir / args.env
    if not (out / "sft.jsonl").is_file():  # the same rows every time (fixed seeds)
        write_data(out, args.env, train=2000, held_out=100, worked=args.sft_trajectories)
    results = [
        run_seed(
            out,
            args.env,
            seed,
            sft_steps=args.sft_steps,
            grpo_steps=args.grpo_steps,
            grpo_set=args.grpo_set,
            threads=args.threads,
            sft_seed=args.sft_seed,
            eval_seed=args.eval_seed,
            eval_samples=args.eval_samples,
        )  # fmt: skip
        for seed in args.seeds
    ]
    write_report(out, args.env, results, "python -m rlhf_lab.multi_turn " + " ".join(
        sys.argv[1:] if argv is None else argv))  # fmt: skip
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
