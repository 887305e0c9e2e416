"""Changes to our DPO log-probs that are measured here but NOT in src/.

`direct_alignment.reference.pair_logps` runs the whole causal LM, so the LM head projects every
position of the (2B, S) batch to the vocabulary: prompt tokens, completion tokens and padding. Only
the positions that predict a completion token (`loss_mask`) enter the DPO loss. With a large
vocabulary (GPT-2: 50,257; Qwen3: 151,936) and HH-style data (long multi-turn prompts, short
replies, batches padded to their longest row) that is most of the work and nearly all of the
activation memory: (2B, S, V) fp32 logits, a contiguous copy of `logits[:, :-1]`, and their
gradients.

`completion_pair_logps` runs the transformer body, gathers the hidden states of the `loss_mask`
positions (N, H), and projects only those through the LM head before the same chunked
`rlhf_core.logprobs.token_logprobs`. The numbers are the same (checked in `benchmarks.techniques`
to 1e-4 on fp32 sums of hundreds of log-probs); the LM head and log-softmax cost drop by the
factor (2B x S) / N. TRL does the same on CUDA/XPU (its "compact" fused head) but projects every
position on CPU.

`shifted_pair_logps` is the smaller change: the LM head runs on positions 0..S-2 (the hidden
states are sliced before the head), so `token_logprobs` gets contiguous logits and the
(2B, S-1, V) copy that `logits[:, :-1].reshape(...)` makes in `causal_lm_token_logprobs` is gone.

`patch_our_trainer()` swaps `completion_pair_logps` into `direct_alignment.train` and
`direct_alignment.reference` for the current process only, so the real training loop can be
measured with it.
"""

from __future__ import annotations

import torch

from rlhf_core.logprobs import token_logprobs


def completion_pair_logps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed completion log-probs (B,), the LM head run on completion
    positions only. Same contract as `direct_alignment.reference.pair_logps`."""
    input_ids, attention_mask, loss_mask = (
        batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    )  # fmt: skip
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).last_hidden_state  # (2B, S, H)
    rows, cols = loss_mask.nonzero(as_tuple=True)  # position t predicts token t + 1
    logits = model.get_output_embeddings()(hidden[rows, cols])  # (N, V)
    token_logps = token_logprobs(logits, input_ids[rows, cols + 1])  # (N,)
    seq = token_logps.new_zeros(input_ids.shape[0]).index_add(0, rows, token_logps)
    half = seq.shape[0] // 2
    return seq[:half], seq[half:]


def shifted_pair_logps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `direct_alignment.reference.pair_logps`, with the LM head run on positions 0..S-2
    only (no copy of the logits)."""
    from rlhf_core.logprobs import masked_sum

    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).last_hidden_state
    logits = model.get_output_embeddings()(hidden[:, :-1])  # (2B, S-1, V), contiguous
    seq = masked_sum(token_logprobs(logits, input_ids[:, 1:]), batch["loss_mask"], dim=-1)
    half = seq.shape[0] // 2
    return seq[:half], seq[half:]


def patch_our_trainer() -> None:
    """Make our DPO trainer use `completion_pair_logps` for the policy and the reference."""
    import direct_alignment.reference as reference
    import direct_alignment.train as train

    train.pair_logps = completion_pair_logps
    reference.pair_logps = completion_pair_logps
