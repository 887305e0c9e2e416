"""`rlhf-lab chat`: talk to one or several checkpoints side by side in the browser (Gradio).

    rlhf-lab chat outputs/quickstart-*/sft/final outputs/quickstart-*/grpo/final \\
        [--reward-model outputs/quickstart-*/rm/final] [--port 7860]
    rlhf-lab chat --replay RUN_DIR [--trajectory ID]   # a multi-turn episode, in the terminal

Each DIR is a model directory (`save_pretrained`), a LoRA adapter directory (its base is read
from `adapter_config.json`), a hub id, or a tiny-world preset name (`tiny-qwen3`). One message
goes to every model; each replies in its own column, streamed token by token, through its own
tokenizer's chat template (the whole conversation, multi-turn). Sampling: temperature (0 =
greedy), top-p, max new tokens. With `--reward-model` (a reward model saved by `reward_models`,
or any `...ForSequenceClassification` directory) each reply's reward is shown under it, scored on
the reply without its <think> block.

Every reply is bounded (`ChatLimits`, each a command-line option), so whatever is typed is
answered within seconds with a visible note: a message over `--max-message-chars` (8,000) is not
sent; control characters and broken (surrogate) characters are removed; an empty message is not
sent; the conversation is cut to `--max-prompt-tokens` (2,048) and to what the model's positions
leave after the reply (the oldest turns first, then the message's end); max new tokens is at
most `--max-new-tokens` (1,024) and half the model's positions; a reply stops after
`--max-seconds` (60). A model that fails says so under its column; the page stays up.

The page is served on the loopback interface by default and never calls out: Gradio analytics
are off and the theme uses system fonts (no font CDN).

`--replay RUN_DIR --trajectory ID` prints one episode of a multi-turn run from its rollout log,
turn by turn, with each turn's role, tools and reward (`rlhf_lab.replay`); no page is served.

Not here: batching several users, images, tool calls.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# before gradio is imported: no usage analytics, no version check, no telemetry
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

from rlhf_core.errors import UserError, run_main  # noqa: E402

# C0 and C1 control characters except tab and newline (and carriage return, folded below)
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


@dataclass
class ChatModel:
    label: str
    model: Any
    tokenizer: Any


@dataclass(frozen=True)
class ChatLimits:
    """What one message and one reply may take (each a `rlhf-lab chat` option)."""

    max_message_chars: int = 8000
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 1024
    max_seconds: float = 60.0


def clean_message(text: Any, limits: ChatLimits) -> tuple[str | None, str]:
    """(the message to send, or None to send nothing; a note for the page, "" when none): a
    message over the character limit or empty is not sent; control characters and characters
    that are not valid Unicode (lone surrogates) are removed, with a note."""
    text = content_text(text) if text is not None else ""
    if len(text) > limits.max_message_chars:
        limit = f"{limits.max_message_chars:,} (rlhf-lab chat --max-message-chars)"
        return None, f"Message not sent: it has {len(text):,} characters; the limit is {limit}."
    valid = text.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate becomes "?"
    broken = sum(a != b for a, b in zip(text, valid, strict=True))
    cleaned = CONTROL_CHARS.sub("", valid.replace("\r\n", "\n").replace("\r", "\n"))
    removed = len(valid.replace("\r\n", "\n")) - len(cleaned)
    notes = [f"{removed:,} control characters removed"] if removed else []
    notes += [f"{broken:,} invalid characters replaced by '?'"] if broken else []
    if not cleaned.strip():
        return None, "Message not sent: it is empty" + (f" ({notes[0]})." if notes else ".")
    return cleaned, ("From your message: " + "; ".join(notes) + ".") if notes else ""


def model_positions(model: Any) -> int | None:
    """How many positions the model takes (None when its config does not say)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def fit_prompt(tokenizer: Any, messages: list[dict[str, str]], max_tokens: int):
    """(prompt token ids, at most `max_tokens`; a note, "" when nothing was cut): the oldest
    turns are left out first, then the last message is cut to its first tokens."""
    from rlhf_core.chat import render_prompt

    def encode(msgs: list[dict[str, str]]) -> list[int]:
        text = render_prompt(tokenizer, msgs, where="chat")
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    msgs, dropped, notes = list(messages), 0, []
    ids = encode(msgs)
    while len(ids) > max_tokens and len(msgs) > 1:  # the oldest turn first
        msgs, dropped = msgs[1:], dropped + 1
        ids = encode(msgs)
    if dropped:
        notes.append(f"the oldest {dropped} message(s) were left out")
    content = msgs[-1]["content"]
    total = len(tokenizer(content, add_special_tokens=False)["input_ids"])
    for _ in range(8):  # the last message cut to its first tokens (decoding may re-split a few)
        if len(ids) <= max_tokens:
            break
        kept = tokenizer(content, add_special_tokens=False)["input_ids"]
        content = tokenizer.decode(kept[: max(0, len(kept) - (len(ids) - max_tokens) - 1)])
        msgs[-1] = {**msgs[-1], "content": content}
        ids = encode(msgs)
    else:
        ids = ids[-max_tokens:]  # still over (a template longer than the limit): keep its end
    if content != messages[-1]["content"]:
        kept = len(tokenizer(content, add_special_tokens=False)["input_ids"])
        notes.append(f"your message was cut to its first {kept:,} of {total:,} tokens")
    note = f"Prompt cut to {max_tokens:,} tokens: " + " and ".join(notes) + "." if notes else ""
    return ids, note


