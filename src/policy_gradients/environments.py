"""Environments for multi-turn RL (registry `ENVIRONMENTS`), and two of them for the tiny world.

An environment runs one episode at a time; the rollout (`policy_gradients.episodes`) makes one
instance per trajectory, from the config's keywords:

    environment:
      env: {name: calculator_arithmetic, tools: [calculator], timeout_s: 2.0}
      max_turns: 4

    reset(row) -> messages
        the conversation the model first answers, from a prompt row (`rollout.load_prompts`'s
        item: its `messages` after the data block's template and system prompt, `answer`, ...)
    step(messages, completion) -> (new messages, reward, done)
        `messages` is the conversation before the model's reply, `completion` the reply's text;
        returns the messages the environment adds (tool results, feedback; shown to the model
        unless `done`), this turn's reward and whether the episode is over

A user's own environment subclasses `Environment`, registers it (`@ENVIRONMENTS.register("x")`)
and comes in with `--import my_module` (or `imports:`), or is named `my_module:MyEnvironment`;
docs/policy_gradients/environments.md has an example. `stats` counts what the rollout reports
(e.g. `tool_calls`, `invalid_tool_calls`); an episode whose rewards sum to `success_reward` or
more is a success in the held-out figures.

Here: `ToolEnvironment` (the model calls tools with `<tool_call>` blocks, `policy_gradients.tools`,
until it answers without one), `CalculatorArithmetic` (a product of two numbers, easy with the
calculator and hard for a tiny model in its head), `GuessNumber` (guess a secret number over
several turns, told "higher" or "lower"), and the rows of their offline data sets
(`arithmetic_rows`, `guess_rows`).
"""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

from policy_gradients.rewards import extract_answer, last_number
from policy_gradients.tools import ToolBox, parse_tool_calls
from rlhf_core.chat import Messages
from rlhf_core.errors import UserError
from rlhf_core.registry import Registry


class Environment:
    """The protocol: `reset` and `step` (see the module docstring). Keyword-only constructor
    arguments are the config's keywords."""

    name = "environment"  # the registry sets each subclass's name
    success_reward = 1.0  # an episode whose rewards sum to this or more is a success

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}

    def reset(self, row: dict[str, Any]) -> Messages:
        raise NotImplementedError

    def step(self, messages: Messages, completion: str) -> tuple[Messages, float, bool]:
        raise NotImplementedError

    def count(self, key: str, value: float = 1.0) -> None:
        """Add `value` to `stats[key]` (the rollout sums each key over episodes)."""
        stats = self.__dict__.setdefault("stats", {})
        stats[key] = stats.get(key, 0.0) + value


ENVIRONMENTS: Registry[type[Environment]] = Registry("environment", base=Environment)


def same_number(guess: str | None, gold: str) -> bool:
    """Whether the number in `guess` equals `gold` (to 1e-6)."""
    number = last_number(guess or "")
    try:
        return number is not None and abs(float(number) - float(gold)) < 1e-6
    except ValueError:
        return False


