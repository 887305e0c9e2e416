"""The LM-likelihood feature of a preference reward model: each token's score adds
w * log p(token | what precedes it) under the backbone's own language model.

A reward model trained with `lm_likelihood` (reward_models `RMConfig.lm_likelihood`) on a pooled
(mean or sum) completion then holds w * the completion's log-likelihood next to its learned
scores. The language model is the backbone's tied LM head, i.e. its input embeddings: the hidden
state before a token, through those embeddings, gives the token's logits. The log-prob of the
token is computed fused (`rlhf_core.logprobs.linear_token_logprobs`): no (B, T, V) logits.

    check_tied_lm_head(backbone)              raise unless the backbone can serve as its own LM
    previous_positions(hidden)                (previous, predicted) for plain rows: each token is
                                              predicted from the position before it
    add_lm_likelihood(scores, w, backbone, previous, input_ids, predicted)
                                              scores (B, T, 1) + w * log p(input_ids | previous)

The packed-rows and shared-prefix forwards of reward-model training (`reward_models.models`)
find each token's previous position their own way and call `add_lm_likelihood` too.
Not here: decoder-only backbones with untied LM heads (refused), encoder(-decoder) backbones.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from rlhf_core.logprobs import linear_token_logprobs


def check_tied_lm_head(backbone: nn.Module) -> None:
    """Raise ValueError unless `backbone` is a decoder-only model whose LM head is tied to its
    input embeddings (the LM this feature reads)."""
    text_config = backbone.config.get_text_config()
    if not getattr(text_config, "tie_word_embeddings", False):
        raise ValueError(
            f"lm_likelihood reads the backbone's language model through its input "
            f"embeddings (tied LM head); {text_config.model_type} "
            f"{getattr(text_config, '_name_or_path', '')!r} unties them"
        )
    if backbone.config.is_encoder_decoder:
        raise ValueError("lm_likelihood: decoder-only backbones only")


def previous_positions(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For unpacked rows: the hidden state (B, T, H) each token is predicted from (the one before
    it; zeros at position 0) and the mask (B, T) of predicted tokens (all but position 0)."""
    previous = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
    first = torch.arange(hidden.shape[1], device=hidden.device) == 0
    return previous, ~first.expand(hidden.shape[:2])


def add_lm_likelihood(
    scores: torch.Tensor,
    likelihood_weight: torch.Tensor,
    backbone: nn.Module,
    previous: torch.Tensor,
    input_ids: torch.Tensor,
    predicted: torch.Tensor,
) -> torch.Tensor:
    """scores (B, T, 1) + w * log p(input_ids | previous): `previous` (B, T, H) is the hidden
    state each token is predicted from (the position before it in its own sequence), read
    through the backbone's tied LM head (its input embeddings), at the positions `predicted`
    (B, T) marks (elsewhere 0: a sequence's first token). Fused: no (B, T, V) logits."""
    embedding = backbone.get_input_embeddings().weight
    lm_head = SimpleNamespace(weight=embedding, bias=None)  # the tied LM head
    logps = torch.zeros(input_ids.shape, dtype=scores.dtype, device=scores.device)
    picked = linear_token_logprobs(previous[predicted], lm_head, input_ids[predicted])
    logps = logps.masked_scatter(predicted, picked.to(scores.dtype))
    return scores + likelihood_weight * logps[..., None]
