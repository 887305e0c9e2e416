"""The matmul work of a training step, counted one way for every benchmark.

A side-by-side's ratio is the product of two things: how much less work one arm does, and how
much faster it does each unit of it. These counts give the first; dividing them by an arm's
measured CPU-seconds gives the second (GFLOP per CPU-second). Where the work ratio alone is
below a target, no kernel can meet it: only doing less work, or the peer doing its work slower.

The convention (decoder-only transformer, `Shapes.of(config)`):

- the body: 2 FLOPs per weight of the decoder's linear layers per position it computes, padding
  included (positions = rows x row length);
- the LM head: 2 x hidden x vocabulary per position it scores;
- attention: 4 x heads x head_dim per score entry and layer (the scores and the weighted
  values), counting every entry the kernel computes (the CPU kernels compute the whole masked
  block of a row: L x L per row, or per segment when a row's sequences run one call each);
- the backward: 2x the forward for matmuls, 2.5x for attention (the kernel recomputes the
  scores); a fused (chunked) LM head recomputes its logits in the backward, so forward and
  backward are 4x its forward (both our head and TRL's fused head do).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Per-position matmul weights of a decoder's body and head, and attention's width."""

    body_params: int  # weights of the decoder layers' linear maps (q, k, v, o, MLP)
    head_params: int  # hidden x vocabulary
    attn_width: int  # query heads x head_dim, summed over the layers

    @classmethod
    def of(cls, config: Any) -> Shapes:
        h = config.hidden_size
        nq, nkv = config.num_attention_heads, config.num_key_value_heads
        d = getattr(config, "head_dim", None) or h // nq
        per_layer = h * nq * d * 2 + h * nkv * d * 2 + 3 * h * config.intermediate_size
        return cls(
            body_params=per_layer * config.num_hidden_layers,
            head_params=h * config.vocab_size,
            attn_width=nq * d * config.num_hidden_layers,
        )

    def forward_gflop(self, positions: int, head_positions: int, score_entries: int) -> float:
        """One forward (a frozen reference's, or a generation prefill's)."""
        return (
            2 * self.body_params * positions
            + 4 * self.attn_width * score_entries
            + 2 * self.head_params * head_positions
        ) / 1e9

    def train_gflop(self, positions: int, head_positions: int, score_entries: int) -> float:
        """Forward + backward of a policy with a fused LM head (it recomputes its logits)."""
        return (
            3 * 2 * self.body_params * positions
            + 3.5 * 4 * self.attn_width * score_entries
            + 4 * 2 * self.head_params * head_positions
        ) / 1e9

    def decode_gflop(self, rows: int, prompt: int, new_tokens: int) -> float:
        """Sampling `new_tokens` tokens for `rows` rows after a `prompt`-token prefill, one
        token per forward with a KV cache: the first token comes from the prefill's logits (its
        head on the last position only, as `logits_to_keep=1` gives), each later one from a
        single-position forward attending to the prompt and the tokens so far. The prefill is
        not included (`forward_gflop(rows * prompt, rows, rows * prompt**2)`)."""
        steps = max(new_tokens - 1, 0)
        keys = sum(prompt + t for t in range(1, steps + 1))
        return steps * self.forward_gflop(rows, rows, 0) + self.forward_gflop(0, 0, rows * keys)


def segment_score_entries(segments: Any) -> int:
    """Score entries of a packed batch's attention run segment by segment (`pack_groups`'
    `segments` (K, 3) = (row, start, end); where `rlhf_core.attention.segments_pay`, as on the
    benchmarks' `real` model): the sum of each segment's length squared."""
    return int(((segments[:, 2] - segments[:, 1]) ** 2).sum())


def per_cpu_second(gflop: float, tokens: int, tokens_per_cpu_s: float) -> float:
    """GFLOP per CPU-second of an arm that did `gflop` of work on `tokens` tokens at a measured
    `tokens_per_cpu_s`."""
    return gflop * tokens_per_cpu_s / tokens
