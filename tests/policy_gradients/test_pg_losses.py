"""Policy-gradient and value losses against independent float64 references written from the
papers, their gradients, identities, gradient-accumulation invariance and input errors.

The references work on Python lists one token at a time with `math`, sharing no code with
`policy_gradients.losses` or `rlhf_core`.
"""

from __future__ import annotations

import math

import pytest
import torch

import rlhf_core.kl
from policy_gradients import losses as pg_losses
from policy_gradients.experience import Experience
from policy_gradients.losses import LOSSES, VALUE_LOSSES
from rlhf_core.registry import RegistryError, build_from_spec, validate_spec

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-10}
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
POLICY_LOSSES = ["pg", "clipped", "gspo", "cispo"]


def loss_cls(name: str) -> type:
    """A policy loss from `LOSSES`, or PPO's value loss from its own registry."""
    return VALUE_LOSSES.get(name) if name == "value" else LOSSES.get(name)


# B = 6, T = 5: full rows, a fully masked row (2), a length-1 row (3).
MASK = [
    [1, 1, 1, 1, 1],
    [1, 1, 1, 0, 0],
    [0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0],
    [1, 1, 1, 1, 0],
    [1, 1, 1, 1, 1],
]
B, T = len(MASK), len(MASK[0])


def random_batch(seed: int = 0, *, log_ratio_scale: float = 0.4, per_token_adv: bool = True):
    """Lists: log-probs, old log-probs, ref log-probs, advantages, entropies, values, old values,
    returns. Ratios exp(logp - old) spread well past 1 +- 0.2."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=F64) * scale

    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    old = logp - rand(B, T, scale=log_ratio_scale)
    ref = logp + rand(B, T, scale=0.5)
    adv = rand(B, T) if per_token_adv else rand(B, 1).expand(B, T).clone()
    entropy = torch.rand(B, T, generator=g, dtype=F64) * 2
    values = rand(B, T)
    values_old = values + rand(B, T, scale=0.3)
    returns = values + rand(B, T)
    named = {
        "logp": logp, "old": old, "ref": ref, "adv": adv, "entropy": entropy,
        "values": values, "values_old": values_old, "returns": returns,
    }  # fmt: skip
    return {k: v.tolist() for k, v in named.items()}


def experience(d: dict, mask=MASK, **overrides) -> Experience:
    """A real `Experience` from the lists in `d` (sequence ids are dummies)."""
    b, t = len(mask), len(mask[0])
    fields = {
        "sequence_ids": torch.zeros(b, 3 + t, dtype=torch.long),
        "attention_mask": torch.ones(b, 3 + t, dtype=torch.long),
        "action_mask": torch.tensor(mask, dtype=torch.bool),
        "log_probs_old": torch.tensor(d["old"], dtype=F64),
        "advantages": torch.tensor(d["adv"], dtype=F64),
        "log_probs_ref": torch.tensor(d["ref"], dtype=F64),
        "values_old": torch.tensor(d["values_old"], dtype=F64),
        "returns": torch.tensor(d["returns"], dtype=F64),
        "group_ids": torch.arange(b),
    }
    return Experience(**{**fields, **overrides})


def leaf(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64, requires_grad=True)


def make(name: str, mode: str = "token-mean", **kwargs):
    normalizer = 7.0 if mode == "seq-mean-token-sum-norm" else None
    return loss_cls(name)(aggregation=mode, normalizer=normalizer, **kwargs)


# ---------------------------------------------------------------- float64 references


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def kl_ref(lp: float, ref: float, estimator: str) -> float:
    """Schulman's estimators of KL(pi || ref) from one sample: d = log pi - log ref."""
    d = lp - ref
    return {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[estimator]


def kl_grad_ref(lp: float, ref: float, estimator: str) -> float:
    d = lp - ref
    return {"k1": 1.0, "k2": d, "k3": 1 - math.exp(-d)}[estimator]


def seq_ratio(d: dict, i: int, mask=MASK) -> float:
    idx = [t for t, m in enumerate(mask[i]) if m]
    if not idx:
        return 1.0
    return math.exp(sum(d["logp"][i][t] - d["old"][i][t] for t in idx) / len(idx))


def policy_token_ref(name: str, d: dict, i: int, t: int, eps_low: float, eps_high: float):
    """(per-token policy loss, its gradient in logp_t) from the paper's formula."""
    lp, a = d["logp"][i][t], d["adv"][i][t]
    if name == "pg":
        return -a * lp, -a
    if name == "cispo":
        w = clip(math.exp(lp - d["old"][i][t]), 1 - eps_low, 1 + eps_high)
        return -w * a * lp, -w * a
    rho = math.exp(lp - d["old"][i][t]) if name == "clipped" else seq_ratio(d, i)
    unclipped, clipped = rho * a, clip(rho, 1 - eps_low, 1 + eps_high) * a
    binds = (rho < 1 - eps_low and a < 0) or (rho > 1 + eps_high and a > 0)
    # d(rho)/d(logp_t) = rho, also for gspo's token form sg(s) exp(logp - sg(logp)).
    return -min(unclipped, clipped), (0.0 if binds else -rho * a)


def token_weights(mode: str, mask=MASK, normalizer: float = 7.0) -> list[list[float]]:
    """d(aggregate)/d(loss_t) for each token: the aggregation written out."""
    n_tokens = sum(map(sum, mask))
    out = []
    for row in mask:
        n = sum(row)
        if mode == "token-mean":
            w = 1 / n_tokens
        elif mode == "seq-mean-token-mean":
            w = 1 / (len(mask) * n) if n else 0.0
        else:
            w = 1 / (len(mask) * normalizer)
        out.append([w if m else 0.0 for m in row])
    return out


def policy_loss_ref(
    name, d, mode, *, eps_low, eps_high, kl_beta=0.0, kl_estimator="k3", entropy_coef=0.0
):
    """(loss, gradient in logp (B, T) as lists) for a policy loss."""
    w = token_weights(mode)
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if not MASK[i][t]:
                continue
            value, dvalue = policy_token_ref(name, d, i, t, eps_low, eps_high)
            lp, ref = d["logp"][i][t], d["ref"][i][t]
            value += kl_beta * kl_ref(lp, ref, kl_estimator) - entropy_coef * d["entropy"][i][t]
            dvalue += kl_beta * kl_grad_ref(lp, ref, kl_estimator)
            loss += w[i][t] * value
            grad[i][t] = w[i][t] * dvalue
    return loss, grad


def value_loss_ref(d, mode, eps_value):
    w = token_weights(mode)
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if not MASK[i][t]:
                continue
            v, v_old, r = d["values"][i][t], d["values_old"][i][t], d["returns"][i][t]
            if eps_value is None:
                value, dvalue = 0.5 * (v - r) ** 2, v - r
            else:
                v_clip = v_old + clip(v - v_old, -eps_value, eps_value)
                inside = abs(v - v_old) < eps_value
                if (v - r) ** 2 >= (v_clip - r) ** 2:
                    value, dvalue = 0.5 * (v - r) ** 2, v - r
                else:
                    value, dvalue = 0.5 * (v_clip - r) ** 2, (v_clip - r) if inside else 0.0
            loss += w[i][t] * value
            grad[i][t] = w[i][t] * dvalue
    return loss, grad


DEFAULT_EPS = {"pg": (0.2, 0.2), "clipped": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 4.0)}


