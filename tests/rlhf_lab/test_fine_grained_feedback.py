"""The fine-grained pipeline's `feedback` stage: the segment reward models' rows are the policy's
own answers, each labelled per segment by the exact grader, and a segment RM trains on them."""

from __future__ import annotations

import json

from conftest import REPO

from rlhf_core.longform import grade, question_from_prompt
from rlhf_core.segmentation import segment
from rlhf_core.tiny import preset_dir
from rlhf_lab.fine_grained import collect_feedback


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
    rel = [json.loads(x)["labels"] for x in (out / "relevance.jsonl").read_text().splitlines()]
    assert sum(map(sum, rel)) > 0  # an untrained policy writes irrelevant text
    before = (out / "factuality.jsonl").read_text()
    assert collect_feedback(policy, prompts, out, samples=2, max_new_tokens=12) == 0.0  # reused
    assert (out / "factuality.jsonl").read_text() == before