class ToolEnvironment(Environment):
    """An episode in which the model may call `tools` (`policy_gradients.tools`) before it answers.

    A reply with `<tool_call>` blocks gets one tool message per call back (an invalid call or a
    failing tool: an error message), `call_reward` per valid call (default 0) and minus
    `invalid_call_penalty` per invalid one (default 0); a reply without one is the answer, scored
    by `score` (subclasses), and ends the episode. With `describe_tools`, a system message lists
    the tools' JSON schemas, Hermes-style."""

    def __init__(
        self, *, tools: list[str], timeout_s: float = 2.0, call_reward: float = 0.0,
        invalid_call_penalty: float = 0.0, describe_tools: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        if not 0.0 <= invalid_call_penalty < math.inf:
            raise UserError(
                "environment.env.invalid_call_penalty: expected a finite number >= 0 (subtracted "
                f"per invalid call), got {invalid_call_penalty}"
            )
        self.toolbox = ToolBox(tools, timeout_s=timeout_s)
        self.call_reward, self.describe_tools = float(call_reward), describe_tools
        self.invalid_call_penalty = float(invalid_call_penalty)
        self.row: dict[str, Any] = {}

    def tools_prompt(self) -> str:
        schemas = "\n".join(json.dumps(s) for s in self.toolbox.schemas.values())
        return (
            "You may call these tools:\n<tools>\n" + schemas + "\n</tools>\nCall one as "
            '<tool_call>{"name": <name>, "arguments": {...}}</tool_call>.'
        )

    def reset(self, row: dict[str, Any]) -> Messages:
        self.row = row
        self.stats.update(tool_calls=0.0, invalid_tool_calls=0.0)  # reported even when 0
        messages = [dict(m) for m in row["messages"]]
        if self.describe_tools:
            messages.insert(0, {"role": "system", "content": self.tools_prompt()})
        return messages

    def step(self, messages: Messages, completion: str) -> tuple[Messages, float, bool]:
        calls = parse_tool_calls(completion)
        if not calls:
            return [], self.score(completion), True
        results = [self.toolbox.run(call) for call in calls]
        valid = sum(r.ok for r in results)
        self.count("tool_calls", len(results))
        self.count("invalid_tool_calls", len(results) - valid)
        reward = self.call_reward * valid - self.invalid_call_penalty * (len(results) - valid)
        return [r.message() for r in results], reward, False

    def score(self, completion: str) -> float:
        raise NotImplementedError


@ENVIRONMENTS.register("calculator_arithmetic")
class CalculatorArithmetic(ToolEnvironment):
    """Arithmetic with a calculator (rows: `arithmetic_rows`): reward 1 when the final reply's
    <answer> equals the row's answer, else 0; plus `right_call_reward` (default 0, below
    `success_reward`), once per episode, for the first tool call that ran and returned the row's
    answer (the question's operands copied right), counted as `right_calls`. Only a right answer
    reaches `success_reward`."""

    def __init__(
        self, *, tools: list[str] | None = None, timeout_s: float = 2.0, call_reward: float = 0.0,
        invalid_call_penalty: float = 0.0, right_call_reward: float = 0.0,
        describe_tools: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(
            tools=tools or ["calculator"], timeout_s=timeout_s, call_reward=call_reward,
            invalid_call_penalty=invalid_call_penalty, describe_tools=describe_tools,
        )  # fmt: skip
        if not 0.0 <= right_call_reward < self.success_reward:
            raise UserError(
                f"environment.env.right_call_reward: expected a number in [0, "
                f"{self.success_reward:g}) (only a right answer may count as solved), got "
                f"{right_call_reward}"
            )
        self.right_call_reward, self.paid = float(right_call_reward), False

    def reset(self, row: dict[str, Any]) -> Messages:
        self.paid = False
        messages = super().reset(row)
        self.stats.update(right_calls=0.0)
        return messages

    def step(self, messages: Messages, completion: str) -> tuple[Messages, float, bool]:
        new, reward, done = super().step(messages, completion)
        answer = str(self.row["answer"])
        right = [m for m in new if m["role"] == "tool" and not m["content"].startswith("error:")
                 and same_number(m["content"], answer)]  # fmt: skip
        if right and not self.paid:
            self.paid = True
            self.count("right_calls")
            reward += self.right_call_reward
        return new, reward, done

    def score(self, completion: str) -> float:
        return float(same_number(extract_answer(completion), str(self.row["answer"])))


GUESS = re.compile(r"-?\d+")


@ENVIRONMENTS.register("guess_number")
class GuessNumber(Environment):
    """Guess the row's secret number (rows: `guess_rows`) over several turns. Each reply's
    <answer> (else its last number) is a guess: right, reward 1 and the episode ends; wrong, the
    user says "higher" or "lower"; no number, the user asks for one. `max_turns` bounds it."""

    def __init__(self) -> None:
        super().__init__()
        self.secret = 0

    def reset(self, row: dict[str, Any]) -> Messages:
        self.secret = int(str(row["answer"]).strip())
        return [dict(m) for m in row["messages"]]

    def step(self, messages: Messages, completion: str) -> tuple[Messages, float, bool]:
        found = GUESS.findall(extract_answer(completion) or completion)
        self.count("guesses")
        if not found:
            self.count("invalid_guesses")
            return [{"role": "user", "content": "Say a number."}], 0.0, False
        guess = int(found[-1])
        if guess == self.secret:
            return [{"role": "user", "content": "correct"}], 1.0, True
        hint = "higher" if guess < self.secret else "lower"
        return [{"role": "user", "content": hint}], 0.0, False


# ------------------------------------------------------------------ tiny-world data


def arithmetic_rows(n: int, *, seed: int, low: int = 10, high: int = 99) -> list[dict[str, str]]:
    """`n` rows {prompt, answer} asking for the product of two numbers in [low, high]."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"prompt": f"{a}*{b}=?", "answer": str(a * b)})
    return rows


def guess_rows(n: int, *, seed: int, high: int = 8) -> list[dict[str, str]]:
    """`n` rows {prompt, answer}: a secret number in [1, high] to guess."""
    rng = random.Random(seed)
    return [
        {"prompt": f"Guess my number, 1 to {high}.", "answer": str(rng.randint(1, high))}
        for _ in range(n)
    ]
