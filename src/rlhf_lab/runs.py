"""`rlhf-lab runs`: list, inspect, compare, prune, snapshot and delete run directories.

    rlhf-lab runs list     [--root outputs]
    rlhf-lab runs show     RUN
    rlhf-lab runs compare  RUN RUN [...] [--metric KEY ...] [--png FILE]
    rlhf-lab runs prune    RUN --keep N [--by last|METRIC] [--mode min|max] [--yes]
    rlhf-lab runs snapshot RUN NAME [--checkpoint final|checkpoint-N|latest] [--overwrite]
    rlhf-lab runs delete   RUN [RUN ...] [--yes]

A *run* is any directory under the root holding `config.yaml` or `status.json` (what every trainer,
`compare` and `quickstart` write, see `rlhf_core.tracking`). RUN is a path, or a path relative to
the root (`instruction_tuning/sft-20261123-101500`).

Status is read from the run-dir protocol and checked, never taken on trust:

- `status.json` says finished / interrupted / failed: that is the status.
- `status.json` says running: the run is running only while `.lock` (or status.json) names a live
  process on this host; a run killed by SIGKILL leaves "running" behind with a dead pid, and is
  reported as interrupted. A lock held on another host is reported as running (we cannot check).
- no `status.json` (runs from before the protocol): `summary.json` = finished; checkpoints or a
  metrics log without a summary = interrupted. A killed run never wrote its summary, so it is never
  reported finished.

What it leaves out: remote runs (wandb), and any notion of "best" other than a logged metric.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from rlhf_core.checkpoint import CHECKPOINT_RE, list_checkpoints
from rlhf_core.errors import UserError, run_main
from rlhf_core.output_dir import claim_output_path
from rlhf_core.rundir import run_status as rundir_status
from rlhf_core.tracking import plot_panels

PACKAGES = ("instruction_tuning", "reward_models", "policy_gradients", "direct_alignment")
# directories inside a run that are never runs themselves
NOT_RUNS = {"checkpoints", "final", "rollouts", "samples", "wandb", "value"}
# summary keys worth a column in `list`: held-out accuracies first, then losses
KEY_METRICS = re.compile(r"^eval/.*(exact_match|_exact|accuracy)$|^eval/loss$|^final_train_loss$")


@dataclass
class Run:
    path: Path
    name: str
    package: str
    algorithm: str
    status: str
    step: int | None
    metrics: dict[str, float] = field(default_factory=dict)
    size_bytes: int = 0
    why: str = ""  # how the status was decided


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_status(run_dir: Path) -> tuple[str, str]:
    """(status, reason) of one run dir, read by `rlhf_core.rundir.run_status` (the protocol's
    owner): status.json, a dead lock's "running" read as interrupted, older runs inferred."""
    from rlhf_core.rundir import read_lock

    status = rundir_status(run_dir)
    said = status.get("status", "?")
    if status.get("inferred"):
        return said, "inferred from the files (no status.json)"
    if status.get("killed"):
        return said, f"status.json says running but its process (pid {status.get('pid')}) is gone"
    if said == "running":
        holder = read_lock(run_dir) or {}
        return said, f"pid {holder.get('pid')} on {holder.get('host')} holds .lock"
    code = status.get("exit_code")
    return said, "status.json" + (f" (exit code {code})" if code is not None else "")


def _package_and_algorithm(run_dir: Path, root: Path) -> tuple[str, str]:
    cfg = {}
    if (run_dir / "config.yaml").is_file():
        try:
            cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        except yaml.YAMLError:
            cfg = {}
    try:
        parts = run_dir.resolve().relative_to(root.resolve()).parts if root else ()
    except ValueError:  # a run given by a path outside --root: its own path's folder names
        parts = run_dir.resolve().parts
    package = next((p for p in parts if p in PACKAGES), "")
    if not package:
        if "algorithm" in cfg:
            package = "policy_gradients"
        elif "freeze_backbone" in cfg:
            package = "reward_models"
        elif "reference" in cfg and isinstance(cfg.get("loss"), dict):
            package = "direct_alignment"
        elif cfg:
            package = "instruction_tuning"
        elif (run_dir / "report.md").is_file():
            package = "rlhf_lab"
    if package == "policy_gradients":
        algorithm = str((cfg.get("algorithm") or {}).get("name", ""))
    elif package in ("reward_models", "direct_alignment"):
        algorithm = str((cfg.get("loss") or {}).get("name", ""))
    elif package == "instruction_tuning":
        algorithm = str((cfg.get("train") or {}).get("loss", "nll"))
        algorithm = "sft" if algorithm == "nll" else f"sft-{algorithm}"
    else:
        algorithm = "quickstart" if (run_dir / "report.md").is_file() else ""
    return package or "?", algorithm


