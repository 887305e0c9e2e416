"""Offline builders of labelled ORM / PRM data (no hub): right and deliberately wrong solutions.

    python -m reward_models.build_data orm-gsm8k --input data/gsm8k/train-2000.jsonl \\
        --output outputs/data/gsm8k_orm.jsonl [--wrong 3] [--seed 0] [--limit N]
    python -m reward_models.build_data orm-reasoning-gym --task spell_backward --size 2000 \\
        --seed 1 [--task-config '{"min_word_len": 3}'] --output outputs/data/spell_orm.jsonl
    python -m reward_models.build_data prm-gsm8k --input data/gsm8k/train-2000.jsonl \\
        --output outputs/data/gsm8k_prm.jsonl [--corruption arithmetic|copy]
        [--after-error drop|negative] [--no-gold] [--seed 0]
    python -m reward_models.build_data prm-reasoning-gym --task spell_backward --size 2000 \\
        --output outputs/data/spell_prm.jsonl [--after-error drop|negative] [--no-gold]

ORM rows are `{"prompt", "completion", "label"}` (label true = the final answer is right); PRM rows
are `{"prompt", "steps", "labels"}` with PRM800K ratings (+1 good, -1 an error). The same functions
run on the fly when a config's data source is a GSM8K file or a reasoning-gym task, so a built
file and an on-the-fly run see the same rows. The construction is documented in
docs/reward_models/data.md. Every choice is seeded per question (`Random(f"{seed}:{index}")`), so
a row does not change when `--limit` or the file order of other rows changes.

GSM8K steps are the lines of the worked answer (the final `#### N` line included, as the final
step). A calculation is the dataset's calculator annotation `<<expr=R>>` followed by the visible
result R. Corruptions of one calculation:
    arithmetic   R is replaced by a wrong value R' in the annotation and the visible text: the
                 step states a wrong result (an arithmetic error; checking it needs arithmetic)
    copy         only the visible result becomes R': the step contradicts its own annotation
                 (a transcription error; checkable by comparing the two numbers)

reasoning-gym answers: wrong ones are perturbed numbers, or reversed / swapped / replaced /
another example's text (`rlhf_core.wrong_answers.wrong_answers`, which also builds the preference
pairs of reasoning-gym sources, for reward models and direct alignment alike); a PRM spells the
answer one character per step and one step writes a letter the answer does not contain
(`reasoning_gym_prm_rows`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from rlhf_core.errors import UserError, UserFileNotFound
from rlhf_core.wrong_answers import (
    WRONG_KINDS,
    reasoning_gym_labelled_rows,
    seeded_rng,
    wrong_number,
)

CALC = re.compile(r"<<([^<>=]*)=([^<>]*)>>(\$?)(-?[\d,]*\.?\d+)")
FINAL = re.compile(r"^####\s*(.+)$")

Corruption = Literal["arithmetic", "copy"]
AfterError = Literal["drop", "negative"]


# ----------------------------------------------------------------------------- GSM8K


def gsm8k_steps(answer: str, *, where: str) -> list[str]:
    """The worked answer's non-empty lines; the last must be the `#### N` final answer."""
    steps = [line.strip() for line in answer.split("\n") if line.strip()]
    if not steps or not FINAL.match(steps[-1]):
        raise UserError(f"{where}: a GSM8K answer must end with a '#### <answer>' line")
    return steps


def corrupt_calculation(step: str, match: re.Match, new: str, corruption: Corruption) -> str:
    """`step` with the calculation `match` (of CALC) given the wrong result `new`."""
    expr, result, dollar, _ = match.groups()
    stated = new if corruption == "arithmetic" else result
    return step[: match.start()] + f"<<{expr}={stated}>>{dollar}{new}" + step[match.end() :]


def corrupt_step(step: str, rng: random.Random, corruption: Corruption) -> str:
    """`step` with one of its calculations (chosen by `rng`) made wrong."""
    match = rng.choice(list(CALC.finditer(step)))
    return corrupt_calculation(step, match, wrong_number(match.group(4), rng), corruption)


