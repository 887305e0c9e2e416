"""Run directories, metric logs, curves, summaries, a progress display, optional trackers.

A run dir (`outputs/<package>/<name>-<YYYYmmdd-HHMMSS>/`, or `--output-dir`) holds

    config.yaml      the resolved config, exactly as validated
    metrics.jsonl    one JSON object per logged step: {"step": 10, "train/loss": 1.2, ...}
    curves.png       one panel per metric family ("train/loss" and "eval/loss" share "loss")
    summary.json     final figures and wall time
    checkpoints/     see rlhf_core.checkpoint

    tensorboard/     event files, with `tracking.backends: [tensorboard]`

Only the main process writes (pass `enabled=False` elsewhere). `tracking.backends` adds
experiment trackers, each optional and imported only when listed (`uv sync --extra tracking`):
wandb (`WANDB_MODE`, e.g. offline, is honoured), tensorboard (`tensorboard --logdir RUN_DIR`)
and trackio (a local dashboard, `trackio show --project rlhf-lab`; `TRACKIO_DIR` is honoured).
None is ever required to train: metrics.jsonl always holds everything.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from rlhf_core.config import StrictModel, dump_config
from rlhf_core.errors import UserError

Backend = Literal["wandb", "tensorboard", "trackio"]


class WandbConfig(StrictModel):
    project: str = Field("rlhf-lab", description="wandb project")
    entity: str | None = Field(None, description="wandb entity (team or user)")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="wandb mode; null = honour WANDB_MODE"
    )
    tags: list[str] = Field(default_factory=list, description="wandb tags")


class TrackingConfig(StrictModel):
    log_every: int = Field(10, ge=1, description="log training metrics every k optimizer steps")
    plot_every: int = Field(
        10,
        ge=0,
        description="redraw curves.png every k metric lines (and at the end); 0 = no curves.png: "
        "metrics.jsonl holds the same numbers, and `rlhf-lab runs compare` draws them later",
    )
    backends: list[Backend] = Field(
        default_factory=list,
        description="experiment trackers besides metrics.jsonl: wandb, tensorboard (event files "
        "in <run_dir>/tensorboard), trackio (local dashboard); each optional, imported only here",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="wandb settings")
    trackio_project: str = Field("rlhf-lab", description="trackio project (runs by run dir name)")


def timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def metric_family(key: str) -> str:
    """'train/loss' and 'eval/loss' -> 'loss'; a key without '/' is its own family."""
    return key.split("/", 1)[1] if "/" in key else key


class Tracker:
    """Writes metrics.jsonl / curves.png / summary.json and shows progress; wandb if enabled."""

    def __init__(
        self,
        run_dir: Path,
        cfg: BaseModel,
        tracking: TrackingConfig,
        *,
        total_steps: int,
        resume_step: int | None = None,
        keep_rows: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.tracking = tracking
        self.total_steps = total_steps
        self.enabled = enabled
        self.start_time = time.time()
        self.history: list[dict[str, Any]] = []
        self._lines_since_plot = 0
        self._backends: list[Any] = []
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._load_history(resume_step, keep_rows)
        config = cfg.model_dump(mode="json")
        for name in dict.fromkeys(tracking.backends):  # each once, in the order given
            self._backends.append(BACKENDS[name](self.run_dir, config, tracking, resume_step))

    def _load_history(self, resume_step: int | None, keep_rows: int | None) -> None:
        """On resume keep the lines up to the checkpoint's step, and of those the first
        `keep_rows` (how many it had when the checkpoint was written; None: a checkpoint from
        before that count); later ones are redone. Rewritten atomically."""
        if resume_step is None or not self.metrics_path.is_file():
            self.metrics_path.write_text("")
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("step", 0) <= resume_step:
                    kept.append(row)
        self.history = kept[:keep_rows]
        tmp = self.metrics_path.with_name(f".{self.metrics_path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        os.replace(tmp, self.metrics_path)

    def log(self, step: int, metrics: dict[str, float], *, show: bool = True) -> None:
        """Append one metrics line for `step` and print a short progress line."""
        if not self.enabled:
            return
        row = {"step": step, "elapsed_s": round(time.time() - self.start_time, 3)}
        row.update({k: _finite_or_none(float(v)) for k, v in metrics.items()})
        self.history.append(row)
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        numbers = {k: v for k, v in row.items() if k != "step" and _is_number(v)}
        for backend in self._backends:
            backend.log(numbers, step)
        if show:
            shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if _is_number(v))
            pct = 100.0 * step / max(1, self.total_steps)
            print(f"[{step}/{self.total_steps} {pct:3.0f}%] {shown}", file=sys.stderr, flush=True)
        self._lines_since_plot += 1
        if self._lines_since_plot >= self.tracking.plot_every:  # plot() draws none with 0
            self.plot()

    def plot(self) -> None:
        """Redraw curves.png: one panel per metric family, x = step (not with plot_every 0)."""
        if not self.enabled or not self.history or not self.tracking.plot_every:
            return
        self._lines_since_plot = 0
        series: dict[str, dict[str, tuple[list[int], list[float]]]] = defaultdict(dict)
        for row in self.history:
            for key, value in row.items():
                if key in ("step", "elapsed_s") or not _is_number(value):
                    continue
                xs, ys = series[metric_family(key)].setdefault(key, ([], []))
                xs.append(row["step"])
                ys.append(value)
        panels = {family: dict(sorted(series[family].items())) for family in sorted(series)}
        plot_panels(panels, self.run_dir / "curves.png")

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write summary.json (adds wall time), redraw the curves, close the trackers."""
        if not self.enabled:
            return summary
        summary = {**summary, "wall_time_s": round(time.time() - self.start_time, 2)}
        tmp = self.run_dir / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        os.replace(tmp, self.run_dir / "summary.json")
        self.plot()
        for backend in self._backends:
            backend.finish({k: v for k, v in summary.items() if _is_number(v)})
        return summary


