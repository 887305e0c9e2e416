"""Reward-model data: preference / ORM / PRM rows, the offline builders, batches, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from reward_models.build_data import (
    CALC,
    gsm8k_orm_rows,
    gsm8k_prm_rows,
    main,
    reasoning_gym_prm_rows,
)
from reward_models.config import RMDataConfig
from reward_models.data import (
    build_reward_data,
    collate_outcomes,
    collate_steps,
    prm800k_row,
)
from reward_models.losses import IGNORE_INDEX
from rlhf_core.data import DataSource
from rlhf_core.models import ModelConfig, load_tokenizer
from rlhf_core.preference import collate_pairs
from rlhf_core.wrong_answers import reasoning_gym_labelled_rows, wrong_answers

HH = "data/hh-rlhf/harmless-base-test.jsonl.gz"
GSM8K = "data/gsm8k/train-2000.jsonl"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def build(tok, path, kind, *, classes=3, limit=None, **data):
    cfg = RMDataConfig.model_validate({"train": {"path": str(path)}, "max_length": 200, **data})
    return build_reward_data(cfg.train, tok, kind=kind, data_cfg=cfg, num_classes=classes,
                             where="data.train", limit=limit)  # fmt: skip


# ----------------------------------------------------------------------------- preference


def test_vendored_hh_pairs_load_and_end_with_eos(tok):
    data = build(tok, HH, "preference", limit=100, max_length=256)
    assert len(data.examples) + data.counts["dropped_identical"] == 100
    pair = data.examples[0]
    assert tok.decode(pair.prompt_ids).endswith("<|assistant|>")
    assert pair.margin is None
    for p in data.examples:  # each completion ends with eos unless cut at max_length
        for ids in (p.chosen_ids, p.rejected_ids):
            assert len(p.prompt_ids) + len(ids) <= 256
            assert ids[-1] == tok.eos_token_id or len(p.prompt_ids) + len(ids) == 256
    assert 0 < data.counts["truncated"] < 100


def test_ultrafeedback_messages_and_margins_from_two_columns(tok, tmp_path):
    user = {"role": "user", "content": "Spell: abc"}
    row = {
        "prompt": "Spell: abc", "score_chosen": 9.0, "score_rejected": 6.5,
        "chosen": [user, {"role": "assistant", "content": "cba"}],
        "rejected": [user, {"role": "assistant", "content": "abc"}],
    }  # fmt: skip
    path = write_jsonl(tmp_path / "uf.jsonl", [row])
    data = build(tok, path, "preference", margin_column=["score_chosen", "score_rejected"])
    pair = data.examples[0]
    assert tok.decode(pair.chosen_ids) == "cba<|end|>" and pair.margin == 2.5
    assert torch.equal(collate_pairs(data.examples, tok.pad_token_id)["margins"],
                       torch.tensor([2.5]))  # fmt: skip


def test_pairs_identical_after_truncation_are_dropped_and_counted(tok, tmp_path):
    rows = [{"prompt": "p", "chosen": "same start A", "rejected": "same start B"},
            {"prompt": "p", "chosen": "xy", "rejected": "yx"}]  # fmt: skip
    prompt_len = len(tok("<|user|>p<|end|><|assistant|>")["input_ids"])
    data = build(tok, write_jsonl(tmp_path / "t.jsonl", rows), "preference",
                 max_length=prompt_len + 5)  # fmt: skip
    assert data.counts["dropped_identical"] == 1 and len(data.examples) == 1
    assert data.counts["truncated"] >= 1


def test_pair_batches_put_chosen_then_rejected(tok, tmp_path):
    rows = [{"prompt": "p", "chosen": "abc", "rejected": "d"},
            {"prompt": "qq", "chosen": "e", "rejected": "fghi"}]  # fmt: skip
    data = build(tok, write_jsonl(tmp_path / "c.jsonl", rows), "preference")
    batch = collate_pairs(data.examples, tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 4 and "margins" not in batch
    texts = [tok.decode(ids[m.bool()]) for ids, m in zip(batch["input_ids"],
             batch["attention_mask"], strict=True)]  # fmt: skip
    assert [t.split("<|assistant|>")[1] for t in texts] == [
        "abc<|end|>", "e<|end|>", "d<|end|>", "fghi<|end|>",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "p", "chosen": "a"}, r"row 1 is missing column 'rejected'"),
        ({"chosen": "a", "rejected": "b"}, r"row 1 .*transcript"),
        ({"prompt": "p", "chosen": [{"role": "user"}], "rejected": "b"}, r"row 1 column 'chosen'"),
        ({"prompt": "p", "chosen": "a", "rejected": "b", "m": "big"}, r"row 1 column 'm'"),
    ],
)
def test_malformed_preference_rows_name_their_index_and_column(tok, tmp_path, row, message):
    good = {"prompt": "p", "chosen": "a", "rejected": "b", "m": 1.0}
    with pytest.raises(ValueError, match=message):
        build(tok, write_jsonl(tmp_path / "bad.jsonl", [good, row]), "preference",
              margin_column="m")  # fmt: skip


# ----------------------------------------------------------------------------- ORM


def test_orm_rows_groups_and_completion_mask(tok, tmp_path):
    rows = [{"prompt": "q1", "completion": "right", "label": True},
            {"prompt": "q1", "completion": "wrong", "label": 0},
            {"prompt": "q2", "completion": "half", "label": 0.5}]  # fmt: skip
    data = build(tok, write_jsonl(tmp_path / "o.jsonl", rows), "orm")
    assert [e.group for e in data.examples] == [0, 0, 1]
    assert data.counts == {"truncated": 0, "truncated_prompts": 0, "groups": 2, "correct": 1,
                           "dropped_overlong": 0, "stripped_thinking": 0}  # fmt: skip
    batch = collate_outcomes(data.examples, tok.pad_token_id)
    assert batch["labels"].tolist() == [1.0, 0.0, 0.5]
    assert tok.decode(batch["input_ids"][0][batch["completion_mask"][0]]) == "right<|end|>"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "completion": "a"}, r"row 1 is missing column 'label'"),
        ({"prompt": "q", "completion": "a", "label": 2}, r"row 1 column 'label': expected"),
        ({"prompt": "q", "label": True}, r"row 1 is missing column 'completion'"),
    ],
)
def test_malformed_orm_rows_name_their_index_and_column(tok, tmp_path, row, message):
    good = {"prompt": "q", "completion": "a", "label": True}
    with pytest.raises(ValueError, match=message):
        build(tok, write_jsonl(tmp_path / "bad.jsonl", [good, row]), "orm")


def test_orm_limit_keeps_whole_prompt_groups(tok, tmp_path):
    rows = [{"prompt": f"q{i // 3}", "completion": str(i), "label": i % 3 == 0} for i in range(9)]
    data = build(tok, write_jsonl(tmp_path / "o.jsonl", rows), "orm", limit=4)
    assert len(data.examples) == 6 and data.counts["groups"] == 2


# ----------------------------------------------------------------------------- PRM


def test_prm_rows_label_the_separators_only(tok, tmp_path):
    rows = [{"prompt": "q", "steps": ["a=1", "b=2", "c=4"], "labels": [1, 0, -1]},
            {"prompt": "r", "steps": ["x"], "labels": [True]}]  # fmt: skip
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    three = build(tok, path, "prm", classes=3)
    assert [e.step_classes for e in three.examples] == [[2, 1, 0], [2]]
    batch = collate_steps(three.examples, tok.pad_token_id)
    at = batch["step_labels"][0] != IGNORE_INDEX
    assert batch["step_labels"][0][at].tolist() == [2, 1, 0]
    assert tok.decode(batch["input_ids"][0][at]) == "\n\n\n"
    two = build(tok, path, "prm", classes=2)
    assert [e.step_classes for e in two.examples] == [[1, 1, 0], [1]]
    strict = build(tok, path, "prm", classes=2, neutral_label="negative")
    assert strict.examples[0].step_classes == [1, 0, 0]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "steps": ["a", "b"], "labels": [1]}, r"row 1 column 'labels'"),
        ({"prompt": "q", "steps": ["a"], "labels": [2]}, r"row 1 column 'labels' step 0"),
        ({"prompt": "q", "steps": "a", "labels": [1]}, r"row 1 column 'steps'"),
        ({"prompt": "q", "steps": ["a"]}, r"row 1 is missing column 'labels'"),
    ],
)
def test_malformed_prm_rows_name_their_index_and_column(tok, tmp_path, row, message):
    good = {"prompt": "q", "steps": ["a"], "labels": [1]}
    with pytest.raises(ValueError, match=message):
        build(tok, write_jsonl(tmp_path / "bad.jsonl", [good, row]), "prm")


def test_prm800k_rows_follow_the_rated_path():
    def completion(text, rating):
        return {"text": text, "rating": rating, "flagged": None}

    row = {
        "question": {"problem": "What is 2 + 2 * 3?"},
        "label": {"steps": [
            {"completions": [completion("2 * 3 = 6.", 1)], "human_completion": None,
             "chosen_completion": 0},
            {"completions": [completion("6 + 2 = 9.", -1), completion("So 8.", 0)],
             "human_completion": {"text": "6 + 2 = 8.", "rating": None},
             "chosen_completion": None},
            {"completions": [completion("The answer is 9.", -1)], "human_completion": None,
             "chosen_completion": None},
        ], "finish_reason": "give_up"},
    }  # fmt: skip
    out = prm800k_row(row, "data.train: row 0")
    assert out == {"prompt": "What is 2 + 2 * 3?", "labels": [1, 1, -1],
                   "steps": ["2 * 3 = 6.", "6 + 2 = 8.", "The answer is 9."]}  # fmt: skip
    with pytest.raises(ValueError, match="row 0: not a PRM800K row"):
        prm800k_row({"question": "q", "label": 1}, "data.train: row 0")


# ----------------------------------------------------------------------------- builders


def gsm8k(n: int) -> list[dict]:
    with open(GSM8K) as fh:
        return [json.loads(next(fh)) for _ in range(n)]


def test_gsm8k_orm_rows_are_the_reference_and_wrong_final_answers():
    rows = list(gsm8k_orm_rows(gsm8k(30), wrong=3, seed=0))
    by_prompt: dict[str, list[dict]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt"], []).append(row)
    assert len(by_prompt) == 30
    for source, cands in zip(gsm8k(30), by_prompt.values(), strict=True):
        gold = source["answer"].split("#### ")[-1].strip()
        assert cands[0]["label"] is True and cands[0]["completion"].endswith(f"#### {gold}")
        for bad in cands[1:]:
            assert bad["label"] is False and not bad["completion"].endswith(f"#### {gold}")
    assert sum(not r["label"] for r in rows) >= 60
    assert rows == list(gsm8k_orm_rows(gsm8k(30), wrong=3, seed=0))  # deterministic


@pytest.mark.parametrize("corruption", ["arithmetic", "copy"])
@pytest.mark.parametrize("after_error", ["drop", "negative"])
def test_gsm8k_prm_rows_corrupt_one_step(corruption, after_error):
    sources = gsm8k(20)
    rows = list(gsm8k_prm_rows(sources, corruption=corruption, after_error=after_error, seed=3))
    gold, bad = rows[0::2], rows[1::2]
    assert len(gold) == len(bad) == 20
    for g, b in zip(gold, bad, strict=True):
        assert g["labels"] == [1] * len(g["steps"]) and g["steps"][-1].startswith("####")
        j = b["labels"].index(-1)
        assert b["labels"][:j] == [1] * j and b["steps"][:j] == g["steps"][:j]
        assert b["steps"][j] != g["steps"][j]
        if after_error == "drop":
            assert len(b["steps"]) == j + 1
        else:
            assert b["labels"][j:] == [-1] * (len(g["steps"]) - j)
        changed = [
            (new, old)
            for new, old in zip(CALC.findall(b["steps"][j]), CALC.findall(g["steps"][j]),
                                strict=True)
            if new != old
        ]  # fmt: skip
        assert len(changed) == 1  # one calculation of one step
        (_, result, _, shown), (_, old_result, _, old_shown) = changed[0]
        if corruption == "copy":  # the annotation stays right, the stated result does not
            assert result == old_result and shown != old_shown
        else:  # both say the same wrong result
            assert result == shown and result != old_result
    no_gold = list(gsm8k_prm_rows(sources, gold=False))
    assert len(no_gold) == 20 and all(-1 in r["labels"] for r in no_gold)


def test_reasoning_gym_orm_rows_and_wrong_answers():
    entries = [{"question": f"Spell backward: {w}", "answer": w[::-1]}
               for w in ("cat", "horse", "banana", "kiwi")]  # fmt: skip
    rows = list(reasoning_gym_labelled_rows(entries, wrong=3, seed=0))
    assert [r["label"] for r in rows[:4]] == [True, False, False, False]
    assert len({r["completion"] for r in rows[:4]}) == 4
    import random

    assert wrong_answers("42", random.Random(0), 3, others=[]) != ["42"]
    assert all(a != "tac" for a in wrong_answers("tac", random.Random(1), 3, others=["esroh"]))


def test_build_data_command_line_writes_rows(tmp_path, capsys):
    out = tmp_path / "prm.jsonl"
    assert main(["prm-gsm8k", "--input", GSM8K, "--output", str(out), "--limit", "5",
                 "--corruption", "copy", "--no-gold"]) == 0  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all(r["labels"][-1] == -1 for r in rows)
    assert rows == list(gsm8k_prm_rows(gsm8k(5), corruption="copy", gold=False))
    out = tmp_path / "orm.jsonl"
    main(["orm-reasoning-gym", "--task", "spell_backward", "--size", "4", "--output", str(out)])
    assert "wrote 16 rows" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="--input: file not found"):
        main(["orm-gsm8k", "--input", str(tmp_path / "none.jsonl"), "--output", str(out)])
    # the built file trains like any generic ORM file
    source = DataSource(path=str(out))
    assert source.describe().endswith("[train]")


def test_reasoning_gym_prm_rows_spell_with_one_foreign_letter():
    entries = [{"question": f"Spell backward: {w}", "answer": w[::-1]}
               for w in ("cat", "Horse", "banana")]  # fmt: skip
    rows = list(reasoning_gym_prm_rows(entries, seed=0))
    gold, bad = rows[0::2], rows[1::2]
    for entry, g, b in zip(entries, gold, bad, strict=True):
        assert "".join(g["steps"]) == entry["answer"] and set(g["labels"]) == {1}
        j = b["labels"].index(-1)
        assert b["labels"] == [1] * j + [-1] and b["steps"][:j] == g["steps"][:j]
        assert b["steps"][j].lower() not in entry["answer"].lower()
        assert b["steps"][j].isupper() == g["steps"][j].isupper()
    negative = list(reasoning_gym_prm_rows(entries, after_error="negative", gold=False, seed=0))
    assert all(len(r["steps"]) == len(e["answer"]) for r, e in zip(negative, entries, strict=True))


def test_prompts_cut_to_the_prompt_budget_are_counted_and_warned_about(tok):
    with pytest.warns(
        UserWarning, match=r"data.train: \d+ of 40 prompts were cut to their last 64"
    ):
        data = build(tok, HH, "preference", limit=40, max_length=128, max_prompt_length=64)
    assert data.counts["truncated_prompts"] > 0
    for pair in data.examples:
        assert len(pair.prompt_ids) <= 64
    # null: a prompt keeps what the longer completion leaves of max_length (at least 1 token)
    with pytest.warns(UserWarning, match=r"cut to leave room for their completions"):
        data = build(tok, HH, "preference", limit=40, max_length=128)
    assert data.counts["truncated_prompts"] > 0
    for pair in data.examples:
        longer = max(len(pair.chosen_ids), len(pair.rejected_ids))
        assert len(pair.prompt_ids) + longer <= 128 or len(pair.prompt_ids) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a budget that fits every prompt: no warning
        roomy = build(tok, HH, "preference", limit=5, max_length=4096, max_prompt_length=4000)
    assert roomy.counts["truncated_prompts"] == 0
