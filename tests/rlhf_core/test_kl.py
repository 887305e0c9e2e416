"""rlhf_core.kl: Schulman's k1/k2/k3 estimators, exactly and as Monte-Carlo estimates of KL."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.kl import kl_estimate, kl_k1, kl_k2, kl_k3

ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def random_logps(shape=(4, 9), scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 5
    logp_ref = logp + torch.randn(shape, generator=g, dtype=torch.float64) * scale
    return logp, logp_ref


def categorical_pair(seed: int, k: int = 5, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    logpi = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64) * scale, -1)
    logref = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64) * scale, -1)
    return logpi, logref


def exact_kl(logpi: torch.Tensor, logref: torch.Tensor) -> float:
    """KL(pi || pi_ref) = sum_x pi(x) (log pi(x) - log pi_ref(x)), from the definition."""
    return sum(math.exp(a) * (a - b) for a, b in zip(logpi.tolist(), logref.tolist(), strict=True))


# ----------------------------------------------------------------------------- formulas


def test_formulas_elementwise():
    logp, logp_ref = random_logps()
    for a, b, k1, k2, k3 in zip(
        logp.flatten().tolist(),
        logp_ref.flatten().tolist(),
        kl_k1(logp, logp_ref).flatten().tolist(),
        kl_k2(logp, logp_ref).flatten().tolist(),
        kl_k3(logp, logp_ref).flatten().tolist(),
        strict=True,
    ):
        d = a - b
        r = math.exp(b - a)  # pi_ref / pi
        assert k1 == pytest.approx(d, rel=1e-12, abs=1e-14)
        assert k2 == pytest.approx(d * d / 2, rel=1e-12, abs=1e-14)
        assert k3 == pytest.approx((r - 1) - math.log(r), rel=1e-9, abs=1e-12)


def test_known_values():
    logp = torch.tensor([0.0, -1.0, -2.0], dtype=torch.float64)
    logp_ref = torch.tensor([-1.0, -1.0, 0.0], dtype=torch.float64)
    # d = [1, 0, -2]
    assert torch.equal(kl_k1(logp, logp_ref), torch.tensor([1.0, 0.0, -2.0], dtype=torch.float64))
    assert torch.equal(kl_k2(logp, logp_ref), torch.tensor([0.5, 0.0, 2.0], dtype=torch.float64))
    expected_k3 = torch.tensor(
        [math.exp(-1) - 1 + 1, 0.0, math.exp(2) - 1 - 2], dtype=torch.float64
    )
    torch.testing.assert_close(kl_k3(logp, logp_ref), expected_k3, rtol=1e-14, atol=1e-15)


def test_k3_precise_for_tiny_differences():
    # k3 ~ d^2 / 2 for small d; exp(-d) - 1 + d computed naively would lose it to cancellation
    d = torch.tensor([1e-3, 1e-5, -1e-6], dtype=torch.float64)
    zero = torch.zeros_like(d)
    k3 = kl_k3(d, zero)
    exact = d.square() / 2 - d.pow(3) / 6 + d.pow(4) / 24
    torch.testing.assert_close(k3, exact, rtol=1e-6, atol=0)
    # float32: expm1 keeps ~1e-4 relative accuracy at d = 1e-3 (exp(-d) - 1 + d would give ~1e-2)
    d32 = torch.tensor([1e-3, -1e-3], dtype=torch.float32)
    exact32 = d32.double().square() / 2 - d32.double().pow(3) / 6
    k3_32 = kl_k3(d32, torch.zeros_like(d32))
    torch.testing.assert_close(k3_32.double(), exact32, rtol=1e-3, atol=0)


def test_estimator_signs_on_random_inputs():
    logp, logp_ref = random_logps(shape=(64, 64), scale=3.0, seed=1)
    k1 = kl_k1(logp, logp_ref)
    assert (kl_k3(logp, logp_ref) >= 0).all()
    assert (kl_k2(logp, logp_ref) >= 0).all()
    assert (k1 < 0).any()  # k1 is not a per-sample upper bound on anything
    assert (k1 > 0).any()


def test_k3_nonnegative_float32_extreme():
    logp, logp_ref = random_logps(shape=(1000,), scale=20.0, seed=2)
    assert (kl_k3(logp.float(), logp_ref.float()) >= 0).all()


def test_all_zero_when_policies_equal():
    logp, _ = random_logps(seed=3)
    for name, fn in ESTIMATORS.items():
        assert torch.equal(fn(logp, logp.clone()), torch.zeros_like(logp)), name
        assert torch.equal(kl_estimate(logp, logp.clone(), name), torch.zeros_like(logp)), name


def test_shape_and_dtype_preserved():
    logp, logp_ref = random_logps(shape=(2, 3, 4))
    for name in ESTIMATORS:
        out = kl_estimate(logp.float(), logp_ref.float(), name)
        assert out.shape == (2, 3, 4)
        assert out.dtype == torch.float32


def test_kl_estimate_dispatches():
    logp, logp_ref = random_logps(seed=4)
    for name, fn in ESTIMATORS.items():
        assert torch.equal(kl_estimate(logp, logp_ref, name), fn(logp, logp_ref))


def test_kl_estimate_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        kl_estimate(torch.zeros(2, 3), torch.zeros(3, 2), "k3")
    with pytest.raises(ValueError):
        kl_estimate(torch.zeros(2, 3), torch.zeros(2, 3, 1), "k1")


def test_kl_estimate_unknown_estimator_raises():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")


def test_gradients():
    logp, logp_ref = random_logps(shape=(3, 4), seed=5)
    x = logp.clone().requires_grad_(True)
    kl_k3(x, logp_ref).sum().backward()
    d = logp - logp_ref
    # d/dlogp [exp(-d) - 1 + d] = 1 - exp(-d)
    torch.testing.assert_close(x.grad, 1 - torch.exp(-d), rtol=1e-12, atol=1e-14)
    for fn in ESTIMATORS.values():
        assert torch.autograd.gradcheck(
            lambda a, b, fn=fn: fn(a, b),
            (logp.clone().requires_grad_(True), logp_ref.clone().requires_grad_(True)),
        )


# ----------------------------------------------------------------------------- as estimators of KL


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_expectations_on_categorical(seed):
    """E_pi[k1] = E_pi[k3] = KL(pi || pi_ref) exactly, summing over the support."""
    logpi, logref = categorical_pair(seed)
    kl = exact_kl(logpi, logref)
    assert kl > 0
    pi = logpi.exp()
    assert (pi * kl_k1(logpi, logref)).sum().item() == pytest.approx(kl, rel=1e-12)
    assert (pi * kl_k3(logpi, logref)).sum().item() == pytest.approx(kl, rel=1e-12)
    # k2 is biased: E[k2] != KL in general
    assert (pi * kl_k2(logpi, logref)).sum().item() != pytest.approx(kl, rel=1e-3)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_monte_carlo_means_match_exact_kl(seed):
    logpi, logref = categorical_pair(seed, k=5, scale=0.7)
    kl = exact_kl(logpi, logref)
    assert 0.02 < kl < 1.0
    g = torch.Generator().manual_seed(100 + seed)
    n = 200_000
    samples = torch.multinomial(logpi.exp(), n, replacement=True, generator=g)
    logp, logp_ref = logpi[samples], logref[samples]
    for name in ("k1", "k3"):
        k = kl_estimate(logp, logp_ref, name)
        mean = k.mean().item()
        stderr = k.std().item() / math.sqrt(n)
        assert abs(mean - kl) <= max(3 * stderr, 1e-3), (name, mean, kl, stderr)
        assert abs(mean - kl) <= 0.01


def test_k3_has_lower_variance_than_k1_for_nearby_distributions():
    logpi, logref = categorical_pair(11, k=5, scale=0.3)
    pi = logpi.exp()

    def variance(k):
        mean = (pi * k).sum()
        return (pi * (k - mean).square()).sum().item()

    var_k1 = variance(kl_k1(logpi, logref))
    var_k3 = variance(kl_k3(logpi, logref))
    assert var_k3 < 0.5 * var_k1


def test_k2_close_to_kl_for_nearby_distributions():
    logpi, logref = categorical_pair(7, scale=1.0)
    # make pi_ref a small perturbation of pi
    logref = torch.log_softmax(logpi + 0.05 * (logref - logpi), -1)
    kl = exact_kl(logpi, logref)
    e_k2 = (logpi.exp() * kl_k2(logpi, logref)).sum().item()
    assert e_k2 == pytest.approx(kl, rel=0.05)
