"""Sequence log-probs of preference batches, for the policy and the reference.

`pair_logps` runs the chosen and rejected sequences of a batch through the model in ONE forward
and returns the summed completion log-probs (B,) of each: packed rows [prompt | chosen |
rejected] that encode each prompt once (`pack_pairs`, the default for SDPA/eager causal models),
or 2B rows, prompt + chosen then prompt + rejected (`collate_pairs`).

The reference pi_ref comes in three modes (`reference.mode`):
  model        a frozen copy of the starting policy, loaded separately (full or LoRA training)
  adapter      the LoRA policy itself with its adapter disabled: no second copy of the weights
  precomputed  log-probs of every train/eval pair computed once before training with the
               starting policy and cached in `<run_dir>/reference_logps.pt`; no reference model
               is held while training (the cache is reused on resume)
All three give the same numbers (tested).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from rlhf_core.layout import is_packed, stream_sums
from rlhf_core.logprobs import masked_sum
from rlhf_core.models import ReferencePolicy
from rlhf_core.preference import PreferencePair, collate_pairs
from rlhf_core.sequences import sequence_logprobs


def pair_logps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed completion log-probs, each (B,), from one forward."""
    if is_packed(batch):
        both = stream_sums(sequence_logprobs(model, batch)[0], batch).view(-1, 2)
        return both[:, 0], both[:, 1]
    token_logps = sequence_logprobs(model, batch)
    seq = masked_sum(token_logps, batch["loss_mask"], dim=-1)
    half = seq.shape[0] // 2
    return seq[:half], seq[half:]


@torch.no_grad()
def reference_pair_logps(
    reference: ReferencePolicy, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    with reference.model() as ref:
        return pair_logps(ref, batch)


@torch.no_grad()
def precompute_reference(
    reference: ReferencePolicy,
    pairs: list[PreferencePair],
    *,
    pad_id: int,
    batch_size: int,
    device: torch.device,
    collate: Callable[..., dict[str, torch.Tensor]] = collate_pairs,
) -> torch.Tensor:
    """Reference log-probs of every pair, (N, 2) = [chosen, rejected], in pair order."""
    out = []
    for start in range(0, len(pairs), batch_size):
        batch = collate(pairs[start : start + batch_size], pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        chosen, rejected = reference_pair_logps(reference, batch)
        out.append(torch.stack([chosen, rejected], dim=-1).float().cpu())
    return torch.cat(out)


def save_reference_cache(path: Path, cache: dict[str, torch.Tensor]) -> None:
    """Atomic write of the precomputed reference log-probs."""
    tmp = path.with_suffix(".tmp")
    torch.save(cache, tmp)
    os.replace(tmp, path)


def load_reference_cache(path: Path, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    cache = torch.load(path, map_location="cpu", weights_only=True)
    for split, n in sizes.items():
        if split not in cache or cache[split].shape != (n, 2):
            raise ValueError(
                f"{path}: cached reference log-probs for {split!r} do not match the data "
                f"({n} pairs expected); delete the file to recompute"
            )
    return cache
