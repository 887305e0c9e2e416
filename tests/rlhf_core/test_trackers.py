"""`tracking.backends`: wandb, tensorboard and trackio each write the logged metrics offline (in a
fresh interpreter each, as trackio and wandb read their directories at import), and a tracker
whose package is missing is a one-line error naming the extra to install."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

SCRIPT = """
import json, sys
from pathlib import Path
from rlhf_core.config import StrictModel
from rlhf_core.tracking import Tracker, TrackingConfig

class Cfg(StrictModel):
    lr: float = 0.1

run_dir = Path(sys.argv[1])
tracking = TrackingConfig(backends=[sys.argv[2]], log_every=1)
tracker = Tracker(run_dir, Cfg(), tracking, total_steps=3)
for step in (1, 2, 3):
    tracker.log(step, {"train/loss": 1.0 / step, "eval/accuracy": 0.25 * step}, show=False)
tracker.finish({"final_loss": 0.333})
"""


def _run(backend: str, tmp_path, **env) -> None:
    run_dir = tmp_path / "run"
    script = tmp_path / "track.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(run_dir), backend],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO / "src"),
             **env},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_tensorboard_writes_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _run("tensorboard", tmp_path)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    loss = [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")]
    assert loss == [(1, 1.0), (2, 0.5), (3, 0.333333)]
    assert [e.value for e in events.Scalars("eval/accuracy")] == [0.25, 0.5, 0.75]


def test_trackio_writes_a_local_run(tmp_path):
    store = tmp_path / "trackio"
    _run("trackio", tmp_path, TRACKIO_DIR=str(store))
    read = textwrap.dedent("""
        import json
        from trackio.sqlite_storage import SQLiteStorage
        print(json.dumps(SQLiteStorage.get_logs("rlhf-lab", "run")))
    """)
    result = subprocess.run(
        [sys.executable, "-c", read], env={"TRACKIO_DIR": str(store), "HOME": str(tmp_path),
        "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    logs = json.loads(result.stdout.strip().splitlines()[-1])
    assert [(r["step"], r["train/loss"]) for r in logs] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]


def _wandb_records(path) -> list:
    """The protobuf records of an offline `.wandb` file: a 7-byte header, then a LevelDB-style
    log of 32 KiB blocks whose records have a (crc32, length, type) header, type 1 = a full
    record, 2/3/4 = its first/middle/last piece."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, piece, records = path.read_bytes(), 7, b"", []
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0:
            break
        piece += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pb.Record.FromString(piece))
            piece = b""
    return records


def test_wandb_offline_writes_history_and_summary(tmp_path):
    run_dir = _run("wandb", tmp_path, WANDB_MODE="offline", WANDB_SILENT="true")
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, summary = [], {}

    def items(entries) -> dict:
        return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in entries}

    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(items(record.history.item))
        elif kind == "summary":
            summary.update(items(record.summary.update))
    assert [(h["_step"], h["train/loss"]) for h in history] == [(1, 1), (2, 0.5), (3, 1 / 3)]
    assert summary["final_loss"] == 0.333


def test_missing_tracker_package_is_a_user_error(tmp_path, monkeypatch):
    from rlhf_core.config import StrictModel
    from rlhf_core.errors import UserError
    from rlhf_core.tracking import Tracker, TrackingConfig

    monkeypatch.setitem(sys.modules, "trackio", None)  # as if not installed
    with pytest.raises(UserError, match=r"'trackio' needs the trackio package .*--extra tracking"):
        Tracker(tmp_path, StrictModel(), TrackingConfig(backends=["trackio"]), total_steps=1)
