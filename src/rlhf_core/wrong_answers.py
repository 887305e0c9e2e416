"""Offline labelled data from reasoning-gym tasks: right answers and deliberately wrong ones.

A reasoning-gym task's examples carry their reference answer, which is right; `wrong_answers`
makes deliberately wrong ones (a number perturbed; text reversed, two characters swapped, one
replaced, or another example's answer). `reasoning_gym_labelled_rows` gives labelled single
completions (ORM rows; KTO's unpaired rows), `reasoning_gym_preference_rows` pairs (chosen = the
answer, rejected = one wrong answer). Every choice is seeded per example (`seeded_rng`), so a row
does not change when other rows do. The rows are in the standard layouts of `rlhf_core.columns`
(unpaired, preference), so the loaders read them like a file's rows.

Not here: GSM8K and PRM builders (`reward_models.build_data`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any, Literal


def seeded_rng(seed: int, index: int) -> random.Random:
    """The random generator of example `index` under `seed`."""
    return random.Random(f"{seed}:{index}")


def wrong_number(text: str, rng: random.Random) -> str:
    """A different number written like `text` (same decimals, no sign flip of non-negatives)."""
    clean = text.replace(",", "")
    decimals = len(clean.split(".")[1]) if "." in clean else 0
    value = float(clean)
    step = 10.0**-decimals
    while True:
        delta = rng.choice([-3, -2, -1, 1, 2, 3, 5, 10]) * step
        new = value + delta
        if new != value and (value < 0 or new >= 0):
            return f"{new:.{decimals}f}"


WRONG_KINDS = ("reverse", "swap", "replace", "other")
WrongKind = Literal["reverse", "swap", "replace", "other"]


def wrong_answers(
    answer: str,
    rng: random.Random,
    k: int,
    *,
    others: list[str],
    kinds: tuple[str, ...] = WRONG_KINDS,
) -> list[str]:
    """Up to `k` distinct wrong versions of a short answer. A number is perturbed (`wrong_number`);
    text is, by a kind drawn from `kinds`: reversed, two neighbouring characters swapped, one
    character replaced by another letter, or another example's answer (from `others`)."""
    found: list[str] = []
    for _ in range(50 * k):
        if len(found) >= k:
            break
        if re.fullmatch(r"-?[\d,]*\.?\d+", answer.strip()):
            candidate = wrong_number(answer.strip(), rng)
        else:
            candidate = _wrong_text(answer, rng, others, rng.choice(kinds))
        if candidate != answer and candidate not in found and candidate.strip():
            found.append(candidate)
    return found


def _wrong_text(answer: str, rng: random.Random, others: list[str], how: str) -> str:
    chars = list(answer)
    if how == "reverse":
        return answer[::-1]
    if how == "swap" and len(chars) > 1:
        i = rng.randrange(len(chars) - 1)
        chars[i], chars[i + 1] = chars[i + 1], chars[i]
        return "".join(chars)
    if how == "replace" and chars:
        i = rng.randrange(len(chars))
        chars[i] = rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c != chars[i]])
        return "".join(chars)
    return rng.choice(others) if others else answer[::-1]


# ----------------------------------------------------------------------------- reasoning-gym


def reasoning_gym_labelled_rows(
    entries: list[dict[str, Any]],
    *,
    wrong: int = 3,
    kinds: tuple[str, ...] = WRONG_KINDS,
    seed: int = 0,
) -> Iterator[dict[str, Any]]:
    """Per reasoning-gym example: the reference answer (label true) and up to `wrong` wrong
    answers (`wrong_answers` of `kinds`; label false), each a row {"prompt", "completion",
    "label"} with the example's question: ORM rows, and KTO's unpaired rows."""
    answers = [str(e["answer"]) for e in entries]
    for index, entry in enumerate(entries):
        rng = seeded_rng(seed, index)
        others = [a for a in rng.sample(answers, min(len(answers), 8)) if a != answers[index]]
        yield {"prompt": entry["question"], "completion": answers[index], "label": True}
        for bad in wrong_answers(answers[index], rng, wrong, others=others, kinds=kinds):
            yield {"prompt": entry["question"], "completion": bad, "label": False}


def reasoning_gym_preference_rows(
    entries: list[dict[str, Any]], *, kinds: tuple[str, ...] = WRONG_KINDS, seed: int = 0
) -> Iterator[dict[str, Any]]:
    """Per reasoning-gym example: chosen = the reference answer, rejected = one wrong answer."""
    for row in reasoning_gym_labelled_rows(entries, wrong=1, kinds=kinds, seed=seed):
        if row["label"]:
            good = row
        else:
            yield {
                "prompt": good["prompt"],
                "chosen": good["completion"],
                "rejected": row["completion"],
            }
