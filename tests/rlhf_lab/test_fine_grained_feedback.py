"""The fine-grained pipeline's `feedback` stage: the segment reward models' rows are the policy's
own answers, each labelled per segment by the exact grader, and a segment RM trains on them."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import REPO

from rlhf_core.longform import (
    EDITS,
    clause,
    edit_answer,
    grade,
    holistic_score,
    question_from_prompt,
)
from rlhf_core.segmentation import segment
from rlhf_core.tiny import preset_dir
from rlhf_lab.fine_grained import answer_pairs, collect_feedback, run_stage


def test_feedback_rows_are_the_policys_answers_graded_exactly(tmp_path):
    rows = (REPO / "data" / "longform" / "prompts.jsonl").read_text().splitlines()[:6]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(rows) + "\n")
    out = tmp_path / "feedback"
    policy = preset_dir("tiny-t5-facts")  # untrained: its answers are mostly not template text
    assert collect_feedback(policy, prompts, out, temperatures=(0.0, 1.0), max_new_tokens=12) > 0
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
    assert (
        collect_feedback(policy, prompts, out, temperatures=(0.0, 1.0), max_new_tokens=12) == 0.0
    )  # reused
    assert (out / "factuality.jsonl").read_text() == before


def test_edited_feedback_adds_relevance_rows_of_the_greedy_answers_and_nothing_else(tmp_path):
    """`collect_feedback(edits=EDITS)`: every greedy answer with a template clause comes back once
    per kind of edit in the relevance rows, labelled by the grader; the other files are as
    without edits."""
    rows = (REPO / "data" / "longform" / "prompts.jsonl").read_text().splitlines()[:8]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(rows) + "\n")
    # 60 steps of the pipeline's SFT stage: its greedy answers hold template clauses
    run_stage(
        "instruction_tuning", "tiny_t5_sft_longform", tmp_path / "sft", ["train.max_steps=60"]
    )
    policy = tmp_path / "sft" / "final"
    plain, edited = tmp_path / "plain", tmp_path / "edited"
    collect_feedback(policy, prompts, plain, temperatures=(0.0,), max_new_tokens=24)
    collect_feedback(policy, prompts, edited, temperatures=(0.0,), edits=EDITS, max_new_tokens=24)
    for name in ("factuality", "completeness", "preference"):
        assert (plain / f"{name}.jsonl").read_text() == (edited / f"{name}.jsonl").read_text()
    before = [json.loads(x) for x in (plain / "relevance.jsonl").read_text().splitlines()]
    after = [json.loads(x) for x in (edited / "relevance.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    with_clause = [r for r in before if edit_answer(rng, question_from_prompt(r["prompt"]),
                                                    r["completion"], EDITS[0])]  # fmt: skip
    assert len(after) == len(before) + len(EDITS) * len(with_clause)
    assert all(r in after for r in before)
    for row in after:
        q = question_from_prompt(row["prompt"])
        assert row["labels"] == grade(q, row["completion"]).subsentence_irrelevant
    assert with_clause, "no greedy answer held a template clause: the edits went untested"
    # reused only with the settings it was collected with; another kind of edit is named
    with pytest.raises(ValueError, match=r"plain/settings.json: the feedback there was collected"):
        collect_feedback(policy, prompts, plain, temperatures=(0.0,), edits=EDITS)
    assert collect_feedback(policy, prompts, edited, temperatures=(0.0,), edits=EDITS) == 0.0
    with pytest.raises(ValueError, match=r"edits \['swap'\]: expected kinds of other_person"):
        collect_feedback(policy, prompts, tmp_path / "other", edits=("swap",))
    with pytest.raises(
        ValueError, match=r"edits apply to greedy answers, and temperatures \[1.0\]"
    ):
        collect_feedback(policy, prompts, tmp_path / "other", temperatures=(1.0,), edits=EDITS)
    assert not (tmp_path / "other").exists()


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


def test_reading_accuracy_picks_each_facts_most_likely_value_as_scored_one_by_one():
    """lm_facts' check, batched with its padding and prompt offsets, picks the same values as
    scoring each candidate answer text alone with transformers (an untrained 4-layer model)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.longform import ATTESTED, ATTRIBUTES, sample_question
    from rlhf_lab.fine_grained_diag import reading_accuracy

    rng, path = random.Random(3), preset_dir("tiny-qwen3-facts-4l")
    questions = [sample_question(rng, shared=k % 2 == 0) for k in range(8)]
    got = reading_accuracy(path, [{"prompt": q.prompt} for q in questions])
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    n = right = shared = bound = 0
    for q in questions:
        head = tok.apply_chat_template(
            [{"role": "user", "content": q.prompt}], tokenize=False, add_generation_prompt=True
        )
        for attribute, value in q.facts.items():
            template = ATTRIBUTES[attribute][0]
            stem = head + template[: template.index("{value}")].format(name=q.target).rstrip()
            start = len(tok(stem, add_special_tokens=False).input_ids)
            scores = {}
            for v in ATTRIBUTES[attribute][1][:ATTESTED]:
                ids = tok(f"{stem} {v}", add_special_tokens=False, return_tensors="pt").input_ids
                with torch.no_grad():
                    logp = model(ids).logits[0].log_softmax(-1)
                scores[v] = sum(float(logp[t - 1, ids[0, t]]) for t in range(start, ids.shape[1]))
            pick = max(scores, key=scores.get)
            n, right = n + 1, right + (pick == value)
            other = q.distractor_facts.get(attribute)
            if other is not None and other != value:
                shared, bound = shared + 1, bound + (pick == value)
    assert (got["facts"], got["shared"]) == (n, shared) and shared >= 8
    assert got["all"] == right / n and got["bind"] == bound / shared


