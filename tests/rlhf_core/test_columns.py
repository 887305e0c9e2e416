"""Column mapping and layout detection (`rlhf_core.columns`): renames, the system column, which
layout a row is in, and the one error a row in no accepted layout gets."""

from __future__ import annotations

import pytest

from rlhf_core.columns import LAYOUTS, Columns, apply_columns, detect_layout
from rlhf_core.errors import UserError
from rlhf_core.preference import PAIR_LAYOUTS, preference_row

HH_CHOSEN = "\n\nHuman: hi\n\nAssistant: hello there"
HH_REJECTED = "\n\nHuman: hi\n\nAssistant: go away"
USER = {"role": "user", "content": "hi"}


def test_apply_columns_renames_to_the_standard_keys():
    row = {"question": "q", "good": "a", "bad": "b", "extra": 1}
    out = apply_columns(row, Columns(prompt="question", chosen="good", rejected="bad"), "f: row 0")
    assert out == {"prompt": "q", "chosen": "a", "rejected": "b", "extra": 1}
    assert row == {"question": "q", "good": "a", "bad": "b", "extra": 1}  # not modified
    assert apply_columns(row, None, "f: row 0") == row


def test_apply_columns_swaps_and_overrides():
    # a mapping may swap two standard names, and a mapped column replaces one of the same name
    swapped = apply_columns({"chosen": "x", "rejected": "y"},
                            Columns(chosen="rejected", rejected="chosen"), "w")  # fmt: skip
    assert swapped == {"chosen": "y", "rejected": "x"}
    over = apply_columns({"prompt": "old", "question": "new"}, Columns(prompt="question"), "w")
    assert over == {"prompt": "new"}


def test_a_missing_mapped_column_names_where_the_key_and_the_columns_found():
    with pytest.raises(UserError) as err:
        apply_columns(
            {"q": "x", "a": "y"}, Columns(prompt="question"), "data.train (f.jsonl): row 3"
        )
    message = str(err.value)
    assert message.startswith("data.train (f.jsonl): row 3: data.columns.prompt names column")
    assert "'question'" in message and "['a', 'q']" in message


def test_a_system_column_becomes_the_leading_system_message():
    orca = {"system": "Be brief.", "question": "2+2?", "chosen": "4", "rejected": "5"}
    out = apply_columns(orca, Columns(prompt="question"), "w")
    assert out["prompt"] == [{"role": "system", "content": "Be brief."}, USER | {"content": "2+2?"}]
    assert "system" not in out and "question" not in out
    assert detect_layout(out, PAIR_LAYOUTS, "w") == "preference"
    # an empty system prompt (orca has many) adds nothing
    empty = apply_columns({**orca, "system": ""}, Columns(prompt="question"), "w")
    assert empty["prompt"] == "2+2?"
    # messages, and conversations with no prompt column, get it first too
    convo = apply_columns({"messages": [USER], "system": "s"}, None, "w")
    assert convo["messages"][0] == {"role": "system", "content": "s"}
    pair = apply_columns({"chosen": [USER], "rejected": [USER], "system": "s"}, None, "w")
    assert pair["chosen"][0] == pair["rejected"][0] == {"role": "system", "content": "s"}
    # nothing to go before: it stays, so a layout error lists it, and HH rows refuse it
    kept = apply_columns({"system": "s", "chosen": "a", "rejected": "b"}, None, "w")
    assert kept == {"system": "s", "chosen": "a", "rejected": "b"}
    hh = {"system": "s", "chosen": HH_CHOSEN, "rejected": HH_REJECTED}
    with pytest.raises(UserError, match=r"w: row 0: a 'system' column has no prompt"):
        preference_row(apply_columns(hh, None, "w"), 0, "auto", "w")


@pytest.mark.parametrize(
    ("row", "layout"),
    [
        ({"prompt": "p", "chosen": "a", "rejected": "b"}, "preference"),
        ({"prompt": [USER], "chosen": [USER], "rejected": [USER]}, "preference"),
        ({"prompt": "p", "completion": "c", "label": True}, "unpaired"),
        ({"prompt": "p", "completion": "c"}, "prompt_completion"),
        ({"chosen": HH_CHOSEN, "rejected": HH_REJECTED}, "implicit_preference"),
        ({"chosen": [USER], "rejected": [USER]}, "implicit_preference"),
        ({"messages": [USER]}, "messages"),
        ({"prompt": "p", "answer": "4"}, "prompt_only"),
    ],
)
def test_detect_layout_finds_the_most_specific_layout(row, layout):
    assert detect_layout(row, tuple(LAYOUTS), "w") == layout


def test_detect_layout_keeps_to_the_accepted_layouts():
    row = {"prompt": "p", "chosen": "a", "rejected": "b"}
    assert detect_layout(row, ("prompt_only",), "w") == "prompt_only"  # extra columns ignored
    unpaired = {"prompt": "p", "completion": "c", "label": False}
    assert detect_layout(unpaired, ("messages", "prompt_completion"), "w") == "prompt_completion"
    # None counts as missing (a parquet file's schema gives absent values as null)
    assert detect_layout({"prompt": None, "messages": [USER]}, tuple(LAYOUTS), "w") == "messages"


def test_a_row_in_no_accepted_layout_gets_one_error_with_the_closest_layout():
    with pytest.raises(UserError) as err:
        detect_layout({"question": "q", "response": "r"}, ("messages", "prompt_completion"),
                      "data.train (x.jsonl[train]): row 0")  # fmt: skip
    message = str(err.value)
    assert message.startswith("data.train (x.jsonl[train]): row 0 is missing columns 'prompt', ")
    assert "of layout prompt_completion (prompt + completion)" in message
    assert "columns found: ['question', 'response']" in message
    assert "data.columns: {prompt: <your column>, completion: <your column>}" in message


def test_plain_string_pairs_need_a_prompt_column():
    # the orca / stack-exchange case: {question, chosen, rejected} is not an HH pair
    row = {"question": "q", "chosen": "a", "rejected": "b"}
    with pytest.raises(UserError) as err:
        detect_layout(row, PAIR_LAYOUTS, "w: row 0")
    message = str(err.value)
    assert "w: row 0 is missing column 'prompt' of layout preference" in message
    assert "HH transcripts or message lists" in message and "{prompt: <your column>}" in message
    with pytest.raises(UserError, match="is missing column 'prompt'"):
        preference_row(row, 0, "auto", "data.train", file="x.jsonl")


def test_conversations_without_a_prompt_column_split_at_their_shared_turns():
    chosen = [USER, {"role": "assistant", "content": "hello"}]
    rejected = [USER, {"role": "assistant", "content": "go away"}]
    prompt, good, bad = preference_row({"chosen": chosen, "rejected": rejected}, 0, "auto", "w")
    assert (prompt, good, bad) == ([USER], "hello", "go away")
    assert preference_row({"chosen": HH_CHOSEN, "rejected": HH_REJECTED}, 0, "hh", "w") == (
        [USER],
        "hello there",
        "go away",
    )
