"""Reward-model losses against independent scalar float64 references, gradchecks and identities.

The references are written from the papers' formulas with Python's `math`, one example at a time,
sharing no code with `reward_models.losses`.
"""

from __future__ import annotations

import math

import pytest
import torch

from reward_models.config import RMConfig
from reward_models.losses import IGNORE_INDEX, LOSSES, first_error_step
from rlhf_core.config import ConfigError, validate_config
from rlhf_core.registry import RegistryError

F64 = torch.float64
TOL = {"rtol": 1e-6, "atol": 1e-6}


def softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


# ----------------------------------------------------------------------------- Bradley-Terry

# (r_c, r_r, m): rewards and the Llama 2 margin; large values check stability.
PAIRS = [
    (1.5, -0.5, 1.0),
    (-2.0, 0.3, 0.0),
    (0.1, 0.1, 0.5),
    (40.0, -60.0, 3.0),
    (-800.0, 900.0, 1.0),
]


def ref_bt(pairs, *, use_margin: bool, eta: float) -> float:
    total = 0.0
    for c, r, m in pairs:
        diff = c - r - (m if use_margin else 0.0)
        total += softplus(-diff) + eta * (c + r) ** 2  # -log sigmoid(x) = softplus(-x)
    return total / len(pairs)


@pytest.mark.parametrize("use_margin", [False, True])
@pytest.mark.parametrize("eta", [0.0, 0.01, 0.5])
def test_bradley_terry_matches_the_float64_reference(use_margin, eta):
    c, r, m = (torch.tensor(col, dtype=F64) for col in zip(*PAIRS, strict=True))
    loss_fn = LOSSES.get("bradley_terry")(use_margin=use_margin, centering_eta=eta)
    loss, metrics = loss_fn(c, r, margins=m if use_margin else None)
    assert loss.dtype == F64 and torch.isfinite(loss)
    torch.testing.assert_close(loss, torch.tensor(ref_bt(PAIRS, use_margin=use_margin, eta=eta),
                                                  dtype=F64), **TOL)  # fmt: skip
    assert metrics["accuracy"].item() == pytest.approx(2 / 5)  # ties (0.1, 0.1) are not correct
    assert metrics["margin"].item() == pytest.approx(sum(a - b for a, b, _ in PAIRS) / 5)
    assert metrics["chosen"].item() == pytest.approx(sum(a for a, _, _ in PAIRS) / 5)
    assert metrics["rejected"].item() == pytest.approx(sum(b for _, b, _ in PAIRS) / 5)
    assert metrics["bt_loss"].item() == pytest.approx(ref_bt(PAIRS, use_margin=use_margin, eta=0))
    assert not any(v.requires_grad for v in metrics.values())


def test_bradley_terry_needs_margins_only_when_asked():
    c, r = torch.zeros(2), torch.ones(2)
    assert LOSSES.get("bradley_terry")().needs_margins is False
    loss_fn = LOSSES.get("bradley_terry")(use_margin=True)
    assert loss_fn.needs_margins is True
    with pytest.raises(ValueError, match="use_margin=True needs margins"):
        loss_fn(c, r)
    with pytest.raises(ValueError, match=r"chosen_rewards \(2,\), rejected_rewards \(3,\)"):
        loss_fn(c, torch.ones(3), margins=c)
    with pytest.raises(ValueError, match="centering_eta must be >= 0"):
        LOSSES.get("bradley_terry")(centering_eta=-1.0)


# ----------------------------------------------------------------------------- ORM

# per example: token logits, mask, label
ORM_ROWS = [
    ([0.3, -1.2, 2.0, 0.7], [0, 1, 1, 1], 1.0),
    ([1.1, 0.4, -0.2, 9.0], [0, 0, 1, 0], 0.0),  # one completion token
    ([-50.0, 60.0, -3.0, 0.0], [1, 1, 1, 1], 0.0),  # large logits
    ([0.2, 0.2, 0.2, 0.2], [0, 0, 0, 0], 1.0),  # fully masked: contributes 0, still counts
    ([0.5, -0.5, 1.5, 2.5], [0, 1, 1, 0], 0.25),  # a soft label
]


def ref_orm(rows, *, token_level: bool) -> float:
    total = 0.0
    for logits, mask, y in rows:
        positions = [t for t, keep in enumerate(mask) if keep]
        if not token_level:
            positions = positions[-1:]
        bce = [softplus(logits[t]) - y * logits[t] for t in positions]  # -y log s - (1-y) log(1-s)
        total += sum(bce) / len(bce) if bce else 0.0
    return total / len(rows)


