"""Direct alignment losses against independent scalar float64 references, plus identities.

The references below are written from the papers' formulas with Python's `math` on one pair at a
time (KTO on the whole batch), sharing no code with `direct_alignment.losses`.
"""

from __future__ import annotations

import inspect
import math
from decimal import Decimal, getcontext

import pytest
import torch

from direct_alignment.losses import LOSSES, log1mexp
from rlhf_core.registry import RegistryError

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-9}

# (pc, pr, rc, rr, chosen_length, rejected_length): summed log-probs and token counts.
ROWS = [
    (-12.5, -15.0, -13.0, -14.0, 9, 11),
    (-3.2, -2.9, -3.0, -3.1, 1, 1),  # length 1
    (-40.0, -38.5, -41.0, -37.0, 30, 25),
    (-0.7, -6.0, -1.2, -5.5, 2, 4),
]
# h = +-1000, and averages of -1001 for the reference-free losses.
LARGE_ROWS = [(-1.0, -1001.0, -1.0, -1.0, 1, 1), (-1001.0, -1.0, -1.0, -1.0, 1, 1)]

# (name, non-beta keyword arguments): every loss, some with non-default settings.
CASES = [
    ("dpo", {}),
    ("rpo", {"alpha": 1.0}),
    ("rpo", {"alpha": 0.3}),
    ("cdpo", {"label_smoothing": 0.1}),
    ("cdpo", {"label_smoothing": 0.35}),
    ("robust", {"label_smoothing": 0.1}),
    ("robust", {"label_smoothing": 0.4}),
    ("ipo", {"length_normalize": False}),
    ("ipo", {"length_normalize": True}),
    ("hinge", {}),
    ("simpo", {"gamma": 0.5}),
    ("simpo", {"gamma": 1.4}),
    ("orpo", {}),
    ("kto", {"desirable_weight": 1.0, "undesirable_weight": 1.0}),
    ("kto", {"desirable_weight": 1.33, "undesirable_weight": 0.7}),
    ("apo_zero", {}),
    ("apo_down", {}),
]
CASE_IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for name, kw in CASES]
ALL_NAMES = sorted(
    ["dpo", "rpo", "cdpo", "robust", "ipo", "hinge", "simpo", "orpo", "kto", "kto_unpaired",
     "apo_zero", "apo_down"]
)  # fmt: skip
PAIRED_NAMES = [n for n in ALL_NAMES if n != "kto_unpaired"]  # losses that read a preference


# ---------------------------------------------------------------- scalar float64 references


def softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def neg_log_sigmoid(x: float) -> float:  # -log(1 / (1 + e^-x)) = log(1 + e^-x)
    return softplus(-x)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def margin(row, normalize: bool = False) -> float:
    pc, pr, rc, rr, lc, lr = row
    if normalize:
        return (pc / lc - rc / lc) - (pr / lr - rr / lr)
    return (pc - rc) - (pr - rr)


def ref_dpo(row, *, beta):
    return neg_log_sigmoid(beta * margin(row))


def ref_rpo(row, *, beta, alpha):
    pc, _, _, _, lc, _ = row
    return neg_log_sigmoid(beta * margin(row)) + alpha * (-pc / lc)


def ref_cdpo(row, *, beta, label_smoothing):
    x, e = beta * margin(row), label_smoothing
    return (1 - e) * neg_log_sigmoid(x) + e * neg_log_sigmoid(-x)


def ref_robust(row, *, beta, label_smoothing):
    x, e = beta * margin(row), label_smoothing
    return ((1 - e) * neg_log_sigmoid(x) - e * neg_log_sigmoid(-x)) / (1 - 2 * e)


def ref_ipo(row, *, beta, length_normalize):
    return (margin(row, length_normalize) - 1 / (2 * beta)) ** 2


def ref_hinge(row, *, beta):
    return max(0.0, 1 - beta * margin(row))


def ref_simpo(row, *, beta, gamma):
    pc, pr, _, _, lc, lr = row
    return neg_log_sigmoid(beta * (pc / lc - pr / lr) - gamma)


def odds(avg: float) -> float:  # log(p / (1 - p)), p = e^avg
    return avg - math.log(-math.expm1(avg))


def ref_orpo(row, *, beta):
    pc, pr, _, _, lc, lr = row
    return -pc / lc + beta * neg_log_sigmoid(odds(pc / lc) - odds(pr / lr))


