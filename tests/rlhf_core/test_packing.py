"""Packed rows (`rlhf_core.packing`): a shared prompt encoded once and several sequences per row
give the log-probs and gradients of the plain padded forward, on the tiny world's Qwen3 in
float64 (log-probs to 1e-6, gradients to 1e-5 relative).

Relative is per parameter tensor, ||g_packed - g_rows|| / ||g_rows||: Qwen3's RMSNorm computes
in float32 even in a float64 model, so the backward rounds gradients to float32 at every norm,
and a prompt's gradient (the sum of its two completions' in one row, two rows' sums otherwise)
can only agree to float32 rounding (~1e-7 relative here), element by element less near zero."""

from __future__ import annotations

import pytest
import torch

from direct_alignment.data import PreferencePair, collate_pairs, pack_pairs
from direct_alignment.reference import pair_logps
from rlhf_core.models import ModelConfig, load_policy
from rlhf_core.packing import pack_groups, pack_rows, stream_sums, supports_packing


def random_pairs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(6, 100, (n,), generator=g).tolist()

    return [PreferencePair(ids(p), ids(c), ids(r), "") for p, c, r in lengths]


def tiny_policy(attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(name_or_path="tiny-qwen3", attention=attention, dtype="fp32")
    return load_policy(cfg, "cpu").double().train()


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
    assert supports_packing(model)
    pairs = random_pairs(PAIRS)
    full = collate_pairs(pairs, 0)
    reference = logps_and_grads(model, full)
    for pack in (False, True):
        packed = pack_pairs(pairs, 0, pack=pack)
        rows = 4 if pack else 6
        assert packed["input_ids"].shape == (rows, 22)
        assert packed["lengths"].tolist() == full["lengths"].tolist()
        chosen, rejected, grads = logps_and_grads(model, packed)
        torch.testing.assert_close(chosen, reference[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(rejected, reference[1], rtol=0, atol=1e-6)
        assert grads.keys() == reference[2].keys() and grads
        for name, grad in grads.items():
            relative = (grad - reference[2][name]).norm() / reference[2][name].norm()
            assert relative <= 1e-5, (name, float(relative))


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
    sums = stream_sums(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), batch)
    assert sums.tolist() == [3.0, 3.0, 9.0]


def test_rows_are_no_longer_than_the_longest_sequence():
    # first-fit decreasing into rows of 10: 10 | 9 | 7 + 3 | 2 (no room left beside the 9)
    assert pack_rows([7, 10, 3, 2, 9]) == [[1], [4], [0, 2], [3]]
    assert pack_rows([7, 10, 3], pack=False) == [[0], [1], [2]]


def test_unpaired_rows_keep_their_labels():
    pairs = random_pairs([(3, 2, 2), (2, 1, 3)])
    for p, label in zip(pairs, (True, False), strict=True):
        p.label = label
    assert pack_pairs(pairs, 0)["labels"].tolist() == [True, False]


def test_packed_sft_loss_and_gradients_equal_the_padded_batch():
    from instruction_tuning.data import SFTExample, collate, pack
    from instruction_tuning.losses import CompletionNLLLoss
    from rlhf_core.packing import batch_logprobs

    model = tiny_policy("sdpa")
    g = torch.Generator().manual_seed(1)
    examples = [
        SFTExample(torch.randint(6, 100, (p,), generator=g).tolist(),
                   torch.randint(6, 100, (c,), generator=g).tolist(), "", "")
        for p, c in [(4, 9), (2, 3), (7, 1), (1, 5), (3, 3)]
    ]  # fmt: skip
    results = []
    for batch in (collate(examples, 0), pack(examples, 0)):
        model.zero_grad(set_to_none=True)
        logps = batch_logprobs(model, batch)
        loss, metrics = CompletionNLLLoss()(logps, batch["loss_mask"], 21.0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), metrics["tokens"], grads))
    (loss_a, tokens_a, grads_a), (loss_b, tokens_b, grads_b) = results
    assert int(tokens_a) == int(tokens_b) == 21
    packed = pack(examples, 0)
    assert packed["input_ids"].shape == (3, 13)  # 13 | 5 + 8 | 6 + 6, not 5 rows of 13
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_b.items():
        relative = (grad - grads_a[name]).norm() / grads_a[name].norm()
        assert relative <= 1e-5, (name, float(relative))
