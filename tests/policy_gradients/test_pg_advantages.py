"""Advantage estimators against independent float64 references written from the papers, plus
identities and input errors.

The references work on Python lists one completion (or one token) at a time with `math`, sharing
no code with `policy_gradients.advantages`.
"""

from __future__ import annotations

import math

import pytest
import torch

from policy_gradients.advantages import ADVANTAGES
from rlhf_core.registry import RegistryError, build_from_spec, validate_spec

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-9}

# Nine completions of three prompts (ids not contiguous, not sorted), T = 6. Row 2 is fully
# masked, rows 3 and 7 have length 1, row 5 has a hole (a masked-out position mid-completion).
GROUPS = [4, 0, 4, 0, 9, 4, 0, 9, 0]
MASK = [
    [1, 1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0],
    [1, 1, 0, 1, 1, 0],
    [1, 1, 1, 1, 1, 0],
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
]
REWARDS = [1.0, 0.25, -0.5, 2.0, 0.7, 0.0, -1.5, 0.3, 0.8]
B, T = len(MASK), len(MASK[0])


def tensors(rewards=REWARDS, mask=MASK, groups=GROUPS):
    return (
        torch.tensor(rewards, dtype=F64),
        torch.tensor(mask, dtype=torch.bool),
        torch.tensor(groups),
    )


def dense_rewards(seed: int = 0) -> list[list[float]]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, generator=gen, dtype=F64) * 0.5).tolist()


def random_values(seed: int = 1) -> list[list[float]]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, generator=gen, dtype=F64)).tolist()


# ---------------------------------------------------------------- float64 references


def broadcast(per_sequence: list[float], mask=MASK) -> list[list[float]]:
    return [[a if m else 0.0 for m in row] for a, row in zip(per_sequence, mask, strict=True)]


def members(i: int, groups=GROUPS) -> list[int]:
    return [j for j in range(len(groups)) if groups[j] == groups[i]]


def ref_grpo(rewards, groups=GROUPS, eps=1e-6, scale=True) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        rs = [rewards[j] for j in members(i, groups)]
        n = len(rs)
        mean = sum(rs) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (n - 1)) if n > 1 else 0.0
        out.append((r - mean) / (std + eps) if scale else r - mean)
    return out


def ref_rloo(rewards, groups=GROUPS) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in members(i, groups) if j != i]
        out.append(r - sum(others) / len(others))
    return out


def ref_whiten(xs: list[float]) -> list[float]:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def positions(row) -> list[int]:
    return [t for t, m in enumerate(row) if m]


def ref_reward_to_go(dense, mask=MASK) -> list[list[float]]:
    out = []
    for r, row in zip(dense, mask, strict=True):
        idx = positions(row)
        out.append([sum(r[u] for u in idx if u >= t) if row[t] else 0.0 for t in range(len(row))])
    return out


def ref_gae(dense, values, gamma, lam, mask=MASK) -> tuple[list[list[float]], list[list[float]]]:
    """A_t = sum_l (gamma lam)^l delta_{t+l} over a row's masked tokens, V after the last = 0."""
    adv, ret = [], []
    for r, v, row in zip(dense, values, mask, strict=True):
        idx = positions(row)
        deltas = []
        for k, t in enumerate(idx):
            v_next = v[idx[k + 1]] if k + 1 < len(idx) else 0.0
            deltas.append(r[t] + gamma * v_next - v[t])
        a_row, r_row = [0.0] * len(row), [0.0] * len(row)
        for k, t in enumerate(idx):
            a = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(idx) - k))  # noqa: E741
            a_row[t], r_row[t] = a, a + v[t]
        adv.append(a_row)
        ret.append(r_row)
    return adv, ret


def on_last_token(rewards, mask=MASK) -> list[list[float]]:
    out = []
    for r, row in zip(rewards, mask, strict=True):
        idx = positions(row)
        out.append([r if idx and t == idx[-1] else 0.0 for t in range(len(row))])
    return out


