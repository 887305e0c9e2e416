"""Reward-model data: rows -> token ids -> batches, for preference, outcome (ORM) and process (PRM)
models.

Row formats (`data.format`; `auto` picks by columns):
  preference (kind preference)
    auto           preference if the row has a prompt, else hh (`rlhf_core.columns.detect_layout`)
    preference     {"prompt": str | messages, "chosen": str | messages, "rejected": ...}; message
                   completions may repeat the prompt (UltraFeedback-binarized): the shared prefix is
                   removed and the last assistant turn is the completion
    ultrafeedback  the same, named for UltraFeedback-binarized rows
    hh             Anthropic HH {"chosen": transcript, "rejected": transcript}, split at the last
                   shared "\\n\\nAssistant:" into a multi-turn prompt and two completions; or two
                   conversations (message lists) whose shared leading turns are the prompt
    margins        `data.margin_column`: a numeric column, or [a, b] for row[a] - row[b]
                   (UltraFeedback: [score_chosen, score_rejected])
  orm (kind orm)
    orm            {"prompt", "completion": str | messages, "label": bool | 0/1 | float in [0, 1]}
    gsm8k          GSM8K {"question", "answer"} rows, labelled on the fly by
                   `build_data.gsm8k_orm_rows` (the reference answer and wrong ones)
  segment (kind segment; Fine-Grained RLHF's token-level reward models)
    segments       {"prompt", "completion": str, "labels": [int]}: one class per sentence or
                   sub-sentence (`data.segment_level`, segmented by `rlhf_core.segmentation`),
                   0 = no error (booleans: True = has the error); scored at each segment's
                   last token
  prm (kind prm)
    prm            {"prompt", "steps": [str], "labels": [bool | -1/0/+1]}  (booleans: True = good)
    prm800k        PRM800K rows {"question": {"problem"}, "label": {"steps": [...]}}: the rated path
                   through each step's completions (see `prm800k_row`)
    gsm8k          GSM8K rows, one step corrupted on the fly (`build_data.gsm8k_prm_rows`)
A reasoning-gym source builds preference pairs (chosen = the answer, rejected = a wrong one) or
ORM rows (the answer and wrong ones) on the fly (`rlhf_core.wrong_answers`), PRM rows by
`build_data`. `data.columns` renames a file's columns to the standard keys first
(`rlhf_core.columns`; a `system` column becomes the prompt's leading system message); a
preference row in neither pair layout gets one error naming the file, the columns found and the
closest layout. Preference rows are parsed, tokenized and batched by `rlhf_core.preference`, the
same code DPO uses (`PreferencePair`, `collate_pairs`, `pack_pairs`).

With `data.strip_thinking` (default on, as RL's reward scoring), completions lose their
<think>...</think> blocks (`rlhf_core.chat.strip_thinking`) before tokenizing (preference and
ORM rows; counted `stripped_thinking`): the model learns to score the answer, as it is asked to in
RL. Prompts are rendered with the chat template; completions end with eos; PRM completions are
the steps, each followed by the one-token `step_separator`. Truncation is `rlhf_core.encoding`'s
one rule (the same at scoring time); a pair's two completions follow the same prompt tokens. With
`data.overlong: drop`, an example the limits would cut is dropped instead (counted
`dropped_overlong`; for PRM and segment rows, one that would lose a step or segment). Preference
pairs identical after truncation are dropped and counted. A malformed row raises naming its
index and column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from reward_models.build_data import gsm8k_orm_rows, gsm8k_prm_rows, reasoning_gym_prm_rows
from reward_models.config import RMDataConfig
from reward_models.losses import IGNORE_INDEX
from rlhf_core.chat import Messages, as_messages, completion_text, render_prompt, strip_thinking
from rlhf_core.columns import apply_columns, column
from rlhf_core.data import DataSource, load_rows, reasoning_gym_dataset, warn_truncated_prompts
from rlhf_core.encoding import (
    encode_completions,
    encode_segments,
    encode_steps,
    pad_sequences,
)
from rlhf_core.errors import UserError
from rlhf_core.preference import (
    encode_preference_pairs,
    preference_row,
    report_degenerate_pairs,
)
from rlhf_core.segmentation import segment
from rlhf_core.wrong_answers import reasoning_gym_labelled_rows, reasoning_gym_preference_rows

# ----------------------------------------------------------------------------- examples


@dataclass
class OutcomeExample:
    prompt_ids: list[int]
    completion_ids: list[int]
    label: float
    group: int  # examples with the same prompt share a group (a question's candidates)


@dataclass
class ProcessExample:
    prompt_ids: list[int]
    completion_ids: list[int]
    step_ends: list[int]  # index in completion_ids of each step's separator
    step_classes: list[int]  # class of each step (0 = negative)


@dataclass
class RewardData:
    """Examples of one kind plus what happened to the rows on the way."""

    examples: list[Any]
    counts: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        extra = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        return f"{len(self.examples)}" + (f" ({extra})" if extra else "")


# ----------------------------------------------------------------------------- row parsing


def row_margin(row: dict[str, Any], spec: str | list[str], here: str) -> float:
    """The Llama 2 margin of a row: one numeric column, or the difference of two."""
    columns = [spec] if isinstance(spec, str) else list(spec)
    values = []
    for name in columns:
        value = column(row, name, here)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise UserError(f"{here} column {name!r}: expected a number, got {value!r}")
        values.append(float(value))
    return values[0] if len(values) == 1 else values[0] - values[1]


def outcome_row(row: dict[str, Any], index: int, where: str) -> tuple[Messages, str, float]:
    """(prompt messages, completion text, label in [0, 1]) of one ORM row."""
    here = f"{where}: row {index}"
    prompt = as_messages(column(row, "prompt", here), where=f"{here} column 'prompt'")
    completion = completion_text(
        column(row, "completion", here), prompt, f"{here} column 'completion'"
    )
    label = column(row, "label", here)
    if isinstance(label, bool):
        return prompt, completion, float(label)
    if isinstance(label, int | float) and 0 <= label <= 1:
        return prompt, completion, float(label)
    raise UserError(
        f"{here} column 'label': expected true/false or a number in [0, 1], got {label!r}"
    )


def step_class(label: Any, num_classes: int, neutral: str, here: str) -> int:
    """A step label as a class: booleans (True = good) or PRM800K ratings -1 / 0 / +1."""
    if isinstance(label, bool):
        return num_classes - 1 if label else 0
    if label in (-1, 0, 1) and isinstance(label, int | float):
        if num_classes == 3:
            return int(label) + 1
        return 0 if label < 0 or (label == 0 and neutral == "negative") else 1
    raise UserError(f"{here}: expected a step label true/false or -1/0/+1, got {label!r}")


def prm800k_row(row: dict[str, Any], here: str) -> dict[str, Any]:
    """A PRM800K row as {"prompt", "steps", "labels"}: at each step the labeller's chosen
    completion (its rating), or their own written step (`human_completion`, counted +1); where
    labelling stopped with no continuation, the first -1 completion is kept as the last step."""
    question, label = column(row, "question", here), column(row, "label", here)
    if not isinstance(question, dict) or not isinstance(label, dict) or "steps" not in label:
        raise UserError(f"{here}: not a PRM800K row (question.problem, label.steps expected)")
    steps, ratings = [], []
    for k, step in enumerate(label["steps"]):
        completions = step.get("completions") or []
        chosen = step.get("chosen_completion")
        if chosen is not None:
            text, rating = completions[chosen]["text"], completions[chosen].get("rating")
        elif step.get("human_completion") is not None:
            human = step["human_completion"]
            text, rating = (human["text"] if isinstance(human, dict) else str(human)), 1
        else:
            negative = [c for c in completions if c.get("rating") == -1]
            if negative:
                steps.append(negative[0]["text"])
                ratings.append(-1)
            break
        if rating is None:
            raise UserError(f"{here} column 'label': step {k} has an unrated chosen completion")
        steps.append(text)
        ratings.append(rating)
    return {"prompt": question.get("problem", ""), "steps": steps, "labels": ratings}


def process_row(
    row: dict[str, Any], index: int, fmt: str, where: str, num_classes: int, neutral: str
) -> tuple[Messages, list[str], list[int]]:
    """(prompt messages, steps, step classes) of one PRM row."""
    here = f"{where}: row {index}"
    if fmt == "prm800k" or (fmt == "auto" and isinstance(row.get("label"), dict)):
        row = prm800k_row(row, here)
    prompt = as_messages(column(row, "prompt", here), where=f"{here} column 'prompt'")
    steps, labels = column(row, "steps", here), column(row, "labels", here)
    if not isinstance(steps, list) or not all(isinstance(s, str) for s in steps) or not steps:
        raise UserError(f"{here} column 'steps': expected a non-empty list of strings")
    if not isinstance(labels, list) or len(labels) != len(steps):
        raise UserError(
            f"{here} column 'labels': expected a list of {len(steps)} labels (one per step), "
            f"got {labels!r}"
        )
    classes = [
        step_class(x, num_classes, neutral, f"{here} column 'labels' step {k}")
        for k, x in enumerate(labels)
    ]
    return prompt, steps, classes


def segment_row(
    row: dict[str, Any], index: int, where: str, level: str, num_classes: int
) -> tuple[Messages, str, list[int]]:
    """(prompt messages, completion text, one class per segment) of one segment row."""
    here = f"{where}: row {index}"
    prompt = as_messages(column(row, "prompt", here), where=f"{here} column 'prompt'")
    completion = completion_text(
        column(row, "completion", here), prompt, f"{here} column 'completion'"
    )
    labels = column(row, "labels", here)
    count = len(segment(completion, level))
    if not isinstance(labels, list) or len(labels) != count:
        raise ValueError(
            f"{here} column 'labels': expected {count} labels, one per {level} of the completion "
            f"(rlhf_core.segmentation), got {labels!r}"
        )
    classes = []
    for k, label in enumerate(labels):
        value = int(label) if isinstance(label, bool | int) else None
        if value is None or not 0 <= value < num_classes:
            raise ValueError(
                f"{here} column 'labels' segment {k}: expected a class 0..{num_classes - 1} "
                f"(0 = no error) or a boolean (true = error), got {label!r}"
            )
        classes.append(value)
    return prompt, completion, classes


# ----------------------------------------------------------------------------- loading


def source_rows(source: DataSource, kind: str, data_cfg: RMDataConfig, where: str):
    """(rows, format) of a source: files and hub sets as read, renamed by `data.columns`; GSM8K
    and reasoning-gym sources turned into labelled rows by the offline builders."""
    builder, fmt = data_cfg.builder, data_cfg.format
    if source.reasoning_gym is not None:
        entries = list(reasoning_gym_dataset(source.reasoning_gym))
        kinds = tuple(builder.wrong_kinds)
        if kind == "preference":
            rows = reasoning_gym_preference_rows(entries, kinds=kinds, seed=builder.seed)
            return list(rows), "preference"
        if kind == "orm":
            rows = reasoning_gym_labelled_rows(
                entries, wrong=builder.wrong, kinds=kinds, seed=builder.seed
            )
            return list(rows), "orm"
        rows = reasoning_gym_prm_rows(
            entries, after_error=builder.after_error, gold=builder.gold, seed=builder.seed
        )
        return list(rows), "prm"
    rows = load_rows(source, field=where)
    if (
        fmt == "auto"
        and kind != "preference"
        and data_cfg.columns is None
        and "question" in rows.column_names
    ):
        fmt = "gsm8k" if isinstance(rows[0]["question"], str) else fmt
    if fmt == "gsm8k" and kind == "orm":
        return list(
            gsm8k_orm_rows(rows, wrong=builder.wrong, seed=builder.seed, where=where)
        ), "orm"
    if fmt == "gsm8k":
        built = gsm8k_prm_rows(
            rows, corruption=builder.corruption, after_error=builder.after_error,
            gold=builder.gold, seed=builder.seed, where=where,
        )  # fmt: skip
        return list(built), "prm"
    file = source.describe()
    renamed = (
        apply_columns(row, data_cfg.columns, f"{where} ({file}): row {index}")
        for index, row in enumerate(rows)
    )
    return renamed, fmt


def build_reward_data(
    source: DataSource,
    tokenizer: Any,
    *,
    kind: str,
    data_cfg: RMDataConfig,
    num_classes: int = 3,
    where: str,
    limit: int | None = None,
) -> RewardData:
    """Load, render, tokenize and truncate the examples of one kind (see the module docstring).

    `data_cfg` is the config's `data` block (format, columns, lengths, overlong, strip_thinking,
    margin column, step separator, builder options); `limit` keeps the first N examples (ORM:
    whole prompt groups).
    """
    rows, fmt = source_rows(source, kind, data_cfg, where)
    file, stripped = source.describe(), 0
    parsed, prompts = [], []
    for index, row in enumerate(rows):
        if kind == "preference":
            prompt, *rest = preference_row(row, index, fmt, where, file=file)
            if data_cfg.strip_thinking:
                kept = [strip_thinking(text) for text in rest]
                stripped += kept != rest
                rest = kept
            if data_cfg.margin_column is not None:
                rest.append(row_margin(row, data_cfg.margin_column, f"{where}: row {index}"))
        elif kind == "orm":
            prompt, *rest = outcome_row(row, index, where)
            if data_cfg.strip_thinking and (kept := strip_thinking(rest[0])) != rest[0]:
                stripped, rest[0] = stripped + 1, kept
        elif kind == "segment":
            prompt, *rest = segment_row(row, index, where, data_cfg.segment_level, num_classes)
        else:
            prompt, *rest = process_row(row, index, fmt, where, num_classes, data_cfg.neutral_label)
        if (
            limit is not None
            and len(parsed) >= limit
            and (kind != "orm" or prompt != parsed[-1][0])
        ):
            break
        parsed.append((prompt, *rest))
        prompts.append(render_prompt(tokenizer, prompt, where=f"{where}: row {index} prompt"))
    if not parsed:
        raise UserError(f"{where}: no rows in {source.describe()}")
    lengths = {"max_length": data_cfg.max_length, "max_prompt_length": data_cfg.max_prompt_length}
    drop = data_cfg.overlong == "drop"
    if kind == "preference":
        data = _preference_examples(tokenizer, prompts, parsed, lengths, data_cfg.overlong)
    elif kind == "orm":
        data = _outcome_examples(tokenizer, prompts, parsed, lengths, drop)
    elif kind == "segment":
        data = _segment_examples(tokenizer, prompts, parsed, lengths, data_cfg.segment_level, drop)
    else:
        data = _process_examples(tokenizer, prompts, parsed, lengths, data_cfg.step_separator, drop)
    if kind in ("preference", "orm"):
        data.counts["stripped_thinking"] = stripped
    if not data.examples:
        dropped = data.counts.get("dropped_overlong")
        raise UserError(
            f"{where}: no usable {kind} examples in {source.describe()}"
            + (f" ({dropped} dropped as longer than the length limits)" if dropped else "")
        )
    if kind == "preference":
        report_degenerate_pairs(where, parsed, data.counts["dropped_identical"])
    if data.counts.get("truncated_prompts"):
        cut = data.counts["truncated_prompts"]
        warn_truncated_prompts(where, cut, len(parsed), data_cfg.max_prompt_length)
    return data


def _preference_examples(tokenizer, prompts, parsed, lengths, overlong) -> RewardData:
    margins = [item[3] for item in parsed] if parsed and len(parsed[0]) > 3 else None
    pairs, counts = encode_preference_pairs(
        tokenizer, prompts, [(p[1], p[2]) for p in parsed], **lengths, overlong=overlong,
        margins=margins,
    )  # fmt: skip
    return RewardData(pairs, counts)


def _outcome_examples(tokenizer, prompts, parsed, lengths, drop) -> RewardData:
    encoded = encode_completions(tokenizer, prompts, [p[1] for p in parsed], **lengths)
    groups: dict[str, int] = {}
    data = RewardData([], {"truncated": 0, "truncated_prompts": 0, "groups": 0, "correct": 0,
                           "dropped_overlong": 0})  # fmt: skip
    for text, item, e in zip(prompts, parsed, encoded, strict=True):
        if drop and (e.truncated or e.prompt_truncated):
            data.counts["dropped_overlong"] += 1
            continue
        group = groups.setdefault(text, len(groups))
        data.examples.append(OutcomeExample(e.prompt_ids, e.completion_ids, item[2], group))
        data.counts["truncated"] += e.truncated
        data.counts["truncated_prompts"] += e.prompt_truncated
        data.counts["correct"] += item[2] > 0.5
    data.counts["groups"] = len(groups)
    return data


def _process_examples(tokenizer, prompts, parsed, lengths, separator, drop) -> RewardData:
    encoded = encode_steps(
        tokenizer, prompts, [p[1] for p in parsed], separator=separator, **lengths
    )
    data = RewardData([], {"steps": 0, "dropped_steps": 0, "negative_steps": 0,
                           "dropped_overlong": 0})  # fmt: skip
    for item, e in zip(parsed, encoded, strict=True):
        if drop and e.dropped_steps:
            data.counts["dropped_overlong"] += 1
            continue
        classes = item[2][: len(e.step_ends)]
        data.examples.append(ProcessExample(e.prompt_ids, e.completion_ids, e.step_ends, classes))
        data.counts["steps"] += len(classes)
        data.counts["dropped_steps"] += e.dropped_steps
        data.counts["negative_steps"] += sum(c == 0 for c in classes)
    return data


def _segment_examples(tokenizer, prompts, parsed, lengths, level, drop) -> RewardData:
    encoded = encode_segments(tokenizer, prompts, [p[1] for p in parsed], level=level, **lengths)
    data = RewardData([], {"segments": 0, "dropped_segments": 0, "error_segments": 0,
                           "dropped_overlong": 0})  # fmt: skip
    for item, e in zip(parsed, encoded, strict=True):
        if drop and e.dropped_steps:
            data.counts["dropped_overlong"] += 1
            continue
        classes = item[2][: len(e.step_ends)]
        data.examples.append(ProcessExample(e.prompt_ids, e.completion_ids, e.step_ends, classes))
        data.counts["segments"] += len(classes)
        data.counts["dropped_segments"] += e.dropped_steps
        data.counts["error_segments"] += sum(c != 0 for c in classes)
    return data


# ----------------------------------------------------------------------------- batches
# preference pairs: `rlhf_core.preference.collate_pairs` / `pack_pairs` (DPO's too)


def collate_outcomes(examples: list[OutcomeExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded sequences, `completion_mask` (B, T) over completion tokens, `labels` (B,)."""
    input_ids, attention_mask = pad_sequences(
        [e.prompt_ids + e.completion_ids for e in examples], pad_id
    )
    completion_mask = torch.zeros_like(attention_mask, dtype=torch.bool)
    for b, e in enumerate(examples):
        completion_mask[b, len(e.prompt_ids) : len(e.prompt_ids) + len(e.completion_ids)] = True
    labels = torch.tensor([e.label for e in examples], dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "completion_mask": completion_mask, "labels": labels}  # fmt: skip


def collate_steps(examples: list[ProcessExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded sequences and `step_labels` (B, T): each step's class at its separator,
    IGNORE_INDEX (-100) everywhere else."""
    input_ids, attention_mask = pad_sequences(
        [e.prompt_ids + e.completion_ids for e in examples], pad_id
    )
    step_labels = torch.full_like(input_ids, IGNORE_INDEX)
    for b, e in enumerate(examples):
        for end, cls in zip(e.step_ends, e.step_classes, strict=True):
            step_labels[b, len(e.prompt_ids) + end] = cls
    return {"input_ids": input_ids, "attention_mask": attention_mask, "step_labels": step_labels}
