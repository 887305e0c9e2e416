"""rlhf_core.lean: the SwiGLU MLP that recomputes its product computes autograd's values and
gradients bitwise; the RMSNorm that recomputes its normalised input computes the module's
forward bitwise, and its closed-form backward equals the formula to 1e-12 in float64 arithmetic
and is as close to the float64 gradient as autograd's chain in the norm's float32 (or bf16)
arithmetic, with NaN where the mean square overflowed; both save what they say and step aside
where they would not apply (a wrapped projection, no grad, autocast)."""

import copy
import importlib
import inspect

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import rlhf_core.lean as lean_module
from rlhf_core.lean import LEAN_RMSNORM_CLASSES, apply_lean, is_swiglu_mlp
from rlhf_core.models import ModelConfig, load_policy


def qwen3(dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).to(dtype)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lean_mlp_matches_autograd_bitwise(dtype, monkeypatch):
    monkeypatch.setattr(lean_module, "LEAN_RMSNORM_CLASSES", frozenset())  # the MLPs alone
    plain = qwen3(dtype)
    lean = copy.deepcopy(plain)
    assert apply_lean(lean) == 2 and apply_lean(lean) == 0  # one MLP per layer, patched once
    ids = torch.randint(0, 96, (3, 11))
    loss_a, grads_a = loss_and_grads(plain, ids)
    loss_b, grads_b = loss_and_grads(lean, ids)
    assert torch.equal(loss_a, loss_b)
    for name, grad in grads_a.items():
        assert torch.equal(grad, grads_b[name]), name  # same operations in the same order


