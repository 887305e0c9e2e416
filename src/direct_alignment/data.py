"""Preference pairs: rows -> (prompt, chosen, rejected) token ids -> one concatenated batch.

Row formats (`data.format`, `auto` picks by columns):
  preference      {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}
                  (message-list completions may repeat the prompt, as in UltraFeedback-binarized;
                  the shared prefix is removed and the last assistant turn is the completion)
  hh              Anthropic HH: {"chosen": transcript, "rejected": transcript}; each transcript is
                  split at its last "\\n\\nAssistant:" into the multi-turn prompt (parsed into
                  user/assistant messages) and the completion (see `split_hh_pair`)
  ultrafeedback   UltraFeedback-binarized: {"prompt": str, "chosen": [messages], "rejected": [...]}
  reasoning_gym   synthetic pairs from a task: chosen = the reference answer, rejected = a
                  deterministic corruption of it (`corrupt_answer`), for learnable offline tests
  unpaired        KTO's labelled single completions (`build_unpaired_data`):
                  {"prompt": str | messages, "completion": str | messages, "label": bool}, as in
                  trl-lib/kto-mix-14k; from reasoning-gym, two rows per task example (the answer,
                  label true; its corruption, label false)

Prompts are rendered with the tokenizer's chat template; completions end with eos. Truncation
keeps the end of the prompt (its last `max_prompt_length` tokens, default max_length // 2), then
cuts completions to fit `max_length`. Pairs whose two completions are identical after truncation
are dropped and counted. Empty completions (real HH data has a few) are kept as eos alone and
counted. A malformed row raises naming its index and column.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_core.chat import Messages, as_messages, completion_text, render_prompt, split_hh_pair
from rlhf_core.data import (
    DataSource,
    load_rows,
    reasoning_gym_dataset,
    report_degenerate,
    warn_truncated_prompts,
)
from rlhf_core.errors import UserError
from rlhf_core.scalar_head import encode_completions


@dataclass
class PreferencePair:
    """A preference pair; or, for unpaired data (`label` set), one labelled completion as
    `chosen_ids` and, as `rejected_ids`, the completion of another prompt that KTO's reference
    point reads (`build_unpaired_data`). Either way the two halves run as one batch."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_text: str
    label: bool | None = None


@dataclass
class PreferenceData:
    pairs: list[PreferencePair]
    dropped_identical: int = 0
    truncated: int = 0
    truncated_prompts: int = 0  # prompts that lost their start to max_prompt_length
    empty_completions: int = 0  # kept: an empty reply is the eos token alone (HH has some)
    dropped_overlong: int = 0  # pairs over the limits, with overlong="drop"


def row_to_triple(
    row: dict[str, Any], index: int, fmt: str, where: str
) -> tuple[Messages, str, str]:
    """(prompt messages, chosen text, rejected text) of one row."""
    here = f"{where}: row {index}"
    for column in ("chosen", "rejected"):
        if row.get(column) is None:
            raise UserError(f"{here} is missing column {column!r} (columns: {list(row)})")
    if fmt == "auto":
        fmt = "preference" if row.get("prompt") is not None else "hh"
    if fmt == "hh":
        if not isinstance(row["chosen"], str) or not isinstance(row["rejected"], str):
            raise UserError(f"{here}: HH rows need string transcripts in 'chosen' and 'rejected'")
        return split_hh_pair(
            row["chosen"], row["rejected"], where=f"{here} columns chosen/rejected"
        )
    if row.get("prompt") is None:
        raise UserError(f"{here} is missing column 'prompt' (columns: {list(row)})")
    prompt = as_messages(row["prompt"], where=f"{here} column 'prompt'")
    chosen = completion_text(row["chosen"], prompt, f"{here} column 'chosen'")
    rejected = completion_text(row["rejected"], prompt, f"{here} column 'rejected'")
    return prompt, chosen, rejected


def corrupt_answer(answer: str, seed: int) -> str:
    """A deterministic wrong answer: the reversed string if that differs, else two swapped chars,
    else the answer with its last character repeated."""
    if answer[::-1] != answer:
        return answer[::-1]
    chars = list(answer)
    rng = random.Random(seed)
    for _ in range(10):
        i, j = rng.randrange(len(chars)), rng.randrange(len(chars))
        if chars[i] != chars[j]:
            chars[i], chars[j] = chars[j], chars[i]
            return "".join(chars)
    return answer + answer[-1]


