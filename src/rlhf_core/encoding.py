"""Text -> token ids -> padded tensors, with the one truncation rule every package uses.

A training example is a rendered prompt (chat template, generation prompt included) and one or
more completions, each tokenized separately (so the completion's tokens are known exactly under
any tokenizer) and ended with eos. Every package (SFT, reward models, direct alignment) and the
scoring of a saved reward model (`rlhf_core.scalar_head`) encode text here, so a sequence is cut
the same way at training and at scoring time.

The truncation rule (`fit_lengths`), with `max_length` the most prompt + completion tokens:

    prompt      keeps its last `max_prompt_length` tokens (its end holds the instruction and the
                generation prompt); `max_prompt_length: null` means it keeps as many as the
                completion leaves room for: max_length - len(completion), the longest completion
                of a pair; at least one token either way
    completion  is then cut at its end to the room left, max_length - len(prompt), at least one
                token (a cut completion loses its eos)

Both cuts are flagged per example so the data builders can count and report them.

Not here: chat rendering (`rlhf_core.chat`), row parsing (`rlhf_core.preference`, the packages),
each package's collate (it builds its own masks from `pad_sequences`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlhf_core.segmentation import segment, segment_end_tokens

MAX_PROMPT_LENGTH_HELP = (
    "keep the prompt's last N tokens; null = as many as the completion leaves room for "
    "(max_length - completion, the longer one of a pair); at least 1"
)


@dataclass
class EncodedCompletion:
    """Token ids of one prompt and its completion (ending with eos unless truncated)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    truncated: bool  # the completion lost tokens to max_length
    prompt_truncated: bool = False  # the prompt lost its start (see the module docstring)


@dataclass
class EncodedSteps:
    """Token ids of one prompt and a step-by-step completion: each step, then the separator."""

    prompt_ids: list[int]
    completion_ids: list[int]
    step_ends: list[int]  # index in completion_ids of each kept step's separator token
    dropped_steps: int  # steps that did not fit in max_length (a cut first step counts too)


def tokenize_texts(tokenizer: Any, texts: list[str], chunk: int = 1024) -> list[list[int]]:
    """Token ids of each text, no special tokens added, in batches of `chunk`."""
    out: list[list[int]] = []
    for start in range(0, len(texts), chunk):
        out.extend(tokenizer(texts[start : start + chunk], add_special_tokens=False)["input_ids"])
    return out


def prompt_budget(max_length: int, max_prompt_length: int | None, completion_length: int) -> int:
    """How many of the prompt's last tokens to keep (see the module docstring)."""
    if max_prompt_length is not None:
        return max_prompt_length
    return max(1, max_length - completion_length)


def fit_lengths(
    prompt_ids: list[int],
    completions: list[list[int]],
    *,
    max_length: int,
    max_prompt_length: int | None,
) -> tuple[list[int], list[list[int]], bool, list[bool]]:
    """Cut a prompt and its completions (a pair shares one prompt) to the limits: (prompt,
    completions, prompt was cut, each completion was cut)."""
    keep = prompt_budget(max_length, max_prompt_length, max(len(c) for c in completions))
    prompt_cut = len(prompt_ids) > keep
    prompt_ids = prompt_ids[-keep:]
    room = max(1, max_length - len(prompt_ids))
    return (
        prompt_ids,
        [c[:room] for c in completions],
        prompt_cut,
        [len(c) > room for c in completions],
    )


def encode_pairs(
    tokenizer: Any,
    prompt_texts: list[str],
    completions: list[tuple[str, ...]],
    *,
    max_length: int,
    max_prompt_length: int | None = None,
) -> list[list[EncodedCompletion]]:
    """Tokenize rendered prompts and, per prompt, one or more completions (+ eos), cut together
    by `fit_lengths`: every completion of a prompt follows the same prompt tokens."""
    if len(prompt_texts) != len(completions):
        raise ValueError(f"{len(prompt_texts)} prompts but {len(completions)} completion tuples")
    width = {len(c) for c in completions}
    if len(width) > 1:
        raise ValueError(f"every prompt needs the same number of completions, got {sorted(width)}")
    eos = tokenizer.eos_token_id
    n = width.pop() if width else 0
    columns = [tokenize_texts(tokenizer, [c[k] for c in completions]) for k in range(n)]
    out = []
    for i, p_ids in enumerate(tokenize_texts(tokenizer, prompt_texts)):
        full = [column[i] + [eos] for column in columns]
        p_ids, cut_ids, p_cut, c_cut = fit_lengths(
            p_ids, full, max_length=max_length, max_prompt_length=max_prompt_length
        )
        out.append(
            [EncodedCompletion(p_ids, c, t, p_cut) for c, t in zip(cut_ids, c_cut, strict=True)]
        )
    return out


