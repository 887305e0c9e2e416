"""Data sources shared by the packages: local files, hub datasets, reasoning-gym tasks; a
resumable seeded sampler.

A `DataSource` is exactly one of
    path: data/x.jsonl        local .jsonl / .json / .jsonl.gz / .parquet, read by `datasets`
    path: org/name            a hub dataset id through `datasets.load_dataset` (needs network)
    reasoning_gym: {task: spell_backward, size: 1000, seed: 1, config: {...}}
                              generated on the fly by reasoning-gym (offline, deterministic)

`EpochSampler` yields batches of indices from a seeded permutation per epoch; its position
(epoch, offset) is what a checkpoint stores, so a resumed run sees exactly the same batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from rlhf_core.columns import Columns
from rlhf_core.config import StrictModel
from rlhf_core.encoding import MAX_PROMPT_LENGTH_HELP
from rlhf_core.errors import UserError, UserFileNotFound

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".gz": "json", ".parquet": "parquet"}


class ReasoningGymSource(StrictModel):
    task: str = Field(description="reasoning-gym dataset name, e.g. spell_backward")
    size: int = Field(gt=0, description="number of examples to generate")
    seed: int = Field(0, description="generation seed (use different seeds for train and eval)")
    config: dict[str, Any] = Field(
        default_factory=dict, description="task options, e.g. word lengths"
    )


class DataSource(StrictModel):
    path: str | None = Field(None, description="local data file or hub dataset id")
    name: str | None = Field(None, description="hub dataset configuration name")
    split: str = Field("train", description="split to read")
    offset: int = Field(0, ge=0, description="skip the first N rows (e.g. to hold out a tail)")
    limit: int | None = Field(None, gt=0, description="keep at most N rows after the offset")
    reasoning_gym: ReasoningGymSource | None = Field(
        None, description="generate with reasoning-gym"
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> DataSource:
        if (self.path is None) == (self.reasoning_gym is None):
            raise UserError("a data source needs exactly one of 'path' or 'reasoning_gym'")
        return self

    def describe(self) -> str:
        if self.reasoning_gym is not None:
            rg = self.reasoning_gym
            return f"reasoning_gym:{rg.task}(size={rg.size}, seed={rg.seed})"
        return f"{self.path}[{self.split}]"


def check_heldout_seeds(train: DataSource, heldout: DataSource | None) -> None:
    """Reject reasoning-gym train/held-out sources whose examples coincide.

    reasoning-gym draws example i of a dataset with seed s from Random(s + i), so seeds 1 and 2
    share all but one example: held-out seed ranges [seed, seed + size) must not overlap.
    """
    if heldout is None or train.reasoning_gym is None or heldout.reasoning_gym is None:
        return
    a, b = train.reasoning_gym, heldout.reasoning_gym
    if a.task == b.task and a.seed < b.seed + b.size and b.seed < a.seed + a.size:
        raise UserError(
            f"reasoning_gym held-out seed range [{b.seed}, {b.seed + b.size}) overlaps the "
            f"training range [{a.seed}, {a.seed + a.size}); example i uses Random(seed + i), so "
            "the sets would share examples. Use a held-out seed far from the training one "
            "(e.g. 10000000)."
        )


class SplitDataConfig(StrictModel):
    """A `data:` block's training and held-out sources (the trainers' data configs extend it,
    re-declaring the two fields' descriptions); the held-out one is checked to be held out."""

    train: DataSource = Field(description="training rows (file, hub id, or reasoning-gym)")
    eval: DataSource | None = Field(None, description="held-out rows")
    columns: Columns | None = Field(
        None,
        description="the data set's column for each standard key, e.g. {prompt: question}, "
        "when its names differ (rlhf_core.columns); a 'system' column becomes a leading "
        "system message of the prompt",
    )

    @model_validator(mode="after")
    def _heldout_is_heldout(self) -> SplitDataConfig:
        check_heldout_seeds(self.train, self.eval)
        return self


class TextDataConfig(SplitDataConfig):
    """Prompt + completion rows: their format (each trainer names its own), the length limits
    of `rlhf_core.encoding`'s one truncation rule, and what to do with a longer row."""

    format: str = Field("auto", description="row format")
    max_length: int = Field(512, gt=2, description="max prompt + completion tokens")
    max_prompt_length: int | None = Field(None, gt=0, description=MAX_PROMPT_LENGTH_HELP)
    overlong: Literal["truncate", "drop"] = Field(
        "truncate",
        description="a row longer than the length limits: truncate it (counted as truncated) or "
        "drop it (counted as dropped_overlong in the summary)",
    )


def is_local_path(path: str) -> bool:
    """A path we must find on disk (has a data-file suffix, or exists) rather than a hub id."""
    p = Path(path).expanduser()
    return p.exists() or p.suffix in LOCAL_SUFFIXES or path.startswith((".", "/", "~"))


