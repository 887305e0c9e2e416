"""`rlhf-lab eval`: evaluate any saved policy on held-out prompts, with the trainers' own code
(`policy_gradients.evaluate.evaluate_policy`, as the RL trainer's and the quickstart's eval).

    uv run rlhf-lab eval --model outputs/quickstart/dpo/final --task spell_backward
    uv run rlhf-lab eval --model DIR --prompts heldout.jsonl --reward-model RM_DIR

Greedy and one sampled completion per prompt are scored by reward components:
  --task NAME      a reasoning-gym task (held-out seed far from training by default): the task's
                   partial credit `task` and its exact match `task_exact` (share scoring 1.0)
  --prompts FILE   rows with a prompt and a reference answer (a generation task): `exact` match
                   and `rouge` (ROUGE-L F, rouge-score)
  --reward-model   also the reward model's score `rm` (a directory saved by reward_models)
  --reference DIR  also the per-token KL (k1, k3) of the sampled completions to that model
Prints a table and writes the metrics as JSON (`--output`, default <model>/eval-<task>.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from rlhf_core.errors import UserError, run_main


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
    p.add_argument("--extract", choices=["full", "answer_tag"], default="full",
                   help="score the whole completion or its last <answer> block")  # fmt: skip
    p.add_argument("--reward-model", default=None, help="also score with this reward model")
    p.add_argument("--reference", default=None, help="also report KL to this model")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="of the sampled completion")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--sample-seed", type=int, default=1234)
    p.add_argument("--output", type=Path, default=None, help="metrics JSON path")
    return p


def components(args: argparse.Namespace) -> list[dict]:
    """The reward components that score the completions (see the module docstring)."""
    if args.task:
        specs = [{"name": "reasoning_gym", "extract": args.extract, "label": "task"}]
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
    model_cfg = ModelConfig(name_or_path=args.model)
    tokenizer = load_tokenizer(model_cfg, padding_side="left")
    prompts = load_prompts(
        source, tokenizer, prompt_column=args.prompt_column, answer_column=args.answer_column,
        prompt_template="{question}", system_prompt=None, where="--task/--prompts",
    )  # fmt: skip
    reward = CombinedReward(components(args))
    policy = load_policy(model_cfg).eval()
    reference = None
    if args.reference:
        reference = ReferencePolicy(load_policy(ModelConfig(name_or_path=args.reference)),
                                    "frozen")  # fmt: skip
    with torch.no_grad():
        results = evaluate_policy(
            policy, reference, tokenizer, prompts, reward, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, batch_size=args.batch_size, seed=args.sample_seed,
        )  # fmt: skip
    results = {"prompts": len(prompts.items), **results}
    width = max(len(k) for k in results)
    print("\n".join(f"{k:<{width}}  {v:.4f}" for k, v in results.items()))
    name = args.task or args.prompts.stem
    out = args.output or (Path(args.model) / f"eval-{name}.json")
    if args.output is not None or Path(args.model).is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": args.model, "source": source.describe(),
                                   **results}, indent=2) + "\n")  # fmt: skip
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