def dir_size(path: Path) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return rows


def _last_step(run_dir: Path, status: dict[str, Any] | None, summary: dict[str, Any]) -> int | None:
    """The furthest step the run reached: status.json, the summary, the metrics log and the
    checkpoints may each lag (a killed run's status.json keeps the step it started at)."""
    found = [r["step"] for r in read_metrics(run_dir) if isinstance(r.get("step"), int)]
    found += [int(CHECKPOINT_RE.match(c.name).group(1))
              for c in list_checkpoints(run_dir / "checkpoints")]  # fmt: skip
    for value in ((status or {}).get("step"), summary.get("steps")):
        if isinstance(value, int):
            found.append(value)
    return max(found) if found else None


def load_run(run_dir: Path, root: Path) -> Run:
    status, why = run_status(run_dir)
    summary = _read_json(run_dir / "summary.json") or {}
    package, algorithm = _package_and_algorithm(run_dir, root)
    numbers = {
        k: v for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    if not numbers:  # no summary: the last logged value of each metric
        for row in read_metrics(run_dir):
            numbers.update({k: v for k, v in row.items() if isinstance(v, int | float)})
    try:
        name = str(run_dir.resolve().relative_to(root.resolve()))
    except ValueError:
        name = str(run_dir)
    return Run(
        path=run_dir, name=name, package=package, algorithm=algorithm, status=status,
        step=_last_step(run_dir, _read_json(run_dir / "status.json"), summary),
        metrics=numbers, size_bytes=dir_size(run_dir), why=why,
    )  # fmt: skip


def find_runs(root: Path) -> list[Path]:
    """Every run dir under `root` (a quickstart dir and its stage dirs are all runs)."""
    found = []
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in NOT_RUNS and not d.startswith("."))
        if "config.yaml" in files or "status.json" in files:
            found.append(Path(base))
    return found


def resolve_run(spec: str, root: Path) -> Path:
    for candidate in (Path(spec), root / spec):
        if candidate.is_dir() and (
            (candidate / "config.yaml").is_file() or (candidate / "status.json").is_file()
        ):
            return candidate
    raise UserError(
        f"runs: {spec!r} is not a run directory (no config.yaml or status.json there or under "
        f"{root}); `rlhf-lab runs list --root {root}` lists them"
    )


def human_size(n: int) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def _key_metrics(run: Run, limit: int = 3) -> str:
    shown = [f"{k}={v:.4g}" for k, v in run.metrics.items() if KEY_METRICS.match(k)]
    return "  ".join(shown[:limit])


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- commands


def cmd_list(root: Path) -> int:
    runs = [load_run(p, root) for p in find_runs(root)]
    if not runs:
        print(f"no runs under {root}")
        return 0
    rows = [["run", "package", "algorithm", "status", "steps", "size", "final metrics"]]
    for r in runs:
        steps = "" if r.step is None else str(r.step)
        rows.append([r.name, r.package, r.algorithm, r.status, steps, human_size(r.size_bytes),
                     _key_metrics(r)])  # fmt: skip
    print(table(rows))
    return 0


def cmd_show(run_dir: Path, root: Path) -> int:
    run = load_run(run_dir, root)
    print(f"run:       {run.path}\npackage:   {run.package}\nalgorithm: {run.algorithm}")
    print(f"status:    {run.status} ({run.why})\nsteps:     {run.step}")
    print(f"size:      {human_size(run.size_bytes)}")
    print("checkpoints:")
    for ckpt in list_checkpoints(run_dir / "checkpoints"):
        print(f"  {ckpt.name}  {human_size(dir_size(ckpt))}")
    if (run_dir / "final").is_dir():
        print(f"  final  {human_size(dir_size(run_dir / 'final'))}")
    summary = _read_json(run_dir / "summary.json")
    print("summary:" + ("" if summary else " (none)"))
    for k, v in (summary or {}).items():
        print(f"  {k}: {v}")
    if (run_dir / "config.yaml").is_file():
        print("config:\n  " + (run_dir / "config.yaml").read_text().rstrip().replace("\n", "\n  "))
    return 0


