"""SFT data: rows -> tokenized (prompt, completion) pairs -> right-padded batches.

Row formats (`data.format`; `auto` detects each row's layout, `rlhf_core.columns.detect_layout`):
  messages            {"messages": [{"role", "content"}, ...]} ending with an assistant turn; the
                      last assistant turn is the completion, everything before it the prompt
                      (earlier assistant turns are context and carry no loss).
  prompt_completion   {"prompt": str | messages, "completion": str | [one assistant message]}
  reasoning_gym       question -> user turn, answer -> completion; the entry is kept for scoring.

`data.columns` renames a data set's columns to these keys first (`rlhf_core.columns`, e.g.
`{prompt: question, completion: response}`; a `system` column becomes the prompt's leading
system message); a file in neither layout gets one error naming it, the columns found and the
closest layout.

Prompt and completion are tokenized separately and concatenated (so the loss mask is exact under
any tokenizer); the completion ends with the tokenizer's eos. Over-long rows are cut by
`rlhf_core.encoding`'s one rule: the prompt keeps its end (its instruction and generation prompt;
its last `max_prompt_length` tokens, or with null as many as the completion leaves room for),
then the completion is cut to the room left (counted and reported). A malformed row raises naming
its index and column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_core.chat import as_messages, render_prompt
from rlhf_core.columns import Columns, apply_columns, detect_layout
from rlhf_core.data import DataSource, load_rows, reasoning_gym_dataset, report_degenerate
from rlhf_core.encoding import encode_completions
from rlhf_core.errors import UserError
from rlhf_core.layout import pack_groups


@dataclass
class SFTExample:
    prompt_ids: list[int]
    completion_ids: list[int]
    prompt_text: str  # rendered prompt, for generation at eval
    reference: str  # the completion text, for exact match
    entry: dict[str, Any] | None = None  # reasoning-gym entry, for the task's own scorer


@dataclass
class SFTData:
    examples: list[SFTExample]
    scorer: Any | None  # reasoning-gym dataset (has score_answer) or None
    truncated_completions: int = 0
    dropped_overlong: int = 0  # rows over the limits, with overlong="drop"


SFT_LAYOUTS = ("messages", "prompt_completion")


def _split_row(
    row: dict[str, Any], index: int, fmt: str, where: str, file: str = "?"
) -> tuple[Any, str]:
    """(prompt as str|messages, completion text) of one (renamed) row, or a clear error; the
    first row of a declared format is checked to be in that layout at all."""
    located = f"{where} ({file}): row {index}"
    if fmt == "auto":
        fmt = detect_layout(row, SFT_LAYOUTS, located)
    elif index == 0:
        detect_layout(row, (fmt,), located)
    if fmt == "messages":
        messages = row.get("messages")
        if messages is None:
            raise UserError(f"{where}: row {index} has no 'messages' column (columns: {list(row)})")
        messages = as_messages(messages, where=f"{where}: row {index} column 'messages'")
        if not messages or messages[-1]["role"] != "assistant":
            raise UserError(
                f"{where}: row {index} column 'messages' must end with an assistant turn"
            )
        return messages[:-1], messages[-1]["content"]
    for column in ("prompt", "completion"):
        if column not in row or row[column] is None:
            raise UserError(
                f"{where}: row {index} is missing column {column!r} (columns: {list(row)})"
            )
    completion = row["completion"]
    if isinstance(completion, list):  # conversational completion: one assistant message
        msgs = as_messages(completion, where=f"{where}: row {index} column 'completion'")
        completion = "".join(m["content"] for m in msgs)
    if not isinstance(completion, str):
        raise UserError(f"{where}: row {index} column 'completion' must be a string or messages")
    return row["prompt"], completion


def build_sft_data(
    source: DataSource,
    tokenizer,
    *,
    fmt: str,
    max_length: int,
    max_prompt_length: int | None,
    where: str,
    limit: int | None = None,
    exclude_prompts: set[str] | None = None,
    overlong: str = "truncate",
    columns: Columns | None = None,
) -> SFTData:
    """Load, rename (`columns`) and tokenize a source. `exclude_prompts` drops rows whose prompt
    text is in it; `overlong="drop"` drops (and counts) rows that would be cut instead."""
    scorer, file = None, source.describe()
    if source.reasoning_gym is not None:
        scorer = reasoning_gym_dataset(source.reasoning_gym)
        rows: Any = [
            {"prompt": e["question"], "completion": e["answer"], "_entry": e} for e in scorer
        ]
        fmt = "prompt_completion"
    else:
        rows = load_rows(source, field=where)
        rows = (
            apply_columns(row, columns, f"{where} ({file}): row {index}")
            for index, row in enumerate(rows)
        )
    rendered: list[tuple[str, str, Any]] = []
    for index, row in enumerate(rows):
        prompt, completion = _split_row(row, index, fmt, where, file)
        if not completion.strip():
            raise UserError(f"{where}: row {index} has an empty completion")
        prompt_text = render_prompt(
            tokenizer, prompt, where=f"{where}: row {index} column 'prompt'"
        )
        if exclude_prompts is not None and prompt_text in exclude_prompts:
            continue
        rendered.append((prompt_text, completion, row.get("_entry")))
        if limit is not None and len(rendered) >= limit:
            break
    encoded = encode_completions(
        tokenizer, [r[0] for r in rendered], [r[1] for r in rendered],
        max_length=max_length, max_prompt_length=max_prompt_length,
    )  # fmt: skip
    examples, cut_count, dropped, tiny_prompts, tiny_completions = [], 0, 0, 0, 0
    for (prompt_text, completion, entry), e in zip(rendered, encoded, strict=True):
        if overlong == "drop" and (e.truncated or e.prompt_truncated):
            dropped += 1
            continue
        cut_count += e.truncated
        tiny_prompts += len(e.prompt_ids) <= 1 and e.prompt_truncated
        tiny_completions += len(e.completion_ids) <= 1 and e.truncated
        examples.append(SFTExample(e.prompt_ids, e.completion_ids, prompt_text, completion, entry))
    if not examples:
        raise UserError(
            f"{where}: no usable rows in {source.describe()}"
            + (f" ({dropped} dropped as longer than max_length {max_length})" if dropped else "")
        )
    report_degenerate(where, len(examples), {
        f"have their prompt cut to a single token (data.max_length {max_length}, "
        f"max_prompt_length {max_prompt_length})": tiny_prompts,
        f"have their completion cut to a single token (data.max_length {max_length})":
            tiny_completions,
    })  # fmt: skip
    return SFTData(examples, scorer, truncated_completions=cut_count, dropped_overlong=dropped)


def collate(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest row. loss_mask[b, t] marks targets input_ids[b, t + 1]
    that are completion tokens, aligned with `causal_lm_token_logprobs` output (B, S - 1)."""
    longest = max(len(e.prompt_ids) + len(e.completion_ids) for e in examples)
    input_ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), longest - 1), dtype=torch.bool)
    for b, ex in enumerate(examples):
        ids = ex.prompt_ids + ex.completion_ids
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention_mask[b, : len(ids)] = 1
        loss_mask[b, len(ex.prompt_ids) - 1 : len(ids) - 1] = True
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def pack(
    examples: list[SFTExample],
    pad_id: int,
    *,
    row_tokens: int | None = None,
    flat: bool = False,
) -> dict[str, torch.Tensor]:
    """The examples packed several to a row (`rlhf_core.layout.pack_groups`: positions restart
    at every example, attention blocked across examples, rows no longer than the longest
    example, or `row_tokens` for segmented attention; `flat=True`: all of them in one row with
    no padding and no mask, flash attention's varlen layout), the targets being the completion
    tokens: loss_mask (1, N) is all true, aligned with `rlhf_core.sequences.sequence_logprobs`. Same
    loss as `collate` (tested)."""
    batch = pack_groups(
        [(e.prompt_ids, (e.completion_ids,)) for e in examples],
        pad_id,
        row_tokens=row_tokens,
        flat=flat,
    )
    batch["loss_mask"] = torch.ones((1, batch["targets"].shape[0]), dtype=torch.bool)
    return batch
