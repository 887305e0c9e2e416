"""rlhf_core.generation: the decode loop against transformers `generate`, and its sampler."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.generation import Sampling, decode, row_generators, sample_from_logits
from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

TINY = ModelConfig(name_or_path="tiny-qwen3")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    torch.manual_seed(0)
    return load_policy(TINY).eval(), load_tokenizer(TINY, padding_side="left")


def test_greedy_decode_equals_transformers_generate_under_left_padding(model_and_tokenizer):
    model, tok = model_and_tokenizer
    prompts = ["<|user|>ab<|end|><|assistant|>", "<|user|>a much longer prompt<|end|><|assistant|>"]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert enc["attention_mask"][0, 0] == 0  # the short prompt really is left-padded
    ours = decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=20,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    theirs = model.generate(
        **enc, max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    n = min(ours.shape[1], theirs.shape[1])  # generate may stop at the same eos or run on pads
    assert torch.equal(ours[:, :n], theirs[:, :n])
    assert (theirs[:, n:] == tok.pad_token_id).all()


def test_decode_stops_after_eos_and_pads(model_and_tokenizer):
    model, tok = model_and_tokenizer
    PAD = 7  # any id that is not eos, to see where padding went  # noqa: N806
    enc = tok(["<|user|>x<|end|><|assistant|>"] * 6, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(4)
    out = decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=40,
                 sampling=Sampling(temperature=1.5), eos_token_id=tok.eos_token_id,
                 pad_token_id=PAD)  # fmt: skip
    new = out[:, enc["input_ids"].shape[1] :]
    for row in new.tolist():
        if tok.eos_token_id in row:
            after = row[row.index(tok.eos_token_id) + 1 :]
            assert all(t == PAD for t in after)
        else:
            assert len(row) == 40
    assert any(tok.eos_token_id in row for row in new.tolist())


def test_inverse_cdf_sampler_draws_the_categorical_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    logits = probs.log().expand(200_000, -1)
    g = torch.Generator().manual_seed(0)
    draws = sample_from_logits(logits, g)
    freq = torch.bincount(draws, minlength=6).double() / len(draws)
    assert freq[1] == 0 and freq[5] == 0  # zero-probability tokens never come out
    # 5 standard errors of a proportion at n = 200k
    se = (probs.double() * (1 - probs.double()) / len(draws)).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * se + 1e-12).all(), freq


def test_warp_logits_follows_transformers_warpers():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g) * 3
    ids = torch.zeros(4, 1, dtype=torch.long)
    for kwargs in ({"top_k": 7}, {"top_p": 0.8}, {"min_p": 0.1}, {"top_k": 20, "top_p": 0.9}):
        want = TemperatureLogitsWarper(0.7)(ids, logits.clone())
        if "top_k" in kwargs:
            want = TopKLogitsWarper(kwargs["top_k"])(ids, want)
        if "top_p" in kwargs:
            want = TopPLogitsWarper(kwargs["top_p"])(ids, want)
        if "min_p" in kwargs:
            want = MinPLogitsWarper(kwargs["min_p"])(ids, want)
        got = Sampling(temperature=0.7, **kwargs).warp(logits)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), kwargs
        keep = ~torch.isinf(want)
        torch.testing.assert_close(got[keep], want[keep])


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_nucleus_from_candidates_equals_transformers_top_p_on_a_large_vocabulary(top_p):
    """`keep_nucleus` settles peaked rows from their top-64 or top-1024 candidates and sorts
    the flat ones; every row keeps exactly the set transformers' TopPLogitsWarper keeps."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from rlhf_core.generation import NUCLEUS_CANDIDATES, keep_nucleus

    g = torch.Generator().manual_seed(2)
    vocab = 16 * NUCLEUS_CANDIDATES[-1]  # the smallest vocabulary that tries both counts
    scale = torch.tensor([12.0, 8.0, 6.0, 4.0, 2.0, 0.5, 0.0, 3.0])[:, None]  # peaked .. flat
    logits = torch.randn(8, vocab, generator=g) * scale
    logits[7, 100:] = float("-inf")  # a row already cut by top-k
    want = TopPLogitsWarper(top_p)(torch.zeros(8, 1, dtype=torch.long), logits.clone())
    got = keep_nucleus(logits.clone(), top_p)
    kept = (~torch.isinf(got)).sum(-1)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), kept
    torch.testing.assert_close(got[~torch.isinf(got)], logits[~torch.isinf(want)])
    # every path ran: rows settled by each candidate count and rows sorted whole
    small, large = NUCLEUS_CANDIDATES
    assert (kept <= small).any() and ((kept > small) & (kept <= large)).any(), kept
    assert (kept > large).any(), kept


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seeded", [True, False])
def test_group_sampling_encodes_each_prompt_once_and_draws_what_repeated_prompts_draw(
    model_and_tokenizer, temperature, seeded
):
    """decode(prompts, group_size=G) == decode(each prompt repeated G times): same tokens, same
    RNG consumption (per-row generators or the global RNG), with the prefill run on the N
    distinct prompts only."""
    from rlhf_core.generation import row_generators

    model, tok = model_and_tokenizer
    prompts = ["<|user|>ab<|end|><|assistant|>", "<|user|>a much longer prompt<|end|><|assistant|>",
               "<|user|>x<|end|><|assistant|>"]  # fmt: skip
    group = 4
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    args = {"max_new_tokens": 16, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "sampling": Sampling(temperature=temperature)}  # fmt: skip
    prefill_rows = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: prefill_rows.append(kw["input_ids"].shape) if kw["input_ids"].shape[1]
        > 1 else None, with_kwargs=True)  # fmt: skip
    try:
        seeds = [11 * i + 3 for i in range(len(prompts) * group)]
        gen = row_generators(seeds, "cpu") if seeded else None
        torch.manual_seed(5)
        shared = decode(model, enc["input_ids"], enc["attention_mask"], group_size=group,
                        generator=gen, **args)  # fmt: skip
        after_shared = torch.rand(1)
        gen = row_generators(seeds, "cpu") if seeded else None
        torch.manual_seed(5)
        repeated = decode(model, enc["input_ids"].repeat_interleave(group, 0),
                          enc["attention_mask"].repeat_interleave(group, 0), generator=gen,
                          **args)  # fmt: skip
        after_repeated = torch.rand(1)
    finally:
        hook.remove()
    assert prefill_rows == [(3, enc["input_ids"].shape[1]), (12, enc["input_ids"].shape[1])]
    assert torch.equal(shared, repeated)
    assert torch.equal(after_shared, after_repeated)  # the global RNG advanced alike
    new = shared[:, enc["input_ids"].shape[1] :]
    if temperature > 0:  # the samples of a group really differ
        assert len({tuple(r) for r in new[:group].tolist()}) > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampler_workspace_gives_the_same_draws_and_reuses_its_buffers(dtype):
    """With a workspace (as `decode` keeps one per loop) every warper draws exactly the tokens
    the fresh-tensor path draws, step after step, the caller's logits are never written, and
    the buffers are allocated once: the same storage on every later step of that shape."""
    g = torch.Generator().manual_seed(2)
    settings = ({"temperature": 1.0}, {"temperature": 0.7, "top_k": 9},
                {"temperature": 1.1, "top_p": 0.8}, {"temperature": 0.9, "min_p": 0.05,
                                                      "top_k": 30, "top_p": 0.95})  # fmt: skip
    for kwargs in settings:
        sampling, workspace, pointers = Sampling(**kwargs), {}, None
        for step in range(4):
            logits = (torch.randn(6, 300, generator=g) * 3).to(dtype)
            before = logits.clone()
            seeds = [10 * step + r for r in range(6)]
            fresh = sampling.next_token(logits, row_generators(seeds, "cpu"))
            reused = sampling.next_token(logits, row_generators(seeds, "cpu"), workspace)
            assert torch.equal(fresh, reused), (kwargs, step)
            assert torch.equal(logits, before)
            now = {name: t.data_ptr() for name, t in workspace.items()}
            assert set(now) == {"warped", "probs", "cdf"}
            assert pointers is None or now == pointers, (kwargs, step)
            pointers = now


