"""`rlhf-lab data CONFIG [--set k=v ...]`: what a trainer's data looks like before training on it.

    uv run rlhf-lab data configs/direct_alignment/dpo.yaml --set model.name_or_path=tiny-qwen3-gpt2

The config is any trainer's (SFT, reward model, DPO/KTO, policy-gradient prompts; which one is
found by validating it against each, or named with `--trainer`). Its data is loaded through that
trainer's own loaders (`build_sft_data`, `build_reward_data`, `build_preference_data` /
`build_unpaired_data`, `load_prompts`) with the config's settings, as the trainer would at its
start, and reported per split (the held-out one as the trainer reads it: `train.eval_size` rows):

- rows: in the source, and the examples the trainer keeps; rows it drops or finds degenerate,
  with the reason (its own counters and warnings)
- token lengths (p50 / p90 / p99 / max) of the prompt (chat template applied) and of each
  completion (with eos), before truncation: the loader run once more without length limits
- how many rows `data.max_length` / `data.max_prompt_length` cut (`rlhf_core.encoding.fit_lengths`,
  the one truncation rule, on those lengths) or, with `overlong: drop`, drop
- three examples as the model sees them: the kept rows' token ids decoded (special tokens shown)
- a length histogram, `lengths.png`, and everything as `report.json`, in `--out`
  (default outputs/data-<config name>-<time>/)

RL prompts have no completion to cut: their report gives the prompt lengths, the reference
answers' lengths where the rows have them, and `rollout.max_new_tokens`.
Not here: a process- or segment-reward model's steps are reported as one completion each.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.errors import UserError

CONFIG_CLASSES = {
    "sft": "instruction_tuning.config:SFTConfig",
    "rm": "reward_models.config:RMConfig",
    "dpo": "direct_alignment.config:DAConfig",
    "rl": "policy_gradients.config:PGConfig",
}
UNLIMITED = 10**9  # a max_length no row reaches: the loaders' lengths before truncation
EXAMPLES = 3


@dataclass
class Loaded:
    """One split as a trainer's loader returned it, reduced to token ids and its counters."""

    examples: list[tuple[list[int], list[list[int]]]]  # (prompt ids, completion ids...)
    names: tuple[str, ...]  # what each completion is: ("completion",), ("chosen", "rejected")
    counts: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    prompt_texts: set[str] = field(default_factory=set)  # SFT: its held-out split excludes them


def config_class(name: str) -> type:
    module, cls = CONFIG_CLASSES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_trainer_config(path: Path, overrides: list[str], trainer: str | None) -> tuple[str, Any]:
    """(trainer, validated config): the named trainer's config, or the one class it validates as."""
    from rlhf_core.config import ConfigError, apply_overrides, load_config, read_yaml

    if trainer is not None:
        return trainer, load_config(config_class(trainer), path, overrides)
    data = apply_overrides(read_yaml(path), list(overrides))
    fits, errors = [], {}
    for name in CONFIG_CLASSES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fits.append((name, config_class(name).model_validate(data)))
        except Exception as exc:  # noqa: BLE001 - every mismatch is reported below
            errors[name] = str(exc).splitlines()[0]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        listed = "; ".join(f"{n}: {e}" for n, e in errors.items())
        raise ConfigError(f"{path}: not a config of any trainer ({listed}); name it with --trainer")
    raise ConfigError(
        f"{path}: valid for {', '.join(n for n, _ in fits)}; name the one with --trainer"
    )


# ----------------------------------------------------------------------------- the loaders


def _sft(cfg: Any, tok: Any, split: str, limits: dict, train: Loaded | None) -> Loaded:
    from instruction_tuning.data import build_sft_data

    d, t = cfg.data, cfg.train
    extra: dict[str, Any] = {}
    if split == "eval":  # as the trainer: eval_size rows, none of the training prompts
        extra = {"limit": t.eval_size, "exclude_prompts": train.prompt_texts if train else None}
    data = build_sft_data(
        getattr(d, split), tok, fmt=d.format, where=f"data.{split}", overlong=d.overlong,
        columns=d.columns, **limits, **extra,
    )  # fmt: skip
    return Loaded(
        [(e.prompt_ids, [e.completion_ids]) for e in data.examples], ("completion",),
        {"truncated_completions": data.truncated_completions,
         "dropped_overlong": data.dropped_overlong},
        prompt_texts={e.prompt_text for e in data.examples},
    )  # fmt: skip


