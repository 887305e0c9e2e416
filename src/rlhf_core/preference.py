"""Preference pairs, the one type direct alignment and reward models train on: rows -> (prompt,
chosen, rejected) text -> token ids -> batches.

Rows are read in the standard layouts of `rlhf_core.columns` (after `data.columns` renames them):

    preference            {"prompt": str | messages, "chosen": str | messages, "rejected": ...};
                          message completions may repeat the prompt (UltraFeedback-binarized): the
                          shared prefix is removed and the last assistant turn is the completion
                          (formats `preference`, `ultrafeedback`)
    implicit_preference   {"chosen", "rejected"} and no prompt: Anthropic HH transcripts, split at
                          the last shared "\\n\\nAssistant:" into a multi-turn prompt and two
                          completions (`rlhf_core.chat.split_hh_pair`), or two message lists whose
                          shared leading turns are the prompt (format `hh`)
    auto                  detected per row (`rlhf_core.columns.detect_layout`)

`encode_preference_pairs` tokenizes and cuts pairs by `rlhf_core.encoding`'s one rule: both
completions follow the same prompt tokens; a pair over the limits is cut (counted `truncated`) or,
with `overlong="drop"`, dropped (`dropped_overlong`); a pair whose completions are identical
after the cut is dropped (`dropped_identical`); empty completions are kept as eos alone
(`empty_completions`).

Batches (`collate_pairs`, `pack_pairs`) share one `lengths` convention: (2B,) completion token
counts (eos included), the B chosen then the B rejected, as the direct-alignment losses take them.

Not here: synthetic pairs from reasoning-gym (`rlhf_core.wrong_answers`); each package's own row
kinds (margins, ORM/PRM labels in `reward_models.data`; KTO's unpaired rows in
`direct_alignment.data`); the packed layout itself (`pack_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_core.chat import Messages, as_messages, completion_text, split_hh_pair
from rlhf_core.columns import column, detect_layout
from rlhf_core.data import report_degenerate
from rlhf_core.encoding import encode_pairs, pad_sequences
from rlhf_core.errors import UserError
from rlhf_core.layout import pack_groups

PREFERENCE_FORMATS = ("auto", "preference", "ultrafeedback", "hh")
PAIR_LAYOUTS = ("preference", "implicit_preference")
FORMAT_LAYOUTS = {"preference": "preference", "ultrafeedback": "preference",
                  "hh": "implicit_preference"}  # fmt: skip


@dataclass
class PreferencePair:
    """One pair as token ids. `label` is set on KTO's unpaired rows: then `chosen_ids` is one
    labelled completion and `rejected_ids` another prompt's completion, which KTO's reference
    point reads (`direct_alignment.data.build_unpaired_data`). `margin` is a reward model's
    Llama 2 margin. Either way the two halves run as one batch."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_text: str = ""  # the rendered prompt, for sampling at evaluation
    label: bool | None = None
    margin: float | None = None

    @property
    def packed_tokens(self) -> int:
        """Its tokens in a packed row (`pack_pairs`): the prompt once, both completions."""
        return len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)


# ----------------------------------------------------------------------------- rows


def preference_row(
    row: dict[str, Any], index: int, fmt: str, where: str, *, file: str | None = None
) -> tuple[Messages, str, str]:
    """(prompt messages, chosen text, rejected text) of one (renamed) row; `fmt` is a format of
    `PREFERENCE_FORMATS` or a layout of `PAIR_LAYOUTS`; `file` is named when detection fails."""
    here = f"{where}: row {index}"
    if fmt == "auto":
        layout = detect_layout(
            row, PAIR_LAYOUTS, f"{where} ({file}): row {index}" if file else here
        )
    else:
        layout = FORMAT_LAYOUTS.get(fmt, fmt)
    chosen, rejected = column(row, "chosen", here), column(row, "rejected", here)
    if layout == "implicit_preference":
        if isinstance(chosen, list) and isinstance(rejected, list):
            return split_message_pair(chosen, rejected, where=f"{here} columns chosen/rejected")
        if not isinstance(chosen, str) or not isinstance(rejected, str):
            raise UserError(f"{here}: HH rows need string transcripts in 'chosen' and 'rejected'")
        if row.get("system"):
            raise UserError(
                f"{here}: a 'system' column has no prompt to go before in HH "
                "transcripts; give the prompt its own column (data.columns.prompt)"
            )
        return split_hh_pair(chosen, rejected, where=f"{here} columns chosen/rejected")
    if layout != "preference":
        raise ValueError(f"preference_row: unknown format {fmt!r}")
    prompt = as_messages(column(row, "prompt", here), where=f"{here} column 'prompt'")
    return (
        prompt,
        completion_text(chosen, prompt, f"{here} column 'chosen'"),
        completion_text(rejected, prompt, f"{here} column 'rejected'"),
    )


