"""The fine-grained pipeline's `feedback` stage: the segment reward models' rows are the policy's
own answers, each labelled per segment by the exact grader, and a segment RM trains on them."""

from __future__ import annotations

import json

from conftest import REPO

from rlhf_core.longform import grade, holistic_score, question_from_prompt
from rlhf_core.segmentation import segment
from rlhf_core.tiny import preset_dir
from rlhf_lab.fine_grained import answer_pairs, collect_feedback


def test_feedback_rows_are_the_policys_answers_graded_exactly(tmp_path):
    rows = (REPO / "data" / "longform" / "prompts.jsonl").read_text().splitlines()[:6]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(rows) + "\n")
    out = tmp_path / "feedback"
    policy = preset_dir("tiny-t5-facts")  # untrained: its answers are mostly not template text
    assert collect_feedback(policy, prompts, out, samples=2, max_new_tokens=12) > 0
    questions = {json.loads(r)["prompt"] for r in rows}
    for name, level, field in (("relevance", "subsentence", "subsentence_irrelevant"),
                               ("factuality", "sentence", "sentence_factual")):  # fmt: skip
        got = [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]
        assert 0 < len(got) <= 12  # 6 prompts x 2 answers, those with a segment
        for row in got:
            assert row["prompt"] in questions
            assert len(row["labels"]) == len(segment(row["completion"], level)) > 0
            expected = getattr(grade(question_from_prompt(row["prompt"]), row["completion"]), field)
            assert row["labels"] == expected
    for name, score in (("completeness", lambda g: g.covered), ("preference", holistic_score)):
        for row in map(json.loads, (out / f"{name}.jsonl").read_text().splitlines()):
            q = question_from_prompt(row["prompt"])
            assert score(grade(q, row["chosen"])) > score(grade(q, row["rejected"]))
    rel = [json.loads(x)["labels"] for x in (out / "relevance.jsonl").read_text().splitlines()]
    assert sum(map(sum, rel)) > 0  # an untrained policy writes irrelevant text
    before = (out / "factuality.jsonl").read_text()
    assert collect_feedback(policy, prompts, out, samples=2, max_new_tokens=12) == 0.0  # reused
    assert (out / "factuality.jsonl").read_text() == before


def test_answer_pairs_prefer_the_higher_grade_and_skip_ties():
    q = question_from_prompt(
        "Tell me about Ada. Notes: Ada has a cat. Ada eats rice. Tom likes red. Ada plays golf."
    )
    answers = ["Ada has a cat. Ada eats rice.", "Ada has a cat.", "Ada has a dog.",
               "Ada has a cat, and Ada eats figs.", "Ada eats rice."]  # fmt: skip
    graded = {a: grade(q, a) for a in answers}
    rows = answer_pairs(q.prompt, graded, lambda g: g.covered)
    covered = {a: g.covered for a, g in graded.items()}  # 2, 1, 0, 1, 1
    assert len(rows) == 7  # 10 pairs less the 3 ties among the one-fact answers
    for row in rows:
        assert row["prompt"] == q.prompt and covered[row["chosen"]] > covered[row["rejected"]]
    holistic = answer_pairs(q.prompt, graded, holistic_score)  # 2, 1, -1, 0, 1
    assert {"prompt": q.prompt, "chosen": "Ada has a cat, and Ada eats figs.",
            "rejected": "Ada has a dog."} in holistic  # fmt: skip
    assert all(holistic_score(graded[r["chosen"]]) > holistic_score(graded[r["rejected"]])
               for r in holistic)  # fmt: skip
