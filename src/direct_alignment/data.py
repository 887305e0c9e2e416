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
                  wrong answer, the reversed reference (`WRONG_KINDS`), from
                  `rlhf_core.preference.reasoning_gym_preference_rows`, the builder reward
                  models use too; for learnable offline tests
  unpaired        KTO's labelled single completions (`build_unpaired_data`):
                  {"prompt": str | messages, "completion": str | messages, "label": bool}, as in
                  trl-lib/kto-mix-14k; from reasoning-gym, two rows per task example (the answer,
                  label true; a wrong answer, label false)

Rows are parsed by `rlhf_core.preference.preference_row`. Prompts are rendered with the tokenizer's
chat template; completions end with eos. Truncation is `rlhf_core.encoding`'s one rule: the prompt
keeps its last `max_prompt_length` tokens (null: as many as the longer completion leaves room for),
then both completions are cut to fit `max_length`, after the same prompt tokens. Pairs whose two
completions are identical after truncation are dropped and counted. Empty completions (real HH data
has a few) are kept as eos alone and counted. A malformed row raises naming its index and column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_core.chat import Messages, as_messages, completion_text, render_prompt
from rlhf_core.data import DataSource, load_rows, reasoning_gym_dataset, warn_truncated_prompts
from rlhf_core.encoding import encode_pairs
from rlhf_core.errors import UserError
from rlhf_core.layout import pack_groups
from rlhf_core.preference import (
    column,
    preference_row,
    reasoning_gym_labelled_rows,
    reasoning_gym_preference_rows,
    report_degenerate_pairs,
)


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


# The wrong answers of synthetic reasoning-gym pairs: the reversed reference (an answer with no
# other wrong answer of this kind, a palindrome, yields no pair). Reward models draw from more
# kinds (`data.builder.wrong_kinds`); a reversal is what the tiny DPO runs were measured on.
WRONG_KINDS = ("reverse",)


def _rows(source: DataSource, where: str) -> tuple[Any, str | None]:
    """(rows, forced format): a reasoning-gym source becomes synthetic preference rows."""
    if source.reasoning_gym is None:
        return load_rows(source, field=where), None
    entries = list(reasoning_gym_dataset(source.reasoning_gym))
    seed = source.reasoning_gym.seed
    return list(reasoning_gym_preference_rows(entries, kinds=WRONG_KINDS, seed=seed)), "preference"


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
    prompts, completions, triples, empty = [], [], [], 0
    for index, row in enumerate(rows):
        prompt, chosen, rejected = preference_row(row, index, fmt, where)
        triples.append((prompt, chosen, rejected))
        empty += (not chosen.strip()) + (not rejected.strip())
        prompts.append(render_prompt(tokenizer, prompt, where=f"{where}: row {index} prompt"))
        completions.append((chosen, rejected))
        if limit is not None and len(prompts) >= limit:
            break
    encoded = encode_pairs(
        tokenizer, prompts, completions, max_length=max_length, max_prompt_length=max_prompt_length
    )
    data = PreferenceData(pairs=[], empty_completions=empty)
    for prompt_text, (c, r) in zip(prompts, encoded, strict=True):
        if overlong == "drop" and (c.prompt_truncated or c.truncated or r.truncated):
            data.dropped_overlong += 1
            continue
        data.truncated_prompts += c.prompt_truncated
        data.truncated += c.truncated or r.truncated
        if c.completion_ids == r.completion_ids:
            data.dropped_identical += 1
            continue
        data.pairs.append(
            PreferencePair(c.prompt_ids, c.completion_ids, r.completion_ids, prompt_text)
        )
    if not data.pairs:
        raise UserError(f"{where}: no usable preference pairs in {source.describe()}")
    report_degenerate_pairs(where, triples, data.dropped_identical)
    if data.truncated_prompts:
        warn_truncated_prompts(where, data.truncated_prompts, len(prompts), max_prompt_length)
    return data


def unpaired_row(row: dict[str, Any], index: int, where: str) -> tuple[Messages, str, bool]:
    """(prompt messages, completion text, label) of one unpaired row."""
    here = f"{where}: row {index}"
    for name in ("prompt", "completion", "label"):
        column(row, name, here)
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
    else:  # per example: the answer (label true) and one wrong answer (false)
        entries = list(reasoning_gym_dataset(source.reasoning_gym))
        seed = source.reasoning_gym.seed
        rows = list(reasoning_gym_labelled_rows(entries, wrong=1, kinds=WRONG_KINDS, seed=seed))
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
    with_partner = [(c, completions[j]) for c, j in zip(completions, partners, strict=True)]
    encoded = encode_pairs(
        tokenizer, prompt_texts, with_partner,
        max_length=max_length, max_prompt_length=max_prompt_length,
    )  # fmt: skip
    data = PreferenceData(pairs=[], empty_completions=empty)
    for (prompt_text, _, label), (e, k) in zip(parsed, encoded, strict=True):
        data.truncated += e.truncated
        data.truncated_prompts += e.prompt_truncated
        data.pairs.append(
            PreferencePair(e.prompt_ids, e.completion_ids, k.completion_ids, prompt_text, label)
        )
    if data.truncated_prompts:
        warn_truncated_prompts(where, data.truncated_prompts, len(parsed), max_prompt_length)
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


def pack_pairs(
    pairs: list[PreferencePair],
    pad_id: int,
    *,
    pack: bool = True,
    row_tokens: int | None = None,
    flat: bool = False,
) -> dict[str, torch.Tensor]:
    """The pairs as packed rows [prompt | chosen | rejected] (`rlhf_core.layout.pack_groups`):
    each prompt encoded once for both completions, several short pairs per row (one per row
    with `pack=False`; rows of up to `row_tokens` tokens for segmented attention). `flat=True`
    is flash attention's varlen layout instead: [prompt chosen][prompt rejected] for every pair
    in one row, no padding, the prompt encoded once per completion. Streams 2i
    and 2i + 1 are pair i's chosen and rejected completions;
    `lengths` (2B,) are completion token counts, chosen then rejected (as `collate_pairs`);
    labels (B,) bool for unpaired rows."""
    batch = pack_groups(
        [(p.prompt_ids, (p.chosen_ids, p.rejected_ids)) for p in pairs],
        pad_id,
        pack=pack,
        row_tokens=row_tokens,
        flat=flat,
    )
    per_pair = batch["branch_lengths"].view(-1, 2)
    batch["lengths"] = torch.cat([per_pair[:, 0], per_pair[:, 1]])
    if pairs[0].label is not None:
        batch["labels"] = torch.tensor([bool(p.label) for p in pairs])
    return batch
