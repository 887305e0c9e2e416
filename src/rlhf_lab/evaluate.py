"""`rlhf-lab eval`: evaluate any saved policy on held-out prompts, with the trainers' own code
(`policy_gradients.evaluate.evaluate_policy`, as the RL trainer's and the quickstart's eval).

    uv run rlhf-lab eval --model outputs/quickstart/dpo/final --task spell_backward
    uv run rlhf-lab eval --model DIR --prompts heldout.jsonl --reward-model RM_DIR

Greedy and one sampled completion per prompt are scored by reward components:
  --task NAME      a reasoning-gym task (held-out seed far from training by default): the task's
                   partial credit `task` and its exact match `task_exact` (share scoring 1.0)
  --prompts FILE   rows with a prompt (any layout `--format` reads, e.g. HH transcripts) and a
                   reference answer: `exact` match and `rouge` (ROUGE-L F, rouge-score); rows
                   without an answer column are scored by --reward-model alone
  --reward-model   also the reward model's score `rm` (a directory saved by reward_models)
  --reference DIR  also the per-token KL (k1, k3) of the sampled completions to that model
  --reward-model and --reference together: also the win rate against the reference model (per
                   prompt, the model's sampled completion against the reference's, both scored by
                   the reward model; a tie counts half), `evaluate_models`, as `rlhf-lab compare`
Prints a table and writes the metrics as JSON (`--output`, default <model>/eval-<task>.json); an
existing file there is refused unless `--overwrite`, which moves it aside (`<file>.old-<time>`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

from rlhf_core.errors import UserError, run_main
from rlhf_core.output_dir import check_output_path, claim_output_path

WIN_RATE, WIN_RATE_SE = "eval/win_rate", "eval/win_rate_se"


def win_rate(scores: list[float], baseline: list[float]) -> dict[str, float]:
    """Share of prompts whose score beats the baseline's on the same prompt (a tie counts
    half), and its standard error over prompts (std of the per-prompt outcomes / sqrt(n))."""
    if len(scores) != len(baseline) or not scores:
        raise ValueError(f"win_rate: {len(scores)} scores against {len(baseline)} baseline scores")
    pairs = zip(scores, baseline, strict=True)
    outcomes = [1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs]
    n = len(outcomes)
    mean = sum(outcomes) / n
    var = sum((x - mean) ** 2 for x in outcomes) / max(1, n - 1)
    return {WIN_RATE: mean, WIN_RATE_SE: math.sqrt(var / n)}


def evaluate_models(
    models: dict[str, str | Path],
    reference: str,
    prompts: Any,
    tokenizer: Any,
    reward: Any,
    *,
    win_label: str | None,
    max_new_tokens: int,
    temperature: float,
    batch_size: int = 64,
    seed: int = 1234,
) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, Any]]]]:
    """Every model of `models` (name -> directory) on the same prompts with the same sampling
    seed (`policy_gradients.evaluate.evaluate_policy`: greedy and sampled reward components,
    lengths, KL to the model named `reference`). With `win_label` (a reward component's label,
    e.g. the reward model's), each model also gets its win rate against `reference` on the
    sampled completions (`win_rate`). Returns (figures per model, sampled completions per model:
    prompt, completion and component scores, in prompt order)."""
    import torch

    from policy_gradients.evaluate import evaluate_policy
    from rlhf_core.models import ModelConfig, ReferencePolicy, load_policy

    if reference not in models:
        raise ValueError(f"evaluate_models: reference {reference!r} is not one of {list(models)}")
    ref = ReferencePolicy(load_policy(ModelConfig(name_or_path=str(models[reference]))), "frozen")
    figures: dict[str, dict[str, float]] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    for name, path in models.items():
        policy = load_policy(ModelConfig(name_or_path=str(path))).eval()
        rows: list[tuple] = []
        with torch.no_grad():
            figures[name] = evaluate_policy(
                policy, ref, tokenizer, prompts, reward, max_new_tokens=max_new_tokens,
                temperature=temperature, batch_size=batch_size, seed=seed, log_rows=rows,
            )  # fmt: skip
        sampled = sorted((r for r in rows if r[0] == "sampled"), key=lambda r: r[1])
        samples[name] = [
            {"prompt": r[3], "completion": r[4], "scores": json.loads(r[6])} for r in sampled
        ]
        del policy
    if win_label is not None:
        baseline = [s["scores"][win_label] for s in samples[reference]]
        for name in models:
            scores = [s["scores"][win_label] for s in samples[name]]
            figures[name].update(win_rate(scores, baseline))
    return figures, samples


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhf-lab eval", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="policy directory (or tiny preset / hub id)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", help="reasoning-gym task name, e.g. spell_backward")
    source.add_argument("--prompts", type=Path, help="jsonl/json/parquet file of held-out rows")
    p.add_argument("--size", type=int, default=200, help="held-out prompts (reasoning-gym)")
    p.add_argument("--seed", type=int, default=10_000_000, help="reasoning-gym dataset seed")
    p.add_argument("--task-config", default="{}", help="reasoning-gym task config as JSON")
    p.add_argument("--prompt-column", default="prompt", help="file rows: the question column")
    p.add_argument("--answer-column", default="answer", help="file rows: the reference column")
    p.add_argument("--limit", type=int, default=None, help="file rows: use the first N")
    p.add_argument("--format", default="auto", choices=["auto", "plain", "conversational", "hh"],
                   help="file rows: how the prompt is read (as RL's data.format)")  # fmt: skip
    p.add_argument("--extract", choices=["full", "answer_tag"], default="full",
                   help="score the whole completion or its last <answer> block")  # fmt: skip
    p.add_argument("--reward-model", default=None, help="also score with this reward model")
    p.add_argument("--reference", default=None, help="also report KL to this model")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="of the sampled completion")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--sample-seed", type=int, default=1234)
    p.add_argument("--output", type=Path, default=None, help="metrics JSON path")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="move an existing metrics JSON aside (<file>.old-<time>) and write anew",
    )
    return p


def components(args: argparse.Namespace, has_answers: bool = True) -> list[dict]:
    """The reward components that score the completions (see the module docstring)."""
    if args.task:
        specs = [{"name": "reasoning_gym", "extract": args.extract, "label": "task"}]
    elif not has_answers:
        if not args.reward_model:
            raise UserError(
                f"--prompts {args.prompts}: the rows have no answer column "
                f"({args.answer_column!r}) to check completions against; give --reward-model"
            )
        specs = []
    else:
        specs = [{"name": "exact_match", "extract": args.extract, "label": "exact"}]
        if importlib.util.find_spec("rouge_score") is not None:
            specs.append({"name": "rouge", "label": "rouge"})
    if args.reward_model:
        specs.append({"name": "reward_model", "path": args.reward_model, "label": "rm"})
    return specs


def main(argv: list[str] | None = None) -> int:
    import torch

    from policy_gradients.evaluate import evaluate_policy
    from policy_gradients.rewards import CombinedReward
    from policy_gradients.rollout import load_prompts
    from rlhf_core.data import DataSource
    from rlhf_core.models import ModelConfig, ReferencePolicy, load_policy, load_tokenizer

    args = build_parser().parse_args(argv)
    if args.task:
        try:
            task_config = json.loads(args.task_config)
        except json.JSONDecodeError as exc:
            raise UserError(f"--task-config: not valid JSON: {exc}") from None
        rg = {"task": args.task, "size": args.size, "seed": args.seed, "config": task_config}
        source = DataSource.model_validate({"reasoning_gym": rg})
    else:
        if not args.prompts.is_file():
            raise UserError(f"--prompts: no such file {args.prompts}")
        source = DataSource(path=str(args.prompts), limit=args.limit)
    name = args.task or args.prompts.stem
    out = args.output or (Path(args.model) / f"eval-{name}.json")
    write = args.output is not None or Path(args.model).is_dir()
    if write:  # refused before the evaluation, not after it
        check_output_path(out, overwrite=args.overwrite, command="rlhf-lab eval", is_file=True)
    model_cfg = ModelConfig(name_or_path=args.model)
    tokenizer = load_tokenizer(model_cfg, padding_side="left")
    prompts = load_prompts(
        source, tokenizer, prompt_column=args.prompt_column, answer_column=args.answer_column,
        where="--task/--prompts", format=args.format,
    )  # fmt: skip
    has_answers = all(item["answer"] is not None for item in prompts.items)
    reward = CombinedReward(components(args, has_answers))
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "batch_size": args.batch_size, "seed": args.sample_seed}  # fmt: skip
    if args.reference and args.reward_model:  # also the win rate against the reference
        models = {"model": args.model, "reference": args.reference}
        figures, _ = evaluate_models(
            models, "reference", prompts, tokenizer, reward, win_label="rm", **sampling
        )
        results = figures["model"]
    else:
        policy = load_policy(model_cfg).eval()
        reference = None
        if args.reference:
            reference = ReferencePolicy(load_policy(ModelConfig(name_or_path=args.reference)),
                                        "frozen")  # fmt: skip
        with torch.no_grad():
            results = evaluate_policy(policy, reference, tokenizer, prompts, reward, **sampling)
    results = {"prompts": len(prompts.items), **results}
    width = max(len(k) for k in results)
    print("\n".join(f"{k:<{width}}  {v:.4f}" for k, v in results.items()))
    if write:
        claim_output_path(out, overwrite=args.overwrite, command="rlhf-lab eval", is_file=True)
        out.write_text(json.dumps({"model": args.model, "source": source.describe(),
                                   **results}, indent=2) + "\n")  # fmt: skip
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
