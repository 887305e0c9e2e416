"""Attention on the CPU: one dispatch for a model's SDPA calls, and the kernels it picks.

`fast_attention(model, segments=None)` is the one switch: inside it, `model`'s SDPA attention
goes through `_dispatch` (registered with transformers on first use, set on the model's config
for the context only) where the speed plan says so (`rlhf_core.fastpath`: CPU, SDPA, a causal
model; nothing changes elsewhere, and never on CUDA). Per call it takes

  - `short_attention` for a bf16/fp16 multi-token call with a mask, few keys
    (`SpeedPlan.short_attention_keys`) and a backward to come: SDPA's CPU flash kernel runs its
    bf16 backward several times slower at such shapes; forward-only calls, float32 and long
    calls keep SDPA (docs/performance.md has the measurements);
  - SDPA with `enable_gqa=True` for other masked multi-token calls under grouped-query attention:
    transformers otherwise repeats every key and value head once per query head of its group
    (`repeat_kv`, copies autograd keeps for the backward); the same output, no copies;
  - `grouped_decode_attention` for a bf16/fp16 decoding step under grouped-query attention
    (`SpeedPlan.grouped_decode`): SDPA with `enable_gqa=True` and one query position is 3-4x
    slower on the CPU than the same call with the groups as query rows;
  - with `segments` (a packed batch's (row, start, end) spans, `rlhf_core.layout`), one call per
    segment where that is cheaper (`segments_pay`): no score between two groups is computed,
    nor any for a row's padding after its groups. The 4D mask stays the definition (each
    segment's block of it is passed to the call, every entry outside the blocks is masked), so a
    forward outside the context (eager attention, activation recomputation) gives the same
    result, only with the whole (L, L) matrix computed.

`short_attention` is the attention of Vaswani et al. 2017 (arXiv:1706.03762, eq. 1) with the
backward of FlashAttention (Dao et al. 2022, arXiv:2205.14135, Algorithm 4) done in one block:
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
dK, dV sum over the group inside the matmul. Past a few hundred keys the float32 (G x queries)
x keys block costs more than the flash kernel's tiling saves, which is why calls are bounded by a
key limit (`rlhf_core.fastpath.short_attention_keys`).

A query whose keys are all masked (a left-padding position) gets zeros, as from SDPA, and passes
no gradient; such a position's output is read by no other position, so the log-probs and
gradients of real tokens do not depend on it. Exactness: float64 equal to autograd's attention;
in bf16 as close to float64 as SDPA's flash kernel (`tests/rlhf_core/test_attention.py`). The
per-segment calls compute the masked call's result up to float rounding (tested in float64).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from rlhf_core.fastpath import SpeedPlan, speed_plan, unwrapped


def takes_short_attention(query: torch.Tensor, key: torch.Tensor, max_keys: int) -> bool:
    """Whether `short_attention` is the faster way for a masked call of multi-token `query`
    (B, H, Q, D) over `key` (B, H_kv, K, D) on the CPU: reduced-precision inputs, at most
    `max_keys` keys, and a backward to come (see the module docstring)."""
    return (
        query.dtype in (torch.bfloat16, torch.float16) and query.shape[2] > 1
        and key.shape[2] <= max_keys
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

    On the CPU in bf16, SDPA with `enable_gqa=True` and one query position is 3-4x slower than
    the same call with the groups as query rows, so only bf16/fp16 calls come here
    (`folds_query_groups`; fp16 not measured; docs/performance.md). On an AVX-512 CPU the
    outputs were bitwise equal up to 72 keys and differed by at most 6e-5 beyond (a rounding of
    the bf16 output); on another CPU SDPA's kernel, and so its rounding, can differ. Tested: as
    close to float64 attention as SDPA's."""
    b, h, _, d = query.shape
    grouped = query.reshape(b, key.shape[1], h // key.shape[1], d)  # query head j*G + i is (j, i)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask, scale=scale
    )
    return out.reshape(b, h, 1, d)


# ----------------------------------------------------------------------------- the dispatch

#: The attention implementation `fast_attention` switches an SDPA model to (registered with
#: transformers on first use).
DISPATCH = "rlhf_cpu_sdpa"
_ACTIVE: ContextVar[tuple[SpeedPlan, list[tuple[int, int, int]] | None] | None] = ContextVar(
    "fast_attention", default=None
)


