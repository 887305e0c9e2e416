"""YAML -> Pydantic v2 configs, `--set a.b=value` overrides, and the common command line.

Every package's `train.py` does

    cfg, run = parse_run_args(argv, SFTConfig, prog="instruction_tuning.train")

which reads `--config FILE`, applies each `--set key.path=value` (the value parsed as a YAML scalar,
so `--set optim.lr=3e-4` and `--set model.lora=null` do what they say), validates against the
Pydantic model (`extra="forbid"` everywhere) and returns the config plus the run options
(`--output-dir`, `--resume [auto|PATH]`, `--dry-run`). `--import MODULE` (repeatable) adds to the
config's top-level `imports:` list: user modules imported before the config is validated, so the
losses, estimators and rewards they register can be named in it (see docs/extending/).

Errors name the file, the key path and what was expected:
  unknown key   -> the key path, the file, and the keys allowed at that level
  wrong type    -> the key path, the expected type, and the value given
  missing file  -> the path that was tried
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlhf_core.errors import UserError
from rlhf_core.user_modules import import_modules

C = TypeVar("C", bound=BaseModel)


class StrictModel(BaseModel):
    """Base for every config block: unknown keys are errors, values are validated on assignment,
    numbers must be finite, and a boolean is never read as a number (`lr: yes` is not 1.0) nor a
    number as a boolean (`eval_sampled: 1` is not true)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False
    )

    @model_validator(mode="before")
    @classmethod
    def _no_bool_number_confusion(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                field_info = cls.model_fields.get(key) if isinstance(key, str) else None
                if field_info is not None:
                    try:
                        check_scalar_kind(field_info.annotation, value)
                    except ValueError as exc:
                        raise ValueError(f"{key}: {exc}") from None
        return data


def check_scalar_kind(annotation: Any, value: Any) -> None:
    """Raise ValueError when YAML's bool lands in a number field or a number in a bool field
    (pydantic's lax mode would coerce both silently)."""
    kinds = set(_unwrap(annotation))
    numeric = bool(kinds & {int, float})
    if isinstance(value, bool) and numeric and bool not in kinds:
        raise ValueError(f"expected a number, got the boolean {value!r}")
    if (
        bool in kinds
        and not isinstance(value, bool)
        and isinstance(value, int | float)
        and not numeric
    ):
        raise ValueError(f"expected true or false, got the number {value!r}")


class RunConfig(StrictModel):
    """Base of every trainer's top-level config. `imports` is its first field, so the user modules
    are imported before any loss, estimator or reward spec is checked against its registry."""

    imports: list[str] = Field(
        default_factory=list,
        description="user modules imported before the config is validated (their registered "
        "losses, estimators and rewards become usable by name); --import MODULE adds one",
    )

    @field_validator("imports")
    @classmethod
    def _import_user_modules(cls, modules: list[str]) -> list[str]:
        import_modules(modules)
        return modules


class ConfigError(UserError):
    """A config that cannot be used, with a message naming the file and key path."""


@dataclass
class RunArgs:
    """Command-line options shared by every trainer (everything except the config contents)."""

    config_path: Path | None
    overrides: list[str] = field(default_factory=list)
    output_dir: Path | None = None
    resume: str | None = None  # None, "auto", or a path
    dry_run: bool = False
    overwrite: bool = False  # move an existing run in output_dir aside instead of refusing
    model_index: int | None = None  # configs with a `models:` list: train only this entry


# Settings a resumed run may change without changing what the run means (its data, batches,
# model and loss stay those of the checkpoint). Anything else differing from the run's saved
# config.yaml is refused on resume.
SAFE_ON_RESUME = (
    "name", "tracking", "checkpoint", "imports", "data.eval", "train.max_steps", "train.epochs",
    "train.eval_every", "train.eval_size", "train.eval_max_new_tokens", "train.eval_sampled",
    "train.threads",
)  # fmt: skip


# ----------------------------------------------------------------------------- loading


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from `path`; a missing file or a non-mapping top level raises."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path} (resolved to {path.resolve()})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
            "save the config as UTF-8"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}{yaml_problem(exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys, got {type(data).__name__}"
        )
    return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """`:LINE:COLUMN: not valid YAML: <the problem>` on one line (PyYAML's own text spans
    several, quoting the file)."""
    mark = getattr(exc, "problem_mark", None)
    where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
    what = ", ".join(str(p) for p in parts if p) or str(exc).strip().splitlines()[0]
    return f"{where}: not valid YAML: {what}"


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides in order; values are parsed as YAML scalars."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"--set {item!r}: empty component in key path {key!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value{yaml_problem(exc)}") from None
        node: Any = data
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                node = node[_list_index(node, part, item, ".".join(parts[:depth]))]
                continue
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict | list):
                raise ConfigError(
                    f"--set {item!r}: {where!r} is a {type(child).__name__}, not a mapping"
                )
            node = child
        if isinstance(node, list):
            node[_list_index(node, parts[-1], item, ".".join(parts[:-1]))] = value
        else:
            node[parts[-1]] = value
    return data


def _list_index(node: list, part: str, item: str, where: str) -> int:
    """`rewards.0.path=...`: a numeric key path component indexes a list."""
    if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
        raise ConfigError(
            f"--set {item!r}: {where!r} is a list of {len(node)} items; "
            f"use an index 0..{len(node) - 1}"
        )
    return int(part)


def validate_config(cls: type[C], data: dict[str, Any], source: str = "<config>") -> C:
    """Validate `data` against `cls`, turning pydantic's errors into one readable ConfigError."""
    imports = data.get("imports")
    if isinstance(imports, list):  # first, so a missing module is its own one-line error
        import_modules(imports, where=f"{source}: imports")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        lines = [_describe_error(cls, err) for err in exc.errors()]
        raise ConfigError(f"{source}: invalid config\n  " + "\n  ".join(lines)) from None


def load_config(
    cls: type[C],
    path: str | Path,
    overrides: list[str] | None = None,
    imports: list[str] | None = None,
) -> C:
    """Read YAML at `path`, apply overrides, add `imports` (--import), validate as `cls`."""
    data = apply_overrides(read_yaml(path), list(overrides or []))
    if imports:
        data["imports"] = [*(data.get("imports") or []), *imports]
    source = str(path) + (f" (with --set {', '.join(overrides)})" if overrides else "")
    return validate_config(cls, data, source)


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML (what is saved in the run dir and printed by --dry-run)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


# ----------------------------------------------------------------------------- command line


def build_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--config", type=Path, default=None,
        help="YAML config file (optional with --resume RUN_DIR: the run's saved config is used)",
    )  # fmt: skip
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config value (repeatable); VALUE is parsed as YAML",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module of your own before the config is validated (repeatable), so the "
        "losses, estimators or rewards it registers can be named in the config",
    )
    parser.add_argument("--output-dir", type=Path, default=None, help="run directory to use")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="auto|PATH",
        help="continue a run: its newest valid checkpoint (auto: of --output-dir, or of the newest "
        "run of this config's name) or a given run/checkpoint directory, with the run's own config",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="if --output-dir already holds a run, move it aside (to <dir>.replaced-<time>) and "
        "start fresh; without this flag such a directory is refused",
    )
    parser.add_argument(
        "--model-index",
        type=int,
        default=None,
        metavar="N",
        help="configs with a 'models:' list: train only entry N (0-based), e.g. one per job",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and resolve the config, load the tokenizer, print the plan; train nothing",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a user error too"
    )
    return parser