def test_diag_draws_the_sampled_answers_again_the_first_draw_being_the_reports(capsys):
    """`fine_grained_diag --sampling-seeds K`: K draws of the sampled answers, each draw's error
    rates and their mean; the first draw is the one `evaluate_models` reports with one draw,
    the mean the one it reports with `draws=K`."""
    from rlhf_lab.fine_grained import evaluate_models
    from rlhf_lab.fine_grained_diag import main

    policy, heldout = preset_dir("tiny-t5-facts"), REPO / "data" / "longform" / "heldout.jsonl"
    assert (
        main([str(policy), "--heldout", "4", "--sampling-seeds", "3", "--data", str(heldout)]) == 0
    )
    lines = {
        line.split(" over ")[0].split()[-1]: line for line in capsys.readouterr().out.splitlines()
        if " over 3 draws: mean " in line
    }  # fmt: skip
    assert set(lines) == {"irrelevant_rate", "factual_error_rate", "missing_rate"}
    report, _ = evaluate_models({"p": policy}, policy, heldout, size=4, max_new_tokens=40)
    three, _ = evaluate_models({"p": policy}, policy, heldout, size=4, max_new_tokens=40, draws=3)
    for key, line in lines.items():
        mean, draws = line.split(": mean ")[1].split("; ")
        draws = [float(v) for v in draws.split()]
        assert len(draws) == 3 and float(mean) == pytest.approx(sum(draws) / 3, abs=1e-3)
        assert draws[0] == pytest.approx(report["p"][f"sampled/{key}"], abs=1e-3)
        assert three["p"][f"sampled/{key}"] == pytest.approx(sum(draws) / 3, abs=1e-3)
        assert three["p"][f"greedy/{key}"] == report["p"][f"greedy/{key}"]
    # the untrained policy's error rates are the same in every draw (all garbage): ROUGE-L is not,
    # so check the mean on it, each draw generated here with the diag's seeds
    from policy_gradients.rollout import generate_rollouts, load_prompts
    from rlhf_core.data import DataSource
    from rlhf_core.generation import Sampling
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer
    from rlhf_core.scoring import rouge_scores

    tok = load_tokenizer(ModelConfig(name_or_path=str(policy)), padding_side="left")
    items = load_prompts(
        DataSource(path=str(heldout), limit=4), tok, prompt_column="prompt", answer_column="answer",
        prompt_template="{question}", system_prompt=None, where="heldout",
    ).items  # fmt: skip
    model = load_policy(ModelConfig(name_or_path=str(policy))).eval()
    each = []
    for k in range(3):
        with torch.no_grad():
            answers = generate_rollouts(
                model, tok, [it["prompt"] for it in items], group_size=1, max_new_tokens=40,
                sampling=Sampling(temperature=1.0), seeds=[100_000 * k + i for i in range(4)],
            ).completions  # fmt: skip
        each.append(
            sum(rouge_scores(answers, [it["answer"] for it in items], ("rougeL",))["rougeL"]) / 4
        )
    assert len(set(each)) > 1  # the draws differ
    assert report["p"]["sampled/rougeL"] == pytest.approx(each[0])
    assert three["p"]["sampled/rougeL"] == pytest.approx(sum(each) / 3)
    with pytest.raises(SystemExit):
        main([str(policy), "--sampling-seeds", "0"])
    assert "--sampling-seeds: expected an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("edited", [[], ["--edited-feedback"]])
