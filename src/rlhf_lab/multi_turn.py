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
end. Writes `<out>/<env>/report.md` (a table) and `report.png` (held-out success during GRPO).
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


def held_out(cfg: Any, model_dir: Path, seed: int) -> dict[str, float]:
    """Held-out episodes of the model in `model_dir` (as the GRPO run evaluates)."""
    from policy_gradients.episodes import EpisodeRunner, evaluate_episodes
    from policy_gradients.rollout import load_prompts
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

    model_cfg = ModelConfig(name_or_path=str(model_dir))
    tokenizer = load_tokenizer(model_cfg, padding_side="left")
    prompts = load_prompts(cfg.data.eval, tokenizer, where="data.eval", limit=cfg.train.eval_size,
                           **cfg.prompt_args())  # fmt: skip
    return evaluate_episodes(
        EpisodeRunner.from_config(cfg.environment), load_policy(model_cfg), tokenizer,
        prompts.items, max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature, batch_size=100, seed=seed,
    )  # fmt: skip


def run_seed(
    out: Path,
    env: str,
    seed: int,
    *,
    sft_steps: int,
    grpo_steps: int,
    grpo_set: list[str],
    threads: int | None = None,
    sft_seed: int | None = None,
) -> dict:
    from instruction_tuning.train import train as train_sft
    from policy_gradients.config import PGConfig
    from policy_gradients.train import train as train_pg
    from rlhf_core.config import RunArgs, load_config

    sft_seed = seed if sft_seed is None else sft_seed
    sft_dir, grpo_dir = out / f"sft-seed{sft_seed}", out / f"grpo-seed{seed}"
    if not (sft_dir / "final").is_dir():
        cfg = sft_config(out, sft_seed, sft_steps, threads)
        code = train_sft(cfg, RunArgs(None, output_dir=sft_dir))
        if code != 0:
            raise RuntimeError(f"SFT seed {sft_seed} exited with {code}")
    path = Path("configs") / "policy_gradients" / f"{ENVS[env]}.yaml"
    cfg = load_config(PGConfig, path, [
        f"model.name_or_path={sft_dir / 'final'}", f"data.train.path={out / 'train.jsonl'}",
        f"data.eval.path={out / 'eval.jsonl'}", f"seed={seed}", f"train.max_steps={grpo_steps}",
        *([f"train.threads={threads}"] if threads else []), *grpo_set,
    ])  # fmt: skip
    before = held_out(cfg, sft_dir / "final", seed)
    print(f"seed {seed} SFT held-out: {json.dumps(before)}", flush=True)
    if not (grpo_dir / "summary.json").is_file():
        code = train_pg(cfg, RunArgs(config_path=path, output_dir=grpo_dir))
        if code != 0:
            raise RuntimeError(f"GRPO seed {seed} exited with {code}")
    after = held_out(cfg, grpo_dir / "final", seed)
    print(f"seed {seed} GRPO held-out: {json.dumps(after)}", flush=True)
    return {"seed": seed, "sft_seed": sft_seed, "sft": before, "grpo": after}


COLUMNS = ("greedy_success", "sampled_success", "sampled_tool_call_valid", "sampled_turns")


def write_report(out: Path, env: str, results: list[dict], command: str) -> None:
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
    seeds = [r["seed"] for r in results]
    shares = [f"seed {n} {advantage_share(out / f'grpo-seed{n}'):.2f}" for n in seeds]
    lines += ["", "GRPO groups with a nonzero advantage (training): " + ", ".join(shares)]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(out, results)


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
    """Held-out sampled success (and, with tools, the share of valid calls) during GRPO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("sampled_success", "sampled_tool_call_valid")
            if f"eval/{k}" in results[0]["sft"]]  # fmt: skip
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for r in results:
            metrics = out / f"grpo-seed{r['seed']}" / "metrics.jsonl"
            rows = [json.loads(x) for x in metrics.read_text().splitlines()]
            points = [(0, r["sft"][f"eval/{key}"])] + [
                (x["step"], x[f"eval/{key}"]) for x in rows if f"eval/{key}" in x
            ]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    label=f"seed {r['seed']}")  # fmt: skip
        ax.set_xlabel("GRPO step (0 = the SFT model)")
        ax.set_ylabel("held-out " + ("success" if key.endswith("success") else "valid tool calls")
                      + " (sampled)")  # fmt: skip
        ax.legend()
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
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per trainer")
    parser.add_argument(
        "--sft-seed",
        type=int,
        default=None,
        help="one SFT model (this seed) for every GRPO seed; default: one per seed",
    )
    parser.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the GRPO config (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
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
        )  # fmt: skip
        for seed in args.seeds
    ]
    write_report(out, args.env, results, "python -m rlhf_lab.multi_turn " + " ".join(
        sys.argv[1:] if argv is None else argv))  # fmt: skip
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
