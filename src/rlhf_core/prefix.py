"""A shared prefix through the KV cache: prompts encoded once for all the rows that continue them.

GRPO's groups (the G samples of a prompt, found by comparing the prompts:
`shared_prompt_logprobs`) and a reward model's pairs under flash-attention 2 (no 4D mask,
`reward_models.models`) run the distinct prompts once; their keys and values are gathered for
the rows that continue them, and the completions attend to them through the KV cache
(`shared_prefix_forward`). Gradients flow through the cache into the prompt's single forward,
so they are the sum over its rows, as with separate rows (tested in float64 against the flat
[prompt | completion] rows). The rows stay rows (no packing), which suits sampled completions of
one length budget. Needs the cache, so not under activation checkpointing (the flat rows then).

The other way to share a prompt, packed rows with a 4D mask, is `rlhf_core.layout`; the one entry
point for log-probs of either is `rlhf_core.sequences.sequence_logprobs`.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.attention import fast_attention
from rlhf_core.distributed import run_as_root_forward
from rlhf_core.logprobs import (
    causal_lm_selected_logprobs,
    decoder_and_head,
    fused_head_logprobs,
    scatter_selected,
)


def _checkpointing(model: torch.nn.Module) -> bool:
    """True when a module of `model` recomputes activations in training (transformers then drops
    the KV cache, so a shared-prompt forward through the cache is impossible)."""
    return model.training and any(
        getattr(m, "gradient_checkpointing", False) is True for m in model.modules()
    )


def shared_prompt_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T) of completions (B, T, right-padded, `completion_mask`) continuing
    left-padded prompts (B, P), 0 off the mask; with `with_entropy` also the entropies. Rows whose
    prompts are equal (GRPO's G samples of a group, wherever they sit in the batch) share one
    encoding of the prompt: the U distinct prompts run once, their keys and values are gathered
    for the B rows, and the completions attend to them through the KV cache; gradients flow
    through the cache into the prompt's single forward, so they are the sum over the group, as
    with B separate rows (tested against `causal_lm_selected_logprobs` on [prompt | completion]
    rows in float64). The state that predicts a completion's first token is the prompt's last
    one. Falls back to the flat rows where the decoder and head cannot run apart (see
    `causal_lm_selected_logprobs`) or where activation checkpointing drops the cache."""
    if prompt_ids.shape != prompt_mask.shape or completion_ids.shape != completion_mask.shape:
        raise ValueError(
            f"shared_prompt_logprobs: ids and masks must match, got prompt "
            f"{tuple(prompt_ids.shape)} / {tuple(prompt_mask.shape)}, completion "
            f"{tuple(completion_ids.shape)} / {tuple(completion_mask.shape)}"
        )
    if not bool(prompt_mask[:, -1].all()):
        raise ValueError("shared_prompt_logprobs: prompts must be left-padded (last column real)")
    parts = decoder_and_head(model)
    if parts is None or _checkpointing(model):
        ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1)
        target = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
        target[:, prompt_ids.shape[1] - 1 :] = completion_mask.bool()
        out = causal_lm_selected_logprobs(
            model, ids, mask, target, temperature=temperature, chunk_rows=chunk_rows,
            with_entropy=with_entropy,
        )  # fmt: skip
        p = prompt_ids.shape[1] - 1
        return tuple(x[:, p:] for x in out) if with_entropy else out[:, p:]
    return run_as_root_forward(
        model, _shared_prompt_fused, *parts, prompt_ids, prompt_mask, completion_ids,
        completion_mask, temperature, chunk_rows, with_entropy,
    )  # fmt: skip


def _shared_prompt_fused(
    decoder, head, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
    chunk_rows, with_entropy,
):  # fmt: skip
    """The distinct prompts once, the completions through their gathered KV cache, then the fused
    head on the completion positions (see `shared_prompt_logprobs`)."""
    width = prompt_ids.shape[1]
    rows = torch.cat([prompt_ids.masked_fill(prompt_mask == 0, 0), prompt_mask.long()], 1)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    prompt_states, hidden = shared_prefix_forward(
        decoder, distinct[:, :width], distinct[:, width:], completion_ids, completion_mask, inverse
    )
    # the state predicting completion token t: the prompt's last for t = 0, else completion t - 1
    # index_select, not `[inverse]`: its backward sums each group's rows in a fixed order (see
    # `_gather_cache_rows`)
    states = torch.cat([prompt_states[:, -1:].index_select(0, inverse), hidden[:, :-1]], 1)
    select = completion_mask.bool()
    picked = fused_head_logprobs(
        head, states[select], completion_ids[select], temperature, chunk_rows, with_entropy
    )
    return scatter_selected(select, picked, with_entropy)


def shared_prefix_forward(
    decoder: torch.nn.Module,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prefix_of: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that continue shared prefixes, through the prefixes' KV cache: the prefixes (U, P),
    left-padded, run once; row b of `input_ids` / `attention_mask` (B, T), right-padded,
    continues prefix `prefix_of[b]` and attends to its keys and values through the cache, so
    gradients flow through the cache into the prefix's single forward (summed over its rows, as
    with B separate rows). Returns the decoder's hidden states of the prefixes (U, P, H) and of
    the continuations (B, T, H), equal up to float rounding to those of each prefix +
    continuation as one row (tested). `decoder`: a transformers base model (no LM head)."""
    prefix_mask, attention_mask = prefix_mask.long(), attention_mask.long()
    # one embedding lookup for both passes: a second would add a second dense (vocab x hidden)
    # embedding gradient in the backward
    embed = decoder.get_input_embeddings()
    both = embed(torch.cat([prefix_ids.reshape(-1), input_ids.reshape(-1)]))
    n = prefix_ids.numel()
    with fast_attention(decoder):
        prefix = decoder(
            inputs_embeds=both[:n].view(*prefix_ids.shape, -1), attention_mask=prefix_mask,
            position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
        )  # fmt: skip
        cache = prefix.past_key_values
        _gather_cache_rows(cache, prefix_of)
        starts = prefix_mask.sum(-1, keepdim=True)[prefix_of]
        hidden = decoder(
            inputs_embeds=both[n:].view(*input_ids.shape, -1),
            attention_mask=torch.cat([prefix_mask[prefix_of], attention_mask], 1),
            position_ids=starts + (attention_mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=cache, use_cache=True,
        ).last_hidden_state  # fmt: skip
    return prefix.last_hidden_state, hidden


def _gather_cache_rows(cache: Any, index: torch.Tensor) -> None:
    """Row b of every layer's keys and values becomes row `index[b]`, in place, by `index_select`.
    transformers' `batch_select_indices` indexes with `keys[index]`, whose backward on CPU is an
    accumulating `index_put_` that adds a group's G rows in whatever order the threads finish:
    the prompt's gradient then differs in the last bits from run to run (measured: a quickstart
    GRPO run's second micro-batch differed at 1e-7, and 80 steps later its held-out score by 4
    points). `index_select`'s backward (`index_add_`) adds them in a fixed order."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(x, "keys") and hasattr(x, "values") for x in layers):
        cache.batch_select_indices(index)  # another cache layout: transformers' own gather
        return
    for layer in layers:
        if isinstance(layer.keys, torch.Tensor) and layer.keys.numel():
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