def test_edited_feedback_and_a_segment_encoder_are_one_error(tmp_path, capsys, edited):
    from rlhf_lab.fine_grained import main

    with pytest.raises(SystemExit) as exit_info:  # edited feedback is the default
        main(["--out", str(tmp_path), *edited, "--segment-encoder", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--edited-feedback (the default) starts the relevance reward model from lm_facts" in err
    assert "add --no-edited-feedback to use the encoder" in err
    assert not any(tmp_path.iterdir())  # nothing ran


def test_diag_names_each_kind_of_clause():
    from rlhf_core.longform import sample_question
    from rlhf_lab.fine_grained_diag import clause_kind

    q = sample_question(random.Random(4))
    attribute, value = next(iter(q.facts.items()))
    other_attribute = next(a for a in q.facts if a != attribute)
    assert clause_kind(q, clause(q.target, attribute, value)) == "correct"
    assert clause_kind(q, clause(q.distractor, attribute, value)) == "about another person"
    mismatched = clause(q.target, attribute, q.facts[other_attribute])
    assert clause_kind(q, mismatched) == "another attribute's value"
    assert clause_kind(q, "HugoIvHuNo, andTell") == "not a template clause"
    cut = clause(q.target, "city", "Oslo").replace("Oslo", "To")  # a word no attribute has
    assert clause_kind(q, cut) == "not a template clause"
    assert clause_kind(q, "so " + mismatched) == "not a template clause"


def test_sentence_counts_split_the_factual_error_rate():
    """`sentence_counts`: wrong / all is the grader's factual error rate; a sentence of garbage
    adds to all and to nothing else, so writing less garbage raises the rate."""
    from rlhf_core.longform import error_rates, sample_answer, sample_question
    from rlhf_lab.fine_grained_diag import sentence_counts

    rng = random.Random(5)
    questions = [sample_question(rng) for _ in range(40)]
    answers = [sample_answer(rng, q, p_wrong=0.4) for q in questions]
    counts = sentence_counts(questions, answers)
    rate = error_rates(list(zip(questions, answers, strict=True)))["factual_error_rate"]
    assert counts["wrong"] / counts["all"] == pytest.approx(rate)
    assert 0 < counts["wrong"] < counts["about"] <= counts["all"]
    garbage = [a + " HugoIvHuNo andTell." for a in answers]
    more = sentence_counts(questions, garbage)
    assert more["all"] == counts["all"] + len(answers)
    assert (more["about"], more["wrong"]) == (counts["about"], counts["wrong"])