def cmd_compare(run_dirs: list[Path], root: Path, metrics: list[str], png: Path) -> int:
    runs = [load_run(p, root) for p in run_dirs]
    keys = metrics or sorted({k for r in runs for k in r.metrics if KEY_METRICS.match(k)})
    rows = [["run", "status", "steps", *keys]]
    for r in runs:
        rows.append([r.name, r.status, str(r.step), *(
            f"{r.metrics[k]:.4g}" if k in r.metrics else "-" for k in keys)])  # fmt: skip
    print(table(rows))
    histories = {r.name: read_metrics(r.path) for r in runs}
    curve_keys = metrics or sorted({
        k for rows_ in histories.values() for row in rows_ for k, v in row.items()
        if k not in ("step", "elapsed_s") and isinstance(v, int | float)
    })  # fmt: skip
    # only curves that at least two runs share, unless asked for by name
    if not metrics and len(runs) > 1:
        shared = lambda k: sum(any(k in row for row in h) for h in histories.values()) > 1  # noqa: E731
        curve_keys = [k for k in curve_keys if shared(k)]
    if curve_keys:
        plot_overlaid(histories, curve_keys, png)
        print(f"curves: {png}")
    return 0


def plot_overlaid(histories: dict[str, list[dict[str, Any]]], keys: list[str], png: Path) -> None:
    """One panel per metric key, one line per run."""
    panels: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for key in keys:
        panels[key] = {}
        for name, rows in histories.items():
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            if pts:
                xs, ys = zip(*pts, strict=True)
                panels[key][name] = (list(xs), list(ys))
    plot_panels(panels, png, panel_size=(4.8, 3.3), legend_fontsize=6)


def confirm(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UserError(f"{question} needs confirmation: pass --yes (stdin is not a terminal)")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def _refuse_running(run: Run, what: str) -> None:
    if run.status == "running":
        raise UserError(f"runs {what}: {run.name} is running ({run.why}); stop it first")


def cmd_prune(run_dir: Path, root: Path, keep: int, by: str, mode: str, yes: bool) -> int:
    run = load_run(run_dir, root)
    _refuse_running(run, "prune")
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if by == "last":
        kept = ckpts[-keep:] if keep else []
    else:
        at_step = {
            r["step"]: r[by] for r in read_metrics(run_dir) if isinstance(r.get(by), int | float)
        }
        scored = []
        for c in ckpts:
            step = int(CHECKPOINT_RE.match(c.name).group(1))
            if step not in at_step:
                raise UserError(f"runs prune --by {by}: {c.name} has no {by!r} logged at step "
                                f"{step} in {run_dir / 'metrics.jsonl'}")  # fmt: skip
            scored.append((at_step[step], c))
        scored.sort(key=lambda sc: sc[0], reverse=(mode == "max"))
        kept = [c for _, c in scored[:keep]]
    removed = [c for c in ckpts if c not in kept]
    if not removed:
        print(f"nothing to prune: {len(ckpts)} checkpoint(s), keeping {keep}")
        return 0
    print(f"keep:   {', '.join(c.name for c in kept) or '-'}")
    print(f"remove: {', '.join(c.name for c in removed)}")
    if not confirm(f"remove {len(removed)} checkpoint(s) of {run.name}?", yes):
        print("nothing removed")
        return 1
    for c in removed:
        shutil.rmtree(c)
    return 0


def cmd_snapshot(
    run_dir: Path, root: Path, name: str, checkpoint: str, overwrite: bool = False
) -> int:
    if checkpoint == "latest":
        ckpts = list_checkpoints(run_dir / "checkpoints")
        source = (
            run_dir / "final" if (run_dir / "final").is_dir() else (ckpts[-1] if ckpts else None)
        )
    elif checkpoint == "final":
        source = run_dir / "final"
    else:
        source = run_dir / "checkpoints" / checkpoint
    if source is None or not source.is_dir():
        raise UserError(f"runs snapshot: no checkpoint {checkpoint!r} in {run_dir}")
    dest = Path(name) if ("/" in name or name.startswith(".")) else root / "snapshots" / name
    claim_output_path(dest, overwrite=overwrite, command="runs snapshot")  # old one moved aside
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("trainer_state.pt"),
                    dirs_exist_ok=True)  # fmt: skip
    for extra in ("config.yaml", "summary.json"):
        if (run_dir / extra).is_file():
            shutil.copy2(run_dir / extra, dest / f"run_{extra}")
    (dest / "snapshot.json").write_text(json.dumps({
        "source": str(source.resolve()), "run": str(run_dir.resolve()),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }, indent=2) + "\n")  # fmt: skip
    print(f"snapshot: {source} -> {dest}")
    return 0


