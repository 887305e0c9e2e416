"""`rlhf-lab pairs`: on-policy preference pairs from a policy and a judge (a verifier or a
reward model), the data step of the quickstart and of iterative (online) DPO.

    uv run rlhf-lab pairs --config configs/quickstart/pairs.yaml \
        --output-dir outputs/quickstart/pairs

For each prompt of each split, `samples` completions are drawn from the model (temperature
`temperature`, seeded per split) and judged:

  verifier       the reasoning-gym task's own scorer (exact = score 1.0). A prompt with a correct
                 and an incorrect completion gives one pair (chosen = a correct one, rejected = an
                 incorrect one, each picked with a seeded generator). With `reference_fallback`,
                 a prompt whose samples are all wrong still gives a pair, with the task's
                 reference answer as chosen (counted: those pairs are only half on-policy).
  reward_model   a reward model directory saved by `reward_models` (or a transformers sequence
                 classifier), loaded through `rlhf_core.scalar_head`: chosen = the best-scored
                 completion, rejected = the worst, if their scores differ by more than
                 `min_reward_gap` (the iterative-DPO recipe of Xiong et al. 2024,
                 arXiv:2312.11456; any prompt source, no verifier needed).

Prompts are read as the RL trainer reads them (`policy_gradients.rollout.load_prompts`: any
standard layout, `format: hh` for Anthropic HH transcripts). Each split is written to
`<output_dir>/<split>.jsonl` with the columns direct_alignment and reward_models read (`prompt` =
the question, or the conversation as messages when it has more than one user turn or a system
turn; `chosen`, `rejected`), plus `summary.json` with the counts. For iterative DPO, alternate
this command (`--set model.name_or_path=<last DPO final>`) with `python -m direct_alignment.train`
on the new pairs.

`pairs_per_prompt` > 1 gives each prompt up to that many pairs, each with a different rejected
completion, so a prompt with many distinct wrong answers teaches more contrasts while every prompt
keeps the same cap (no prompt dominates the data).

Not here: best-of-n against the reference, and a reward model's ties broken by length.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from policy_gradients.rollout import generate_rollouts, load_prompts
from rlhf_core.config import RunArgs, RunConfig, StrictModel, dump_config, parse_run_args
from rlhf_core.data import DataSource
from rlhf_core.errors import UserError, run_main
from rlhf_core.generation import Sampling
from rlhf_core.models import ModelConfig, load_policy, load_tokenizer
from rlhf_core.output_dir import check_output_path, claim_output_path
from rlhf_core.rundir import default_run_dir


class PairSplit(StrictModel):
    prompts: DataSource = Field(description="the prompts (reasoning-gym, or a file/hub dataset)")
    seed: int = Field(0, description="seed of this split's sampling and pair choices")


class PairsConfig(RunConfig):
    name: str = Field("pairs", description="run name (default dir outputs/pairs/<name>-<time>)")
    model: ModelConfig = Field(description="the policy that samples the completions")
    splits: dict[str, PairSplit] = Field(
        description="output name -> prompts and seed; each becomes <output_dir>/<name>.jsonl",
        min_length=1,
    )
    samples: int = Field(4, ge=2, description="completions sampled per prompt")
    max_new_tokens: int = Field(16, gt=0, description="completion length cap")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    batch_prompts: int = Field(64, gt=0, description="prompts per generation batch")
    prompt_column: str = Field("prompt", description="question column of file rows")
    answer_column: str = Field("answer", description="reference answer column of file rows")
    format: Literal["auto", "plain", "conversational", "hh"] = Field(
        "auto", description="how a file row's prompt is read (policy_gradients.rollout."
        "prompt_messages); hh = Anthropic HH transcripts",
    )  # fmt: skip
    judge: Literal["verifier", "reward_model"] = Field(
        "verifier", description="who picks chosen and rejected (see rlhf_lab.onpolicy)"
    )
    reward_model: str | None = Field(
        None, description="judge reward_model: the reward model directory"
    )
    reference_fallback: bool = Field(
        True, description="verifier: all samples wrong -> the reference answer as chosen"
    )
    min_reward_gap: float = Field(
        0.0, ge=0, description="reward_model: keep a pair only if best - worst exceeds this"
    )
    pairs_per_prompt: int = Field(
        1,
        ge=1,
        description="at most this many pairs per prompt, each with a different rejected "
        "completion (verifier: distinct wrong answers, each against a correct one in turn; "
        "reward_model: the best against each of the worst); every prompt has the same cap",
    )

    @model_validator(mode="after")
    def _judge_inputs(self) -> PairsConfig:
        if (self.judge == "reward_model") != (self.reward_model is not None):
            raise ValueError("judge 'reward_model' needs reward_model: DIR, and only it reads it")
        if self.judge == "verifier":
            for name, split in self.splits.items():
                if split.prompts.reasoning_gym is None:
                    raise ValueError(
                        f"splits.{name}: the verifier judge needs reasoning-gym prompts (it "
                        "grades with the task's scorer); use judge: reward_model for file prompts"
                    )
        return self


def _choose(
    texts: list[str], scores: list[float], cfg: PairsConfig, item: dict, rng: random.Random
) -> list[tuple[str, str, bool]]:
    """Up to `pairs_per_prompt` (chosen, rejected, used the reference answer) for one prompt's
    samples; each pair has a different rejected completion."""
    k = cfg.pairs_per_prompt
    if cfg.judge == "reward_model":
        order = sorted(range(len(texts)), key=lambda i: scores[i])
        best = order[-1]
        pairs, seen = [], {texts[best]}
        for worst in order[:-1]:
            if len(pairs) < k and scores[best] - scores[worst] > cfg.min_reward_gap:
                if texts[worst] not in seen:
                    pairs.append((texts[best], texts[worst], False))
                    seen.add(texts[worst])
        return pairs
    good = [t for t, s in zip(texts, scores, strict=True) if s >= 1.0]
    bad = [t for t, s in zip(texts, scores, strict=True) if s < 1.0 and t]
    if not bad or not (good or cfg.reference_fallback):
        return []
    if k == 1:  # (the draws of the one-pair recipe, kept as they were)
        chosen = rng.choice(good) if good else item["entry"]["answer"]
        return [(chosen, rng.choice(bad), not good)]
    distinct = list(dict.fromkeys(bad))
    rejected = rng.sample(distinct, min(k, len(distinct)))
    chosen = rng.sample(good, len(good)) if good else [item["entry"]["answer"]]
    return [(chosen[i % len(chosen)], r, not good) for i, r in enumerate(rejected)]


def _pair_prompt(item: dict) -> str | list[dict[str, str]]:
    """A pair row's prompt: the reasoning-gym question, the user turn's text, or the messages
    when the prompt is more than one user turn (a conversation, a system turn)."""
    if item["entry"] is not None and "question" in item["entry"]:
        return item["entry"]["question"]
    messages = item["messages"]
    return messages[0]["content"] if len(messages) == 1 else messages


@torch.no_grad()
def build_pairs(
    cfg: PairsConfig, out_dir: Path, *, prompt_args: dict[str, Any] | None = None
) -> dict[str, dict[str, float]]:
    """Write `<out_dir>/<split>.jsonl` for every split; return each split's counts.
    `prompt_args` (keywords of `load_prompts`, e.g. an RL config's `prompt_args()`) replaces the
    config's prompt_column / answer_column / format, so the pairs' prompts are rendered as that
    config renders them."""
    tokenizer = load_tokenizer(cfg.model, padding_side="left")
    model = load_policy(cfg.model).eval()
    judge_model = None
    if cfg.judge == "reward_model":
        from rlhf_core.scalar_head import ScalarHeadModel

        judge_model = ScalarHeadModel.from_pretrained(cfg.reward_model)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats: dict[str, dict[str, float]] = {}
    for name, split in cfg.splits.items():
        args = prompt_args or {
            "prompt_column": cfg.prompt_column, "answer_column": cfg.answer_column,
            "format": cfg.format,
        }  # fmt: skip
        prompts = load_prompts(split.prompts, tokenizer, where=f"splits.{name}.prompts", **args)
        rng = random.Random(split.seed)
        rows, scored, score_sum, correct, fallback, paired = [], 0, 0.0, 0, 0, 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(split.seed)
            for start in range(0, len(prompts.items), cfg.batch_prompts):
                items = prompts.items[start : start + cfg.batch_prompts]
                ro = generate_rollouts(
                    model, tokenizer, [it["prompt"] for it in items], group_size=cfg.samples,
                    max_new_tokens=cfg.max_new_tokens,
                    sampling=Sampling(temperature=cfg.temperature),
                )  # fmt: skip
                texts = [t.strip() for t in ro.completions]
                if judge_model is not None:
                    questions = [it["messages"] for it in items for _ in range(cfg.samples)]
                    scores = judge_model.score(questions, texts).float().tolist()
                else:
                    scores = [
                        prompts.scorer.score_answer(t, items[i // cfg.samples]["entry"])
                        for i, t in enumerate(texts)
                    ]
                for g, item in enumerate(items):
                    span = slice(g * cfg.samples, (g + 1) * cfg.samples)
                    scored += cfg.samples
                    score_sum += sum(scores[span])
                    correct += sum(s >= 1.0 for s in scores[span])
                    question = _pair_prompt(item)
                    picked = _choose(texts[span], scores[span], cfg, item, rng)
                    paired += bool(picked)
                    for chosen, rejected, used_reference in picked:
                        fallback += used_reference
                        rows.append({"prompt": question, "chosen": chosen, "rejected": rejected})
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        stats[name] = {
            "prompts": len(prompts.items), "paired_prompts": paired, "pairs": len(rows),
            "reference_chosen": fallback,
            "mean_score": score_sum / max(1, scored),
            **({"sample_accuracy": correct / max(1, scored)} if judge_model is None else {}),
        }  # fmt: skip
        if not rows:
            print(f"warning: split {name!r} gave no pairs", file=sys.stderr)
    (out_dir / "summary.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


PAIR_EVAL_SEED = 20_000_000  # reasoning-gym seed of held-out pairs, far from training


def sized(source: DataSource, size: int) -> DataSource:
    """`source` cut to `size` prompts: a reasoning-gym size, or a file's row limit."""
    if source.reasoning_gym is not None:
        rg = source.reasoning_gym.model_copy(update={"size": size})
        return source.model_copy(update={"reasoning_gym": rg})
    return source.model_copy(update={"limit": min(size, source.limit or size)})


def pair_splits(train: DataSource, n: int) -> dict[str, tuple[DataSource, int]]:
    """Pair prompts from RL training prompts, split -> (source, sampling seed): the first `n`,
    and `max(8, n // 4)` more for held-out pairs (reasoning-gym: a far seed; a file: the rows
    after the first n, which must still be training rows); `rlhf-lab compare`'s DPO family."""
    m = max(8, n // 4)
    if train.reasoning_gym is not None:
        rg = train.reasoning_gym
        heldout = rg.model_copy(update={"size": m, "seed": PAIR_EVAL_SEED})
        return {
            "train": (sized(train, n), rg.seed),
            "eval": (train.model_copy(update={"reasoning_gym": heldout}), PAIR_EVAL_SEED),
        }
    if train.limit is not None and train.limit < n + m:
        raise UserError(
            f"pairs {n}: the pairs take {n} + {m} (held-out) of the training prompts, which "
            f"have limit {train.limit}; lower pairs or raise the limit"
        )
    return {
        "train": (train.model_copy(update={"limit": n}), 1),
        "eval": (train.model_copy(update={"offset": train.offset + n, "limit": m}), 2),
    }


def run(cfg: PairsConfig, args: RunArgs) -> int:
    out_dir = args.output_dir or default_run_dir("pairs", cfg.name)
    # never over pairs written before: refused, or moved aside with --overwrite
    check_output_path(out_dir, overwrite=args.overwrite, command="rlhf-lab pairs")
    if args.dry_run:
        print(dump_config(cfg))
        print(f"would write: {', '.join(str(out_dir / f'{s}.jsonl') for s in cfg.splits)}")
        return 0
    claim_output_path(out_dir, overwrite=args.overwrite, command="rlhf-lab pairs")
    stats = build_pairs(cfg, out_dir)
    (out_dir / "config.yaml").write_text(dump_config(cfg))
    for name, s in stats.items():
        print(f"{out_dir / f'{name}.jsonl'}: " + ", ".join(f"{k} {v:.4g}" for k, v in s.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_run_args(
        argv, PairsConfig, prog="rlhf-lab pairs",
        description="on-policy preference pairs from a policy and a verifier or reward model",
    )  # fmt: skip
    return run(cfg, args)


if __name__ == "__main__":
    sys.exit(run_main(main))
