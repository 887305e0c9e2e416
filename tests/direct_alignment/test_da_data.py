"""Preference data: HH and UltraFeedback adapters, truncation, dropped pairs, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from direct_alignment.data import build_preference_data, build_unpaired_data, mismatched_partners
from rlhf_core.chat import split_hh_pair
from rlhf_core.data import DataSource
from rlhf_core.models import ModelConfig, load_tokenizer
from rlhf_core.preference import collate_pairs

HH = "data/hh-rlhf/harmless-base-test.jsonl.gz"


@pytest.fixture(scope="module")
def char_tok():
    return load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataSource(path=str(path))


def build(tok, source, fmt="auto", max_length=200, max_prompt_length=None):
    return build_preference_data(
        source, tok, fmt=fmt, max_length=max_length, max_prompt_length=max_prompt_length,
        where="data.train",
    )  # fmt: skip


def test_hh_split_gives_a_multi_turn_prompt_and_two_completions():
    chosen = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: fine, thanks"
    rejected = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: go away"
    prompt, c, r = split_hh_pair(chosen, rejected, where="x")
    assert prompt == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "how are you?"},
    ]
    assert (c, r) == ("fine, thanks", "go away")


def test_vendored_hh_loads_through_the_real_gpt2_tokenizer():
    with pytest.warns(UserWarning):
        tok = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3-gpt2"), padding_side="right")
    data = build(tok, DataSource(path=HH, limit=200), max_length=256)
    assert len(data.pairs) + data.dropped_identical == 200
    pair = data.pairs[0]
    assert tok.decode(pair.prompt_ids).endswith("\n\nAssistant:")
    assert pair.chosen_ids[-1] == tok.eos_token_id and pair.rejected_ids[-1] == tok.eos_token_id
    assert all(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) <= 256
               for p in data.pairs)  # fmt: skip


def test_ultrafeedback_message_lists_drop_the_repeated_prompt(char_tok, tmp_path):
    user = {"role": "user", "content": "Spell: abc"}
    row = {
        "prompt": "Spell: abc",
        "chosen": [user, {"role": "assistant", "content": "cba"}],
        "rejected": [user, {"role": "assistant", "content": "abc"}],
    }
    pair = build(char_tok, write_jsonl(tmp_path / "u.jsonl", [row])).pairs[0]
    assert char_tok.decode(pair.chosen_ids) == "cba<|end|>"
    assert char_tok.decode(pair.rejected_ids) == "abc<|end|>"
    assert char_tok.decode(pair.prompt_ids) == "<|user|>Spell: abc<|end|><|assistant|>"


def test_pairs_identical_after_truncation_are_dropped_and_counted(char_tok, tmp_path):
    rows = [
        {"prompt": "p", "chosen": "same start A", "rejected": "same start B"},
        {"prompt": "p", "chosen": "xy", "rejected": "yx"},
    ]
    prompt_len = len(char_tok("<|user|>p<|end|><|assistant|>")["input_ids"])
    data = build(char_tok, write_jsonl(tmp_path / "t.jsonl", rows), max_length=prompt_len + 5)
    assert data.dropped_identical == 1 and len(data.pairs) == 1 and data.truncated >= 1


def test_truncation_keeps_the_end_of_the_prompt(char_tok, tmp_path):
    rows = [{"prompt": "0123456789" * 5, "chosen": "a", "rejected": "b"}]
    pair = build(char_tok, write_jsonl(tmp_path / "t.jsonl", rows), max_length=40,
                 max_prompt_length=10).pairs[0]  # fmt: skip
    assert len(pair.prompt_ids) == 10
    assert char_tok.decode(pair.prompt_ids) == "23456789<|end|><|assistant|>"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "p", "chosen": "a"}, r"row 1 is missing column 'rejected'"),
        ({"chosen": "a", "rejected": "b"}, r"row 1 .*transcript"),
        ({"prompt": "p", "chosen": [{"role": "user"}], "rejected": "b"}, r"row 1 column 'chosen'"),
    ],
)
def test_malformed_rows_name_their_index_and_column(char_tok, tmp_path, row, message):
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    with pytest.raises(ValueError, match=message):
        build(char_tok, write_jsonl(tmp_path / "bad.jsonl", [good, row]))


def test_collate_concatenates_chosen_then_rejected(char_tok, tmp_path):
    rows = [{"prompt": "p", "chosen": "abc", "rejected": "d"}, {"prompt": "qq", "chosen": "e",
            "rejected": "fghi"}]  # fmt: skip
    data = build(char_tok, write_jsonl(tmp_path / "c.jsonl", rows))
    batch = collate_pairs(data.pairs, char_tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 4
    assert batch["lengths"].tolist() == [4, 2, 2, 5]  # completions + eos
    for b, ids in enumerate(
        [p.chosen_ids for p in data.pairs] + [p.rejected_ids for p in data.pairs]
    ):
        assert batch["input_ids"][b, 1:][batch["loss_mask"][b]].tolist() == ids
    assert torch.equal(batch["loss_mask"].sum(-1), batch["lengths"])


def test_synthetic_rejected_answers_are_wrong_and_deterministic(char_tok):
    # reasoning-gym pairs come from rlhf_core.wrong_answers (the reward models' builder too)
    source = DataSource.model_validate(
        {"reasoning_gym": {"task": "spell_backward", "size": 6, "seed": 3}}
    )
    first, again = build(char_tok, source), build(char_tok, source)
    assert len(first.pairs) == 6
    for a, b in zip(first.pairs, again.pairs, strict=True):
        assert a.chosen_ids != a.rejected_ids
        assert (a.prompt_ids, a.chosen_ids, a.rejected_ids) == (
            b.prompt_ids, b.chosen_ids, b.rejected_ids,
        )  # fmt: skip


def test_prompts_cut_to_the_prompt_budget_are_counted_and_warned_about(char_tok, tmp_path):
    rows = [{"prompt": "x" * 50 + str(i), "chosen": "good", "rejected": "bad"} for i in range(3)]
    rows.append({"prompt": "short", "chosen": "good", "rejected": "bad"})
    source = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.warns(UserWarning, match=r"data.train: 3 of 4 prompts were cut to their last 40"):
        data = build(char_tok, source, max_length=80, max_prompt_length=40)
    assert data.truncated_prompts == 3
    assert all(len(p.prompt_ids) <= 40 for p in data.pairs)
    # null: each prompt keeps what its longer completion leaves of max_length
    with pytest.warns(UserWarning, match=r"3 of 4 prompts were cut to leave room"):
        data = build(char_tok, source, max_length=40)
    assert data.truncated_prompts == 3
    for p in data.pairs:
        assert len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) <= 40
    roomy = build(char_tok, source, max_length=200, max_prompt_length=150)
    assert roomy.truncated_prompts == 0


# ----------------------------------------------------------------------------- unpaired (KTO)


def build_unpaired(tok, source, max_length=200, max_prompt_length=None):
    return build_unpaired_data(
        source, tok, max_length=max_length, max_prompt_length=max_prompt_length,
        where="data.train",
    )  # fmt: skip


def test_unpaired_rows_give_labelled_completions_with_a_mismatched_kl_partner(char_tok, tmp_path):
    rows = [
        {"prompt": "say hi", "completion": "hi", "label": True},
        {"prompt": "say hi", "completion": "go away", "label": False},
        {"prompt": [{"role": "user", "content": "count"}],
         "completion": [{"role": "assistant", "content": "1 2 3"}], "label": True},
        {"prompt": "name a colour", "completion": "blue", "label": False},
    ]  # fmt: skip
    data = build_unpaired(char_tok, write_jsonl(tmp_path / "u.jsonl", rows))
    eos = char_tok.eos_token_id
    assert [e.label for e in data.pairs] == [True, False, True, False]
    for e, row in zip(data.pairs, rows, strict=True):
        completion = row["completion"]
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        assert e.chosen_ids == char_tok(text, add_special_tokens=False)["input_ids"] + [eos]
    # each KL completion comes from another prompt: i + N // 2, stepping past the same prompt
    kl_sources = [rows[j]["completion"] for j in (2, 3, 0, 1)]
    for e, source in zip(data.pairs, kl_sources, strict=True):
        text = source if isinstance(source, str) else source[-1]["content"]
        assert e.rejected_ids == char_tok(text, add_special_tokens=False)["input_ids"] + [eos]
    batch = collate_pairs(data.pairs, char_tok.pad_token_id)
    assert batch["labels"].tolist() == [True, False, True, False]
    assert batch["input_ids"].shape[0] == 8  # completions, then their KL rows


def test_mismatched_partners_skip_rows_of_the_same_prompt():
    assert mismatched_partners(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert mismatched_partners(["a", "b", "a", "b"]) == [3, 0, 1, 2]  # i + 2: same prompt
    with pytest.raises(ValueError, match="at least two distinct prompts"):
        mismatched_partners(["a", "a"])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "p", "completion": "c"}, r"row 0 is missing column 'label'"),
        ({"prompt": "p", "label": True}, r"row 0 is missing column 'completion'"),
        ({"prompt": "p", "completion": "c", "label": "yes"}, r"row 0 column 'label'.*true/false"),
        ({"prompt": "p", "completion": "c", "label": 1}, r"got 1"),
    ],
)
def test_bad_unpaired_rows_are_clear_errors(char_tok, tmp_path, row, message):
    source = write_jsonl(
        tmp_path / "u.jsonl", [row, {"prompt": "q", "completion": "d", "label": True}]
    )
    with pytest.raises(ValueError, match=message):
        build_unpaired(char_tok, source)


def test_unpaired_reasoning_gym_rows_are_the_answer_and_its_corruption(char_tok):
    source = DataSource.model_validate(
        {"reasoning_gym": {"task": "spell_backward", "size": 3, "seed": 5}}
    )
    data = build_unpaired(char_tok, source)
    assert [e.label for e in data.pairs] == [True, False] * 3
    for good, bad in zip(data.pairs[0::2], data.pairs[1::2], strict=True):
        assert good.prompt_ids == bad.prompt_ids and good.chosen_ids != bad.chosen_ids
        assert good.rejected_ids != good.chosen_ids  # the KL row reads another prompt's answer
