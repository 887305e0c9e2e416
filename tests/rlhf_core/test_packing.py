"""Packed rows (`rlhf_core.layout`): a shared prompt encoded once and several sequences per row
give the log-probs and gradients of the plain padded forward, on the tiny world's Qwen3 in
float64 (log-probs to 1e-6, gradients to 1e-5 relative).

Relative is per parameter tensor, ||g_packed - g_rows|| / ||g_rows||: Qwen3's RMSNorm computes
in float32 even in a float64 model, so the backward rounds gradients to float32 at every norm,
and a prompt's gradient (the sum of its two completions' in one row, two rows' sums otherwise)
can only agree to float32 rounding (~1e-7 relative here), element by element less near zero."""

from __future__ import annotations

import pytest
import torch

import rlhf_core.attention as attention_module
import rlhf_core.fastpath as fastpath
from direct_alignment.reference import pair_logps
from rlhf_core.attention import fast_attention
from rlhf_core.fastpath import speed_plan
from rlhf_core.layout import is_packed, pack_groups, pack_rows, stream_sums, unpacked_tokens
from rlhf_core.logprobs import causal_lm_token_logprobs
from rlhf_core.models import ModelConfig, load_policy
from rlhf_core.preference import PreferencePair, collate_pairs, pack_pairs


def random_pairs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(6, 100, (n,), generator=g).tolist()

    return [PreferencePair(ids(p), ids(c), ids(r), "") for p, c, r in lengths]


