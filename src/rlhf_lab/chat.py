"""`rlhf-lab chat`: talk to one or several checkpoints side by side in the browser (Gradio).

    rlhf-lab chat outputs/quickstart-*/sft/final outputs/quickstart-*/grpo/final \\
        [--reward-model outputs/quickstart-*/rm/final] [--port 7860]

Each DIR is a model directory (`save_pretrained`), a LoRA adapter directory (its base is read
from `adapter_config.json`), a hub id, or a tiny-world preset name (`tiny-qwen3`). One message
goes to every model; each replies in its own column, streamed token by token, through its own
tokenizer's chat template (the whole conversation, multi-turn). Sampling: temperature (0 =
greedy), top-p, max new tokens. With `--reward-model` (a reward model saved by `reward_models`,
or any `...ForSequenceClassification` directory) each reply's reward is shown under it, scored on
the reply without its <think> block.

The page is served on the loopback interface by default and never calls out: Gradio analytics
are off and the theme uses system fonts (no font CDN).

Not here: batching several users, images, tool calls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# before gradio is imported: no usage analytics, no version check, no telemetry
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

from rlhf_core.errors import UserError, run_main  # noqa: E402


@dataclass
class ChatModel:
    label: str
    model: Any
    tokenizer: Any


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
    max_new_tokens: int,
):  # fmt: skip
    """Yield the reply text so far, token by token (transformers' TextIteratorStreamer)."""
    from transformers import TextIteratorStreamer

    from rlhf_core.chat import render_prompt

    tok = chat.tokenizer
    prompt = render_prompt(tok, messages, where="chat")
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    device = next(chat.model.parameters()).device
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True, timeout=120)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p}
    kwargs = {
        **{k: v.to(device) for k, v in enc.items()}, "streamer": streamer,
        "max_new_tokens": int(max_new_tokens), "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        **(sampling if temperature > 0 else {"do_sample": False}),
    }  # fmt: skip

    def generate() -> None:
        with torch.no_grad():
            chat.model.generate(**kwargs)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    text = ""
    for piece in streamer:
        text += piece
        yield text
    thread.join()


def content_text(content: Any) -> str:
    """A Gradio message's content as plain text (it may be a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def build_app(models: list[ChatModel], reward_model: Any | None = None):
    """The Gradio Blocks page: one chat column per model, a shared message box and controls."""
    import gradio as gr

    from rlhf_core.chat import strip_thinking

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
            max_new = gr.Slider(1, 1024, value=64, step=1, label="max new tokens")

        def respond(text: str, temp: float, p: float, budget: float, *histories):
            histories = [list(h or []) for h in histories]
            notes = [""] * len(models)
            if not text.strip():
                yield ("", *histories, *notes)
                return
            for h in histories:
                h.append({"role": "user", "content": text})
                h.append({"role": "assistant", "content": ""})
            for i, m in enumerate(models):
                convo = [{"role": x["role"], "content": content_text(x["content"])}
                         for x in histories[i][:-1]]  # fmt: skip
                reply = ""
                for reply in stream_reply(m, convo, temperature=temp, top_p=p,
                                          max_new_tokens=int(budget)):  # fmt: skip
                    histories[i][-1] = {"role": "assistant", "content": reply}
                    yield ("", *histories, *notes)
                if not reply.strip():
                    histories[i][-1] = {"role": "assistant", "content": "(empty reply)"}
                if reward_model is not None:
                    score = reward_model.score([convo], [strip_thinking(reply)])[0]
                    notes[i] = f"reward: **{float(score):.4f}**"
                yield ("", *histories, *notes)

        inputs = [message, temperature, top_p, max_new, *boxes]
        outputs = [message, *boxes, *rewards]
        send.click(respond, inputs, outputs)
        message.submit(respond, inputs, outputs)
        clear.click(lambda: [[] for _ in boxes] + [""] * len(rewards), None, [*boxes, *rewards])
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf-lab chat", description="chat with checkpoints")
    parser.add_argument("models", nargs="+", help="model dirs, adapter dirs, hub ids or presets")
    parser.add_argument("--reward-model", help="score each reply with this reward model")
    parser.add_argument("--host", default="127.0.0.1", help="interface to serve on")
    parser.add_argument("--port", type=int, default=7860, help="port")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = [load_chat_model(spec) for spec in args.models]
    reward_model = None
    if args.reward_model:
        from rlhf_core.scalar_head import ScalarHeadModel

        reward_model = ScalarHeadModel.from_pretrained(args.reward_model)
    app = build_app(models, reward_model)
    print(f"rlhf-lab chat: {', '.join(m.label for m in models)} on http://{args.host}:{args.port}",
          flush=True)  # fmt: skip
    app.queue().launch(server_name=args.host, server_port=args.port, share=False,
                       show_error=True, inbrowser=False)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