def ref_apo_zero(row, *, beta):
    pc, pr, rc, rr, _, _ = row
    return (1 - sigmoid(beta * (pc - rc))) + sigmoid(beta * (pr - rr))


def ref_apo_down(row, *, beta):
    pc, pr, rc, rr, _, _ = row
    return sigmoid(beta * (pc - rc)) + (1 - sigmoid(beta * margin(row)))


def ref_kto(rows, *, beta, desirable_weight, undesirable_weight):
    n = len(rows)
    z_chosen = max(0.0, sum(pc - rc for pc, _, rc, _, _, _ in rows) / n)
    z_rejected = max(0.0, sum(pr - rr for _, pr, _, rr, _, _ in rows) / n)
    total = 0.0
    for pc, pr, rc, rr, _, _ in rows:
        total += desirable_weight * (1 - sigmoid(beta * ((pc - rc) - z_rejected)))
        total += undesirable_weight * (1 - sigmoid(beta * (z_chosen - (pr - rr))))
    return total / (2 * n)


PAIR_REFERENCES = {
    "dpo": ref_dpo,
    "rpo": ref_rpo,
    "cdpo": ref_cdpo,
    "robust": ref_robust,
    "ipo": ref_ipo,
    "hinge": ref_hinge,
    "simpo": ref_simpo,
    "orpo": ref_orpo,
    "apo_zero": ref_apo_zero,
    "apo_down": ref_apo_down,
}


def reference_loss(name: str, rows, **kwargs) -> float:
    if name == "kto":
        return ref_kto(rows, **kwargs)
    return sum(PAIR_REFERENCES[name](row, **kwargs) for row in rows) / len(rows)


# ---------------------------------------------------------------- helpers


def as_tensors(rows, dtype=F64) -> dict[str, torch.Tensor]:
    cols = list(zip(*rows, strict=True))
    logps = [torch.tensor(c, dtype=dtype) for c in cols[:4]]
    lengths = [torch.tensor(c, dtype=torch.long) for c in cols[4:]]
    return dict(
        zip(
            ["pc", "pr", "rc", "rr", "chosen_lengths", "rejected_lengths"],
            logps + lengths,
            strict=True,
        )
    )


def call(loss_fn, t: dict[str, torch.Tensor], **overrides):
    t = {**t, **overrides}
    return loss_fn(
        t["pc"],
        t["pr"],
        t["rc"],
        t["rr"],
        chosen_lengths=t["chosen_lengths"],
        rejected_lengths=t["rejected_lengths"],
    )