def load_chat_model(spec: str) -> ChatModel:
    """A causal LM and its tokenizer from a model dir, adapter dir, hub id or tiny preset."""
    from rlhf_core.models import LoraConfig, ModelConfig, load_policy, load_tokenizer

    path = Path(spec)
    adapter = path / "adapter_config.json"
    if adapter.is_file():
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        if not base:
            raise UserError(f"chat: {adapter} names no base_model_name_or_path")
        cfg = ModelConfig(name_or_path=base, lora=LoraConfig())
        model = load_policy(cfg, weights_from=path)
        has_tokenizer = (path / "tokenizer_config.json").is_file()
        tokenizer = load_tokenizer(
            ModelConfig(name_or_path=str(path) if has_tokenizer else base), padding_side="left"
        )
    else:
        if path.exists() and not (path / "config.json").is_file():
            raise UserError(f"chat: {spec} is neither a model nor a LoRA adapter directory")
        cfg = ModelConfig(name_or_path=spec)
        model = load_policy(cfg)
        tokenizer = load_tokenizer(cfg, padding_side="left")
    parts = path.parts
    label = "/".join(parts[-2:]) if len(parts) > 1 else spec
    return ChatModel(label=label, model=model.eval(), tokenizer=tokenizer)


def stream_reply(
    chat: ChatModel, messages: list[dict[str, str]], *, temperature: float, top_p: float,
    max_new_tokens: int, limits: ChatLimits = ChatLimits(),
) -> Iterator[tuple[str, str]]:  # fmt: skip
    """Yield (the reply text so far, a note on what was cut or went wrong) token by token
    (transformers' TextIteratorStreamer), within `limits`: the prompt cut to fit, max new tokens
    capped, generation stopped after `limits.max_seconds`. An error in the model is a note."""
    from transformers import TextIteratorStreamer

    tok, notes = chat.tokenizer, []
    positions = model_positions(chat.model)
    budget = max(1, min(int(max_new_tokens), limits.max_new_tokens))
    if positions is not None and budget > positions // 2:
        budget = positions // 2
    if budget != int(max_new_tokens):
        notes.append(f"max new tokens {int(max_new_tokens):,} capped at {budget:,}")
    room = limits.max_prompt_tokens if positions is None else min(
        limits.max_prompt_tokens, positions - budget)  # fmt: skip
    ids, cut = fit_prompt(tok, messages, room)
    notes += [cut] if cut else []
    device = next(chat.model.parameters()).device
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True,
                                    timeout=limits.max_seconds + 30)  # fmt: skip
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p}
    kwargs = {
        "input_ids": torch.tensor([ids], device=device),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long, device=device),
        "streamer": streamer, "max_new_tokens": budget, "max_time": limits.max_seconds,
        "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
        **(sampling if temperature > 0 else {"do_sample": False}),
    }  # fmt: skip
    failed: list[BaseException] = []

    def generate() -> None:
        try:
            with torch.no_grad():
                chat.model.generate(**kwargs)
        except Exception as exc:  # noqa: BLE001 - shown on the page, the server stays up
            failed.append(exc)
            streamer.text_queue.put(streamer.stop_signal)

    start, text = time.monotonic(), ""
    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    try:
        for piece in streamer:
            text += piece
            yield text, " ".join(notes)
    except queue.Empty:
        notes.append(f"No token came for {limits.max_seconds + 30:.0f} s; stopped waiting.")
    thread.join(timeout=5)
    if failed:
        notes.append(f"The model failed: {type(failed[0]).__name__}: {failed[0]}".splitlines()[0])
    elif time.monotonic() - start >= limits.max_seconds:
        notes.append(f"Stopped after {limits.max_seconds:g} s (rlhf-lab chat --max-seconds).")
    yield text, " ".join(notes)