@contextmanager
def fast_attention(model: torch.nn.Module, segments: torch.Tensor | None = None) -> Iterator[None]:
    """Inside this context, `model`'s SDPA calls go through the CPU dispatch where its speed
    plan says so (`SpeedPlan.dispatch`; see the module docstring); with `segments` (K, 3) =
    (row, start, end) (`rlhf_core.layout.pack_groups`' segments: each row's back to back from
    its start, the positions after a row's last one padding) one call per segment where that is
    cheaper (`segments_pay`). Nothing changes where the plan has no dispatch. The backward needs
    no context (autograd kept each call); the model is restored after an error too."""
    plan = speed_plan(model)
    if not plan.dispatch:
        yield
        return
    spans = None
    if segments is not None and plan.cpu_attention:
        spans = [tuple(x) for x in segments.tolist()]
        spans = spans if segments_pay(model, spans, plan) else None
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if DISPATCH not in AttentionInterface._global_mapping:
        AttentionInterface.register(DISPATCH, _segmented_sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(DISPATCH, sdpa_mask)
    config = unwrapped(model).config
    token = _ACTIVE.set((plan, spans))
    before = config._attn_implementation_internal
    config._attn_implementation_internal = DISPATCH
    try:
        yield
    finally:
        config._attn_implementation_internal = before
        _ACTIVE.reset(token)


def segments_pay(
    model: torch.nn.Module, spans: list[tuple[int, int, int]], plan: SpeedPlan | None = None
) -> bool:
    """Whether attention segment by segment (one SDPA call per segment of every row) is cheaper
    for `model` than one call over all rows with their masks: the score entries it skips (those
    between segments, all masked) times the query heads' width must outweigh its extra calls
    (`SpeedPlan.segment_call_units` each). Long rows of many sequences (segmented rows) always
    pay; rows of a few short sequences in a narrow model (the tiny world's) do not. Both compute
    the same attention (the skipped entries are masked)."""
    plan = speed_plan(model) if plan is None else plan
    config = unwrapped(model).config
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    rows = {r for r, _, _ in spans}
    length = max(e for _, _, e in spans)
    skipped = len(rows) * length**2 - sum((e - s) ** 2 for _, s, e in spans)
    return skipped * width > (len(spans) - 1) * plan.segment_call_units


def _grouped_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention, except where the active plan (`fast_attention`) takes one
    of the module docstring's kernels: a bf16/fp16 decoding step under grouped-query attention
    (`grouped_decode_attention`), a masked multi-token call with few keys in bf16/fp16
    (`short_attention`) or under grouped-query attention (SDPA with `enable_gqa=True`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    active = _ACTIVE.get()
    plain = (
        active is not None and query.device.type == "cpu"
        and not args and kwargs.get("position_bias") is None and kwargs.get("cache") is None
        and not kwargs.get("softcap") and not kwargs.get("output_attentions")
        and not kwargs.get("dropout")
    )  # fmt: skip
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    plan = active[0]
    if plan.grouped_decode and folds_query_groups(query, key, attention_mask):
        out = grouped_decode_attention(query, key, value, attention_mask, kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None
    ours = plan.cpu_attention and attention_mask is not None
    if ours and takes_short_attention(query, key, plan.short_attention_keys):
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        out = short_attention(query, key, value, attention_mask, scale)
        return out.transpose(1, 2).contiguous(), None
    grouped = getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1
    if not (ours and grouped):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"),
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _segmented_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """SDPA attention (`_grouped_sdpa`), called once per segment of the packed rows (`_ACTIVE`)
    when there are segments: query (B, H, L, D), key/value (B, H_kv, L, D), mask (B, 1, L, L) ->
    (B, L, H, D). Queries of a segment attend only to keys of the same segment (the mask says
    so), so the result is the full call's at every segment's position; the scores between
    segments, all masked, are never computed, nor a row's padding after its last segment (no
    query attends to it; its output is zeros where the full call's lets each padding query see
    itself)."""
    active = _ACTIVE.get()
    segments = None if active is None else active[1]
    whole = query.shape[2] != key.shape[2] or attention_mask is None or attention_mask.dim() != 4
    if segments is None or whole:  # not a packed forward: the whole call
        return _grouped_sdpa(module, query, key, value, attention_mask, *args, **kwargs)
    # One split per tensor and row, not a slice per segment: the backward of a slice writes the
    # segment's gradient into a zero tensor the size of the whole input, so K segments would
    # cost K whole-size tensors per layer (quadratic in the segments of a row); a split's
    # backward concatenates its parts once.
    length = query.shape[2]
    sizes: list[list[int]] = [[] for _ in range(query.shape[0])]
    for r, s, e in segments:
        sizes[r].append(e - s)
    rows = []
    for r, qkv in enumerate(zip(query.split(1), key.split(1), value.split(1), strict=True)):
        used = sum(sizes[r])
        parts, s = [], 0
        chunks = [x.split([*sizes[r], length - used], 2) for x in qkv]
        for q_seg, k_seg, v_seg in zip(*chunks, strict=True):
            e = s + q_seg.shape[2]
            if s == used:  # the row's padding tail: read by no query, so not computed (zeros)
                parts.append(q_seg.new_zeros(1, e - s, q_seg.shape[1], q_seg.shape[3]))
                continue
            out, _ = _grouped_sdpa(
                module, q_seg, k_seg, v_seg, attention_mask[r : r + 1, :, s:e, s:e],
                *args, **kwargs,
            )  # fmt: skip
            parts.append(out)
            s = e
        rows.append(torch.cat(parts, 1))
    return torch.cat(rows, 0), None
