"""`rlhf-lab chat --replay RUN_DIR --trajectory ID` (rlhf_lab.replay) on a real tiny multi-turn
run's rollout log: every turn of the episode in order, with its role, text, tools and reward as
the `turns` table holds them; the episode's prompt, reward and advantage from `rollouts`; a step's
listing; one-line errors for a bad run directory, a log without turns and an unknown id."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import yaml
from conftest import run_module

from rlhf_lab.cli import main
from rlhf_lab.replay import listing, replay

ENV_MODULE = '''
from policy_gradients.environments import ENVIRONMENTS, Environment


@ENVIRONMENTS.register("replay_clock")
class Clock(Environment):
    """A clock tool answers the first two replies (two lines each); the third ends it."""

    def reset(self, row):
        self.turn = 0
        return row["messages"]

    def step(self, messages, completion):
        self.turn += 1
        if self.turn == 3:
            return [{"role": "user", "content": "time is up"}], 0.5, True
        tick = {"role": "tool", "name": "clock", "content": f"tick {self.turn}\\nsecond line"}
        return [tick], 0.25 * self.turn, False
'''


def eos_prone_model(directory: Path) -> Path:
    """A real one-layer Qwen3 LM (random init) with about 0.3 of each next-token distribution on
    eos, so its turns end after a few tokens and episodes reach their environment turns; saved
    with the tiny tokenizer."""
    from conftest import eos_prone_model as build

    from rlhf_core.models import ModelConfig, load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="left")
    model = build(tokenizer, p_eos=0.3, seed=0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two GRPO steps of the tiny world against the clock environment (`--import`)."""
    root = tmp_path_factory.mktemp("replay")
    (root / "replay_env.py").write_text(ENV_MODULE)
    rg = {"task": "spell_backward", "size": 32, "seed": 1, "config": {"max_word_len": 5}}
    model = str(eos_prone_model(root / "m"))
    config = {
        "name": "replay_test", "seed": 0, "model": {"name_or_path": model},
        "data": {"train": {"reasoning_gym": rg}}, "rewards": [{"name": "environment"}],
        "environment": {"env": {"name": "replay_clock"}, "max_turns": 3, "max_tokens": 200,
                        "tool_role": "user"},
        "algorithm": {"name": "grpo", "advantage": {"name": "grpo"},
                      "loss": {"name": "clipped", "aggregation": "seq-mean-token-mean"}},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12},
        "train": {"max_steps": 2, "micro_batch_size": 8, "eval_every": 0, "threads": 1},
        "checkpoint": {"save_every": 0},
    }  # fmt: skip
    (root / "replay.yaml").write_text(yaml.safe_dump(config))
    result = run_module("policy_gradients.train", "--config", "replay.yaml", "--import",
                        "replay_env", "--output-dir", "run", cwd=root)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return root / "run"


def parse(text: str) -> tuple[str, list[str], list[tuple[str, str]]]:
    """(header, prompt lines, [(turn line, its text)]) of a replay's output."""
    lines = text.split("\n")
    header, blocks, current = lines[0], [], None
    for line in lines[1:]:
        if line.startswith("  "):
            current[1].append(line[2:])
        else:
            current = (line, [])
            blocks.append(current)
    (prompt_head, prompt), *turns = blocks
    assert prompt_head == "prompt:"
    return header, prompt, [(head, "\n".join(body)) for head, body in turns]


@pytest.mark.slow
def test_replay_shows_every_turn_as_logged(run_dir: Path):
    with sqlite3.connect(run_dir / "rollouts.sqlite") as db:
        (trajectory,) = db.execute(
            "SELECT trajectory FROM turns GROUP BY trajectory ORDER BY count(*) DESC, trajectory "
            "LIMIT 1"
        ).fetchone()  # fmt: skip
        rows = db.execute(
            "SELECT step, prompt_index, rollout_index, turn, role, text, tool, reward FROM turns "
            "WHERE trajectory = ? ORDER BY turn", (trajectory,)
        ).fetchall()  # fmt: skip
        step, prompt_index, rollout_index = rows[0][:3]
        prompt, reward, advantage = db.execute(
            "SELECT prompt, reward, advantage FROM rollouts WHERE step = ? AND prompt_index = ? "
            "AND rollout_index = ?", (step, prompt_index, rollout_index)
        ).fetchone()  # fmt: skip
    assert len(rows) >= 4 and {r[4] for r in rows} == {"assistant", "environment"}
    assert any(r[6] == "clock" for r in rows) and any(r[7] > 0 for r in rows)
    header, prompt_lines, turns = parse(replay(run_dir, trajectory))
    assert header.startswith(
        f"trajectory {trajectory}: step {step}, prompt {prompt_index}, rollout {rollout_index}, "
        f"reward {reward:g}, advantage {advantage:g}, "
    )
    assert "\n".join(prompt_lines) == prompt
    assert len(turns) == len(rows)
    for (head, text), (*_, index, role, logged, tool, turn_reward) in zip(turns, rows, strict=True):
        tools = f"  tool {tool}" if tool else ""
        assert head == f"turn {index}  {role}{tools}  reward {turn_reward:g}"
        assert text == (logged if logged else "(empty)")
    # two lines of the clock's message stay two lines, each under its turn
    assert any(role == "environment" and "\nsecond line" in text for (_, text), (*_, role, _, _, _)
               in zip(turns, rows, strict=True))  # fmt: skip


@pytest.mark.slow
def test_replay_command_lists_and_refuses_in_one_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    with sqlite3.connect(run_dir / "rollouts.sqlite") as db:
        ids = [r[0] for r in db.execute("SELECT DISTINCT trajectory FROM turns WHERE step = 2")]
        top = db.execute("SELECT max(trajectory) FROM turns").fetchone()[0]
    listed = listing(run_dir)
    assert listed.startswith("step 2 (steps 1 to 2): 8 trajectories")
    assert [int(x.split()[0]) for x in listed.splitlines()[2:]] == sorted(ids)
    ok = run_module("rlhf_lab.cli", "chat", "--replay", str(run_dir), "--trajectory",
                    str(ids[0]), cwd=tmp_path)  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.startswith(f"trajectory {ids[0]}: step 2"), ok.stderr
    (tmp_path / "plain").mkdir()
    with sqlite3.connect(tmp_path / "plain" / "rollouts.sqlite") as db:
        db.execute("CREATE TABLE rollouts (step INTEGER)")
    cases = {
        ("--replay", str(run_dir), "--trajectory", str(top + 1)): f"trajectory {top + 1} is not in",
        ("--replay", str(tmp_path / "nope"), "--trajectory", "0"): "is not a directory",
        ("--replay", str(tmp_path), "--trajectory", "0"): "has no rollouts.sqlite",
        ("--replay", str(tmp_path / "plain")): "has no turns table",
        ("--replay", str(run_dir), "--step", "9"): "step 9 is not in",
        ("--trajectory", "3", "tiny-qwen3"): "go with --replay",
    }
    capsys.readouterr()
    for args, expected in cases.items():  # the console script's entry point, in this process
        code = main(["chat", *args])
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expected in lines[0], (args, err)
        assert lines[0].startswith("error: ") and out == ""