def whiten_tokens(adv, mask=MASK) -> list[list[float]]:
    flat = [
        a
        for a_row, row in zip(adv, mask, strict=True)
        for a, m in zip(a_row, row, strict=True)
        if m
    ]
    white = iter(ref_whiten(flat))
    return [[next(white) if m else 0.0 for m in row] for row in mask]


def assert_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), **TOL)


# ---------------------------------------------------------------- reference values


@pytest.mark.parametrize(("eps", "scale"), [(1e-6, True), (1e-2, True), (1e-6, False)])
def test_grpo_matches_reference(eps, scale):
    r, m, g = tensors()
    adv, returns = ADVANTAGES.get("grpo")(eps=eps, scale_rewards=scale)(
        r, action_mask=m, group_ids=g
    )
    assert returns is None
    assert_close(adv, broadcast(ref_grpo(REWARDS, eps=eps, scale=scale)))


def test_dr_grpo_matches_reference():
    r, m, g = tensors()
    adv, _ = ADVANTAGES.get("dr_grpo")()(r, action_mask=m, group_ids=g)
    assert_close(adv, broadcast(ref_grpo(REWARDS, scale=False)))


def test_rloo_matches_hand_leave_one_out():
    r, m, g = tensors()
    adv, _ = ADVANTAGES.get("rloo")()(r, action_mask=m, group_ids=g)
    assert_close(adv, broadcast(ref_rloo(REWARDS)))
    # Row 0 by hand: group 4 = rows 0, 2, 5 with rewards 1.0, -0.5, 0.0.
    assert adv[0, 0].item() == pytest.approx(1.0 - (-0.5 + 0.0) / 2, abs=1e-12)


@pytest.mark.parametrize("baseline", ["none", "batch_mean"])
@pytest.mark.parametrize("whiten", [False, True])
def test_reinforce_scalar_matches_reference(baseline, whiten):
    r, m, _ = tensors()
    adv, returns = ADVANTAGES.get("reinforce")(baseline=baseline, whiten=whiten)(r, action_mask=m)
    assert returns is None
    expected = list(REWARDS)
    if baseline == "batch_mean":
        mean = sum(expected) / len(expected)
        expected = [x - mean for x in expected]
    if whiten:
        expected = ref_whiten(expected)
    assert_close(adv, broadcast(expected))


@pytest.mark.parametrize("baseline", ["none", "batch_mean"])
@pytest.mark.parametrize("whiten", [False, True])
def test_reinforce_dense_is_reward_to_go(baseline, whiten):
    dense = dense_rewards()
    _, m, _ = tensors()
    est = ADVANTAGES.get("reinforce")(baseline=baseline, whiten=whiten)
    adv, _ = est(torch.tensor(dense, dtype=F64), action_mask=m)
    expected = ref_reward_to_go(dense)
    if baseline == "batch_mean":
        flat = [
            x
            for x_row, row in zip(expected, MASK, strict=True)
            for x, k in zip(x_row, row, strict=True)
            if k
        ]
        mean = sum(flat) / len(flat)
        expected = [
            [x - mean if k else 0.0 for x, k in zip(x_row, row, strict=True)]
            for x_row, row in zip(expected, MASK, strict=True)
        ]
    if whiten:
        expected = whiten_tokens(expected)
    assert_close(adv, expected)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
@pytest.mark.parametrize("dense", [False, True])
def test_gae_matches_reference(gamma, lam, dense):
    r, m, _ = tensors()
    values = random_values()
    per_token = dense_rewards() if dense else on_last_token(REWARDS)
    rewards = torch.tensor(per_token, dtype=F64) if dense else r
    est = ADVANTAGES.get("gae")(gamma=gamma, lam=lam, whiten=False)
    adv, returns = est(rewards, action_mask=m, values=torch.tensor(values, dtype=F64))
    exp_adv, exp_ret = ref_gae(per_token, values, gamma, lam)
    assert_close(adv, exp_adv)
    assert_close(returns, exp_ret)