def content_text(content: Any) -> str:
    """A Gradio message's content as plain text (it may be a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def respond(
    models: list[ChatModel], reward_model: Any | None, limits: ChatLimits, text: Any,
    temperature: float, top_p: float, budget: float, *histories: Any,
) -> Iterator[tuple[Any, ...]]:  # fmt: skip
    """One turn of the page: yields (the message box, *histories, *each model's notes, the
    page's notice) as the replies stream in. A message that is not sent stays in the box."""
    from rlhf_core.chat import strip_thinking

    histories = [list(h or []) for h in histories]
    notes = [""] * len(models)
    message, notice = clean_message(text, limits)
    if message is None:  # a message too long stays in the box, to be shortened
        long = isinstance(text, str) and len(text) > limits.max_message_chars
        yield (text if long else "", *histories, *notes, notice)
        return
    for h in histories:
        h.append({"role": "user", "content": message})
        h.append({"role": "assistant", "content": ""})
    for i, m in enumerate(models):
        convo = [{"role": x["role"], "content": content_text(x["content"])}
                 for x in histories[i][:-1]]  # fmt: skip
        reply = ""
        try:
            for reply, note in stream_reply(m, convo, temperature=temperature, top_p=top_p,
                                            max_new_tokens=int(budget), limits=limits):  # fmt: skip
                histories[i][-1] = {"role": "assistant", "content": reply}
                notes[i] = note
                yield ("", *histories, *notes, notice)
            if reward_model is not None:
                score = reward_model.score([convo], [strip_thinking(reply)])[0]
                notes[i] = f"reward: **{float(score):.4f}** {notes[i]}".strip()
        except Exception as exc:  # noqa: BLE001 - a note under the column; the page stays up
            notes[i] = f"{notes[i]} Failed: {type(exc).__name__}: {exc}".strip().splitlines()[0]
        if not reply.strip():
            histories[i][-1] = {"role": "assistant", "content": "(empty reply)"}
        yield ("", *histories, *notes, notice)


def build_app(
    models: list[ChatModel], reward_model: Any | None = None, limits: ChatLimits = ChatLimits()
):
    """The Gradio Blocks page: one chat column per model, a shared message box and controls."""
    import gradio as gr

    theme = gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )
    with gr.Blocks(title="rlhf-lab chat", theme=theme) as app:
        gr.Markdown("## rlhf-lab chat\nOne message goes to every model; replies stream in.")
        boxes, rewards = [], []
        with gr.Row():
            for i, m in enumerate(models):
                with gr.Column():
                    boxes.append(gr.Chatbot(label=m.label, elem_id=f"chat-{i}", height=360))
                    rewards.append(gr.Markdown("", elem_id=f"reward-{i}"))
        with gr.Row():
            message = gr.Textbox(placeholder="Type a message", show_label=False, scale=5,
                                 elem_id="message")  # fmt: skip
            send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            clear = gr.Button("Clear", scale=1, elem_id="clear")
        with gr.Row():
            temperature = gr.Slider(
                0.0, 2.0, value=0.7, step=0.05, label="temperature (0 = greedy)"
            )
            top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
            max_new = gr.Slider(1, limits.max_new_tokens, value=min(64, limits.max_new_tokens),
                                step=1, label="max new tokens")  # fmt: skip
        notice = gr.Markdown("", elem_id="notice")

        def on_send(text: str, temp: float, p: float, budget: float, *histories):
            yield from respond(models, reward_model, limits, text, temp, p, budget, *histories)

        inputs = [message, temperature, top_p, max_new, *boxes]
        outputs = [message, *boxes, *rewards, notice]
        send.click(on_send, inputs, outputs)
        message.submit(on_send, inputs, outputs)
        clear.click(lambda: [[] for _ in boxes] + [""] * (len(rewards) + 1), None,
                    [*boxes, *rewards, notice])  # fmt: skip
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf-lab chat", description="chat with checkpoints")
    parser.add_argument("models", nargs="*", help="model dirs, adapter dirs, hub ids or presets")
    parser.add_argument(
        "--replay",
        type=Path,
        metavar="RUN_DIR",
        help="print an episode of a multi-turn run's rollout log instead",
    )
    parser.add_argument(
        "--trajectory",
        type=int,
        metavar="ID",
        help="with --replay: the trajectory id (without: list a step's)",
    )
    parser.add_argument("--step", type=int, help="with --replay and no --trajectory: the step")
    parser.add_argument("--reward-model", help="score each reply with this reward model")
    parser.add_argument("--host", default="127.0.0.1", help="interface to serve on")
    parser.add_argument("--port", type=int, default=7860, help="port")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    for name, kind, what in (
        ("max_message_chars", int, "longest message sent, in characters"),
        ("max_prompt_tokens", int, "longest prompt (the conversation), in tokens"),
        ("max_new_tokens", int, "most new tokens per reply"),
        ("max_seconds", float, "most seconds per reply"),
    ):
        value = getattr(ChatLimits(), name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value,
                            help=f"{what} (default {value})")  # fmt: skip
    args = parser.parse_args(argv)
    if args.replay is not None:
        if args.models:
            raise UserError("chat: --replay RUN_DIR takes no model directories")
        from rlhf_lab.replay import main as replay_main

        return replay_main(args.replay, args.trajectory, args.step)
    if args.trajectory is not None or args.step is not None:
        raise UserError("chat: --trajectory and --step go with --replay RUN_DIR")
    if not args.models:
        raise UserError("chat: name at least one model directory, or --replay RUN_DIR")
    limits = ChatLimits(args.max_message_chars, args.max_prompt_tokens, args.max_new_tokens,
                        args.max_seconds)  # fmt: skip
    sizes = (limits.max_message_chars, limits.max_prompt_tokens, limits.max_new_tokens)
    if min(sizes) < 1 or not limits.max_seconds > 0:
        raise UserError("chat: --max-message-chars, --max-prompt-tokens, --max-new-tokens and "
                        "--max-seconds must be positive")  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    models = [load_chat_model(spec) for spec in args.models]
    reward_model = None
    if args.reward_model:
        from rlhf_core.scalar_head import ScalarHeadModel

        reward_model = ScalarHeadModel.from_pretrained(args.reward_model)
    app = build_app(models, reward_model, limits)
    print(f"rlhf-lab chat: {', '.join(m.label for m in models)} on http://{args.host}:{args.port}",
          flush=True)  # fmt: skip
    app.queue().launch(server_name=args.host, server_port=args.port, share=False,
                       show_error=True, inbrowser=False)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
