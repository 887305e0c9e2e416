"""rlhf_core.segmentation (pysbd sentences, sub-sentences, token positions) and the synthetic
long-form task of rlhf_core.longform whose segment errors are known by construction."""

from __future__ import annotations

import random

import pytest

from rlhf_core import longform
from rlhf_core.models import ModelConfig, load_tokenizer
from rlhf_core.segmentation import segment, segment_end_tokens

TRICKY = (
    'Dr. Smith paid $3.5 million, and he left at 12:30; then "Stop." said Ann. '
    "Mr. J. Doe earned 3,500 dollars, e.g. in Rome... He won! Did he?"
)


def test_sentences_survive_abbreviations_decimals_and_quotes():
    got = [s.text for s in segment(TRICKY, "sentence")]
    assert got == [
        'Dr. Smith paid $3.5 million, and he left at 12:30; then "Stop." said Ann.',
        "Mr. J. Doe earned 3,500 dollars, e.g. in Rome...",
        "He won!",
        "Did he?",
    ]


def test_subsentences_cut_at_punctuation_followed_by_space_only():
    got = [s.text for s in segment(TRICKY, "subsentence")]
    assert got[:5] == [
        "Dr. Smith paid $3.5 million,",
        "and he left at 12:30;",
        'then "Stop." said Ann.',
        "Mr. J. Doe earned 3,500 dollars,",  # "3,500" is not a break
        "e.g. in Rome...",
    ]


@pytest.mark.parametrize("level", ["sentence", "subsentence"])
def test_segments_are_offsets_into_the_text_and_lose_nothing(level):
    segs = segment("  " + TRICKY + "  ", level)
    text = "  " + TRICKY + "  "
    for s in segs:
        assert text[s.start : s.end] == s.text
    rebuilt = "".join(s.text for s in segs)
    assert rebuilt.replace(" ", "") == text.replace(" ", "")
    assert [s.start for s in segs] == sorted(s.start for s in segs)


def test_unknown_level_is_an_error():
    with pytest.raises(ValueError, match="sentence"):
        segment("a.", "word")


@pytest.mark.parametrize("preset", ["tiny-t5-facts", "tiny-qwen3"])
def test_segment_end_tokens_are_the_tokens_holding_each_last_character(preset):
    tok = load_tokenizer(ModelConfig(name_or_path=preset), padding_side="right")
    text = "Mira lives in Oslo, and Mira has a cat. Tom plays golf. Dr. No eats 3.5 figs."
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    decoded = tok.decode(ids, skip_special_tokens=True)
    assert decoded == text
    segs = segment(decoded, "subsentence")
    ends = segment_end_tokens(tok, ids, segs)
    assert len(ends) == 4 and ends == sorted(ends) and ends[-1] < len(ids) - 1
    for s, e in zip(segs, ends, strict=True):
        upto = tok.decode(ids[: e + 1], skip_special_tokens=True)
        before = tok.decode(ids[:e], skip_special_tokens=True)
        assert len(upto) >= s.end > len(before)  # token e holds the segment's last character
        assert upto.rstrip().endswith(s.text[-1])


def test_longform_grades_planted_errors_exactly():
    rng = random.Random(3)
    q = longform.sample_question(rng)
    (a1, v1), (a2, v2) = list(q.facts.items())[:2]
    wrong = longform.ATTRIBUTES[a2][1][-1]
    d_attr, d_val = next(iter(q.distractor_facts.items()))
    answer = (
        f"{longform.clause(q.target, a1, v1)}, and {longform.clause(q.distractor, d_attr, d_val)}."
        f" {longform.clause(q.target, a2, wrong)}. Hello there."
    )
    g = longform.grade(q, answer)
    assert g.subsentence_irrelevant == [0, 1, 0, 1]  # distractor clause, off-template sentence
    assert g.sentence_factual == [0, 1, 0]
    assert (g.covered, g.total) == (1, 3)
    assert longform.grade(q, q.reference()) == longform.Grade([0, 0, 0], [0, 0], 3, 3)
    parsed = longform.question_from_prompt(q.prompt)
    assert (parsed.target, parsed.facts, parsed.distractor_facts) == (
        q.target, q.facts, q.distractor_facts)  # fmt: skip


