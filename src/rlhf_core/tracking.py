"""Run directories, metric logs, curves, summaries, a progress display and optional wandb.

A run dir (`outputs/<package>/<name>-<YYYYmmdd-HHMMSS>/`, or `--output-dir`) holds

    config.yaml      the resolved config, exactly as validated
    metrics.jsonl    one JSON object per logged step: {"step": 10, "train/loss": 1.2, ...}
    curves.png       one panel per metric family ("train/loss" and "eval/loss" share "loss")
    summary.json     final figures and wall time
    checkpoints/     see rlhf_core.checkpoint

Only the main process writes (pass `enabled=False` elsewhere). wandb is used only when the config
enables it; `WANDB_MODE` (e.g. offline) is honoured, and it is never required to train.
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


class WandbConfig(StrictModel):
    enabled: bool = Field(False, description="log to Weights & Biases")
    project: str = Field("rlhf-lab", description="wandb project")
    entity: str | None = Field(None, description="wandb entity (team or user)")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="wandb mode; null = honour WANDB_MODE"
    )
    tags: list[str] = Field(default_factory=list, description="wandb tags")


class TrackingConfig(StrictModel):
    log_every: int = Field(10, ge=1, description="log training metrics every k optimizer steps")
    plot_every: int = Field(10, ge=1, description="redraw curves.png every k metric lines")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="optional wandb logging")


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
        enabled: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.tracking = tracking
        self.total_steps = total_steps
        self.enabled = enabled
        self.start_time = time.time()
        self.history: list[dict[str, Any]] = []
        self._lines_since_plot = 0
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._load_history(resume_step)
        if tracking.wandb.enabled:
            import wandb

            self._wandb = wandb.init(
                project=tracking.wandb.project,
                entity=tracking.wandb.entity,
                name=self.run_dir.name,
                dir=str(self.run_dir),
                config=cfg.model_dump(mode="json"),
                tags=tracking.wandb.tags,
                mode=tracking.wandb.mode or os.environ.get("WANDB_MODE"),
                resume="allow",
                id=self.run_dir.name,
            )

    def _load_history(self, resume_step: int | None) -> None:
        """On resume keep the lines up to the checkpoint's step; later ones are redone."""
        if resume_step is None or not self.metrics_path.is_file():
            self.metrics_path.write_text("")
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("step", 0) <= resume_step:
                    kept.append(row)
        self.history = kept
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def log(self, step: int, metrics: dict[str, float], *, show: bool = True) -> None:
        """Append one metrics line for `step` and print a short progress line."""
        if not self.enabled:
            return
        row = {"step": step, "elapsed_s": round(time.time() - self.start_time, 3)}
        row.update({k: _finite_or_none(float(v)) for k, v in metrics.items()})
        self.history.append(row)
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if show:
            shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if _is_number(v))
            pct = 100.0 * step / max(1, self.total_steps)
            print(f"[{step}/{self.total_steps} {pct:3.0f}%] {shown}", file=sys.stderr, flush=True)
        self._lines_since_plot += 1
        if self._lines_since_plot >= self.tracking.plot_every:
            self.plot()

    def plot(self) -> None:
        """Redraw curves.png: one panel per metric family, x = step."""
        if not self.enabled or not self.history:
            return
        self._lines_since_plot = 0
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        series: dict[str, dict[str, tuple[list[int], list[float]]]] = defaultdict(dict)
        for row in self.history:
            for key, value in row.items():
                if key in ("step", "elapsed_s") or not _is_number(value):
                    continue
                xs, ys = series[metric_family(key)].setdefault(key, ([], []))
                xs.append(row["step"])
                ys.append(value)
        if not series:
            return
        families = sorted(series)
        cols = min(3, len(families))
        rows = math.ceil(len(families) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
        for ax, family in zip(axes.flat, families, strict=False):
            for key, (xs, ys) in sorted(series[family].items()):
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=key)
            ax.set_title(family)
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(families) :]:
            ax.axis("off")
        fig.tight_layout()
        tmp = self.run_dir / ".curves.png.tmp"
        fig.savefig(tmp, dpi=90, format="png")
        plt.close(fig)
        os.replace(tmp, self.run_dir / "curves.png")

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write summary.json (adds wall time), redraw the curves, close wandb."""
        if not self.enabled:
            return summary
        summary = {**summary, "wall_time_s": round(time.time() - self.start_time, 2)}
        tmp = self.run_dir / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        os.replace(tmp, self.run_dir / "summary.json")
        self.plot()
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in summary.items() if _is_number(v)})
            self._wandb.finish()
        return summary


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