def _question_answer(row: dict[str, Any], where: str) -> tuple[str, str]:
    for column in ("question", "answer"):
        if not isinstance(row.get(column), str):
            raise UserError(f"{where} column {column!r}: expected a string (GSM8K row)")
    return row["question"], row["answer"]


def gsm8k_orm_rows(
    rows: Iterable[dict[str, Any]], *, wrong: int = 3, seed: int = 0, where: str = "gsm8k"
) -> Iterator[dict[str, Any]]:
    """Per question: the reference solution (label true) and up to `wrong` solutions whose last
    calculation is wrong (arithmetic corruption) with the final answer changed to match (false).
    Questions whose final answer is not the result of a calculation yield only the reference."""
    for index, row in enumerate(rows):
        question, answer = _question_answer(row, f"{where}: row {index}")
        steps = gsm8k_steps(answer, where=f"{where}: row {index} column 'answer'")
        yield {"prompt": question, "completion": "\n".join(steps), "label": True}
        final = FINAL.match(steps[-1]).group(1).strip().replace(",", "")
        last = max((i for i, s in enumerate(steps[:-1]) if CALC.search(s)), default=None)
        if last is None:
            continue
        match = list(CALC.finditer(steps[last]))[-1]
        if match.group(4).replace(",", "") != final:
            continue
        rng, seen = seeded_rng(seed, index), set()
        for _ in range(10 * wrong):
            new = wrong_number(match.group(4), rng)
            if new in seen:
                continue
            seen.add(new)
            bad = corrupt_calculation(steps[last], match, new, "arithmetic")
            completion = "\n".join([*steps[:last], bad, *steps[last + 1 : -1], f"#### {new}"])
            yield {"prompt": question, "completion": completion, "label": False}
            if len(seen) >= wrong:
                break


def gsm8k_prm_rows(
    rows: Iterable[dict[str, Any]],
    *,
    corruption: Corruption = "arithmetic",
    after_error: AfterError = "drop",
    gold: bool = True,
    seed: int = 0,
    where: str = "gsm8k",
) -> Iterator[dict[str, Any]]:
    """Per question: the reference solution with every step +1 (if `gold`), and one copy with a
    uniformly chosen calculation step corrupted: earlier steps +1, that step -1, later steps
    dropped (PRM800K: labelling stops at the first error) or kept and labelled -1 (`negative`).
    Questions without a calculation step yield only the reference."""
    for index, row in enumerate(rows):
        question, answer = _question_answer(row, f"{where}: row {index}")
        steps = gsm8k_steps(answer, where=f"{where}: row {index} column 'answer'")
        if gold:
            yield {"prompt": question, "steps": steps, "labels": [1] * len(steps)}
        candidates = [i for i, s in enumerate(steps) if CALC.search(s)]
        if not candidates:
            continue
        rng = seeded_rng(seed, index)
        j = rng.choice(candidates)
        bad = corrupt_step(steps[j], rng, corruption)
        kept = steps[:j] + [bad] + (steps[j + 1 :] if after_error == "negative" else [])
        labels = [1] * j + [-1] * (len(kept) - j)
        yield {"prompt": question, "steps": kept, "labels": labels}


# ----------------------------------------------------------------------------- reasoning-gym


def reasoning_gym_prm_rows(
    entries: list[dict[str, Any]],
    *,
    after_error: AfterError = "drop",
    gold: bool = True,
    seed: int = 0,
) -> Iterator[dict[str, Any]]:
    """Step-by-step spelling of each reasoning-gym answer, one character per step (made for
    spell_backward): the reference spelling with every step +1 (if `gold`), and a copy in which
    one step writes a letter the answer does not contain (earlier steps +1, that step -1, later
    steps dropped or labelled -1 as in `gsm8k_prm_rows`). Answers without a letter to replace
    (or with every letter of the alphabet) yield only the reference."""
    for index, entry in enumerate(entries):
        steps = list(str(entry["answer"]))
        if gold:
            yield {"prompt": entry["question"], "steps": steps, "labels": [1] * len(steps)}
        rng = seeded_rng(seed, index)
        absent = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in entry["answer"].lower()]
        letters = [k for k, c in enumerate(steps) if c.isalpha()]
        if not absent or not letters:
            continue
        j = rng.choice(letters)
        bad = rng.choice(absent)
        kept = steps[:j] + [bad.upper() if steps[j].isupper() else bad]
        kept += steps[j + 1 :] if after_error == "negative" else []
        yield {
            "prompt": entry["question"],
            "steps": kept,
            "labels": [1] * j + [-1] * (len(kept) - j),
        }