def cmd_delete(run_dirs: list[Path], root: Path, yes: bool) -> int:
    runs = [load_run(p, root) for p in run_dirs]
    for r in runs:
        _refuse_running(r, "delete")
    total = sum(r.size_bytes for r in runs)
    for r in runs:
        print(f"delete {r.path} ({r.status}, {human_size(r.size_bytes)})")
    if not confirm(f"delete {len(runs)} run(s), {human_size(total)}?", yes):
        print("nothing deleted")
        return 1
    for r in runs:
        shutil.rmtree(r.path)
    return 0


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS,
                        help="where runs live (default outputs/)")  # fmt: skip
    parser = argparse.ArgumentParser(
        prog="rlhf-lab runs", description="manage run directories", parents=[common]
    )
    sub = parser.add_subparsers(dest="command")
    add = lambda name, text: sub.add_parser(name, help=text, parents=[common])  # noqa: E731
    add("list", "every run: package, algorithm, status, steps, metrics, size")
    p = add("show", "one run: status, checkpoints, summary, config")
    p.add_argument("run")
    p = add("compare", "a table and one PNG of overlaid curves")
    p.add_argument("runs", nargs="+")
    p.add_argument("--metric", action="append", default=[], help="metric key (repeatable)")
    p.add_argument("--png", type=Path, default=Path("runs_compare.png"), help="curves PNG path")
    p = add("prune", "delete all but N checkpoints (last, or best by a metric)")
    p.add_argument("run")
    p.add_argument("--keep", type=int, required=True, help="checkpoints to keep")
    p.add_argument("--by", default="last", help="'last' or a metric key in metrics.jsonl")
    p.add_argument("--mode", choices=["min", "max"], default="min", help="better = lower/higher")
    p.add_argument("--yes", action="store_true", help="do not ask")
    p = add("snapshot", "copy a checkpoint to <root>/snapshots/NAME (or a path)")
    p.add_argument("run")
    p.add_argument("name")
    p.add_argument("--checkpoint", default="latest", help="final, checkpoint-N or latest")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="move an existing NAME aside (NAME.old-<time>) and snapshot there",
    )
    p = add("delete", "delete run directories (asks first)")
    p.add_argument("runs", nargs="+")
    p.add_argument("--yes", action="store_true", help="do not ask")
    args = parser.parse_args(argv if argv else ["list"])
    root = getattr(args, "root", Path("outputs"))
    if args.command in (None, "list"):
        return cmd_list(root)
    if args.command == "show":
        return cmd_show(resolve_run(args.run, root), root)
    if args.command == "compare":
        return cmd_compare([resolve_run(r, root) for r in args.runs], root, args.metric, args.png)
    if args.command == "prune":
        if args.keep < 0:
            raise UserError("runs prune: --keep must be >= 0")
        run_dir = resolve_run(args.run, root)
        return cmd_prune(run_dir, root, args.keep, args.by, args.mode, args.yes)
    if args.command == "snapshot":
        return cmd_snapshot(resolve_run(args.run, root), root, args.name, args.checkpoint,
                            args.overwrite)  # fmt: skip
    return cmd_delete([resolve_run(r, root) for r in args.runs], root, args.yes)


if __name__ == "__main__":
    sys.exit(run_main(main))
