"""On-policy preference pairs: sample from a model, grade with the task's verifier, pair.

For each prompt, `samples` completions are drawn at temperature 1 from the model; each is graded
by the reasoning-gym task's own scorer (exact = score 1.0). A prompt with at least one correct and
one incorrect completion gives one pair (chosen = a correct completion, rejected = an incorrect
one, both picked at random with a seeded generator). With `reference_fallback`, a prompt whose
samples are all wrong still gives a pair, with the task's reference answer as chosen (counted
separately: those pairs are only half on-policy). Rows are written as jsonl with the columns
direct_alignment and reward_models read: `prompt` (the question), `chosen`, `rejected`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from policy_gradients.rollout import generate_rollouts, load_prompts
from rlhf_core.data import DataSource
from rlhf_core.models import ModelConfig, load_policy, load_tokenizer


@torch.no_grad()
def build_onpolicy_pairs(
    model_path: str | Path,
    source: DataSource,
    out_path: Path,
    *,
    samples: int,
    max_new_tokens: int,
    seed: int,
    batch_prompts: int = 64,
    reference_fallback: bool = True,
) -> dict[str, float]:
    """Write pairs to `out_path`; return counts (prompts, pairs, sample accuracy)."""
    cfg = ModelConfig(name_or_path=str(model_path))
    tokenizer = load_tokenizer(cfg, padding_side="left")
    model = load_policy(cfg).eval()
    prompts = load_prompts(
        source, tokenizer, prompt_column="prompt", answer_column="answer",
        prompt_template="{question}", system_prompt=None, where="pairs.source",
    )  # fmt: skip
    rng = random.Random(seed)
    rows, correct_total, graded, fallback = [], 0, 0, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(prompts.items), batch_prompts):
            items = prompts.items[start : start + batch_prompts]
            ro = generate_rollouts(
                model, tokenizer, [it["prompt"] for it in items], group_size=samples,
                max_new_tokens=max_new_tokens, temperature=1.0,
            )  # fmt: skip
            for g, item in enumerate(items):
                texts = [t.strip() for t in ro.completions[g * samples : (g + 1) * samples]]
                scores = [prompts.scorer.score_answer(t, item["entry"]) for t in texts]
                good = [t for t, s in zip(texts, scores, strict=True) if s >= 1.0]
                bad = [t for t, s in zip(texts, scores, strict=True) if s < 1.0 and t]
                correct_total += len(good)
                graded += len(texts)
                if bad and (good or reference_fallback):
                    chosen = rng.choice(good) if good else item["entry"]["answer"]
                    fallback += not good
                    rows.append({
                        "prompt": item["entry"]["question"], "chosen": chosen,
                        "rejected": rng.choice(bad),
                    })  # fmt: skip
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "prompts": len(prompts.items),
        "pairs": len(rows),
        "sample_accuracy": correct_total / max(1, graded),
    }