def orm_tensors(rows, dtype=F64):
    logits = torch.tensor([r[0] for r in rows], dtype=dtype)
    mask = torch.tensor([r[1] for r in rows], dtype=torch.bool)
    labels = torch.tensor([r[2] for r in rows], dtype=dtype)
    return logits, labels, mask


@pytest.mark.parametrize("token_level", [True, False])
def test_orm_bce_matches_the_float64_reference(token_level):
    logits, labels, mask = orm_tensors(ORM_ROWS)
    loss, metrics = LOSSES.get("orm_bce")(token_level=token_level)(logits, labels, mask)
    expected = torch.tensor(ref_orm(ORM_ROWS, token_level=token_level), dtype=F64)
    torch.testing.assert_close(loss, expected, **TOL)
    # last completion token: 0.7 (y=1 right), -0.2 (y=0 right), 0.0 (y=0: 0 > 0 is false, right),
    # masked row -> index 0, 0.2 (y=1 right), 1.5 (y=0.25 -> 0: wrong)
    assert metrics["accuracy"].item() == pytest.approx(4 / 5)
    sig = [1 / (1 + math.exp(-z)) for z in (0.7, -0.2, 0.0, 0.2, 1.5)]
    assert metrics["p_correct"].item() == pytest.approx(sum(sig) / 5)


def test_orm_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logits \(2, 3\), labels \(3,\), mask \(2, 3\)"):
        LOSSES.get("orm_bce")()(torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))


# ----------------------------------------------------------------------------- PRM

# per example: (T, C) logits and per-position class or -100
PRM_LOGITS = [
    [[0.2, 1.0, -0.5], [2.0, 0.1, 0.3], [0.0, 0.0, 0.0], [-1.0, 3.0, 0.5]],
    [[5.0, -5.0, 0.0], [0.3, 0.2, 0.1], [40.0, -30.0, 2.0], [0.1, 0.9, 0.4]],
    [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [0.5, 0.5, 0.6], [9.0, 9.0, 9.0]],
]
PRM_LABELS = [
    [IGNORE_INDEX, 2, IGNORE_INDEX, 0],
    [0, IGNORE_INDEX, 2, 1],
    [IGNORE_INDEX] * 4,  # no steps: contributes 0, still counts
]


def ref_prm(logits, labels) -> float:
    total = 0.0
    for row_logits, row_labels in zip(logits, labels, strict=True):
        terms = []
        for z, c in zip(row_logits, row_labels, strict=True):
            if c == IGNORE_INDEX:
                continue
            top = max(z)
            lse = top + math.log(sum(math.exp(v - top) for v in z))
            terms.append(lse - z[c])  # -log softmax(z)[c]
        total += sum(terms) / len(terms) if terms else 0.0
    return total / len(logits)


def test_prm_ce_matches_the_float64_reference_and_its_metrics():
    logits = torch.tensor(PRM_LOGITS, dtype=F64)
    labels = torch.tensor(PRM_LABELS)
    loss, metrics = LOSSES.get("prm_ce")(num_classes=3)(logits, labels)
    torch.testing.assert_close(
        loss, torch.tensor(ref_prm(PRM_LOGITS, PRM_LABELS), dtype=F64), **TOL
    )
    # argmax at the steps: row 0 -> [0 (label 2), 1 (label 0)]; row 1 -> [0 (0), 0 (2), 1 (1)]
    assert metrics["step_accuracy"].item() == pytest.approx(2 / 5)
    # first error: row 0 predicted step 0, true step 1 (wrong); row 1 predicted 0, true 0 (right)
    assert metrics["first_error_accuracy"].item() == pytest.approx(1 / 2)