def load_rows(source: DataSource, *, field: str = "data") -> Any:
    """Load a file/hub source as a `datasets.Dataset` (rows are dicts)."""
    import datasets

    assert source.path is not None
    if is_local_path(source.path):
        path = Path(source.path).expanduser()
        if path.is_dir():
            raise UserError(
                f"{field}.path: {source.path} is a directory; give a data file inside it "
                f"({', '.join(sorted(LOCAL_SUFFIXES))})"
            )
        if not path.is_file():
            raise UserFileNotFound(f"{field}.path: data file not found: {source.path}")
        if path.stat().st_size == 0:
            raise UserError(f"{field}.path: data file is empty: {source.path}")
        builder = LOCAL_SUFFIXES.get(path.suffix)
        if builder is None:
            raise UserError(
                f"{field}.path: {source.path} has an unsupported suffix {path.suffix!r}; "
                f"expected one of {sorted(LOCAL_SUFFIXES)}"
            )
        if path.suffix in (".jsonl", ".gz"):
            check_jsonl(path, field=field)
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as exc:  # noqa: BLE001 - pyarrow/datasets errors name no line
            raise UserError(f"{field}.path: {source.path} could not be read: {exc}") from exc
    else:
        ds = datasets.load_dataset(source.path, source.name, split=source.split)
    if source.offset or source.limit is not None:
        stop = len(ds) if source.limit is None else min(len(ds), source.offset + source.limit)
        start = min(source.offset, len(ds))
        ds = ds.select(list(range(start, stop)))  # a list: datasets rejects an empty range
    return ds


def check_jsonl(path: Path, *, field: str) -> None:
    """Every line of a JSON-lines file (plain or .gz) must be a JSON object: the first bad one is
    reported as `file:line` with the parse error (pyarrow would only say "position 42")."""
    import gzip
    import json

    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(
                        f"{field}.path: {path}:{number}: not valid JSON ({exc.msg} at column "
                        f"{exc.colno}): {line.strip()[:80]!r}"
                    ) from None
                if not isinstance(row, dict):
                    raise UserError(
                        f"{field}.path: {path}:{number}: expected a JSON object per line, got "
                        f"{type(row).__name__}"
                    )
    except UnicodeDecodeError as exc:
        raise UserError(f"{field}.path: {path}: not UTF-8 text ({exc.reason})") from None
    except (OSError, EOFError) as exc:  # e.g. a truncated .gz
        raise UserError(f"{field}.path: {path}: could not be read: {exc}") from None


def reasoning_gym_dataset(source: ReasoningGymSource) -> Any:
    """A reasoning-gym ProceduralDataset (indexable; entries have question/answer/metadata).

    `task: composite` mixes tasks: `config: {datasets: [{name, weight, config}, ...]}`; each
    entry is then scored by its own task's `score_answer`.
    """
    import warnings

    with warnings.catch_warnings():  # a dependency (cellpylib) compiles with SyntaxWarnings
        warnings.filterwarnings("ignore", category=SyntaxWarning)
        import reasoning_gym

    config = dict(source.config)
    if source.task == "composite" and isinstance(config.get("datasets"), list):
        from reasoning_gym.composite import DatasetSpec

        config["datasets"] = [
            spec if isinstance(spec, DatasetSpec) else DatasetSpec(**spec)
            for spec in config["datasets"]
        ]
    try:
        return reasoning_gym.create_dataset(
            source.task, size=source.size, seed=source.seed, **config
        )
    except (
        TypeError,
        ValueError,
        KeyError,
        AssertionError,
        AttributeError,
    ) as exc:  # configs validate by assert
        msg = f"reasoning_gym task {source.task!r} with config {source.config}: {exc}"
        raise UserError(msg) from exc


class EpochSampler:
    """Batches of indices from a fresh seeded permutation each epoch; resumable by position."""

    def __init__(self, num_items: int, seed: int, *, shuffle: bool = True) -> None:
        if num_items <= 0:
            raise UserError("EpochSampler: the dataset is empty")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_items))
        gen = torch.Generator().manual_seed(self.seed + 1_000_003 * epoch)
        return torch.randperm(self.num_items, generator=gen).tolist()

    def next_batch(self, batch_size: int) -> list[int]:
        out: list[int] = []
        while len(out) < batch_size:
            if self.offset >= self.num_items:
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            take = min(batch_size - len(out), self.num_items - self.offset)
            out.extend(self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num_items": self.num_items}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_items"] != self.num_items:
            raise UserError(
                f"resume: the checkpoint's dataset had {state['num_items']} items, "
                f"this one has {self.num_items}; the data changed"
            )
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._order = self._permutation(self.epoch)

    @property
    def epoch_float(self) -> float:
        return self.epoch + self.offset / self.num_items


def warn_truncated_prompts(where: str, cut: int, total: int, max_prompt_length: int | None) -> None:
    """Say when prompts lost their start: a cut prompt is a different question at training time
    than at generation time, and would otherwise be cut silently (rule: `rlhf_core.encoding`)."""
    import warnings

    how = (
        f"to their last {max_prompt_length} tokens (data.max_prompt_length)"
        if max_prompt_length is not None
        else "to leave room for their completions (data.max_prompt_length: null)"
    )
    warnings.warn(
        f"{where}: {cut} of {total} prompts were cut {how}: raise it (or data.max_length) if "
        "the start matters",
        stacklevel=2,
    )


# A data set in which more than this fraction of rows is degenerate in one way is refused: it
# would train on noise (e.g. every `chosen` empty, or every prompt cut to a single token).
MAX_DEGENERATE_FRACTION = 0.5


def report_degenerate(where: str, total: int, counts: dict[str, int]) -> None:
    """Warn with the count of each kind of degenerate row (`counts`: description -> rows), and
    refuse the data when one kind exceeds `MAX_DEGENERATE_FRACTION` of the `total` rows."""
    import warnings

    for what, n in counts.items():
        if not n:
            continue
        if n > MAX_DEGENERATE_FRACTION * total:
            raise UserError(
                f"{where}: {n} of {total} rows {what}; more than "
                f"{MAX_DEGENERATE_FRACTION:.0%} of the data is degenerate this way, so training "
                "on it would learn nothing useful. Check the data and the length limits"
            )
        warnings.warn(f"{where}: {n} of {total} rows {what}", stacklevel=2)