def _dpo(cfg: Any, tok: Any, split: str, limits: dict, train: Loaded | None) -> Loaded:
    from direct_alignment.data import build_preference_data, build_unpaired_data

    d, t = cfg.data, cfg.train
    limit = t.eval_size if split == "eval" else None
    source, where = getattr(d, split), f"data.{split}"
    if d.format == "unpaired":  # KTO: one labelled completion per row (its partner is another's)
        data = build_unpaired_data(
            source, tok, where=where, limit=limit, columns=d.columns, **limits
        )
        examples = [(p.prompt_ids, [p.chosen_ids]) for p in data.pairs]
        names: tuple[str, ...] = ("completion",)
    else:
        data = build_preference_data(
            source, tok, fmt=d.format, overlong=d.overlong, columns=d.columns, where=where,
            limit=limit, **limits,
        )  # fmt: skip
        examples = [(p.prompt_ids, [p.chosen_ids, p.rejected_ids]) for p in data.pairs]
        names = ("chosen", "rejected")
    counts = {k: getattr(data, k) for k in ("dropped_identical", "dropped_overlong", "truncated",
                                            "truncated_prompts", "empty_completions")}  # fmt: skip
    return Loaded(examples, names, counts)


def _rm(cfg: Any, tok: Any, split: str, limits: dict, train: Loaded | None) -> Loaded:
    from reward_models.data import build_reward_data
    from reward_models.losses import LOSSES
    from rlhf_core.registry import build_from_spec

    loss = build_from_spec(LOSSES, cfg.loss)
    d = cfg.data.model_copy(update=limits)
    limit = cfg.train.eval_size if split == "eval" else None
    data = build_reward_data(
        getattr(d, split), tok, kind=loss.kind, data_cfg=d, num_classes=loss.head_dim,
        where=f"data.{split}", limit=limit,
    )  # fmt: skip
    if loss.kind == "preference":
        examples = [(e.prompt_ids, [e.chosen_ids, e.rejected_ids]) for e in data.examples]
        return Loaded(examples, ("chosen", "rejected"), dict(data.counts))
    examples = [(e.prompt_ids, [e.completion_ids]) for e in data.examples]
    return Loaded(examples, ("completion",), dict(data.counts))


def _rl(cfg: Any, tok: Any, split: str, limits: dict, train: Loaded | None) -> Loaded:
    from policy_gradients.rollout import load_prompts
    from rlhf_core.encoding import tokenize_texts

    limit = cfg.train.eval_size if split == "eval" else None
    prompts = load_prompts(
        getattr(cfg.data, split), tok, where=f"data.{split}", limit=limit, **cfg.prompt_args()
    )
    ids = tokenize_texts(tok, [it["prompt"] for it in prompts.items])
    answers = [it.get("answer") for it in prompts.items]
    if all(a is not None for a in answers):
        answer_ids = tokenize_texts(tok, [str(a) for a in answers])
        return Loaded([(p, [a]) for p, a in zip(ids, answer_ids, strict=True)], ("answer",))
    return Loaded([(p, []) for p in ids], ())


LOADERS = {"sft": _sft, "dpo": _dpo, "rm": _rm, "rl": _rl}


