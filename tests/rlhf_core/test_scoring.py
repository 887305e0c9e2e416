"""Answer scoring (rlhf_core.scoring): exact match and reasoning-gym partial credit."""

from __future__ import annotations

import pytest

from rlhf_core.data import ReasoningGymSource, reasoning_gym_dataset
from rlhf_core.scoring import exact_match, task_score


@pytest.mark.parametrize(
    ("text", "reference", "score"),
    [
        ("olleh", "olleh", 1.0),
        ("  olleh\n", "olleh", 1.0),
        ("olleh", "\tolleh ", 1.0),
        ("oll eh", "olleh", 0.0),  # only surrounding whitespace is stripped
        ("OLLEH", "olleh", 0.0),  # case matters
        ("olle", "olleh", 0.0),
        ("", "olleh", 0.0),
    ],
)
def test_exact_match(text, reference, score):
    assert exact_match(text, reference) == score


@pytest.fixture(scope="module")
def spell():
    source = ReasoningGymSource(
        task="spell_backward", size=4, seed=3, config={"min_word_len": 5, "max_word_len": 8}
    )
    return reasoning_gym_dataset(source)


def test_task_score_uses_reasoning_gym_partial_credit(spell):
    entry = spell[0]
    answer = entry["answer"]
    n = len(answer)
    assert n >= 5
    assert task_score(answer, answer, entry, spell) == 1.0
    assert task_score(f"  {answer}\n", answer, entry, spell) == 1.0  # stripped first
    # spell_backward gives 1/n per character in the right position
    wrong_first = ("#" if answer[0] != "#" else "$") + answer[1:]
    assert task_score(wrong_first, answer, entry, spell) == pytest.approx((n - 1) / n)
    assert exact_match(wrong_first, answer) == 0.0
    assert task_score(answer[:2], answer, entry, spell) == pytest.approx(2 / n)
    assert task_score(answer.upper(), answer, entry, spell) == 1.0  # the task ignores case


def test_task_score_without_entry_or_scorer_is_exact_match(spell):
    entry = spell[0]
    answer = entry["answer"]
    partial = answer[:-1] + ("#" if answer[-1] != "#" else "$")
    assert task_score(partial, answer, None, spell) == 0.0
    assert task_score(partial, answer, entry, None) == 0.0
    assert task_score(f" {answer} ", answer, None, None) == 1.0


def test_rouge_scores_match_hand_counts():
    from rlhf_core.scoring import rouge_scores

    # reference "mira lives in oslo" vs "mira lives in paris": 3 of 4 unigrams, 2 of 3 bigrams,
    # LCS 3 of 4 tokens on both sides
    got = rouge_scores(["Mira lives in Paris."], ["Mira lives in Oslo."])
    assert got["rouge1"] == [pytest.approx(0.75)]
    assert got["rouge2"] == [pytest.approx(2 / 3)]
    assert got["rougeL"] == [pytest.approx(0.75)]
    assert rouge_scores(["a b"], ["c d"])["rougeL"] == [0.0]
    with pytest.raises(ValueError, match="2 texts but 1"):
        rouge_scores(["a", "b"], ["a"])
