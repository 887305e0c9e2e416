"""`rlhf-lab eval`: any saved policy on held-out prompts through the trainers' own evaluation
(`evaluate_policy`), with exact match, ROUGE, a reward model's score and KL to a reference."""

from __future__ import annotations

import json

import torch
from rouge_score import rouge_scorer

from policy_gradients.rollout import generate_rollouts
from rlhf_core.chat import render_prompt
from rlhf_core.generation import Sampling
from rlhf_core.models import ModelConfig, load_policy, load_tokenizer
from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel
from rlhf_lab.cli import main as cli


def test_eval_on_a_prompt_file_with_rm_and_reference(tmp_path):
    mcfg = ModelConfig(name_or_path="tiny-qwen3")
    tokenizer = load_tokenizer(mcfg, padding_side="left")
    questions = [
        f"Say {w} backwards" for w in ["apple", "river", "stone", "cloud", "tiger", "lime"]
    ]
    texts = [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    greedy = generate_rollouts(
        load_policy(mcfg).eval(), tokenizer, texts, group_size=1, max_new_tokens=6,
        sampling=Sampling(temperature=0.0),
    ).completions  # fmt: skip
    # half the references are the model's own greedy answer: greedy exact match must be 0.5
    answers = [g if i % 2 == 0 else "a different answer" for i, g in enumerate(greedy)]
    rows = [{"prompt": q, "answer": a} for q, a in zip(questions, answers, strict=True)]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    torch.manual_seed(0)
    right = load_tokenizer(mcfg, padding_side="right")
    rm = ScalarHeadModel.from_config(
        mcfg, ScalarHeadInfo(kind="preference", chat_template=right.chat_template)
    )
    rm.tokenizer = right
    rm.save_pretrained(tmp_path / "rm")

    out = tmp_path / "eval.json"
    argv = [
        "eval", "--model", "tiny-qwen3", "--prompts", str(tmp_path / "heldout.jsonl"),
        "--reward-model", str(tmp_path / "rm"), "--reference", "tiny-qwen3",
        "--max-new-tokens", "6", "--output", str(out),
    ]  # fmt: skip
    assert cli(argv) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == 6
    assert result["eval/greedy_exact"] == 0.5
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    rouge = [scorer.score(a, g)["rougeL"].fmeasure for a, g in zip(answers, greedy, strict=True)]
    assert abs(result["eval/greedy_rouge"] - sum(rouge) / 6) < 1e-6
    scores = rm.score([[{"role": "user", "content": q}] for q in questions], greedy)
    assert abs(result["eval/greedy_rm"] - scores.mean().item()) < 1e-4
    assert abs(result["eval/sampled_kl_k3"]) < 1e-6  # the policy is its own reference
    assert 0 <= result["eval/sampled_exact"] <= 1


def test_eval_on_a_reasoning_gym_task(tmp_path):
    out = tmp_path / "e.json"
    argv = [
        "eval", "--model", "tiny-qwen3", "--task", "spell_backward", "--size", "8",
        "--task-config", '{"min_word_len": 3, "max_word_len": 5}', "--max-new-tokens", "6",
        "--output", str(out),
    ]  # fmt: skip
    assert cli(argv) == 0
    result = json.loads(out.read_text())
    for key in ("eval/greedy_task", "eval/greedy_task_exact", "eval/sampled_task"):
        assert 0 <= result[key] <= 1