def test_gae_whiten_standardises_over_masked_tokens():
    r, m, _ = tensors()
    values = random_values()
    est = ADVANTAGES.get("gae")(gamma=1.0, lam=0.95)  # whiten=True by default
    adv, returns = est(r, action_mask=m, values=torch.tensor(values, dtype=F64))
    exp_adv, exp_ret = ref_gae(on_last_token(REWARDS), values, 1.0, 0.95)
    assert_close(adv, whiten_tokens(exp_adv))
    assert_close(returns, exp_ret)  # returns come from the raw advantages


# ---------------------------------------------------------------- identities


def test_dr_grpo_equals_grpo_without_std():
    r, m, g = tensors()
    dr, _ = ADVANTAGES.get("dr_grpo")()(r, action_mask=m, group_ids=g)
    plain, _ = ADVANTAGES.get("grpo")(scale_rewards=False)(r, action_mask=m, group_ids=g)
    assert torch.equal(dr, plain)


def test_rloo_is_rescaled_dr_grpo():
    r, m, g = tensors()
    rloo, _ = ADVANTAGES.get("rloo")()(r, action_mask=m, group_ids=g)
    dr, _ = ADVANTAGES.get("dr_grpo")()(r, action_mask=m, group_ids=g)
    n = torch.tensor([len(members(i)) for i in range(B)], dtype=F64)[:, None]
    torch.testing.assert_close(rloo, dr * n / (n - 1), **TOL)


def test_gae_lambda1_gamma1_is_reward_to_go_minus_value():
    dense = dense_rewards(3)
    values = random_values(4)
    _, m, _ = tensors()
    est = ADVANTAGES.get("gae")(gamma=1.0, lam=1.0, whiten=False)
    adv, returns = est(
        torch.tensor(dense, dtype=F64), action_mask=m, values=torch.tensor(values, dtype=F64)
    )
    togo = torch.tensor(ref_reward_to_go(dense), dtype=F64)
    v = torch.tensor(values, dtype=F64) * m
    torch.testing.assert_close(adv, togo - v, **TOL)
    torch.testing.assert_close(returns, togo, **TOL)  # lambda = 1: Monte-Carlo returns


def test_gae_lambda0_is_td_error():
    r, m, _ = tensors()
    values = random_values()
    est = ADVANTAGES.get("gae")(gamma=0.9, lam=0.0, whiten=False)
    adv, _ = est(r, action_mask=m, values=torch.tensor(values, dtype=F64))
    rewards = on_last_token(REWARDS)
    row = 1  # full row: delta_t = r_t + 0.9 V_{t+1} - V_t
    for t in range(T):
        v_next = values[row][t + 1] if t + 1 < T else 0.0
        expected = rewards[row][t] + 0.9 * v_next - values[row][t]
        assert adv[row, t].item() == pytest.approx(expected, abs=1e-12)


def test_reinforce_dense_on_last_token_equals_scalar():
    r, m, _ = tensors()
    dense = torch.tensor(on_last_token(REWARDS), dtype=F64)
    est = ADVANTAGES.get("reinforce")()
    torch.testing.assert_close(est(dense, action_mask=m)[0], est(r, action_mask=m)[0], **TOL)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_dense_reduction_sum_equals_summed_scalar_rewards(name):
    dense = dense_rewards(5)
    _, m, g = tensors()
    sums = [
        sum(x for x, k in zip(r_row, row, strict=True) if k)
        for r_row, row in zip(dense, MASK, strict=True)
    ]
    got, _ = ADVANTAGES.get(name)(dense_reduction="sum")(
        torch.tensor(dense, dtype=F64), action_mask=m, group_ids=g
    )
    want, _ = ADVANTAGES.get(name)()(torch.tensor(sums, dtype=F64), action_mask=m, group_ids=g)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce", "gae"])
