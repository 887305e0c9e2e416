"""Held-out evaluation of a preference-trained policy, and sampled generations for inspection.

`evaluate_pairs` reports the loss and its metrics (implicit reward accuracy and margins,
log-probs) averaged over held-out pairs. `write_samples` appends a few generations from held-out
prompts to `<run_dir>/samples.jsonl`, so how the policy's outputs drift can be read directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from direct_alignment.losses import loss_inputs
from direct_alignment.reference import pair_logps
from rlhf_core.generation import Sampling, generate_completions
from rlhf_core.models import eval_mode, with_padding_side
from rlhf_core.preference import PreferencePair, collate_pairs


@torch.no_grad()
def evaluate_pairs(
    model: torch.nn.Module,
    loss_fn: torch.nn.Module,
    pairs: list[PreferencePair],
    reference_logps: Callable[[dict[str, torch.Tensor], slice], tuple[torch.Tensor, torch.Tensor]]
    | None,
    *,
    pad_id: int,
    batch_size: int,
    collate: Callable[..., dict[str, torch.Tensor]] = collate_pairs,
) -> dict[str, float]:
    """Pair-weighted means of the loss and its metrics over `pairs`, keys prefixed 'eval/';
    `collate` makes the batches (`collate_pairs`, or the packed `pack_pairs`)."""
    device = next(model.parameters()).device
    totals: dict[str, float] = {}
    with eval_mode(model):
        for start in range(0, len(pairs), batch_size):
            chunk = slice(start, min(start + batch_size, len(pairs)))
            batch = {k: v.to(device) for k, v in collate(pairs[chunk], pad_id).items()}
            chosen, rejected = pair_logps(model, batch)
            refs = reference_logps(batch, chunk) if reference_logps is not None else (None, None)
            loss, metrics = loss_fn(chosen, rejected, *refs, **loss_inputs(batch))
            n = chunk.stop - chunk.start
            for key, value in {"loss": loss, **metrics}.items():
                totals[key] = totals.get(key, 0.0) + float(value) * n
    return {f"eval/{k}": v / len(pairs) for k, v in totals.items()}


def write_samples(
    model: torch.nn.Module,
    tokenizer,
    pairs: list[PreferencePair],
    path: Path | None,
    *,
    step: int,
    max_new_tokens: int,
    seed: int,
) -> None:
    """Sample (T=1) one completion per prompt under a forked RNG and append them as JSON lines
    to `path` (None: sample only, as the processes other than the main one do)."""
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        outs = generate_completions(
            model, with_padding_side(tokenizer, "left"), [p.prompt_text for p in pairs],
            max_new_tokens=max_new_tokens, sampling=Sampling(temperature=1.0),
        )  # fmt: skip
    if path is None:
        return
    with open(path, "a") as fh:
        for pair, out in zip(pairs, outs, strict=True):
            row = {
                "step": step,
                "prompt": pair.prompt_text,
                "completion": out.text,
                "chosen": tokenizer.decode(pair.chosen_ids, skip_special_tokens=True),
            }
            fh.write(json.dumps(row) + "\n")


def keep_samples_through(path: Path, step: int) -> None:
    """On resume from checkpoint-<step>: drop the sample lines of later steps (they are redone;
    a kill after writing a step's samples, before its checkpoint, would log them twice)."""
    if not path.is_file():
        return
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    kept = [x for x in lines if json.loads(x)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    os.replace(tmp, path)