# ----------------------------------------------------------------------------- trackers


def plot_panels(
    panels: dict[str, dict[str, tuple[list[int], list[float]]]],
    png: Path,
    *,
    panel_size: tuple[float, float] = (4.5, 3.2),
    legend_fontsize: int = 7,
) -> None:
    """Curves against the step into the PNG `png` (written atomically): one panel per title of
    `panels`, one line per label in it ({title: {label: (steps, values)}}); three panels a row.
    A panel of one line has no legend: its label is in the title ("train/loss/kl" for the panel
    "loss/kl"; "eval/loss (run-a)" for the panel "eval/loss" with one line "run-a").

    Drawn on a bare matplotlib Figure with fixed margins, without `tight_layout`: every trainer
    draws it in its main loop, and the previous drawing cost more than a short run's training
    (`python -m benchmarks.plot`; figures in docs/performance.md)."""
    if not panels:
        return
    from matplotlib.figure import Figure

    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    width, height = panel_size[0] * cols, panel_size[1] * rows
    fig = Figure(figsize=(width, height))
    # margins in inches: tick labels on the left, the x label below, a title above each row
    fig.subplots_adjust(left=0.6 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                        top=1 - 0.3 / height, wspace=0.3, hspace=0.45)  # fmt: skip
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items(), strict=False):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
        if len(lines) == 1:  # its label in the title, no legend
            (label,) = lines
            ax.set_title(label if title in label else f"{title} ({label})")
        else:
            ax.set_title(title)
            ax.legend(fontsize=legend_fontsize)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(f".{png.name}.tmp")
    fig.savefig(tmp, dpi=90, format="png")
    os.replace(tmp, png)


def _import(backend: str, module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UserError(
            f"tracking.backends: {backend!r} needs the {exc.name} package (uv sync --extra "
            f"tracking, or pip install {exc.name}); or remove it from tracking.backends"
        ) from None


class WandbBackend:
    def __init__(self, run_dir: Path, config: dict, tracking: TrackingConfig, resume_step) -> None:
        wandb = _import("wandb", "wandb")
        w = tracking.wandb
        self.run = wandb.init(
            project=w.project, entity=w.entity, name=run_dir.name, dir=str(run_dir),
            config=config, tags=w.tags, mode=w.mode or os.environ.get("WANDB_MODE"),
            resume="allow", id=run_dir.name,
        )  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, float]) -> None:
        self.run.summary.update(summary)
        self.run.finish()


class TensorBoardBackend:
    """Scalars to `<run_dir>/tensorboard`; on resume, events after the checkpoint are purged."""

    def __init__(self, run_dir: Path, config: dict, tracking: TrackingConfig, resume_step) -> None:
        _import("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        if resume_step is None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, summary: dict[str, float]) -> None:
        for key, value in summary.items():
            self.writer.add_scalar(f"summary/{key}", value, 0)
        self.writer.close()


class TrackioBackend:
    """A local trackio run named after the run dir (`TRACKIO_DIR` is honoured); resumed runs
    continue it."""

    def __init__(self, run_dir: Path, config: dict, tracking: TrackingConfig, resume_step) -> None:
        self.trackio = _import("trackio", "trackio")
        self.trackio.init(
            project=tracking.trackio_project, name=run_dir.name, config=config,
            resume="allow" if resume_step is not None else "never", embed=False,
            auto_log_cpu=False, auto_log_gpu=False,
        )  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log(metrics, step=step)

    def finish(self, summary: dict[str, float]) -> None:
        self.trackio.finish()


BACKENDS: dict[str, type] = {
    "wandb": WandbBackend,
    "tensorboard": TensorBoardBackend,
    "trackio": TrackioBackend,
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
