"""Held-out evaluation for SFT: teacher-forced completion loss and task accuracy by generation.

Accuracy is measured by generating from the rendered prompt: greedy, and optionally one sample at
T=1 per prompt (under a forked, seeded RNG so evaluation never changes the training run's random
stream). Reported: exact match and the task's partial-credit score (`rlhf_core.scoring`).

With several processes (`shard=(rank, world)`) each evaluates every world-th example and the
per-example results are gathered, so every process returns the same numbers. Greedy results
equal one process's; sampled ones are drawn from each process's own seeded stream.
"""

from __future__ import annotations

from functools import partial

import torch

from instruction_tuning.data import SFTData, collate, pack
from instruction_tuning.losses import CompletionNLLLoss
from rlhf_core.fastpath import speed_plan
from rlhf_core.generation import Sampling, generate_completions
from rlhf_core.models import with_padding_side
from rlhf_core.scoring import exact_match, task_score
from rlhf_core.sequences import sequence_logprobs


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer,
    data: SFTData,
    *,
    batch_size: int,
    max_new_tokens: int,
    sampled: bool,
    seed: int,
    shard: tuple[int, int] = (0, 1),
    packing: bool = True,
) -> dict[str, float]:
    """Eval loss (per completion token), greedy (and sampled) exact match, task score, length.
    `shard` = (rank, world): this process's share; every process must call it (see above).
    `packing`: the loss over packed rows where the model takes them (`rlhf_core.layout`)."""
    rank, world = shard
    examples = data.examples[rank::world]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll_sum, tokens = 0.0, 0
    loss_fn = CompletionNLLLoss()
    layout = speed_plan(model).layout if packing else "padded"
    batcher = {"segmented": pack, "mask": pack, "flat": partial(pack, flat=True)}.get(
        layout, collate
    )
    for start in range(0, len(examples), batch_size):
        batch = batcher(examples[start : start + batch_size], tokenizer.pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        logps = sequence_logprobs(model, batch)
        _, metrics = loss_fn(logps, batch["loss_mask"], 1.0)
        nll_sum += metrics["nll_sum"].item()
        tokens += int(metrics["tokens"].item())
    nll_sum, tokens = (sum(x) for x in zip(*gather([(nll_sum, tokens)], world), strict=True))
    results = {"eval/loss": nll_sum / max(1, tokens)}

    left = with_padding_side(tokenizer, "left")
    prompts = [e.prompt_text for e in examples]
    modes = [("greedy", 0.0)] + ([("sampled", 1.0)] if sampled else [])
    for label, temperature in modes:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            outs = generate_completions(
                model,
                left,
                prompts,
                max_new_tokens=max_new_tokens,
                sampling=Sampling(temperature=temperature),
                batch_size=batch_size,
            )
        rows = gather([
            (exact_match(o.text, e.reference),
             task_score(o.text, e.reference, e.entry, data.scorer), len(o.token_ids))
            for o, e in zip(outs, examples, strict=True)
        ], world)  # fmt: skip
        exact, score, length = zip(*rows, strict=True)
        results[f"eval/{label}_exact_match"] = sum(exact) / len(exact)
        results[f"eval/{label}_task_score"] = sum(score) / len(score)
        results[f"eval/{label}_length"] = sum(length) / len(length)
    model.train(was_training)
    return results


def gather(rows: list, world: int) -> list:
    """Every process's `rows`, concatenated in rank order (as is with one process)."""
    if world == 1:
        return rows
    from accelerate.utils import gather_object

    return gather_object(rows)