def test_longform_files_are_consistent(tmp_path):
    paths = longform.write_task(tmp_path, train=60, heldout=10, seed=1)
    import json

    rel = [json.loads(x) for x in paths["relevance"].read_text().splitlines()]
    fact = [json.loads(x) for x in paths["factuality"].read_text().splitlines()]
    pref = [json.loads(x) for x in paths["preference"].read_text().splitlines()]
    assert len(rel) == 60 and pref
    for row in rel:
        assert len(row["labels"]) == len(segment(row["completion"], "subsentence"))
    for row in fact:
        assert len(row["labels"]) == len(segment(row["completion"], "sentence"))
    rates = longform.error_rates(
        [(longform.question_from_prompt(json.loads(x)["prompt"]), json.loads(x)["answer"])
         for x in paths["heldout"].read_text().splitlines()]
    )  # fmt: skip
    assert rates == {"irrelevant_rate": 0.0, "factual_error_rate": 0.0, "missing_rate": 0.0}
    assert 0.1 < sum(sum(r["labels"]) for r in rel) / sum(len(r["labels"]) for r in rel) < 0.4


def test_retrieval_answers_carry_the_policys_kinds_of_error(tmp_path):
    """`sample_retrieval_answer`'s wrong clauses are wrong only against the notes: every value
    but the unattested kind is a value some note could state, so the label needs retrieval; and,
    as in the SFT policy's answers, most wrong values are copied from the notes (another
    person's), so that "is this value in the notes" does not tell them apart."""
    import json
    import random

    rng = random.Random(3)
    kinds = {"fact": 0, "unstated": 0, "distractor": 0, "attested": 0, "unattested": 0}
    wrong_in_notes = 0
    for _ in range(300):
        q = longform.sample_question(rng)
        for sub in segment(longform.sample_retrieval_answer(rng, q), "subsentence"):
            name, attribute, value = longform.parse_clause(sub.text)
            assert name == q.target  # never irrelevant: only the factual judgement varies
            wrong_in_notes += q.facts.get(attribute) != value and f" {value}." in q.prompt
            if q.facts.get(attribute) == value:
                kinds["fact"] += 1
            elif attribute not in q.facts:
                kinds["unstated"] += 1
            elif q.distractor_facts.get(attribute) == value:
                kinds["distractor"] += 1
            elif value in longform.ATTRIBUTES[attribute][1][: longform.ATTESTED]:
                kinds["attested"] += 1
            else:
                kinds["unattested"] += 1
    assert all(kinds.values()), kinds
    assert 0.4 < kinds["fact"] / sum(kinds.values()) < 0.65
    assert wrong_in_notes / (sum(kinds.values()) - kinds["fact"]) > 0.55
    path = longform.write_retrieval_factuality(tmp_path / "r.jsonl", 50, seed=1)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 50 and len({r["prompt"] for r in rows}) == 50
    for row in rows:
        q = longform.question_from_prompt(row["prompt"])
        assert row["labels"] == longform.grade(q, row["completion"]).sentence_factual


def test_reading_corpus_answers_are_correct_relevant_and_varied(tmp_path):
    """`write_reading_corpus`: language-model text whose every clause is a fact the notes give the
    target (nothing irrelevant or wrong), in varied orders and lengths, to distinct questions."""
    import json

    path = longform.write_reading_corpus(tmp_path / "reading.jsonl", 200, seed=2)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 200 and len({r["prompt"] for r in rows}) == 200
    covered = set()
    for row in rows:
        q = longform.question_from_prompt(row["prompt"])
        g = longform.grade(q, row["completion"])
        assert not any(g.subsentence_irrelevant) and not any(g.sentence_factual), row
        assert 1 <= g.covered <= len(q.facts)
        covered.add(g.covered)
    assert covered == {1, 2, 3}