def encode_completions(
    tokenizer: Any,
    prompt_texts: list[str],
    completions: list[str],
    *,
    max_length: int,
    max_prompt_length: int | None = None,
) -> list[EncodedCompletion]:
    """Tokenize rendered prompts and their completions (+ eos), cut by `fit_lengths`."""
    if len(prompt_texts) != len(completions):
        raise ValueError(f"{len(prompt_texts)} prompts but {len(completions)} completions")
    encoded = encode_pairs(
        tokenizer, prompt_texts, [(c,) for c in completions],
        max_length=max_length, max_prompt_length=max_prompt_length,
    )  # fmt: skip
    return [e[0] for e in encoded]


def separator_token_id(tokenizer: Any, separator: str) -> int:
    """The id of a step separator, which must be exactly one token under `tokenizer`."""
    ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(
            f"step separator {separator!r} is {len(ids)} tokens {ids} under this tokenizer; it "
            "must be exactly one token (choose e.g. '\\n' or a special token)"
        )
    return ids[0]


def encode_steps(
    tokenizer: Any,
    prompt_texts: list[str],
    steps: list[list[str]],
    *,
    separator: str,
    max_length: int,
    max_prompt_length: int | None = None,
) -> list[EncodedSteps]:
    """Tokenize rendered prompts and step lists: completion = step_1 sep step_2 sep ... step_n sep.

    Each step is tokenized on its own, so every separator is exactly one token at a known place.
    The prompt is cut by the rule of the module docstring (the completion being all the steps and
    separators); whole steps are then kept while they fit in `max_length`; if even the first does
    not fit it is cut (and counted as dropped).
    """
    if len(prompt_texts) != len(steps):
        raise ValueError(f"{len(prompt_texts)} prompts but {len(steps)} step lists")
    sep = separator_token_id(tokenizer, separator)
    flat = tokenize_texts(tokenizer, [s for row in steps for s in row])
    out, cursor = [], 0
    for p_ids in tokenize_texts(tokenizer, prompt_texts):
        n = len(steps[len(out)])
        row_steps, cursor = flat[cursor : cursor + n], cursor + n
        keep = prompt_budget(max_length, max_prompt_length, sum(len(s) + 1 for s in row_steps))
        p_ids = p_ids[-keep:]
        room = max(2, max_length - len(p_ids))
        ids: list[int] = []
        ends: list[int] = []
        for step_ids in row_steps:
            if len(ids) + len(step_ids) + 1 > room:
                break
            ids.extend(step_ids + [sep])
            ends.append(len(ids) - 1)
        dropped = n - len(ends)
        if not ends and row_steps:  # the first step alone is too long: keep its start
            ids = row_steps[0][: room - 1] + [sep]
            ends = [len(ids) - 1]
        out.append(EncodedSteps(p_ids, ids, ends, dropped))
    return out


def pad_sequences(
    sequences: list[list[int]], pad_id: int, *, side: Literal["left", "right"] = "right"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T_max), padded on `side`."""
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for b, seq in enumerate(sequences):
        cols = slice(0, len(seq)) if side == "right" else slice(longest - len(seq), longest)
        input_ids[b, cols] = torch.tensor(seq, dtype=torch.long)
        attention_mask[b, cols] = 1
    return input_ids, attention_mask


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last position whose mask is set; right or left padding alike.

    `attention_mask` is (B, T), bool or 0/1. A row with no set position gets index 0.
    """
    if attention_mask.dim() != 2:
        raise ValueError(
            f"last_token_index: expected a (B, T) mask, got shape {tuple(attention_mask.shape)}"
        )
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.ne(0)).argmax(-1)


def encode_segments(
    tokenizer: Any,
    prompt_texts: list[str],
    completions: list[str],
    *,
    level: str,
    max_length: int,
    max_prompt_length: int | None = None,
) -> list[EncodedSteps]:
    """Tokenize rendered prompts and completions (+ eos) and find the token that ends each
    sentence or sub-sentence of the completion (`rlhf_core.segmentation`, pysbd); truncation as
    `encode_completions`, and segments whose end was cut off are dropped (counted)."""
    encoded = encode_completions(
        tokenizer, prompt_texts, completions, max_length=max_length,
        max_prompt_length=max_prompt_length,
    )  # fmt: skip
    out = []
    for text, e in zip(completions, encoded, strict=True):
        segs = segment(text, level)
        full = tokenize_texts(tokenizer, [text])[0]
        ends = segment_end_tokens(tokenizer, full, segs) if segs else []
        kept = [end for end in ends if end < len(e.completion_ids)]
        out.append(EncodedSteps(e.prompt_ids, e.completion_ids, kept, len(ends) - len(kept)))
    return out
