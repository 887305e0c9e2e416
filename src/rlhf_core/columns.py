"""Column mapping and the standard row layouts every loader reads (SFT, reward models, DPO/KTO,
RL prompts): one owner, so a data set that trains one workflow is read the same way by the others.

`data.columns` names the user's column for each standard key (`Columns`); `apply_columns` renames
a row to those keys, and folds a `system` column into the prompt as a leading system message
(orca_dpo_pairs' {system, question, chosen, rejected}). `detect_layout` then says which standard
layout the row is in, among the layouts its loader accepts:

    preference            prompt + chosen + rejected: strings, or message lists (a completion may
                          repeat the prompt, as in UltraFeedback-binarized)
    unpaired              prompt + completion + label (KTO's unpaired rows; ORM rows)
    prompt_completion     prompt + completion
    implicit_preference   chosen + rejected with no prompt: Anthropic HH transcripts, or message
                          lists sharing their prompt turns
    messages              a conversation ending with an assistant turn
    prompt_only           a prompt alone (RL prompts)

A row is in the first layout of that list whose keys it has (extra columns are ignored), so a
preference row also serves as a prompt-only row. A row in none of the accepted layouts gets one
error naming the file and row, the columns found, and the closest accepted layout with the keys
it is missing and the `data.columns` entry that would supply them.

Not here: parsing a layout's values (`rlhf_core.preference`, each package's data module), and
the per-package formats that are not standard layouts (GSM8K, PRM800K, segment labels).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rlhf_core.chat import as_messages
from rlhf_core.config import StrictModel
from rlhf_core.errors import UserError

_HELP = "the column holding {}; null = the column is already called '{}'"


class Columns(StrictModel):
    """`data.columns`: the user's column name for each standard key (unset keys keep their own)."""

    prompt: str | None = Field(
        None, description=_HELP.format("the prompt (str or messages)", "prompt")
    )
    chosen: str | None = Field(None, description=_HELP.format("the preferred completion", "chosen"))
    rejected: str | None = Field(
        None, description=_HELP.format("the dispreferred completion", "rejected")
    )
    completion: str | None = Field(
        None, description=_HELP.format("the completion (str or messages)", "completion")
    )
    messages: str | None = Field(
        None, description=_HELP.format("a whole conversation (a message list)", "messages")
    )
    label: str | None = Field(
        None, description=_HELP.format("an unpaired row's label (true = desirable)", "label")
    )
    answer: str | None = Field(
        None, description=_HELP.format("the reference answer a verifier checks", "answer")
    )
    system: str | None = Field(
        None,
        description=_HELP.format("a system prompt, put before the prompt as a system message",
                                 "system"),
    )  # fmt: skip

    def mapping(self) -> dict[str, str]:
        """{standard key: the user's column} for the keys that are set."""
        return {key: name for key, name in self.model_dump().items() if name is not None}


# standard layout -> the keys a row needs, most specific first (see the module docstring)
LAYOUTS: dict[str, tuple[str, ...]] = {
    "preference": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),
    "prompt_completion": ("prompt", "completion"),
    "implicit_preference": ("chosen", "rejected"),
    "messages": ("messages",),
    "prompt_only": ("prompt",),
}
LAYOUT_NOTES = {"implicit_preference": "as HH transcripts or message lists, no prompt"}
HH_ASSISTANT = "\n\nAssistant:"


def column(row: dict[str, Any], name: str, here: str) -> Any:
    """`row[name]`, or an error naming the row (`here`) and the columns it has."""
    if row.get(name) is None:
        raise UserError(f"{here} is missing column {name!r} (columns: {list(row)})")
    return row[name]


