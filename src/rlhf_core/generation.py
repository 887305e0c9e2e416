"""Batched generation with transformers `generate` (KV cache, left padding).

`generate_completions` takes rendered prompt texts and returns, per prompt, the completion token
ids (up to and including the first eos), the decoded text (special tokens removed) and whether it
was truncated at `max_new_tokens` without an eos. temperature 0 means greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    truncated: bool


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    batch_size: int = 64,
) -> list[Completion]:
    """Complete each prompt text; see the module docstring."""
    if tokenizer.padding_side != "left":
        raise ValueError(
            "generate_completions needs a left-padding tokenizer (padding_side='left')"
        )
    device = next(model.parameters()).device
    eos_id = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    out: list[Completion] = []
    sampling: dict = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        if min_p > 0:
            sampling["min_p"] = min_p
    try:
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(
                prompts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(device)
            generated = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_id,
                pad_token_id=tokenizer.pad_token_id,
                use_cache=True,
                **sampling,
            )
            new_tokens = generated[:, batch["input_ids"].shape[1] :].tolist()
            for row in new_tokens:
                if eos_id in row:
                    ids, truncated = row[: row.index(eos_id) + 1], False
                else:
                    ids, truncated = row, True
                text = tokenizer.decode(ids, skip_special_tokens=True)
                out.append(Completion(token_ids=ids, text=text, truncated=truncated))
    finally:
        model.train(was_training)
    return out
