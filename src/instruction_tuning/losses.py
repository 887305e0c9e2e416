"""SFT losses (registry `LOSSES`).

`nll` — the standard instruction-tuning objective: negative log-likelihood of the completion
tokens only; prompt and padding are masked out (Ouyang et al. 2022, arXiv:2203.02155, sec. 3.5;
"completion-only loss" in TRL). Per token t of completion y given prompt x:

    loss = - sum_{b,t} mask[b,t] * log p(y_t | x, y_<t) / N

where N is the number of completion tokens in the whole optimizer step (all micro-batches and all
processes), so gradient accumulation and data parallelism give exactly the one-big-batch loss.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf_core.logprobs import masked_sum
from rlhf_core.registry import Configurable, Registry

LOSSES: Registry[type[nn.Module]] = Registry("SFT loss", base=nn.Module)


@LOSSES.register("nll")
class CompletionNLLLoss(Configurable, nn.Module):
    """Completion-only token NLL summed and divided by a given token count (see module doc)."""

    def forward(
        self,
        token_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        num_tokens: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """token_logprobs, loss_mask: (B, T); num_tokens: the step's total completion tokens."""
        nll_sum = -masked_sum(token_logprobs, loss_mask)
        loss = nll_sum / num_tokens
        metrics = {"nll_sum": nll_sum.detach(), "tokens": loss_mask.sum().detach()}
        return loss, metrics
