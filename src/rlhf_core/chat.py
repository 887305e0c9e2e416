"""Prompts (strings or chat message lists) rendered as model text with the chat template.

A tokenizer without a chat template (GPT-2, most base models) gets `DEFAULT_CHAT_TEMPLATE`, the
plain "\\n\\nHuman: ...\\n\\nAssistant: ..." format of Anthropic HH, with a one-time warning;
`ModelConfig.chat_template` overrides either.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from rlhf_core.errors import UserError

Messages = list[dict[str, str]]

HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")
# a reasoning block (Qwen3, DeepSeek-R1): closed, or opened and cut off by the length budget
THINK_BLOCK = re.compile(r"<think>.*?(</think>|$)\s*", re.DOTALL)

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}{{ '\n\nHuman: ' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}{{ '\n\nAssistant: ' + message['content'] }}"
    "{%- if not loop.last -%}{{ eos_token }}{%- endif -%}"
    "{%- else -%}{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\n\nAssistant:' }}{%- endif -%}"
)


def ensure_chat_template(tokenizer: Any, override: str | None = None) -> None:
    """Give `tokenizer` a chat template: the override, its own, or the documented default."""
    if override is not None:
        tokenizer.chat_template = override
    elif not getattr(tokenizer, "chat_template", None):
        warnings.warn(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; using "
            "rlhf_core.chat.DEFAULT_CHAT_TEMPLATE (HH-style 'Human:/Assistant:' turns)",
            stacklevel=2,
        )
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE


def as_messages(prompt: str | Messages, *, where: str = "prompt") -> Messages:
    """A prompt as a message list: a string becomes one user turn; a list is checked."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    ):
        return prompt
    raise UserError(
        f"{where}: expected a string or a list of {{'role': str, 'content': str}} messages, "
        f"got {type(prompt).__name__}: {str(prompt)[:80]!r}"
    )


def set_thinking(tokenizer: Any, enable_thinking: bool | None) -> None:
    """Render prompts with `enable_thinking` (Qwen3's switch for its <think> block) from now on;
    None = the template's default. A template that does not read the variable gets a warning."""
    if enable_thinking is None:
        tokenizer.rlhf_template_kwargs = {}
        return
    if "enable_thinking" not in (getattr(tokenizer, "chat_template", None) or ""):
        warnings.warn(
            f"model.enable_thinking={enable_thinking}: the chat template of "
            f"{getattr(tokenizer, 'name_or_path', '?')!r} does not read enable_thinking; ignored",
            stacklevel=2,
        )
    tokenizer.rlhf_template_kwargs = {"enable_thinking": enable_thinking}


def render_prompt(tokenizer: Any, prompt: str | Messages, *, where: str = "prompt") -> str:
    """The text the model sees before its reply (chat template with the generation prompt, and
    the template variables set by `set_thinking`)."""
    return tokenizer.apply_chat_template(
        as_messages(prompt, where=where), tokenize=False, add_generation_prompt=True,
        **getattr(tokenizer, "rlhf_template_kwargs", {}),
    )  # fmt: skip


def strip_thinking(text: str) -> str:
    """`text` without its <think>...</think> blocks (an unclosed one runs to the end): what a
    verifier or reward model should score is the answer, not the reasoning."""
    return THINK_BLOCK.sub("", text) if "<think>" in text else text


# ------------------------------------------------------------------ preference rows


def split_hh_pair(chosen: str, rejected: str, *, where: str) -> tuple[Messages, str, str]:
    """(prompt messages, chosen completion, rejected completion) of an HH pair: the prompt ends
    at the last '\\n\\nAssistant:' inside the text the two transcripts share."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    cut = chosen.rfind("\n\nAssistant:", 0, shared + len("\n\nAssistant:"))
    if cut < 0:
        raise UserError(f"{where}: no shared '\\n\\nAssistant:' turn in the two transcripts")
    parts = HH_TURN.split(chosen[:cut])
    if parts[0].strip():
        raise UserError(f"{where}: transcript does not start with '\\n\\nHuman:'")
    roles = {"Human": "user", "Assistant": "assistant"}
    turns = zip(parts[1::2], parts[2::2], strict=True)
    messages = [{"role": roles[role], "content": content} for role, content in turns]
    if not messages:
        raise UserError(f"{where}: transcript has no prompt turns")
    start = cut + len("\n\nAssistant:")
    return messages, chosen[start:].lstrip(" "), rejected[start:].lstrip(" ")


def completion_text(value: Any, prompt: Messages, where: str) -> str:
    """A completion given as a string or as messages (possibly repeating the prompt)."""
    if isinstance(value, str):
        return value
    messages = as_messages(value, where=where)
    if messages[: len(prompt)] == prompt:
        messages = messages[len(prompt) :]
    if not messages or messages[-1]["role"] != "assistant":
        raise UserError(f"{where}: a message-list completion must end with an assistant turn")
    return messages[-1]["content"]