def clip_kwargs(name: str, eps_low: float, eps_high: float) -> dict:
    return {} if name == "pg" else {"eps_low": eps_low, "eps_high": eps_high}


# ---------------------------------------------------------------- reference values


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("name", "eps"),
    [("pg", (0.2, 0.2)), ("clipped", (0.2, 0.2)), ("clipped", (0.2, 0.28)), ("gspo", (3e-4, 4e-4)),
     ("gspo", (0.05, 0.08)), ("cispo", (1.0, 4.0)), ("cispo", (0.2, 0.28))],
)  # fmt: skip
def test_policy_loss_and_gradient_match_reference(name, eps, mode):
    d = random_batch(per_token_adv=name != "gspo")
    if name == "gspo" and eps[0] > 0.01:  # spread sequence ratios over both sides of the clip
        d = random_batch(seed=3, log_ratio_scale=0.15)
    logp = leaf(d["logp"])
    loss, _ = make(name, mode, **clip_kwargs(name, *eps))(logp, experience(d))
    loss.backward()
    exp_loss, exp_grad = policy_loss_ref(name, d, mode, eps_low=eps[0], eps_high=eps[1])
    assert loss.item() == pytest.approx(exp_loss, rel=1e-9, abs=1e-10)
    torch.testing.assert_close(logp.grad, torch.tensor(exp_grad, dtype=F64), **TOL)