def load_split(trainer: str, cfg: Any, tok: Any, split: str, limits: dict, train=None) -> Loaded:
    """A split through the trainer's loader, its warnings captured as reasons."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = LOADERS[trainer](cfg, tok, split, limits, train)
    loaded.warnings = [str(w.message) for w in caught if "chat template" not in str(w.message)]
    return loaded


# ----------------------------------------------------------------------------- the figures


def percentiles(values: list[int]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {}
    p50, p90, p99 = np.percentile(np.asarray(values), [50, 90, 99]).tolist()
    return {
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": max(values),
        "mean": sum(values) / len(values),
    }


def length_table(loaded: Loaded) -> dict[str, list[int]]:
    """Token counts per example: prompt, each completion, and prompt + longest completion."""
    out = {"prompt": [len(p) for p, _ in loaded.examples]}
    for k, name in enumerate(loaded.names):
        out[name] = [len(c[k]) for _, c in loaded.examples]
    if loaded.names:
        out["total"] = [len(p) + max(len(x) for x in c) for p, c in loaded.examples]
    return out


def cut_counts(raw: Loaded, max_length: int, max_prompt_length: int | None) -> dict[str, int]:
    """Rows whose prompt / completion the configured limits cut (`fit_lengths`, the one rule)."""
    from rlhf_core.encoding import fit_lengths

    prompt_cut = completion_cut = either = 0
    for prompt, completions in raw.examples:
        _, _, p_cut, c_cuts = fit_lengths(
            prompt, completions, max_length=max_length, max_prompt_length=max_prompt_length
        )
        prompt_cut += p_cut
        completion_cut += any(c_cuts)
        either += p_cut or any(c_cuts)
    return {"rows": len(raw.examples), "rows_cut": either, "prompt_cut": prompt_cut,
            "completion_cut": completion_cut}  # fmt: skip


def source_rows(source: Any, where: str) -> int:
    from rlhf_core.data import load_rows

    if source.reasoning_gym is not None:
        return source.reasoning_gym.size
    return len(load_rows(source, field=where))


def describe(source: Any) -> str:
    """The source as `DataSource.describe` names it, with the rows it skips and keeps."""
    window = [f"{k} {getattr(source, k)}" for k in ("offset", "limit") if getattr(source, k)]
    return source.describe() + (f" ({', '.join(window)})" if window else "")


def show(tok: Any, ids: list[int], chars: int) -> str:
    text = tok.decode(ids, skip_special_tokens=False)
    return text if len(text) <= chars else f"[... {len(text) - chars} chars] " + text[-chars:]


def report_split(trainer: str, cfg: Any, tok: Any, split: str, chars: int, train=None) -> dict:
    """One split's figures (see the module docstring), and the loaded examples for the plot."""
    d = cfg.data
    limits = {}
    if trainer != "rl":
        limits = {"max_length": d.max_length, "max_prompt_length": d.max_prompt_length}
    loaded = load_split(trainer, cfg, tok, split, limits, train)
    unlimited = {"max_length": UNLIMITED, "max_prompt_length": None} if limits else {}
    raw = load_split(trainer, cfg, tok, split, unlimited, train) if limits else loaded
    result: dict[str, Any] = {
        "source": describe(getattr(d, split)),
        "rows_in_source": source_rows(getattr(d, split), f"data.{split}"),
        "examples_kept": len(loaded.examples),
        "loader_counts": loaded.counts,
        "warnings": loaded.warnings,
        "lengths_before_truncation": {k: percentiles(v) for k, v in length_table(raw).items()},
    }
    if limits:
        result["limits"] = {**limits, "overlong": d.overlong if hasattr(d, "overlong") else None}
        result["cut_by_limits"] = cut_counts(raw, d.max_length, d.max_prompt_length)
    else:
        result["limits"] = {"rollout.max_new_tokens": cfg.rollout.max_new_tokens}
    result["examples"] = [
        {"prompt": show(tok, p, chars),
         **{n: show(tok, c[k], chars) for k, n in enumerate(loaded.names)}}
        for p, c in loaded.examples[:EXAMPLES]
    ]  # fmt: skip
    return {"figures": result, "raw": raw, "loaded": loaded}


