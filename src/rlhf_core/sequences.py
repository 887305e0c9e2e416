"""`sequence_logprobs(model, batch)`: a model's log-probs of a batch's completion tokens, the one
entry point whatever the batch's layout.

    packed rows          `rlhf_core.layout.pack_groups` (a 4D mask, or the flat varlen layout):
                         one forward of the rows, attention per segment where the speed plan says
                         so (`rlhf_core.attention.fast_attention`) -> (1, N), one per target,
                         aligned with the batch's loss_mask (1, N)
    prompt + completion  `prompt_ids` / `prompt_mask` (B, P, left-padded) and `completion_ids` /
                         `completion_mask` (B, T, right-padded): equal prompts encoded once
                         through the KV cache (`rlhf_core.prefix`) -> (B, T), 0 off the mask
    rows                 `input_ids` / `attention_mask` (B, S) with `target_mask` or `loss_mask`
                         (B, S - 1; none = every next token): causal or encoder-decoder
                         (`rlhf_core.policy_model.policy_logprobs`) -> (B, S - 1), 0 off targets

Every path runs the LM head on the scored positions only, fused with the log-softmax
(`rlhf_core.logprobs.linear_token_logprobs`), where the model allows it, and all give the plain
padded forward's log-probs up to float rounding (tested in float64). Not here: the per-token
primitives (`rlhf_core.logprobs`: `token_logprobs` on logits, the fused head, masked sums).
"""

from __future__ import annotations

import torch

from rlhf_core.attention import fast_attention
from rlhf_core.fastpath import unwrapped
from rlhf_core.layout import is_packed, packed_attention_mask
from rlhf_core.logprobs import causal_lm_logprobs_at
from rlhf_core.policy_model import is_encoder_decoder, policy_logprobs
from rlhf_core.prefix import shared_prompt_logprobs

LogProbs = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
PROMPT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


def sequence_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
) -> LogProbs:
    """Log-probs under logits / `temperature` of `batch`'s completion tokens, by its layout (see
    the module docstring); with `with_entropy` also the entropies (not for packed rows)."""
    if is_packed(batch):
        if with_entropy:
            raise ValueError("sequence_logprobs: packed rows give log-probs only, no entropies")
        return _packed_logprobs(model, batch, temperature)[None]
    if all(k in batch for k in PROMPT_KEYS):
        ids, masks = (
            (batch["prompt_ids"], batch["completion_ids"]),
            (
                batch["prompt_mask"],
                batch["completion_mask"],
            ),
        )
        if not is_encoder_decoder(model):
            return shared_prompt_logprobs(
                model, ids[0], masks[0], ids[1], masks[1], temperature=temperature,
                chunk_rows=chunk_rows, with_entropy=with_entropy,
            )  # fmt: skip
        rows = {"input_ids": torch.cat(ids, 1), "attention_mask": torch.cat(masks, 1)}
        p = ids[0].shape[1]
        rows["target_mask"] = torch.zeros_like(rows["input_ids"][:, 1:], dtype=torch.bool)
        rows["target_mask"][:, p - 1 :] = masks[1].bool()
        out = sequence_logprobs(model, rows, temperature=temperature, with_entropy=with_entropy)
        return tuple(x[:, p - 1 :] for x in out) if with_entropy else out[:, p - 1 :]
    if "input_ids" not in batch or "attention_mask" not in batch:
        raise ValueError(
            "sequence_logprobs: a batch needs packed rows (rlhf_core.layout.pack_groups), "
            f"prompt and completion tensors {PROMPT_KEYS}, or input_ids and attention_mask; "
            f"got keys {sorted(batch)}"
        )
    ids, mask = batch["input_ids"], batch["attention_mask"]
    target = batch.get("target_mask", batch.get("loss_mask"))
    if target is None:
        target = torch.ones_like(ids[:, 1:], dtype=torch.bool)
    if target.shape != (ids.shape[0], ids.shape[1] - 1):
        raise ValueError(
            f"sequence_logprobs: target_mask {tuple(target.shape)} must be (B, S - 1) for "
            f"input_ids {tuple(ids.shape)}"
        )
    return policy_logprobs(
        model, ids, mask, target, temperature=temperature, with_entropy=with_entropy
    )


def _packed_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float
) -> torch.Tensor:
    """Log-probs (N,) of a `pack_groups` batch's targets under a causal LM: one forward of the
    packed rows, the LM head on the target positions only (`causal_lm_logprobs_at`), attention
    segment by segment where the speed plan says so (`fast_attention`)."""
    if "attention_mask" not in batch:  # the flat layout: sequences told apart by position ids
        return causal_lm_logprobs_at(
            model, batch["input_ids"], None, batch["position_ids"], batch["sources"],
            batch["targets"], temperature=temperature,
        )  # fmt: skip
    dtype = unwrapped(model).get_input_embeddings().weight.dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    mask = packed_attention_mask(
        unwrapped(model).config, batch["attention_mask"], batch["position_ids"], dtype
    )
    with fast_attention(model, batch.get("segments")):
        return causal_lm_logprobs_at(
            model, batch["input_ids"], mask, batch["position_ids"], batch["sources"],
            batch["targets"], temperature=temperature,
        )  # fmt: skip
