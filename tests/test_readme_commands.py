"""The README's commands work as written.

Every command line in the README's ```bash blocks is listed in `PLAN`, either to run or with the
reason it is not run here (network, GPU, minutes of CPU, the whole suite), so a command added to
or changed in the README without updating this test fails `test_every_readme_command_is_planned`.
`test_readme_commands_run` runs the offline ones in README order (later ones read earlier ones'
outputs, as a user would) from a scratch directory that links the repository's configs/ and data/:
verbatim, except for the smoke-run overrides the README itself gives: trainers get
`--set train.max_steps=2`, `rlhf-lab pairs` a few prompts per split (`PAIRS_SMOKE`). A Python
block whose first line is `# <name>.py` is written there first, as the README tells the user to.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

README = (REPO / "README.md").read_text()
RUN = "run"  # run it (trainers with --set train.max_steps=2)
TRAINER_SMOKE = ["--set", "train.max_steps=2"]
PAIRS_SMOKE = [
    "--set", "splits.train.prompts.reasoning_gym.size=32",
    "--set", "splits.eval.prompts.reasoning_gym.size=8",
]  # fmt: skip
EXIT_2_WITHOUT_GPU = "exit 2 without a GPU"

PLAN: dict[str, str] = {
    "uv run python -m <package>.train --config configs/<package>/<algo>.yaml "
    "[--set key.path=value ...]": "a template, not a command",
    "uv run rlhf-lab quickstart": "about 4 CPU minutes; its --fast form is "
    "tests/rlhf_lab/test_quickstart.py, and each stage runs below",
    "uv run pytest": "the whole suite",
    "uv run python -m instruction_tuning.train --config configs/quickstart/sft.yaml "
    "--output-dir outputs/quickstart/sft": RUN,
    "uv run rlhf-lab pairs --config configs/quickstart/pairs.yaml "
    "--output-dir outputs/quickstart/pairs": RUN,
    "uv run python -m reward_models.train --config configs/quickstart/rm.yaml "
    "--output-dir outputs/quickstart/rm": RUN,
    "uv run python -m policy_gradients.train --config configs/quickstart/grpo.yaml "
    "--output-dir outputs/quickstart/grpo": RUN,
    "uv run python -m policy_gradients.train --config configs/quickstart/rloo_rm.yaml "
    "--output-dir outputs/quickstart/rloo_rm": RUN,
    "uv run python -m direct_alignment.train --config configs/quickstart/dpo.yaml "
    "--output-dir outputs/quickstart/dpo": RUN,
    "uv run rlhf-lab eval --model outputs/quickstart/dpo/final --task spell_backward "
    """--task-config '{"min_word_len": 3, "max_word_len": 10}' """
    "--reference outputs/quickstart/sft/final": RUN,
    "uv run python -m instruction_tuning.train "
    "--config configs/instruction_tuning/tiny_sft.yaml": RUN,
    "uv run python -m direct_alignment.train --config configs/direct_alignment/tiny_dpo.yaml "
    "--import my_dpo --set loss.name=my_dpo": RUN,
    "uv run rlhf-lab compare --config configs/quickstart/compare.yaml "
    "--set sft_model=outputs/quickstart-<time>/sft/final --jobs 2": "a <time> placeholder and "
    "~12 minutes on 2 cores; its --fast form is tests/rlhf_lab/test_compare.py",
    "uv run python -m policy_gradients.train "
    "--config configs/policy_gradients/grpo_qwen3_1p7b_reasoning_gym.yaml": "a hub model (network)",
    "uv run python -m policy_gradients.train --config configs/policy_gradients/grpo.yaml "
    "--set model.name_or_path=/models/Qwen3-0.6B": "a local Qwen3-0.6B the user has",
    "uv run python -m direct_alignment.train --config configs/direct_alignment/tiny_dpo.yaml": RUN,
    "uv run python -m direct_alignment.train "
    "--config configs/direct_alignment/dpo.yaml": "a hub model (network)",
    "uv run python -m reward_models.train --config configs/reward_models/tiny_preference.yaml": RUN,
    "uv run python -m instruction_tuning.train --config configs/instruction_tuning/tiny_sft.yaml "
    "--output-dir outputs/tiny_sft": RUN,
    "uv run python -m policy_gradients.train --config configs/policy_gradients/tiny_grpo.yaml": RUN,
    'sqlite3 outputs/policy_gradients/tiny_grpo-*/rollouts.sqlite "SELECT step, AVG(reward) '
    'FROM rollouts GROUP BY step"': RUN,
    "uv run python -m benchmarks.gpu": EXIT_2_WITHOUT_GPU,
    # the toolkit, fine-grained and FSDP2 sections: each has its own test that runs it
    "uv run rlhf-lab runs list": "tests/rlhf_lab/test_runs.py runs every verb on real runs",
    "uv run rlhf-lab runs compare RUN RUN --png cmp.png": "placeholders; "
    "tests/rlhf_lab/test_runs.py",
    "uv run rlhf-lab runs prune RUN --keep 2 [--by eval/loss --mode min] --yes": "placeholders; "
    "tests/rlhf_lab/test_runs.py",
    "uv run rlhf-lab runs snapshot RUN best-sft --checkpoint checkpoint-300": "placeholders; "
    "tests/rlhf_lab/test_runs.py",
    "uv run rlhf-lab chat outputs/quickstart-<time>/sft/final outputs/quickstart-<time>/grpo/final "
    "--reward-model outputs/quickstart-<time>/rm/final": "a server and a browser: "
    "tests/rlhf_lab/test_chat.py",
    "uv run rlhf-lab quantize --model outputs/reward_models/<run>/final --bits 8": "a <run> "
    "placeholder; tests/rlhf_lab/test_quantize.py",
    "uv run rlhf-lab quantize --model outputs/policy_gradients/<run>/final --bits 4": "a <run> "
    "placeholder; tests/rlhf_lab/test_quantize.py",
    "uv run rlhf-lab data configs/direct_alignment/dpo.yaml "
    "--set model.name_or_path=tiny-qwen3-gpt2 --out outputs/data-hh-dpo --chars 160": "a minute "
    "of CPU over 2,312 HH pairs; tests/rlhf_lab/test_data_report.py runs it on a slice",
    "uv run python -m rlhf_core.longform data/longform": "writes the committed data files; "
    "tests/rlhf_core/test_segmentation.py checks them",
    "uv run python -m rlhf_lab.fine_grained --steps 20 --seeds 0 1 2 3 4 5": "~1.5 h on 2 cores",
    "uv run torchrun --nproc_per_node 2 -m instruction_tuning.train --config "
    "configs/instruction_tuning/tiny_sft.yaml --set train.engine=fsdp2 --set "
    "train.micro_batch_size=32 --set train.max_steps=20": "two minutes of two processes; "
    "tests/test_fsdp2.py runs FSDP2 SFT",
}


def readme_commands(text: str = README) -> list[str]:
    """Command lines of the ```bash blocks, comments stripped, spaces normalised, in order."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```$", text, flags=re.S | re.M):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def readme_files(text: str = README) -> dict[str, str]:
    """Python blocks that name their file on the first line (`# my_dpo.py`)."""
    files = {}
    for block in re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M):
        named = re.match(r"# (\w+\.py)\n", block)
        if named:
            files[named.group(1)] = block
    return files


