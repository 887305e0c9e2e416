"""`rlhf-lab runs` over real run directories: a finished, a SIGKILLed and a failed tiny SFT run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import start_module, wait_for_checkpoint, write_yaml

from rlhf_lab import cli, runs


def _cli(*args: str, capsys) -> subprocess.CompletedProcess:
    """`rlhf-lab runs ARGS` through the real entry point, in this process (stdin is no tty)."""
    code = cli.main(["runs", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """outputs/ with three real SFT runs: finished (6 steps), killed after checkpoint-2 of 200,
    and failed on a training file whose row 1 has no completion."""
    tmp = tmp_path_factory.mktemp("runs")
    root = tmp / "outputs"
    cfg = _sft_dict()
    finished_cfg = write_yaml(tmp / "finished.yaml", {**cfg, "name": "finished"})
    killed_cfg = write_yaml(tmp / "killed.yaml", {
        **cfg, "name": "killed", "train": {**cfg["train"], "max_steps": 200},
        "checkpoint": {"save_every": 1, "keep_last": 3},
    })  # fmt: skip
    bad = tmp / "bad.jsonl"
    bad.write_text('{"prompt": "abc", "completion": "cba"}\n{"prompt": "xyz"}\n')
    failed_cfg = write_yaml(tmp / "failed.yaml", {
        **cfg, "name": "failed", "data": {**cfg["data"], "train": {"path": str(bad)}, "eval": None},
    })  # fmt: skip
    out = lambda n: ("--output-dir", str(root / "instruction_tuning" / n))  # noqa: E731
    mod = "instruction_tuning.train"
    killed = start_module(mod, "--config", str(killed_cfg), *out("killed"), cwd=tmp)
    finished = start_module(mod, "--config", str(finished_cfg), *out("finished"), cwd=tmp)
    failed = start_module(mod, "--config", str(failed_cfg), *out("failed"), cwd=tmp)
    wait_for_checkpoint(killed, root / "instruction_tuning" / "killed/checkpoints/checkpoint-2")
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    assert finished.wait(timeout=240) == 0, finished.stdout.read()[-3000:]
    assert failed.wait(timeout=240) != 0
    return root


def _sft_dict() -> dict:
    rg = {"task": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 6}}
    return {
        "name": "test_sft", "seed": 0, "model": {"name_or_path": "tiny-qwen3"},
        "data": {
            "train": {"reasoning_gym": {**rg, "size": 256, "seed": 1}},
            "eval": {"reasoning_gym": {**rg, "size": 8, "seed": 10_000_000}},
            "max_length": 80,
        },
        "train": {"batch_size": 16, "max_steps": 6, "eval_every": 0, "eval_max_new_tokens": 8,
                  "threads": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "checkpoint": {"save_every": 3, "keep_last": 2},
        "tracking": {"log_every": 1, "plot_every": 0},
    }  # fmt: skip


def _by_name(root: Path) -> dict[str, runs.Run]:
    return {r.name: r for r in (runs.load_run(p, root) for p in runs.find_runs(root))}


def test_status_of_real_runs(runs_root: Path) -> None:
    found = _by_name(runs_root)
    finished = found["instruction_tuning/finished"]
    assert finished.status == "finished", finished.why
    assert (finished.package, finished.algorithm, finished.step) == ("instruction_tuning", "sft", 6)
    assert "eval/greedy_exact_match" in finished.metrics and finished.size_bytes > 100_000
    killed = found["instruction_tuning/killed"]
    assert killed.status == "interrupted", killed.why  # never "finished", never "running"
    assert killed.step is not None and 2 <= killed.step < 200


def test_failed_run_is_failed(runs_root: Path) -> None:
    run_dir = runs_root / "instruction_tuning" / "failed"
    assert runs.run_status(run_dir)[0] == "failed"  # status.json, written as the run failed


def test_running_with_dead_pid_is_interrupted(tmp_path: Path) -> None:
    """status.json left at "running" by a killed process: its pid is gone -> interrupted; the
    pid of this test process is alive -> running."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    (tmp_path / "config.yaml").write_text("name: x\n")
    host = socket.gethostname()
    status = {"status": "running", "step": 3, "pid": proc.pid, "host": host}
    (tmp_path / "status.json").write_text(json.dumps(status))
    (tmp_path / ".lock").write_text(json.dumps({"pid": proc.pid, "host": host}))
    assert runs.run_status(tmp_path)[0] == "interrupted"
    (tmp_path / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": host}))
    assert runs.run_status(tmp_path)[0] == "running"


def test_cli_list_show_compare_prune_snapshot_delete(
    runs_root: Path, tmp_path: Path, capsys
) -> None:
    root = str(runs_root)
    listed = _cli("list", "--root", root, capsys=capsys)
    assert listed.returncode == 0, listed.stderr
    lines = {ln.split()[0]: ln for ln in listed.stdout.splitlines()[2:]}
    assert " finished " in lines["instruction_tuning/finished"]
    assert " interrupted " in lines["instruction_tuning/killed"]

    shown = _cli("show", "instruction_tuning/killed", "--root", root, capsys=capsys)
    assert "checkpoint-2" in shown.stdout and "summary: (none)" in shown.stdout

    png = tmp_path / "cmp.png"
    cmp = _cli("compare", "instruction_tuning/finished", "instruction_tuning/killed",
               "--root", root, "--png", str(png), capsys=capsys)  # fmt: skip
    assert cmp.returncode == 0, cmp.stderr
    assert png.stat().st_size > 5000 and "final_train_loss" in cmp.stdout

    killed = runs_root / "instruction_tuning" / "killed"
    before = [c.name for c in runs.list_checkpoints(killed / "checkpoints")]
    assert len(before) >= 2
    # no terminal, no --yes: refuses with one line, removes nothing
    refused = _cli(
        "prune", "instruction_tuning/killed", "--keep", "1", "--root", root, capsys=capsys
    )
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert [c.name for c in runs.list_checkpoints(killed / "checkpoints")] == before

    snap = _cli("snapshot", "instruction_tuning/killed", "keepme", "--checkpoint", before[0],
                "--root", root, capsys=capsys)  # fmt: skip
    assert snap.returncode == 0, snap.stderr
    snap_dir = runs_root / "snapshots" / "keepme"
    assert (snap_dir / "model.safetensors").is_file() and (snap_dir / "snapshot.json").is_file()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(snap_dir)  # a plain HF directory

    pruned = _cli("prune", "instruction_tuning/killed", "--keep", "1", "--yes", "--root", root,
                  capsys=capsys)  # fmt: skip
    assert pruned.returncode == 0, pruned.stderr
    assert [c.name for c in runs.list_checkpoints(killed / "checkpoints")] == before[-1:]

    gone = _cli("delete", "instruction_tuning/killed", "--yes", "--root", root, capsys=capsys)
    assert gone.returncode == 0 and not killed.exists()
    missing = _cli("show", "instruction_tuning/killed", "--root", root, capsys=capsys)
    assert missing.returncode == 2 and missing.stderr.startswith("error: runs:")
