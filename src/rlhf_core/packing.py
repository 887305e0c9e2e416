"""Prompt sharing: a prompt encoded once for all its completions, the one owner of both ways.

Two mechanisms, each where it is exact and fast:

  packed rows (4D mask)    SFT examples, DPO / KTO pairs, a reward model's pairs: each batch is
                           laid out once in the collate (`pack_groups`), prompts and completions
                           in one forward. Needs an attention that reads a 4D mask (SDPA, eager:
                           `supports_packing`).
  shared prefix (KV cache) GRPO's groups (the G samples of a prompt, found by comparing the
                           prompts: `shared_prompt_logprobs`) and a reward model's pairs under
                           flash-attention 2 (no 4D mask): the distinct prompts run once, their
                           keys and values are gathered for the rows that continue them, and
                           the completions attend to them through the KV cache
                           (`shared_prefix_forward`). Needs the cache, so not under activation
                           checkpointing. The rows stay rows (no packing), which suits sampled
                           completions of one length budget.

Both give the log-probs (or scores) of the unshared rows up to float rounding, gradients
included (tested in float64), and both run the LM head on the completion positions only
(`rlhf_core.logprobs`' fused head).

Packed rows. One layout serves SFT, DPO and reward-model batches. A *group* is a prefix (the
prompt) and one or more *branches* (completions) that continue it:

    SFT example      (prompt, [completion])
    preference pair  (prompt, [chosen, rejected])        DPO, KTO, a reward model's pair

A group is laid out in a row as [prefix | branch 1 | branch 2 | ...]. Every token sees exactly
what it would see in its own `prefix + branch` row: a branch token attends to the prefix and to
the earlier tokens of its own branch (never another branch, never another group), and position
ids restart at every group, each branch counting on from the prefix's end. So the prompt of a
pair is encoded once, not once per completion (prefix sharing: Wang et al. 2024, "Accelerating
Direct Preference Optimization with Prefix Sharing", arXiv:2410.20305), and several short groups
share a row instead of each padding one (padding-free packing; first-fit decreasing into rows no
longer than the longest group, `pack_rows`).

    pack_groups(groups, pad_id)          -> input_ids (R, L), a 4D boolean mask (R, 1, L, L),
                                            position_ids (R, L), and the targets: where each
                                            completion token is predicted from
    packed_token_logprobs(model, batch)  -> (N,) log-probs of those N targets, through the fused
                                            completion-only LM head (`rlhf_core.logprobs`)
    stream_sums(values, batch)           -> (S,) one sum per branch ("stream"), group-major
    batch_logprobs(model, batch)         -> log-probs aligned with batch["loss_mask"], for a
                                            packed batch or a flat one (`policy_logprobs`)

The results equal the unpacked forward's up to float rounding (tested in float64 to 1e-6).

Attention: the 4D mask is for SDPA and eager attention (CPU and GPU); `supports_packing` says
whether a model takes it. Flash attention takes no 4D mask; there transformers packs by position
ids alone (its varlen path: one row, no attention mask, positions restarting at 0 for every
sequence, the layout of TRL's `padding_free` and transformers' `DataCollatorWithFlattening`),
which expresses a block-diagonal mask but not a prefix shared by two branches.
`pack_groups(..., flat=True)` builds that layout: every stream (a group's prefix and one of its
branches) becomes a sequence of its own, so the prompt is encoded once per completion again, but
no position is padding. `supports_flat_packing` says where a trainer uses it (a causal LM whose
attention is a flash-attention implementation); SFT and DPO do, a reward model shares its
prompt through the KV cache instead. The flat batch is tested on the CPU through SDPA, where
transformers reads the same position ids into a block-diagonal mask
(`masking_utils.find_packed_sequence_indices`), and against the sequence boundaries transformers'
flash path computes from them (`prepare_fa_kwargs_from_position_ids`); the flash kernel itself
needs a GPU and is not run by the tests. SDPA computes the whole masked (L, L) score matrix of
a row, so by default rows are kept no longer than the batch's longest group; that leaves padding
(~25% of the positions on HH batches of 4 pairs). `row_tokens` lets rows grow to hold several
groups with no padding, and `segmented_attention` then computes attention one segment (a group)
at a time, so no score between two groups is ever computed, nor any for a row's padding after
its groups: the cost of attention is the sum of the groups' squared lengths, whatever the rows
hold. Where that many calls cost more than the scores they skip (`segments_pay`: a narrow
model's short rows), it makes one call over the rows instead. The 4D mask stays
the definition (each segment's block of it is passed to SDPA, and every entry outside the blocks
is masked), so a forward outside the context (eager attention, activation recomputation) gives
the same result, only with the whole (L, L) matrix computed.

Shared prefix. `shared_prefix_forward(decoder, prefixes, rows)` is the forward both the policy
log-probs (`shared_prompt_logprobs`) and the reward model (`reward_models.models`) run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from rlhf_core.attention import (
    folds_query_groups,
    grouped_decode_attention,
    short_attention,
    takes_short_attention,
)
from rlhf_core.distributed import run_as_root_forward
from rlhf_core.logprobs import (
    causal_lm_logprobs_at,
    causal_lm_selected_logprobs,
    decoder_and_head,
    fused_head_logprobs,
    scatter_selected,
)
from rlhf_core.policy_model import policy_logprobs

Group = tuple[Sequence[int], Sequence[Sequence[int]]]  # (prefix ids, [branch ids, ...])


def pack_rows(
    lengths: list[int], *, pack: bool = True, row_tokens: int | None = None
) -> list[list[int]]:
    """Indices of sequences grouped into rows no longer than the longest sequence (or
    `row_tokens`, if larger), by first-fit decreasing: the longest first, each into the first row
    with room. Rows never get longer than padding every sequence to the longest would make them,
    and short sequences share a row instead of each padding one (on HH batches of 4 pairs: ~14%
    fewer positions, ~15% less attention than one row per pair). With `pack=False`, one
    sequence per row, in order."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    capacity = max(max(lengths), row_tokens or 0)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(capacity)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def pack_groups(
    groups: Sequence[Group],
    pad_id: int,
    *,
    pack: bool = True,
    row_tokens: int | None = None,
    flat: bool = False,
) -> dict[str, torch.Tensor]:
    """Groups (prefix, [branches]) as packed rows (see the module docstring); `pack=False` puts
    each group in a row of its own (the prompt is still shared by its branches); `row_tokens`
    lets a row hold that many tokens when the longest group is shorter (for
    `segmented_attention`: fewer rows, no padding); `flat=True` gives the flash-attention varlen
    layout instead (`_pack_flat`: one row, no attention mask, no prefix shared).

    Streams are the branches in group-major order (group 0's branches, then group 1's ...).
    Returns, right-padded:
      input_ids (R, L); attention_mask (R, 1, L, L) boolean, True = may attend (a padding query
      attends to itself only, so no row is empty); position_ids (R, L);
      sources (N,), targets (N,), owners (N,): target n is token targets[n] of stream owners[n],
      predicted from the hidden state at flat position sources[n] of the (R * L) positions
      (a branch's first token from the prefix's last position; not a target if the prefix is
      empty); ends (S,): flat position of each stream's last token (its prefix's last token
      for an empty branch); branch_lengths (S,); prefix_lengths (G,); segments (K, 3): (row,
      start, end) of every group, each row's in order and back to back from its start; a row's
      positions after its last segment are padding (no query attends outside its segment, and
      nothing attends to padding: `segmented_attention`).
    """
    if not groups:
        raise ValueError("pack_groups: no groups")
    if flat:
        return _pack_flat(groups)
    sizes = [len(prefix) + sum(len(b) for b in branches) for prefix, branches in groups]
    if min(sizes) == 0:
        raise ValueError(f"pack_groups: group {sizes.index(0)} has no tokens")
    rows = pack_rows(sizes, pack=pack, row_tokens=row_tokens)
    longest = max(sum(sizes[i] for i in members) for members in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), longest), dtype=torch.long)
    group_of = torch.full((len(rows), longest), -1, dtype=torch.long)  # -1 = padding
    part = torch.zeros((len(rows), longest), dtype=torch.long)  # 0 prefix, k = branch k
    first_stream = [0]
    for _, branches in groups:
        first_stream.append(first_stream[-1] + len(branches))
    ends = torch.zeros(first_stream[-1], dtype=torch.long)
    sources, targets, owners, segments = [], [], [], []
    for r, members in enumerate(rows):
        start = r * longest  # flat position of the row's next free slot
        for g in members:
            prefix, branches = groups[g]
            n_p = len(prefix)
            flat = [*prefix]
            for branch in branches:
                flat += branch
            offset = start - r * longest
            segments.append((r, offset, offset + len(flat)))
            ids[r, offset : offset + len(flat)] = torch.tensor(flat, dtype=torch.long)
            group_of[r, offset : offset + len(flat)] = g
            positions[r, offset : offset + n_p] = torch.arange(n_p)
            at = start + n_p  # flat position of the current branch's first token
            for k, branch in enumerate(branches):
                n_b, s = len(branch), first_stream[g] + k
                local = at - r * longest
                positions[r, local : local + n_b] = torch.arange(n_p, n_p + n_b)
                part[r, local : local + n_b] = k + 1
                preceding = ([start + n_p - 1] if n_p and n_b else []) + list(
                    range(at, at + n_b - 1)
                )
                sources += preceding
                targets += list(branch[n_b - len(preceding) :])
                owners += [s] * len(preceding)
                ends[s] = at + n_b - 1 if n_b else start + n_p - 1
                at += n_b
            start = at
    index = torch.arange(longest)
    causal = index[None, :, None] >= index[None, None, :]  # (1, L, L): query >= key
    q_group, k_group = group_of[:, :, None], group_of[:, None, :]
    q_part, k_part = part[:, :, None], part[:, None, :]
    allowed = causal & (q_group == k_group) & (k_group >= 0) & ((k_part == 0) | (k_part == q_part))
    allowed |= torch.eye(longest, dtype=torch.bool)[None] & (q_group < 0)
    return {
        "input_ids": ids,
        "attention_mask": allowed[:, None],
        "position_ids": positions,
        "sources": torch.tensor(sources, dtype=torch.long),
        "targets": torch.tensor(targets, dtype=torch.long),
        "owners": torch.tensor(owners, dtype=torch.long),
        "ends": ends,
        "branch_lengths": torch.tensor([len(b) for _, bs in groups for b in bs], dtype=torch.long),
        "prefix_lengths": torch.tensor([len(p) for p, _ in groups], dtype=torch.long),
        "branches_per_group": torch.tensor([len(bs) for _, bs in groups], dtype=torch.long),
        "segments": torch.tensor(segments, dtype=torch.long),
    }