def test_permuting_rows_permutes_advantages(name):
    r, m, g = tensors()
    v = torch.tensor(random_values(), dtype=F64)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(7))
    est = ADVANTAGES.get(name)()
    a, _ = est(r, action_mask=m, group_ids=g, values=v)
    b, _ = est(r[perm], action_mask=m[perm], group_ids=g[perm] * 10 + 3, values=v[perm])
    torch.testing.assert_close(b, a[perm], **TOL)


# ---------------------------------------------------------------- edge cases


def test_group_of_equal_rewards_gives_zero_not_nan():
    rewards = [0.1, 0.1, 0.1, 0.7, 0.2, 0.1, 0.1]
    groups = [0, 0, 0, 1, 1, 0, 2]  # group 0: five equal rewards; group 2: one completion
    mask = [[1, 1]] * 7
    r, m, g = tensors(rewards, mask, groups)
    adv, _ = ADVANTAGES.get("grpo")()(r, action_mask=m, group_ids=g)
    assert torch.isfinite(adv).all()
    assert adv[[0, 1, 2, 5, 6]].abs().max().item() < 1e-6
    assert_close(adv, broadcast(ref_grpo(rewards, groups), mask))


def test_fully_masked_row_and_length_one():
    r, m, g = tensors()
    values = torch.tensor(random_values(), dtype=F64)
    dense = torch.tensor(dense_rewards(), dtype=F64)
    for name in ADVANTAGES:
        rewards = dense if name == "turn_grpo" else r  # per-turn rewards are dense
        adv, returns = ADVANTAGES.get(name)()(rewards, action_mask=m, group_ids=g, values=values)
        assert torch.isfinite(adv).all(), name
        assert torch.equal(adv[~m], torch.zeros_like(adv[~m])), name
        assert torch.all(adv[2] == 0), name
        if returns is not None:
            assert torch.equal(returns[~m], torch.zeros_like(returns[~m])), name
    # Length 1 under GAE (gamma = lam = 1): A = r - V on the single token.
    est = ADVANTAGES.get("gae")(gamma=1.0, lam=1.0, whiten=False)
    adv, _ = est(r, action_mask=m, values=values)
    assert adv[3, 0].item() == pytest.approx(REWARDS[3] - values[3, 0].item(), abs=1e-12)


def test_padding_values_are_ignored():
    r, m, g = tensors()
    dense = torch.tensor(dense_rewards(), dtype=F64)
    values = torch.tensor(random_values(), dtype=F64)
    noisy_dense = torch.where(m, dense, torch.full_like(dense, float("nan")))
    noisy_values = torch.where(m, values, torch.full_like(values, float("inf")))
    for name in ["reinforce", "gae"]:
        est = ADVANTAGES.get(name)()
        clean = est(dense, action_mask=m, values=values)
        noisy = est(noisy_dense, action_mask=m, values=noisy_values)
        torch.testing.assert_close(noisy[0], clean[0], **TOL)


def test_integer_rewards_and_float_mask_are_accepted():
    r, m, g = tensors()
    adv_int, _ = ADVANTAGES.get("dr_grpo")()(
        torch.tensor([1, 0, 0, 1, 1, 0, 1, 0, 1]), action_mask=m.double(), group_ids=g
    )
    adv_flt, _ = ADVANTAGES.get("dr_grpo")()(
        torch.tensor([1.0, 0, 0, 1, 1, 0, 1, 0, 1]), action_mask=m, group_ids=g
    )
    assert adv_int.dtype == torch.get_default_dtype()
    torch.testing.assert_close(adv_int.double(), adv_flt.double())