def split_message_pair(chosen: Any, rejected: Any, *, where: str) -> tuple[Messages, str, str]:
    """(prompt, chosen, rejected) of two conversations with no prompt column: the turns they
    share are the prompt, each one's last assistant turn after it the completion."""
    a, b = as_messages(chosen, where=where), as_messages(rejected, where=where)
    shared = 0
    while shared < min(len(a), len(b)) - 1 and a[shared] == b[shared]:
        shared += 1
    prompt = a[:shared]
    if not prompt or a[-1]["role"] != "assistant" or b[-1]["role"] != "assistant":
        raise UserError(
            f"{where}: two conversations without a prompt column must share their leading "
            "(prompt) turns and each end with an assistant turn"
        )
    return prompt, completion_text(a, prompt, where), completion_text(b, prompt, where)


def report_degenerate_pairs(
    where: str, triples: list[tuple[Any, str, str]], dropped_identical: int
) -> None:
    """Warn about (or, past `rlhf_core.data.MAX_DEGENERATE_FRACTION`, refuse) pairs with an
    empty completion or identical chosen and rejected tokens; `triples` are the parsed
    (prompt, chosen, rejected) rows."""
    report_degenerate(where, len(triples), {
        "have an empty 'chosen' completion": sum(not t[1].strip() for t in triples),
        "have an empty 'rejected' completion": sum(not t[2].strip() for t in triples),
        "have identical chosen and rejected tokens (dropped)": dropped_identical,
    })  # fmt: skip


# ----------------------------------------------------------------------------- token ids


def encode_preference_pairs(
    tokenizer: Any,
    prompts: list[str],
    texts: list[tuple[str, str]],
    *,
    max_length: int,
    max_prompt_length: int | None,
    overlong: str = "truncate",
    margins: list[float] | None = None,
) -> tuple[list[PreferencePair], dict[str, int]]:
    """(pairs, counts) of rendered prompts and their (chosen, rejected) texts, cut and dropped as
    the module docstring says; counts: dropped_identical, truncated, truncated_prompts,
    empty_completions, dropped_overlong."""
    encoded = encode_pairs(
        tokenizer, prompts, texts, max_length=max_length, max_prompt_length=max_prompt_length
    )
    counts = dict.fromkeys(("dropped_identical", "truncated", "truncated_prompts"), 0)
    counts["empty_completions"] = sum((not c.strip()) + (not r.strip()) for c, r in texts)
    counts["dropped_overlong"] = 0
    pairs = []
    for i, (prompt_text, (c, r)) in enumerate(zip(prompts, encoded, strict=True)):
        if overlong == "drop" and (c.prompt_truncated or c.truncated or r.truncated):
            counts["dropped_overlong"] += 1
            continue
        counts["truncated_prompts"] += c.prompt_truncated
        counts["truncated"] += c.truncated or r.truncated
        if c.completion_ids == r.completion_ids:
            counts["dropped_identical"] += 1
            continue
        margin = None if margins is None else margins[i]
        pairs.append(PreferencePair(c.prompt_ids, c.completion_ids, r.completion_ids,
                                    prompt_text, margin=margin))  # fmt: skip
    return pairs, counts


# ----------------------------------------------------------------------------- batches


def _extras(pairs: list[PreferencePair]) -> dict[str, torch.Tensor]:
    """labels (B,) bool of unpaired rows; margins (B,) when every pair has one."""
    out = {}
    if pairs and pairs[0].label is not None:
        out["labels"] = torch.tensor([bool(p.label) for p in pairs])
    if pairs and all(p.margin is not None for p in pairs):
        out["margins"] = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    return out