def test_references_exercise_both_clip_sides():
    """The data above must actually hit the clip (else the clipped tests cannot fail)."""
    for name, seed, scale in [("clipped", 0, 0.4), ("gspo", 3, 0.15)]:
        d = random_batch(seed=seed, log_ratio_scale=scale)
        _, metrics = make(
            name, eps_low=0.05 if name == "gspo" else 0.2, eps_high=0.08 if name == "gspo" else 0.2
        )(leaf(d["logp"]), experience(d))
        assert 0.05 < metrics["clip_fraction"].item() < 0.95, name


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_kl_and_entropy_terms_match_reference(name, estimator):
    d = random_batch(1)
    logp = leaf(d["logp"])
    exp = experience(d)
    fn = make(name, "seq-mean-token-mean", kl_beta=0.3, kl_estimator=estimator, entropy_coef=0.05)
    loss, metrics = fn(logp, exp, entropy=torch.tensor(d["entropy"], dtype=F64))
    loss.backward()
    exp_loss, exp_grad = policy_loss_ref(
        name, d, "seq-mean-token-mean", eps_low=DEFAULT_EPS[name][0], eps_high=DEFAULT_EPS[name][1],
        kl_beta=0.3, kl_estimator=estimator, entropy_coef=0.05,
    )  # fmt: skip
    assert loss.item() == pytest.approx(exp_loss, rel=1e-9, abs=1e-10)
    torch.testing.assert_close(logp.grad, torch.tensor(exp_grad, dtype=F64), **TOL)
    kls = [
        kl_ref(d["logp"][i][t], d["ref"][i][t], estimator)
        for i in range(B)
        for t in range(T)
        if MASK[i][t]
    ]
    assert metrics["kl"].item() == pytest.approx(sum(kls) / len(kls), rel=1e-9)
    ents = [d["entropy"][i][t] for i in range(B) for t in range(T) if MASK[i][t]]
    assert metrics["entropy"].item() == pytest.approx(sum(ents) / len(ents), rel=1e-9)


def test_kl_in_loss_is_rlhf_core_kl():
    assert pg_losses.kl_estimate is rlhf_core.kl.kl_estimate


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eps_value", [0.2, 0.05, None])
def test_value_loss_and_gradient_match_reference(eps_value, mode):
    d = random_batch(2)
    values = leaf(d["values"])
    fn = loss_cls("value")(
        eps_value=eps_value, aggregation=mode, normalizer=7.0 if "norm" in mode else None
    )
    loss, metrics = fn(None, experience(d), values=values)
    loss.backward()
    exp_loss, exp_grad = value_loss_ref(d, mode, eps_value)
    assert loss.item() == pytest.approx(exp_loss, rel=1e-9, abs=1e-10)
    torch.testing.assert_close(values.grad, torch.tensor(exp_grad, dtype=F64), **TOL)
    if eps_value == 0.05:
        assert 0.05 < metrics["value_clip_fraction"].item() < 0.95  # both branches exercised


