"""SFT data: row formats, masks, truncation and clear errors on bad rows."""

from __future__ import annotations

import json

import pytest
import torch

from instruction_tuning.data import build_sft_data, collate
from rlhf_core.data import DataSource
from rlhf_core.models import ModelConfig, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def build(tokenizer, path, fmt="auto", max_length=64, max_prompt_length=None):
    return build_sft_data(
        DataSource(path=path),
        tokenizer,
        fmt=fmt,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        where="data.train",
    )


def test_prompt_completion_and_messages_rows_give_the_same_tokens(tokenizer, tmp_path):
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Spell: abc", "completion": "cba"}])
    msgs = [{"role": "user", "content": "Spell: abc"}, {"role": "assistant", "content": "cba"}]
    mm = write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}])
    a, b = build(tokenizer, pc).examples[0], build(tokenizer, mm).examples[0]
    assert a.prompt_ids == b.prompt_ids and a.completion_ids == b.completion_ids
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert tokenizer.decode(a.prompt_ids + a.completion_ids) == full
    assert a.completion_ids[-1] == tokenizer.eos_token_id


def test_collate_masks_exactly_the_completion_targets(tokenizer, tmp_path):
    rows = [{"prompt": "Spell: abc", "completion": "cba"}, {"prompt": "x", "completion": "longer"}]
    data = build(tokenizer, write_jsonl(tmp_path / "d.jsonl", rows))
    batch = collate(data.examples, tokenizer.pad_token_id)
    assert batch["input_ids"].shape[1] == max(
        len(e.prompt_ids) + len(e.completion_ids) for e in data.examples
    )
    for b, ex in enumerate(data.examples):
        targets = batch["input_ids"][b, 1:][batch["loss_mask"][b]]
        assert targets.tolist() == ex.completion_ids
        n = len(ex.prompt_ids) + len(ex.completion_ids)
        assert batch["attention_mask"][b].sum() == n
        assert (batch["input_ids"][b, n:] == tokenizer.pad_token_id).all()


def test_row_missing_a_column_names_row_and_column(tokenizer, tmp_path):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "a", "answer": "b"}]
    with pytest.raises(ValueError, match=r"data.train: row 1 is missing column 'completion'"):
        build(tokenizer, write_jsonl(tmp_path / "d.jsonl", rows), fmt="prompt_completion")


def test_empty_completion_is_an_error(tokenizer, tmp_path):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "b"}]
    rows.append({"prompt": "q", "completion": "   "})
    with pytest.raises(ValueError, match=r"row 2 has an empty completion"):
        build(tokenizer, write_jsonl(tmp_path / "d.jsonl", rows))


def test_messages_must_end_with_assistant(tokenizer, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(ValueError, match=r"row 0 column 'messages' must end with an assistant"):
        build(tokenizer, write_jsonl(tmp_path / "d.jsonl", rows))


def test_malformed_message_list_names_the_row(tokenizer, tmp_path):
    rows = [{"messages": [{"role": "user", "text": "hi"}]}]
    with pytest.raises(ValueError, match=r"row 0 column 'messages'"):
        build(tokenizer, write_jsonl(tmp_path / "d.jsonl", rows))


def test_missing_data_file_names_the_path(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.train.path: data file not found: .*nope"):
        build(tokenizer, str(tmp_path / "nope.jsonl"))


def test_reasoning_gym_rows_keep_their_entry_for_scoring(tokenizer):
    src = DataSource.model_validate(
        {"reasoning_gym": {"task": "spell_backward", "size": 5, "seed": 3}}
    )
    data = build_sft_data(
        src, tokenizer, fmt="auto", max_length=96, max_prompt_length=None, where="data.train"
    )
    ex = data.examples[0]
    assert ex.reference == ex.entry["answer"]
    assert data.scorer.score_answer(ex.reference, ex.entry) == 1.0
    assert torch.tensor(ex.completion_ids[:-1]).numel() == len(ex.reference)


def test_heldout_seed_ranges_must_not_overlap():
    from pydantic import ValidationError

    from instruction_tuning.config import SFTDataConfig

    rg = {"task": "spell_backward", "size": 100}
    with pytest.raises(ValidationError, match="overlaps the training"):
        SFTDataConfig.model_validate(
            {
                "train": {"reasoning_gym": {**rg, "seed": 1}},
                "eval": {"reasoning_gym": {**rg, "seed": 2}},
            }
        )
    SFTDataConfig.model_validate(
        {
            "train": {"reasoning_gym": {**rg, "seed": 1}},
            "eval": {"reasoning_gym": {**rg, "seed": 101}},
        }
    )


def test_columns_map_a_users_names_and_a_mismatch_names_the_closest_layout(tokenizer, tmp_path):
    from rlhf_core.columns import Columns

    rows = [{"system": "Be terse.", "instruction": "Spell: abc", "output": "cba"}]
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    mapped = build_sft_data(
        DataSource(path=path), tokenizer, fmt="auto", max_length=64, max_prompt_length=None,
        where="data.train", columns=Columns(prompt="instruction", completion="output"),
    ).examples[0]  # fmt: skip
    assert tokenizer.decode(mapped.prompt_ids).startswith("<|system|>Be terse.")
    assert "Spell: abc" in mapped.prompt_text and mapped.reference == "cba"
    with pytest.raises(ValueError) as err:  # unmapped: neither SFT layout
        build(tokenizer, path)
    message = str(err.value)
    assert f"data.train ({path}[train]): row 0 is missing columns 'prompt', 'completion'" in message
    assert "columns found: ['instruction', 'output', 'system']" in message
    with pytest.raises(ValueError, match=r"row 0 is missing column 'messages' of layout messages"):
        build(tokenizer, path, fmt="messages")  # a declared format: its first row is checked
