"""Off-policy corrections (TIS, MIS, decoupled PPO) against float64 references written from their
papers, value and gradient through the policy losses; the sampler-trainer mismatch metrics; the
config errors; and, end to end on the tiny world, that recording the sampler's log-probs changes
no weight and that the mismatch they log is the one truncated sampling makes.

The references work on Python lists one token at a time with `math`, sharing no code with
`policy_gradients` or `rlhf_core`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import mismatch_gather_worker as worker
import pytest
import torch
from conftest import REPO, metric_series, tiny_pg_dict, write_yaml
from safetensors.torch import load_file

from policy_gradients.config import PGConfig
from policy_gradients.experience import Experience
from policy_gradients.losses import LOSSES
from policy_gradients.off_policy import CORRECTIONS, MismatchStats, outside_sampling_set
from policy_gradients.train import main, train
from rlhf_core.config import RunArgs
from rlhf_core.errors import run_main
from rlhf_core.generation import Sampling
from rlhf_core.models import ModelConfig, load_policy
from rlhf_core.registry import build_from_spec

F64 = torch.float64
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
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
CORRECTION_SPECS = [
    {"name": "tis", "cap": 2.0},
    {"name": "tis", "cap": 1.3},
    {"name": "mis", "level": "token", "low": 0.5, "high": 2.0},
    {"name": "mis", "level": "token", "low": 0.5, "high": 5.0},  # a wider band
    {"name": "mis", "level": "sequence", "low": 0.5, "high": 2.0},
    {"name": "decoupled", "cap": None},
    {"name": "decoupled", "cap": 1.5},
]


def batch(seed: int = 0) -> dict[str, list[list[float]]]:
    """Lists: current log-probs, pi_old (proximal), mu (behaviour), advantages. The behaviour
    ratios pi_old / mu spread over about [0.3, 3], the current ratios past 1 +- 0.2."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    old = logp - torch.randn(B, T, generator=g, dtype=F64) * 0.3
    behaviour = old - torch.randn(B, T, generator=g, dtype=F64) * 0.6
    adv = torch.randn(B, T, generator=g, dtype=F64)
    return {"logp": logp.tolist(), "old": old.tolist(), "mu": behaviour.tolist(),
            "adv": adv.tolist()}  # fmt: skip


def inputs(d: dict, **overrides) -> Experience:
    """A real `Experience` from the lists in `d` (sequence ids are dummies)."""
    fields = {
        "sequence_ids": torch.zeros(B, 3 + T, dtype=torch.long),
        "attention_mask": torch.ones(B, 3 + T, dtype=torch.long),
        "action_mask": torch.tensor(MASK, dtype=torch.bool),
        "advantages": torch.tensor(d["adv"], dtype=F64),
        "log_probs_old": torch.tensor(d["old"], dtype=F64),
        "log_probs_behaviour": torch.tensor(d["mu"], dtype=F64),
    }
    return Experience(**{**fields, **overrides})


# ---------------------------------------------------------------- float64 references


def weight_ref(spec: dict, d: dict, i: int, t: int) -> tuple[float, bool]:
    """(w_t, whether the correction cut or dropped rho) from the papers' formulas."""
    rho = math.exp(d["old"][i][t] - d["mu"][i][t])
    name = spec["name"]
    if name == "tis":  # Yao et al. 2025: min(rho, C)
        return min(rho, spec["cap"]), rho > spec["cap"]
    if name == "mis":  # rho 1[low <= rho <= high], rho per token or the sequence's product
        if spec["level"] == "sequence":
            rho = math.prod(
                math.exp(d["old"][i][s] - d["mu"][i][s]) for s in range(T) if MASK[i][s]
            )
        keep = spec["low"] <= rho <= spec["high"]
        return (rho if keep else 0.0), not keep
    # decoupled PPO (Hilton et al. 2021): pi_prox / mu; AReaL's cap drops the tokens above it
    if spec["cap"] is not None and rho > spec["cap"]:
        return 0.0, True
    return rho, False