def test_every_readme_command_is_planned():
    commands = readme_commands()
    for smoke in (TRAINER_SMOKE, PAIRS_SMOKE):  # the README gives the overrides the test uses
        assert " ".join(smoke) in " ".join(README.split())
    assert "uv run python -m benchmarks.gpu" in README  # inline in the README; tested below
    unplanned = [c for c in commands if c not in PLAN]
    stale = [c for c in PLAN if c not in commands and c != "uv run python -m benchmarks.gpu"]
    assert not unplanned, "README commands this test does not know (add them to PLAN):\n" + (
        "\n".join(unplanned)
    )
    assert not stale, "PLAN lists commands the README no longer has:\n" + "\n".join(stale)


def _argv(command: str) -> tuple[list[str], bool]:
    """The command as this interpreter runs it, and whether it is a trainer."""
    argv = shlex.split(command)
    assert argv[:2] == ["uv", "run"], command
    argv = argv[2:]
    if argv[0] == "rlhf-lab":
        argv = [sys.executable, "-m", "rlhf_lab.cli", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    elif argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    module = argv[len(argv) - argv[::-1].index("-m")]  # the last -m names the entry
    return argv, module.endswith(".train")


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_readme_commands_run(tmp_path):
    for name in ("configs", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    for filename, code in readme_files().items():
        (tmp_path / filename).write_text(code)
    ran = []
    for command in readme_commands():
        how = PLAN[command]
        if how == RUN and command.startswith("sqlite3"):
            path, query = shlex.split(command)[1:]
            (found,) = glob.glob(str(tmp_path / path))
            rows = sqlite3.connect(found).execute(query).fetchall()
            assert [step for step, _ in rows] == [1, 2], rows
        elif how == RUN:
            argv, trainer = _argv(command)
            argv += TRAINER_SMOKE if trainer else PAIRS_SMOKE if " pairs " in command else []
            result = _run(argv, cwd=tmp_path, timeout=600)
            assert result.returncode == 0, (
                f"{command}\n{result.stdout[-2000:]}\n" + (result.stderr[-4000:])
            )
        else:
            continue
        ran.append(command)
    assert len(ran) == sum(how == RUN for how in PLAN.values())
    for stage in ("sft", "rm", "grpo", "rloo_rm", "dpo"):
        assert (tmp_path / "outputs" / "quickstart" / stage / "final").is_dir(), stage
    assert (tmp_path / "outputs" / "quickstart" / "pairs" / "train.jsonl").stat().st_size > 0


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the refusal is for CPU-only machines"
)
def test_gpu_benchmark_command_refuses_without_cuda():
    assert PLAN["uv run python -m benchmarks.gpu"] == EXIT_2_WITHOUT_GPU
    result = _run([sys.executable, "-m", "benchmarks.gpu"], cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no CUDA device" in result.stderr and "--smoke" in result.stderr