def apply_columns(row: dict[str, Any], columns: Columns | None, where: str) -> dict[str, Any]:
    """`row` with the columns of `columns` renamed to their standard keys, and a `system` column
    (when set) made the leading system message of the prompt, the messages, or (no prompt) both
    message-list completions; with none of them it stays. `where` names the file and row."""
    mapping = columns.mapping() if columns is not None else {}
    for key, name in mapping.items():
        if name not in row:
            raise UserError(
                f"{where}: data.columns.{key} names column {name!r}, which the row does not "
                f"have (columns found: {sorted(row)})"
            )
    out = {k: v for k, v in row.items() if k not in mapping.values()}
    out.update({key: row[name] for key, name in mapping.items()})
    system = out.get("system")
    if system is None or system == "":
        out.pop("system", None)
        return out
    if not isinstance(system, str):
        raise UserError(f"{where} column 'system': expected a string, got {type(system).__name__}")
    first = [{"role": "system", "content": system}]
    if out.get("prompt") is not None:
        out["prompt"] = first + as_messages(out["prompt"], where=f"{where} column 'prompt'")
    elif out.get("messages") is not None:
        out["messages"] = first + as_messages(out["messages"], where=f"{where} column 'messages'")
    elif all(isinstance(out.get(k), list) for k in ("chosen", "rejected")):
        for key in ("chosen", "rejected"):
            out[key] = first + as_messages(out[key], where=f"{where} column {key!r}")
    else:  # nothing to go before: kept, so the layout error lists it (HH rows refuse it)
        return out
    del out["system"]
    return out


def _missing(row: dict[str, Any], layout: str) -> list[str]:
    return [key for key in LAYOUTS[layout] if row.get(key) is None]


def _lacks(row: dict[str, Any], layout: str) -> list[str]:
    """The keys a row needs for `layout` and does not have; a pair of plain strings (no HH
    turns) lacks the prompt it would need (it cannot be split off the completions)."""
    missing = _missing(row, layout)
    if not missing and layout == "implicit_preference":
        pair = (row["chosen"], row["rejected"])
        carries_prompt = all(isinstance(v, list) for v in pair) or all(
            isinstance(v, str) and HH_ASSISTANT in v for v in pair
        )
        return [] if carries_prompt else ["prompt"]
    return missing


def describe_layout(layout: str) -> str:
    """'name (key + key ...[, note])', as errors list the accepted layouts."""
    note = f", {LAYOUT_NOTES[layout]}" if layout in LAYOUT_NOTES else ""
    return f"{layout} ({' + '.join(LAYOUTS[layout])}{note})"


def detect_layout(row: dict[str, Any], wanted: tuple[str, ...], where: str) -> str:
    """The standard layout of a (renamed) row among `wanted`: the first of `LAYOUTS`' order whose
    keys the row has. None fits: one error naming `where` (file and row), the columns found, and
    the closest accepted layout with what it is missing and a `data.columns` hint."""
    unknown = [name for name in wanted if name not in LAYOUTS]
    if unknown or not wanted:
        raise ValueError(f"detect_layout: unknown layouts {unknown}; known: {list(LAYOUTS)}")
    for layout in LAYOUTS:
        if layout in wanted and not _lacks(row, layout):
            return layout
    # closest: the fewest keys that no unrecognised column could supply, then the layout that
    # would read the most of the row, then the order above
    spare = sum(v is not None and k not in Columns.model_fields for k, v in row.items())
    order = list(LAYOUTS)
    closest = min(wanted, key=lambda name: (max(0, len(_lacks(row, name)) - spare),
                                            -len(LAYOUTS[name]), order.index(name)))  # fmt: skip
    missing = _lacks(row, closest)
    found = sorted(k for k, v in row.items() if v is not None)
    accepted = "; ".join(describe_layout(name) for name in wanted)
    example = ", ".join(f"{key}: <your column>" for key in missing)
    raise UserError(
        f"{where} is missing column{'s' if len(missing) > 1 else ''} "
        f"{', '.join(repr(k) for k in missing)} of layout {describe_layout(closest)}, the "
        f"closest of the layouts read here ({accepted}); columns found: {found}. If the data "
        f"set names them differently, map them with data.columns, e.g. "
        f"data.columns: {{{example}}}"
    )
