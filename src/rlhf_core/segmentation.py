"""Segmenting text into sentences and sub-sentences, and mapping segments to token positions.

Fine-Grained RLHF (Wu et al. 2023, arXiv:2306.01693) rewards a completion at the end of each
segment a reward model judges: relevance per sub-sentence, factuality per sentence.

    segment(text, "sentence")      pysbd's rule-based sentence boundaries (Golden Rules: "Dr.",
                                   "3.5", "e.g.", quotes and ellipses do not end a sentence)
    segment(text, "subsentence")   each sentence further cut after a comma, semicolon or colon that
                                   is followed by a space (so "3,500" and "12:30" stay whole), as
                                   the paper splits sentences into sub-sentences at punctuation
    segment_end_tokens(tokenizer, token_ids, segments)
                                   for each segment, the index of the token that holds its last
                                   character in the decoding of `token_ids`: where its reward lands

Segments keep character offsets into the original text (`start`, `end`, trailing spaces
excluded) and never lose text: the segments plus the spaces between them are the text. Not here:
languages other than English (pysbd supports more; `language` is fixed to "en").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

Level = Literal["sentence", "subsentence"]
LEVELS: tuple[str, ...] = ("sentence", "subsentence")
_SUB_BREAK = re.compile(r"[,;:](?=\s)")


@dataclass(frozen=True)
class Segment:
    text: str  # the segment, trailing whitespace stripped
    start: int  # character offset of its first character in the segmented text
    end: int  # offset one past its last character


@lru_cache(maxsize=1)
def _sentence_segmenter() -> Any:
    import pysbd

    return pysbd.Segmenter(language="en", clean=False, char_span=True)


#: control characters (all but newline) as spaces, one character for one, so every offset into
#: the text stays the same
_BLANK_CONTROLS = {i: " " for i in [*range(0x20), *range(0x7F, 0xA0)] if i != 0x0A}


def _sentence_spans(text: str) -> tuple[str, Any]:
    """pysbd's sentence spans of `text`, and the text they are of: `text` itself, or where pysbd
    raises (its numbered-list rule calls int() on "\\x1d8" in "a 1.\\x1d8. b"; a policy's sampled
    bytes hold such characters) a copy with its control characters blanked."""
    try:
        return text, _sentence_segmenter().segment(text)
    except ValueError:
        plain = text.translate(_BLANK_CONTROLS)
        return plain, _sentence_segmenter().segment(plain)


def _trimmed(text: str, start: int, end: int) -> Segment | None:
    piece = text[start:end]
    lead = len(piece) - len(piece.lstrip())
    body = piece.strip()
    if not body:
        return None
    return Segment(body, start + lead, start + lead + len(body))


def segment(text: str, level: Level) -> list[Segment]:
    """`text` cut into sentences or sub-sentences (see the module docstring)."""
    if level not in LEVELS:
        raise ValueError(f"segment level {level!r}: expected one of {LEVELS}")
    sentences = []
    cursor = 0
    plain, spans = _sentence_spans(text)
    for span in spans:
        # pysbd's spans are into the text; search from the cursor to be robust to its offsets
        start = plain.find(span.sent.strip(), cursor) if span.sent.strip() else -1
        if start < 0:
            continue
        seg = _trimmed(plain, start, start + len(span.sent.strip()))
        if seg is not None:
            sentences.append(Segment(text[seg.start : seg.end], seg.start, seg.end))
            cursor = seg.end
    if level == "sentence":
        return sentences
    out = []
    for sent in sentences:
        start = sent.start
        for found in _SUB_BREAK.finditer(sent.text):
            cut = sent.start + found.end()
            piece = _trimmed(text, start, cut)
            if piece is not None:
                out.append(piece)
            start = cut
        piece = _trimmed(text, start, sent.end)
        if piece is not None:
            out.append(piece)
    return out


def decoded_prefix_lengths(tokenizer: Any, token_ids: list[int]) -> list[int]:
    """len(decode(token_ids[: i + 1])) for each i (special tokens skipped): the character where
    each token's text ends in the decoded completion."""
    return [
        len(tokenizer.decode(token_ids[: i + 1], skip_special_tokens=True))
        for i in range(len(token_ids))
    ]


def segment_end_tokens(tokenizer: Any, token_ids: list[int], segments: list[Segment]) -> list[int]:
    """For each segment of `tokenizer.decode(token_ids, skip_special_tokens=True)`, the index
    (into `token_ids`) of the first token whose decoded prefix reaches the segment's end, i.e.
    the token holding its last character. Segments must come from that decoded text."""
    ends = decoded_prefix_lengths(tokenizer, token_ids)
    out = []
    for seg in segments:
        index = next((i for i, e in enumerate(ends) if e >= seg.end), None)
        if index is None:
            raise ValueError(
                f"segment {seg.text!r} ends at character {seg.end}, past the decoded text "
                f"({ends[-1] if ends else 0} characters)"
            )
        out.append(index)
    return out
