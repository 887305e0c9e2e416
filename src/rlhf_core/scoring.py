"""Scoring generated answers against references: exact match and a task's own partial credit.

`task_score` uses the reasoning-gym dataset's `score_answer` when the example came from
reasoning-gym (e.g. spell_backward: 1/len per character in the right position, ignoring case),
else exact match.
"""

from __future__ import annotations

from typing import Any


def exact_match(text: str, reference: str) -> float:
    """1.0 if the answer equals the reference after stripping surrounding whitespace."""
    return float(text.strip() == reference.strip())


def task_score(
    text: str, reference: str, entry: dict[str, Any] | None, scorer: Any | None
) -> float:
    """The task's partial credit in [0, 1] (reasoning-gym `score_answer`), else exact match."""
    if scorer is not None and entry is not None:
        return float(scorer.score_answer(text.strip(), entry))
    return exact_match(text, reference)
