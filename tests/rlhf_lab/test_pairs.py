"""`rlhf-lab pairs`: on-policy preference pairs judged by the task's verifier or a reward model,
the step the quickstart runs between SFT and the RM / DPO stages."""

from __future__ import annotations

import json

import torch
from conftest import REPO

from rlhf_core.data import reasoning_gym_dataset
from rlhf_core.models import ModelConfig, load_tokenizer
from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel
from rlhf_lab.cli import main as cli
from rlhf_lab.onpolicy import PairsConfig

CONFIG = str(REPO / "configs" / "quickstart" / "pairs.yaml")


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_verifier_pairs(tmp_path):
    """From the untrained tiny model (its samples are wrong: the reference answer becomes chosen,
    `reference_fallback`); the quickstart test covers a partly-right SFT model."""
    out = tmp_path / "pairs"
    argv = [
        "pairs", "--config", CONFIG, "--output-dir", str(out),
        "--set", "model.name_or_path=tiny-qwen3",
        "--set", "splits.train.prompts.reasoning_gym.size=24",
        "--set", "splits.eval.prompts.reasoning_gym.size=8",
        "--set", "samples=8", "--set", "pairs_per_prompt=3",
    ]  # fmt: skip
    assert cli(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    train = _rows(out / "train.jsonl")
    assert summary["train"]["prompts"] == 24 and summary["train"]["pairs"] == len(train) > 0
    assert summary["train"]["reference_chosen"] <= len(train)
    # every chosen is correct (a sample, or the reference when none was), every rejected is not
    cfg = PairsConfig.model_validate(
        {
            "model": {"name_or_path": "x"},
            "splits": {
                "t": {
                    "prompts": {
                        "reasoning_gym": {
                            "task": "spell_backward",
                            "size": 24,
                            "seed": 1,
                            "config": {"min_word_len": 3, "max_word_len": 10},
                        }
                    }
                }
            },
        }  # fmt: skip
    )
    task = reasoning_gym_dataset(cfg.splits["t"].prompts.reasoning_gym)
    by_question = {e["question"]: e for e in task}
    rejected_by_prompt: dict[str, list[str]] = {}
    for row in train:
        entry = by_question[row["prompt"]]
        assert task.score_answer(row["chosen"], entry) == 1.0
        assert task.score_answer(row["rejected"], entry) < 1.0
        rejected_by_prompt.setdefault(row["prompt"], []).append(row["rejected"])
    # up to pairs_per_prompt (3) pairs per prompt, each with a different wrong answer
    assert max(len(r) for r in rejected_by_prompt.values()) == 3
    assert all(len(set(r)) == len(r) for r in rejected_by_prompt.values())
    assert summary["train"]["paired_prompts"] == len(rejected_by_prompt)
    assert (out / "eval.jsonl").is_file() and (out / "config.yaml").is_file()


def test_reward_model_judge_picks_best_and_worst(tmp_path):
    """A real (untrained) scalar-head RM judges samples of the tiny model: the chosen completion
    scores above the rejected one under that RM, for prompts from a plain jsonl file."""
    torch.manual_seed(0)
    mcfg = ModelConfig(name_or_path="tiny-qwen3")
    tokenizer = load_tokenizer(mcfg, padding_side="right")
    info = ScalarHeadInfo(kind="preference", chat_template=tokenizer.chat_template)
    rm = ScalarHeadModel.from_config(mcfg, info)
    torch.nn.init.normal_(rm.head.weight, std=1.0)  # scores far apart: no ties to break
    rm.tokenizer = tokenizer
    rm.save_pretrained(tmp_path / "rm")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt": f"Spell backward: {w}", "answer": w[::-1]}) + "\n"
        for w in ["apple", "river", "stone", "cloud", "green", "tiger"]
    ))  # fmt: skip
    out = tmp_path / "pairs"
    argv = [
        "pairs", "--config", CONFIG, "--output-dir", str(out),
        "--set", "model.name_or_path=tiny-qwen3", "--set", "judge=reward_model",
        "--set", f"reward_model={tmp_path / 'rm'}",
        "--set", f"splits={{train: {{prompts: {{path: {prompts}}}, seed: 3}}}}",
        "--set", "max_new_tokens=6", "--set", "samples=8", "--set", "pairs_per_prompt=3",
    ]  # fmt: skip
    assert cli(argv) == 0
    rows = _rows(out / "train.jsonl")
    # distinct random samples always differ in score: pairs_per_prompt (3) pairs per prompt,
    # the best sample against each of the three worst
    assert len(rows) == 18
    for k in range(0, 18, 3):
        group = rows[k : k + 3]
        assert len({r["prompt"] for r in group}) == 1 and len({r["chosen"] for r in group}) == 1
        assert len({r["rejected"] for r in group}) == 3
    judge = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    messages = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    chosen = judge.score(messages, [r["chosen"] for r in rows])
    rejected = judge.score(messages, [r["rejected"] for r in rows])
    assert bool((chosen > rejected).all())


def test_verifier_judge_refuses_file_prompts(tmp_path):
    import pytest

    from rlhf_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="verifier judge needs reasoning-gym prompts"):
        load_config(PairsConfig, CONFIG, ["splits.train.prompts={path: x.jsonl}"])
