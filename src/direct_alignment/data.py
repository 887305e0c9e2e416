"""Direct-alignment data: preference pairs, and KTO's unpaired rows, as `PreferencePair`s.

Row formats (`data.format`, `auto` picks by columns):
  auto            preference if the row has a prompt, else hh (`rlhf_core.columns.detect_layout`)
  preference      {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}
                  (message-list completions may repeat the prompt, as in UltraFeedback-binarized;
                  the shared prefix is removed and the last assistant turn is the completion)
  hh              Anthropic HH: {"chosen": transcript, "rejected": transcript}; each transcript is
                  split at its last "\\n\\nAssistant:" into the multi-turn prompt (parsed into
                  user/assistant messages) and the completion (see `split_hh_pair`)
  ultrafeedback   UltraFeedback-binarized: {"prompt": str, "chosen": [messages], "rejected": [...]}
  reasoning_gym   synthetic pairs from a task: chosen = the reference answer, rejected = a
                  wrong answer, the reversed reference (`WRONG_KINDS`), from
                  `rlhf_core.wrong_answers.reasoning_gym_preference_rows`, the builder reward
                  models use too; for learnable offline tests
  unpaired        KTO's labelled single completions (`build_unpaired_data`):
                  {"prompt": str | messages, "completion": str | messages, "label": bool}, as in
                  trl-lib/kto-mix-14k; from reasoning-gym, two rows per task example (the answer,
                  label true; a wrong answer, label false)

`data.columns` renames a data set's columns to the standard keys first (`rlhf_core.columns`; a
`system` column becomes the prompt's leading system message), so orca_dpo_pairs' {system,
question, chosen, rejected} reads with `data.columns: {prompt: question}`. Pair rows are parsed by
`rlhf_core.preference.preference_row` (under `auto`, a row with no prompt is an implicit pair:
HH transcripts or two conversations sharing their prompt turns); a row in no layout this
reads gets one error naming the file, the columns found and the closest layout. Prompts are
rendered with the tokenizer's chat template; completions end with eos. Tokenizing, truncation
and the dropped / counted pairs are `rlhf_core.preference.encode_preference_pairs` (the reward
models' too): the prompt keeps its last `max_prompt_length` tokens (null: as many as the longer
completion leaves room for), then both completions are cut to fit `max_length`, after the same
prompt tokens. Pairs whose two completions are identical after truncation are dropped and
counted. Empty completions (real HH data has a few) are kept as eos alone and counted. Batches
are `rlhf_core.preference.collate_pairs` / `pack_pairs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_core.chat import Messages, as_messages, completion_text, render_prompt
from rlhf_core.columns import Columns, apply_columns, column, detect_layout
from rlhf_core.data import DataSource, load_rows, reasoning_gym_dataset, warn_truncated_prompts
from rlhf_core.encoding import encode_pairs
from rlhf_core.errors import UserError
from rlhf_core.preference import (
    PreferencePair,
    encode_preference_pairs,
    preference_row,
    report_degenerate_pairs,
)
from rlhf_core.wrong_answers import reasoning_gym_labelled_rows, reasoning_gym_preference_rows


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
    columns: Columns | None = None,
) -> PreferenceData:
    """Load, rename (`columns`), render, tokenize and truncate preference pairs (see the module
    docstring); `overlong="drop"` drops (and counts) pairs that would be cut instead."""
    rows, forced = _rows(source, where)
    fmt, file = forced or fmt, source.describe()
    prompts, triples = [], []
    for index, row in enumerate(rows):
        if forced is None:  # a file's rows; generated rows have the standard keys already
            row = apply_columns(row, columns, f"{where} ({file}): row {index}")
        prompt, chosen, rejected = preference_row(row, index, fmt, where, file=file)
        triples.append((prompt, chosen, rejected))
        prompts.append(render_prompt(tokenizer, prompt, where=f"{where}: row {index} prompt"))
        if limit is not None and len(prompts) >= limit:
            break
    pairs, counts = encode_preference_pairs(
        tokenizer, prompts, [(t[1], t[2]) for t in triples],
        max_length=max_length, max_prompt_length=max_prompt_length, overlong=overlong,
    )  # fmt: skip
    data = PreferenceData(pairs=pairs, **counts)
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
    columns: Columns | None = None,
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
    parsed, empty, file = [], 0, source.describe()
    for index, row in enumerate(rows):
        if source.reasoning_gym is None:  # generated rows have the standard keys already
            row = apply_columns(row, columns, f"{where} ({file}): row {index}")
        if index == 0:  # a file in another layout altogether: one clear error
            detect_layout(row, ("unpaired",), f"{where} ({file}): row {index}")
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
