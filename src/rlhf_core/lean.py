"""Lean activations: a SwiGLU MLP and an RMSNorm whose backwards recompute what autograd would
save.

A gated MLP (Llama, Qwen2/3, Mistral: `down_proj(silu(gate_proj(x)) * up_proj(x))`) run by
autograd op by op saves, per position and layer, four tensors of the intermediate width I (1536
in Qwen3-0.6B, 3x the hidden width): `g = gate_proj(x)` for SiLU's backward, `silu(g)` and
`u = up_proj(x)` for the product's, and `h = silu(g) * u` for `down_proj`'s weight gradient.
`silu(g)` and `h` are one element-wise pass away from `g` and `u`, so `_SwiGLUDown` saves only
`g` and `u` and recomputes the other two in its backward: two (positions x I) tensors fewer per
layer, ~2 x 1536 of the ~13,800 floats a Qwen3-0.6B-shaped layer saves per position in fp32
(docs/performance.md), for two element-wise passes in the backward. This is what Liger-Kernel's
fused SiLU-mul does with a Triton kernel (GPU only); here it is plain PyTorch, so it runs on CPU
too, and the values and gradients are the ones autograd computes op by op (the same operations in
the same order: tested bitwise in float64, float32 and bfloat16, `tests/rlhf_core/test_lean.py`).

`apply_lean(model)` patches the `forward` of every such MLP module of a loaded model (an instance
attribute; the class and the checkpoint are untouched). The lean path runs only while the three
projections are plain bias-free `nn.Linear`s and the activation is SiLU; anything else (a LoRA or
k-bit layer wrapped around a projection later, a bias, an input whose dtype differs from the
weights', an autocast region, no grad) takes the module's own forward, so nothing changes where
the recomputation would not be exact. It is applied by
`rlhf_core.models.load_pretrained` unless `model.lean_activations: false`.

The RMSNorm of the same models (`weight * (x * rsqrt(mean(x^2) + eps))`, computed in float32)
saves, besides its input, the normalised `x * rsqrt(...)` for the weight's product; its output
is saved again by the projection that reads it. `_RMSNorm` saves the input and the (positions x
1) reciprocal root only and recomputes the normalised tensor in its backward, with autograd's own
formulas in autograd's order (bitwise equal, tested): one hidden-width tensor fewer per norm
(four norms per Qwen3 layer: two on the residual stream, `q_norm` and `k_norm` on the heads), and
in bf16 the float32 copy of the input autograd keeps as well. `apply_lean` patches those norms
too: classes whose forward is that formula (`LEAN_RMSNORM_CLASSES`; a test checks their
source).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


class _SwiGLUDown(torch.autograd.Function):
    """out = linear(silu(gate) * up, weight), saving gate and up (not silu(gate), not the
    product); the backward recomputes both. Gradients as autograd's SiluBackward, MulBackward
    and the linear's backward compute them."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        return F.linear(F.silu(gate) * up, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_weight = ctx.needs_input_grad
        silu = F.silu(gate)
        grad_gate = grad_up = grad_weight = None
        if need_weight:  # linear's weight gradient: grad_out^T @ input over all positions
            hidden = silu * up
            grad_weight = (
                grad_out.reshape(-1, grad_out.shape[-1])
                .t()
                .mm(hidden.reshape(-1, hidden.shape[-1]))
            )
        if need_gate or need_up:
            grad_hidden = grad_out.matmul(weight)  # linear's input gradient
            if need_up:
                grad_up = grad_hidden * silu
            if need_gate:
                grad_gate = torch.ops.aten.silu_backward(grad_hidden * up, gate)
        return grad_gate, grad_up, grad_weight


