"""`rlhf_core.attention.short_attention`: the attention formula with flash attention's recomputing
backward, checked against autograd through the plain formula (float64) and against SDPA's own
bf16 error; and `grouped_decode_attention`, a decoding step's grouped heads as query rows."""

import pytest
import torch

from rlhf_core.attention import (
    folds_query_groups,
    grouped_decode_attention,
    short_attention,
    takes_short_attention,
)


def reference(query, key, value, mask, scale):
    """softmax(q k^T * scale + mask) v by autograd, key/value heads repeated per group (as
    transformers' eager attention); a boolean mask is True where a query may attend."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scale
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    return scores.softmax(-1) @ value


def inputs(dtype, *, heads=8, kv_heads=4, rows=3, queries=5, keys=9, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, queries, dim, generator=g, dtype=torch.float64)
    k = torch.randn(rows, kv_heads, keys, dim, generator=g, dtype=torch.float64)
    v = torch.randn(rows, kv_heads, keys, dim, generator=g, dtype=torch.float64)
    # causal over the last `queries` keys, and left padding of 0, 2 and 3 keys
    mask = torch.ones(rows, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
    for r, pad in enumerate((0, 2, 3)[:rows]):
        mask[r, :, :, :pad] = False
    grad = torch.randn(rows, heads, queries, dim, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v)], mask, grad.to(dtype)


def run(fn, tensors, mask, grad, scale):
    leaves = [x.detach().clone().requires_grad_() for x in tensors]
    out = fn(*leaves, mask, scale)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("kv_heads", [8, 4, 1])
@pytest.mark.parametrize("additive", [False, True])
def test_short_attention_equals_autograd_in_float64(kv_heads, additive):
    """Output and the gradients of q, k and v equal autograd through the formula (float64), for
    plain, grouped and multi-query attention, with a boolean mask and with an additive one (0 /
    -inf, as `rlhf_core.layout.additive_mask` builds)."""
    tensors, mask, grad = inputs(torch.float64, kv_heads=kv_heads)
    if additive:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    ours = run(short_attention, tensors, mask, grad, 0.3)
    ref = run(reference, tensors, mask, grad, 0.3)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


def test_short_attention_takes_a_mask_per_head_and_wider_than_the_keys():
    """A (B, H, Q, K) mask, a mask with more key columns than keys (transformers' masks can be
    sized for the cache): the first K columns apply, and a (B, H, 1, K) mask broadcast over the
    queries."""
    tensors, mask, grad = inputs(torch.float64)
    per_head = mask.expand(-1, 8, -1, -1).clone()
    per_head[:, 3, :, 4] = False  # one head may not see key 4
    wide = torch.cat([per_head, torch.ones(3, 8, 5, 2, dtype=torch.bool)], -1)
    ours = run(short_attention, tensors, wide, grad, 0.25)
    ref = run(reference, tensors, per_head, grad, 0.25)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    padding_only = torch.ones(3, 8, 1, 9, dtype=torch.bool)  # (B, H, 1, K): one row per head
    padding_only[0, 5, 0, 2] = padding_only[2, :, 0, :3] = False
    ours = run(short_attention, tensors, padding_only, grad, 0.25)
    ref = run(reference, tensors, padding_only, grad, 0.25)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("additive", [False, True])
def test_an_all_masked_query_gives_zeros_and_leaves_the_other_rows_alone(additive):
    """A left-padding query sees no key at all: it gets zeros, as from SDPA, never NaN (which
    would reach the weights' gradients as NaN x 0), also with transformers' additive mask (the
    dtype's minimum where masked, which a log-sum-exp would otherwise count as K equal
    scores); every other query's output and every gradient are the ones without that query."""
    tensors, mask, grad = inputs(torch.float64)
    mask[1, :, 0, :] = False  # row 1's first query: no key
    grad[1, :, 0, :] = 0  # nothing downstream reads that position
    given = mask
    if additive:
        given = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    out, dq, dk, dv = run(short_attention, tensors, given, grad, 0.3)
    assert all(torch.isfinite(x).all() for x in (out, dq, dk, dv))
    assert (out[1, :, 0] == 0).all() and (dq[1, :, 0] == 0).all()
    keep = torch.ones(5, dtype=torch.bool)
    keep[0] = False
    sub = [tensors[0][1:2, :, keep], tensors[1][1:2], tensors[2][1:2]]
    ref = run(reference, sub, mask[1:2, :, keep], grad[1:2, :, keep], 0.3)
    torch.testing.assert_close(out[1:2, :, keep], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(dk[1:2], ref[2], rtol=0, atol=1e-12)
    torch.testing.assert_close(dv[1:2], ref[3], rtol=0, atol=1e-12)


def test_bf16_is_as_close_to_float64_as_sdpa():
    """In bf16 (GRPO's micro-batch shape: 8 heads over 4, 32 queries, 56 keys, width 64) the
    output and gradients are as close to the float64 result as SDPA's CPU flash kernel's (within
    1.25x of its largest relative error)."""
    tensors, mask, grad = inputs(torch.float64, rows=4, queries=32, keys=56, dim=64, seed=1)
    mask[:, :, :, :] = torch.ones(32, 56, dtype=torch.bool).tril(24)
    exact = run(reference, tensors, mask, grad, 0.125)

    def sdpa(q, k, v, m, scale):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=m, scale=scale, enable_gqa=True
        )

    low = [x.to(torch.bfloat16) for x in tensors]
    for name, a, b, e in zip(
        ("out", "dq", "dk", "dv"),
        run(short_attention, low, mask, grad.to(torch.bfloat16), 0.125),
        run(sdpa, low, mask, grad.to(torch.bfloat16), 0.125),
        exact,
        strict=True,
    ):
        assert a.dtype == torch.bfloat16
        ours = float((a.double() - e).norm() / e.norm())
        theirs = float((b.double() - e).norm() / e.norm())
        assert ours <= 1.25 * theirs, (name, ours, theirs)


def test_short_attention_keeps_no_score_matrix_for_the_backward():
    """Like a flash kernel, the forward saves q, k, v, the mask and one log-sum-exp per query:
    no (queries x keys) tensor per head."""
    tensors, mask, _ = inputs(torch.float32, queries=32, keys=56)
    leaves = [x.requires_grad_() for x in tensors]
    saved = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        short_attention(*leaves, mask, 0.3)
    per_head_scores = 3 * 8 * 32 * 56
    assert saved and all(torch.Size(s).numel() < per_head_scores for s in saved), saved


def test_short_attention_takes_short_reduced_precision_calls_only():
    """bf16/fp16 multi-token calls with at most the plan's key limit (128 for 8 query heads over
    4 key/value heads, `rlhf_core.fastpath.short_attention_keys`) and a backward to come; not
    float32 (SDPA's flash kernel is as fast there), not longer calls, not a single decoding
    query, not a forward without gradients."""
    from types import SimpleNamespace

    from rlhf_core.fastpath import short_attention_keys

    keys = short_attention_keys(SimpleNamespace(num_attention_heads=8, num_key_value_heads=4))
    assert keys == 128

    def call(dtype, queries, keys, grad=True):
        query = torch.zeros(1, 8, queries, 4, dtype=dtype, requires_grad=grad)
        return query, torch.zeros(1, 4, keys, 4, dtype=dtype)

    assert takes_short_attention(*call(torch.bfloat16, 32, 56), keys)
    assert takes_short_attention(*call(torch.float16, 2, keys), keys)
    assert not takes_short_attention(*call(torch.bfloat16, 2, keys + 1), keys)
    assert not takes_short_attention(*call(torch.float32, 32, 56), keys)
    assert not takes_short_attention(*call(torch.bfloat16, 1, 56), keys)
    assert not takes_short_attention(*call(torch.bfloat16, 32, 56, grad=False), keys)
    with torch.no_grad():  # a reference model's forward: SDPA's forward is faster
        assert not takes_short_attention(*call(torch.bfloat16, 32, 56), keys)


def decode_inputs(dtype, *, kv_heads, keys, mask_kind, rows=3, heads=8, dim=16, seed=0):
    """One query position per row over `keys` keys; rows 1 and 2 left-padded by 2 and 5 keys
    (mask_kind "bool" or "additive", shaped (B, 1, 1, K) as transformers builds it), or None."""
    (q, k, v), _, _ = inputs(
        dtype, heads=heads, kv_heads=kv_heads, rows=rows, queries=1, keys=keys, dim=dim, seed=seed
    )
    if mask_kind is None:
        return (q, k, v), None
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
    mask[1, ..., :2] = False
    mask[2, ..., :5] = False
    if mask_kind == "additive":
        additive = torch.zeros(mask.shape, dtype=dtype)
        mask = additive.masked_fill(~mask, torch.finfo(dtype).min)
    return (q, k, v), mask


@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_grouped_decode_attention_equals_the_formula_in_float64(kv_heads, mask_kind):
    (q, k, v), mask = decode_inputs(torch.float64, kv_heads=kv_heads, keys=11, mask_kind=mask_kind)
    out = grouped_decode_attention(q, k, v, mask, 0.3)
    full = torch.ones(3, 1, 1, 11, dtype=torch.bool) if mask is None else mask
    torch.testing.assert_close(out, reference(q, k, v, full, 0.3), rtol=0, atol=1e-12)


@pytest.mark.parametrize("keys", [72, 150])
def test_grouped_decode_attention_in_bf16_is_as_close_to_float64_as_sdpa(keys):
    """At a decoding step's shape (8 query heads over 4, width 64, left-padded rows) the bf16
    output is as close to float64 attention as SDPA's `enable_gqa=True` call (within 1.25x of
    its relative error). Not bitwise: which kernel SDPA picks, and so its rounding, depends on
    the CPU (equal up to 72 keys on AVX-512, not on CI's machine)."""
    (q, k, v), mask = decode_inputs(
        torch.float64, kv_heads=4, keys=keys, mask_kind="bool", rows=16, dim=64, seed=2
    )
    exact = reference(q, k, v, mask, 0.125)
    low = [x.to(torch.bfloat16) for x in (q, k, v)]
    ours = grouped_decode_attention(*low, mask, 0.125)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *low, attn_mask=mask, scale=0.125, enable_gqa=True
    )
    assert ours.dtype == torch.bfloat16 and ours.shape == sdpa.shape
    error = float((ours.double() - exact).norm() / exact.norm())
    sdpa_error = float((sdpa.double() - exact).norm() / exact.norm())
    assert error <= 1.25 * sdpa_error, (error, sdpa_error)


def test_folds_query_groups_takes_reduced_precision_single_grouped_queries_only():
    (q, k, _), mask = decode_inputs(torch.bfloat16, kv_heads=4, keys=9, mask_kind="bool")
    assert folds_query_groups(q, k, mask)
    assert folds_query_groups(q, k, None)
    assert folds_query_groups(q.half(), k.half(), mask)
    assert not folds_query_groups(q.float(), k.float(), mask)  # fp32: enable_gqa is faster
    assert not folds_query_groups(q, q, mask)  # no groups
    assert not folds_query_groups(q.expand(3, 8, 2, 16), k, mask)  # two query positions
    per_head = mask.expand(3, 8, 1, 9)
    assert not folds_query_groups(q, k, per_head)  # a mask per head: not shared by the group