def _rows(source: DataSource, where: str) -> tuple[Any, str | None]:
    if source.reasoning_gym is None:
        return load_rows(source, field=where), None
    ds = reasoning_gym_dataset(source.reasoning_gym)
    rows = [
        {"prompt": e["question"], "chosen": e["answer"],
         "rejected": corrupt_answer(e["answer"], source.reasoning_gym.seed + i)}
        for i, e in enumerate(ds)
    ]  # fmt: skip
    return rows, "preference"


def build_preference_data(
    source: DataSource,
    tokenizer,
    *,
    fmt: str,
    max_length: int,
    max_prompt_length: int | None,
    where: str,
    limit: int | None = None,
    overlong: str = "truncate",
) -> PreferenceData:
    """Load, render, tokenize and truncate preference pairs (see the module docstring);
    `overlong="drop"` drops (and counts) pairs that would be cut instead of cutting them."""
    rows, forced = _rows(source, where)
    fmt = forced or fmt
    triples, empty, empty_chosen, empty_rejected = [], 0, 0, 0
    for index, row in enumerate(rows):
        prompt, chosen, rejected = row_to_triple(row, index, fmt, where)
        empty += (not chosen.strip()) + (not rejected.strip())
        empty_chosen += not chosen.strip()
        empty_rejected += not rejected.strip()
        prompt_text = render_prompt(tokenizer, prompt, where=f"{where}: row {index} prompt")
        triples.append((prompt_text, chosen, rejected))
        if limit is not None and len(triples) >= limit:
            break
    keep_prompt = max_prompt_length or max_length // 2
    data = PreferenceData(pairs=[], empty_completions=empty)
    eos = tokenizer.eos_token_id
    for start in range(0, len(triples), 1024):
        chunk = triples[start : start + 1024]
        enc = [
            tokenizer([t[k] for t in chunk], add_special_tokens=False)["input_ids"]
            for k in range(3)
        ]
        for (prompt_text, _, _), p_ids, c_ids, r_ids in zip(chunk, *enc, strict=True):
            longest = len(p_ids) + max(len(c_ids), len(r_ids)) + 1
            if overlong == "drop" and (len(p_ids) > keep_prompt or longest > max_length):
                data.dropped_overlong += 1
                continue
            data.truncated_prompts += len(p_ids) > keep_prompt
            p_ids = p_ids[-keep_prompt:]
            room = max(1, max_length - len(p_ids))
            c_full, r_full = c_ids + [eos], r_ids + [eos]
            c_ids, r_ids = c_full[:room], r_full[:room]
            data.truncated += (len(c_ids) < len(c_full)) or (len(r_ids) < len(r_full))
            if c_ids == r_ids:
                data.dropped_identical += 1
                continue
            data.pairs.append(PreferencePair(p_ids, c_ids, r_ids, prompt_text))
    if not data.pairs:
        raise UserError(f"{where}: no usable preference pairs in {source.describe()}")
    report_degenerate(where, len(triples), {
        "have an empty 'chosen' completion": empty_chosen,
        "have an empty 'rejected' completion": empty_rejected,
        "have identical chosen and rejected tokens (dropped)": data.dropped_identical,
    })  # fmt: skip
    if data.truncated_prompts:
        warn_truncated_prompts(where, data.truncated_prompts, len(triples), keep_prompt)
    return data


def unpaired_row(row: dict[str, Any], index: int, where: str) -> tuple[Messages, str, bool]:
    """(prompt messages, completion text, label) of one unpaired row."""
    here = f"{where}: row {index}"
    for column in ("prompt", "completion", "label"):
        if row.get(column) is None:
            raise UserError(f"{here} is missing column {column!r} (columns: {list(row)})")
    if not isinstance(row["label"], bool):
        raise UserError(
            f"{here} column 'label': expected true/false (is the completion desirable), "
            f"got {row['label']!r}"
        )
    prompt = as_messages(row["prompt"], where=f"{here} column 'prompt'")
    return (
        prompt,
        completion_text(row["completion"], prompt, f"{here} column 'completion'"),
        row["label"],
    )


