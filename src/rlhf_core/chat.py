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


def render_prompt(tokenizer: Any, prompt: str | Messages, *, where: str = "prompt") -> str:
    """The text the model sees before its reply (chat template with the generation prompt)."""
    return tokenizer.apply_chat_template(
        as_messages(prompt, where=where), tokenize=False, add_generation_prompt=True
    )


def completion_suffix(tokenizer: Any) -> str:
    """What ends an assistant turn in training targets: the tokenizer's eos token."""
    return tokenizer.eos_token


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