# ----------------------------------------------------------------------------- command line


def _read_jsonl(path: Path, limit: int | None) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserFileNotFound(f"--input: file not found: {path}")
    rows = []
    with open(path) as fh:
        for number, line in enumerate(fh, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}: line {number} is not valid JSON: {exc}") from None
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    count = 0
    with open(tmp, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
            count += 1
    tmp.replace(path)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reward_models.build_data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("orm-gsm8k", "prm-gsm8k", "orm-reasoning-gym", "prm-reasoning-gym"):
        p = sub.add_parser(name)
        p.add_argument("--output", type=Path, required=True, help="JSON-lines file to write")
        p.add_argument("--seed", type=int, default=0, help="seed of the random choices")
        if name.endswith("gsm8k"):
            p.add_argument("--input", type=Path, required=True, help="GSM8K JSON-lines file")
            p.add_argument("--limit", type=int, default=None, help="use the first N questions")
        if name.startswith("orm"):
            p.add_argument("--wrong", type=int, default=3, help="wrong answers per question")
        if name == "prm-gsm8k":
            p.add_argument("--corruption", choices=["arithmetic", "copy"], default="arithmetic")
        if name.startswith("prm"):
            p.add_argument("--after-error", choices=["drop", "negative"], default="drop")
            p.add_argument("--no-gold", action="store_true", help="omit the all-correct copies")
        if name.endswith("reasoning-gym"):
            p.add_argument(
                "--task", required=True, help="reasoning-gym dataset, e.g. spell_backward"
            )
            p.add_argument("--size", type=int, required=True, help="examples to generate")
            p.add_argument("--task-seed", type=int, default=1, help="reasoning-gym seed")
            p.add_argument("--task-config", type=json.loads, default={}, help="task options, JSON")
        if name == "orm-reasoning-gym":
            p.add_argument("--wrong-kinds", nargs="+", choices=WRONG_KINDS, default=WRONG_KINDS,
                           help="how wrong text answers are made")  # fmt: skip
    args = parser.parse_args(argv)
    if args.command.endswith("reasoning-gym"):
        from rlhf_core.data import ReasoningGymSource, reasoning_gym_dataset

        source = ReasoningGymSource(task=args.task, size=args.size, seed=args.task_seed,
                                    config=args.task_config)  # fmt: skip
        entries = list(reasoning_gym_dataset(source))
        if args.command == "orm-reasoning-gym":
            rows = reasoning_gym_labelled_rows(
                entries, wrong=args.wrong, kinds=tuple(args.wrong_kinds), seed=args.seed
            )
        else:
            rows = reasoning_gym_prm_rows(
                entries, after_error=args.after_error, gold=not args.no_gold, seed=args.seed
            )
    else:
        source_rows = _read_jsonl(args.input, args.limit)
        where = str(args.input)
        if args.command == "orm-gsm8k":
            rows = gsm8k_orm_rows(source_rows, wrong=args.wrong, seed=args.seed, where=where)
        else:
            rows = gsm8k_prm_rows(
                source_rows, corruption=args.corruption, after_error=args.after_error,
                gold=not args.no_gold, seed=args.seed, where=where,
            )  # fmt: skip
    count = write_jsonl(rows, args.output)
    print(f"wrote {count} rows to {args.output}")
    return 0


if __name__ == "__main__":
    from rlhf_core.errors import run_main

    sys.exit(run_main(main))
