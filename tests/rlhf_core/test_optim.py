"""AdamW parameter groups and the learning-rate schedule (rlhf_core.optim)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from rlhf_core.optim import (
    OptimConfig,
    build_optimizer,
    build_scheduler,
    lr_factor,
    maybe_embedding_grad_buffer,
)

# ----------------------------------------------------------------------------- lr_factor


def cfg(**kwargs) -> OptimConfig:
    return OptimConfig(lr=1.0, **kwargs)


def test_warmup_is_linear_and_never_zero():
    c = cfg(warmup_steps=4, schedule="cosine")
    # step k (0-based) of the warmup trains at (k + 1) / warmup of the peak
    assert [lr_factor(k, c, 14) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_no_warmup_starts_at_the_peak(schedule):
    assert lr_factor(0, cfg(schedule=schedule, min_lr_ratio=0.1), 10) == 1.0


@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
def test_cosine_values(min_lr_ratio):
    c = cfg(warmup_steps=4, schedule="cosine", min_lr_ratio=min_lr_ratio)
    total = 14  # 10 decay steps after the warmup

    def expected(shape: float) -> float:
        return min_lr_ratio + (1 - min_lr_ratio) * shape

    assert lr_factor(4, c, total) == pytest.approx(1.0)  # first step after the warmup: the peak
    assert lr_factor(9, c, total) == pytest.approx(expected(0.5))  # half way: half the range
    quarter = 0.5 * (1 + math.cos(math.pi * 0.2))  # 2 of 10 decay steps
    assert lr_factor(6, c, total) == pytest.approx(expected(quarter))
    assert lr_factor(14, c, total) == pytest.approx(min_lr_ratio)  # the end: the floor
    assert lr_factor(100, c, total) == pytest.approx(min_lr_ratio)  # past the end: stays there
    values = [lr_factor(k, c, total) for k in range(4, 15)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
def test_linear_values(min_lr_ratio):
    c = cfg(warmup_steps=2, schedule="linear", min_lr_ratio=min_lr_ratio)
    total = 12  # 10 decay steps after the warmup
    for step, shape in [(2, 1.0), (4, 0.8), (7, 0.5), (11, 0.1), (12, 0.0), (50, 0.0)]:
        want = min_lr_ratio + (1 - min_lr_ratio) * shape
        assert lr_factor(step, c, total) == pytest.approx(want), step


def test_constant_ignores_min_lr_ratio():
    c = cfg(warmup_steps=2, schedule="constant", min_lr_ratio=0.3)
    assert [lr_factor(k, c, 10) for k in range(6)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert lr_factor(1000, c, 10) == 1.0


def test_scheduler_sets_optimizer_lr():
    c = OptimConfig(lr=2e-3, warmup_steps=3, schedule="cosine", min_lr_ratio=0.1)
    model = nn.Linear(2, 2)
    optimizer = build_optimizer(model, c)
    scheduler = build_scheduler(optimizer, c, total_steps=8)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2e-3 * lr_factor(k, c, 8) for k in range(10)])
    assert seen[0] == pytest.approx(2e-3 / 3)  # the first step already trains
    assert seen[-1] == pytest.approx(2e-4)
    # both parameter groups follow the same schedule
    assert optimizer.param_groups[1]["lr"] == optimizer.param_groups[0]["lr"]


# ----------------------------------------------------------------------------- build_optimizer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.linear = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def test_one_dimensional_params_get_no_weight_decay():
    model = Block()
    optimizer = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    decay, no_decay = optimizer.param_groups
    ids = {id(p) for p in decay["params"]}
    assert ids == {id(model.embed.weight), id(model.linear.weight)}
    no_ids = {id(p) for p in no_decay["params"]}
    assert no_ids == {id(model.linear.bias), id(model.norm.weight), id(model.norm.bias)}
    assert decay["weight_decay"] == 0.5 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in no_decay["params"])


def test_weight_decay_acts_on_matrices_only():
    """With zero gradients AdamW only decays: w <- w (1 - lr wd) for matrices, 1-D params stay."""
    model = Block()
    optimizer = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    after = dict(model.named_parameters())
    for name in ("embed.weight", "linear.weight"):
        torch.testing.assert_close(after[name].detach(), before[name] * (1 - 0.1 * 0.5))
    for name in ("linear.bias", "norm.weight", "norm.bias", "frozen.weight", "frozen.bias"):
        assert torch.equal(after[name].detach(), before[name]), name


# peft's get_peft_model reads transformers' deprecated `is_gradient_checkpointing`
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_model_optimizes_only_the_adapter():
    from rlhf_core.models import ModelConfig, load_policy

    model = load_policy(
        ModelConfig(name_or_path="tiny-qwen3", dtype="fp32", lora={"r": 4, "alpha": 8})
    )
    optimizer = build_optimizer(model, OptimConfig())
    in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert in_groups == trainable
    assert 0 < len(trainable) < len(list(model.parameters()))


def test_no_trainable_parameters_is_an_error():
    model = Block().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model, OptimConfig())


# ----------------------------------------------------------------------------- embedding grad


def tiny_lm(tied: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def train_steps(model: nn.Module, buffered: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three AdamW steps of two accumulated micro-batches each, with clipping; returns the
    embedding gradient of every step (before clipping) and the final parameters."""
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    buffer = maybe_embedding_grad_buffer(model, enabled=buffered, processes=1)
    assert (buffer is not None) == buffered
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(3):
        for _ in range(2):  # a batch uses a few rows of the 500, some twice
            ids = torch.randint(0, 60, (3, 9), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append(model.get_input_embeddings().weight.grad.clone())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if buffer is not None:
            buffer.reset()
            # reset zeroed exactly the rows the step wrote: the whole buffer is zero again
            assert torch.count_nonzero(buffer.buffer) == 0
            assert model.get_input_embeddings().weight.grad is buffer.buffer
    return grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_grad_buffer_trains_as_the_dense_gradient(tied):
    # untied: only sparse row updates arrive; tied: the output head's dense gradient too
    dense_grads, dense_params = train_steps(tiny_lm(tied), buffered=False)
    sparse_grads, sparse_params = train_steps(tiny_lm(tied), buffered=True)
    for a, b in zip(dense_grads, sparse_grads, strict=True):
        assert not b.is_sparse and (a != 0).any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(dense_params, sparse_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_embedding_grad_buffer_applies_only_where_it_can():
    model = tiny_lm(False)
    assert maybe_embedding_grad_buffer(model, enabled=False, processes=1) is None
    # two processes: the DDP wrapper owns gradient reduction
    assert maybe_embedding_grad_buffer(model, enabled=None, processes=2) is None
    with pytest.raises(ValueError, match="2 processes"):
        maybe_embedding_grad_buffer(model, enabled=True, processes=2)
    model.get_input_embeddings().weight.requires_grad_(False)
    assert maybe_embedding_grad_buffer(model, enabled=None, processes=1) is None
    with pytest.raises(ValueError, match="frozen"):
        maybe_embedding_grad_buffer(model, enabled=True, processes=1)
    assert maybe_embedding_grad_buffer(nn.Linear(2, 2), enabled=None, processes=1) is None


# ----------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("max_norm", [1e-3, 1e3, float("nan")])
def test_clip_grad_norm_equals_torchs(max_norm):
    from accelerate import Accelerator

    from rlhf_core.loop import clip_grad_norm

    accelerator = Accelerator(cpu=True)
    models = [tiny_lm(False) for _ in range(2)]
    ids = torch.arange(20).view(2, 10)
    for model in models:
        model(input_ids=ids, labels=ids).loss.backward()
    nan_grad = max_norm != max_norm
    if nan_grad:  # a NaN gradient: the same NaN norm; we leave the gradients (the step is skipped)
        max_norm = 1.0
        for model in models:
            next(model.parameters()).grad[0, 0] = float("nan")
    before = [p.grad.clone() for p in models[0].parameters()]
    ours = clip_grad_norm(accelerator, models[0], max_norm)
    theirs = torch.nn.utils.clip_grad_norm_(models[1].parameters(), max_norm)
    assert ours == float(theirs) or (ours != ours and theirs != theirs)
    for a, b, a0 in zip(models[0].parameters(), models[1].parameters(), before, strict=True):
        if nan_grad:
            assert torch.equal(a.grad.nan_to_num(7.0), a0.nan_to_num(7.0))  # untouched
        else:
            assert torch.equal(a.grad, b.grad)


# ----------------------------------------------------------------------------- master weights


def bf16_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.to(torch.bfloat16)


def grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    """A fixed gradient per step, the same for every run (bf16, as a bf16 backward leaves it)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in model.parameters()]


def run_steps(model, optimizer, steps: range) -> None:
    for step in steps:
        for p, g in zip(model.parameters(), grads(model, step), strict=True):
            p.grad = g.clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_bf16_weights_train_at_a_small_lr_only_through_fp32_masters():
    """At lr 1e-6 the update is far below a bf16 weight's spacing: plain AdamW on bf16 weights
    leaves almost all of them as they were. MasterWeightAdamW's masters equal fp32 AdamW run on
    fp32 copies with the same gradients, exactly, and the bf16 weights are those masters
    rounded."""
    from rlhf_core.optim import MasterWeightAdamW

    c = OptimConfig(lr=1e-6, weight_decay=0.1)
    start = bf16_model()
    plain, mixed = bf16_model(), bf16_model()
    plain_opt = build_optimizer(plain, c.model_copy(update={"master_weights": False}))
    mixed_opt = build_optimizer(mixed, c)  # auto: bf16 parameters
    assert type(plain_opt) is torch.optim.AdamW and type(mixed_opt) is MasterWeightAdamW
    reference = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    reference.load_state_dict({k: v.float() for k, v in start.state_dict().items()})
    ref_opt = build_optimizer(reference, c)
    assert type(ref_opt) is torch.optim.AdamW  # fp32 parameters: the plain optimizer
    run_steps(plain, plain_opt, range(20))
    run_steps(mixed, mixed_opt, range(20))
    for step in range(20):  # fp32 AdamW on the same (bf16-valued) gradients
        for p, g in zip(reference.parameters(), grads(start, step), strict=True):
            p.grad = g.float()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    moved = [(a != b).float().mean().item() for a, b in
             zip(plain.parameters(), start.parameters(), strict=True)]  # fmt: skip
    assert max(moved) < 0.05, moved  # rounded away
    for p, r in zip(mixed.parameters(), reference.parameters(), strict=True):
        master = mixed_opt.state[p]["master"]
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(master, r.detach()) and torch.equal(p.detach(), r.detach().bfloat16())
        assert mixed_opt.state[p]["exp_avg"].dtype == torch.float32
    total = sum((r.detach() - s.float()).abs().sum() for r, s in
                zip(reference.parameters(), start.parameters(), strict=True))  # fmt: skip
    assert total > 0


def test_master_weights_resume_exactly_from_the_optimizer_state():
    """The masters are in the optimizer's state_dict: a fresh bf16 model with the saved (rounded)
    weights and the loaded state continues exactly as the uninterrupted run, though the weights
    alone could not give back the masters."""
    c = OptimConfig(lr=1e-5)
    whole = bf16_model()
    whole_opt = build_optimizer(whole, c)
    run_steps(whole, whole_opt, range(12))
    first = bf16_model()
    first_opt = build_optimizer(first, c)
    run_steps(first, first_opt, range(5))
    saved = {"model": first.state_dict(), "optimizer": first_opt.state_dict()}
    saved = torch.load(_roundtrip(saved), weights_only=True)
    resumed = bf16_model(seed=1)
    resumed.load_state_dict(saved["model"])
    resumed_opt = build_optimizer(resumed, c)
    resumed_opt.load_state_dict(saved["optimizer"])
    state = resumed_opt.state[next(resumed.parameters())]
    assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
    assert not torch.equal(state["master"], next(resumed.parameters()).float())  # not the weights
    run_steps(resumed, resumed_opt, range(5, 12))
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(whole_opt.state[a]["master"], resumed_opt.state[b]["master"])


def _roundtrip(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_master_weights_settings():
    model = bf16_model()
    assert type(build_optimizer(model, OptimConfig(), sharded=True)) is torch.optim.AdamW
    from rlhf_core.errors import UserError

    with pytest.raises(UserError, match="fsdp2.*mixed_precision"):
        build_optimizer(model, OptimConfig(master_weights=True), sharded=True)
    fp32 = nn.Linear(4, 4)
    assert type(build_optimizer(fp32, OptimConfig(master_weights=True))).__name__ == (
        "MasterWeightAdamW"
    )
