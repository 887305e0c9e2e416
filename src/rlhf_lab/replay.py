"""`rlhf-lab chat --replay RUN_DIR --trajectory ID`: one multi-turn episode of a run, turn by turn,
read back from its rollout log (`rollouts.sqlite`, the `turns` table written with an
`environment:` block; docs/policy_gradients/environments.md).

    rlhf-lab chat --replay outputs/multi_turn/calculator/grpo-seed0 --trajectory 9
    rlhf-lab chat --replay outputs/multi_turn/calculator/grpo-seed0 [--step 3]   # list them

Prints the episode's header (step, prompt index, rollout index, summed reward, advantage, tokens,
truncated, from the `rollouts` row of the same episode), its prompt as the model saw it, then
each turn in order: index, role (assistant: sampled and trained; environment: the tool's result
or feedback, context only), the tools called or answering, the turn's reward, and the text as
logged, each line indented by two spaces. Without `--trajectory`, one line per episode of a step
(the last by default). A directory that is not a run, a log without a `turns` table or an id
that is not in it is one line naming what was expected.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from rlhf_core.errors import UserError

TURNS = "step, prompt_index, rollout_index, trajectory, turn, role, text, tool, reward"


def open_log(run_dir: Path) -> sqlite3.Connection:
    """The run's rollout log, read-only, with its `turns` table checked."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"chat --replay: {run_dir} is not a directory (expected a run directory)")
    path = run_dir / "rollouts.sqlite"
    if not path.is_file():
        raise UserError(
            f"chat --replay: {run_dir} has no rollouts.sqlite (expected the directory of a "
            "policy-gradient run with an environment: block)"
        )
    conn = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise UserError(f"chat --replay: {path} cannot be read as SQLite: {exc}") from None
    if "turns" not in tables:
        conn.close()
        raise UserError(
            f"chat --replay: {path} has no turns table (the run played single completions, "
            "not episodes: it had no environment: block)"
        )
    return conn


def _indent(text: str) -> str:
    if text == "":
        return "  (empty)"
    return "\n".join("  " + line for line in text.split("\n"))


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def replay(run_dir: Path, trajectory: int) -> str:
    """The text of episode `trajectory` (its id in the `turns` table) of the run in `run_dir`."""
    with closing(open_log(run_dir)) as conn:
        turns = conn.execute(
            f"SELECT {TURNS} FROM turns WHERE trajectory = ? ORDER BY step, turn, rowid",
            (trajectory,),
        ).fetchall()  # fmt: skip
        if not turns:
            low, high, n = conn.execute(
                "SELECT min(trajectory), max(trajectory), count(DISTINCT trajectory) FROM turns"
            ).fetchone()
            span = f"{n} trajectories, ids {low} to {high}" if n else "no trajectories"
            raise UserError(
                f"chat --replay: trajectory {trajectory} is not in {Path(run_dir)}/rollouts.sqlite"
                f" ({span}; without --trajectory the last step's are listed)"
            )
        step, prompt_index, rollout_index = turns[0][:3]
        episode = conn.execute(
            "SELECT prompt, reward, advantage, length, truncated FROM rollouts WHERE step = ? "
            "AND prompt_index = ? AND rollout_index = ? ORDER BY rowid LIMIT 1",
            (step, prompt_index, rollout_index),
        ).fetchone()  # fmt: skip
    head = (f"trajectory {trajectory}: step {step}, prompt {prompt_index}, "
            f"rollout {rollout_index}")  # fmt: skip
    lines = []
    if episode is not None:
        prompt, reward, advantage, length, truncated = episode
        head += (f", reward {_reward(reward)}, advantage {_reward(advantage)}, "
                 f"{length} tokens, truncated {'yes' if truncated else 'no'}")  # fmt: skip
        lines += ["prompt:", _indent(prompt)]
    else:
        total = sum(t[8] or 0.0 for t in turns)
        head += f", reward {total:g} (no rollouts row)"
    for _, _, _, _, index, role, text, tool, reward in turns:
        tools = f"  tool {tool}" if tool else ""
        lines += [f"turn {index}  {role}{tools}  reward {_reward(reward)}", _indent(text or "")]
    return "\n".join([head, *lines])


def listing(run_dir: Path, step: int | None = None) -> str:
    """One line per episode of `step` (default: the last step in the log)."""
    with closing(open_log(run_dir)) as conn:
        steps = [r[0] for r in conn.execute("SELECT DISTINCT step FROM turns ORDER BY step")]
        if not steps:
            raise UserError(f"chat --replay: {Path(run_dir)}/rollouts.sqlite has no turns logged")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise UserError(
                f"chat --replay: step {step} is not in {Path(run_dir)}/rollouts.sqlite's turns "
                f"(steps {steps[0]} to {steps[-1]})"
            )
        rows = conn.execute(
            "SELECT trajectory, prompt_index, rollout_index, sum(role = 'assistant'), "
            "sum(reward), group_concat(tool, ' ') FROM turns WHERE step = ? "
            "GROUP BY trajectory ORDER BY trajectory",
            (step,),
        ).fetchall()  # fmt: skip
    lines = [f"step {step} (steps {steps[0]} to {steps[-1]}): {len(rows)} trajectories",
             "trajectory  prompt  rollout  model turns  reward  tools"]  # fmt: skip
    for trajectory, prompt, rollout, turns, reward, tools in rows:
        called = ",".join(sorted({t for t in (tools or "").replace(",", " ").split() if t})) or "-"
        lines.append(f"{trajectory:>10}  {prompt:>6}  {rollout:>7}  {turns:>11}  "
                     f"{reward:>6g}  {called}")  # fmt: skip
    return "\n".join(lines)


def main(run_dir: Path, trajectory: int | None, step: int | None = None) -> int:
    print(listing(run_dir, step) if trajectory is None else replay(run_dir, trajectory))
    return 0
