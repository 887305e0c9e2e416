"""The hostile-input table (issue 36): every entry point (the trainers' `python -m ...train`, the
`rlhf-lab` subcommands, the quickstart) answers a bad input with one `error:` line naming the
file, field or path, exit code 2 for the user's mistake and 1 for the machine's, and never a
Python traceback. Then what keeps a traceback on purpose: `--debug` / `RLHF_LAB_DEBUG=1`, and
an error raised inside the user's own `--import`ed module (under a one-line header naming it).

The table runs each entry's `main` in this process through `run_main`, as `python -m` and the
`rlhf-lab` script do; `test_the_table_through_real_processes` runs a few rows as real commands.
A full disk has its own tests (tests/test_disk_full.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_module, tiny_pg_dict, write_yaml

from rlhf_core.errors import run_main
from rlhf_lab.cli import main as cli

TRAINERS = {
    "sft": "instruction_tuning.train", "rm": "reward_models.train",
    "dpo": "direct_alignment.train", "rl": "policy_gradients.train",
}  # fmt: skip


@dataclass
class Row:
    """A bad input: `entry` ("sft", "dpo", ... or "cli"), its argv ({tmp}, {cfg} filled in),
    what `setup(tmp)` writes first, the exit code, and text the error must name."""

    id: str
    entry: str
    argv: list[str]
    code: int
    names: str
    setup: Callable[[Path], None] = field(default=lambda tmp: None)


def _sft(tmp: Path, **changes: object) -> dict:
    rg = {"task": "spell_backward", "size": 8, "seed": 1}
    cfg = {"name": "hostile", "seed": 0, "model": {"name_or_path": "tiny-qwen3"},
           "data": {"train": {"reasoning_gym": rg}, "max_length": 64},
           "train": {"batch_size": 4, "max_steps": 1, "threads": 1}}  # fmt: skip
    for key, value in changes.items():
        node = cfg
        *path, last = key.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg


def _write(name: str, content: bytes | str | dict | list) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        path = tmp / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        else:
            path.write_text(yaml.safe_dump(content))

    return setup


def _sft_with_data(data_name: str, data: bytes | str | None) -> Callable[[Path], None]:
    """A config `cfg.yaml` whose train data is `data_name` (written as `data`, None: a dir)."""

    def setup(tmp: Path) -> None:
        write_yaml(tmp / "cfg.yaml", _sft(tmp, data__train={"path": str(tmp / data_name)}))
        if data is None:
            (tmp / data_name).mkdir()
        elif isinstance(data, bytes):
            (tmp / data_name).write_bytes(data)
        else:
            (tmp / data_name).write_text(data)

    return setup


def _cfg(**changes: object) -> Callable[[Path], None]:
    return lambda tmp: write_yaml(tmp / "cfg.yaml", _sft(tmp, **changes))


GARBAGE = random.Random(0).randbytes(3000)
GRPO = {"name": "grpo", "advantage": {"name": "grpo"}, "loss": {"name": "clipped"}}
CFG = ["--config", "{tmp}/cfg.yaml"]

ROWS = [
    # --- the config file
    Row("config missing", "sft", ["--config", "{tmp}/nope.yaml"], 2, "nope.yaml"),
    Row("config is a directory", "sft", ["--config", "{tmp}"], 2, "is a directory"),
    Row("config not UTF-8", "sft", CFG, 2, "not UTF-8",
        _write("cfg.yaml", b"name: caf\xe9\n")),
    Row("config YAML syntax", "sft", CFG, 2, "cfg.yaml", _write("cfg.yaml", "a: [1, 2\nb: {")),
    Row("config binary garbage", "sft", CFG, 2, "cfg.yaml", _write("cfg.yaml", GARBAGE)),
    Row("config empty", "sft", CFG, 2, "cfg.yaml", _write("cfg.yaml", "")),
    Row("config a list", "sft", CFG, 2, "cfg.yaml", _write("cfg.yaml", [1, 2])),
    Row("unknown key", "sft", [*CFG, "--set", "train.nope=1"], 2, "train.nope", _cfg()),
    Row("--set without =", "sft", [*CFG, "--set", "train.max_steps"], 2, "train.max_steps",
        _cfg()),
    Row("a boolean for a number", "sft", [*CFG, "--set", "optim.lr=yes"], 2, "optim.lr",
        _cfg()),
    Row("a negative batch", "sft", [*CFG, "--set", "train.batch_size=-4"], 2, "batch_size",
        _cfg()),
    Row("unknown loss", "sft", [*CFG, "--set", "loss.name=nope"], 2, "nope", _cfg()),
    # --- the data
    Row("data file missing", "sft", CFG, 2, "missing.jsonl", lambda tmp: write_yaml(
        tmp / "cfg.yaml", _sft(tmp, data__train={"path": str(tmp / "missing.jsonl")}))),
    Row("data path a directory", "sft", CFG, 2, "is a directory",
        _sft_with_data("rows.jsonl", None)),
    Row("data JSONL line broken", "sft", CFG, 2, "rows.jsonl:2",
        _sft_with_data("rows.jsonl", '{"prompt": "a", "completion": "b"}\n{"prompt": \n')),
    Row("data file empty", "sft", CFG, 2, "rows.jsonl", _sft_with_data("rows.jsonl", "")),
    Row("data binary garbage", "sft", CFG, 2, "rows.jsonl",
        _sft_with_data("rows.jsonl", GARBAGE)),
    Row("data rows without the fields", "sft", CFG, 2, "data.train",
        _sft_with_data("rows.jsonl", '{"question": "a", "reply": "b"}\n' * 4)),
    Row("data rows not objects", "sft", CFG, 2, "rows.jsonl",
        _sft_with_data("rows.jsonl", "[1, 2]\n3\n")),
    # --- the model
    Row("model dir missing", "sft", [*CFG, "--set", "model.name_or_path=./no/such/model"], 2,
        "no/such/model", _cfg()),
    Row("model dir empty", "sft", [*CFG, "--set", "model.name_or_path={tmp}/empty"], 2,
        "empty", lambda tmp: (_cfg()(tmp), (tmp / "empty").mkdir())),
    Row("model config.json garbage", "sft", [*CFG, "--set", "model.name_or_path={tmp}/m"], 2,
        "m", lambda tmp: (_cfg()(tmp), (tmp / "m").mkdir(),
                          (tmp / "m" / "config.json").write_bytes(GARBAGE))),
    # --- the run directory and resume
    Row("output dir a file", "sft", [*CFG, "--output-dir", "{tmp}/afile"], 2, "afile",
        lambda tmp: (_cfg()(tmp), (tmp / "afile").write_text("x"))),
    Row("output dir unwritable", "sft", [*CFG, "--output-dir", "/sys/rlhf-lab-hostile/run"], 1,
        "/sys/rlhf-lab-hostile/run", _cfg()),
    Row("resume a missing dir", "sft", ["--resume", "{tmp}/gone"], 2, "gone"),
    Row("resume a dir without a run", "sft", ["--resume", "{tmp}"], 2, "{tmp}"),
    Row("import a missing module", "sft", [*CFG, "--import", "no_such_module_xyz"], 2,
        "no_such_module_xyz", _cfg()),
    # --- the other trainers
    Row("dpo loss.beta negative", "dpo", [*CFG, "--set", "loss.beta=-0.1"], 2, "loss.beta",
        lambda tmp: write_yaml(tmp / "cfg.yaml", {**_sft(tmp), "loss": {"name": "dpo"}})),
    Row("dpo pairs file missing", "dpo", CFG, 2, "pairs.jsonl", lambda tmp: write_yaml(
        tmp / "cfg.yaml", _sft(tmp, data__train={"path": str(tmp / "pairs.jsonl")}))),
    Row("rm pairs file broken", "rm", CFG, 2, "pairs.jsonl:1", lambda tmp: (write_yaml(
        tmp / "cfg.yaml", _sft(tmp, data__train={"path": str(tmp / "pairs.jsonl")})),
        (tmp / "pairs.jsonl").write_text('{"chosen": "a", "rejected"\n'))),
    Row("rl group of one", "rl", [*CFG, "--set", "rollout.group_size=1"], 2, "group_size",
        lambda tmp: write_yaml(tmp / "cfg.yaml", tiny_pg_dict(Path("tiny-qwen3"), **GRPO))),
    Row("rl prompts file missing", "rl", CFG, 2, "prompts.jsonl", lambda tmp: write_yaml(
        tmp / "cfg.yaml", {**tiny_pg_dict(Path("tiny-qwen3"), **GRPO),
                           "data": {"train": {"path": str(tmp / "prompts.jsonl")}}})),
    # --- rlhf-lab
    Row("rlhf-lab unknown command", "cli", ["frobnicate"], 2, "frobnicate"),
    Row("rlhf-lab unknown option", "cli", ["runs", "list", "--frobnicate"], 2, "--frobnicate"),
    Row("runs show a missing run", "cli", ["runs", "show", "{tmp}/gone"], 2, "gone"),
    Row("eval a missing model", "cli", ["eval", "--model", "{tmp}/gone", "--prompts",
        "{tmp}/p.jsonl"], 2, "gone", _write("p.jsonl", '{"prompt": "a", "answer": "b"}\n')),
    Row("eval missing prompts", "cli", ["eval", "--model", "tiny-qwen3", "--prompts",
        "{tmp}/gone.jsonl"], 2, "gone.jsonl"),
    Row("quantize a missing model", "cli", ["quantize", "--model", "{tmp}/gone", "--bits", "8"],
        2, "gone"),
    Row("data a missing config", "cli", ["data", "{tmp}/gone.yaml"], 2, "gone.yaml"),
    Row("pairs a missing config", "cli", ["pairs", "--config", "{tmp}/gone.yaml"], 2,
        "gone.yaml"),
    Row("compare a missing config", "cli", ["compare", "--config", "{tmp}/gone.yaml"], 2,
        "gone.yaml"),
    Row("quickstart resume a missing run", "cli", ["quickstart", "--resume", "{tmp}/gone"], 2,
        "gone"),
    Row("chat a missing model", "cli", ["chat", "{tmp}/gone"], 2, "gone"),
    Row("chat a zero time limit", "cli", ["chat", "tiny-qwen3", "--max-seconds", "0"], 2,
        "--max-seconds"),
]  # fmt: skip


def run_entry(entry: str, argv: list[str]) -> int:
    """The entry's main through run_main, as its command line runs it; argparse's exit code."""
    import importlib

    try:
        if entry == "cli":
            return cli(argv)
        return run_main(importlib.import_module(TRAINERS[entry]).main, argv)
    except SystemExit as exc:  # argparse: usage and "error: ..." on stderr, exit 2
        return exc.code


def error_block(err: str) -> str:
    """The one `error:` line of stderr and the indented lines under it (a config error lists
    each bad field on its own line); nothing may follow them (PyYAML's several-line message
    did)."""
    lines = err.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if "error: " in line]
    assert len(starts) == 1, f"expected one error line, got:\n{err}"
    block = [lines[starts[0]]]
    for line in lines[starts[0] + 1 :]:
        assert line.startswith("  "), f"more after the error line:\n{err}"
        block.append(line)
    return "\n".join(block)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_a_bad_input_is_one_line_with_the_right_exit_code(row, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLHF_LAB_DEBUG", raising=False)
    row.setup(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in row.argv]
    code = run_entry(row.entry, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "During handling" not in err, err
    assert code == row.code, err
    assert row.names.replace("{tmp}", str(tmp_path)) in error_block(err), err


def test_the_table_through_real_processes(tmp_path):
    """A few rows as the commands a user types: `python -m ...train` and `rlhf-lab`, one of
    them a directory with no model in it (a transformers traceback before)."""
    (tmp_path / "afile").write_text("x")
    write_yaml(tmp_path / "cfg.yaml", _sft(tmp_path))
    cases = [
        (["instruction_tuning.train", "--config", str(tmp_path / "nope.yaml")], 2, "nope.yaml"),
        (["instruction_tuning.train", "--config", str(tmp_path / "cfg.yaml"), "--output-dir",
          "/sys/rlhf-lab-hostile/run"], 1, "/sys/rlhf-lab-hostile/run"),
        (["rlhf_lab.cli", "sft", "--config", str(tmp_path / "cfg.yaml"), "--set",
          "optim.lr=yes"], 2, "optim.lr"),
        (["rlhf_lab.cli", "sft", "--config", str(tmp_path / "cfg.yaml"), "--set",
          f"model.name_or_path={tmp_path}"], 2, "could not be loaded"),  # no model files there
        (["rlhf_lab.cli", "runs", "show", str(tmp_path / "gone")], 2, "gone"),
        (["rlhf_lab.quickstart", "--resume", str(tmp_path / "gone")], 2, "gone"),
    ]  # fmt: skip
    for args, code, names in cases:
        proc = run_module(*args, cwd=tmp_path, timeout=240)
        assert "Traceback" not in proc.stderr, (args, proc.stderr)
        assert proc.returncode == code, (args, proc.stderr)
        assert names in error_block(proc.stderr), (args, proc.stderr)


# ------------------------------------------------------------------ --debug shows the traceback


def test_debug_or_the_environment_variable_shows_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLHF_LAB_DEBUG", raising=False)
    gone = str(tmp_path / "gone")
    for argv in (["runs", "show", gone, "--debug"], ["--debug", "sft", "--resume", gone],
                 ["quickstart", "--resume", gone, "--debug"]):  # fmt: skip
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "error: " in err, (argv, err)
    from instruction_tuning.train import main

    assert run_main(main, ["--resume", gone, "--debug"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    monkeypatch.setenv("RLHF_LAB_DEBUG", "1")
    assert cli(["runs", "show", gone]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    env = {k: v for k, v in os.environ.items() if k != "RLHF_LAB_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "rlhf_lab.cli", "runs", "show", gone, "--debug"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**env, "PYTHONPATH": str(REPO / "src")})  # fmt: skip
    assert proc.returncode == 2 and "Traceback (most recent call last)" in proc.stderr


# ------------------------------------------------------------------ the user's own module


def test_an_error_in_an_imported_user_module_keeps_its_traceback_under_a_header(
    tmp_path, capsys, monkeypatch
):
    from instruction_tuning.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLHF_LAB_DEBUG", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_yaml(tmp_path / "cfg.yaml", _sft(tmp_path))
    (tmp_path / "hostile_raises.py").write_text(
        "def load_table():\n    raise RuntimeError('my table is broken')\n\n\nload_table()\n"
    )
    assert run_main(main, [*(a.replace("{tmp}", str(tmp_path)) for a in CFG),
                           "--import", "hostile_raises"]) == 2  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    header = next(i for i, line in enumerate(err) if line.startswith("error: "))
    assert "'hostile_raises'" in err[header] and "RuntimeError: my table is broken" in err[header]
    trace = "\n".join(err[header + 1 :])
    assert trace.startswith("Traceback (most recent call last)")
    assert 'hostile_raises.py", line 2, in load_table' in trace  # their frames ...
    assert "user_modules.py" not in trace and "importlib" not in trace  # ... not ours
    assert trace.endswith("RuntimeError: my table is broken")

    (tmp_path / "hostile_syntax.py").write_text("def f(:\n    pass\n")
    assert run_main(main, ["--config", str(tmp_path / "cfg.yaml"),
                           "--import", "hostile_syntax"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "error: " in err and "'hostile_syntax'" in err and "SyntaxError" in err
    assert 'hostile_syntax.py", line 1' in err

    (tmp_path / "hostile_needs.py").write_text("import no_such_package_abc\n")
    assert run_main(main, ["--config", str(tmp_path / "cfg.yaml"),
                           "--import", "hostile_needs"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "'hostile_needs'" in err and "no_such_package_abc" in err
    assert 'hostile_needs.py", line 1' in err


def test_a_user_loss_that_raises_during_training_is_named_with_its_traceback(
    tmp_path, capsys, monkeypatch
):
    from instruction_tuning.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLHF_LAB_DEBUG", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "hostile_loss.py").write_text(
        "from instruction_tuning.losses import LOSSES, CompletionNLLLoss\n\n\n"
        "@LOSSES.register('hostile_exploding')\n"
        "class Exploding(CompletionNLLLoss):\n"
        "    def forward(self, token_logprobs, loss_mask, num_tokens):\n"
        "        raise ArithmeticError('my loss divided by zero')\n"
    )
    write_yaml(tmp_path / "cfg.yaml", _sft(tmp_path, loss={"name": "hostile_exploding"}))
    out = tmp_path / "run"
    argv = ["--config", str(tmp_path / "cfg.yaml"), "--import", "hostile_loss", "--output-dir",
            str(out)]  # fmt: skip
    assert run_main(main, argv) == 2
    err = capsys.readouterr().err.splitlines()
    header = next(line for line in err if line.startswith("error: "))
    assert "your module 'hostile_loss' raised ArithmeticError in forward" in header
    assert "hostile_loss.py:7" in header
    trace = "\n".join(err)
    assert "Traceback (most recent call last)" in trace
    assert "ArithmeticError: my loss divided by zero" in trace
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "failed" and status["exit_code"] == 2
