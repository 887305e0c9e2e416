"""Short attention: softmax(q k^T * scale + mask) v for calls with few keys, without the tiling
of a flash kernel, and with flash attention's memory.

Why. On the CPU, torch's SDPA runs a masked call through its flash kernel
(`_scaled_dot_product_flash_attention_for_cpu`), which walks blocks of queries and keys with
running maxima and sums. In bf16 that kernel is slow at short lengths: at a GRPO micro-batch's
shape it takes 2.3x as long as this module's one-block computation. Measured on this machine
(`uv run --group bench python -m benchmarks.attention --dtype bf16` and `--dtype fp32`, runs
`20261125-204941-attention-bf16` and `-204954-attention-fp32`; 2 threads, 8 query heads over 4
key/value heads of width 64; forward + backward of one call, median of 20, alternating):

    queries x keys, rows          bf16: SDPA    short      fp32: SDPA    short
    32 x 56, 32 rows (GRPO)           16.1 ms    7.0 ms          7.0 ms    6.9 ms
    24 x 24, 4 rows (its prompts)      1.4 ms    0.9 ms          0.5 ms    0.7 ms
    96 x 120, 16 rows                 24.9 ms   18.7 ms         15.5 ms   17.6 ms
    120 x 120, 1 row (a DPO pair)      2.0 ms    1.7 ms          1.2 ms    1.6 ms
    128 x 160, 16 rows                34.0 ms   39.0 ms         25.0 ms   34.8 ms
    512 x 600, 4 rows                 68.8 ms  151.4 ms         67.8 ms  167.5 ms

What is slow is the flash kernel's bf16 backward; its forward alone (no gradients) is as fast as
ours or faster (32 x 56, 32 rows: 2.8 vs 2.8 ms; 24 x 24, 4 rows: 0.24 vs 0.42 ms; 120 x 120, 1
row: 0.59 vs 0.85 ms; run `20261125-211934-attention-bf16`). Past ~150 keys the (queries x keys)
float32 passes of one block cost more than the flash kernel's tiling saves, and in float32 the
flash kernel is as fast or faster at every shape. So `takes_short_attention` sends here only
bf16/fp16 calls with at most `SHORT_ATTENTION_KEYS` (128) keys whose backward will run
(gradients enabled, the query requiring one); forward-only calls (a DPO reference model,
evaluation) and everything else go to SDPA. In both arms the errors against float64 are alike
(bf16: 4.3e-3 ours, 4.5e-3 SDPA at GRPO's shape).

What. `short_attention` is the attention of Vaswani et al. 2017 (arXiv:1706.03762, eq. 1) with
the backward of FlashAttention (Dao et al. 2022, arXiv:2205.14135, Algorithm 4) done in one block:
the forward keeps only q, k, v, the mask and each query's log-sum-exp (not the (queries x keys)
probabilities), and the backward recomputes the probabilities from them, as the flash kernel
does:

    S = q k^T * scale + mask        P = exp(S - lse),  lse = logsumexp(S)    out = P v
    dV = P^T dO    dP = dO V^T    dS = P * (dP - rowsum(dP * P))    dQ = dS K * scale
    dK = dS^T Q * scale

Scores, probabilities and dS are float32 (float64 for float64 inputs), whatever the inputs'
dtype; the products with v and the gradients' matmuls run in the inputs' dtype with float32
accumulation, as the flash kernel's do. Grouped-query attention (fewer key/value heads than
query heads) is computed on the grouped heads as they are: the G query heads that share a
key/value head are one (G x queries)-row matmul against it, so no key or value is repeated, and
dK, dV sum over the group inside the matmul.

A query whose keys are all masked (a left-padding position) gets zeros, as from SDPA, and passes
no gradient; such a position's output is read by no other position, so the log-probs and
gradients of real tokens do not depend on it (tests: float64 equal to autograd's
attention, bf16 as close to float64 as SDPA's flash kernel, `tests/rlhf_core/test_attention.py`).

The module also holds `grouped_decode_attention`, a decoding step's attention under grouped-query
attention with each key/value head's query heads as query rows of one SDPA call (bf16/fp16 on
the CPU, where SDPA's `enable_gqa=True` call is 3-4x slower; see its docstring).
"""