def policy_ref(loss: str, d: dict, i: int, t: int) -> tuple[float, float]:
    """(per-token policy term, its derivative in logp_t): PPO's clipped surrogate (eps 0.2) with
    r = pi_theta / pi_old, or REINFORCE's -A logp."""
    lp, a = d["logp"][i][t], d["adv"][i][t]
    if loss == "pg":
        return -a * lp, -a
    r = math.exp(lp - d["old"][i][t])
    clipped = min(max(r, 0.8), 1.2)
    binds = (r < 0.8 and a < 0) or (r > 1.2 and a > 0)
    return -min(r * a, clipped * a), (0.0 if binds else -r * a)


def aggregation_ref(mode: str) -> list[list[float]]:
    """d(aggregate)/d(loss_t): the three aggregation modes written out (normaliser 7)."""
    n_tokens = sum(map(sum, MASK))
    out = []
    for row in MASK:
        n = sum(row)
        if mode == "token-mean":
            w = 1 / n_tokens
        elif mode == "seq-mean-token-mean":
            w = 1 / (B * n) if n else 0.0
        else:
            w = 1 / (B * 7.0)
        out.append([w if m else 0.0 for m in row])
    return out


def corrected_loss_ref(spec: dict, loss: str, d: dict, mode: str):
    agg = aggregation_ref(mode)
    value, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if MASK[i][t]:
                w = weight_ref(spec, d, i, t)[0]
                term, dterm = policy_ref(loss, d, i, t)
                value += agg[i][t] * w * term
                grad[i][t] = agg[i][t] * w * dterm
    return value, grad


def make_loss(loss: str, mode: str):
    kwargs = {} if loss == "pg" else {"eps_low": 0.2, "eps_high": 0.2}
    normalizer = 7.0 if mode == "seq-mean-token-sum-norm" else None
    return LOSSES.get(loss)(aggregation=mode, normalizer=normalizer, **kwargs)


# ---------------------------------------------------------------- reference values


@pytest.mark.parametrize("spec", CORRECTION_SPECS, ids=str)
def test_weights_and_metrics_match_reference(spec):
    d = batch()
    weights, metrics = build_from_spec(CORRECTIONS, spec)(inputs(d))
    expected = [[weight_ref(spec, d, i, t)[0] if MASK[i][t] else 0.0 for t in range(T)]
                for i in range(B)]  # fmt: skip
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)
    assert not weights.requires_grad
    tokens = [(i, t) for i in range(B) for t in range(T) if MASK[i][t]]
    changed = [weight_ref(spec, d, i, t)[1] for i, t in tokens]
    assert metrics["weight_mean"].item() == pytest.approx(
        sum(expected[i][t] for i, t in tokens) / len(tokens), rel=1e-12
    )
    key = "truncated_fraction" if spec["name"] == "tis" else "masked_fraction"
    assert metrics[key].item() == pytest.approx(sum(changed) / len(tokens), rel=1e-12)
    # the data reaches both sides of every bound (an uncapped decoupled weight changes nothing)
    if spec.get("cap", 0) is not None:
        assert 0 < sum(changed) < len(tokens), changed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", ["clipped", "pg"])
