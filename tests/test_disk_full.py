"""A disk that fills up during a checkpoint, on a real small filesystem (issue 36): a tmpfs
mounted for the test, sized so the first checkpoint fits and the second does not. The save is
warned about first; the write fails with the kernel's own ENOSPC; the partial copy is removed,
the previous checkpoint stays whole, and the run stops with one line (exit 1) naming the space
a checkpoint needs and the last good checkpoint, without a chained traceback.

Mounting needs root (or CAP_SYS_ADMIN); elsewhere the real-filesystem tests skip, saying so, and
`test_reliability.py::test_disk_full_during_a_checkpoint_names_the_last_good_one` (ENOSPC raised
by a patched `torch.save`) still runs.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from conftest import run_module, write_yaml

from rlhf_core.checkpoint import (
    CheckpointWriteError,
    list_checkpoints,
    newest_valid_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


def mount_small_disk(where: Path, size: int) -> Path:
    """A tmpfs of `size` bytes at `where` (unmounted by the caller), or skip saying why not."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount for a small tmpfs: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"mounting a small tmpfs is not permitted here (needs root): {proc.stderr}")
    return where


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a fresh tmpfs of that size; all are unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        mounted.append(mount_small_disk(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", size))
        return mounted[-1]

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def pages(directory: Path) -> int:
    """Bytes `directory` takes on a tmpfs, which stores each file in whole 4 KiB pages."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in directory.rglob("*") if p.is_file())


def tiny_save_args() -> dict:
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

    model = load_policy(ModelConfig(name_or_path="tiny-qwen3"))
    tokenizer = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()  # optimizer state, as a real checkpoint holds
    return {"model": model, "tokenizer": tokenizer, "optimizer": optimizer, "scheduler": None,
            "state": {"sampler": {}}, "keep_last": 1}  # fmt: skip


def test_a_full_disk_keeps_the_previous_checkpoint_and_names_it(tmp_path, small_disk, capsys):
    args = tiny_save_args()
    size = pages(save_checkpoint(tmp_path / "measure", 1, **args))
    disk = small_disk(int(size * 1.5))  # one checkpoint fits, two do not
    checkpoints = disk / "run" / "checkpoints"
    good = save_checkpoint(checkpoints, 1, **args)
    capsys.readouterr()
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(checkpoints, 2, **args)
    warning = capsys.readouterr().err
    assert "warning: checkpoint-2 will likely not fit" in warning and "checkpoint-1" in warning
    message = str(info.value)
    assert "\n" not in message
    assert "The disk is full" in message and "checkpoint-2 needs about" in message
    assert f"The last good checkpoint is {good}" in message and "--resume" in message
    assert info.value.__suppress_context__  # raised `from None`: no "During handling" chain
    assert [p.name for p in checkpoints.iterdir()] == ["checkpoint-1"]  # no partial copy
    assert verify_checkpoint(good) is None and newest_valid_checkpoint(checkpoints) == good


def test_a_trainer_on_a_full_disk_stops_with_one_line_and_exit_1(
    tiny_sft_dict, tmp_path, small_disk
):
    """The whole way a user meets it: `python -m instruction_tuning.train` into a run dir on a
    disk that holds one checkpoint; the second save fills it."""
    tiny_sft_dict["train"]["max_steps"] = 3
    tiny_sft_dict["data"].pop("eval")
    tiny_sft_dict["checkpoint"] = {"save_every": 1, "keep_last": 1}
    cfg = write_yaml(tmp_path / "sft.yaml", tiny_sft_dict)
    size = pages(save_checkpoint(tmp_path / "measure", 1, **tiny_save_args()))
    disk = small_disk(int(size * 1.5) + 64 * 1024)  # + config, metrics, status, lock
    out = disk / "run"
    proc = run_module("instruction_tuning.train", "--config", str(cfg), "--output-dir", str(out),
                      cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "During handling" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    good = out / "checkpoints" / "checkpoint-1"
    assert "The disk is full" in errors[0] and "needs about" in errors[0]
    assert f"The last good checkpoint is {good}" in errors[0], errors[0]
    assert "warning: checkpoint-2 will likely not fit" in proc.stderr
    assert list_checkpoints(out / "checkpoints") == [good] and verify_checkpoint(good) is None
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "failed" and status["exit_code"] == 1


def test_final_on_a_full_disk_is_one_error_and_leaves_no_partial_copy(tmp_path, small_disk):
    from accelerate import Accelerator

    from rlhf_core.checkpoint import save_final

    args = tiny_save_args()
    size = pages(save_checkpoint(tmp_path / "measure", 1, **args))
    disk = small_disk(int(size * 1.3))  # a checkpoint fits; final/ (weights, tokenizer) does not
    run = disk / "run"
    good = save_checkpoint(run / "checkpoints", 1, **args)
    with pytest.raises(CheckpointWriteError) as info:
        save_final(Accelerator(cpu=True), args["model"], args["tokenizer"], run / "final")
    message = str(info.value)
    assert "could not write final" in message and "The disk is full" in message
    assert f"The last good checkpoint is {good}" in message and info.value.__suppress_context__
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]  # no .tmp-final, no final


def test_any_write_the_machine_refuses_is_one_line_exit_1(small_disk, capsys, monkeypatch):
    """Not only checkpoints: an OSError saying the disk is full or read-only, raised anywhere
    (here a plain write, as metrics.jsonl or a report would be), is one line, exit 1."""
    from rlhf_core.errors import run_main

    monkeypatch.delenv("RLHF_LAB_DEBUG", raising=False)
    disk = small_disk(64 * 1024)

    def fill(argv: list[str] | None) -> int:
        (disk / "metrics.jsonl").write_bytes(b"x" * 1024 * 1024)
        return 0

    assert run_main(fill, []) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1, err
    assert "No space left on device" in err and "free up space" in err
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, timeout=30)

    def write(argv: list[str] | None) -> int:
        (disk / "report.md").write_text("x")
        return 0

    assert run_main(write, []) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Read-only file system" in err and "report.md" in err
    assert "choose a writable location" in err
