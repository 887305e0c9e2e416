"""A synthetic long-form QA task whose segment-level errors are known by construction, for
Fine-Grained RLHF (Wu et al. 2023, arXiv:2306.01693) offline.

A prompt gives notes about a target person and a distractor person and asks about the target:

    Tell me about Mira. Notes: Mira lives in Oslo. Tom plays golf. Mira has a cat. Mira eats rice.

An answer is sentences of one or two clauses joined by ", and"; every clause states one fact:

    Mira lives in Oslo, and Mira has a cat. Mira eats figs. Tom plays golf.

Each clause is one of the fixed templates below, so any text (a policy's sample too) can be graded
exactly by `grade`: a clause that is not a template sentence about the target (an off-topic
filler, or a fact about the distractor) is *irrelevant* (the paper's C1, judged per
sub-sentence); a sentence stating a wrong value of the target is a *factual error* (C2, per
sentence); target facts not stated correctly are *missing* (C3, completeness, per answer).
`sample_answer` draws answers with each error planted at a known rate, so segment labels,
preference pairs and reference answers all come from here.

The planted errors are ones a ~1M-parameter reward model learns in a minute on a CPU: irrelevant
clauses are off-topic fillers ("I hope this helps"), and wrong values come from values no note
ever states (`ATTESTED`), i.e. unverifiable facts. (Checking a value against the notes, or a name
against the question, is retrieval that our tiny causal reward models did not learn in 600 steps;
`grade` still checks every fact exactly.)

`write_task(out_dir, ...)` writes the JSONL files the trainers read (see its docstring); run
`python -m rlhf_core.longform OUT_DIR` to write them. Not here: paraphrase (every fact has one
wording), pronouns, or facts that need world knowledge: the notes hold everything.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

NAMES = ["Mira", "Tom", "Ada", "Ravi", "Lena", "Omar", "Kira", "Ivan", "Nora", "Hugo", "Sara"]
#: attribute -> (clause template, values). Notes draw from the first `ATTESTED` values of each
#: attribute; planted factual errors from the rest, values no note ever states ("unverifiable")
ATTRIBUTES: dict[str, tuple[str, list[str]]] = {
    "city": ("{name} lives in {value}", ["Oslo", "Paris", "Lima", "Cairo", "Tokyo", "Rome"]),
    "pet": ("{name} has a {value}", ["cat", "dog", "fox", "owl", "frog", "goat"]),
    "color": ("{name} likes {value}", ["red", "blue", "green", "gold", "pink", "gray"]),
    "food": ("{name} eats {value}", ["rice", "fish", "bread", "soup", "figs", "plums"]),
    "job": ("{name} works as a {value}", ["baker", "nurse", "pilot", "judge", "tailor", "chef"]),
    "sport": ("{name} plays {value}", ["chess", "golf", "polo", "tennis", "rugby", "darts"]),
}
ATTESTED = 4
#: off-topic clauses planted as irrelevant sub-sentences
FILLERS = [
    "I hope this helps", "this is a good question", "the sky is blue today",
    "everyone likes a good story", "life is full of surprises", "I read that somewhere",
]  # fmt: skip
_CLAUSES = [
    (attr, re.compile("^" + tpl.format(name=r"(?P<name>\w+)", value=r"(?P<value>\w+)") + "$"))
    for attr, (tpl, _) in ATTRIBUTES.items()
]
ERROR_TYPES = ("irrelevant", "factual", "missing")


def clause(name: str, attribute: str, value: str) -> str:
    return ATTRIBUTES[attribute][0].format(name=name, value=value)


def clause_shape(text: str) -> tuple[str, str, str] | None:
    """(name, attribute, word) of text shaped like a template clause (leading "and", trailing
    punctuation and spaces ignored), whatever word fills the value ("Mira lives in nurse" too)."""
    text = re.sub(r"^\s*(and\s+)?", "", text).strip().rstrip(".,;").strip()
    for attribute, pattern in _CLAUSES:
        if found := pattern.match(text):
            return found["name"], attribute, found["value"]
    return None


def parse_clause(text: str) -> tuple[str, str, str] | None:
    """(name, attribute, value) of a template clause, or None if `text` is not one (its shape
    with a value that is not one of the attribute's)."""
    shaped = clause_shape(text)
    return shaped if shaped and shaped[2] in ATTRIBUTES[shaped[1]][1] else None


@dataclass
class Question:
    target: str
    facts: dict[str, str]  # the target's attribute -> value
    distractor: str
    distractor_facts: dict[str, str]
    prompt: str  # the question text (before any chat template)

    def reference(self) -> str:
        """The correct, complete, relevant answer: the facts in drawn order, two per sentence."""
        return join_sentences([[clause(self.target, a, v) for a, v in pair] for pair in
                               _pairs(list(self.facts.items()))])  # fmt: skip


def _pairs(items: list) -> list[list]:
    return [items[i : i + 2] for i in range(0, len(items), 2)]


def join_sentences(sentences: list[list[str]]) -> str:
    text = (", and ".join(clauses) + "." for clauses in sentences)
    return " ".join(t[0].upper() + t[1:] for t in text)


def join_in_sentences(rng: random.Random, clauses: list[str]) -> str:
    """`clauses` in order, one or two to a sentence (two with probability 1/2), as text."""
    sentences, i = [], 0
    while i < len(clauses):
        size = 2 if (i + 1 < len(clauses) and rng.random() < 0.5) else 1
        sentences.append(clauses[i : i + size])
        i += size
    return join_sentences(sentences)


def sample_question(
    rng: random.Random, *, n_facts: int = 3, n_distractor: int = 2, shared: bool = False
) -> Question:
    """A question: the target's `n_facts` facts and a distractor's `n_distractor` among the notes.
    `shared`: the distractor's attributes are the target's, with other values, so that only the
    name tells which value is the target's."""
    target, distractor = rng.sample(NAMES, 2)
    attributes = rng.sample(list(ATTRIBUTES), n_facts)
    facts = {a: rng.choice(ATTRIBUTES[a][1][:ATTESTED]) for a in attributes}
    if shared:
        d_attrs = rng.sample(attributes, n_distractor)
        values = {a: [v for v in ATTRIBUTES[a][1][:ATTESTED] if v != facts[a]] for a in d_attrs}
        d_facts = {a: rng.choice(values[a]) for a in d_attrs}
    else:
        d_attrs = rng.sample(list(ATTRIBUTES), n_distractor)
        d_facts = {a: rng.choice(ATTRIBUTES[a][1][:ATTESTED]) for a in d_attrs}
    notes = [clause(target, a, v) for a, v in facts.items()]
    notes += [clause(distractor, a, v) for a, v in d_facts.items()]
    rng.shuffle(notes)
    prompt = f"Tell me about {target}. Notes: " + " ".join(n + "." for n in notes)
    return Question(target, facts, distractor, d_facts, prompt)


_PROMPT = re.compile(r"^Tell me about (?P<target>\w+)\. Notes: (?P<notes>.*)$", re.DOTALL)


def question_from_prompt(prompt: str) -> Question:
    """The `Question` a prompt text (as `sample_question` writes it) was made from."""
    found = _PROMPT.match(prompt.strip())
    if found is None:
        raise ValueError(f"not a long-form task prompt: {prompt[:60]!r}")
    target, facts, other, other_facts = found["target"], {}, None, {}
    for note in found["notes"].split(". "):
        parsed = parse_clause(note)
        if parsed is None:
            raise ValueError(f"long-form prompt: unreadable note {note!r}")
        name, attribute, value = parsed
        if name == target:
            facts[attribute] = value
        else:
            other, other_facts[attribute] = name, value
    return Question(target, facts, other or "", other_facts, prompt.strip())


def sample_answer(
    rng: random.Random,
    q: Question,
    *,
    p_missing: float = 0.25,
    p_wrong: float = 0.25,
    p_irrelevant: float = 0.35,
) -> str:
    """An answer with errors planted at the given rates: each target fact is left out with
    `p_missing` (at least one stays) or stated with a wrong (unattested) value with `p_wrong`;
    with `p_irrelevant` one off-topic filler is added as a clause or a sentence."""
    items = list(q.facts.items())
    kept = [it for it in items if rng.random() >= p_missing] or [rng.choice(items)]
    clauses = []
    for attribute, value in kept:
        if rng.random() < p_wrong:
            value = rng.choice(ATTRIBUTES[attribute][1][ATTESTED:])
        clauses.append(clause(q.target, attribute, value))
    if rng.random() < p_irrelevant:
        clauses.insert(rng.randrange(len(clauses) + 1), rng.choice(FILLERS))
    return join_in_sentences(rng, clauses)


#: clause kinds of `sample_retrieval_answer` and their probabilities: the SFT policy's own kinds
#: of factual error (docs/algorithms/fine_grained_rlhf.md), which only looking the fact up can tell
RETRIEVAL_KINDS = {"correct": 0.5, "unstated_attribute": 0.1, "distractor_value": 0.3,
                   "other_attested_value": 0.05, "unattested_value": 0.05}  # fmt: skip


def sample_retrieval_answer(rng: random.Random, q: Question, *, max_clauses: int = 4) -> str:
    """An answer of 1..`max_clauses` clauses about the target, each correct or wrong in one of the
    ways the SFT policy is wrong (`RETRIEVAL_KINDS`): an attribute the notes do not give (with
    the distractor's value for it where the notes give one), the distractor's value, another
    note-like value, or an unattested one. Only the last is visible without reading the notes,
    and as in the policy's answers most wrong values are copied from the notes (another
    person's), so "is this value in the notes at all" does not tell them apart."""
    clauses = []
    for _ in range(rng.randint(1, max_clauses)):
        kind = rng.choices(list(RETRIEVAL_KINDS), weights=list(RETRIEVAL_KINDS.values()))[0]
        attribute = rng.choice(list(q.facts))
        value = q.facts[attribute]
        unstated = [a for a in ATTRIBUTES if a not in q.facts]
        if kind == "unstated_attribute" and unstated:
            attribute = rng.choice(unstated)
            attested = ATTRIBUTES[attribute][1][:ATTESTED]  # the distractor's, as the policy copies
            value = q.distractor_facts.get(attribute) or rng.choice(attested)
        elif kind == "distractor_value" and q.distractor_facts:
            attribute, value = rng.choice(list(q.distractor_facts.items()))
        elif kind == "other_attested_value":
            value = rng.choice([v for v in ATTRIBUTES[attribute][1][:ATTESTED] if v != value])
        elif kind == "unattested_value":
            value = rng.choice(ATTRIBUTES[attribute][1][ATTESTED:])
        clauses.append(clause(q.target, attribute, value))
    return join_in_sentences(rng, clauses)


#: the edits `edit_answer` makes to an answer: one of the two kinds of irrelevant text the PPO
#: policy writes in its greedy answers and the SFT model's (the feedback's) do not
EDITS = ("other_person", "mismatched_value")
#: template clauses inside a text, any word in their name and value slots (`edit_answer`)
_CLAUSE_SPANS = re.compile(
    "|".join(
        "(?:" + tpl.format(name=f"(?P<name{i}>[A-Z]\\w*)", value=f"(?P<value{i}>\\w+)") + ")"
        for i, (tpl, _) in enumerate(ATTRIBUTES.values())
    )  # fmt: skip
)


def edit_answer(rng: random.Random, q: Question, answer: str, kind: str) -> str | None:
    """`answer` (its template clauses) with irrelevant text put in, or None if it has no clause:
    `other_person`: the target's name of every clause (half the time) or of one clause becomes
    another person's (the distractor's half the time), as in an answer about the wrong person;
    `mismatched_value`: one clause's value becomes a value of another attribute, taken from the
    notes where they give one ("Mira lives in nurse"): not a statement about the target at all."""
    if kind not in EDITS:
        raise ValueError(f"edit_answer: kind {kind!r}: expected one of {', '.join(EDITS)}")
    found = [m for m in _CLAUSE_SPANS.finditer(answer) if parse_clause(m.group(0))]
    if not found:
        return None
    chosen = found if kind == "other_person" and rng.random() < 0.5 else [rng.choice(found)]
    spans = []  # (start, end, new text), left to right
    if kind == "other_person":
        other = q.distractor if q.distractor and rng.random() < 0.5 else rng.choice(
            [n for n in NAMES if n not in (q.target, q.distractor)])  # fmt: skip
        for m in chosen:
            group = next(g for g in m.groupdict() if g.startswith("name") and m.group(g))
            spans.append((m.start(group), m.end(group), other))
    else:
        m = chosen[0]
        group = next(g for g in m.groupdict() if g.startswith("value") and m.group(g))
        attribute = parse_clause(m.group(0))[1]
        noted = [v for a, v in {**q.distractor_facts, **q.facts}.items() if a != attribute]
        pool = noted or [v for a, (_, vs) in ATTRIBUTES.items() if a != attribute for v in vs]
        spans.append((m.start(group), m.end(group), rng.choice(pool)))
    for start, end, text in reversed(spans):
        answer = answer[:start] + text + answer[end:]
    return answer


# ----------------------------------------------------------------------------- grading


@dataclass
class Grade:
    """The exact errors of one answer. Labels: 1 = the segment has the error, 0 = it does not."""

    subsentence_irrelevant: list[int]  # per sub-sentence (`segment(..., "subsentence")`)
    sentence_factual: list[int]  # per sentence (`segment(..., "sentence")`)
    covered: int  # target facts stated correctly
    total: int  # target facts in the notes

    @property
    def missing(self) -> float:
        return 1.0 - self.covered / self.total


def grade(q: Question, answer: str) -> Grade:
    """Grade `answer` against the question's facts, segment by segment (pysbd segmentation via
    `rlhf_core.segmentation`, the same the reward models use)."""
    from rlhf_core.segmentation import segment

    irrelevant, factual, correct = [], [], set()
    for sentence in segment(answer, "sentence"):
        wrong = 0
        for sub in segment(sentence.text, "subsentence"):
            parsed = parse_clause(sub.text)
            about_target = parsed is not None and parsed[0] == q.target
            irrelevant.append(int(not about_target))
            if about_target:
                _, attribute, value = parsed
                if q.facts.get(attribute) == value:
                    correct.add(attribute)
                else:
                    wrong = 1  # a wrong value or an attribute the notes do not give
        factual.append(wrong)
    return Grade(irrelevant, factual, len(correct), len(q.facts))


def error_rates(q_and_answers: list[tuple[Question, str]]) -> dict[str, float]:
    """Each error type's rate over answers: irrelevant sub-sentences / all sub-sentences,
    sentences with a factual error / all sentences, mean share of target facts missing."""
    subs = irr = sents = fact = 0
    missing = 0.0
    for q, answer in q_and_answers:
        g = grade(q, answer)
        subs, irr = subs + len(g.subsentence_irrelevant), irr + sum(g.subsentence_irrelevant)
        sents, fact = sents + len(g.sentence_factual), fact + sum(g.sentence_factual)
        missing += g.missing
    n = max(1, len(q_and_answers))
    return {
        "irrelevant_rate": irr / max(1, subs),
        "factual_error_rate": fact / max(1, sents),
        "missing_rate": missing / n,
    }


def holistic_score(g: Grade) -> float:
    """The overall quality the holistic preference comes from: facts covered minus errors."""
    return g.covered - sum(g.subsentence_irrelevant) - sum(g.sentence_factual)


# ----------------------------------------------------------------------------- files


def write_task(
    out_dir: str | Path, *, train: int = 2000, heldout: int = 200, seed: int = 0
) -> dict[str, Path]:
    """Write the task's JSONL files into `out_dir` and return their paths:

    sft.jsonl            {"prompt", "completion"}: noisy answers (errors at the sampling rates),
                         the imperfect demonstrations an SFT policy imitates
    prompts.jsonl        {"prompt", "answer" (the reference)} for RL (`question_from_prompt`
                         recovers the facts from the prompt)
    heldout.jsonl        the same for held-out questions (different seed)
    relevance.jsonl      {"prompt", "completion", "labels"}: per sub-sentence, 1 = irrelevant
    factuality.jsonl     {"prompt", "completion", "labels"}: per sentence, 1 = factual error
    completeness.jsonl   {"prompt", "chosen", "rejected"}: the answer covering more target facts
                         (both free of other errors) is chosen
    preference.jsonl     {"prompt", "chosen", "rejected"}: the holistic preference, by
                         `holistic_score` (ties skipped)
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows: dict[str, list[dict]] = {k: [] for k in (
        "sft", "prompts", "relevance", "factuality", "completeness", "preference")}  # fmt: skip
    for _ in range(train):
        q = sample_question(rng)
        rows["prompts"].append({"prompt": q.prompt, "answer": q.reference()})
        a, b = sample_answer(rng, q), sample_answer(rng, q)
        rows["sft"].append({"prompt": q.prompt, "completion": a})
        ga, gb = grade(q, a), grade(q, b)
        rows["relevance"].append({"prompt": q.prompt, "completion": a,
                                  "labels": ga.subsentence_irrelevant})  # fmt: skip
        rows["factuality"].append({"prompt": q.prompt, "completion": b,
                                   "labels": gb.sentence_factual})  # fmt: skip
        if holistic_score(ga) != holistic_score(gb):
            chosen, rejected = (a, b) if holistic_score(ga) > holistic_score(gb) else (b, a)
            rows["preference"].append({"prompt": q.prompt, "chosen": chosen, "rejected": rejected})
        clean = {"p_wrong": 0.0, "p_irrelevant": 0.0, "p_missing": 0.4}
        c1, c2 = sample_answer(rng, q, **clean), sample_answer(rng, q, **clean)
        g1, g2 = grade(q, c1), grade(q, c2)
        if g1.covered != g2.covered:
            chosen, rejected = (c1, c2) if g1.covered > g2.covered else (c2, c1)
            rows["completeness"].append({"prompt": q.prompt, "chosen": chosen,
                                         "rejected": rejected})  # fmt: skip
    held_rng = random.Random(seed + 1_000_003)
    rows["heldout"] = []
    for _ in range(heldout):
        q = sample_question(held_rng)
        rows["heldout"].append({"prompt": q.prompt, "answer": q.reference()})
    paths = {}
    for name, items in rows.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in items))
    return paths


def write_retrieval_factuality(path: str | Path, n: int, *, seed: int = 0) -> Path:
    """Write `n` factuality rows {"prompt", "completion", "labels"} (per sentence, 1 = factual
    error) of `sample_retrieval_answer`s to `n` new questions (a seed of their own)."""
    rng, path = random.Random(seed + 2_000_003), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(n):
            q = sample_question(rng)
            answer = sample_retrieval_answer(rng, q)
            labels = grade(q, answer).sentence_factual
            f.write(json.dumps({"prompt": q.prompt, "completion": answer, "labels": labels}) + "\n")
    return path


#: `write_reading_corpus`'s draw: the one whose language model (configs/instruction_tuning/
#: tiny_lm_facts_cosine.yaml, then tiny_lm_facts.yaml) learns to bind values to names; other draws
#: and schedules tried did not (docs/algorithms/fine_grained_rlhf.md)
READING_SEED = 777


def write_reading_corpus(
    path: str | Path, n: int, *, seed: int = READING_SEED, shared: float = 0.0
) -> Path:
    """Write `n` rows {"prompt", "completion"}: new questions, each with a correct answer (1-3 of
    the target's facts, in random order). Language-model text for a reward model's backbone:
    predicting each value means reading it off the notes for the right person, the look-up the
    factuality reward model needs (the paper's start from a pretrained Longformer; the tiny world
    has none). A share `shared` of the questions have a distractor with the target's attributes
    (`sample_question(shared=True)`), so that more values need the name to be told apart than
    the task's quarter; at 0.5 it did not make the binding more often learned, so the pipeline
    writes the task's own mix (0: no extra random draw per row), at `READING_SEED`."""
    rng, path = random.Random(seed), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(n):
            q = sample_question(rng, shared=shared > 0 and rng.random() < shared)
            items = list(q.facts.items())
            rng.shuffle(items)
            kept = items[: rng.randint(1, len(items))]
            answer = join_in_sentences(rng, [clause(q.target, a, v) for a, v in kept])
            f.write(json.dumps({"prompt": q.prompt, "completion": answer}) + "\n")
    return path


def corpus(size: int = 400, seed: int = 12345) -> list[str]:
    """Texts for training the task's tokenizer: prompts and answers."""
    rng = random.Random(seed)
    texts = []
    for _ in range(size):
        q = sample_question(rng)
        texts += [q.prompt, q.reference(), sample_answer(rng, q)]
    return texts


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Write the synthetic long-form QA task files")
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--retrieval", type=int, default=0, metavar="N",
        help="also write factuality_retrieval.jsonl: N answers to N new questions with the SFT "
        "policy's kinds of factual error (sample_retrieval_answer), labelled per sentence",
    )  # fmt: skip
    parser.add_argument(
        "--reading", type=int, default=0, metavar="N",
        help="also write reading.jsonl: N new questions with correct answers "
        "(write_reading_corpus)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for name, path in write_task(args.out_dir, train=args.train, heldout=args.heldout,
                                 seed=args.seed).items():  # fmt: skip
        print(f"{name}: {path} ({sum(1 for _ in path.open())} rows)")
    if args.retrieval:
        path = write_retrieval_factuality(
            Path(args.out_dir) / "factuality_retrieval.jsonl", args.retrieval, seed=args.seed
        )
        print(f"factuality_retrieval: {path} ({args.retrieval} rows)")
    if args.reading:
        path = write_reading_corpus(Path(args.out_dir) / "reading.jsonl", args.reading,
                                    seed=READING_SEED + args.seed)  # fmt: skip
        print(f"reading: {path} ({args.reading} rows)")
    return 0


if __name__ == "__main__":
    from rlhf_core.errors import run_main

    sys.exit(run_main(main))
