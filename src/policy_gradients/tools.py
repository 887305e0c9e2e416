"""Tools a policy can call during a multi-turn rollout: the registry `TOOLS`, the call format, and
running a call safely.

Format (Qwen3 / Hermes): the model writes one or more blocks

    <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 48"}}</tool_call>

in its turn; each is parsed (`parse_tool_calls`), checked against the tool's JSON schema and run
(`ToolBox.run`), and its result goes back to the model as a message `{"role": "tool", "name": ...,
"content": ...}`. A tool is a plain Python function registered with a JSON schema, written out or
derived from its signature (`tool_schema`: str / int / float / bool / list / dict parameters;
the docstring's first line is the description):

    @TOOLS.register("calculator")
    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses.'''

Nothing a call does crashes the rollout: invalid JSON, a call without a name, an unknown tool,
arguments that do not match the schema, and an exception inside the tool each become an error
message to the model (`ToolResult.ok` False). A tool that runs longer than `timeout_s` is stopped:
on the main thread a `SIGALRM` timer raises `ToolTimeout` (a `BaseException`, so a tool's own
`except Exception` cannot swallow it) inside the tool, which stops pure-Python loops and sleeps;
a single C call that never returns to the interpreter is stopped only when it does. Off the main
thread (no signals there) the call runs in a daemon thread that is abandoned after the timeout.
Tools run in the trainer's process: they are for trusted code, not a sandbox.
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
import signal
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_core.errors import UserError
from rlhf_core.registry import Registry

TOOLS: Registry[Callable[..., Any]] = Registry("tool")

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
              dict: "object"}  # fmt: skip


class ToolTimeout(BaseException):
    """Raised inside a tool that ran past its time limit (a BaseException: see the docstring)."""


@dataclass
class ToolCall:
    """One parsed `<tool_call>` block: a name and its arguments, or the reason it is invalid."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None  # set when the block is not a valid call


@dataclass
class ToolResult:
    name: str | None
    content: str  # what the model reads back
    ok: bool  # False: an invalid call, an exception or a timeout (content says which)

    def message(self) -> dict[str, str]:
        """The result as a chat message, role `tool`."""
        return {"role": "tool", "name": self.name or "", "content": self.content}


def tool_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI / Qwen3 function schema of `fn`: its own `schema` attribute when it has one,
    else derived from its signature (every parameter without a default is required)."""
    if isinstance(getattr(fn, "schema", None), dict):
        return fn.schema
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for pname, param in inspect.signature(fn).parameters.items():
        kind = JSON_TYPES.get(typing.get_origin(hints.get(pname)) or hints.get(pname))
        properties[pname] = {"type": kind} if kind else {}
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return {"type": "function", "function": {
        "name": name or getattr(fn, "name", fn.__name__), "description": doc[0] if doc else "",
        "parameters": {"type": "object", "properties": properties, "required": required},
    }}  # fmt: skip


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block of `text`, in order; a `<tool_call>` never closed, or a
    `</tool_call>` never opened (a garbled opening tag), is an invalid call too. Arguments may be
    an object or a JSON string holding one (OpenAI style)."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(None, {}, f"invalid JSON in <tool_call>: {exc.msg}"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall(None, {}, 'a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        args = value.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(value["name"], {}, "arguments must be a JSON object"))
            continue
        calls.append(ToolCall(value["name"], args))
    opened, closed = text.count("<tool_call>"), text.count("</tool_call>")
    if opened > closed:
        calls.append(ToolCall(None, {}, "<tool_call> without </tool_call>"))
    elif closed > opened:
        calls.append(ToolCall(None, {}, "</tool_call> without <tool_call>"))
    return calls


def check_arguments(schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    """Why `args` do not fit the function schema (missing, unknown or mistyped keys), or None."""
    params = schema["function"]["parameters"]
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    unknown = [k for k in args if k not in props]
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)}; expected {', '.join(props) or 'none'}"
    python = {v: k for k, v in JSON_TYPES.items()}
    for key, value in args.items():
        want = python.get(props[key].get("type"))
        if want is None:
            continue
        accepted = (int, float) if want is float else want  # JSON numbers include integers
        if not isinstance(value, accepted) or (isinstance(value, bool) and want is not bool):
            return f"argument {key} must be of type {props[key]['type']}"
    return None


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """`fn()`, stopped after `timeout_s` seconds with `ToolTimeout` (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc

        worker = threading.Thread(target=target, daemon=True, name="tool-call")
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise ToolTimeout
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def on_alarm(signum: int, frame: Any) -> None:
        raise ToolTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    start = time.monotonic()
    pending, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)  # someone else's timer, if any
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending > 0:  # give it back what is left of it (at least a moment)
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - start), 1e-3))


class ToolBox:
    """The tools an environment offers, by registered name, and `run`, which never raises for
    anything the model wrote or a tool did."""

    def __init__(self, names: list[str], *, timeout_s: float = 2.0, max_chars: int = 200) -> None:
        if timeout_s <= 0:
            raise UserError(f"tool timeout_s must be > 0, got {timeout_s}")
        self.tools = {name: TOOLS.get(name) for name in names}
        self.schemas = {name: tool_schema(fn, name) for name, fn in self.tools.items()}
        self.timeout_s, self.max_chars = float(timeout_s), max_chars

    def run(self, call: ToolCall) -> ToolResult:
        """The result of one parsed call, an error message when it is invalid or fails."""
        if call.error is not None:
            return ToolResult(call.name, f"error: {call.error}", ok=False)
        if call.name not in self.tools:
            known = ", ".join(self.tools) or "none"
            return ToolResult(call.name, f"error: unknown tool {call.name!r} (tools: {known})",
                              ok=False)  # fmt: skip
        problem = check_arguments(self.schemas[call.name], call.arguments)
        if problem is not None:
            return ToolResult(call.name, f"error: {problem}", ok=False)
        fn = self.tools[call.name]
        try:
            value = call_with_timeout(lambda: fn(**call.arguments), self.timeout_s)
        except ToolTimeout:
            return ToolResult(call.name, f"error: timed out after {self.timeout_s:g} s", False)
        except Exception as exc:  # the tool's own failure goes back to the model
            return ToolResult(call.name, f"error: {type(exc).__name__}: {exc}"[: self.max_chars],
                              ok=False)  # fmt: skip
        text = value if isinstance(value, str) else json.dumps(value)
        return ToolResult(call.name, text[: self.max_chars], ok=True)


# ------------------------------------------------------------------ built-in tools

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}  # fmt: skip


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


@TOOLS.register("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses."""
    value = _evaluate(ast.parse(expression, mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)
