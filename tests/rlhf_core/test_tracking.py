"""Run directories and metric logs (rlhf_core.tracking): config.yaml, metrics.jsonl, curves.png,
summary.json, resume truncation, and wandb in offline mode (run dirs and `--resume`:
test_rundir.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import Field

from rlhf_core.config import StrictModel
from rlhf_core.tracking import Tracker, TrackingConfig, metric_family

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class RunConfig(StrictModel):
    name: str = Field("demo", description="run name")
    lr: float = Field(3e-4, description="learning rate")
    tags: list[str] = Field(default_factory=lambda: ["a", "b"], description="tags")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="tracking")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def make_tracker(run_dir: Path, *, plot_every: int = 100, **kwargs) -> Tracker:
    tracking = TrackingConfig(log_every=1, plot_every=plot_every)
    cfg = RunConfig(tracking=tracking)
    return Tracker(run_dir, cfg, tracking, total_steps=10, **kwargs)


# ----------------------------------------------------------------------------- Tracker files


def test_config_yaml_round_trips(tmp_path):
    cfg = RunConfig(name="x", lr=1e-3, tags=["t"])
    Tracker(tmp_path / "run", cfg, cfg.tracking, total_steps=1)
    loaded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert loaded == cfg.model_dump(mode="json")
    assert RunConfig.model_validate(loaded) == cfg


def test_metrics_jsonl_lines(tmp_path, capsys):
    tracker = make_tracker(tmp_path)
    tracker.log(1, {"train/loss": 2.5, "train/lr": 1e-3})
    tracker.log(2, {"train/loss": float("nan"), "eval/loss": 1.5}, show=False)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/loss"] == 2.5 and rows[0]["train/lr"] == 1e-3
    assert rows[1]["train/loss"] is None  # non-finite values are logged as null, not NaN
    assert rows[1]["eval/loss"] == 1.5
    assert all(r["elapsed_s"] >= 0 for r in rows)
    err = capsys.readouterr().err
    assert "[1/10" in err and "train/loss 2.5" in err
    assert "[2/10" not in err  # show=False prints nothing


def test_curves_png_is_written_and_redrawn(tmp_path):
    tracker = make_tracker(tmp_path, plot_every=2)
    png = tmp_path / "curves.png"
    tracker.log(1, {"train/loss": 3.0}, show=False)
    assert not png.exists()  # drawn every plot_every lines
    tracker.log(2, {"train/loss": 2.0, "eval/loss": 2.5}, show=False)
    first = png.read_bytes()
    assert first.startswith(PNG_SIGNATURE)
    tracker.log(3, {"train/loss": 1.0, "train/reward": 0.5}, show=False)
    tracker.log(4, {"train/loss": 0.5}, show=False)
    second = png.read_bytes()
    assert second.startswith(PNG_SIGNATURE) and second != first

    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert not list(tmp_path.glob(".*.tmp"))


def test_plot_every_0_draws_no_curves_and_keeps_every_metric(tmp_path):
    tracker = make_tracker(tmp_path, plot_every=0)
    for step in range(1, 4):
        tracker.log(step, {"train/loss": 1.0 / step}, show=False)
    tracker.plot()  # what a stop signal calls
    summary = tracker.finish({"steps": 3})
    assert not (tmp_path / "curves.png").exists() and not list(tmp_path.glob(".*.tmp"))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in rows] == [1.0, 0.5, 1.0 / 3]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == summary["steps"] == 3


def test_a_panel_of_one_line_has_its_label_in_the_title_and_no_legend(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from rlhf_core.tracking import plot_panels

    drawn = {"set_title": [], "legend": []}
    for method in drawn:
        real = getattr(Axes, method)

        def spy(self, *args, _real=real, _name=method, **kwargs):  # the real call, recorded
            drawn[_name].append(args)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Axes, method, spy)
    panels = {
        "loss": {"eval/loss": ([2], [2.5]), "train/loss": ([1, 2], [3.0, 2.0])},
        "loss/kl": {"train/loss/kl": ([1, 2], [0.0, 0.1])},  # a trainer's panel of one key
        "eval/loss": {"run-a": ([1], [1.0])},  # `runs compare`: one run has the key
    }
    plot_panels(panels, tmp_path / "curves.png")
    assert [args[0] for args in drawn["set_title"]] == [
        "loss", "train/loss/kl", "eval/loss (run-a)",
    ]  # fmt: skip
    assert len(drawn["legend"]) == 1  # the panel of two lines only
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)


def test_finish_writes_summary_with_wall_time(tmp_path):
    tracker = make_tracker(tmp_path)
    tracker.log(1, {"train/loss": 1.0}, show=False)
    summary = tracker.finish({"final/loss": 0.25, "steps": 1})
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    assert on_disk["final/loss"] == 0.25 and on_disk["steps"] == 1
    assert isinstance(on_disk["wall_time_s"], float) and on_disk["wall_time_s"] >= 0
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_SIGNATURE)


def test_resume_truncates_metrics_to_resume_step(tmp_path):
    tracker = make_tracker(tmp_path)
    for step in range(1, 6):
        tracker.log(step, {"train/loss": float(step)}, show=False)
    resumed = make_tracker(tmp_path, resume_step=3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert [r["step"] for r in resumed.history] == [1, 2, 3]
    resumed.log(4, {"train/loss": 40.0}, show=False)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["train/loss"] == 40.0


def test_fresh_tracker_starts_an_empty_log(tmp_path):
    make_tracker(tmp_path).log(1, {"train/loss": 1.0}, show=False)
    make_tracker(tmp_path)  # no resume_step: a new run in the same dir
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_disabled_tracker_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    tracker = make_tracker(run_dir, plot_every=1, enabled=False)
    tracker.log(1, {"train/loss": 1.0})
    tracker.plot()
    summary = tracker.finish({"final/loss": 1.0})
    assert summary == {"final/loss": 1.0}
    assert not run_dir.exists()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("key", "family"),
    [
        ("train/loss", "loss"),
        ("eval/loss", "loss"),
        ("lr", "lr"),
        ("train/reward/mean", "reward/mean"),
    ],
)
def test_metric_family(key, family):
    assert metric_family(key) == family


# ----------------------------------------------------------------------------- wandb


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    tracking = TrackingConfig(
        log_every=1, plot_every=100, backends=["wandb"], wandb={"tags": ["t"]}
    )
    cfg = RunConfig(tracking=tracking)
    run_dir = tmp_path / "demo-20240101-000000"
    tracker = Tracker(run_dir, cfg, tracking, total_steps=2)
    tracker.log(1, {"train/loss": 1.0}, show=False)
    tracker.log(2, {"train/loss": 0.5}, show=False)
    tracker.finish({"final/loss": 0.5})
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    assert runs[0].name.endswith(run_dir.name)  # the run id is the run dir's name
    assert list(runs[0].glob("run-*.wandb"))
    assert (run_dir / "metrics.jsonl").is_file()