def test_reserved_cache_layer_holds_what_concatenation_holds():
    """`_ReservedLayer` against transformers' `DynamicLayer` fed the same keys and values: equal
    tensors after every update, written in place while the reserve lasts, and still equal after
    it runs out, after a `crop` and a `reorder_cache` (which replace or shorten `keys`), and
    after a `reset`."""
    from transformers.cache_utils import DynamicLayer

    from rlhf_core.generation import _ReservedLayer

    g = torch.Generator().manual_seed(0)
    kv = lambda n: (torch.randn(3, 2, n, 4, generator=g), torch.randn(3, 2, n, 4, generator=g))  # noqa: E731
    plain = DynamicLayer()
    plain.update(*kv(5))
    reserved = _ReservedLayer(plain, room=3)  # 5 positions + room for 3
    plain = DynamicLayer()
    plain.update(reserved.keys.clone(), reserved.values.clone())
    storage = reserved.keys.data_ptr()
    for step, n in enumerate([1, 1, 1, 1, 2, 1]):  # 5 + 3 fills the reserve, then it grows
        if step == 4:
            plain.crop(-1), reserved.crop(-1)
        if step == 5:
            order = torch.tensor([2, 0, 1])
            plain.reorder_cache(order), reserved.reorder_cache(order)
        k, v = kv(n)
        a, b = plain.update(k, v), reserved.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), step
        assert reserved.get_seq_length() == plain.get_seq_length()
        assert reserved.get_mask_sizes(1) == plain.get_mask_sizes(1)
        if step < 3:
            assert reserved.keys.data_ptr() == storage  # written into the reserve
    assert reserved.keys.data_ptr() != storage  # re-reserved when it ran out
    plain.reset(), reserved.reset()  # emptied (transformers' reset), then filled again
    for n in (3, 1):
        k, v = kv(n)
        a, b = plain.update(k, v), reserved.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(("temperature", "room"), [(0.0, 256), (1.0, 256), (1.0, 4)])