def random_rows(batch: int, seed: int):
    """Rows with per-token averages in (-3.05, -0.05) and lengths in [1, 20)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (batch, 2), generator=gen)
    avgs = -(torch.rand(batch, 4, generator=gen, dtype=F64) * 3 + 0.05)
    rows = []
    for (lc, lr), (apc, apr, arc, arr) in zip(lengths.tolist(), avgs.tolist(), strict=True):
        rows.append((apc * lc, apr * lr, arc * lc, arr * lr, lc, lr))
    return rows


# ---------------------------------------------------------------- reference values


@pytest.mark.parametrize("beta", [1e-6, 0.1, 2.0])
@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=CASE_IDS)
def test_matches_float64_reference(name, kwargs, beta):
    loss, _ = call(LOSSES.get(name)(beta=beta, **kwargs), as_tensors(ROWS))
    expected = reference_loss(name, ROWS, beta=beta, **kwargs)
    assert loss.dtype == F64 and loss.dim() == 0
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), **TOL)


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=CASE_IDS)
def test_large_margins_stay_finite_and_exact(name, kwargs):
    t = {
        k: v.requires_grad_() if v.is_floating_point() else v
        for k, v in as_tensors(LARGE_ROWS).items()
    }
    loss, metrics = call(LOSSES.get(name)(beta=2.0, **kwargs), t)
    expected = reference_loss(name, LARGE_ROWS, beta=2.0, **kwargs)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), **TOL)
    loss.backward()
    assert all(
        t[k].grad is None or torch.isfinite(t[k].grad).all() for k in ("pc", "pr", "rc", "rr")
    )
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [c for c in CASES if c[0] != "kto"],
    ids=[i for c, i in zip(CASES, CASE_IDS, strict=True) if c[0] != "kto"],
)
def test_gradcheck(name, kwargs):
    loss_fn = LOSSES.get(name)(beta=0.1, **kwargs)
    t = as_tensors(random_rows(3, seed=0))
    logps = tuple(t[k].clone().requires_grad_() for k in ("pc", "pr", "rc", "rr"))

    def fn(pc, pr, rc, rr):
        return call(loss_fn, t, pc=pc, pr=pr, rc=rc, rr=rr)[0]

    assert torch.autograd.gradcheck(fn, logps)


def test_kto_gradcheck_where_reference_points_are_clamped_to_zero():
    # Both batch-mean log-ratios are < 0, so z = 0 in a neighbourhood and the detached z does not
    # make the numerical and analytical gradients differ.
    t = as_tensors(random_rows(3, seed=1))
    noise = torch.randn(3, generator=torch.Generator().manual_seed(5), dtype=F64)
    t["pc"], t["pr"] = t["rc"] - 5 + 0.5 * noise, t["rr"] - 4 - noise
    loss_fn = LOSSES.get("kto")(beta=0.3, desirable_weight=1.2, undesirable_weight=0.8)
    logps = tuple(t[k].clone().requires_grad_() for k in ("pc", "pr", "rc", "rr"))

    def fn(pc, pr, rc, rr):
        return call(loss_fn, t, pc=pc, pr=pr, rc=rc, rr=rr)[0]

    assert torch.autograd.gradcheck(fn, logps)


def test_kto_no_gradient_flows_through_the_reference_points():
    rows = [
        (-5.0, -6.0, -7.0, -7.5, 3, 3),
        (-8.0, -8.2, -9.0, -9.0, 4, 4),
        (-2.0, -1.0, -2.5, -3.0, 1, 2),
    ]
    t = as_tensors(rows)  # batch-mean log-ratios 1.17 (chosen), 1.43 (rejected): z not clamped
    pc, pr, rc, rr = (t[k].clone().requires_grad_() for k in ("pc", "pr", "rc", "rr"))
    beta = 0.5
    loss, metrics = LOSSES.get("kto")(beta=beta)(pc, pr, rc, rr)
    got = torch.autograd.grad(loss, (pc, pr, rc, rr))

    def by_hand(z_chosen, z_rejected):
        desirable = 1 - torch.sigmoid(beta * ((pc - rc) - z_rejected))
        undesirable = 1 - torch.sigmoid(beta * (z_chosen - (pr - rr)))
        return torch.autograd.grad(torch.cat([desirable, undesirable]).mean(), (pc, pr, rc, rr))

    z_c, z_r = ((pc - rc).mean().item(), (pr - rr).mean().item())
    assert z_c > 0 and z_r > 0
    torch.testing.assert_close(metrics["kto/kl_chosen"], torch.tensor(z_c, dtype=F64))
    torch.testing.assert_close(metrics["kto/kl_rejected"], torch.tensor(z_r, dtype=F64))
    for g, e in zip(got, by_hand(z_c, z_r), strict=True):  # z as constants
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
    live = by_hand((pc - rc).mean(), (pr - rr).mean())  # z differentiated: a different gradient
    assert any((g - e).abs().max() > 1e-3 for g, e in zip(got, live, strict=True))


def test_orpo_clamps_averages_at_zero_to_finite_loss_and_gradient():
    pc = torch.tensor([0.0, -2.0], dtype=F64, requires_grad=True)
    pr = torch.tensor([-3.0, 0.0], dtype=F64, requires_grad=True)
    ones = torch.ones(2, dtype=torch.long)
    loss, _ = LOSSES.get("orpo")()(pc, pr, chosen_lengths=ones, rejected_lengths=ones)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(pc.grad).all() and torch.isfinite(pr.grad).all()
    expected = (0.0 + 0.1 * neg_log_sigmoid(odds(-1e-6) - odds(-3.0))) / 2
    expected += (2.0 + 0.1 * neg_log_sigmoid(odds(-2.0) - odds(-1e-6))) / 2
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), **TOL)


def test_log1mexp_matches_high_precision_decimal():
    getcontext().prec = 60
    xs = [-1e-12, -1e-6, -1e-3, -0.5, -math.log(2), -0.7, -1.0, -30.0, -800.0]
    got = log1mexp(torch.tensor(xs, dtype=F64))
    expected = [float((1 - Decimal(x).exp()).ln()) for x in xs]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-13, atol=0)


# ---------------------------------------------------------------- identities


@pytest.mark.parametrize("loss_name", ["cdpo", "robust"])
def test_zero_label_smoothing_is_dpo(loss_name):
    t = as_tensors(random_rows(5, seed=2))
    smoothed, smoothed_metrics = call(LOSSES.get(loss_name)(beta=0.3, label_smoothing=0.0), t)
    dpo, dpo_metrics = call(LOSSES.get("dpo")(beta=0.3), t)
    torch.testing.assert_close(smoothed, dpo, rtol=0, atol=1e-15)
    torch.testing.assert_close(smoothed_metrics, dpo_metrics, rtol=0, atol=0)
    with_eps, _ = call(LOSSES.get(loss_name)(beta=0.3, label_smoothing=0.2), t)
    assert (with_eps - dpo).abs() > 1e-3  # the comparison can fail


def test_ipo_length_normalize_uses_per_token_averages():
    t = as_tensors(random_rows(5, seed=3))
    lc, lr = t["chosen_lengths"].to(F64), t["rejected_lengths"].to(F64)
    normalized, _ = call(LOSSES.get("ipo")(beta=0.2, length_normalize=True), t)
    on_averages, _ = call(
        LOSSES.get("ipo")(beta=0.2),
        t,
        pc=t["pc"] / lc,
        pr=t["pr"] / lr,
        rc=t["rc"] / lc,
        rr=t["rr"] / lr,
    )
    on_sums, _ = call(LOSSES.get("ipo")(beta=0.2), t)
    torch.testing.assert_close(normalized, on_averages, **TOL)
    assert (normalized - on_sums).abs() > 1e-3


@pytest.mark.parametrize("name", [n for n in PAIRED_NAMES if n != "kto"])
def test_batch_loss_is_mean_of_per_pair_losses(name):
    """Rows of different lengths in one batch give the mean of the rows' own losses."""
    loss_fn = LOSSES.get(name)()
    rows = random_rows(6, seed=4)
    whole, _ = call(loss_fn, as_tensors(rows))
    singles = torch.stack([call(loss_fn, as_tensors([row]))[0] for row in rows])
    torch.testing.assert_close(whole, singles.mean(), rtol=1e-12, atol=1e-12)


