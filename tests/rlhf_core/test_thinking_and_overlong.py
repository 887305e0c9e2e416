"""Qwen3 thinking through the chat template, <think> stripping before scoring, the evaluation
switch, and dropping (instead of cutting) over-long rows."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from direct_alignment.data import build_preference_data
from instruction_tuning.data import build_sft_data
from policy_gradients.rewards import CombinedReward, RewardInput
from rlhf_core.chat import render_prompt, strip_thinking
from rlhf_core.data import DataSource, ReasoningGymSource, reasoning_gym_dataset
from rlhf_core.models import ModelConfig, load_tokenizer

# the generation-prompt tail of Qwen3's own chat template (tokenizer_config.json of Qwen3-0.6B)
QWEN3_TAIL = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content "
    "+ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def test_enable_thinking_reaches_a_template_that_reads_it():
    base = {"name_or_path": "tiny-qwen3", "chat_template": QWEN3_TAIL}
    off = load_tokenizer(ModelConfig(**base, enable_thinking=False), padding_side="left")
    on = load_tokenizer(ModelConfig(**base, enable_thinking=True), padding_side="left")
    default = load_tokenizer(ModelConfig(**base), padding_side="left")
    assert render_prompt(off, "hi").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_prompt(on, "hi").endswith("<|im_start|>assistant\n")
    assert render_prompt(default, "hi") == render_prompt(on, "hi")


def test_enable_thinking_warns_when_the_template_ignores_it():
    with pytest.warns(UserWarning, match="does not read enable_thinking"):
        tok = load_tokenizer(
            ModelConfig(name_or_path="tiny-qwen3", enable_thinking=False), padding_side="left"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert render_prompt(tok, "hi")  # still renders


def test_strip_thinking():
    assert strip_thinking("<think>a\nb</think>\n\n42") == "42"
    assert strip_thinking("x<think>a</think> y <think>b</think>z") == "xy z"
    assert strip_thinking("<think>cut off by the budget") == ""
    assert strip_thinking("no block") == "no block"


def test_verifier_scores_the_answer_not_the_think_block():
    data = reasoning_gym_dataset(
        ReasoningGymSource(
            task="spell_backward", config={"min_word_len": 3, "max_word_len": 5}, size=1, seed=0
        )
    )
    entry = data[0]  # fmt: skip
    right = f"<think>reverse {entry['question'][-20:]}</think>\n{entry['answer']}"
    specs = [{"name": "reasoning_gym", "extract": "full", "label": "task"}]
    batch = RewardInput(["p"], [right], [{"entry": entry, "answer": entry["answer"]}],
                        torch.tensor([4]), torch.ones(1, 4), data)  # fmt: skip
    stripped, _ = CombinedReward(specs)(batch)
    whole, _ = CombinedReward(specs, strip_thinking=False)(batch)
    assert stripped.item() == 1.0 and whole.item() < 1.0


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_overlong_rows_are_dropped_and_counted(tmp_path):
    tok = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")
    rows = [{"prompt": "ab", "completion": "cd"}, {"prompt": "ab", "completion": "x" * 200}]
    path = _jsonl(tmp_path / "sft.jsonl", rows)
    kw = {"fmt": "prompt_completion", "max_length": 40, "max_prompt_length": None, "where": "t"}
    cut = build_sft_data(DataSource(path=path), tok, **kw)
    dropped = build_sft_data(DataSource(path=path), tok, overlong="drop", **kw)
    assert (len(cut.examples), cut.truncated_completions, cut.dropped_overlong) == (2, 1, 0)
    assert (len(dropped.examples), dropped.truncated_completions) == (1, 0)
    assert dropped.dropped_overlong == 1

    pairs = [{"prompt": "ab", "chosen": "cd", "rejected": "ef"},
             {"prompt": "ab", "chosen": "cd", "rejected": "y" * 200}]  # fmt: skip
    ppath = _jsonl(tmp_path / "pairs.jsonl", pairs)
    kw = {"fmt": "preference", "max_length": 40, "max_prompt_length": None, "where": "t"}
    cut = build_preference_data(DataSource(path=ppath), tok, **kw)
    dropped = build_preference_data(DataSource(path=ppath), tok, overlong="drop", **kw)
    assert (len(cut.pairs), cut.truncated) == (2, 1)
    assert (len(dropped.pairs), dropped.truncated, dropped.dropped_overlong) == (1, 0, 1)


def test_evaluate_false_runs_no_evaluation(tiny_sft_dict, tmp_path):
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train
    from rlhf_core.config import RunArgs

    tiny_sft_dict["train"].update(max_steps=2, evaluate=False, eval_every=1)
    tiny_sft_dict["data"]["overlong"] = "drop"
    cfg = SFTConfig.model_validate(tiny_sft_dict)
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert not [k for k in summary if k.startswith("eval/")]
    assert summary["dropped_overlong"] == 0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "eval/" not in metrics and "train/loss" in metrics
