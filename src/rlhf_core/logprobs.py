"""Per-token log-probabilities, masked reductions and loss aggregation.

The log-prob of a label under logits z is log softmax(z)[y] = z[y] - logsumexp(z). We compute
exactly that, a chunk of rows at a time, so at most `chunk_rows x V` floats of temporaries exist at
once and no full (B, T, V) log-softmax copy is ever made (TRL's `selective_log_softmax` idea).
Half-precision logits are upcast to float32 per chunk.

`aggregate` turns a per-token loss (B, T) and a mask into a scalar in one of three ways:

    token-mean                 sum(loss * mask) / sum(mask)                  (DAPO, Dr. GRPO-style)
    seq-mean-token-mean        mean_b [ sum_t(loss * mask) / sum_t(mask) ]   (GRPO as published)
    seq-mean-token-sum-norm    mean_b [ sum_t(loss * mask) ] / normalizer    (Dr. GRPO: a constant,
                                                                             e.g. max new tokens)

Not here: the model forward itself is left to the caller except in `causal_lm_token_logprobs`.
"""

from __future__ import annotations

from typing import Literal

import torch

from rlhf_core.distributed import run_as_root_forward

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 1024,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[labels] for logits (..., V) and integer labels (...).

    Returns float32 (or float64 for float64 logits) of the labels' shape. Rows are processed in
    chunks of `chunk_rows` so memory stays O(chunk_rows x V) beyond the logits themselves. With
    `with_entropy`, also returns the entropy of each row's distribution,
    H = logsumexp(z) - sum(softmax(z) * z), computed in the same chunks.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"token_logprobs: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} "
            "plus a trailing vocabulary dimension"
        )
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1)
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    pieces, entropies = [], []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        chunk = flat_logits[start : start + chunk_rows].to(out_dtype)
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, flat_labels[start : start + chunk_rows, None]).squeeze(-1)
        lse = torch.logsumexp(chunk, dim=-1)
        pieces.append(picked - lse)
        if with_entropy:
            entropies.append(lse - (torch.softmax(chunk, dim=-1) * chunk).sum(-1))
    if not pieces:
        empty = flat_logits.new_zeros(labels.shape, dtype=out_dtype)
        return (empty, empty.clone()) if with_entropy else empty
    logps = torch.cat(pieces).reshape(labels.shape)
    if with_entropy:
        return logps, torch.cat(entropies).reshape(labels.shape)
    return logps