def test_metrics_match_reference_and_are_detached():
    d = random_batch(4)
    exp = experience(d)
    entropy = leaf(d["entropy"])
    n = sum(map(sum, MASK))
    rhos = [
        math.exp(d["logp"][i][t] - d["old"][i][t]) for i in range(B) for t in range(T) if MASK[i][t]
    ]
    for name in POLICY_LOSSES:
        fn = make(name, kl_beta=0.1, entropy_coef=0.01)
        loss, metrics = fn(leaf(d["logp"]), exp, entropy=entropy)
        assert loss.requires_grad and loss.dim() == 0
        assert set(metrics) >= {"pg_loss", "ratio_mean", "kl", "entropy"}, name
        assert ("clip_fraction" in metrics) == (name != "pg"), name
        for key, value in metrics.items():
            assert isinstance(value, torch.Tensor) and value.dim() == 0, (name, key)
            assert not value.requires_grad, (name, key)
        pg_loss, _ = policy_loss_ref(
            name, d, "token-mean", eps_low=DEFAULT_EPS[name][0], eps_high=DEFAULT_EPS[name][1]
        )
        assert metrics["pg_loss"].item() == pytest.approx(pg_loss, rel=1e-9)
        if name != "gspo":
            assert metrics["ratio_mean"].item() == pytest.approx(sum(rhos) / n, rel=1e-9)
    _, metrics = loss_cls("value")()(None, exp, values=leaf(d["values"]))
    assert set(metrics) == {"value_loss", "value_clip_fraction", "value_mean"}
    assert not any(v.requires_grad for v in metrics.values())


def test_clip_fraction_counts_binding_clips():
    # Four one-token completions: rho = 1.5 / 0.5 with A = +1 / -1.
    d = random_batch()
    mask = [[1]] * 4
    logp = torch.zeros(4, 1, dtype=F64)
    old = -torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]], dtype=F64))
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]], dtype=F64)
    exp = experience({**d, "old": old.tolist(), "adv": adv.tolist(), "ref": logp.tolist(),
                      "values_old": logp.tolist(), "returns": logp.tolist()}, mask)  # fmt: skip
    _, metrics = LOSSES.get("clipped")()(logp, exp)
    assert metrics["clip_fraction"].item() == 0.5  # rows 0 (high, A > 0) and 3 (low, A < 0)
    _, metrics = LOSSES.get("cispo")(eps_low=0.2, eps_high=0.2)(logp, exp)
    assert metrics["clip_fraction"].item() == 1.0  # every weight truncated, whatever A's sign


# ---------------------------------------------------------------- identities


@pytest.mark.parametrize("mode", MODES)
def test_gspo_equals_clipped_with_one_token_per_completion(mode):
    d = random_batch(5, log_ratio_scale=0.3)
    for mask in ([[1]] * B, [[1, 0, 0, 0, 0]] * B):  # T = 1, and one token plus padding
        width = len(mask[0])
        cut = {k: [row[:width] for row in v] for k, v in d.items()}
        results = []
        for name in ("gspo", "clipped"):
            logp = leaf(cut["logp"])
            fn = make(name, mode, eps_low=0.1, eps_high=0.15, kl_beta=0.2)
            loss, _ = fn(logp, experience(cut, mask))
            loss.backward()
            results.append((loss, logp.grad))
        torch.testing.assert_close(results[0][0], results[1][0], **TOL)
        torch.testing.assert_close(results[0][1], results[1][1], **TOL)


@pytest.mark.parametrize("name", [*POLICY_LOSSES, "value"])
def test_sum_norm_with_normalizer_T_equals_token_mean_on_full_rows(name):
    d = random_batch(6)
    full = [[1] * T for _ in range(B)]
    out = []
    for mode, normalizer in [("token-mean", None), ("seq-mean-token-sum-norm", float(T))]:
        logp, values = leaf(d["logp"]), leaf(d["values"])
        fn = loss_cls(name)(aggregation=mode, normalizer=normalizer)
        loss, _ = fn(logp, experience(d, full), values=values)
        loss.backward()
        out.append((loss, logp.grad if name != "value" else values.grad))
    torch.testing.assert_close(out[0][0], out[1][0], **TOL)
    torch.testing.assert_close(out[0][1], out[1][1], **TOL)