def collate_pairs(
    pairs: list[PreferencePair], pad_id: int, *, share_prompt: bool = False
) -> dict[str, torch.Tensor]:
    """One right-padded batch of 2B rows, the B chosen sequences then the B rejected ones:
    input_ids / attention_mask (2B, T); loss_mask (2B, T - 1) marks completion targets aligned
    with `causal_lm_token_logprobs`; completion_mask (2B, T) the completion's tokens; lengths
    (2B,); labels / margins (`_extras`).

    With `share_prompt` (a reward model under flash attention), the prompt is kept apart so the
    model encodes it once through the KV cache: prompt_ids / prompt_mask (B, P) left-padded, and
    input_ids / attention_mask (2B, C) the completions alone, right-padded, interleaved chosen_0,
    rejected_0, chosen_1, ... A batch with an empty prompt or completion is collated without
    sharing (an all-padding row would give the attention nothing to read)."""
    completions = [ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)]
    lengths = torch.tensor(
        [len(p.chosen_ids) for p in pairs] + [len(p.rejected_ids) for p in pairs]
    )
    if share_prompt and all(completions) and all(p.prompt_ids for p in pairs):
        prompt_ids, prompt_mask = pad_sequences([p.prompt_ids for p in pairs], pad_id, side="left")
        input_ids, attention_mask = pad_sequences(completions, pad_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "lengths": lengths,
                **_extras(pairs)}  # fmt: skip
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [
        p.prompt_ids + p.rejected_ids for p in pairs
    ]
    input_ids, attention_mask = pad_sequences(seqs, pad_id)
    prompt_lens = torch.tensor([len(p.prompt_ids) for p in pairs] * 2)
    completion_mask = attention_mask.bool() & (
        torch.arange(input_ids.shape[1])[None] >= prompt_lens[:, None]
    )
    loss_mask = torch.zeros((len(seqs), input_ids.shape[1] - 1), dtype=torch.bool)
    for b, (seq, plen) in enumerate(zip(seqs, prompt_lens.tolist(), strict=True)):
        loss_mask[b, plen - 1 : len(seq) - 1] = True
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "completion_mask": completion_mask, "lengths": loss_mask.sum(-1),
            **_extras(pairs)}  # fmt: skip


def pack_pairs(
    pairs: list[PreferencePair],
    pad_id: int,
    *,
    pack: bool = True,
    row_tokens: int | None = None,
    flat: bool = False,
) -> dict[str, torch.Tensor]:
    """The pairs as packed rows [prompt | chosen | rejected] (`pack_groups`): each prompt encoded
    once for both completions, several short pairs per row (one per row with `pack=False`; rows
    of up to `row_tokens` tokens for segmented attention); the rejected tokens do not see the
    chosen ones and no token sees another pair, so every token sees what it would in its own
    prompt + completion row (same log-probs and rewards; tested). `flat=True` is flash
    attention's varlen layout instead: [prompt chosen][prompt rejected] for every pair in one
    row, no padding, the prompt encoded once per completion.

    Returns `pack_groups`' batch (streams 2i and 2i + 1 are pair i's chosen and rejected
    completions: `ends` (2B,) their last tokens' flat positions, `branch_lengths` (2B,) their
    lengths, `segments` for segmented attention) with `lengths` (2B,) chosen then rejected (as
    `collate_pairs`) and labels / margins (`_extras`)."""
    batch = pack_groups(
        [(p.prompt_ids, (p.chosen_ids, p.rejected_ids)) for p in pairs],
        pad_id, pack=pack, row_tokens=row_tokens, flat=flat,
    )  # fmt: skip
    per_pair = batch["branch_lengths"].view(-1, 2)
    batch["lengths"] = torch.cat([per_pair[:, 0], per_pair[:, 1]])
    batch.update(_extras(pairs))
    return batch


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-pad tokens of the full prompt + completion rows a pair batch stands for (a shared
    prompt counts once per completion reading it), so the figure does not depend on the layout."""
    if "branch_lengths" in batch:  # packed: every stream with its prefix
        prefix = batch["prefix_lengths"].repeat_interleave(batch["branches_per_group"])
        return int(prefix.sum() + batch["branch_lengths"].sum())
    tokens = int(batch["attention_mask"].sum())
    if "prompt_mask" in batch:
        repeats = batch["input_ids"].shape[0] // batch["prompt_mask"].shape[0]
        tokens += repeats * int(batch["prompt_mask"].sum())
    return tokens