@pytest.mark.parametrize("spec", CORRECTION_SPECS, ids=str)
def test_corrected_loss_and_gradient_match_reference(spec, loss, mode):
    d = batch(seed=1)
    logp = torch.tensor(d["logp"], dtype=F64, requires_grad=True)
    x = inputs(d)
    weights, _ = build_from_spec(CORRECTIONS, spec)(x)
    value, _ = make_loss(loss, mode)(logp, x, importance_weights=weights)
    value.backward()
    exp_value, exp_grad = corrected_loss_ref(spec, loss, d, mode)
    assert value.item() == pytest.approx(exp_value, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(exp_grad, dtype=F64), rtol=1e-10,
                               atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("spec", CORRECTION_SPECS[::2], ids=str)
def test_gradcheck_through_the_corrected_loss(spec):
    d = batch(seed=2)
    x = inputs(d)
    weights, _ = build_from_spec(CORRECTIONS, spec)(x)
    loss = make_loss("clipped", "seq-mean-token-mean")
    logp = torch.tensor(d["logp"], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda lp: loss(lp, x, importance_weights=weights)[0], (logp,))


@pytest.mark.parametrize("spec", CORRECTION_SPECS, ids=str)
def test_no_mismatch_leaves_the_loss_bitwise_unchanged(spec):
    """mu = pi_old: every weight is exactly 1 and the corrected loss and gradient are the
    uncorrected ones, bit for bit."""
    d = batch(seed=3)
    d["mu"] = d["old"]
    x = inputs(d)
    weights, _ = build_from_spec(CORRECTIONS, spec)(x)
    assert torch.equal(weights, torch.tensor(MASK, dtype=F64))
    results = []
    for w in (None, weights):
        logp = torch.tensor(d["logp"], dtype=F64, requires_grad=True)
        value, _ = make_loss("clipped", "token-mean")(logp, x, importance_weights=w)
        value.backward()
        results.append((value, logp.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_garbage_in_padding_is_ignored():
    d = batch(seed=4)
    clean = inputs(d)
    mask = clean.action_mask
    dirty = inputs(d, log_probs_behaviour=clean.log_probs_behaviour.masked_fill(~mask, math.inf),
                   log_probs_old=clean.log_probs_old.masked_fill(~mask, math.nan))  # fmt: skip
    for spec in CORRECTION_SPECS:
        correction = build_from_spec(CORRECTIONS, spec)
        assert torch.equal(correction(clean)[0], correction(dirty)[0])


def test_correction_without_behaviour_logprobs_names_the_field():
    d = batch()
    with pytest.raises(ValueError, match="experience.log_probs_behaviour"):
        CORRECTIONS.get("tis")()(inputs(d, log_probs_behaviour=None))
    with pytest.raises(ValueError, match="experience.log_probs_old"):
        CORRECTIONS.get("mis")()(inputs(d, log_probs_old=torch.zeros(B, T + 1, dtype=F64)))


def test_defaults_follow_the_papers():
    assert CORRECTIONS.get("tis")().cap == 2.0  # Yao et al.: C = 2
    mis = CORRECTIONS.get("mis")()
    assert (mis.level, mis.low, mis.high) == ("token", 0.5, 2.0)
    assert CORRECTIONS.get("decoupled")().cap is None  # Hilton et al.: no cap


# ---------------------------------------------------------------- mismatch metrics


def test_mismatch_metrics_match_reference():
    g = torch.Generator().manual_seed(5)
    stats, rhos, outside = MismatchStats(), [], []
    for rows in (3, 4):  # two micro-batches
        mask = torch.rand(rows, 7, generator=g) > 0.3
        old = -torch.rand(rows, 7, generator=g, dtype=F64) * 2
        mu = old + torch.randn(rows, 7, generator=g, dtype=F64) * 0.2
        flags = (torch.rand(rows, 7, generator=g) > 0.8).float()
        flags[0] = math.nan  # a row left unmeasured
        x = Experience(
            sequence_ids=torch.zeros(rows, 9, dtype=torch.long), attention_mask=torch.ones(rows, 9),
            action_mask=mask, log_probs_old=old, advantages=torch.zeros(rows, 7),
            log_probs_behaviour=mu.float(), outside_sampling_set=flags,
        )  # fmt: skip
        stats.add(x)
        for i in range(rows):
            for t in range(7):
                if mask[i, t]:
                    rhos.append(math.exp(float(old[i, t]) - float(mu.float()[i, t])))
                    if not math.isnan(flags[i, t]):
                        outside.append(float(flags[i, t]))
    m = stats.metrics()
    assert m["mismatch/k3"] == pytest.approx(
        sum(r - 1 - math.log(r) for r in rhos) / len(rhos), rel=1e-9
    )
    assert m["mismatch/ratio_max"] == pytest.approx(max(rhos), rel=1e-12)
    nearest_rank = sorted(rhos)[math.ceil(0.99 * len(rhos)) - 1]
    assert m["mismatch/ratio_p99"] == pytest.approx(nearest_rank, rel=1e-12)
    assert m["mismatch/outside_truncation"] == pytest.approx(sum(outside) / len(outside))
    assert MismatchStats().metrics() == {}


def test_mismatch_metrics_pool_every_process(tmp_path):
    """Two processes (torch.distributed, gloo), each with its own tokens: both report the
    metrics of all tokens together, those of one process holding them all."""
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
         "127.0.0.1", "--master_port", str(port), worker.__file__, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    pooled, alone = MismatchStats(), MismatchStats()
    for rank in (0, 1):
        for x in worker.experiences(rank):
            pooled.add(x)
            if rank == 0:
                alone.add(x)
    assert ranks[0] == ranks[1] == pooled.metrics()
    assert all(alone.metrics()[k] != v for k, v in pooled.metrics().items())  # it can tell


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("correction", "field"),
    [({"name": "tis", "cap": 0.5}, "algorithm.correction.cap"),
     ({"name": "tis", "cap": -1}, "algorithm.correction.cap"),
     ({"name": "mis", "low": 0.9, "high": 0.95}, "algorithm.correction.high"),
     ({"name": "mis", "low": 1.5}, "algorithm.correction.low"),
     ({"name": "mis", "level": "step"}, "algorithm.correction"),
     ({"name": "decoupled", "cap": 0}, "algorithm.correction.cap"),
     ({"name": "iwpo"}, "algorithm.correction")],
)  # fmt: skip
def test_bad_correction_is_a_config_error_naming_the_field(tmp_path, capsys, correction, field):
    data = tiny_pg_dict("tiny-qwen3", **grpo(correction))
    path = write_yaml(tmp_path / "c.yaml", data)
    assert run_main(main, ["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"'{field}" in err or f"{field}:" in err, err
    assert "Traceback" not in err


def test_correction_without_behaviour_logprobs_is_a_config_error(tmp_path, capsys):
    data = tiny_pg_dict("tiny-qwen3", **grpo({"name": "tis"}))
    data["rollout"]["behaviour_logprobs"] = False
    path = write_yaml(tmp_path / "c.yaml", data)
    assert run_main(main, ["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.correction 'tis'" in err and "rollout.behaviour_logprobs" in err, err
    data["algorithm"]["correction"] = None  # without a correction the switch is fine
    assert PGConfig.model_validate(data).rollout.behaviour_logprobs is False


# ---------------------------------------------------------------- end to end


def grpo(correction: dict | None = None) -> dict:
    return {
        "name": "grpo", "advantage": {"name": "grpo"},
        "loss": {"name": "clipped", "aggregation": "seq-mean-token-mean"},
        "ppo_epochs": 2, "correction": correction,
    }  # fmt: skip


def run(tmp_path, name: str, correction=None, **rollout) -> dict[str, torch.Tensor]:
    data = tiny_pg_dict("tiny-qwen3", **grpo(correction))
    data["data"]["eval"] = None
    data["rollout"].update(rollout)
    out = tmp_path / name
    assert train(PGConfig.model_validate(data), RunArgs(Path("t.yaml"), output_dir=out)) == 0
    return load_file(out / "final" / "model.safetensors")


def test_recording_behaviour_logprobs_changes_no_weight(tmp_path):
    """With top-p sampling (the sampler's log-probs recorded, the extra forward that finds the
    tokens outside the trainer's top-p set, the mismatch metrics) and without any of it: the
    same final weights, bit for bit."""
    on = run(tmp_path, "on", top_p=0.9)
    off = run(tmp_path, "off", top_p=0.9, behaviour_logprobs=False)
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)
    assert len(metric_series(tmp_path / "on", "train/mismatch/outside_truncation")) == 2
    assert metric_series(tmp_path / "off", "train/mismatch/k3") == {}


def test_mismatch_metrics_end_to_end(tmp_path):
    """No truncation: sampler and trainer agree up to float rounding (KV cache vs one forward).
    Top-p 0.8: the sampler renormalises the kept mass, so mu > pi_old on every token: rho < 1,
    and k3 = rho - 1 - log rho clearly above 0; TIS then weighs tokens below 1 and the weights
    differ from the uncorrected run's."""
    run(tmp_path, "plain")
    k3 = metric_series(tmp_path / "plain", "train/mismatch/k3")
    top = metric_series(tmp_path / "plain", "train/mismatch/ratio_max")
    assert len(k3) == 2 and all(v < 1e-8 for v in k3.values()), k3
    assert all(abs(v - 1) < 1e-3 for v in top.values()), top
    assert metric_series(tmp_path / "plain", "train/mismatch/outside_truncation") == {}

    uncorrected = run(tmp_path, "top_p", top_p=0.8)
    corrected = run(tmp_path, "tis", {"name": "tis", "cap": 2.0}, top_p=0.8)
    assert any(not torch.equal(uncorrected[k], corrected[k]) for k in corrected)
    series = {key: metric_series(tmp_path / "tis", f"train/{key}") for key in (
        "mismatch/k3", "mismatch/ratio_max", "mismatch/ratio_p99", "mismatch/outside_truncation",
        "loss/correction/weight_mean", "loss/correction/truncated_fraction",
    )}  # fmt: skip
    assert all(len(v) == 2 for v in series.values()), series
    assert all(v > 1e-3 for v in series["mismatch/k3"].values()), series
    assert all(v <= 1 + 1e-3 for v in series["mismatch/ratio_max"].values()), series
    assert all(v < 1 for v in series["loss/correction/weight_mean"].values()), series
    assert all(v == 0 for v in series["loss/correction/truncated_fraction"].values()), series
    assert all(0 <= v < 0.05 for v in series["mismatch/outside_truncation"].values()), series


def test_outside_sampling_set_matches_the_trainers_top_p_set():
    """Completion tokens drawn uniformly (not from the model): the flags equal a reference that
    warps one plain forward's logits with its own top-p (a token is kept when the mass of the
    tokens above it is < top_p)."""
    torch.manual_seed(0)
    model = load_policy(ModelConfig(name_or_path="tiny-qwen3")).train()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (5, 4 + 6), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # a left-padded prompt
    action = torch.ones(5, 6, dtype=torch.long)
    action[1, 3:] = 0
    sampling = Sampling(temperature=0.8, top_p=0.5)
    flags = outside_sampling_set(model, ids, attn, 4, action, sampling, rows=5)
    assert model.training  # its mode is restored
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits
    expected = torch.full((5, 6), math.nan)  # NaN: not measured (padding)
    for i in range(5):
        for t in range(6):
            if action[i, t]:
                p = (logits[i, 4 + t - 1].double() / 0.8).softmax(-1)
                token = int(ids[i, 4 + t])
                expected[i, t] = float(p[p > p[token]].sum() >= 0.5)
    torch.testing.assert_close(flags, expected, equal_nan=True, rtol=0, atol=0)
    assert 0 < int(expected.nan_to_num().sum()) < int(action.sum())  # both kinds occur
    # at most 2 rows measured, spread over the batch: rows 0 and 3; the others NaN
    some = outside_sampling_set(model, ids, attn, 4, action, sampling, rows=2)
    torch.testing.assert_close(some[[0, 3]], expected[[0, 3]], equal_nan=True, rtol=0, atol=0)
    assert some[[1, 2, 4]].isnan().all()