# ---------------------------------------------------------------- errors and registry


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimator_rejects_dense_rewards(name):
    _, m, g = tensors()
    with pytest.raises(
        ValueError,
        match=rf"{name} advantage estimator: got dense per-token rewards \(9, 6\).*dense_reduction",
    ):
        ADVANTAGES.get(name)()(torch.tensor(dense_rewards(), dtype=F64), action_mask=m, group_ids=g)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimator_needs_group_ids(name):
    r, m, _ = tensors()
    with pytest.raises(ValueError, match="needs group_ids"):
        ADVANTAGES.get(name)()(r, action_mask=m)
    with pytest.raises(ValueError, match=r"integer tensor of shape \(9,\)"):
        ADVANTAGES.get(name)()(r, action_mask=m, group_ids=torch.zeros(9, dtype=F64))


def test_rloo_needs_two_completions_per_group():
    r, m, _ = tensors()
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3, 4, 4])
    with pytest.raises(ValueError, match=r"at least 2 completions per group; group id\(s\) \[2\]"):
        ADVANTAGES.get("rloo")()(r, action_mask=m, group_ids=groups)


def test_gae_needs_values():
    r, m, _ = tensors()
    with pytest.raises(ValueError, match="gae advantage estimator: needs values"):
        ADVANTAGES.get("gae")()(r, action_mask=m)
    with pytest.raises(ValueError, match=r"values must have the action_mask shape \(9, 6\)"):
        ADVANTAGES.get("gae")()(r, action_mask=m, values=torch.zeros(9, 5))


def test_bad_inputs_raise():
    r, m, g = tensors()
    est = ADVANTAGES.get("grpo")()
    with pytest.raises(
        ValueError,
        match=r"rewards must have shape \(B,\) = \(9,\) or \(B, T\) = \(9, 6\).*got \(8,\)",
    ):
        est(r[:8], action_mask=m, group_ids=g)
    with pytest.raises(ValueError, match="action_mask must be a \\(B, T\\) tensor"):
        est(r, action_mask=m[0], group_ids=g)
    with pytest.raises(ValueError, match="only 0 and 1"):
        est(r, action_mask=m.double() * 2, group_ids=g)
    with pytest.raises(ValueError, match="rewards must be finite"):
        est(torch.where(r > 1.5, float("nan"), r), action_mask=m, group_ids=g)
    with pytest.raises(ValueError, match="whiten needs at least 2 completions"):
        ADVANTAGES.get("reinforce")(whiten=True)(r[:1], action_mask=m[:1])


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("grpo", {"eps": 0.0}, "eps must be a positive finite number"),
        ("grpo", {"dense_reduction": "mean"}, "dense_reduction must be 'sum' or None"),
        ("reinforce", {"baseline": "ema"}, "baseline must be 'none' or 'batch_mean'"),
        ("gae", {"gamma": 1.5}, r"gamma must be in \[0, 1\]"),
        ("gae", {"lam": -0.1}, r"lam must be in \[0, 1\]"),
    ],
)
def test_bad_settings_raise(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ADVANTAGES.get(name)(**kwargs)


def test_registry_lists_names_and_flags():
    assert ADVANTAGES.names() == ["dr_grpo", "gae", "grpo", "reinforce", "rloo", "turn_grpo"]
    with pytest.raises(RegistryError, match="registered: dr_grpo, gae, grpo, reinforce, rloo"):
        ADVANTAGES.get("ppo")
    for name in ADVANTAGES:
        cls = ADVANTAGES.get(name)
        assert cls.needs_groups == (name in {"grpo", "dr_grpo", "rloo", "turn_grpo"}), name
        assert cls.needs_values == (name == "gae"), name


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce", "gae"])
def test_configurable_from_spec(name):
    spec = validate_spec(ADVANTAGES, {"name": name}, where="advantage")
    est = build_from_spec(ADVANTAGES, spec)
    assert type(est) is ADVANTAGES.get(name)
    assert repr(est).startswith(type(est).__name__)
    with pytest.raises(ValueError, match="unknown key"):
        validate_spec(ADVANTAGES, {"name": name, "extra": 1}, where="advantage")