def plot_lengths(path: Path, splits: dict[str, dict], limits: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = {name: length_table(s["raw"]) for name, s in splits.items()}
    keys = ["prompt"] + [k for k in next(iter(tables.values())) if k not in ("prompt", "total")]
    keys += ["total"] if "total" in next(iter(tables.values())) else []
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for split, table in tables.items():
            ax.hist(table[key], bins=40, alpha=0.6, label=f"{split} ({len(table[key])})")
        line = {"prompt": limits.get("max_prompt_length"), "total": limits.get("max_length")}
        if line.get(key):
            ax.axvline(line[key], color="k", ls="--", lw=1, label=f"limit {line[key]}")
        ax.set_title(f"{key} tokens" + (" (prompt + longest)" if key == "total" else ""))
        ax.set_xlabel("tokens (before truncation)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("rows")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- the report


def _fmt(stats: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.0f}" for k, v in stats.items() if k != "mean")


def render_text(report: dict[str, Any]) -> str:
    lines = [f"rlhf-lab data: {report['config']} ({report['trainer']} trainer, "
             f"tokenizer {report['tokenizer']})"]  # fmt: skip
    for split, r in report["splits"].items():
        lines += [
            "",
            f"== data.{split}: {r['source']}",
            f"rows: {r['rows_in_source']} in the source, {r['examples_kept']} examples kept",
        ]
        counts = ", ".join(f"{k} {v}" for k, v in r["loader_counts"].items())
        lines.append(f"loader counts: {counts or 'none'}")
        lines += [f"warning: {w}" for w in r["warnings"]]
        lines.append("token lengths before truncation:")
        lines += [f"  {k:10s} {_fmt(v)}" for k, v in r["lengths_before_truncation"].items()]
        limits = ", ".join(f"{k} {v}" for k, v in r["limits"].items())
        lines.append(f"limits: {limits}")
        if "cut_by_limits" in r:
            c = r["cut_by_limits"]
            verb = "drop" if r["limits"].get("overlong") == "drop" else "cut"
            lines.append(
                f"the limits {verb} {c['rows_cut']} of {c['rows']} rows "
                f"({c['rows_cut'] / max(1, c['rows']):.1%}): the prompt of {c['prompt_cut']}, "
                f"a completion of {c['completion_cut']}"
            )
        for i, ex in enumerate(r["examples"]):
            lines.append(f"-- example {i}")
            lines += [f"[{k}] {v!r}" for k, v in ex.items()]
    lines += ["", f"histogram: {report['plot']}", f"report: {report['json']}"]
    return "\n".join(lines)


def build_report(
    config: Path, overrides: list[str], *, trainer: str | None, out: Path | None, chars: int
) -> dict[str, Any]:
    from rlhf_core.models import load_tokenizer
    from rlhf_core.tracking import timestamp

    trainer, cfg = load_trainer_config(config, overrides, trainer)
    if trainer == "dpo" and cfg.model is None:
        model = cfg.models[0]
    else:
        model = cfg.model
    tok = load_tokenizer(model, padding_side="left" if trainer == "rl" else "right")
    splits = {"train": report_split(trainer, cfg, tok, "train", chars)}
    if cfg.data.eval is not None and cfg.train.evaluate:
        train = splits["train"]["loaded"]
        splits["eval"] = report_split(trainer, cfg, tok, "eval", chars, train)
    out = out or Path("outputs") / f"data-{getattr(cfg, 'name', config.stem)}-{timestamp()}"
    out.mkdir(parents=True, exist_ok=True)
    limits = {}
    if trainer != "rl":
        limits = {
            "max_length": cfg.data.max_length,
            "max_prompt_length": cfg.data.max_prompt_length,
        }
    plot_lengths(out / "lengths.png", splits, limits)
    report = {
        "config": str(config) + (f" --set {' --set '.join(overrides)}" if overrides else ""),
        "trainer": trainer, "tokenizer": model.name_or_path,
        "splits": {name: s["figures"] for name, s in splits.items()},
        "plot": str(out / "lengths.png"), "json": str(out / "report.json"),
    }  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf-lab data", description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, help="a trainer's YAML config")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
        help="override a config value (as the trainers' --set)",
    )  # fmt: skip
    parser.add_argument("--trainer", choices=sorted(CONFIG_CLASSES), help="whose config it is")
    parser.add_argument("--out", type=Path, help="output dir (default outputs/data-<name>-<time>)")
    parser.add_argument("--chars", type=int, default=400, help="characters shown per example text")
    args = parser.parse_args(argv)
    if args.chars <= 0:
        raise UserError(f"--chars must be > 0, got {args.chars}")
    report = build_report(
        args.config, args.overrides, trainer=args.trainer, out=args.out, chars=args.chars
    )
    print(render_text(report))
    return 0


if __name__ == "__main__":
    from rlhf_core.errors import run_main

    sys.exit(run_main(main))
