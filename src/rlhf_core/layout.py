"""Packed rows: the layout of a step's sequences (rows, segments, position ids, targets).

One layout serves SFT, DPO and reward-model batches. A *group* is a prefix (the prompt) and one
or more *branches* (completions) that continue it:

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

    pack_groups(groups, pad_id)   -> input_ids (R, L), a 4D boolean mask (R, 1, L, L),
                                     position_ids (R, L), and the targets: where each completion
                                     token is predicted from; `segments`, each group's span
    stream_sums(values, batch)    -> (S,) one sum per branch ("stream"), group-major
    unpacked_tokens(batch)        -> the tokens the unpacked rows would hold

The log-probs of a packed batch (`rlhf_core.logprobs.sequence_logprobs`) equal the unpacked
forward's up to float rounding (tested in float64 to 1e-6).

The 4D mask is for SDPA and eager attention. Flash attention takes no 4D mask; there
transformers packs by position ids alone (its varlen path: one row, no attention mask, positions
restarting at 0 for every sequence, the layout of TRL's `padding_free` and transformers'
`DataCollatorWithFlattening`), which expresses a block-diagonal mask but not a prefix shared by
two branches. `pack_groups(..., flat=True)` builds that layout: every stream (a group's prefix
and one of its branches) becomes a sequence of its own, so the prompt is encoded once per
completion again, but no position is padding. It is tested on the CPU through SDPA, where
transformers reads the same position ids into a block-diagonal mask, and against the sequence
boundaries transformers' flash path computes from them; the flash kernel itself needs a GPU.

SDPA computes the whole masked (L, L) score matrix of a row, so by default rows are no longer
than the batch's longest group, which leaves padding. `row_tokens` lets rows grow to hold
several groups with no padding (segmented rows); `rlhf_core.attention.fast_attention` then
computes attention one segment (a group) at a time. Which layout a model takes is the speed
plan's (`rlhf_core.fastpath`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf_core.fastpath import text_config

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
    lets a row hold that many tokens when the longest group is shorter (segmented rows for
    `rlhf_core.attention.fast_attention`: fewer rows, no padding); `flat=True` gives the
    flash-attention varlen layout instead (`_pack_flat`: one row, no attention mask, no prefix
    shared).

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
      nothing attends to padding: `rlhf_core.attention.fast_attention`).
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


def sliding_window(config: Any) -> int | None:
    """The attention window of a model's sliding-window layers (Mistral; Gemma 2/3 and Qwen2/3
    with `layer_types`: some or all layers "sliding_attention"), None where no layer has one."""
    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None
    return int(window)


def packed_attention_mask(
    config: Any, allowed: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """What a packed batch passes as `attention_mask` to a model of `config`: the additive 4D
    mask (`additive_mask`). transformers uses a 4D mask as given in every layer, so a model with
    sliding-window layers would attend past its window there; for it the window is applied
    here, on the position ids (a shared prefix's distance is its positions', not its columns'):
    one windowed mask where every layer slides, or transformers' per-layer-type mapping
    {"full_attention": ..., "sliding_attention": ...} where only some do. Rows no longer than
    the window need none of this."""
    window = sliding_window(config)
    if window is None or allowed.shape[-1] <= window:
        return additive_mask(allowed, dtype)
    distance = position_ids[:, None, :, None] - position_ids[:, None, None, :]
    near = allowed.bool() & (distance < window)
    types = getattr(text_config(config), "layer_types", None)
    if types is None or set(types) == {"sliding_attention"}:
        return additive_mask(near, dtype)
    full, sliding = additive_mask(allowed, dtype), additive_mask(near, dtype)
    return {"full_attention": full, "sliding_attention": sliding}


def stream_sums(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-stream sums (S,) of per-target values (N,), e.g. each completion's summed log-prob;
    a stream with no targets sums to 0."""
    out = values.new_zeros(batch["ends"].shape[0])
    return out.index_add(0, batch["owners"], values)


def unpacked_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-pad tokens of the unpacked rows a packed batch stands for: each branch with its
    prefix (a shared prompt counts once per completion reading it), so a tokens/s figure does
    not depend on packing."""
    prefix = batch["prefix_lengths"].repeat_interleave(batch["branches_per_group"])
    return int(prefix.sum() + batch["branch_lengths"].sum())