def test_shared_questions_need_the_name_and_the_reading_corpus_mixes_them(tmp_path):
    """`sample_question(shared=True)`: the other person has the target's attributes with other
    values, so only the name tells the values apart; `write_reading_corpus(shared=0.5)` mixes
    them in."""
    import json
    import random

    rng = random.Random(5)
    for _ in range(200):
        q = longform.sample_question(rng, shared=True)
        assert set(q.distractor_facts) <= set(q.facts) and len(q.distractor_facts) == 2
        assert all(q.facts[a] != v for a, v in q.distractor_facts.items())
        assert longform.question_from_prompt(q.prompt) == q
    path = longform.write_reading_corpus(tmp_path / "reading.jsonl", 400, seed=1, shared=0.5)
    questions = [longform.question_from_prompt(json.loads(x)["prompt"]) for x in path.open()]
    share = sum(set(q.distractor_facts) <= set(q.facts) for q in questions) / len(questions)
    assert 0.5 < share < 0.7  # 0.5 shared, plus 0.5 x 0.2 unshared that happen to share


def test_edited_answers_put_in_the_irrelevant_text_the_policy_writes():
    """`edit_answer`: `other_person` renames the target in one clause or in all of them (the
    distractor or another name) and `mismatched_value` gives one clause another attribute's value;
    only the edited clauses change, and the grader calls exactly those irrelevant."""
    rng = random.Random(7)
    seen = {"all": 0, "one": 0, "distractor": 0, "noted": 0}
    for _ in range(300):
        q = longform.sample_question(rng)
        answer = q.reference() + " " + longform.FILLERS[0] + "."
        before = [s.text for s in segment(answer, "subsentence")]
        for kind in longform.EDITS:
            edited = longform.edit_answer(rng, q, answer, kind)
            after = [s.text for s in segment(edited, "subsentence")]
            assert len(after) == len(before)
            changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
            labels = longform.grade(q, edited).subsentence_irrelevant
            assert [i for i, x in enumerate(labels) if x] == changed + [len(before) - 1]
            if kind == "mismatched_value":
                assert len(changed) == 1
                assert longform.parse_clause(after[changed[0]]) is None  # not a fact at all
                value = after[changed[0]].rstrip(".,").split()[-1]
                notes = {**q.facts, **q.distractor_facts}.values()
                seen["noted"] += value in notes
            else:
                names = {longform.parse_clause(after[i])[0] for i in changed}
                assert len(names) == 1 and q.target not in names
                seen["all" if len(changed) == len(before) - 1 else "one"] += 1
                seen["distractor"] += q.distractor in names
    assert all(n > 60 for n in seen.values()), seen
    assert longform.edit_answer(rng, q, "HugoIvHuNo, andTell in Oslo.", "other_person") is None
    with pytest.raises(ValueError, match="kind 'swap': expected one of other_person"):
        longform.edit_answer(rng, q, answer, "swap")


@pytest.mark.parametrize("level", ["sentence", "subsentence"])
def test_control_characters_in_sampled_text_do_not_break_segmentation(level):
    """A policy's sampled bytes can hold control characters; pysbd alone raises on "a 1.\\x1d8. b"
    (its numbered-list rule calls int() on "\\x1d8"). Where it raises, the splitter reads a copy
    with them as spaces, and the segments are still the text's own characters at their own
    offsets."""
    text = "Mira has a cat. \x1d8. Tom, and\x07 Ada. 2.\x1d9 x"
    pieces = segment(text, level)
    assert pieces and all(text[p.start : p.end] == p.text for p in pieces)
    assert "".join(p.text for p in pieces).replace(" ", "") == "".join(text.split())
