"""What a long-form policy's answers get wrong, clause by clause, and whether segment reward
models see it (docs/algorithms/fine_grained_rlhf.md, "Why the first comparison failed"):

    uv run python -m rlhf_lab.fine_grained_diag POLICY_DIR [--rm relevance=DIR]
        [--rm factuality=DIR] [--alone] [--heldout 100] [--sampling-seeds 1]

Greedy and sampled (T=1, seeded) answers to the first `--heldout` held-out prompts, as
`rlhf_lab.fine_grained` evaluates them; every sub-sentence classed against the notes (a correct
fact, an attribute the notes do not give, the distractor's value, another attested or an
unattested value, another person, a clause with another attribute's value such as "Mira lives in
nurse", not a template clause); then each segment reward model's recall and precision of the
exact error labels (`rlhf_core.longform.grade`) on those answers, in all and by the segment's
position in its answer (a reward model trained on short answers may not see errors further on;
`--alone` scores each segment after the prompt alone, as a reward with `alone: true` does).
With `--sampling-seeds K` the sampled answers are drawn K times (seeds offset by 0, 100,000, ...;
offset 0 is the report's) and each draw's error rates are printed with their mean: how much of
a sampled row of the report is the sampling's noise.
Last, per mode, the sentences per answer: in all, about the target, wrong (`sentence_counts`:
the factual error rate is wrong / all, so fewer sentences of garbage raise it).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from statistics import mean

LEVELS = {"relevance": "subsentence_irrelevant", "factuality": "sentence_factual"}


def clause_kind(question, text: str) -> str:
    from rlhf_core.longform import ATTESTED, ATTRIBUTES, clause_shape, parse_clause

    parsed = parse_clause(text)
    if parsed is None:
        shaped = clause_shape(text)
        if shaped and any(shaped[2] in values for attribute, (_, values) in ATTRIBUTES.items()
                          if attribute != shaped[1]):  # fmt: skip
            return "another attribute's value"
        return "not a template clause"
    name, attribute, value = parsed
    if name != question.target:
        return "about another person"
    if attribute not in question.facts:
        return "attribute the notes do not give"
    if question.facts[attribute] == value:
        return "correct"
    if ATTRIBUTES[attribute][1].index(value) >= ATTESTED:
        return "unattested value"
    if question.distractor_facts.get(attribute) == value:
        return "the distractor's value"
    return "another attested value"


def sentence_counts(questions, answers: list[str]) -> collections.Counter:
    """Sentences of `answers` in all, those with a clause about the target (`about`), and those
    with a factual error (`wrong`, always about the target): the grader's factual error rate is
    wrong / all, so a sentence of garbage counts as a sentence without an error."""
    from rlhf_core.longform import parse_clause
    from rlhf_core.segmentation import segment

    counts = collections.Counter()
    for q, a in zip(questions, answers, strict=True):
        for sentence in segment(a, "sentence"):
            clauses = [parse_clause(s.text) for s in segment(sentence.text, "subsentence")]
            about = [c for c in clauses if c is not None and c[0] == q.target]
            counts["all"] += 1
            counts["about"] += bool(about)
            counts["wrong"] += any(q.facts.get(attribute) != value for _, attribute, value in about)
    return counts


def report_clauses(mode: str, questions, answers: list[str], items, rms, alone=False) -> None:
    """Print the answers' clauses by kind and each segment reward model's recall / precision."""
    from rlhf_core.longform import grade
    from rlhf_core.scalar_head import ScalarHeadModel
    from rlhf_core.segmentation import segment

    kinds = collections.Counter(
        clause_kind(q, sub.text)
        for q, a in zip(questions, answers, strict=True)
        for sentence in segment(a, "sentence")
        for sub in segment(sentence.text, "subsentence")
    )
    print(f"{mode} clauses: " + ", ".join(f"{k} {v}" for k, v in kinds.most_common()))
    for label, path in rms:
        model = ScalarHeadModel.from_pretrained(path, device="cpu")
        logits = model.segment_scores([it["messages"] for it in items], answers, alone=alone)
        counts, at = collections.Counter(), collections.Counter()  # at: (position, found)
        for q, a, x in zip(questions, answers, logits, strict=True):
            truth = getattr(grade(q, a), LEVELS[label])
            said = (x.float().softmax(-1)[:, 1] > 0.5).tolist()
            pairs = list(zip(truth, said, strict=False))
            counts.update((bool(t), bool(p)) for t, p in pairs)
            at.update((min(i, 3), bool(p)) for i, (t, p) in enumerate(pairs) if t)
        tp, fn, fp = counts[True, True], counts[True, False], counts[False, True]
        print(
            f"  {label} RM {path}: errors {tp + fn}, found {tp} (recall "
            f"{tp / max(1, tp + fn):.2f}), flagged {tp + fp} (precision "
            f"{tp / max(1, tp + fp):.2f})"
        )
        print("    errors found by the segment's position in the answer: " + ", ".join(
            f"{('1st', '2nd', '3rd', '4th on')[i]} {at[i, True]} of {at[i, True] + at[i, False]}"
            for i in range(4)
        ))  # fmt: skip


def reading_accuracy(model_dir: Path, rows: list[dict[str, str]]) -> dict[str, float]:
    """How well a causal LM reads the notes: after '<target> <verb>' in the answer, is the
    target's value the most likely of its attribute's values (each value's whole log-prob: some
    are several tokens)? `all` over every fact of the questions of `rows`; `bind` and `distractor`
    over the facts whose attribute the other person also has, with another value: the ones only
    the name tells apart. lm_facts' check: a model that never bound values to names reads `bind`
    near 0.5, one that did near 1 (docs/algorithms/fine_grained_rlhf.md)."""
    import torch

    from rlhf_core.logprobs import causal_lm_token_logprobs, masked_sum
    from rlhf_core.longform import ATTESTED, ATTRIBUTES, question_from_prompt
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(model_dir)), padding_side="right")
    model = load_policy(ModelConfig(name_or_path=str(model_dir))).eval()
    n = right = shared = bound = distracted = 0
    for row in rows:
        q = question_from_prompt(row["prompt"])
        head = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )  # fmt: skip
        for attribute, value in q.facts.items():
            stem = head + ATTRIBUTES[attribute][0].format(name=q.target, value="\0").split("\0")[0]
            start = len(tokenizer(stem.rstrip(), add_special_tokens=False).input_ids)
            values = ATTRIBUTES[attribute][1][:ATTESTED]
            ids = [tokenizer(stem + v, add_special_tokens=False).input_ids for v in values]
            width = max(map(len, ids))
            batch = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids])
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
            value_tokens = mask[:, 1:].clone()  # logprob t-1 is token t's
            value_tokens[:, : start - 1] = 0
            with torch.no_grad():
                logp = causal_lm_token_logprobs(model, batch, mask)
            scores = masked_sum(logp, value_tokens, dim=-1).tolist()
            pick = values[max(range(len(values)), key=scores.__getitem__)]
            other = q.distractor_facts.get(attribute)
            n, right = n + 1, right + (pick == value)
            if other is not None and other != value:
                shared, bound = shared + 1, bound + (pick == value)
                distracted += pick == other
    return {"all": right / n, "bind": bound / max(shared, 1),
            "distractor": distracted / max(shared, 1), "facts": n, "shared": shared}  # fmt: skip


#: lm_facts' `bind` below this: the factuality reward model will not tell the target's values
#: from the other person's (warned and reported)
MIN_BIND = 0.9


def check_reading(out: Path, offset: int, size: int = 400) -> dict[str, float]:
    """`reading_accuracy` of lm_facts' model on `size` held-out reading rows (from `offset`),
    kept in <out>/lm_facts/reading.json; a warning where it did not learn to bind."""
    path = out / "lm_facts" / "reading.json"
    if not path.is_file():
        lines = (out / "reading" / "reading.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines[offset : offset + size]]
        path.write_text(json.dumps(reading_accuracy(out / "lm_facts" / "final", rows)) + "\n")
    figures = json.loads(path.read_text())
    print(f"lm_facts reads the notes: {figures}")
    if figures["bind"] < MIN_BIND:
        print(
            f"warning: lm_facts' model tells the target's values from the other person's in only "
            f"{figures['bind']:.2f} of the held-out facts that need the name (< {MIN_BIND}): the "
            f"factuality reward model built on it will confuse the two; train it longer or from "
            f"another seed ({path})", file=sys.stderr,
        )  # fmt: skip
    return figures


def main(argv: list[str] | None = None) -> int:
    import torch

    from policy_gradients.rollout import generate_rollouts, load_prompts
    from rlhf_core.data import DataSource
    from rlhf_core.generation import Sampling
    from rlhf_core.longform import error_rates, question_from_prompt
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policy", type=Path)
    parser.add_argument("--rm", action="append", default=[], help="relevance=DIR or factuality=DIR")
    parser.add_argument("--alone", action="store_true", help="score each segment on its own")
    parser.add_argument("--heldout", type=int, default=100)
    parser.add_argument("--data", type=Path, default=Path("data/longform/heldout.jsonl"))
    parser.add_argument(
        "--sampling-seeds", type=int, default=1, metavar="K",
        help="draw the sampled answers K times and print each draw's error rates",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.sampling_seeds < 1:
        parser.error(f"--sampling-seeds: expected an integer >= 1, got {args.sampling_seeds}")
    rms = []
    for spec in args.rm:
        label, _, path = spec.partition("=")
        if label not in LEVELS or not path:
            parser.error(f"--rm {spec!r}: expected relevance=DIR or factuality=DIR")
        rms.append((label, path))
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(args.policy)), padding_side="left")
    items = load_prompts(
        DataSource(path=str(args.data), limit=args.heldout), tokenizer, prompt_column="prompt",
        answer_column="answer", prompt_template="{question}", system_prompt=None, where="heldout",
    ).items  # fmt: skip
    questions = [question_from_prompt(it["messages"][-1]["content"]) for it in items]
    policy = load_policy(ModelConfig(name_or_path=str(args.policy))).eval()
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        draws, counts = [], collections.Counter()
        for k in range(args.sampling_seeds if temperature else 1):
            with torch.no_grad():
                answers = generate_rollouts(
                    policy, tokenizer, [it["prompt"] for it in items], group_size=1,
                    max_new_tokens=40, sampling=Sampling(temperature=temperature),
                    seeds=[100_000 * k + i for i in range(len(items))],
                ).completions  # fmt: skip
            draws.append(error_rates(list(zip(questions, answers, strict=True))))
            counts += sentence_counts(questions, answers)
            if k == 0:
                report_clauses(mode, questions, answers, items, rms, args.alone)
        if len(draws) > 1:
            for key in ("irrelevant_rate", "factual_error_rate", "missing_rate"):
                values = [d[key] for d in draws]
                each = " ".join(f"{v:.3f}" for v in values)
                print(f"  {mode} {key} over {len(draws)} draws: mean {mean(values):.3f}; {each}")
        n = len(items) * len(draws)
        print(
            f"  {mode} sentences per answer {counts['all'] / n:.2f}, about the target "
            f"{counts['about'] / n:.2f}, wrong {counts['wrong'] / n:.2f}; wrong / all "
            f"{counts['wrong'] / max(1, counts['all']):.3f}, wrong / about the target "
            f"{counts['wrong'] / max(1, counts['about']):.3f}"
        )
    return 0


if __name__ == "__main__":
    from rlhf_core.errors import run_main

    sys.exit(run_main(main))