def float64_norms(model):
    """`model` with every RMSNorm computing in float64 (transformers' computes in float32 even in
    a float64 model): the reference the lean norm's rounding is measured against."""

    def forward(self, x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * (x * rstd)

    for module in model.modules():
        if type(module).__name__ in LEAN_RMSNORM_CLASSES:
            module.forward = forward.__get__(module)
    return model


def compute_eps(dtype: torch.dtype) -> float:
    """Machine epsilon of the norm's arithmetic: float32 in float32 and float64 models (the norm
    upcasts to float32, or computes there in a float64 model, as transformers' does)."""
    return torch.finfo(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32).eps


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_apply_lean_matches_autograd(dtype):
    """With the norms too: the loss bitwise (the forward is the module's); each parameter's
    gradient as close to a float64 model's (norms in float64) as autograd's own, within 1.25x of
    its error or a few units in the last place of the norm's arithmetic."""
    plain = qwen3(dtype)
    lean = copy.deepcopy(plain)
    # per layer its MLP and 4 RMSNorms (input, post-attention, q_norm, k_norm), the final norm
    assert apply_lean(lean) == 2 * 5 + 1 and apply_lean(lean) == 0  # patched once
    ids = torch.randint(0, 96, (3, 11))
    loss_a, grads_a = loss_and_grads(plain, ids)
    loss_b, grads_b = loss_and_grads(lean, ids)
    assert torch.equal(loss_a, loss_b)
    _, exact = loss_and_grads(float64_norms(qwen3(torch.float64)), ids)
    for name, grad in grads_a.items():
        scale = exact[name].abs().max().item()
        err_autograd = (grad.double() - exact[name]).abs().max().item()
        err_lean = (grads_b[name].double() - exact[name]).abs().max().item()
        assert err_lean <= 1.25 * err_autograd + 4 * compute_eps(dtype) * scale, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lean_rmsnorm_gradient_is_the_formulas(dtype):
    """One norm over rows of a wide hidden state (the shape where the closed form pays): its
    output equals the module's bitwise, and its gradients are as close to the float64 formula's
    as autograd's through the module (within 1.25x of its error or a few units in the last
    place); with float64 arithmetic (the norm's forward in float64) they equal them to 1e-12."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from rlhf_core.lean import _RMSNorm

    torch.manual_seed(0)
    norm = Qwen3RMSNorm(256, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    x64 = 3 * torch.randn(4, 9, 256, dtype=torch.float64)
    grad_y = torch.randn_like(x64)

    def grads(module, dtype, lean):
        module = copy.deepcopy(module).to(dtype)
        if lean:
            assert apply_lean(module) == 1
        x = x64.to(dtype, copy=True).requires_grad_()
        y = module(x)
        y.backward(grad_y.to(dtype))
        return y.detach(), x.grad.double(), module.weight.grad.double()

    y_plain, gx_plain, gw_plain = grads(norm, dtype, lean=False)
    y_lean, gx_lean, gw_lean = grads(norm, dtype, lean=True)
    assert torch.equal(y_plain, y_lean)
    _, gx_exact, gw_exact = grads(float64_norms(copy.deepcopy(norm)), torch.float64, lean=False)
    for lean, plain, exact in ((gx_lean, gx_plain, gx_exact), (gw_lean, gw_plain, gw_exact)):
        scale = exact.abs().max().item()
        err_plain = (plain - exact).abs().max().item()
        err_lean = (lean - exact).abs().max().item()
        assert err_lean <= 1.25 * err_plain + 4 * compute_eps(dtype) * scale
    # the backward's formula itself, in float64 arithmetic throughout
    weight = norm.weight.detach().double().requires_grad_()
    x = x64.clone().requires_grad_()

    class Float64Norm(_RMSNorm):  # the same backward, the forward's root in float64
        @staticmethod
        def forward(ctx, x, weight, eps):
            rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            ctx.save_for_backward(x, weight, rstd)
            return weight * (x * rstd)

    Float64Norm.apply(x, weight, 1e-6).backward(grad_y)
    for got, exact in ((x.grad, gx_exact), (weight.grad, gw_exact)):
        torch.testing.assert_close(got, exact, rtol=1e-12, atol=1e-12 * exact.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_rmsnorm_gives_nan_where_the_mean_square_overflowed(dtype):
    """A row whose mean square overflows float32 normalises to zeros, not x / rms(x): the
    closed form would give it a zero gradient and let a run whose weights exploded train on (an
    SFT run at lr 1e10 did, tests/test_reliability.py); it gets NaN, which the trainers' guard
    reads as divergence. The other rows keep autograd's gradients."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    norm = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    x = torch.randn(3, 64).to(dtype)
    x[1] = 1e30  # x^2 = 1e60 overflows float32: mean inf, r = 0, the normalised row 0
    grad_y = torch.randn(3, 64).to(dtype)

    def grads(lean):
        module = copy.deepcopy(norm)
        if lean:
            apply_lean(module)
        xx = x.clone().requires_grad_()
        y = module(xx)
        y.backward(grad_y)
        return y.detach(), xx.grad, module.weight.grad

    (y_plain, gx_plain, gw_plain), (y_lean, gx_lean, gw_lean) = grads(False), grads(True)
    assert torch.equal(y_plain, y_lean) and not y_lean[1].any()  # the forward: zeros, as before
    assert torch.isnan(gx_lean[1]).all()
    torch.testing.assert_close(gx_lean[[0, 2]], gx_plain[[0, 2]])
    torch.testing.assert_close(gw_lean, gw_plain)


def saved_bytes(model, ids) -> int:
    """Bytes autograd saves for the backward in one forward, parameters left out, each storage
    once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.sum()
    return sum(seen.values())


def test_apply_lean_saves_two_intermediate_tensors_per_layer_and_each_norms_output():
    plain = qwen3()
    lean = copy.deepcopy(plain)
    apply_lean(lean)
    ids = torch.randint(0, 96, (3, 11))
    saved = saved_bytes(plain, ids) - saved_bytes(lean, ids)
    # per position, fp32: silu(gate) and silu(gate) * up (intermediate 80 each) in each of 2
    # layers; each norm's normalised input: hidden 32 twice, q heads 4 x 8, k heads 2 x 8; the
    # final norm's 32
    per_position = 2 * (2 * 80 + 32 + 32 + 4 * 8 + 2 * 8) + 32
    assert saved == 3 * 11 * per_position * 4


def test_lean_rmsnorm_classes_compute_its_formula():
    """Each whitelisted class's forward is Qwen3's, the formula `_RMSNorm` implements."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def body(cls) -> str:
        return inspect.getsource(cls.forward).replace(cls.__name__, "X")

    modules = {
        "LlamaRMSNorm": "llama", "MistralRMSNorm": "mistral", "Qwen2RMSNorm": "qwen2",
        "Qwen3RMSNorm": "qwen3", "Qwen2MoeRMSNorm": "qwen2_moe", "Qwen3MoeRMSNorm": "qwen3_moe",
    }  # fmt: skip
    assert set(modules) == LEAN_RMSNORM_CLASSES
    for name, module in modules.items():
        cls = getattr(
            importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name
        )
        assert body(cls) == body(Qwen3RMSNorm), name


def test_apply_lean_steps_aside_for_a_wrapped_projection_and_without_grad():
    from peft import LoraConfig, get_peft_model

    model = qwen3()
    apply_lean(model)
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    # LoRA wraps down_proj after the patch: the module's own forward runs (the adapter counts)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["down_proj"], lora_dropout=0.0))
    mlp = peft.base_model.model.model.layers[0].mlp
    assert not is_swiglu_mlp(mlp)
    for module in peft.modules():
        if hasattr(module, "lora_B"):
            for weight in module.lora_B.values():
                torch.nn.init.normal_(weight.weight)
    out = peft(input_ids=ids).logits
    assert not torch.allclose(out, expected)  # the adapter's contribution is there
    out.sum().backward()
    assert all(p.grad is not None for n, p in peft.named_parameters() if p.requires_grad)


def test_apply_lean_steps_aside_under_autocast():
    plain = qwen3()
    lean = copy.deepcopy(plain)
    apply_lean(lean)
    ids = torch.randint(0, 96, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 activations, fp32 weights
        loss_a, grads_a = loss_and_grads(plain, ids)
        loss_b, grads_b = loss_and_grads(lean, ids)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(g, grads_b[n]) for n, g in grads_a.items())


def test_load_policy_applies_it_unless_turned_off():
    def patched(model) -> int:
        return sum("forward" in vars(m) for m in model.modules())

    on = load_policy(ModelConfig(name_or_path="tiny-qwen3"))
    off = load_policy(ModelConfig(name_or_path="tiny-qwen3", lean_activations=False))
    assert patched(on) == 5 * on.config.num_hidden_layers + 1 and patched(off) == 0
