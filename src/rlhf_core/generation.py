"""Batched generation with a KV cache and left padding: `decode`, and `generate_completions`.

`decode` is the sampling loop every package uses (rollouts, evaluation): one prefill forward of
the left-padded prompts, then one token per step through the transformers KV cache, each token
chosen as a `Sampling` says: the logits warped as transformers `generate` warps them
(temperature -> top-k -> top-p -> min-p), greedy decoding at temperature 0. Its greedy tokens
equal `model.generate`'s (tested). It differs from `generate` in one place, the draw: `generate`
samples with `torch.multinomial`, which draws one exponential variate per vocabulary entry per
row (on CPU that was 3/4 of a GRPO rollout's time with a 50k vocabulary); `decode` inverts the
CDF with one uniform per row, index = min{i : cdf_i > u * cdf_V}, an exact draw from the same
categorical distribution. The draw's per-step tensors (the float32 logits, the probabilities,
the float64 CDF: 16 bytes per row and vocabulary entry, 52 MB for 64 rows of a 50k vocabulary)
are written into buffers `decode` keeps for its loop (`workspace`), not allocated afresh each
step: on CPU glibc returns tensors that size to the kernel and faults them back in every step
(415,000 minor page faults and 0.86 CPU-seconds of system time per GRPO rollout of the
benchmarks' real model; 19,000 and 0.19 with the buffers). The same operations, the same tokens
(tested).

Two CPU fast paths, as the model's speed plan says (`rlhf_core.fastpath`; both off on CUDA):

- The KV cache is reserved: after the prefill every plain transformers `DynamicLayer` of the
  cache becomes a `_ReservedLayer` with room for `min(max_new_tokens,
  SpeedPlan.reserve_positions)` more positions, and each step writes its token's keys and
  values in place, the buffers grown by that much when full; `DynamicLayer` appends with
  `torch.cat`, which copies the whole cache every token. The same tensors, the same tokens
  (tested); never more than that room unused per layer (a long `max_new_tokens` whose
  completions stop early does not reserve its full length); a small gain on CPU
  (docs/performance.md).
- A decoding step's attention under grouped-query attention in bf16 runs inside
  `rlhf_core.attention.fast_attention`: the G query heads that share a key/value head are G
  query rows of one SDPA call on that head (`grouped_decode_attention`), where transformers
  calls SDPA with `enable_gqa=True` for a step without a mask, which torch's CPU kernel runs
  3-4x slower in bf16. The same tokens up to ~72 positions (tested through `decode`). The
  prefill keeps transformers' path.

An encoder-decoder policy (T5) takes the same call and returns the same layout, [prompt |
completion]: the encoder runs once on the left-padded prompts, the decoder starts from its start
token and steps one token at a time through its KV cache, with the same warpers and sampler
(`_decode_encoder_decoder`; greedy tokens equal `generate`'s, tested).

Group sampling (`group_size` G > 1, GRPO's G completions of each prompt): `decode` takes the N
distinct prompts, runs the prefill (or T5's encoder) on those N rows once, then repeats each
row's KV cache (encoder output) and next-token logits G times and decodes N x G rows. The G rows
of a group never re-encode their prompt; the draws (one uniform per row per token, in row order)
are the ones the N x G repeated prompts would make, and so are the tokens (tested against
`decode` of the repeated prompts, greedy and sampled).

The behaviour log-probs (`with_logprobs`): for every sampled token, its log-prob under the
distribution it was drawn from (after temperature and truncation, in float32 from the logits in
the model's dtype), the log of the probability the draw itself used; what an off-policy
correction compares the trainer's recomputed log-probs with.

`generate_completions` takes rendered prompt texts and returns, per prompt, the completion token
ids (up to and including the first eos), the decoded text (special tokens removed) and whether it
was truncated at `max_new_tokens` without an eos. Both decode greedily unless given a `Sampling`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from rlhf_core.attention import fast_attention
from rlhf_core.fastpath import speed_plan
from rlhf_core.policy_model import base_model, decoder_start_id, is_encoder_decoder

Generators = torch.Generator | Sequence[torch.Generator] | None


def row_generators(seeds: Sequence[int], device: torch.device | str) -> list[torch.Generator]:
    """One generator per row, each seeded with its own seed: rows drawn with these do not
    depend on which other rows share the batch (or the process)."""
    return [torch.Generator(device=device).manual_seed(int(s) % (1 << 63)) for s in seeds]


Workspace = dict[str, torch.Tensor]


def _scratch(workspace: Workspace | None, name: str, like: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """An uninitialised tensor of `like`'s shape, in `dtype`: `workspace[name]`, reused while
    its shape, dtype and device hold (a fresh one when `workspace` is None)."""
    buffer = None if workspace is None else workspace.get(name)
    if (buffer is None or buffer.shape != like.shape or buffer.dtype != dtype
            or buffer.device != like.device):  # fmt: skip
        buffer = torch.empty(like.shape, dtype=dtype, device=like.device)
        if workspace is not None:
            workspace[name] = buffer
    return buffer


def sample_from_logits(
    logits: torch.Tensor, generator: Generators = None, *, workspace: Workspace | None = None,
    with_logprob: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token per row of `logits` (B, V), drawn from softmax(logits) by inverting the CDF
    with a single uniform per row (see the module docstring). `generator` is one generator for
    the batch, or a sequence of one per row (`row_generators`). `workspace`: a dict the caller
    keeps across the steps of one decoding loop; the probabilities and the float64 CDF are
    written into its buffers instead of fresh tensors (see the module docstring).
    `with_logprob`: also each drawn token's log-prob (B,) under that softmax, the log of the
    probability the draw used (a gather of B entries; no further pass over the vocabulary)."""
    probs = torch.softmax(logits, -1, out=_scratch(workspace, "probs", logits, logits.dtype))
    cdf = _scratch(workspace, "cdf", logits, torch.float64)
    torch.cumsum(probs, -1, dtype=torch.float64, out=cdf)  # = probs.to(float64).cumsum(-1)
    if isinstance(generator, Sequence):
        if len(generator) != cdf.shape[0]:
            raise ValueError(
                f"sample_from_logits: {len(generator)} generators for {cdf.shape[0]} rows"
            )
        u = torch.stack([
            torch.rand((), dtype=torch.float64, device=cdf.device, generator=g) for g in generator
        ])[:, None]  # fmt: skip
    else:
        u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device, generator=generator)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    index = index.clamp_(max=cdf.shape[-1] - 1)
    if with_logprob:
        return index.squeeze(-1), probs.gather(-1, index).log_().squeeze(-1)
    return index.squeeze(-1)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen, the one owner of the sampling settings: argmax at
    `temperature` 0 (greedy), else a draw (`sample_from_logits`) from the logits warped as
    transformers `generate` warps them, in its order: / temperature, keep the `top_k` (0 = off),
    keep the smallest set whose probability reaches `top_p` (1 = off; at least one token), drop
    tokens below `min_p` x the top one's probability (0 = off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        """Whether `warp` may remove tokens: top-k, top-p or min-p is set."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def warp(self, logits: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
        """Next-token logits (B, V) -> the sampling distribution's logits in float32, -inf on
        removed tokens; `logits` is left as it is. `workspace`: see `sample_from_logits` (the
        result is then one of its buffers)."""
        warped = _scratch(workspace, "warped", logits, torch.float32)
        warped.copy_(logits)  # = logits.float(), written in place from here on
        if self.temperature != 1.0:
            warped.div_(self.temperature)
        if 0 < self.top_k < warped.shape[-1]:
            kth = torch.topk(warped, self.top_k, dim=-1).values[:, -1:]
            warped.masked_fill_(warped < kth, float("-inf"))
        if self.top_p < 1.0:
            keep_nucleus(warped, self.top_p)
        if self.min_p > 0.0:
            probs = warped.softmax(-1)
            floor = self.min_p * probs.max(-1, keepdim=True).values
            warped.masked_fill_(probs < floor, float("-inf"))
        return warped

    def next_token(
        self, logits: torch.Tensor, generator: Generators = None,
        workspace: Workspace | None = None, *, with_logprob: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The next token of each row from its logits (B, V); `workspace`: see
        `sample_from_logits`. `with_logprob`: also each token's log-prob (B,) in float32 under
        the distribution it was drawn from, the warped one (0 when greedy: a point mass)."""
        if self.temperature <= 0:
            token = logits.argmax(-1)
            return (token, torch.zeros(token.shape, device=token.device)) if with_logprob else token
        return sample_from_logits(
            self.warp(logits, workspace), generator, workspace=workspace, with_logprob=with_logprob
        )


GREEDY = Sampling()

# Candidate counts `keep_nucleus` tries, from the most likely token down, before it sorts the
# whole vocabulary; one is tried only if the vocabulary is at least 16x larger (below that the
# extra passes cost more than the sort they save: vocab 103, 0.7 against 0.4 ms). A peaked
# row's top-p 0.9 set is a handful of tokens: 64 rows of 50,257 (151,936) tokens took 0.7 s
# (4.1 s) against 9.3 s (30 s) to sort; flat rows pay ~5% more (`benchmarks.sampling`).
NUCLEUS_CANDIDATES = (64, 1024)


def keep_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """In place on float logits (B, V): -inf outside each row's nucleus, the most likely tokens
    whose probability reaches `top_p` (Holtzman et al. 2020), as transformers'
    `TopPLogitsWarper` defines it: drop the low tail whose cumulative mass is at most 1 - top_p,
    always keep the most likely token. Rows whose nucleus lies within their top
    `NUCLEUS_CANDIDATES` tokens (each tried where the vocabulary is 16x larger) are settled from
    those alone (their masses in float64 against the
    full log-normaliser); the rest sort the whole row. Returns `logits`."""
    vocab, tail = logits.shape[-1], 1.0 - top_p
    todo = torch.arange(logits.shape[0], device=logits.device)
    log_z = torch.logsumexp(logits, dim=-1).double()
    for k in NUCLEUS_CANDIDATES:
        if 16 * k > vocab or todo.numel() == 0:
            break
        values, order = torch.topk(logits[todo], k, dim=-1)  # most likely first
        probs = (values.double() - log_z[todo, None]).exp()
        at_or_below = 1.0 - (probs.cumsum(-1) - probs)  # mass of this token and all less likely
        settled = at_or_below[:, -1] <= tail  # the k-th candidate is dropped: so is all below it
        if settled.any():
            keep = at_or_below[settled] > tail
            keep[:, 0] = True
            values = values[settled].masked_fill(~keep, float("-inf"))
            rows = torch.full((int(settled.sum()), vocab), float("-inf"), dtype=logits.dtype,
                              device=logits.device)  # fmt: skip
            logits[todo[settled]] = rows.scatter_(-1, order[settled], values)
        todo = todo[~settled]
    if todo.numel():
        logits[todo] = _nucleus_by_sort(logits[todo], tail)
    return logits


def _nucleus_by_sort(logits: torch.Tensor, tail: float) -> torch.Tensor:
    """`keep_nucleus` by sorting whole rows (transformers' way), in place; returns `logits`."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    remove = sorted_logits.softmax(-1).cumsum(-1) <= tail  # the low tail of mass <= 1 - top_p
    remove[:, -1] = False  # always keep the most likely token
    return logits.masked_fill_(remove.scatter(-1, order, remove), float("-inf"))


@torch.no_grad()
def _decode_encoder_decoder(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    sampling: Sampling,
    generator: Generators,
    group_size: int,
    with_logprobs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`decode` for an encoder-decoder model: the encoder once per distinct prompt (its output
    repeated `group_size` times), then the decoder token by token through its KV cache from the
    decoder start token; returns [input_ids | completion], input_ids repeated per group (and
    the sampled tokens' log-probs with `with_logprobs`, as `decode`)."""
    base = base_model(model)  # peft's adapters live in the base model's layers
    mask = attention_mask.long()
    encoded = base.get_encoder()(input_ids=input_ids, attention_mask=mask)
    if group_size > 1:
        encoded.last_hidden_state = encoded.last_hidden_state.repeat_interleave(group_size, 0)
        input_ids = input_ids.repeat_interleave(group_size, 0)
        mask = mask.repeat_interleave(group_size, 0)
    batch = input_ids.shape[0]
    token = torch.full((batch,), decoder_start_id(base), dtype=input_ids.dtype,
                       device=input_ids.device)  # fmt: skip
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    pad = torch.full_like(token, pad_token_id)
    cache, new_tokens, logprobs, workspace = None, [], [], {}
    room = min(max_new_tokens, speed_plan(model).reserve_positions)
    for step in range(max_new_tokens):
        out = base(
            encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=token[:, None],
            past_key_values=cache, use_cache=True,
        )  # fmt: skip
        if cache is None and room:  # the decoder's own keys and values (not cross-attention's)
            _reserve_cache(getattr(out.past_key_values, "self_attention_cache", None), room)
        cache = out.past_key_values
        token = sampling.next_token(out.logits[:, -1], generator, workspace,
                                    with_logprob=with_logprobs)  # fmt: skip
        if with_logprobs:
            token, logprob = token
            logprobs.append(logprob.masked_fill(done, 0.0))
        token = torch.where(done, pad, token.to(input_ids.dtype))
        new_tokens.append(token)
        done = done | (token == eos_token_id)
        if step == max_new_tokens - 1 or bool(done.all()):
            break
    sequences = torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)
    return (sequences, torch.stack(logprobs, dim=1)) if with_logprobs else sequences


class _ReservedLayer(DynamicLayer):
    """A transformers `DynamicLayer` whose keys and values live in buffers reserved `room`
    positions ahead: each step writes its token's keys and values in place and the layer's
    `keys` / `values` are views of the filled part. `DynamicLayer` appends with `torch.cat`,
    which copies the whole cache into a fresh tensor every token (44 copies of up to 2 MB per
    step in a GRPO rollout of the benchmarks' `real` model); here the cache is copied once per
    `room` tokens, and it never holds more than `room` unused positions per layer (`torch.cat`
    briefly holds two copies of a layer). The views hold exactly the tensors the concatenation
    would (tested). When something outside replaced or reshaped `keys` (`reorder_cache`,
    `batch_repeat_interleave`, `reset`), the next `update` reserves afresh from what `keys`
    holds then."""

    def __init__(self, layer: DynamicLayer, room: int) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = layer.dtype, layer.device, True
        self._room = max(1, int(room))
        self._reserve(layer.keys, layer.values, layer.keys.shape[-2] + self._room)

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        length = keys.shape[-2]
        self._keys = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
        self._values = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
        self._keys[..., :length, :] = keys
        self._values[..., :length, :] = values
        self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:  # reset()
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            self._reserve(key_states, value_states, key_states.shape[-2] + self._room)
            return self.keys, self.values
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if (end > self._keys.shape[-2] or self.keys.data_ptr() != self._keys.data_ptr()
                or self.keys.shape[:-2] != self._keys.shape[:-2]):  # fmt: skip
            self._reserve(self.keys, self.values, end + self._room)
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values


def _reserve_cache(cache: object, room: int) -> None:
    """Turn every plain `DynamicLayer` of `cache` (a transformers `Cache` after the prefill)
    into a `_ReservedLayer` reserving `room` positions ahead; other layer kinds (sliding
    window, linear attention, quantised) and other cache classes are left as they are."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel() > 0:
            layers[i] = _ReservedLayer(layer, room)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    sampling: Sampling = GREEDY,
    generator: Generators = None,
    group_size: int = 1,
    with_logprobs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Complete left-padded prompts `input_ids` (B, P): returns (B x G, P + T) with T <=
    `max_new_tokens`, G = `group_size` completions of each prompt in consecutive rows (the
    prompt encoded once, see the module docstring); after a row's eos it holds `pad_token_id`.
    Stops early once every row has produced an eos. The model is used as is (call
    `model.eval()` first). `generator`: see `sample_from_logits` (None: the global torch RNG),
    one per output row when a sequence.

    `with_logprobs`: returns (sequences, behaviour log-probs (B x G, T) float32): each sampled
    token's log-prob under the distribution it was drawn from, after temperature and the
    top-k / top-p / min-p truncation, from the logits in the dtype the model ran in (0 after a
    row's eos, and everywhere when greedy). It costs a gather of the probabilities the draw
    already computed, B entries per token, and changes no token (tested)."""
    if max_new_tokens < 1:
        raise ValueError(f"decode: max_new_tokens must be >= 1, got {max_new_tokens}")
    if group_size < 1:
        raise ValueError(f"decode: group_size must be >= 1, got {group_size}")
    if is_encoder_decoder(model):
        return _decode_encoder_decoder(
            model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id, sampling=sampling,
            generator=generator, group_size=group_size, with_logprobs=with_logprobs,
        )  # fmt: skip
    mask = attention_mask.long()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
    out = model(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
        **keep,
    )  # fmt: skip
    logits, cache = out.logits[:, -1], out.past_key_values
    next_position = position_ids[:, -1:] + 1
    if group_size > 1:  # the prompt's keys and values, computed once, shared by its group
        cache.batch_repeat_interleave(group_size)
        logits = logits.repeat_interleave(group_size, 0)
        input_ids, mask, next_position = (
            x.repeat_interleave(group_size, 0) for x in (input_ids, mask, next_position)
        )
    room = min(max_new_tokens, speed_plan(model).reserve_positions)
    if room:  # no torch.cat per token
        _reserve_cache(cache, room)
    batch = input_ids.shape[0]
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    pad = torch.full_like(done, pad_token_id, dtype=input_ids.dtype)
    ones = torch.ones(batch, 1, dtype=mask.dtype, device=mask.device)
    new_tokens, logprobs, workspace = [], [], {}
    with fast_attention(model):  # a step's grouped heads as query rows (bf16, CPU)
        for step in range(max_new_tokens):
            token = sampling.next_token(logits, generator, workspace, with_logprob=with_logprobs)
            if with_logprobs:
                token, logprob = token
                logprobs.append(logprob.masked_fill(done, 0.0))
            token = torch.where(done, pad, token.to(input_ids.dtype))
            new_tokens.append(token)
            done = done | (token == eos_token_id)
            if step == max_new_tokens - 1 or bool(done.all()):  # one host sync per token
                break
            mask = torch.cat([mask, ones], dim=1)
            out = model(
                input_ids=token[:, None], attention_mask=mask, position_ids=next_position,
                past_key_values=cache, use_cache=True, **keep,
            )  # fmt: skip
            logits, cache = out.logits[:, -1], out.past_key_values
            next_position = next_position + 1
    sequences = torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)
    return (sequences, torch.stack(logprobs, dim=1)) if with_logprobs else sequences


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    truncated: bool


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    batch_size: int = 64,
) -> list[Completion]:
    """Complete each prompt text; see the module docstring."""
    if tokenizer.padding_side != "left":
        raise ValueError(
            "generate_completions needs a left-padding tokenizer (padding_side='left')"
        )
    device = next(model.parameters()).device
    eos_id = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    out: list[Completion] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(
                prompts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(device)
            generated = decode(
                model, batch["input_ids"], batch["attention_mask"],
                max_new_tokens=max_new_tokens, eos_token_id=eos_id,
                pad_token_id=tokenizer.pad_token_id, sampling=sampling,
            )  # fmt: skip
            new_tokens = generated[:, batch["input_ids"].shape[1] :].tolist()
            for row in new_tokens:
                if eos_id in row:
                    ids, truncated = row[: row.index(eos_id) + 1], False
                else:
                    ids, truncated = row, True
                text = tokenizer.decode(ids, skip_special_tokens=True)
                out.append(Completion(token_ids=ids, text=text, truncated=truncated))
    finally:
        model.train(was_training)
    return out
