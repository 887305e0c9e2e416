"""rlhf_core.logprobs against float64 reference implementations written out explicitly."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.logprobs import (
    AGGREGATION_MODES,
    aggregate,
    causal_lm_token_logprobs,
    masked_mean,
    masked_sum,
    token_logprobs,
)
from rlhf_core.models import ModelConfig, load_policy


def reference_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """log_softmax in float64, then gather: the textbook definition."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def random_inputs(shape, vocab, dtype=torch.float64, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    return logits, labels


# ----------------------------------------------------------------------------- token_logprobs


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 24, 1024])
def test_token_logprobs_float64_matches_reference(chunk_rows):
    logits, labels = random_inputs((4, 6), 37)  # 24 rows
    out = token_logprobs(logits, labels, chunk_rows=chunk_rows)
    assert out.dtype == torch.float64
    assert out.shape == labels.shape
    torch.testing.assert_close(out, reference_logprobs(logits, labels), rtol=0, atol=1e-10)


@pytest.mark.parametrize("chunk_rows", [1, 5, 1000])
def test_token_logprobs_float32(chunk_rows):
    logits, labels = random_inputs((3, 10), 50, dtype=torch.float32)
    out = token_logprobs(logits, labels, chunk_rows=chunk_rows)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference_logprobs(logits, labels), rtol=0, atol=1e-5)


def test_token_logprobs_chunking_does_not_change_values():
    logits, labels = random_inputs((5, 9), 31, dtype=torch.float32)
    full = token_logprobs(logits, labels, chunk_rows=10_000)
    for chunk_rows in (1, 2, 4, 44, 45, 46):
        torch.testing.assert_close(
            token_logprobs(logits, labels, chunk_rows=chunk_rows), full, rtol=0, atol=1e-6
        )


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 2.5])
def test_token_logprobs_temperature(temperature):
    logits, labels = random_inputs((2, 8), 23)
    out = token_logprobs(logits, labels, temperature=temperature, chunk_rows=3)
    expected = reference_logprobs(logits, labels, temperature)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    if temperature != 1.0:  # temperature genuinely changes the result
        assert not torch.allclose(out, reference_logprobs(logits, labels), atol=1e-3)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_token_logprobs_rejects_non_positive_temperature(bad):
    logits, labels = random_inputs((2, 3), 5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, labels, temperature=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logprobs_large_logits(dtype):
    logits, labels = random_inputs((3, 5), 40, dtype=dtype, scale=1e4)
    out = token_logprobs(logits, labels, chunk_rows=4)
    assert torch.isfinite(out).all()
    assert (out <= 0).all()
    expected = reference_logprobs(logits, labels)
    # relative to the logit scale (1e4), float32 rounding is ~1e-3 in absolute terms
    atol = 1e-10 * 1e4 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=atol)
    # the argmax label has log-prob ~0, others very negative
    top = token_logprobs(logits, logits.argmax(-1))
    assert torch.isfinite(top).all()
    assert (top <= 0).all() and (top > -1.0).all()


def test_token_logprobs_bf16_gives_float32():
    logits, labels = random_inputs((2, 7), 19, dtype=torch.bfloat16)
    out = token_logprobs(logits, labels, chunk_rows=5)
    assert out.dtype == torch.float32
    # computed from the bf16 values exactly, upcast to float32
    torch.testing.assert_close(out.double(), reference_logprobs(logits, labels), rtol=0, atol=1e-5)


def test_token_logprobs_float16_gives_float32():
    logits, labels = random_inputs((2, 3), 11, dtype=torch.float16)
    assert token_logprobs(logits, labels).dtype == torch.float32


def test_token_logprobs_probabilities_sum_to_one():
    logits, _ = random_inputs((2,), 13)
    labels_all = torch.arange(13).expand(2, 13)
    logits_rep = logits[:, None, :].expand(2, 13, 13)
    out = token_logprobs(logits_rep, labels_all, chunk_rows=4)
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4)])
def test_token_logprobs_other_ranks(shape):
    logits, labels = random_inputs(shape, 9)
    out = token_logprobs(logits, labels, chunk_rows=5)
    assert out.shape == labels.shape
    torch.testing.assert_close(out, reference_logprobs(logits, labels), rtol=0, atol=1e-10)