def _pack_flat(groups: Sequence[Group]) -> dict[str, torch.Tensor]:
    """`pack_groups(groups, flat=True)`: every stream (a group's prefix followed by one of its
    branches, group-major) as a sequence of its own, all of them back to back in one row with
    no padding; position ids restart at 0 at every sequence, which is all that tells the
    sequences apart (no attention mask). Returns input_ids (1, T), position_ids (1, T) and the
    targets and stream bookkeeping of `pack_groups` (sources, targets, owners, ends,
    branch_lengths), with prefix_lengths and branches_per_group per stream (each stream is a
    group of one branch here, so `unpacked_tokens` counts the same tokens)."""
    streams = [(prefix, branch) for prefix, branches in groups for branch in branches]
    ids: list[int] = []
    positions: list[int] = []
    sources, targets, owners, ends = [], [], [], []
    for s, (prefix, branch) in enumerate(streams):
        n_p, n_b, start = len(prefix), len(branch), len(ids)
        if n_p + n_b == 0:
            raise ValueError(f"pack_groups(flat=True): stream {s} has no tokens")
        ids += [*prefix, *branch]
        positions += range(n_p + n_b)
        preceding = list(range(start + max(n_p, 1) - 1, start + n_p + n_b - 1))
        sources += preceding
        targets += list(branch[n_b - len(preceding) :])
        owners += [s] * len(preceding)
        ends.append(len(ids) - 1)
    long = {"dtype": torch.long}
    return {
        "input_ids": torch.tensor([ids], **long),
        "position_ids": torch.tensor([positions], **long),
        "sources": torch.tensor(sources, **long),
        "targets": torch.tensor(targets, **long),
        "owners": torch.tensor(owners, **long),
        "ends": torch.tensor(ends, **long),
        "branch_lengths": torch.tensor([len(b) for _, b in streams], **long),
        "prefix_lengths": torch.tensor([len(p) for p, _ in streams], **long),
        "branches_per_group": torch.ones(len(streams), **long),
    }


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    """True for a `pack_groups` batch (explicit targets, and a 4D attention mask or, in the
    flat layout, none)."""
    if "sources" not in batch:
        return False
    return "attention_mask" not in batch or batch["attention_mask"].dim() == 4


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 4D boolean mask (True = may attend) as the additive mask transformers passes on
    untouched: 0 where allowed, the dtype's minimum elsewhere. Eager attention adds the mask to
    the scores (a boolean one would add 0/1: wrong), and SDPA would otherwise convert a boolean
    mask in every layer's forward and backward."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed.bool(), torch.finfo(dtype).min)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether `model` takes a packed batch exactly: a causal (decoder-only) model whose
    attention reads a 4D mask (SDPA or eager). Encoder-decoder and flash-attention models do
    not (see the module docstring)."""
    config = getattr(_unwrapped(model), "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager")


def packing_layout(model: torch.nn.Module) -> str | None:
    """The packed layout `model` takes: "mask" (`pack_groups`' rows with a 4D mask: SDPA or
    eager), "flat" (`pack_groups(..., flat=True)`: flash attention's varlen) or None (run the
    batch unpacked: encoder-decoder models, other attention implementations)."""
    if supports_packing(model):
        return "mask"
    return "flat" if supports_flat_packing(model) else None


def supports_flat_packing(model: torch.nn.Module) -> bool:
    """Whether `model` takes the flat layout (`pack_groups(..., flat=True)`) where it cannot
    take the 4D mask: a causal (decoder-only) model whose attention is a flash-attention
    implementation (transformers' rule: "flash" in its name), which reads packed sequences from
    the position ids (varlen)."""
    config = getattr(_unwrapped(model), "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    return "flash" in (getattr(config, "_attn_implementation", None) or "")


#: The attention implementation `segmented_attention` switches an SDPA model to (registered with
#: transformers on first use): SDPA one segment at a time.
SEGMENTED_SDPA = "rlhf_segmented_sdpa"
#: Row capacity of packed batches under segmented attention (`pack_groups(row_tokens=...)`): a
#: batch's groups share rows up to this many tokens, so rows carry no padding until it is reached.
#: The (L, L) mask of such a row is built (4096: 16M entries), though attention only reads its
#: segments' blocks.
SEGMENTED_ROW_TOKENS = 4096
_SEGMENTS: ContextVar[list[tuple[int, int, int]] | None] = ContextVar("segments", default=None)


def supports_segmented_attention(model: torch.nn.Module) -> bool:
    """Whether `segmented_attention` applies to `model`: a packing-capable model running SDPA on
    the CPU (where SDPA computes every masked score). On a GPU, flash-attention's varlen path is
    the tool for this, and per-segment kernel launches are untested here."""
    inner = _unwrapped(model)
    config = getattr(inner, "config", None)
    on_cpu = all(p.device.type == "cpu" for p in inner.parameters())
    return supports_packing(model) and config._attn_implementation == "sdpa" and on_cpu


#: Below this hidden size a trainer keeps rows of at most `max_length` tokens instead of
#: segmented rows (`segmented_rows_pay`). Each segment costs one SDPA call per layer, forward and
#: backward (`SEGMENT_CALL_UNITS`); what segmented rows save is the padding at the ends of
#: max_length rows, worth ~72 x hidden^2 FLOPs per padded token and layer. Measured, 30 steps of
#: the quickstart's SFT stage (tiny-qwen3, hidden 128, ~68-token examples, 64 per step, 2
#: threads; the trainer's wall_time_s): segmented rows 10.0-10.3 s, max_length rows (one
#: attention call per layer, `segments_pay`) 4.8-5.0 s, padded rows 4.4-4.8 s (before the split
#: per row, the uncomputed padding tail and `segments_pay`, max_length rows took 6.7 s; with the
#: split alone segmented rows took 25.9 s, most of it the second row's padding tail). On the
#: benchmarks' `real` model (hidden 512) segmented rows took a DPO step from 7.16 to 5.79
#: CPU-seconds.
SEGMENTED_MIN_HIDDEN = 256


def segmented_rows_pay(model: torch.nn.Module) -> bool:
    """Whether a trainer should pack a step into segmented rows (`row_tokens=
    SEGMENTED_ROW_TOKENS`) for `model`: `supports_segmented_attention`, and a model wide enough
    (`SEGMENTED_MIN_HIDDEN`) that the padding saved outweighs a call per segment."""
    hidden = getattr(getattr(_unwrapped(model), "config", None), "hidden_size", 0) or 0
    return supports_segmented_attention(model) and hidden >= SEGMENTED_MIN_HIDDEN


def _grouped_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention, except for a multi-token query with a mask on the CPU:

    - bf16/fp16 with few keys (`rlhf_core.attention.takes_short_attention`): `short_attention`
      (SDPA's CPU flash kernel is 2.3x slower at a GRPO micro-batch's shape; see that module);
    - otherwise, under grouped-query attention (fewer key/value heads than query heads): SDPA
      with `enable_gqa=True`. transformers passes it only without a mask (CUDA's fast kernels
      need that) and otherwise repeats every key and value head once per query head of its
      group (`repeat_kv`: copies that autograd keeps for the backward); torch's CPU flash kernel
      takes the mask and the grouped heads as they are: the same output (bitwise at GRPO's
      shapes), faster, and no copies saved.

    A single-token query (a decoding step) in bf16/fp16 under grouped-query attention takes the
    G query heads of a group as G query rows of one SDPA call on their key/value head
    (`rlhf_core.attention.grouped_decode_attention`), as transformers does when the step has a
    mask; without one transformers calls SDPA with `enable_gqa=True`, 3-4x slower on the CPU in
    bf16. Other single-token queries keep transformers' path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (
        not args and kwargs.get("position_bias") is None and kwargs.get("cache") is None
        and not kwargs.get("softcap") and not kwargs.get("output_attentions")
        and not kwargs.get("dropout")
    )  # fmt: skip
    if plain and query.device.type == "cpu" and folds_query_groups(query, key, attention_mask):
        out = grouped_decode_attention(query, key, value, attention_mask, kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None
    ours = plain and attention_mask is not None and query.device.type == "cpu"
    if ours and takes_short_attention(query, key):
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
    """SDPA attention (`_grouped_sdpa`), called once per segment of the packed rows (`_SEGMENTS`)
    when there are segments: query (B, H, L, D), key/value (B, H_kv, L, D), mask (B, 1, L, L) ->
    (B, L, H, D). Queries of a segment attend only to keys of the same segment (the mask says
    so), so the result is the full call's at every segment's position; the scores between
    segments, all masked, are never computed, nor a row's padding after its last segment (no
    query attends to it; its output is zeros where the full call's lets each padding query see
    itself)."""
    segments = _SEGMENTS.get()
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


@contextmanager
def segmented_attention(model: torch.nn.Module, segments: torch.Tensor | None) -> Iterator[None]:
    """Inside this context, `model`'s forwards compute attention one segment of `segments` (K, 3)
    = (row, start, end) at a time (`pack_groups`' segments: each row's back to back from its
    start, in order; the positions after a row's last one are padding) where that is cheaper
    (`segments_pay`), else in one call over the rows with their masks
    (`grouped_query_attention`); nothing changes where `supports_segmented_attention` is false
    or `segments` is None. The backward needs no context (autograd kept each call)."""
    if segments is None or not supports_segmented_attention(model):
        yield
        return
    spans = [tuple(x) for x in segments.tolist()]
    with _our_sdpa(model, spans if segments_pay(model, spans) else None):
        yield


#: What one more SDPA call per layer costs (its forward and backward, the split and the autograd
#: nodes around it), in units of attention work: score entries x query heads x head size. On this
#: CPU a call costs ~0.15-0.2 ms and a unit ~1e-10 s (fp32 and bf16 alike): a 60-step run of
#: `configs/instruction_tuning/tiny_sft.yaml` (64 rows of at most 96 tokens, ~3 sequences each)
#: took 12.0 s segment by segment and 10.3 s one call per layer, where the segments' calls save
#: 17M units per layer against ~70 extra calls.
SEGMENT_CALL_UNITS = 2_000_000


def segments_pay(model: torch.nn.Module, spans: list[tuple[int, int, int]]) -> bool:
    """Whether attention segment by segment (one SDPA call per segment of every row) is cheaper
    for `model` than one call over all rows with their masks: the score entries it skips (those
    between segments, all masked) times the query heads' width must outweigh its extra calls
    (`SEGMENT_CALL_UNITS` each). Long rows of many sequences (segmented rows) always pay; rows of
    a few short sequences in a narrow model (the tiny world's) do not. Both compute the same
    attention (the skipped entries are masked)."""
    config = _unwrapped(model).config
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    rows = {r for r, _, _ in spans}
    length = max(e for _, _, e in spans)
    skipped = len(rows) * length**2 - sum((e - s) ** 2 for _, s, e in spans)
    return skipped * width > (len(spans) - 1) * SEGMENT_CALL_UNITS


@contextmanager
def grouped_query_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside this context, `model`'s multi-token forwards with a mask take grouped key/value
    heads as they are (`_grouped_sdpa`) where `supports_segmented_attention` holds (SDPA on the
    CPU); nothing changes elsewhere."""
    if not supports_segmented_attention(model):
        yield
        return
    with _our_sdpa(model, None):
        yield


@contextmanager
def _our_sdpa(model: torch.nn.Module, segments: list[tuple[int, int, int]] | None):
    """Switch `model` to `_segmented_sdpa` (registered with transformers on first use) for the
    context, one segment at a time when `segments` is given, and back afterwards."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if SEGMENTED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(SEGMENTED_SDPA, _segmented_sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENTED_SDPA, sdpa_mask)
    config = _unwrapped(model).config
    token = _SEGMENTS.set(segments)
    before = config._attn_implementation_internal
    config._attn_implementation_internal = SEGMENTED_SDPA
    try:
        yield
    finally:
        config._attn_implementation_internal = before
        _SEGMENTS.reset(token)


def packed_token_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], *, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs (N,) of a `pack_groups` batch's targets under a causal LM: one forward of the
    packed rows, the LM head on the target positions only (`causal_lm_logprobs_at`), attention
    segment by segment where that applies (`segmented_attention`)."""
    if "attention_mask" not in batch:  # the flat layout: sequences told apart by position ids
        return causal_lm_logprobs_at(
            model, batch["input_ids"], None, batch["position_ids"], batch["sources"],
            batch["targets"], temperature=temperature,
        )  # fmt: skip
    dtype = _unwrapped(model).get_input_embeddings().weight.dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    with segmented_attention(model, batch.get("segments")):
        return causal_lm_logprobs_at(
            model,
            batch["input_ids"],
            additive_mask(batch["attention_mask"], dtype),
            batch["position_ids"],
            batch["sources"],
            batch["targets"],
            temperature=temperature,
        )


def stream_sums(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-stream sums (S,) of per-target values (N,), e.g. each completion's summed log-prob;
    a stream with no targets sums to 0."""
    out = values.new_zeros(batch["ends"].shape[0])
    return out.index_add(0, batch["owners"], values)


def batch_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Completion log-probs aligned with `batch["loss_mask"]`: (1, N) for a packed batch whose
    loss_mask is its N targets, (B, S - 1) for flat rows (`policy_logprobs`, any model kind)."""
    if is_packed(batch):
        return packed_token_logprobs(model, batch)[None]
    return policy_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])


def unpacked_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-pad tokens of the unpacked rows a packed batch stands for: each branch with its
    prefix (a shared prompt counts once per completion reading it), so a tokens/s figure does
    not depend on packing."""
    prefix = batch["prefix_lengths"].repeat_interleave(batch["branches_per_group"])
    return int(prefix.sum() + batch["branch_lengths"].sum())


# --- the shared prefix through the KV cache


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
    with grouped_query_attention(decoder):
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