def test_decode_writes_its_kv_cache_in_place_and_draws_what_concatenation_draws(
    model_and_tokenizer, temperature, room, monkeypatch
):
    """decode's KV cache is reserved the plan's `reserve_positions` ahead after the prefill:
    every step's keys live in one storage per layer until that room is used up, the reserve
    never holds more than that room unused, and the tokens equal those of the same decode with
    transformers' concatenating cache (the reservation switched off)."""
    import rlhf_core.fastpath as fastpath
    import rlhf_core.generation as generation

    monkeypatch.setattr(fastpath, "RESERVE_POSITIONS", room)
    model, tok = model_and_tokenizer
    prompts = ["<|user|>ab<|end|><|assistant|>", "<|user|>a much longer prompt<|end|><|assistant|>"]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    args = {"max_new_tokens": 12, "eos_token_id": -1, "pad_token_id": tok.pad_token_id,
            "sampling": Sampling(temperature=temperature), "group_size": 3}  # fmt: skip
    seen = []  # (storage, filled positions, reserved positions) of layer 0 before each step

    def look(_module, _args, kwargs):
        layer = kwargs["past_key_values"].layers[0] if kwargs.get("past_key_values") else None
        if layer is not None:
            seen.append((layer.keys.data_ptr(), layer.keys.shape[-2], layer._keys.shape[-2]))

    hook = model.register_forward_pre_hook(look, with_kwargs=True)
    try:
        reserved = decode(model, enc["input_ids"], enc["attention_mask"],
                          generator=row_generators(range(6), "cpu"), **args)  # fmt: skip
    finally:
        hook.remove()
    assert len(seen) == 11
    assert all(filled <= total <= filled + room + 1 for _, filled, total in seen)
    # a re-reservation copies into a new storage while the old one is alive, so it moves the
    # pointer; counted step to step (a later storage may reuse a freed one's address)
    moves = sum(a[0] != b[0] for a, b in zip(seen, seen[1:], strict=False))
    assert moves == (0 if room >= 12 else -(-11 // room) - 1), seen
    monkeypatch.setattr(generation, "_reserve_cache", lambda cache, room: None)
    concatenated = decode(model, enc["input_ids"], enc["attention_mask"],
                          generator=row_generators(range(6), "cpu"), **args)  # fmt: skip
    assert torch.equal(reserved, concatenated)


def test_bf16_decoding_steps_take_a_groups_query_heads_as_rows(monkeypatch):
    """On the CPU in bf16 a grouped-query model's decoding steps (not its prefill) go through
    `rlhf_core.attention.grouped_decode_attention`, left padding's mask included, and draw the
    tokens transformers' own attention path draws (greedy and sampled)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import rlhf_core.attention as attention

    config = Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    calls = []
    original = attention.grouped_decode_attention

    def counted(query, key, value, attention_mask, scale):
        calls.append((query.shape[2], attention_mask is not None))
        return original(query, key, value, attention_mask, scale)

    monkeypatch.setattr(attention, "grouped_decode_attention", counted)
    for temperature in (0.0, 1.0):
        args = {"max_new_tokens": 8, "eos_token_id": -1, "pad_token_id": 0,
                "sampling": Sampling(temperature=temperature), "group_size": 2}  # fmt: skip
        calls.clear()
        ours = decode(model, ids, mask, generator=row_generators(range(4), "cpu"), **args)
        assert calls == [(1, True)] * (7 * 2)  # 7 steps after the prefill's token, 2 layers
        with monkeypatch.context() as m:
            m.setattr(attention, "folds_query_groups", lambda *a: False)
            theirs = decode(model, ids, mask, generator=row_generators(range(4), "cpu"), **args)
        assert torch.equal(ours, theirs)