def test_on_policy_gradients_equal_vanilla_pg():
    """At rho = 1 (first step on fresh rollouts) clipped and cispo have pg's gradient; gspo has
    it under its own seq-mean-token-mean aggregation with sequence-level advantages."""
    d = random_batch(7, per_token_adv=False)
    d = {**d, "old": d["logp"]}
    grads = {}
    for name in POLICY_LOSSES:
        logp = leaf(d["logp"])
        make(name, "seq-mean-token-mean")(logp, experience(d))[0].backward()
        grads[name] = logp.grad
    for name in ("clipped", "gspo", "cispo"):
        torch.testing.assert_close(grads[name], grads["pg"], **TOL)


@pytest.mark.parametrize("name", [*POLICY_LOSSES, "value"])
def test_garbage_in_padding_is_ignored(name):
    d = random_batch(8)
    mask = torch.tensor(MASK, dtype=torch.bool)

    def dirty(rows, fill):
        x = torch.tensor(rows, dtype=F64)
        return torch.where(mask, x, torch.full_like(x, fill))

    results = []
    for fill in (None, float("nan")):
        logp = leaf(d["logp"]) if fill is None else dirty(d["logp"], -math.inf).requires_grad_()
        values = leaf(d["values"]) if fill is None else dirty(d["values"], fill).requires_grad_()
        pairs = [("log_probs_old", "old"), ("advantages", "adv"), ("log_probs_ref", "ref"),
                 ("values_old", "values_old"), ("returns", "returns")]  # fmt: skip
        over = {} if fill is None else {key: dirty(d[src], fill) for key, src in pairs}
        entropy = (
            torch.tensor(d["entropy"], dtype=F64) if fill is None else dirty(d["entropy"], fill)
        )
        kwargs = {} if name == "value" else {"kl_beta": 0.1, "entropy_coef": 0.01}
        loss, metrics = loss_cls(name)(**kwargs)(
            logp, experience(d, **over), entropy=entropy, values=values
        )
        loss.backward()
        grad = values.grad if name == "value" else logp.grad
        results.append((loss, grad, metrics))
    (loss0, grad0, m0), (loss1, grad1, m1) = results
    torch.testing.assert_close(loss1, loss0, **TOL)
    torch.testing.assert_close(grad1, grad0, **TOL)
    for key in m0:
        torch.testing.assert_close(m1[key], m0[key], **TOL)


# ---------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [*POLICY_LOSSES, "value"])
def test_micro_batches_accumulate_to_the_one_batch_gradient(name, mode):
    d = random_batch(9)
    exp = experience(d)
    kwargs = {} if name == "value" else {"kl_beta": 0.1, "entropy_coef": 0.01}
    fn = make(name, mode, **kwargs)
    entropy = torch.tensor(d["entropy"], dtype=F64)

    def run(rows, **totals):
        logp, values = leaf(d["logp"]), leaf(d["values"])
        index = torch.tensor(rows)
        total = 0.0
        for part in torch.tensor_split(index, [2, 3]) if totals else [index]:
            loss, _ = fn(
                logp[part], exp.select(part), entropy=entropy[part], values=values[part], **totals
            )
            total = total + loss
        total.backward()
        return total, values.grad if name == "value" else logp.grad

    one_loss, one_grad = run(list(range(B)))
    n_tokens = exp.action_mask.sum()  # a tensor, as a train loop would pass it
    acc_loss, acc_grad = run([4, 0, 2, 5, 1, 3], total_tokens=n_tokens, total_sequences=B)
    torch.testing.assert_close(acc_loss, one_loss, **TOL)
    torch.testing.assert_close(acc_grad, one_grad, **TOL)