def test_reference_free_losses_ignore_reference_logps():
    t = as_tensors(ROWS)
    for name in ("simpo", "orpo"):
        loss_fn = LOSSES.get(name)()
        with_ref, _ = call(loss_fn, t)
        without, _ = loss_fn(
            t["pc"],
            t["pr"],
            chosen_lengths=t["chosen_lengths"],
            rejected_lengths=t["rejected_lengths"],
        )
        assert torch.equal(with_ref, without)


# ---------------------------------------------------------------- metrics


@pytest.mark.parametrize("name", PAIRED_NAMES)
def test_metrics_are_detached_scalars_in_input_dtype(name):
    t = {k: v.float() if v.is_floating_point() else v for k, v in as_tensors(ROWS).items()}
    for k in ("pc", "pr", "rc", "rr"):
        t[k].requires_grad_()
    loss, metrics = call(LOSSES.get(name)(), t)
    assert loss.dtype == torch.float32 and loss.requires_grad
    expected = {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"}
    assert expected | {"logps/chosen", "logps/rejected"} <= set(metrics)
    for key, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, key
        assert not value.requires_grad and value.grad_fn is None, key
        assert value.dtype == torch.float32, key


def test_dpo_metrics_values():
    # chosen log-ratios 1, -1, 2, 0.5; rejected 0, 0, 3, 0.5 -> only the first pair is ranked
    # right (a tie does not count).
    rc, rr = torch.full((4,), -5.0, dtype=F64), torch.full((4,), -7.0, dtype=F64)
    pc = rc + torch.tensor([1.0, -1.0, 2.0, 0.5], dtype=F64)
    pr = rr + torch.tensor([0.0, 0.0, 3.0, 0.5], dtype=F64)
    _, m = LOSSES.get("dpo")(beta=0.5)(pc, pr, rc, rr)
    expected = {
        "rewards/chosen": 0.5 * (1 - 1 + 2 + 0.5) / 4,
        "rewards/rejected": 0.5 * (0 + 0 + 3 + 0.5) / 4,
        "rewards/margin": 0.5 * ((1 - 0) + (-1 - 0) + (2 - 3) + 0) / 4,
        "rewards/accuracy": 1 / 4,
        "logps/chosen": (-4.0 - 6.0 - 3.0 - 4.5) / 4,
        "logps/rejected": (-7.0 - 7.0 - 4.0 - 6.5) / 4,
    }
    for key, value in expected.items():
        torch.testing.assert_close(m[key], torch.tensor(value, dtype=F64), **TOL, msg=key)


def test_reference_free_rewards_are_beta_times_average_logps():
    t = as_tensors(ROWS)
    _, m = call(LOSSES.get("simpo")(beta=2.0), t)
    avg_c = [pc / lc for pc, _, _, _, lc, _ in ROWS]
    avg_r = [pr / lr for _, pr, _, _, _, lr in ROWS]
    torch.testing.assert_close(m["rewards/chosen"], torch.tensor(2.0 * sum(avg_c) / 4, dtype=F64))
    torch.testing.assert_close(m["rewards/rejected"], torch.tensor(2.0 * sum(avg_r) / 4, dtype=F64))
    accuracy = sum(c > r for c, r in zip(avg_c, avg_r, strict=True)) / 4
    assert 0 < accuracy < 1
    torch.testing.assert_close(m["rewards/accuracy"], torch.tensor(accuracy, dtype=F64))
    torch.testing.assert_close(
        m["logps/chosen"], torch.tensor(sum(r[0] for r in ROWS) / 4, dtype=F64)
    )


# ---------------------------------------------------------------- declarations and errors

NEEDS = {  # name: (needs_reference, needs_lengths)
    "dpo": (True, False),
    "rpo": (True, False),  # the lengths feed its NLL term, not the scores
    "cdpo": (True, False),
    "robust": (True, False),
    "ipo": (True, False),
    "hinge": (True, False),
    "simpo": (False, True),
    "orpo": (False, True),
    "kto": (True, False),
    "kto_unpaired": (True, False),
    "apo_zero": (True, False),
    "apo_down": (True, False),
}
DEFAULTS = {
    "dpo": {"beta": 0.1},
    "rpo": {"beta": 0.1, "alpha": 1.0},
    "cdpo": {"beta": 0.1, "label_smoothing": 0.1},
    "robust": {"beta": 0.1, "label_smoothing": 0.1},
    "ipo": {"beta": 0.1, "length_normalize": False},
    "hinge": {"beta": 0.1},
    "simpo": {"beta": 2.0, "gamma": 0.5},
    "orpo": {"beta": 0.1},
    "kto": {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
    "kto_unpaired": {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
    "apo_zero": {"beta": 0.1},
    "apo_down": {"beta": 0.1},
}


def test_registry_lists_every_loss_and_rejects_unknown_names():
    assert LOSSES.names() == ALL_NAMES == sorted(NEEDS) == sorted(DEFAULTS)
    with pytest.raises(RegistryError, match=r"unknown direct alignment loss 'dpoo'.*dpo"):
        LOSSES.get("dpoo")


@pytest.mark.parametrize("name", ALL_NAMES)
def test_declarations_keyword_only_config_and_defaults(name):
    cls = LOSSES.get(name)
    assert cls.name == name
    assert (cls.needs_reference, cls.needs_lengths) == NEEDS[name]
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    assert {p.name: p.default for p in params} == DEFAULTS[name]
    assert cls.__doc__ and ("arXiv:" in cls.__doc__ or name == "cdpo")
    with pytest.raises(TypeError):
        cls(0.1)
    loss_fn = cls()
    assert all(f"{k}={v!r}" in repr(loss_fn) for k, v in DEFAULTS[name].items())


def test_ipo_needs_lengths_follows_length_normalize():
    assert LOSSES.get("ipo")(length_normalize=True).needs_lengths is True
    assert LOSSES.get("ipo")().needs_lengths is False


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("beta", [0.0, -0.1, float("nan"), float("inf")])
def test_bad_beta_raises(name, beta):
    with pytest.raises(ValueError, match=rf"{name} loss: beta must be a positive"):
        LOSSES.get(name)(beta=beta)


@pytest.mark.parametrize(
    ("name", "kwargs", "arg"),
    [
        ("robust", {"label_smoothing": 0.5}, "label_smoothing"),
        ("robust", {"label_smoothing": -0.1}, "label_smoothing"),
        ("cdpo", {"label_smoothing": 0.6}, "label_smoothing"),
        ("simpo", {"gamma": -1.0}, "gamma"),
        ("kto", {"desirable_weight": 0.0}, "desirable_weight"),
        ("kto", {"undesirable_weight": -1.0}, "undesirable_weight"),
    ],
)
def test_bad_settings_raise(name, kwargs, arg):
    with pytest.raises(ValueError, match=rf"{name} loss: {arg} must be"):
        LOSSES.get(name)(**kwargs)


def test_cdpo_allows_label_smoothing_one_half_robust_does_not():
    assert LOSSES.get("cdpo")(label_smoothing=0.5).label_smoothing == 0.5
    with pytest.raises(ValueError, match=r"robust loss: label_smoothing must be in \[0, 0.5\)"):
        LOSSES.get("robust")(label_smoothing=0.5)


@pytest.mark.parametrize("name", [n for n in ALL_NAMES if NEEDS[n][0]])
def test_missing_reference_raises_naming_loss_and_argument(name):
    t = as_tensors(ROWS)
    loss_fn = LOSSES.get(name)()
    with pytest.raises(ValueError, match=rf"{name} loss needs ref_chosen_logps"):
        loss_fn(t["pc"], t["pr"])
    with pytest.raises(ValueError, match=rf"{name} loss needs ref_rejected_logps"):
        loss_fn(t["pc"], t["pr"], t["rc"])


@pytest.mark.parametrize(
    "loss_fn",
    [LOSSES.get("simpo")(), LOSSES.get("orpo")(), LOSSES.get("ipo")(length_normalize=True)],
    ids=["simpo", "orpo", "ipo-length_normalize"],
)
def test_missing_lengths_raise_naming_loss_and_argument(loss_fn):
    t = as_tensors(ROWS)
    with pytest.raises(ValueError, match=rf"{loss_fn.name} loss needs chosen_lengths"):
        loss_fn(t["pc"], t["pr"], t["rc"], t["rr"], rejected_lengths=t["rejected_lengths"])
    with pytest.raises(ValueError, match=rf"{loss_fn.name} loss needs rejected_lengths"):
        loss_fn(t["pc"], t["pr"], t["rc"], t["rr"], chosen_lengths=t["chosen_lengths"])


@pytest.mark.parametrize("name", ALL_NAMES)
def test_bad_shapes_raise_naming_the_shapes(name):
    t = as_tensors(ROWS)  # B = 4
    loss_fn = LOSSES.get(name)()
    with pytest.raises(
        ValueError, match=r"policy_chosen_logps \(4,\), policy_rejected_logps \(3,\)"
    ):
        call(loss_fn, t, pr=t["pr"][:3])
    with pytest.raises(ValueError, match=r"policy_chosen_logps \(4, 1\)"):
        call(loss_fn, t, pc=t["pc"][:, None], pr=t["pr"][:, None])
    with pytest.raises(ValueError, match=r"non-empty 1-D.*\(0,\)"):
        call(loss_fn, {k: v[:0] for k, v in t.items()})
    if NEEDS[name][0]:
        with pytest.raises(ValueError, match=r"ref_rejected_logps \(5,\)"):
            call(loss_fn, t, rr=torch.zeros(5, dtype=F64))
    if NEEDS[name][1]:
        with pytest.raises(ValueError, match=r"chosen_lengths \(2,\)"):
            call(loss_fn, t, chosen_lengths=torch.ones(2, dtype=torch.long))


def test_mixed_or_integer_dtypes_and_non_tensors_raise():
    t = as_tensors(ROWS)
    dpo = LOSSES.get("dpo")()
    with pytest.raises(ValueError, match=r"ref_chosen_logps torch.float32"):
        call(dpo, t, rc=t["rc"].float())
    with pytest.raises(ValueError, match=r"one floating dtype"):
        call(dpo, {k: v.long() for k, v in t.items()})
    with pytest.raises(TypeError, match=r"dpo loss: policy_rejected_logps must be a torch.Tensor"):
        dpo(t["pc"], [-1.0, -2.0, -3.0, -4.0], t["rc"], t["rr"])


def test_rpo_with_alpha_zero_is_dpo_and_needs_the_chosen_lengths():
    t = as_tensors(ROWS)
    rpo, rpo_metrics = call(LOSSES.get("rpo")(beta=0.3, alpha=0.0), t)
    dpo, _ = call(LOSSES.get("dpo")(beta=0.3), t)
    torch.testing.assert_close(rpo, dpo, rtol=0, atol=0)
    nll = -(t["pc"] / t["chosen_lengths"]).mean()
    torch.testing.assert_close(rpo_metrics["rpo/nll"], nll)
    with pytest.raises(ValueError, match="rpo loss needs chosen_lengths"):
        LOSSES.get("rpo")()(t["pc"], t["pr"], t["rc"], t["rr"])
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        LOSSES.get("rpo")(alpha=-1.0)


# ---------------------------------------------------------------- KTO on unpaired rows


def ref_kto_unpaired(rows, labels, *, beta, desirable_weight, undesirable_weight):
    """Ethayarajh et al. 2024 eq. 8 on one batch, scalar float64: rows are (p, p_kl, r, r_kl)."""
    z0 = max(0.0, sum(p_kl - r_kl for _, p_kl, _, r_kl in rows) / len(rows))
    total = 0.0
    for (p, _, r, _), label in zip(rows, labels, strict=True):
        ratio = p - r
        if label:
            total += desirable_weight * (1 - sigmoid(beta * (ratio - z0)))
        else:
            total += undesirable_weight * (1 - sigmoid(beta * (z0 - ratio)))
    return total / len(rows), z0


UNPAIRED = [(-12.5, -15.0, -13.0, -14.5), (-3.2, -2.9, -3.0, -3.1), (-40.0, -38.5, -41.0, -39.0),
            (-0.7, -6.0, -1.2, -5.5), (-9.0, -7.0, -8.0, -7.5)]  # fmt: skip


@pytest.mark.parametrize("beta", [1e-6, 0.1, 2.0])
@pytest.mark.parametrize(("w_d", "w_u"), [(1.0, 1.0), (1.33, 0.7)])
@pytest.mark.parametrize("labels", [[1, 0, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
def test_kto_unpaired_matches_float64_reference(beta, w_d, w_u, labels):
    weights = {"desirable_weight": w_d, "undesirable_weight": w_u}
    want, z0 = ref_kto_unpaired(UNPAIRED, labels, beta=beta, **weights)
    p, p_kl, r, r_kl = (torch.tensor(c, dtype=F64) for c in zip(*UNPAIRED, strict=True))
    loss_fn = LOSSES.get("kto_unpaired")(beta=beta, **weights)
    loss, metrics = loss_fn(p, p_kl, r, r_kl, labels=torch.tensor(labels, dtype=torch.bool))
    torch.testing.assert_close(loss, torch.tensor(want, dtype=F64), **TOL)
    torch.testing.assert_close(metrics["kto/kl"], torch.tensor(z0, dtype=F64), **TOL)
    ratios = [(a - b) for a, _, b, _ in UNPAIRED]
    right = [(x > z0) == bool(y) for x, y in zip(ratios, labels, strict=True)]
    assert float(metrics["rewards/accuracy"]) == pytest.approx(sum(right) / len(right))
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad, key


def test_kto_unpaired_gradcheck_and_no_gradient_through_the_kl_rows():
    p, p_kl, r, r_kl = (
        torch.tensor(c, dtype=F64, requires_grad=True) for c in zip(*UNPAIRED, strict=True)
    )
    labels = torch.tensor([1, 0, 1, 0, 0], dtype=torch.bool)
    loss_fn = LOSSES.get("kto_unpaired")(beta=0.3, desirable_weight=1.2, undesirable_weight=0.8)
    # z0 is a detached batch statistic: check the gradient of the rows' own log-probs, with the
    # KL rows held fixed (numerically z0 moves with them, by design not analytically)
    kl = (p_kl.detach(), r_kl.detach())
    assert torch.autograd.gradcheck(
        lambda a, b: loss_fn(a, kl[0], b, kl[1], labels=labels)[0], (p, r)
    )
    loss_fn(p, p_kl, r, r_kl, labels=labels)[0].backward()
    assert p_kl.grad is None and r_kl.grad is None  # z0 carries no gradient
    assert torch.all(p.grad != 0)


def test_kto_unpaired_needs_labels_of_the_batch_shape():
    t = [torch.tensor(c, dtype=F64) for c in zip(*UNPAIRED, strict=True)]
    loss_fn = LOSSES.get("kto_unpaired")()
    with pytest.raises(ValueError, match=r"labels must be a \(B,\) bool tensor, got None"):
        loss_fn(*t)
    with pytest.raises(ValueError, match=r"got \(3,\)"):
        loss_fn(*t, labels=torch.ones(3, dtype=torch.bool))
