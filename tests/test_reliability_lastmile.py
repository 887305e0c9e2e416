"""Reliability, the last mile (issue 36): no command overwrites a directory it writes, a finished
run's `--resume` changes nothing, a loss's argument check is a one-line config error, the paths
that ended in a traceback end in one line, and bf16 on a CPU without native bf16 is warned.

Each test here failed on the code before the change it covers (see docs/reliability.md)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from conftest import REPO, tiny_pg_dict, write_yaml

from rlhf_core.config import ConfigError, RunArgs, load_config
from rlhf_core.errors import UserError, run_main
from rlhf_lab.cli import main as cli


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


# ------------------------------------------------------------------ 0: nothing overwritten


def test_the_shared_rule_refuses_a_non_empty_target_and_moves_it_aside(tmp_path):
    from rlhf_core.output_dir import claim_output_path

    out = tmp_path / "out"
    assert claim_output_path(out, overwrite=False, command="x") is None and out.is_dir()
    (out / "a.txt").write_text("old")
    with pytest.raises(UserError, match=r"already holds .*--overwrite"):
        claim_output_path(out, overwrite=False, command="x")
    old = claim_output_path(out, overwrite=True, command="x")
    assert old.name.startswith("out.old-") and (old / "a.txt").read_text() == "old"
    assert out.is_dir() and not any(out.iterdir())  # a fresh empty target
    target = tmp_path / "metrics.json"  # a file target (eval --output)
    target.write_text("1")
    with pytest.raises(UserError, match="--overwrite"):
        claim_output_path(target, overwrite=False, command="x", is_file=True)
    moved = claim_output_path(target, overwrite=True, command="x", is_file=True)
    assert moved.read_text() == "1" and not target.exists()


def test_pairs_into_a_directory_holding_pairs_refuses_and_overwrite_keeps_the_old(tmp_path, capsys):
    out = tmp_path / "pairs"
    argv = [
        "pairs", "--config", str(REPO / "configs" / "quickstart" / "pairs.yaml"),
        "--output-dir", str(out), "--set", "model.name_or_path=tiny-qwen3",
        "--set", "splits.train.prompts.reasoning_gym.size=4",
        "--set", "splits.eval.prompts.reasoning_gym.size=2", "--set", "samples=2",
    ]  # fmt: skip
    assert cli(argv) == 0
    first = (out / "train.jsonl").read_text()
    capsys.readouterr()
    bigger = [*argv, "--set", "splits.train.prompts.reasoning_gym.size=6"]
    assert cli(bigger) == 2
    line = _one_line_error(capsys)
    assert str(out) in line and "--overwrite" in line
    assert (out / "train.jsonl").read_text() == first  # untouched
    assert cli([*bigger, "--overwrite"]) == 0
    (old,) = tmp_path.glob("pairs.old-*")
    assert (old / "train.jsonl").read_text() == first
    assert (out / "summary.json").is_file()


def test_eval_output_is_not_overwritten(tmp_path, capsys):
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc", "answer": "cba"}) + "\n")
    out = tmp_path / "eval.json"
    out.write_text('{"earlier": 1}\n')
    argv = ["eval", "--model", "tiny-qwen3", "--prompts", str(prompts), "--output", str(out),
            "--max-new-tokens", "4"]  # fmt: skip
    assert cli(argv) == 2
    assert str(out) in _one_line_error(capsys)
    assert json.loads(out.read_text()) == {"earlier": 1}
    assert cli([*argv, "--overwrite"]) == 0
    (old,) = tmp_path.glob("eval.json.old-*")
    assert json.loads(old.read_text()) == {"earlier": 1}
    assert "prompts" in json.loads(out.read_text())


def test_quantize_refuses_a_non_empty_output_before_any_work(tmp_path, capsys):
    from rlhf_core.tiny import preset_dir

    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = ["quantize", "--model", str(preset_dir("tiny-qwen3")), "--bits", "8", "--output",
            str(out)]  # fmt: skip
    assert cli(argv) == 2
    line = _one_line_error(capsys)
    assert str(out) in line and "--overwrite" in line
    assert (out / "keep.txt").read_text() == "mine"


def test_runs_snapshot_overwrite_moves_the_old_snapshot_aside(tmp_path, capsys):
    run = tmp_path / "outputs" / "instruction_tuning" / "r"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text("name: r\n")
    (run / "final" / "w.txt").write_text("new")
    dest = tmp_path / "snap"
    dest.mkdir()
    (dest / "w.txt").write_text("old")
    argv = ["runs", "snapshot", str(run), str(dest), "--checkpoint", "final",
            "--root", str(tmp_path / "outputs")]  # fmt: skip
    assert cli(argv) == 2
    assert "--overwrite" in _one_line_error(capsys)
    assert cli([*argv, "--overwrite"]) == 0
    (old,) = tmp_path.glob("snap.old-*")
    assert (old / "w.txt").read_text() == "old" and (dest / "w.txt").read_text() == "new"


def test_compare_into_a_used_dir_names_overwrite_which_moves_the_old_aside(tmp_path, capsys):
    from rlhf_core.rundir import locked_run

    out = tmp_path / "cmp"
    out.mkdir()
    (out / "compare.md").write_text("old table")
    assert cli(["compare", "--output-dir", str(out)]) == 2
    assert "--overwrite" in _one_line_error(capsys)
    with locked_run(out, package="compare", overwrite=True):  # what `compare --overwrite` opens
        assert not (out / "compare.md").exists()
    (old,) = tmp_path.glob("cmp.replaced-*")
    assert (old / "compare.md").read_text() == "old table"


# ----------------------------------------------------------------------------- 0: a finished run


def _sft(cfg: dict, out: Path, tmp_path: Path, **run: object) -> int:
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train

    path = write_yaml(tmp_path / f"sft-{random.random()}.yaml", cfg)
    return train(load_config(SFTConfig, path), RunArgs(config_path=path, output_dir=out, **run))


def test_resuming_a_finished_run_changes_nothing_but_more_steps_continue(tiny_sft_dict, tmp_path):
    tiny_sft_dict["checkpoint"]["save_every"] = 3
    tiny_sft_dict["data"]["eval"] = None
    out = tmp_path / "run"
    assert _sft(tiny_sft_dict, out, tmp_path) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    with pytest.raises(UserError, match=r"finished .*step 6 of 6.*train\.max_steps"):
        _sft(tiny_sft_dict, out, tmp_path, resume=str(out))
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before  # summary.json, status.json, metrics.jsonl: byte for byte
    assert json.loads((out / "summary.json").read_text())["final_train_loss"] > 0
    tiny_sft_dict["train"]["max_steps"] = 8  # more steps, on purpose: continues
    assert _sft(tiny_sft_dict, out, tmp_path, resume=str(out)) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


# ----------------------------------------------------------------------------- 1: one-line errors


def test_a_loss_argument_check_is_a_config_error_naming_the_field(tiny_dpo_dict, tmp_path):
    from direct_alignment.config import DAConfig
    from policy_gradients.config import PGConfig

    tiny_dpo_dict["loss"]["beta"] = -0.1
    path = write_yaml(tmp_path / "dpo.yaml", tiny_dpo_dict)
    with pytest.raises(ConfigError, match=r"loss\.beta.*-0\.1"):
        load_config(DAConfig, path)
    pg = tiny_pg_dict(
        Path("tiny-qwen3"), name="grpo", advantage={"name": "grpo"},
        loss={"name": "clipped", "kl_beta": -1},
    )  # fmt: skip
    path = write_yaml(tmp_path / "pg.yaml", pg)
    with pytest.raises(ConfigError, match=r"algorithm\.loss\.kl_beta"):
        load_config(PGConfig, path)


def test_a_loss_argument_check_exits_2_with_one_line(tiny_dpo_dict, tmp_path, capsys):
    from direct_alignment.train import main

    tiny_dpo_dict["loss"]["beta"] = -0.1
    path = write_yaml(tmp_path / "dpo.yaml", tiny_dpo_dict)
    assert run_main(main, ["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err  # the config error's usual form: the file, then the field
    assert "Traceback" not in err and "loss.beta: dpo loss: beta must be" in err


def _fake_run(run: Path) -> None:
    (run / "checkpoints" / "checkpoint-1").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"name": "r", "train": {"loss": "nll"}}))
    (run / "status.json").write_text(json.dumps({"status": "finished", "exit_code": 0}))


def test_runs_prune_and_delete_take_an_absolute_path_outside_the_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default root, outputs/, does not hold the run
    run = tmp_path / "elsewhere" / "r"
    _fake_run(run)
    assert cli(["runs", "prune", str(run.resolve()), "--keep", "1", "--yes"]) == 0
    assert cli(["runs", "delete", str(run.resolve()), "--yes"]) == 0
    assert not run.exists()


def test_eval_with_a_policy_as_reward_model_is_one_line(tmp_path, capsys):
    from rlhf_core.tiny import preset_dir

    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc", "answer": "cba"}) + "\n")
    policy = preset_dir("tiny-qwen3")
    argv = ["eval", "--model", "tiny-qwen3", "--prompts", str(prompts), "--reward-model",
            str(policy), "--output", str(tmp_path / "e.json")]  # fmt: skip
    assert cli(argv) == 2
    assert "scalar_head.json" in _one_line_error(capsys)


def test_quantize_a_t5_policy_or_a_corrupt_model_is_one_line(tmp_path, capsys):
    import shutil

    from rlhf_core.tiny import preset_dir

    eval_cfg = write_yaml(tmp_path / "eval.yaml", {"data": {"eval": {"reasoning_gym": {
        "task": "spell_backward", "size": 4, "seed": 5}}}})  # fmt: skip
    t5 = ["--model", str(preset_dir("tiny-t5-facts")), "--bits", "8", "--eval-config",
          str(eval_cfg), "--output", str(tmp_path / "q5")]  # fmt: skip
    assert cli(["quantize", *t5]) == 2
    assert "encoder-decoder" in _one_line_error(capsys)
    broken = tmp_path / "broken"
    shutil.copytree(preset_dir("tiny-qwen3"), broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    argv = ["quantize", "--model", str(broken), "--bits", "8", "--eval-config", str(eval_cfg),
            "--output", str(tmp_path / "qb")]  # fmt: skip
    assert cli(argv) == 2
    line = _one_line_error(capsys)
    assert "model.safetensors" in line and "damaged" in line


def test_an_output_dir_that_is_a_file_or_unwritable_is_one_line(tiny_sft_dict, tmp_path, capsys):
    from instruction_tuning.train import main
    from rlhf_core.errors import EnvironmentFailure
    from rlhf_core.output_dir import claim_output_path

    cfg = write_yaml(tmp_path / "sft.yaml", tiny_sft_dict)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert run_main(main, ["--config", str(cfg), "--output-dir", str(afile)]) == 2
    assert "is a file" in _one_line_error(capsys) and afile.read_text() == "x"
    unwritable = Path("/sys/rlhf-lab-reliability-test/run")  # sysfs: no new directories
    with pytest.raises(EnvironmentFailure):
        claim_output_path(unwritable, overwrite=False, command="x")
    assert run_main(main, ["--config", str(cfg), "--output-dir", str(unwritable)]) == 1
    line = _one_line_error(capsys)
    assert str(unwritable) in line and "writable" in line


# ----------------------------------------------------------------------------- bf16 on a CPU


def test_bf16_on_a_cpu_without_native_bf16_is_warned():
    from rlhf_core.fastpath import bf16_probe, slow_bf16_warning

    # the decision, from injected probe timings: 66x slower (an AVX2 CPU) warns, 1.2x does not
    warning = slow_bf16_warning(bf16_seconds=0.066, fp32_seconds=0.001, capability="AVX2")
    assert warning is not None and "fp32" in warning and "AVX2" in warning and "66" in warning
    assert slow_bf16_warning(bf16_seconds=0.0012, fp32_seconds=0.001, capability="AVX512") is None
    # the probe itself is real: two positive timings
    bf16_s, fp32_s = bf16_probe()
    assert 0 < bf16_s < 5 and 0 < fp32_s < 5