def tiny_policy(attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(name_or_path="tiny-qwen3", attention=attention, dtype="fp32")
    return load_policy(cfg, "cpu").double().train()


def assert_same_as(reference, chosen, rejected, grads) -> None:
    """Log-probs to 1e-6 and every gradient to 1e-5 relative of the flat rows' `reference`."""
    torch.testing.assert_close(chosen, reference[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rejected, reference[1], rtol=0, atol=1e-6)
    assert grads.keys() == reference[2].keys() and grads
    for name, grad in grads.items():
        relative = (grad - reference[2][name]).norm() / reference[2][name].norm()
        assert relative <= 1e-5, (name, float(relative))


def logps_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    chosen, rejected = pair_logps(model, batch)
    # every pair and side weighted differently, so a mix-up of rows or streams would show
    weights = torch.arange(1.0, 1.0 + 2 * chosen.shape[0], dtype=chosen.dtype)
    (weights * torch.cat([chosen, rejected])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return chosen.detach(), rejected.detach(), grads


# ragged prompts and completions; packed, the pairs (15, 14, 14, 22, 5, 4 tokens) share rows
PAIRS = [(5, 3, 7), (9, 1, 4), (2, 6, 6), (12, 8, 2), (1, 2, 2), (2, 1, 1)]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_dpo_log_probs_and_gradients_equal_the_two_row_forward(attention):
    model = tiny_policy(attention)
    assert speed_plan(model).layout == "mask"  # takes a 4D mask; too narrow for segmented rows
    pairs = random_pairs(PAIRS)
    full = collate_pairs(pairs, 0)
    reference = logps_and_grads(model, full)
    for pack in (False, True):
        packed = pack_pairs(pairs, 0, pack=pack)
        rows = 4 if pack else 6
        assert packed["input_ids"].shape == (rows, 22)
        assert packed["lengths"].tolist() == full["lengths"].tolist()
        chosen, rejected, grads = logps_and_grads(model, packed)
        assert_same_as(reference, chosen, rejected, grads)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_row_with_segmented_attention_equals_the_two_row_forward(attention, monkeypatch):
    # all six pairs (74 tokens) in one row with no padding; under SDPA on CPU attention runs
    # one pair at a time (no query longer than the longest pair, 22), eager computes the full
    # masked row: both equal the flat rows
    model = tiny_policy(attention)
    assert speed_plan(model).cpu_attention == (attention == "sdpa")
    pairs = random_pairs(PAIRS)
    reference = logps_and_grads(model, collate_pairs(pairs, 0))
    packed = pack_pairs(pairs, 0, row_tokens=80)
    assert packed["input_ids"].shape == (1, 74)
    assert packed["segments"].tolist() == [[0, 0, 22], [0, 22, 37], [0, 37, 51], [0, 51, 65],
                                           [0, 65, 70], [0, 70, 74]]  # fmt: skip
    query_lengths = []

    def spy(fn):
        def call(query, *args, **kwargs):
            query_lengths.append(query.shape[-2])
            return fn(query, *args, **kwargs)

        return call

    # a segment's call goes to SDPA, or in bf16 with few keys to `short_attention`; a call per
    # segment even where one call over the row is cheaper (this narrow model: `segments_pay`)
    monkeypatch.setattr(fastpath, "SEGMENT_CALL_UNITS", 0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy(sdpa))
    monkeypatch.setattr(attention_module, "short_attention", spy(attention_module.short_attention))
    chosen, rejected, grads = logps_and_grads(model, packed)
    if attention == "sdpa":
        assert max(query_lengths) == 22 and len(query_lengths) == 6 * 2  # 6 pairs x 2 layers
        assert model.config._attn_implementation == "sdpa"  # restored after the forward
    else:
        assert not query_lengths
    assert_same_as(reference, chosen, rejected, grads)


def test_bf16_packed_segments_through_short_attention_are_as_close_as_flat_rows(monkeypatch):
    """In bf16 the packed row's segments (additive bf16 mask, a backward to come) run through
    `short_attention`; their log-probs are as close to the float64 flat rows as the bf16 flat
    rows (transformers' SDPA path) are, and every gradient is finite."""
    model = tiny_policy("sdpa")
    pairs = random_pairs(PAIRS)
    exact = logps_and_grads(model, collate_pairs(pairs, 0))
    model = model.to(torch.bfloat16)
    calls = []
    short_attention = attention_module.short_attention

    def spy(query, *args, **kwargs):
        calls.append(query.dtype)
        return short_attention(query, *args, **kwargs)

    monkeypatch.setattr(attention_module, "short_attention", spy)
    flat = logps_and_grads(model, collate_pairs(pairs, 0))
    assert not calls  # flat rows: transformers' own attention
    packed = logps_and_grads(model, pack_pairs(pairs, 0, row_tokens=80))
    assert calls and set(calls) == {torch.bfloat16}
    for side in (0, 1):
        flat_error = (flat[side].double() - exact[side]).abs().max()
        packed_error = (packed[side].double() - exact[side]).abs().max()
        assert packed_error <= 2 * flat_error + 1e-3, (side, packed_error, flat_error)
    assert all(torch.isfinite(g).all() for g in packed[2].values())


def sdpa_query_lengths(monkeypatch) -> list[int]:
    """The query length of every SDPA call from here on in the test, in call order."""
    lengths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        lengths.append(query.shape[-2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return lengths


def test_segments_pay_where_the_masked_scores_they_skip_outweigh_their_calls(monkeypatch):
    """`segments_pay`: the tiny world's SFT rows (at most 96 tokens, ~3 sequences each, 64 rows
    of a 128-wide model) run one SDPA call per layer; one long row of 64 sequences, or a
    real-proportions model's row of two DPO pairs (width 512), a call per segment. The forward
    follows the choice, and either way equals the flat rows."""
    tiny = tiny_policy("sdpa")
    config = tiny.config
    assert config.num_attention_heads * config.head_dim == 128
    short_rows = [(r, s, s + 32) for r in range(64) for s in (0, 32, 64)]
    assert not attention_module.segments_pay(tiny, short_rows)
    assert attention_module.segments_pay(tiny, [(0, s, s + 36) for s in range(0, 64 * 36, 36)])
    two_pairs = [(0, 0, 235), (0, 235, 470)]
    with monkeypatch.context() as m:  # 4 heads x 128: the benchmarks' `real` model's width
        m.setattr(config, "head_dim", 128)
        assert attention_module.segments_pay(tiny, two_pairs)
        assert not attention_module.segments_pay(tiny, [(0, 0, 40), (0, 40, 80)])

    pairs = random_pairs(PAIRS)
    reference = logps_and_grads(tiny, collate_pairs(pairs, 0))
    packed = pack_pairs(pairs, 0, row_tokens=80)  # 6 segments in one 74-token row: one call
    calls = sdpa_query_lengths(monkeypatch)
    assert_same_as(reference, *logps_and_grads(tiny, packed))
    assert calls == [74, 74]  # one call per layer, forward
    calls.clear()
    monkeypatch.setattr(fastpath, "SEGMENT_CALL_UNITS", 4000)  # now the 6 calls pay
    assert_same_as(reference, *logps_and_grads(tiny, packed))
    assert calls == [22, 15, 14, 14, 5, 4] * 2


def test_padding_after_a_rows_last_segment_is_not_computed_and_changes_nothing(monkeypatch):
    """Segment by segment, a row's padding after its last segment goes to no SDPA call (no query
    of a segment attends to it; its attention output is zeros): only the 74 real positions are
    attended, and log-probs and gradients equal the flat rows'."""
    monkeypatch.setattr(fastpath, "SEGMENT_CALL_UNITS", 0)  # a call per segment
    model = tiny_policy("sdpa")
    pairs = random_pairs(PAIRS)
    reference = logps_and_grads(model, collate_pairs(pairs, 0))
    packed = pack_pairs(pairs, 0)  # rows of 22: 22 | 15 + 5 | 14 + 4 | 14, tails of 2, 4, 8
    assert packed["input_ids"].shape == (4, 22)
    calls = sdpa_query_lengths(monkeypatch)
    assert_same_as(reference, *logps_and_grads(model, packed))
    assert sorted(calls) == sorted([22, 15, 5, 14, 4, 14] * 2)  # 2 layers


def test_fast_attention_restores_the_model_after_an_error():
    model = tiny_policy("sdpa")
    segments = pack_pairs(random_pairs(PAIRS[:2]), 0)["segments"]
    with pytest.raises(RuntimeError), fast_attention(model, segments):
        assert model.config._attn_implementation != "sdpa"
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_packed_layout_positions_and_targets():
    # group 0: prefix [10, 11], branches [20, 21] and [30]; group 1: no prefix, one branch
    batch = pack_groups([([10, 11], ([20, 21], [30])), ([], ([40, 41, 42],))], 0)
    assert batch["input_ids"].tolist() == [[10, 11, 20, 21, 30], [40, 41, 42, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 0, 0]]
    allowed = batch["attention_mask"][0, 0].int().tolist()
    assert allowed[4] == [1, 1, 0, 0, 1]  # the second branch sees the prefix and itself only
    assert batch["attention_mask"][1, 0, 3].int().tolist() == [0, 0, 0, 1, 0]  # padding: itself
    # each target's predicting position (flat into 2 x 5) and label; an empty prefix leaves the
    # branch's first token unpredicted, as in an unpacked row
    assert batch["sources"].tolist() == [1, 2, 1, 5, 6]
    assert batch["targets"].tolist() == [20, 21, 30, 41, 42]
    assert batch["owners"].tolist() == [0, 0, 1, 2, 2]
    assert batch["ends"].tolist() == [3, 4, 7]
    # attention segments (row, start, end): each group (row 1's padding tail is none)
    assert batch["segments"].tolist() == [[0, 0, 5], [1, 0, 3]]
    sums = stream_sums(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), batch)
    assert sums.tolist() == [3.0, 3.0, 9.0]


def test_rows_are_no_longer_than_the_longest_sequence():
    # first-fit decreasing into rows of 10: 10 | 9 | 7 + 3 | 2 (no room left beside the 9)
    assert pack_rows([7, 10, 3, 2, 9]) == [[1], [4], [0, 2], [3]]
    assert pack_rows([7, 10, 3], pack=False) == [[0], [1], [2]]
    assert pack_rows([7, 10, 3, 2, 9], row_tokens=20) == [[1, 4], [0, 2, 3]]


def test_unpaired_rows_keep_their_labels():
    pairs = random_pairs([(3, 2, 2), (2, 1, 3)])
    for p, label in zip(pairs, (True, False), strict=True):
        p.label = label
    assert pack_pairs(pairs, 0)["labels"].tolist() == [True, False]


def test_packed_sft_loss_and_gradients_equal_the_padded_batch():
    from instruction_tuning.data import SFTExample, collate, pack
    from instruction_tuning.losses import CompletionNLLLoss
    from rlhf_core.sequences import sequence_logprobs

    model = tiny_policy("sdpa")
    g = torch.Generator().manual_seed(1)
    examples = [
        SFTExample(torch.randint(6, 100, (p,), generator=g).tolist(),
                   torch.randint(6, 100, (c,), generator=g).tolist(), "", "")
        for p, c in [(4, 9), (2, 3), (7, 1), (1, 5), (3, 3)]
    ]  # fmt: skip
    results = []
    one_row = pack(examples, 0, row_tokens=40)  # all 38 tokens, attention example by example
    assert one_row["input_ids"].shape == (1, 38) and len(one_row["segments"]) == 5
    flat = pack(examples, 0, flat=True)  # flash attention's varlen layout, here through SDPA
    assert flat["input_ids"].shape == (1, 38) and "attention_mask" not in flat
    for batch in (collate(examples, 0), pack(examples, 0), one_row, flat):
        model.zero_grad(set_to_none=True)
        logps = sequence_logprobs(model, batch)
        loss, metrics = CompletionNLLLoss()(logps, batch["loss_mask"], 21.0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), metrics["tokens"], grads))
    (loss_a, tokens_a, grads_a), *packed_results = results
    packed = pack(examples, 0)
    assert packed["input_ids"].shape == (3, 13)  # 13 | 5 + 8 | 6 + 6, not 5 rows of 13
    for loss_b, tokens_b, grads_b in packed_results:
        assert int(tokens_a) == int(tokens_b) == 21
        torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-6)
        assert grads_a.keys() == grads_b.keys() and grads_a
        for name, grad in grads_b.items():
            relative = (grad - grads_a[name]).norm() / grads_a[name].norm()
            assert relative <= 1e-5, (name, float(relative))


# --- the flat layout (flash attention's varlen: one row, sequences told apart by position ids)


def test_flat_layout_positions_targets_and_sequence_boundaries():
    from transformers.masking_utils import find_packed_sequence_indices
    from transformers.modeling_flash_attention_utils import (
        _is_packed_sequence,
        prepare_fa_kwargs_from_position_ids,
    )

    groups = [([10, 11], ([20, 21], [30])), ([], ([40, 41, 42],)), ([50], ([],))]
    batch = pack_groups(groups, 0, flat=True)
    # every stream a sequence of its own: the prefix repeated for its second branch, no padding
    assert batch["input_ids"].tolist() == [[10, 11, 20, 21, 10, 11, 30, 40, 41, 42, 50]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 0]]
    assert "attention_mask" not in batch and "segments" not in batch and is_packed(batch)
    assert batch["sources"].tolist() == [1, 2, 5, 7, 8]
    assert batch["targets"].tolist() == [20, 21, 30, 41, 42]
    assert batch["owners"].tolist() == [0, 0, 1, 2, 2]
    assert batch["ends"].tolist() == [3, 6, 9, 10]
    assert stream_sums(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), batch).tolist() == [3, 3, 9, 0]
    # the tokens the unpacked rows would hold, as for the 4D-mask layout
    assert unpacked_tokens(batch) == unpacked_tokens(pack_groups(groups, 0)) == 11
    # what transformers reads from these position ids: its mask's sequence index per position
    # (SDPA, eager) and the varlen boundaries of its flash-attention path
    assert find_packed_sequence_indices(batch["position_ids"]).tolist() == [
        [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    ]
    assert _is_packed_sequence(batch["position_ids"], batch_size=1)
    (cu_q, cu_k), (longest, _) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert cu_q.tolist() == cu_k.tolist() == [0, 4, 7, 10, 11] and int(longest) == 4
    with pytest.raises(ValueError, match="stream 1 has no tokens"):
        pack_groups([([], ([5], []))], 0, flat=True)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_flat_dpo_log_probs_and_gradients_equal_the_two_row_forward(attention):
    # transformers turns the position ids into a block-diagonal mask where no attention mask
    # is given (its packed-sequence format), the same sequences flash attention's varlen
    # kernel is handed on a GPU
    model = tiny_policy(attention)
    pairs = random_pairs(PAIRS)
    full = collate_pairs(pairs, 0)
    reference = logps_and_grads(model, full)
    flat = pack_pairs(pairs, 0, flat=True)
    assert flat["input_ids"].shape == (1, int(full["attention_mask"].sum()))  # no padding
    assert flat["lengths"].tolist() == full["lengths"].tolist()
    chosen, rejected, grads = logps_and_grads(model, flat)
    assert_same_as(reference, chosen, rejected, grads)


def test_packing_layout_follows_the_attention_implementation():
    # the trainers read the speed plan's layout: a 4D mask for SDPA / eager, the flat layout for
    # any flash-attention implementation (transformers' rule: "flash" in the name), none for T5
    from transformers import T5Config, T5ForConditionalGeneration

    model = tiny_policy("sdpa")
    assert speed_plan(model).layout == "mask"
    for name in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn"):
        model.config._attn_implementation_internal = name
        assert model.config._attn_implementation == name
        assert speed_plan(model).layout == "flat"
    t5 = T5ForConditionalGeneration(T5Config(d_model=8, d_ff=8, num_layers=1, num_heads=1,
                                             d_kv=8, vocab_size=32))  # fmt: skip
    t5.config._attn_implementation_internal = "flash_attention_2"
    assert speed_plan(t5).layout == "padded"


def sliding_policy(attention: str, layer_types: list[str]) -> torch.nn.Module:
    """tiny-qwen3's weights under a config whose layers (some or all) attend to the last 4
    positions only, as Mistral's, Gemma 2/3's or a Qwen3 with `use_sliding_window` do."""
    from transformers import AutoModelForCausalLM

    base = tiny_policy(attention)
    config = base.config.__class__.from_dict(
        {
            **base.config.to_dict(),
            "use_sliding_window": True,
            "sliding_window": 4,
            "layer_types": layer_types,
        }  # fmt: skip
    )
    config._attn_implementation = attention
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    model.load_state_dict(base.state_dict())
    return model.train()


def one_row_each(model, pairs):
    """`logps_and_grads` with every completion its own unpadded row (a padding query whose
    window holds only padding is NaN in transformers' float64 eager attention, and spreads)."""
    model.zero_grad(set_to_none=True)
    sides = []
    for side in ("chosen_ids", "rejected_ids"):
        logps = []
        for pair in pairs:
            ids = torch.tensor([pair.prompt_ids + getattr(pair, side)])
            logp = causal_lm_token_logprobs(model, ids, torch.ones_like(ids))
            logps.append(logp[0, len(pair.prompt_ids) - 1 :].sum())
        sides.append(torch.stack(logps))
    weights = torch.arange(1.0, 1.0 + 2 * len(pairs), dtype=sides[0].dtype)
    (weights * torch.cat(sides)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sides[0].detach(), sides[1].detach(), grads


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "layer_types", [["sliding_attention", "full_attention"], ["sliding_attention"] * 2]
)
def test_packed_rows_keep_a_sliding_window(attention, layer_types):
    # transformers uses a 4D mask as given in every layer: the window must be in the packed
    # mask (on the position ids: a branch token's distance to its shared prompt), or packed
    # rows would attend past it where the model itself never does
    model = sliding_policy(attention, layer_types)
    pairs = random_pairs(PAIRS)
    reference = one_row_each(model, pairs)  # transformers' own masks, no padding
    assert (one_row_each(sliding_policy(attention, ["full_attention"] * 2), pairs)[0]
            - reference[0]).abs().max() > 1e-3  # fmt: skip
    for packed in (pack_pairs(pairs, 0, pack=True), pack_pairs(pairs, 0, row_tokens=80)):
        assert_same_as(reference, *logps_and_grads(model, packed))