def mismatched_partners(prompts: list[str]) -> list[int]:
    """For each example, another example with a different prompt, whose completion KTO's KL
    estimate reads after this prompt: i + N // 2 (mod N), stepping on while the prompt is the
    same (rows built from pairs put a prompt's completions side by side). Fixed per example,
    so the reference log-probs can be precomputed."""
    n = len(prompts)
    partners = []
    for i in range(n):
        j = (i + max(1, n // 2)) % n
        for _ in range(n):
            if prompts[j] != prompts[i]:
                break
            j = (j + 1) % n
        else:
            raise UserError("unpaired data needs at least two distinct prompts (KTO's KL estimate)")
        partners.append(j)
    return partners


def build_unpaired_data(
    source: DataSource,
    tokenizer,
    *,
    max_length: int,
    max_prompt_length: int | None,
    where: str,
    limit: int | None = None,
) -> PreferenceData:
    """Labelled single completions for KTO, as `PreferencePair`s with `label` set: `chosen_ids`
    the completion, `rejected_ids` the completion of `mismatched_partners` (truncated to fit
    after this prompt). Truncation as for pairs; nothing is dropped."""
    if source.reasoning_gym is None:
        rows = load_rows(source, field=where)
    else:
        rows = []
        for i, e in enumerate(reasoning_gym_dataset(source.reasoning_gym)):
            wrong = corrupt_answer(e["answer"], source.reasoning_gym.seed + i)
            rows += [{"prompt": e["question"], "completion": e["answer"], "label": True},
                     {"prompt": e["question"], "completion": wrong, "label": False}]  # fmt: skip
    parsed, empty = [], 0
    for index, row in enumerate(rows):
        prompt, completion, label = unpaired_row(row, index, where)
        empty += not completion.strip()
        prompt_text = render_prompt(tokenizer, prompt, where=f"{where}: row {index} prompt")
        parsed.append((prompt_text, completion, label))
        if limit is not None and len(parsed) >= limit:
            break
    if not parsed:
        raise UserError(f"{where}: no unpaired rows in {source.describe()}")
    prompt_texts, completions = [p[0] for p in parsed], [p[1] for p in parsed]
    partners = mismatched_partners(prompt_texts)
    lengths = {"max_length": max_length, "max_prompt_length": max_prompt_length}
    own = encode_completions(tokenizer, prompt_texts, completions, **lengths)
    kl = encode_completions(tokenizer, prompt_texts, [completions[j] for j in partners], **lengths)
    data = PreferenceData(pairs=[], empty_completions=empty)
    for (prompt_text, _, label), e, k in zip(parsed, own, kl, strict=True):
        data.truncated += e.truncated
        data.truncated_prompts += e.prompt_truncated
        data.pairs.append(
            PreferencePair(e.prompt_ids, e.completion_ids, k.completion_ids, prompt_text, label)
        )
    keep_prompt = max_prompt_length or max_length // 2
    if data.truncated_prompts:
        warn_truncated_prompts(where, data.truncated_prompts, len(parsed), keep_prompt)
    return data


def collate_pairs(pairs: list[PreferencePair], pad_id: int) -> dict[str, torch.Tensor]:
    """One right-padded batch of 2B rows: the B chosen sequences, then the B rejected ones.

    loss_mask (2B, S-1) marks completion targets aligned with `causal_lm_token_logprobs`;
    lengths (2B,) are completion token counts; labels (B,) bool for unpaired rows.
    """
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [
        p.prompt_ids + p.rejected_ids for p in pairs
    ]
    prompt_lens = [len(p.prompt_ids) for p in pairs] * 2
    longest = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), longest - 1), dtype=torch.bool)
    for b, (seq, plen) in enumerate(zip(seqs, prompt_lens, strict=True)):
        input_ids[b, : len(seq)] = torch.tensor(seq)
        attention_mask[b, : len(seq)] = 1
        loss_mask[b, plen - 1 : len(seq) - 1] = True
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "lengths": loss_mask.sum(-1),
    }
    if pairs[0].label is not None:  # unpaired rows: (B,) labels, for KTO
        batch["labels"] = torch.tensor([bool(p.label) for p in pairs])
    return batch