def test_token_logprobs_empty():
    logits = torch.zeros(2, 0, 5)
    labels = torch.zeros(2, 0, dtype=torch.long)
    out = token_logprobs(logits, labels)
    assert out.shape == (2, 0)
    assert out.dtype == torch.float32


@pytest.mark.parametrize(
    ("logits_shape", "labels_shape"),
    [((2, 3, 5), (2, 4)), ((2, 3, 5), (2, 3, 5)), ((6, 5), (2, 3))],
)
def test_token_logprobs_shape_mismatch_raises(logits_shape, labels_shape):
    with pytest.raises(ValueError, match="token_logprobs"):
        token_logprobs(torch.zeros(logits_shape), torch.zeros(labels_shape, dtype=torch.long))


def test_token_logprobs_gradient_matches_reference():
    logits, labels = random_inputs((2, 4), 6)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    token_logprobs(a, labels, chunk_rows=3).sum().backward()
    reference_logprobs(b, labels).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, labels, chunk_rows=3, temperature=0.7),
        (logits.clone().requires_grad_(True),),
    )


# ----------------------------------------------------------------------------- causal LM


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    model = load_policy(ModelConfig(name_or_path="tiny-qwen3", dtype="fp32", attention="sdpa"))
    model.eval()
    return model


def test_causal_lm_token_logprobs_matches_manual(tiny_model):
    vocab = tiny_model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = causal_lm_token_logprobs(tiny_model, ids, mask, chunk_rows=5)
        logits = tiny_model(input_ids=ids, attention_mask=mask).logits
    assert out.shape == (3, 11)
    assert out.dtype == torch.float32
    expected = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    # a position-wise check that the shift is right: out[:, t] predicts ids[:, t + 1]
    t = 4
    manual = torch.log_softmax(logits[1, t].double(), -1)[ids[1, t + 1]]
    assert abs(out[1, t].item() - manual.item()) < 1e-5


def test_causal_lm_token_logprobs_temperature(tiny_model):
    ids = torch.randint(6, tiny_model.config.vocab_size, (2, 8), generator=torch.manual_seed(2))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = causal_lm_token_logprobs(tiny_model, ids, mask, temperature=0.5)
        logits = tiny_model(input_ids=ids, attention_mask=mask).logits
    expected = reference_logprobs(logits[:, :-1], ids[:, 1:], temperature=0.5)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


def test_causal_lm_token_logprobs_padding_side_invariant(tiny_model):
    vocab = tiny_model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    lengths = [9, 5, 2]
    width = max(lengths)
    pad_id = 0
    seqs = [torch.randint(6, vocab, (n,), generator=g) for n in lengths]
    right = torch.full((len(seqs), width), pad_id)
    left = torch.full((len(seqs), width), pad_id)
    right_mask = torch.zeros_like(right)
    left_mask = torch.zeros_like(left)
    for i, s in enumerate(seqs):
        right[i, : len(s)] = s
        right_mask[i, : len(s)] = 1
        left[i, width - len(s) :] = s
        left_mask[i, width - len(s) :] = 1
    with torch.no_grad():
        out_right = causal_lm_token_logprobs(tiny_model, right, right_mask)
        out_left = causal_lm_token_logprobs(tiny_model, left, left_mask)
        alone = [causal_lm_token_logprobs(tiny_model, s[None], torch.ones(1, len(s))) for s in seqs]
    for i, s in enumerate(seqs):
        n = len(s) - 1  # real next-token predictions
        real_right = out_right[i, :n]
        real_left = out_left[i, width - len(s) : width - 1]
        torch.testing.assert_close(real_right, real_left, rtol=0, atol=1e-5)
        torch.testing.assert_close(real_right, alone[i][0], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- masked reductions


def loop_masked_sum(values, mask):
    total = 0.0
    for v, m in zip(values.flatten().tolist(), mask.flatten().tolist(), strict=True):
        if m:
            total += v
    return total


def random_loss_and_mask(b=5, t=7, seed=0, empty_row=None):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.6
    mask[:, 0] = True  # every row non-empty unless asked
    if empty_row is not None:
        mask[empty_row] = False
    return loss, mask


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64, torch.float32, torch.long])
def test_masked_sum_and_mean_match_loops(mask_dtype):
    loss, mask = random_loss_and_mask(empty_row=2)
    m = mask.to(mask_dtype)
    assert masked_sum(loss, m).item() == pytest.approx(loop_masked_sum(loss, mask), abs=1e-12)
    per_row = masked_sum(loss, m, dim=-1)
    for i in range(loss.shape[0]):
        assert per_row[i].item() == pytest.approx(loop_masked_sum(loss[i], mask[i]), abs=1e-12)
    mean_all = masked_mean(loss, m)
    assert mean_all.item() == pytest.approx(
        loop_masked_sum(loss, mask) / mask.sum().item(), abs=1e-12
    )
    row_means = masked_mean(loss, m, dim=-1)
    for i in range(loss.shape[0]):
        n = int(mask[i].sum())
        expected = loop_masked_sum(loss[i], mask[i]) / n if n else 0.0
        assert row_means[i].item() == pytest.approx(expected, abs=1e-12)
    assert row_means[2].item() == 0.0  # the fully masked row