class _RMSNorm(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype), computed in float32 as the Llama /
    Qwen RMSNorm does; saves x and the reciprocal root, not the normalised x. The backward is
    the op-by-op graph's: PowBackward, MeanBackward, RsqrtBackward, MulBackward (twice) and the
    dtype casts, each with autograd's formula.

    x's two gradient paths (through the product and through the square) meet where autograd
    meets them: in a float32 model x *is* the float32 tensor, so the two reach x's gradient
    buffer one after the other, after the residual stream's (hence x is passed twice, one
    gradient each); otherwise they are summed in float32 and cast back, as `.to()`'s backward
    does."""

    @staticmethod
    def forward(ctx, x, x_again, weight, eps):
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        x32 = x.to(torch.float32)
        grad_x = grad_x_again = grad_weight = None
        if ctx.needs_input_grad[2]:  # y = weight * n: n's share, summed to weight's shape
            normed = (x32 * rstd).to(x.dtype)
            grad_weight = (grad_y * normed).sum_to_size(weight.shape)
        if ctx.needs_input_grad[0]:
            grad_n = (grad_y * weight).to(torch.float32)  # through the cast to x.dtype
            # n = x32 * rstd: to x32 directly, and to rstd (summed over the row)
            grad_direct = grad_n * rstd
            grad_rstd = (grad_n * x32).sum_to_size(rstd.shape)
            grad_var = -0.5 * grad_rstd * rstd.pow(3)  # rsqrt's backward
            grad_sq = grad_var.expand(x32.shape) / x32.shape[-1]  # mean's backward
            grad_pow = grad_sq * (2.0 * x32.pow(1.0))  # pow(2)'s backward
            if x.dtype == torch.float32:
                grad_x, grad_x_again = grad_direct, grad_pow
            else:
                grad_x = (grad_direct + grad_pow).to(x.dtype)
        return grad_x, grad_x_again, grad_weight, None


#: RMSNorm classes whose forward is exactly `_RMSNorm`'s formula (tests/rlhf_core/test_lean.py
#: compares their source); others (Gemma's 1 + weight, OLMo's order) keep their own forward.
LEAN_RMSNORM_CLASSES = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm",
    "Qwen3MoeRMSNorm",
})  # fmt: skip


def _exact_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The lean backward reproduces autograd's when a graph is built, the input and the weight
    share a dtype (no promotion inside the op) and no autocast region recasts the ops."""
    return (
        torch.is_grad_enabled()
        and x.dtype == weight.dtype
        and not torch.is_autocast_enabled(x.device.type)
    )


def _lean_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _exact_here(x, self.weight):
        return type(self).forward(self, x)  # nothing saved, or mixed dtypes: the module's own
    return _RMSNorm.apply(x, x, self.weight, self.variance_epsilon)


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    try:  # transformers' ACT2FN["silu"] is nn.SiLU; some versions wrap it in their own class
        from transformers.activations import SiLUActivation  # type: ignore[attr-defined]
    except ImportError:
        return False
    return isinstance(act, SiLUActivation)


def _plain_linear(module) -> bool:
    return type(module) is nn.Linear and module.bias is None


def _lean_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not (
        _plain_linear(self.gate_proj)
        and _plain_linear(self.up_proj)
        and _plain_linear(self.down_proj)
        and _is_silu(self.act_fn)
    ):
        return type(self).forward(self, x)  # wrapped since (LoRA, k-bit): the module's own
    if not _exact_here(x, self.down_proj.weight):
        return type(self).forward(self, x)  # nothing saved, or mixed dtypes: the module's own
    return _SwiGLUDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


def is_swiglu_mlp(module: nn.Module) -> bool:
    """A gated MLP module `apply_lean` can run: bias-free `nn.Linear` gate/up/down projections
    and a SiLU activation."""
    return (
        all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        and _is_silu(module.act_fn)
        and all(_plain_linear(getattr(module, n)) for n in ("gate_proj", "up_proj", "down_proj"))
    )


def apply_lean(model: nn.Module) -> int:
    """Patch every SwiGLU MLP of `model` to save 2 of its 4 intermediate-width activations, and
    every Llama/Qwen RMSNorm to save its input instead of its normalised input too (see the module
    docstring); returns how many modules were patched (0: none of either form)."""
    patched = 0
    for module in model.modules():
        if "forward" in vars(module):
            continue  # patched already
        if is_swiglu_mlp(module):
            module.forward = types.MethodType(_lean_forward, module)
            patched += 1
        elif type(module).__name__ in LEAN_RMSNORM_CLASSES and hasattr(module, "weight"):
            module.forward = types.MethodType(_lean_norm_forward, module)
            patched += 1
    return patched