from __future__ import annotations

import torch

#: bf16/fp16 calls with at most this many keys take `short_attention` (the module docstring's
#: table).
SHORT_ATTENTION_KEYS = 128


def takes_short_attention(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `short_attention` is the faster way for a masked call of multi-token `query`
    (B, H, Q, D) over `key` (B, H_kv, K, D) on the CPU: reduced-precision inputs, at most
    `SHORT_ATTENTION_KEYS` keys, and a backward to come (see the module docstring)."""
    return (
        query.dtype in (torch.bfloat16, torch.float16) and query.shape[2] > 1
        and key.shape[2] <= SHORT_ATTENTION_KEYS
        and torch.is_grad_enabled() and query.requires_grad
    )  # fmt: skip


def _scores(query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor,
            scale: float) -> torch.Tensor:  # fmt: skip
    """S = q k^T * scale + bias in the accumulation dtype: query (B, Hk, G, Q, D), key
    (B, Hk, K, D), bias broadcastable to (B, Hk, G, Q, K) -> (B, Hk, G, Q, K)."""
    b, hk, g, q_len, d = query.shape
    acc = bias.dtype
    scores = torch.matmul(query.reshape(b, hk, g * q_len, d).to(acc), key.to(acc).transpose(-1, -2))
    return scores.view(b, hk, g, q_len, key.shape[2]).mul_(scale).add_(bias)


class _ShortAttention(torch.autograd.Function):
    """out (B, Hk, G, Q, D) of query (B, Hk, G, Q, D), key/value (B, Hk, K, D) and an additive
    bias (B or 1, Hk or 1, G or 1, Q, K) in the accumulation dtype (no grad). Saves q, k, v, bias
    and lse; the backward recomputes P (see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, bias, scale):
        scores = _scores(query, key, bias, scale)
        lse = scores.logsumexp(-1, keepdim=True)
        lse.masked_fill_(lse == float("-inf"), 0.0)  # a query with no key: P = 0, out = 0
        probs = scores.sub_(lse).exp_().to(value.dtype)
        b, hk, g, q_len, k_len = probs.shape
        out = torch.matmul(probs.view(b, hk, g * q_len, k_len), value)
        ctx.save_for_backward(query, key, value, bias, lse)
        ctx.scale = scale
        return out.view(b, hk, g, q_len, value.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, bias, lse = ctx.saved_tensors
        scale = ctx.scale
        probs = _scores(query, key, bias, scale).sub_(lse).exp_()  # P, (B, Hk, G, Q, K)
        b, hk, g, q_len, k_len = probs.shape
        rows = (b, hk, g * q_len)
        grad_out = grad_out.reshape(*rows, grad_out.shape[-1])
        grad_value = torch.matmul(probs.to(value.dtype).view(*rows, k_len).transpose(-1, -2),
                                  grad_out)  # fmt: skip
        grad_probs = torch.matmul(grad_out.to(probs.dtype), value.to(probs.dtype).transpose(-1, -2))
        grad_probs = grad_probs.view_as(probs)
        delta = (grad_probs * probs).sum(-1, keepdim=True)
        grad_scores = probs.mul_(grad_probs.sub_(delta)).mul_(scale).to(query.dtype)
        grad_scores = grad_scores.view(*rows, k_len)
        grad_query = torch.matmul(grad_scores, key).view_as(query)
        grad_key = torch.matmul(grad_scores.transpose(-1, -2),
                                query.reshape(*rows, query.shape[-1]))  # fmt: skip
        return grad_query, grad_key, grad_value, None, None


def short_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """Attention of query (B, H, Q, D) over key/value (B, H_kv, K, D), H a multiple of H_kv,
    under `mask` (B or 1, 1 or H, Q or 1, >= K): boolean (True: attend) or additive float ->
    (B, H, Q, D) in the query's dtype. See the module docstring."""
    b, h, q_len, d = query.shape
    hk, k_len = key.shape[1], key.shape[2]
    if h % hk:
        raise ValueError(f"short_attention: {h} query heads over {hk} key/value heads")
    g = h // hk
    acc = torch.promote_types(query.dtype, torch.float32)
    mask = mask[..., :k_len]
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=acc, device=mask.device)
        bias.masked_fill_(~mask, float("-inf"))
    else:  # additive: transformers' masked entries are -inf or the mask dtype's minimum
        bias = mask.to(acc, copy=True)  # the caller's mask serves every layer: never written
        bias.masked_fill_(mask == torch.finfo(mask.dtype).min, float("-inf"))
    if bias.shape[1] == 1:
        bias = bias.unsqueeze(2)  # (B, 1, 1, Q, K): one mask for every head
    else:
        bias = bias.view(bias.shape[0], hk, g, *bias.shape[-2:])
    grouped = query.reshape(b, hk, g, q_len, d)  # a view: query head j*G + i is (j, i)
    return _ShortAttention.apply(grouped, key, value, bias, scale).view(b, h, q_len, d)


def folds_query_groups(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `grouped_decode_attention` is the faster way for a call of `query` (B, H, 1, D)
    over `key` (B, H_kv, K, D) on the CPU: one query position (a decoding step), grouped heads
    (H_kv < H), bf16/fp16, and a mask (if any) shared by every head and the query
    (B or 1, 1, 1, K)."""
    shared_mask = mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1)
    return (
        query.dtype in (torch.bfloat16, torch.float16) and query.shape[2] == 1
        and key.shape[1] < query.shape[1] and query.shape[1] % key.shape[1] == 0
        and shared_mask
    )  # fmt: skip


def grouped_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention of one query position, query (B, H, 1, D), over grouped key/value heads
    (B, H_kv, K, D) -> (B, H, 1, D): the G = H / H_kv query heads that share a key/value head
    become G query rows of one SDPA call on that head, (B, H_kv, G, D). transformers does the
    same for a decoding step with a mask (`pack_gqa`) but calls SDPA with `enable_gqa=True` for
    one without (no row padded: equal-length prompts, or a single prompt). The same
    softmax(q k^T * scale + mask) v for every head; with one query position there is no causal
    structure among the G rows, and the mask, one per key, serves all of them.

    Why: on the CPU in bf16, SDPA with `enable_gqa=True` and one query position is 3-4x slower
    than the same call with the groups as query rows. Measured on this machine (64 rows, 8 query
    heads over 4 key/value heads of width 64, keys a view of a reserved cache as `decode` keeps
    it; 2 threads, median of 40 calls, an ad-hoc probe):

        keys        bf16: enable_gqa    grouped rows      fp32: enable_gqa    grouped rows
        41                  1.72 ms       0.52 ms                0.31 ms        0.67 ms
        72                  2.58 ms       0.68 ms                0.42 ms        0.81 ms
        150                 4.83 ms       1.13 ms                1.01 ms        1.31 ms
        300                 9.74 ms       2.43 ms                2.49 ms        2.82 ms

    so only bf16/fp16 calls come here (`folds_query_groups`; fp16 not measured): whole bf16
    decodes without padding of the benchmarks' real model 8-18% faster (docs/performance.md).
    The outputs were bitwise equal up to 72 keys and differed by at most 6e-5 beyond (a
    rounding of the bf16 output), and are as close to float64 attention as SDPA's (tested)."""
    b, h, _, d = query.shape
    grouped = query.reshape(b, key.shape[1], h // key.shape[1], d)  # query head j*G + i is (j, i)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask, scale=scale
    )
    return out.reshape(b, h, 1, d)