def saved_run_config(resume: str | None, output_dir: Path | None) -> Path | None:
    """The `config.yaml` of the run a `--resume` names, if it can be known from the command line
    alone (`--resume RUN_DIR|CHECKPOINT_DIR`, or `--resume auto --output-dir RUN_DIR`)."""
    if resume is None:
        return None
    if resume == "auto":
        run_dir = output_dir
    else:
        path = Path(resume)
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path
    if run_dir is None or not (Path(run_dir) / "config.yaml").is_file():
        return None
    return Path(run_dir) / "config.yaml"


def _differences(old: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{key}" if path else str(key)
            out += _differences(old.get(key), new.get(key), sub)
        return out
    return [] if old == new else [(path, old, new)]


def check_resume_changes(saved: Path, cfg: BaseModel) -> None:
    """Refuse a resume whose config differs from the run's saved one in anything outside
    `SAFE_ON_RESUME` (data, batch, model, loss...), naming each difference."""
    old = read_yaml(saved)
    new = yaml.safe_load(dump_config(cfg))
    unsafe = [
        (key, a, b) for key, a, b in _differences(old, new)
        if not any(key == p or key.startswith(p + ".") for p in SAFE_ON_RESUME)
    ]  # fmt: skip
    if unsafe:
        listed = "; ".join(f"{key}: {a!r} -> {b!r}" for key, a, b in unsafe[:8])
        more = f" (and {len(unsafe) - 8} more)" if len(unsafe) > 8 else ""
        raise ConfigError(
            f"--resume: these settings differ from the run's saved config {saved} and would "
            f"change what the run means: {listed}{more}. Resume without changing them (only "
            f"{', '.join(SAFE_ON_RESUME)} may change), or start a new run in another --output-dir"
        )


def parse_run_args(
    argv: list[str] | None, cls: type[C], *, prog: str, description: str = ""
) -> tuple[C, RunArgs]:
    """Parse the common trainer command line and load the config it names (on `--resume
    RUN_DIR` without `--config`, the run's own saved config, with any `--set` on top)."""
    args = build_arg_parser(prog, description).parse_args(argv)
    saved = saved_run_config(args.resume, args.output_dir)
    config_path = args.config or saved
    if config_path is None:
        raise ConfigError(
            "--config FILE is required (or --resume RUN_DIR to continue a run with its saved "
            "config)"
            + (f"; {args.resume} holds no config.yaml" if args.resume not in (None, "auto") else "")
        )
    run = RunArgs(
        config_path=config_path,
        overrides=list(args.overrides),
        output_dir=args.output_dir,
        resume=args.resume,
        dry_run=args.dry_run,
        overwrite=args.overwrite,
        model_index=args.model_index,
    )
    if args.overwrite and args.resume is not None:
        raise ConfigError("--overwrite starts a new run; it cannot be combined with --resume")
    if run.model_index is not None and "models" not in cls.model_fields:
        raise ConfigError(f"--model-index: {prog} has no 'models:' list to index")
    cfg = load_config(cls, run.config_path, run.overrides, args.imports)
    if saved is not None:
        check_resume_changes(saved, cfg)
    return cfg, run


# ----------------------------------------------------------------------------- error messages


def _unwrap(annotation: Any) -> list[Any]:
    """The concrete types inside Optional/Union/Annotated/list annotations."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        out: list[Any] = []
        for arg in typing.get_args(annotation):
            out.extend(_unwrap(arg))
        return out
    return [annotation]


def _type_name(annotation: Any) -> str:
    names = []
    for t in _unwrap(annotation):
        if t is type(None):
            names.append("null")
        elif isinstance(t, type):
            names.append(t.__name__)
        else:
            names.append(str(t).replace("typing.", ""))
    return " | ".join(names)


def _item_type(annotation: Any) -> Any:
    """The item type of a list[X] (or value type of a dict[K, X]) annotation, else None."""
    for t in _unwrap(annotation):
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin is list and args:
            return args[0]
        if origin is dict and len(args) == 2:
            return args[1]
    return None


def _model_at(
    cls: type[BaseModel], loc: tuple[Any, ...]
) -> tuple[type[BaseModel] | None, Any, tuple[Any, ...]]:
    """Walk `loc` from `cls`; return (model that owns the last key, that key's annotation, the
    key path as the user wrote it, i.e. `loc` without discriminated-union tags)."""
    model: type[BaseModel] | None = cls
    annotation: Any = None
    skip_tag = False
    in_container = False  # this part is a list index or dict key, not a field name
    keys: list[Any] = []
    for i, part in enumerate(loc):
        if skip_tag:  # a discriminated union puts the member's tag in the path: skip it
            skip_tag = False
            continue
        keys.append(part)
        rest = tuple(keys) + tuple(loc[i + 1 :])
        if in_container:
            annotation = _item_type(annotation)
        else:
            info = model.model_fields.get(str(part)) if model is not None else None
            if info is None:
                return (model if i == len(loc) - 1 else None), None, rest
            annotation = info.annotation
        if i == len(loc) - 1:
            return model, annotation, tuple(keys)
        model, skip_tag, in_container = _descend(annotation, loc[i + 1])
        if model is None and not in_container:
            return None, None, rest
    return model, annotation, tuple(keys)


def _descend(annotation: Any, next_part: Any) -> tuple[type[BaseModel] | None, bool, bool]:
    """What the part after a key of type `annotation` is: (the model whose field it names, whether
    it is a discriminated-union tag to skip, whether it is a list index / dict key)."""
    direct = [t for t in _unwrap(annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    if _item_type(annotation) is not None and (isinstance(next_part, int) or not direct):
        return None, False, True
    tagged = [t for t in direct if _has_tag(t, next_part)]
    if len(direct) > 1 and tagged:
        return tagged[0], True, False
    return (direct[0] if len(direct) == 1 else None), False, False


def _has_tag(model: type[BaseModel], tag: Any) -> bool:
    for info in model.model_fields.values():
        if typing.get_origin(info.annotation) is typing.Literal and tag in typing.get_args(
            info.annotation
        ):
            return True
    return False


def _describe_error(cls: type[BaseModel], err: dict[str, Any]) -> str:
    loc = tuple(err.get("loc", ()))
    owner, annotation, keys = _model_at(cls, loc)
    path = ".".join(str(p) for p in keys) or "<top level>"
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        allowed = ", ".join(owner.model_fields) if owner is not None else "?"
        return f"unknown key '{path}'; allowed keys here: {allowed}"
    if kind == "missing":
        return f"missing required key '{path}'"
    if kind == "value_error":  # a validator's own message already says what was expected
        return f"field '{path}': {err.get('msg', '').removeprefix('Value error, ')}"
    expected = f"expected {_type_name(annotation)}" if annotation is not None else "invalid value"
    given = err.get("input")
    given_repr = f"{given!r} ({type(given).__name__})"
    return f"field '{path}': {expected}, got {given_repr}: {err.get('msg', '')}"