# ---------------------------------------------------------------- gradcheck


def gradcheck_batch(kind: str) -> dict:
    """Inputs away from every clip boundary (gradcheck needs a differentiable point)."""
    g = torch.Generator().manual_seed(11)
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.1
    choices = torch.tensor({"token": [-0.7, -0.1, 0.05, 0.4], "gspo": [-1e-3, -1e-4, 1e-4, 2e-3],
                            "truncated": [1.8, 2.0]}[kind], dtype=F64)  # fmt: skip
    if kind == "token":
        log_ratio = choices[torch.randint(len(choices), (B, T), generator=g)]
    else:  # one log-ratio per sequence
        log_ratio = choices[torch.randint(len(choices), (B, 1), generator=g)].expand(B, T)
    adv = torch.randn(B, 1 if kind == "gspo" else T, generator=g, dtype=F64).expand(B, T)
    d = random_batch(12)
    return {**d, "logp": logp.tolist(), "old": (logp - log_ratio).tolist(), "adv": adv.tolist()}


@pytest.mark.parametrize(
    ("name", "kind", "kwargs"),
    [
        ("pg", "token", {}),
        ("clipped", "token", {}),
        ("clipped", "token", {"kl_beta": 0.2, "kl_estimator": "k3", "entropy_coef": 0.1}),
        ("gspo", "gspo", {"kl_beta": 0.2, "kl_estimator": "k2"}),
        # CISPO's weight is a stop-gradient, so finite differences see d(weight)/d(logp) unless
        # the weight is truncated everywhere (rho = e^1.8, e^2 > 1 + eps_high here).
        ("cispo", "truncated", {"eps_high": 1.0, "kl_beta": 0.2, "kl_estimator": "k1"}),
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_gradcheck(name, kind, kwargs, mode):
    d = gradcheck_batch(kind)
    exp = experience(d)
    fn = make(name, mode, **kwargs)

    def loss_of(logp, entropy):
        return fn(logp, exp, entropy=entropy)[0]

    inputs = (leaf(d["logp"]), leaf(d["entropy"]))
    assert torch.autograd.gradcheck(loss_of, inputs, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_value_loss(mode):
    d = random_batch(13)
    exp = experience(d)
    fn = loss_cls("value")(aggregation=mode, normalizer=7.0 if "norm" in mode else None)
    assert torch.autograd.gradcheck(
        lambda v: fn(None, exp, values=v)[0], (leaf(d["values"]),), eps=1e-6, atol=1e-8
    )


# ---------------------------------------------------------------- requirements and errors


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_kl_needs_reference_log_probs(name):
    d = random_batch()
    assert make(name).needs_reference is False
    fn = make(name, kl_beta=0.1)
    assert fn.needs_reference is True and type(fn).needs_reference is False
    with pytest.raises(
        ValueError, match=rf"{name} loss needs experience.log_probs_ref .*kl_beta=0.1"
    ):
        fn(leaf(d["logp"]), experience(d, log_probs_ref=None))
    make(name)(leaf(d["logp"]), experience(d, log_probs_ref=None))  # no KL: fine


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_entropy_bonus_needs_entropy(name):
    d = random_batch()
    with pytest.raises(ValueError, match=rf"{name} loss needs entropy .*entropy_coef=0.01"):
        make(name, entropy_coef=0.01)(leaf(d["logp"]), experience(d))


def test_value_loss_needs_values_and_targets():
    d = random_batch()
    fn = loss_cls("value")()
    assert fn.needs_values is True and not fn.needs_reference
    assert not any(LOSSES.get(n).needs_values for n in POLICY_LOSSES)
    with pytest.raises(ValueError, match="value loss needs values"):
        fn(None, experience(d))
    for field in ("values_old", "returns"):
        with pytest.raises(ValueError, match=f"value loss needs experience.{field}"):
            fn(None, experience(d, **{field: None}), values=leaf(d["values"]))


def test_shape_errors_name_the_argument():
    d = random_batch()
    fn = LOSSES.get("clipped")()
    with pytest.raises(
        ValueError,
        match=r"clipped loss: log_probs must have the action_mask shape \(B, T\) = \(6, 5\), "
        r"got \(6, 4\)",
    ):
        fn(leaf(d["logp"])[:, :4], experience(d))
    bad = experience(d, advantages=torch.zeros(6))
    with pytest.raises(ValueError, match=r"experience.advantages must have .* got \(6,\)"):
        fn(leaf(d["logp"]), bad)
    with pytest.raises(ValueError, match=r"entropy must have .* got \(5, 5\)"):
        fn(leaf(d["logp"]), experience(d), entropy=torch.zeros(5, 5))


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("pg", {"aggregation": "sum"}, "aggregation must be one of"),
        (
            "pg",
            {"aggregation": "seq-mean-token-sum-norm"},
            "normalizer must be a positive constant",
        ),
        ("pg", {"normalizer": 10.0}, "normalizer must be None with aggregation 'token-mean'"),
        ("clipped", {"kl_beta": -0.1}, "kl_beta must be a finite number >= 0"),
        ("clipped", {"kl_estimator": "k4"}, "kl_estimator must be 'k1', 'k2' or 'k3'"),
        ("gspo", {"entropy_coef": -1.0}, "entropy_coef must be a finite number >= 0"),
        ("clipped", {"eps_low": 1.5}, r"eps_low must be in \[0, 1\]"),
        ("cispo", {"eps_high": -0.1}, "eps_high must be a finite number >= 0"),
        ("value", {"eps_value": -0.2}, "eps_value must be a finite number >= 0, or None"),
    ],
)
def test_bad_settings_raise(name, kwargs, match):
    with pytest.raises(ValueError, match=f"{name} loss: {match}"):
        loss_cls(name)(**kwargs)


def test_defaults_follow_the_papers():
    assert (LOSSES.get("clipped")().eps_low, LOSSES.get("clipped")().eps_high) == (0.2, 0.2)
    gspo = LOSSES.get("gspo")()
    assert (gspo.eps_low, gspo.eps_high, gspo.aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    cispo = LOSSES.get("cispo")()
    assert (cispo.eps_low, cispo.eps_high, cispo.aggregation) == (1.0, 4.0, "token-mean")
    assert loss_cls("value")().eps_value == 0.2
    for name in POLICY_LOSSES:
        fn = loss_cls(name)()
        assert (fn.kl_beta, fn.kl_estimator, fn.entropy_coef) == (0.0, "k3", 0.0)


def test_registry_lists_names():
    assert LOSSES.names() == ["cispo", "clipped", "gspo", "pg"]
    with pytest.raises(RegistryError, match="registered: cispo, clipped, gspo, pg"):
        LOSSES.get("ppo")
    assert VALUE_LOSSES.names() == ["value"]


def test_value_and_policy_losses_are_not_interchangeable():
    with pytest.raises(ValueError, match="unknown policy loss 'value'"):
        validate_spec(LOSSES, {"name": "value"}, where="algorithm.loss")
    with pytest.raises(ValueError, match="unknown value loss 'clipped'"):
        validate_spec(VALUE_LOSSES, {"name": "clipped"}, where="algorithm.value_loss")


@pytest.mark.parametrize("name", [*POLICY_LOSSES, "value"])
def test_configurable_from_spec(name):
    registry = VALUE_LOSSES if name == "value" else LOSSES
    spec = validate_spec(registry, {"name": name}, where="loss")
    fn = build_from_spec(registry, spec)
    assert type(fn) is loss_cls(name)
    assert name != "gspo" or spec["eps_high"] == 4e-4
    with pytest.raises(ValueError, match="unknown key"):
        validate_spec(registry, {"name": name, "beta": 0.1}, where="loss")
