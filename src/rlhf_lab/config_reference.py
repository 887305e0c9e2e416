"""Generate `docs/configuration.md`, the configuration reference, from the Pydantic config classes:
every key of every trainer's YAML with its type, default and description (the `Field`
descriptions in the code are the single source), the truncation rule (`rlhf_core.encoding`'s
docstring), and every registered loss, estimator and reward with its constructor keywords.

    uv run python -m rlhf_lab.config_reference            # rewrite docs/configuration.md
    uv run python -m rlhf_lab.config_reference --check    # exit 1 if it is out of date

A test runs the check, so a config change without a regenerated reference fails CI.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOTS = [
    ("instruction_tuning", "instruction_tuning.config:SFTConfig", "instruction_tuning.train"),
    ("reward_models", "reward_models.config:RMConfig", "reward_models.train"),
    ("direct_alignment", "direct_alignment.config:DAConfig", "direct_alignment.train"),
    ("policy_gradients", "policy_gradients.config:PGConfig", "policy_gradients.train"),
    ("rlhf-lab compare", "rlhf_lab.compare:CompareConfig", None),
]
TARGET = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
#: (config key, registry) of every `{name: ..., keyword: value}` spec a config holds.
REGISTRIES = [
    ("loss (instruction_tuning)", "instruction_tuning.losses:LOSSES"),
    ("loss (reward_models)", "reward_models.losses:LOSSES"),
    ("loss (direct_alignment)", "direct_alignment.losses:LOSSES"),
    ("algorithm.advantage (policy_gradients)", "policy_gradients.advantages:ADVANTAGES"),
    ("algorithm.loss (policy_gradients)", "policy_gradients.losses:LOSSES"),
    ("algorithm.value_loss (policy_gradients)", "policy_gradients.losses:VALUE_LOSSES"),
    ("algorithm.correction (policy_gradients)", "policy_gradients.off_policy:CORRECTIONS"),
    ("rewards[] (policy_gradients)", "policy_gradients.rewards:REWARDS"),
]


def _load(spec: str) -> type[BaseModel]:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Pydantic models reachable in a field annotation (through Optional, list, dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += _models_in(arg)
    return out


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    name = getattr(origin, "__name__", str(origin))
    return f"{name}[{', '.join(_type_name(a) for a in args)}]"


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(see below)"
    else:
        return "**required**"
    if isinstance(value, BaseModel):
        return "(see below)"
    text = repr(value)
    return f"`{text}`" if len(text) < 60 else f"`{text[:57]}...`"


def _rows(model: type[BaseModel], prefix: str, seen: list[tuple[str, type[BaseModel]]]):
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
        for sub in _models_in(field.annotation):
            seen.append((key, sub))
    return rows


def _truncation_rule() -> list[str]:
    """`data.max_length` / `data.max_prompt_length`: the rule from `rlhf_core.encoding`'s
    docstring, its single source."""
    import rlhf_core.encoding

    doc = rlhf_core.encoding.__doc__ or ""
    rule = doc[doc.index("The truncation rule") : doc.index("Both cuts")].strip().splitlines()
    return [
        "## Token limits (every package)",
        "",
        "SFT, reward-model and preference data, and the scoring of a saved reward model, all cut",
        "over-long examples by one rule (`rlhf_core.encoding.fit_lengths`):",
        "",
        "```",
        *[line.rstrip() for line in rule],
        "```",
        "",
    ]


def _data_layouts() -> list[str]:
    """`data.columns` and the standard row layouts: the table from `rlhf_core.columns`'
    docstring, its single source."""
    import rlhf_core.columns

    doc = rlhf_core.columns.__doc__ or ""
    table = doc[doc.index("    preference  ") : doc.index("A row is in the first")].rstrip()
    return [
        "## Data: column names and layouts (every package)",
        "",
        "Every trainer's `data.columns` names the data set's column for each standard key "
        "(`prompt`, `chosen`, `rejected`, `completion`, `messages`, `label`, `answer`, "
        "`system`), e.g. `data.columns: {prompt: question}` for orca_dpo_pairs' {system, "
        "question, chosen, rejected}; a `system` column becomes the prompt's leading system "
        "message (`rlhf_core.columns`). `data.format: auto` then detects each row's layout among "
        "those its trainer reads (a row is in the first of these whose keys it has; extra "
        "columns are ignored):",
        "",
        "```",
        *[line.rstrip() for line in table.splitlines()],
        "```",
        "",
        "SFT reads messages and prompt_completion; DPO and preference reward models preference "
        "and implicit_preference (formats `preference` / `ultrafeedback` name the first, `hh` "
        "the second); KTO's `unpaired` format and ORM rows unpaired; RL prompts every layout "
        "with a prompt, conversations and HH transcripts (`policy_gradients.rollout`). A row in "
        "none of them is refused with one error naming the file and row, the columns found, "
        "the closest layout, the keys it lacks and the `data.columns` entry that would supply "
        "them; nothing is written.",
        "",
    ]


def _registered() -> list[str]:
    """Every registered class and the keywords its spec accepts, read from `__init__`."""
    from rlhf_core.registry import keywords

    lines = [
        "## Registered losses, estimators and rewards",
        "",
        "A spec is `{name: <registered name>, <keyword>: <value>, ...}`; the keywords are the "
        "class's constructor arguments (unknown keys and wrong types are errors; defaults are "
        "filled in and shown in the resolved config). Where the loss sits: top-level `loss:` in "
        "the packages whose method is its loss (SFT, reward models, direct alignment), and "
        "`algorithm.loss` in policy gradients, where an algorithm combines the loss with an "
        "advantage estimator.",
        "",
    ]
    for key, spec in REGISTRIES:
        registry = _load(spec)
        lines += [f"### `{key}`", "", "| name | class | keywords (default) |"]
        lines.append("| --- | --- | --- |")
        for name in registry.names():
            cls = registry.get(name)
            if cls.__module__.split(".")[0] not in LIBRARY_PACKAGES:
                continue  # a user's class registered in this process (e.g. by a test)
            hints = typing.get_type_hints(cls.__init__)
            params = [
                f"`{p}`: {_type_name(hints.get(p, Any))}"
                + ("" if param.default is param.empty else f" = `{param.default!r}`")
                for p, param in keywords(cls).items()
            ]
            shown = "; ".join(params) or "(none)"  # _type_name escapes its "|"
            lines.append(f"| `{name}` | `{cls.__name__}` | {shown} |")
        lines.append("")
    return lines


LIBRARY_PACKAGES = (
    "rlhf_core", "instruction_tuning", "reward_models", "policy_gradients", "direct_alignment",
    "rlhf_lab",
)  # fmt: skip


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated by `uv run python -m rlhf_lab.config_reference` from the Pydantic field "
        "descriptions in the code; do not edit by hand (a test fails when it is out of date).",
        "Every trainer reads one YAML file (`--config`), rejects unknown keys, and accepts "
        "`--set key.path=value` overrides (list items by index: `rewards.0.weight=0.5`).",
        "",
        *_truncation_rule(),
        *_data_layouts(),
    ]
    for title, spec, module in ROOTS:
        root = _load(spec)
        run = f"`uv run python -m {module} --config FILE`" if module else f"`{title} --config FILE`"
        lines += [f"## {title} (`{root.__name__}`)", "", f"Run with {run}.", ""]
        queue: list[tuple[str, type[BaseModel]]] = [("", root)]
        done: set[tuple[str, str]] = set()
        while queue:
            prefix, model = queue.pop(0)
            if (prefix, model.__name__) in done:
                continue
            done.add((prefix, model.__name__))
            heading = f"`{prefix}`" if prefix else "top level"
            lines += [f"### {heading} ({model.__name__})", ""]
            lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
            nested: list[tuple[str, type[BaseModel]]] = []
            lines += _rows(model, f"{prefix}." if prefix else "", nested)
            lines.append("")
            queue += nested
    lines += _registered()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_lab.config_reference")
    parser.add_argument("--check", action="store_true", help="fail if the file is out of date")
    parser.add_argument("--output", type=Path, default=TARGET)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.is_file() else ""
        if current != text:
            print(f"{args.output} is out of date: run `uv run python -m rlhf_lab.config_reference`")
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