def causal_lm_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 1024,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of every next token: out[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1]).

    `input_ids`, `attention_mask`: (B, S). Returns (B, S - 1) (and the entropies, same shape,
    with `with_entropy`). Works under left or right padding (position ids are derived from the
    attention mask); positions that are padding hold garbage and must be masked by the caller.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).logits
    return token_logprobs(
        logits[:, :-1],
        input_ids[:, 1:],
        temperature=temperature,
        chunk_rows=chunk_rows,
        with_entropy=with_entropy,
    )


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`F.linear(x, weight, bias)` for 2D x, written into `out` (the same matmul)."""
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def decoder_and_head(model: torch.nn.Module):
    """(decoder, lm_head) of a plain, peft-wrapped or FSDP2-sharded causal LM, or None when the
    head cannot be run separately: a DDP wrapper (its forward hooks sync gradients) or a model that
    rescales or soft-caps its logits after the head (Gemma 2, Cohere, Granite), or whose head is
    not a plain `nn.Linear` (a LoRA-adapted or quantised head)."""
    if hasattr(model, "module"):  # torch.nn.parallel / FSDP1 wrappers
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or not hasattr(base, "get_decoder"):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(text, attr, None) not in (None, 1, 1.0):
            return None
    head = base.get_output_embeddings()
    decoder = base.get_decoder()
    if type(head) is not torch.nn.Linear or decoder is None or decoder is base:
        return None
    return decoder, head


class _LinearLabelLogProbs(torch.autograd.Function):
    """log softmax((h W^T + b) / temperature)[y] (and the entropy) for rows h (N, H), without
    ever holding the (N, V) logits. This is the "fused linear cross-entropy" of Liger-Kernel /
    Apple's cut-cross-entropy in plain PyTorch; it trades one extra head matmul for never
    allocating N x V floats (on CPU, big allocations page-fault on every step: half the time of
    a GRPO step went to the kernel before this).

    The forward walks `chunk_rows` rows at a time (each row's log-sum-exp needs its whole
    vocabulary) and saves h, the log-sum-exps and the entropies. The backward walks blocks of the
    vocabulary instead, each of about `chunk_rows x V / N` entries (the same number of floats per
    block): it recomputes the block's logits for every row, and the block's rows of grad_W come
    out of one matmul over all N rows, written straight into the gradient in the weights' dtype
    (fp32 accumulation inside the matmul, one rounding, as autograd's own linear backward), while
    grad_h, only N x H, is summed over the blocks in fp32. Walking rows instead would sum grad_W
    over row chunks, which needs a V x H fp32 accumulator (for a bf16 head at a 50k vocabulary an
    extra 98 MiB at the very start of the backward, when every activation is still alive) and an
    fp32 matmul for every chunk.

    Both loops write each chunk's (or block's) logits and exponentials into buffers allocated
    once per call, and the forward takes one exp per logit for the log-sum-exp and the entropy
    together (lse = m + log sum e, H = log sum e - sum e (z - m) / sum e, e = exp(z - m), m the
    row's max; the last sum a batched dot product). At a GRPO micro-batch of the benchmarks'
    `real` model (1024 rows, bf16, 50k vocabulary, with the entropy), forward + backward took
    925 ms before these two changes and 766 ms after, the forward alone 359 and 264 ms
    (`docs/performance.md`).

    With z = logits / temperature, p = softmax(z), l = log p[y], H = -sum p log p:
        dl/dz = onehot(y) - p            dH/dz = -p (log p + H)
    and dz/dlogits = 1 / temperature; grad_h = g_z W / temperature, grad_W = g_z^T h / temperature.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_rows, with_entropy):
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        n = hidden.shape[0]
        logps = hidden.new_empty(n, dtype=out_dtype)
        lses = hidden.new_empty(n, dtype=out_dtype)
        entropy = hidden.new_zeros(n, dtype=out_dtype)
        vocab = weight.shape[0]
        rows = min(n, chunk_rows)
        logits = hidden.new_empty(rows, vocab, dtype=weight.dtype)  # reused by every chunk
        upcast = (
            hidden.new_empty(rows, vocab, dtype=out_dtype) if weight.dtype != out_dtype else None
        )
        exps = hidden.new_empty(rows, vocab, dtype=out_dtype)
        for start in range(0, n, chunk_rows):
            end = min(n, start + chunk_rows)
            z = _linear(hidden[start:end], weight, bias, out=logits[: end - start])
            if upcast is not None:
                z = upcast[: end - start].copy_(z)
            if temperature != 1.0:
                z.div_(temperature)
            # one exp per logit for both the log-sum-exp and the entropy: with m the row's max
            # and e = exp(z - m), lse = m + log sum(e), H = log sum(e) - sum(e (z - m)) / sum(e)
            top = z.amax(-1, keepdim=True)
            picked = z.gather(-1, labels[start:end, None])
            shifted = z.sub_(top)
            e = torch.exp(shifted, out=exps[: end - start])
            total = e.sum(-1, keepdim=True)
            log_total = total.log()
            lses[start:end] = (top + log_total).squeeze(-1)
            logps[start:end] = (picked - top - log_total).squeeze(-1)
            if with_entropy:  # sum(e (z - m)) as a batched dot product: no third N x V tensor
                dot = torch.matmul(e.unsqueeze(-2), shifted.unsqueeze(-1)).view(-1, 1)
                entropy[start:end] = (log_total - dot / total).squeeze(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lses, entropy)
        ctx.temperature, ctx.chunk_rows, ctx.with_entropy = temperature, chunk_rows, with_entropy
        ctx.mark_non_differentiable(lses)
        ctx.set_materialize_grads(False)  # an unused entropy output arrives as None, not zeros
        return logps, entropy, lses

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy, _grad_lse):
        hidden, weight, bias, labels, lses, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        use_entropy = ctx.with_entropy and grad_entropy is not None
        n, vocab = hidden.shape[0], weight.shape[0]
        acc = lses.dtype  # float32 (float64 for a float64 model)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.zeros_like(hidden, dtype=acc) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(bias) if need_bias else None
        g = (grad_logps if grad_logps is not None else torch.zeros_like(lses))[:, None]
        if use_entropy:  # g_z = p (a log p + c) + onehot(y) g, a = -g_H, c = -(g_H H + g)
            slope = -grad_entropy[:, None]
            offset = slope * entropy[:, None] - g
        h_w = hidden.to(weight.dtype) if need_weight else None
        block = max(1, ctx.chunk_rows * vocab // max(1, n))
        buffers: dict[str, torch.Tensor] = {}  # one set for every block: no fresh N x block

        def scratch(name: str, cols: int, dtype: torch.dtype) -> torch.Tensor:
            buffer = buffers.get(name)
            if buffer is None:
                buffer = buffers[name] = hidden.new_empty(n * block, dtype=dtype)
            return buffer[: n * cols].view(n, cols)

        for start in range(0, vocab, block):
            end = min(vocab, start + block)
            w = weight[start:end]
            b = bias[start:end] if bias is not None else None
            z = _linear(hidden, w, b, out=scratch("in_weight_dtype", end - start, weight.dtype))
            if z.dtype != acc:
                z = scratch("z", end - start, acc).copy_(z)
            if temperature != 1.0:
                z.div_(temperature)
            logp = z.sub_(lses[:, None])  # log p over this block, in place
            p = torch.exp(logp, out=scratch("p", end - start, acc))
            if use_entropy:  # -p (log p + H) g_H - p g
                grad_z = p.mul_(logp.mul_(slope).add_(offset))
            else:
                grad_z = p.mul_(-g)
            rows = ((labels >= start) & (labels < end)).nonzero().squeeze(1)  # + onehot(y) g
            grad_z.index_put_((rows, labels[rows] - start), g[rows, 0], accumulate=True)
            if temperature != 1.0:
                grad_z.div_(temperature)
            if grad_bias is not None:
                grad_bias[start:end] = grad_z.sum(0)
            if grad_z.dtype != weight.dtype:  # what autograd's linear backward would be given
                grad_z = scratch("in_weight_dtype", end - start, weight.dtype).copy_(grad_z)
            if grad_hidden is not None:
                grad_hidden += grad_z @ w
            if grad_weight is not None:
                torch.mm(grad_z.t(), h_w, out=grad_weight[start:end])
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs(head(hidden), labels, ...)` for hidden (N, H) and labels (N,), computed
    without materialising the (N, V) logits (see `_LinearLabelLogProbs`); differentiable in
    `hidden`, `head.weight` and `head.bias`, including through the entropy. `chunk_rows` defaults
    to about 4M logits per chunk (16 MB in float32); the backward's vocabulary blocks hold as many
    logits each."""
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_token_logprobs: expected hidden (N, H) and labels (N,), got "
            f"{tuple(hidden.shape)} and {tuple(labels.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"linear_token_logprobs: temperature must be > 0, got {temperature}")
    if chunk_rows is None:
        chunk_rows = max(1, (1 << 22) // head.weight.shape[0])
    logps, entropy, _ = _LinearLabelLogProbs.apply(
        hidden, head.weight, head.bias, labels, float(temperature), int(chunk_rows), with_entropy
    )
    return (logps, entropy) if with_entropy else logps


def causal_lm_selected_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`causal_lm_token_logprobs` where only `target_mask` (B, S - 1) matters: the LM head runs
    on the selected positions only (the completion tokens), not on prompt and padding, fused with
    the log-softmax so no (N, V) logits are kept (`linear_token_logprobs`); the rest of the output
    is 0. On CPU this made a DPO step ~6x faster at ~1/5 of the memory (docs/performance.md).
    Under FSDP2 the decoder and head run inside the root unit's forward (`rlhf_core.distributed.
    run_as_root_forward`), so the head weight is the gathered one. Falls back to the full head
    where that is not safe (a DDP wrapper, soft-capped logits, a
    head that is not a plain `nn.Linear`, e.g. a LoRA-adapted one)."""
    parts = decoder_and_head(model)
    if parts is None:
        full = causal_lm_token_logprobs(
            model, input_ids, attention_mask, temperature=temperature, with_entropy=with_entropy
        )
        if with_entropy:
            keep = target_mask.bool()
            return tuple(torch.where(keep, x, torch.zeros_like(x)) for x in full)
        return torch.where(target_mask.bool(), full, torch.zeros_like(full))
    return run_as_root_forward(
        model, _fused_selected_logprobs, *parts, input_ids, attention_mask, target_mask,
        temperature, chunk_rows, with_entropy,
    )  # fmt: skip


def _fused_selected_logprobs(
    decoder, head, input_ids, attention_mask, target_mask, temperature, chunk_rows, with_entropy
):
    """The decoder, then the fused head on the `target_mask` positions (see the caller)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).last_hidden_state
    select = target_mask.bool()
    picked = fused_head_logprobs(
        head, hidden[:, :-1][select], input_ids[:, 1:][select], temperature, chunk_rows,
        with_entropy,
    )  # fmt: skip
    return scatter_selected(select, picked, with_entropy)


def fused_head_logprobs(
    head: torch.nn.Linear,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    chunk_rows: int | None,
    with_entropy: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`linear_token_logprobs` of the selected hidden states (N, H) through `head`, inside the
    head's own forward: an untied head is an FSDP2 unit of its own, gathered just around its
    use (`rlhf_core.distributed.run_as_root_forward`)."""
    return run_as_root_forward(
        head, _head_logprobs, hidden, head, labels, temperature, chunk_rows, with_entropy
    )


def _head_logprobs(hidden, head, labels, temperature, chunk_rows, with_entropy):
    return linear_token_logprobs(
        hidden, head, labels, temperature=temperature, chunk_rows=chunk_rows,
        with_entropy=with_entropy,
    )  # fmt: skip


def scatter_selected(
    select: torch.Tensor,
    picked: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    with_entropy: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The values at the `select`ed positions (N,) (with `with_entropy`, a pair of them) laid
    out in the shape of `select`, 0 elsewhere."""
    outs = tuple(
        torch.zeros(select.shape, dtype=v.dtype, device=v.device).masked_scatter(select, v)
        for v in (picked if with_entropy else (picked,))
    )
    return outs if with_entropy else outs[0]


def causal_lm_logprobs_at(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    sources: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log p(labels[n] | the hidden state at flat position sources[n]), (N,), for rows whose
    layout the caller owns (explicit `position_ids`; `attention_mask` 2D or a 4D additive mask:
    `rlhf_core.layout`). The LM head runs on the N source positions only, fused with the
    log-softmax as in `causal_lm_selected_logprobs`, with the same fallback to the full head."""
    parts = decoder_and_head(model)
    if parts is None:
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=False,
        ).logits  # fmt: skip
        return token_logprobs(logits.flatten(0, 1)[sources], labels, temperature=temperature)
    return run_as_root_forward(
        model, _fused_logprobs_at, *parts, input_ids, attention_mask, position_ids, sources,
        labels, temperature,
    )  # fmt: skip


def _fused_logprobs_at(
    decoder, head, input_ids, attention_mask, position_ids, sources, labels, temperature
):
    """The decoder, then the fused head on the `sources` positions (see the caller)."""
    hidden = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).last_hidden_state
    return fused_head_logprobs(
        head, hidden.flatten(0, 1)[sources], labels, temperature, None, False
    )


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is true (mask may be bool or 0/1 float)."""
    if values.shape != mask.shape:
        raise ValueError(f"masked_sum: values {tuple(values.shape)} != mask {tuple(mask.shape)}")
    # where() rather than multiply: padding positions may hold inf/nan that 0 * x would keep.
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is true; 0 where the mask is empty."""
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return total / count.clamp(min=1)


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationMode,
    *,
    normalizer: float | None = None,
    total_tokens: torch.Tensor | float | None = None,
    total_sequences: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (B, T) under `mask` (B, T) to a scalar; see the module docstring.

    Fully masked rows contribute 0 (and still count as a row in the seq-mean modes).

    Gradient accumulation: pass the whole optimizer step's `total_tokens` (token-mean) or
    `total_sequences` (seq-mean modes) and the result is this micro-batch's share, so summing the
    micro-batch losses gives exactly the one-big-batch loss. Without them the local counts are
    used (the plain formulas above).
    """
    if loss.dim() != 2 or loss.shape != mask.shape:
        raise ValueError(
            f"aggregate: expected loss and mask of the same (B, T) shape, got "
            f"{tuple(loss.shape)} and {tuple(mask.shape)}"
        )
    if mode == "token-mean":
        if total_tokens is None:
            return masked_mean(loss, mask)
        return masked_sum(loss, mask) / total_tokens
    sequences = loss.shape[0] if total_sequences is None else total_sequences
    if mode == "seq-mean-token-mean":
        return masked_mean(loss, mask, dim=-1).sum() / sequences
    if mode == "seq-mean-token-sum-norm":
        if normalizer is None or normalizer <= 0:
            raise ValueError(
                "aggregate: mode 'seq-mean-token-sum-norm' needs a positive constant normalizer "
                f"(e.g. max_new_tokens), got {normalizer!r}"
            )
        return masked_sum(loss, mask, dim=-1).sum() / (sequences * normalizer)
    raise ValueError(f"aggregate: unknown mode {mode!r}; expected one of {AGGREGATION_MODES}")