def test_masked_mean_over_columns():
    loss, mask = random_loss_and_mask()
    col = masked_mean(loss, mask, dim=0)
    for j in range(loss.shape[1]):
        n = int(mask[:, j].sum())
        expected = loop_masked_sum(loss[:, j], mask[:, j]) / n if n else 0.0
        assert col[j].item() == pytest.approx(expected, abs=1e-12)


def test_masked_mean_fully_masked_is_zero():
    values = torch.randn(3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    assert masked_mean(values, mask).item() == 0.0
    assert torch.equal(masked_mean(values, mask, dim=-1), torch.zeros(3))
    assert masked_sum(values, mask).item() == 0.0


def test_masked_reductions_ignore_inf_and_nan_in_masked_positions():
    values = torch.tensor([[1.0, 2.0, float("inf")], [float("-inf"), 4.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    assert masked_sum(values, mask).item() == 7.0
    assert masked_mean(values, mask).item() == pytest.approx(7.0 / 3.0)
    assert torch.equal(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 4.0]))
    # and the gradient is finite too
    v = values.clone().requires_grad_(True)
    masked_mean(v, mask).backward()
    assert torch.isfinite(v.grad).all()
    assert torch.equal(v.grad, mask.float() / 3.0)


def test_masked_sum_shape_mismatch_raises():
    with pytest.raises(ValueError, match="masked_sum"):
        masked_sum(torch.zeros(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 3, 1))


# ----------------------------------------------------------------------------- aggregate


def loop_aggregate(loss, mask, mode, normalizer=None):
    rows = []
    total, count = 0.0, 0
    for i in range(loss.shape[0]):
        row_sum, row_n = 0.0, 0
        for j in range(loss.shape[1]):
            if mask[i, j]:
                row_sum += float(loss[i, j])
                row_n += 1
        total += row_sum
        count += row_n
        if mode == "seq-mean-token-mean":
            rows.append(row_sum / row_n if row_n else 0.0)
        else:
            rows.append(row_sum)
    if mode == "token-mean":
        return total / count if count else 0.0
    if mode == "seq-mean-token-mean":
        return sum(rows) / len(rows)
    return sum(rows) / len(rows) / normalizer


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("empty_row", [None, 1])
def test_aggregate_matches_loops(mode, empty_row):
    loss, mask = random_loss_and_mask(b=6, t=9, seed=4, empty_row=empty_row)
    normalizer = 9.0 if mode == "seq-mean-token-sum-norm" else None
    out = aggregate(loss, mask, mode, normalizer=normalizer)
    assert out.dim() == 0
    assert out.dtype == torch.float64
    assert out.item() == pytest.approx(loop_aggregate(loss, mask, mode, normalizer), abs=1e-12)


def test_aggregate_modes_differ_on_ragged_masks():
    loss, mask = random_loss_and_mask(b=4, t=8, seed=5)
    values = {m: aggregate(loss, mask, m, normalizer=8).item() for m in AGGREGATION_MODES}
    assert len({round(v, 9) for v in values.values()}) == 3


def test_aggregate_known_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", normalizer=3).item() == pytest.approx(
        (6 + 4) / 2 / 3
    )


def test_aggregate_gradients_match_loop_weights():
    loss, mask = random_loss_and_mask(b=3, t=5, seed=6)
    x = loss.clone().requires_grad_(True)
    aggregate(x, mask, "seq-mean-token-mean").backward()
    expected = mask.double() / mask.sum(-1, keepdim=True) / mask.shape[0]
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("normalizer", [None, 0, -2.0])
def test_aggregate_sum_norm_needs_positive_normalizer(normalizer):
    loss, mask = random_loss_and_mask()
    with pytest.raises(ValueError, match="normalizer"):
        aggregate(loss, mask, "seq-mean-token-sum-norm", normalizer=normalizer)


def test_aggregate_unknown_mode_raises():
    loss, mask = random_loss_and_mask()
    with pytest.raises(ValueError, match="unknown mode 'sum'"):
        aggregate(loss, mask, "sum")


@pytest.mark.parametrize(("loss_shape", "mask_shape"), [((6,), (6,)), ((2, 3), (3, 2))])
def test_aggregate_shape_checks(loss_shape, mask_shape):
    with pytest.raises(ValueError, match="aggregate"):
        aggregate(torch.zeros(loss_shape), torch.ones(mask_shape), "token-mean")


@pytest.mark.parametrize("lora", [False, True])
def test_selected_logprobs_equal_the_full_head_on_selected_positions(lora):
    from rlhf_core.logprobs import causal_lm_selected_logprobs, causal_lm_token_logprobs
    from rlhf_core.models import ModelConfig, load_policy

    cfg = ModelConfig(name_or_path="tiny-qwen3", lora={"r": 4, "alpha": 8} if lora else None)
    torch.manual_seed(0)
    model = load_policy(cfg)
    ids = torch.randint(6, 100, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    target = torch.zeros(3, 11, dtype=torch.bool)
    target[0, 4:] = True
    target[1, 2:8] = True
    target[2, 10] = True
    full = causal_lm_token_logprobs(model, ids, mask)
    sel = causal_lm_selected_logprobs(model, ids, mask, target)
    torch.testing.assert_close(sel[target], full[target], rtol=1e-5, atol=1e-5)
    assert (sel[~target] == 0).all()
    sel.sum().backward()  # gradients flow through the selected positions only
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# ------------------------------------------------------------- fused linear head + log-softmax


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 4, 64])
def test_linear_token_logprobs_and_gradients_equal_the_unfused_float64_path(
    bias, temperature, chunk_rows
):
    from rlhf_core.logprobs import linear_token_logprobs

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(13, 8, dtype=torch.float64, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 11, bias=bias).double()
    labels = torch.randint(0, 11, (13,), generator=g)
    weights = torch.randn(13, dtype=torch.float64, generator=g)
    params = [hidden, head.weight] + ([head.bias] if bias else [])

    fused, fused_h = linear_token_logprobs(
        hidden, head, labels, temperature=temperature, chunk_rows=chunk_rows, with_entropy=True
    )
    logits = head(hidden).double() / temperature
    logp_all = torch.log_softmax(logits, -1)
    ref = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    ref_h = -(logp_all.exp() * logp_all).sum(-1)  # the textbook entropy
    torch.testing.assert_close(fused, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(fused_h, ref_h, rtol=0, atol=1e-12)
    # through the log-probs alone, and through log-probs and entropy (an entropy bonus)
    for objective in (
        lambda lp, h: (lp * weights).sum(),
        lambda lp, h: (lp * weights).sum() + (h**2).sum(),
    ):  # noqa: E501
        got = torch.autograd.grad(objective(fused, fused_h), params, retain_graph=True)
        want = torch.autograd.grad(objective(ref, ref_h), params, retain_graph=True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_linear_token_logprobs_bf16_gradients_are_as_close_as_autograds_own_bf16_path():
    """A bf16 head: the fused backward's gradients (grad_W per vocabulary block in one matmul,
    grad_h summed over the blocks) against float64, no further off than autograd's gradients of
    the same bf16 head through the unfused log-softmax."""
    from rlhf_core.logprobs import linear_token_logprobs

    g = torch.Generator().manual_seed(5)
    n, width, vocab = 300, 64, 5000
    hidden64 = torch.randn(n, width, dtype=torch.float64, generator=g)
    weight64 = torch.randn(vocab, width, dtype=torch.float64, generator=g) * width**-0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    weights = torch.randn(n, dtype=torch.float64, generator=g)

    def gradients(dtype, fused):
        hidden = hidden64.to(dtype, copy=True).requires_grad_(True)
        head = torch.nn.Linear(width, vocab, bias=False).to(dtype)
        head.weight.data.copy_(weight64.to(dtype))
        if fused:  # 32-row chunks: 32 x 5000 / 300 = 533-entry vocabulary blocks, 10 of them
            lp, ent = linear_token_logprobs(hidden, head, labels, chunk_rows=32, with_entropy=True)
        else:
            logp = torch.log_softmax(head(hidden).to(torch.float64), -1)
            lp, ent = logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
        ((lp * weights.to(lp.dtype)).sum() + 0.1 * ent.sum()).backward()
        return hidden.grad.double(), head.weight.grad.double()

    exact = gradients(torch.float64, fused=False)
    fused = gradients(torch.bfloat16, fused=True)
    autograd = gradients(torch.bfloat16, fused=False)
    for got, own, want in zip(fused, autograd, exact, strict=True):
        assert got.dtype == own.dtype
        error, own_error = (got - want).norm() / want.norm(), (own - want).norm() / want.norm()
        assert 0 < error <= 1.5 * own_error, (float(error), float(own_error))


def test_linear_token_logprobs_bf16_backward_allocates_no_float32_weight_sized_tensor():
    """For a bf16 head the backward writes grad_W block by block in bf16: no V x H float32
    accumulator (98 MiB at Qwen3-0.6B's width and a 50k vocabulary) is ever allocated."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlhf_core.logprobs import linear_token_logprobs

    head = torch.nn.Linear(32, 3000, bias=False).to(torch.bfloat16)
    hidden = torch.randn(200, 32, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 3000, (200,))
    outputs = []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    outputs.append((t.dtype, t.numel()))
            return out

    lp, ent = linear_token_logprobs(hidden, head, labels, chunk_rows=16, with_entropy=True)
    with Outputs():
        (lp.sum() + ent.sum()).backward()
    assert head.weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16
    biggest_float32 = max(n for dtype, n in outputs if dtype == torch.float32)
    assert biggest_float32 <= 16 * 3000  # the chunk budget's logits, not the 3000 x 32 weight
    assert any(dtype == torch.float32 for dtype, _ in outputs)


def test_linear_token_logprobs_never_holds_the_full_logits_in_the_graph():
    from rlhf_core.logprobs import linear_token_logprobs

    head = torch.nn.Linear(16, 5000)
    hidden = torch.randn(300, 16, requires_grad=True)
    labels = torch.randint(0, 5000, (300,))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_token_logprobs(hidden, head, labels, chunk_rows=32).sum().backward()
    assert max(saved) < 300 * 5000 / 10  # inputs and per-row stats only, no (N, V) tensor
    assert hidden.grad is not None and head.weight.grad is not None


def test_linear_token_logprobs_rejects_bad_shapes_and_temperature():
    from rlhf_core.logprobs import linear_token_logprobs

    head = torch.nn.Linear(4, 7)
    with pytest.raises(ValueError, match=r"hidden \(N, H\) and labels \(N,\)"):
        linear_token_logprobs(torch.randn(2, 3, 4), head, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        linear_token_logprobs(torch.randn(2, 4), head, torch.zeros(2, dtype=torch.long),
                              temperature=0.0)  # fmt: skip


def test_selected_logprobs_with_entropy_match_the_full_head():
    from rlhf_core.logprobs import causal_lm_selected_logprobs

    torch.manual_seed(0)
    model = load_policy(ModelConfig(name_or_path="tiny-qwen3"))
    ids = torch.randint(6, 100, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    target = torch.zeros(2, 9, dtype=torch.bool)
    target[:, 5:] = True
    full_lp, full_h = causal_lm_token_logprobs(model, ids, mask, temperature=0.8, with_entropy=True)
    lp, h = causal_lm_selected_logprobs(model, ids, mask, target, temperature=0.8,
                                        with_entropy=True)  # fmt: skip
    torch.testing.assert_close(lp[target], full_lp[target], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h[target], full_h[target], rtol=1e-5, atol=1e-5)
    assert (lp[~target] == 0).all() and (h[~target] == 0).all()


def sdpa_tiny_qwen3(kv_heads: int = 4) -> torch.nn.Module:
    """The tiny world's Qwen3 (4 query heads) on SDPA, with `kv_heads` key/value heads: 4 as the
    preset, 2 for grouped-query attention (as Qwen3-0.6B's 16/8)."""
    torch.manual_seed(0)
    model = load_policy(ModelConfig(name_or_path="tiny-qwen3", attention="sdpa"))
    if kv_heads == model.config.num_key_value_heads:
        return model
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_shared_prompt_logprobs_equal_flat_rows_in_float64(kv_heads, short, monkeypatch):
    """GRPO's G samples of a prompt, shuffled in the batch, with left-padded prompts of several
    lengths and right-padded completions: encoding each distinct prompt once (its KV cache
    gathered for its rows) gives the flat [prompt | completion] rows' log-probs, entropies and
    gradients (float64; gradients to 1e-5 relative, see below). With grouped-query attention the
    shared forward attends to the grouped heads as they are (`_grouped_sdpa`), the flat rows
    through transformers' repeated heads. `short`: the shared forward's attention is
    `short_attention` (which a bf16 model's short calls take), forced here in float64."""
    import rlhf_core.attention as attention
    from rlhf_core.logprobs import causal_lm_selected_logprobs
    from rlhf_core.prefix import shared_prompt_logprobs

    if short:
        monkeypatch.setattr(attention, "takes_short_attention", lambda q, k, n: q.shape[2] > 1)

    model = sdpa_tiny_qwen3(kv_heads).double()
    model.train()  # dropout is 0: train mode only to check the training path
    g = torch.Generator().manual_seed(7)
    width, t_len, group = 7, 6, 3
    prompts, pmask = (
        torch.zeros(3, width, dtype=torch.long),
        torch.zeros(3, width, dtype=torch.long),
    )
    for i, n in enumerate((7, 4, 2)):  # left-padded prompts
        prompts[i, width - n :] = torch.randint(6, 100, (n,), generator=g)
        pmask[i, width - n :] = 1
    order = torch.randperm(3 * group, generator=g)  # a group's rows scattered over the batch
    p_ids, p_mask = (
        prompts.repeat_interleave(group, 0)[order],
        pmask.repeat_interleave(group, 0)[order],
    )
    c_ids = torch.randint(6, 100, (3 * group, t_len), generator=g)
    c_mask = torch.ones_like(c_ids)
    for row, n in enumerate(torch.randint(1, t_len + 1, (3 * group,), generator=g).tolist()):
        c_mask[row, n:] = 0  # right padding after the completion's end
    c_ids = c_ids.masked_fill(c_mask == 0, 0)

    def flat():
        ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
        target = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
        target[:, width - 1 :] = c_mask.bool()
        lp, h = causal_lm_selected_logprobs(model, ids, mask, target, temperature=0.7,
                                            with_entropy=True)  # fmt: skip
        return lp[:, width - 1 :], h[:, width - 1 :]

    def shared():
        return shared_prompt_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.7,
                                      with_entropy=True)  # fmt: skip

    results = []
    for fn in (flat, shared):
        model.zero_grad()
        lp, h = fn()
        weights = torch.linspace(0.5, 1.5, lp.numel(), dtype=lp.dtype).view_as(lp)
        ((lp * weights).sum() + 0.3 * h.sum()).backward()
        results.append((lp.detach(), h.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))  # fmt: skip
    (lp_a, h_a, grad_a), (lp_b, h_b, grad_b) = results
    assert lp_a.dtype == torch.float64 and (lp_b[c_mask == 0] == 0).all()
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=1e-10)
    torch.testing.assert_close(h_b, h_a, rtol=0, atol=1e-10)
    for name, grad in grad_a.items():
        # Qwen3's RMSNorm computes in float32 even in a float64 model, so gradients summed over a
        # group before that cast (the shared prompt) and after it (flat rows) differ by ~1e-7
        scale = float(grad.abs().max())
        torch.testing.assert_close(grad_b[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
    assert any(g.abs().sum() > 0 for n, g in grad_b.items() if "layers.0." in n)


def test_shared_prompt_logprobs_rejects_right_padded_prompts():
    from rlhf_core.prefix import shared_prompt_logprobs

    model = load_policy(ModelConfig(name_or_path="tiny-qwen3"))
    ids = torch.ones(2, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        shared_prompt_logprobs(model, ids, mask, ids, torch.ones_like(ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shared_prompt_attention_takes_grouped_heads_as_they_are(monkeypatch, dtype):
    """Under grouped-query attention on the CPU the shared-prompt forward's multi-token queries
    reach the attention with the key/value heads unrepeated, so no repeated copies are made or
    saved: in bf16 (short calls) `short_attention`, in float32 SDPA with `enable_gqa=True`; the
    flat rows (transformers' own path) repeat them."""
    import rlhf_core.attention as attention
    from rlhf_core.logprobs import causal_lm_selected_logprobs
    from rlhf_core.prefix import shared_prompt_logprobs

    model = sdpa_tiny_qwen3(kv_heads=2).to(dtype)
    calls, short_calls = [], []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    short_attention = attention.short_attention

    def spy(query, key, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1], query.shape[2], kwargs.get("enable_gqa")))
        return sdpa(query, key, *args, **kwargs)

    def short_spy(query, key, *args, **kwargs):
        short_calls.append((query.shape[1], key.shape[1]))
        return short_attention(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention, "short_attention", short_spy)
    p_ids = torch.randint(6, 100, (4, 5))
    p_mask = torch.ones_like(p_ids)
    p_mask[0, :2] = 0  # left padding: a mask, so transformers would repeat the heads
    c_ids = torch.randint(6, 100, (4, 3))
    shared_prompt_logprobs(model, p_ids, p_mask, c_ids, torch.ones_like(c_ids)).sum().backward()
    if dtype == torch.bfloat16:
        assert not calls and short_calls and set(short_calls) == {(4, 2)}, (calls, short_calls)
    else:
        assert not short_calls and calls and all(c == (4, 2, c[2], True) for c in calls), calls
    calls.clear()
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, torch.ones_like(c_ids)], 1)
    causal_lm_selected_logprobs(model, ids, mask, mask[:, 1:].bool())
    assert calls and all(c[:2] == (4, 4) for c in calls), calls
    assert model.config._attn_implementation == "sdpa"  # restored after the forward


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_shared_prompt_gradients_are_bitwise_reproducible_on_two_threads(kv_heads):
    """The G rows of a group, shuffled over the batch, gather their prompt's keys, values and last
    state. An accumulating `index_put_` (the backward of `keys[index]`) adds a group's gradients
    on CPU in whatever order its threads finish, which made seeded GRPO runs differ; the gathers
    are `index_select`s, so repeated backward passes give identical gradients (fails with
    transformers' `batch_select_indices`)."""
    from rlhf_core.prefix import shared_prompt_logprobs

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = sdpa_tiny_qwen3(kv_heads)
        g = torch.Generator().manual_seed(3)
        prompts, group, width, t_len = 8, 8, 24, 16
        p_ids = torch.randint(6, 100, (prompts, width), generator=g)
        p_mask = torch.ones_like(p_ids)
        for i in range(prompts):  # left padding of several lengths
            p_mask[i, : int(torch.randint(0, width - 4, (1,), generator=g))] = 0
        order = torch.randperm(prompts * group, generator=g)  # groups spread over the threads
        p_ids, p_mask = (
            p_ids.repeat_interleave(group, 0)[order],
            p_mask.repeat_interleave(group, 0)[order],
        )
        p_ids = p_ids.masked_fill(p_mask == 0, 0)
        c_ids = torch.randint(6, 100, (prompts * group, t_len), generator=g)
        c_mask = torch.ones_like(c_ids)
        for row in range(prompts * group):
            c_mask[row, int(torch.randint(1, t_len + 1, (1,), generator=g)) :] = 0
        grads = []
        for _ in range(4):
            model.zero_grad()
            lp, h = shared_prompt_logprobs(model, p_ids, p_mask, c_ids, c_mask, with_entropy=True)
            (lp.sum() + 0.1 * h.sum()).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    finally:
        torch.set_num_threads(threads)
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other, strict=True))