def test_prm_binary_and_shape_errors():
    logits = torch.tensor([[[0.3, -0.3], [1.0, 2.0]]], dtype=F64)
    labels = torch.tensor([[1, 0]])
    loss, _ = LOSSES.get("prm_ce")(num_classes=2)(logits, labels)
    expected = (math.log(math.exp(0.3) + math.exp(-0.3)) + 0.3 + math.log1p(math.exp(1.0))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert LOSSES.get("prm_ce")(num_classes=2).head_dim == 2
    with pytest.raises(ValueError, match=r"logits \(B, T, 3\) and step_labels \(B, T\)"):
        LOSSES.get("prm_ce")()(logits, labels)
    with pytest.raises(ValueError, match="num_classes must be 2 or 3"):
        LOSSES.get("prm_ce")(num_classes=4)


def test_first_error_step_counts_steps_not_positions():
    mask = torch.tensor([[0, 1, 0, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    negative = torch.tensor([[1, 0, 0, 0, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert first_error_step(negative, mask).tolist() == [2, 2, 0]


# ----------------------------------------------------------------------------- identities


def test_batch_loss_is_the_mean_of_per_example_losses():
    torch.manual_seed(0)
    c, r, m = torch.randn(6, dtype=F64), torch.randn(6, dtype=F64), torch.rand(6, dtype=F64)
    bt = LOSSES.get("bradley_terry")(use_margin=True, centering_eta=0.1)
    singles = [bt(c[i : i + 1], r[i : i + 1], margins=m[i : i + 1])[0] for i in range(6)]
    torch.testing.assert_close(bt(c, r, margins=m)[0], torch.stack(singles).mean(), **TOL)

    logits, labels, mask = orm_tensors(ORM_ROWS)
    orm = LOSSES.get("orm_bce")()
    # each example padded differently on its own: only its masked tokens matter
    singles = [orm(logits[i : i + 1, :], labels[i : i + 1], mask[i : i + 1])[0] for i in range(5)]
    torch.testing.assert_close(orm(logits, labels, mask)[0], torch.stack(singles).mean(), **TOL)

    plogits, plabels = torch.tensor(PRM_LOGITS, dtype=F64), torch.tensor(PRM_LABELS)
    prm = LOSSES.get("prm_ce")()
    singles = [prm(plogits[i : i + 1], plabels[i : i + 1])[0] for i in range(3)]
    torch.testing.assert_close(prm(plogits, plabels)[0], torch.stack(singles).mean(), **TOL)


def test_gradcheck_every_loss():
    torch.manual_seed(1)
    c, r, m = (torch.randn(4, dtype=F64, requires_grad=True) for _ in range(3))
    bt = LOSSES.get("bradley_terry")(use_margin=True, centering_eta=0.05)
    assert torch.autograd.gradcheck(lambda a, b, mm: bt(a, b, margins=mm)[0], (c, r, m))
    logits, labels, mask = orm_tensors(ORM_ROWS[:2] + ORM_ROWS[3:])
    logits.requires_grad_(True)
    for token_level in (True, False):
        orm = LOSSES.get("orm_bce")(token_level=token_level)
        assert torch.autograd.gradcheck(lambda z, orm=orm: orm(z, labels, mask)[0], (logits,))
    plogits = torch.tensor(PRM_LOGITS[:1] + PRM_LOGITS[2:], dtype=F64).requires_grad_(True)
    plabels = torch.tensor(PRM_LABELS[:1] + PRM_LABELS[2:])
    prm = LOSSES.get("prm_ce")()
    assert torch.autograd.gradcheck(lambda z: prm(z, plabels)[0], (plogits,))


# ----------------------------------------------------------------------------- registry


def test_registry_names_kinds_and_heads():
    assert LOSSES.names() == ["bradley_terry", "orm_bce", "prm_ce", "segment_ce"]
    kinds = {name: LOSSES.get(name).kind for name in LOSSES}
    assert kinds == {"bradley_terry": "preference", "orm_bce": "orm", "prm_ce": "prm",
                     "segment_ce": "segment"}  # fmt: skip
    with pytest.raises(RegistryError, match="unknown reward model loss 'dpo'; registered: "):
        LOSSES.get("dpo")
    for name in LOSSES:  # every docstring cites its paper
        assert "arXiv:" in (LOSSES.get(name).__doc__ or ""), name


def test_loss_spec_is_validated_in_the_config():
    base = {"model": {"name_or_path": "tiny-qwen3"}, "data": {"train": {"path": "x.jsonl"}}}
    cfg = validate_config(RMConfig, {**base, "loss": {"name": "prm_ce"}})
    assert cfg.loss == {"name": "prm_ce", "num_classes": 3} and cfg.kind == "prm"
    with pytest.raises(ConfigError, match=r"unknown key\(s\) beta for reward model loss"):
        validate_config(RMConfig, {**base, "loss": {"name": "bradley_terry", "beta": 1}})


def test_pooling_is_checked_in_the_config():
    base = {"model": {"name_or_path": "tiny-qwen3"}, "data": {"train": {"path": "x.jsonl"}}}
    assert validate_config(RMConfig, {**base, "pooling": "sum"}).pooling == "sum"
    with pytest.raises(ConfigError, match="pooling 'mean' is for preference models"):
        validate_config(RMConfig, {**base, "pooling": "mean", "loss": {"name": "orm_bce"}})
    with pytest.raises(ConfigError, match="sequence classifiers read the last token only"):
        validate_config(RMConfig, {**base, "pooling": "sum",
                                   "train": {"export_sequence_classification": True}})  # fmt: skip
    with pytest.raises(ConfigError, match="lm_likelihood needs pooling: mean or sum"):
        validate_config(RMConfig, {**base, "lm_likelihood": 1.0})
    assert validate_config(RMConfig, {**base, "pooling": "sum", "lm_likelihood": 1.0})
