"""Lean activations: a SwiGLU MLP whose backward recomputes its product instead of saving it.

A gated MLP (Llama, Qwen2/3, Mistral: `down_proj(silu(gate_proj(x)) * up_proj(x))`) run by
autograd op by op saves, per position and layer, four tensors of the intermediate width I (1536
in Qwen3-0.6B, 3x the hidden width): `g = gate_proj(x)` for SiLU's backward, `silu(g)` and
`u = up_proj(x)` for the product's, and `h = silu(g) * u` for `down_proj`'s weight gradient.
`silu(g)` and `h` are one element-wise pass away from `g` and `u`, so `_SwiGLUDown` saves only
`g` and `u` and recomputes the other two in its backward: two (positions x I) tensors fewer per
layer, about 40% of a Qwen3 layer's saved activations in fp32 (measured in docs/performance.md),
for two element-wise passes in the backward. This is what Liger-Kernel's fused SiLU-mul does with
a Triton kernel (GPU only); here it is plain PyTorch, so it runs on CPU too, and the values and
gradients are the ones autograd computes op by op (the same operations in the same order: tested
bitwise in float64 and float32, `tests/rlhf_core/test_lean.py`).

`lean_mlp(model)` patches the `forward` of every such MLP module of a loaded model (an instance
attribute; the class and the checkpoint are untouched). The lean path runs only while the three
projections are plain bias-free `nn.Linear`s and the activation is SiLU; anything else (a LoRA or
k-bit layer wrapped around a projection later, a bias) takes the module's own forward, so
nothing changes where the recomputation would not be exact. It is applied by
`rlhf_core.models.load_pretrained` unless `model.lean_mlp: false`.
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
    if not torch.is_grad_enabled():
        return type(self).forward(self, x)  # nothing is saved without a graph
    return _SwiGLUDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


def is_swiglu_mlp(module: nn.Module) -> bool:
    """A gated MLP module `lean_mlp` can run: gate/up/down projections, a SiLU activation, and
    a forward of its own class (not already patched)."""
    return (
        all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        and _is_silu(module.act_fn)
        and all(_plain_linear(getattr(module, n)) for n in ("gate_proj", "up_proj", "down_proj"))
    )


def lean_mlp(model: nn.Module) -> int:
    """Patch every SwiGLU MLP of `model` to save 2 of its 4 intermediate-width activations (see
    the module docstring); returns how many modules were patched (0: none of this form)."""
    patched = 0
    for module in model.modules():
        if is_swiglu_mlp(module) and "forward" not in vars(module):
            module.forward = types.MethodType(_lean_forward, module)
            patched += 1
    return patched
