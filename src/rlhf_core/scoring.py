"""Scoring generated answers against references: exact match, a task's own partial credit, and
ROUGE for long-form generation.

`task_score` uses the reasoning-gym dataset's `score_answer` when the example came from
reasoning-gym (e.g. spell_backward: 1/len per character in the right position, ignoring case),
else exact match. `rouge_scores` is ROUGE (Lin 2004) from Google's `rouge-score` package: the
F1 of ROUGE-1 / ROUGE-2 (unigram / bigram overlap) and ROUGE-L (longest common subsequence),
Porter-stemmed, against one reference each.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


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


@lru_cache(maxsize=8)
def _rouge_scorer(types: tuple[str, ...]) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(types), use_stemmer=True)


def rouge_scores(
    texts: list[str], references: list[str], types: tuple[str, ...] = ROUGE_TYPES
) -> dict[str, list[float]]:
    """ROUGE F1 of each text against its reference: {type: [f1 per text]}."""
    if len(texts) != len(references):
        raise ValueError(f"rouge_scores: {len(texts)} texts but {len(references)} references")
    unknown = set(types) - set(ROUGE_TYPES) - {"rougeLsum"}
    if unknown:
        raise ValueError(f"rouge_scores: unknown types {sorted(unknown)}; use {ROUGE_TYPES}")
    scorer = _rouge_scorer(tuple(types))
    out: dict[str, list[float]] = {t: [] for t in types}
    for text, ref in zip(texts, references, strict=True):
        scores = scorer.score(ref, text)  # (target, prediction)
        for t in types:
            out[t].append(scores[t].fmeasure)
    return out
