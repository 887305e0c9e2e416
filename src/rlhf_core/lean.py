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
1) reciprocal root only and recomputes the normalised tensor in its backward: one hidden-width
tensor fewer per norm (four norms per Qwen3 layer: two on the residual stream, `q_norm` and
`k_norm` on the heads), and in bf16 the float32 copy of the input autograd keeps as well. Its
backward is the closed form of the gradient, not autograd's op-by-op chain (see `_RMSNorm`): the
chain runs nine passes over the row, two of them broadcasting a (positions x 1) tensor along it,
which torch's CPU kernels do one element at a time; the closed form runs four. At a GRPO
micro-batch of the benchmarks' `real` model (32 x 40 positions, width 512, bf16) a norm's
forward + backward takes 2.2 ms instead of 7.2 ms, and GRPO's training forward + backward (two
micro-batches) 5.35 instead of 5.69 s (docs/performance.md). With float64 arithmetic the
gradients equal the formula's to 1e-12; in the norm's own float32 arithmetic (transformers' norm
computes in float32 in every model dtype) they differ from autograd's chain in the last bits, as
close to the float64 gradient as autograd's are, and a row whose mean square overflows gets NaN
(tested; see `_RMSNorm`).
`apply_lean` patches those norms too: classes whose forward is that formula
(`LEAN_RMSNORM_CLASSES`; a test checks their source). Their closed-form backward is a CPU speed
rule: where the run's speed plan says so (on CUDA, or `train.speed.lean_norms: false`),
`restore_norms` gives them back their own forward (`rlhf_core.fastpath.announce_plan`).
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
    """y = weight * (x * r).to(x.dtype) with r = rsqrt(mean(x^2, -1) + eps), computed in float32
    as the Llama / Qwen RMSNorm does; saves x and r, not the normalised x.

    The backward, with n = x r and g = (dL/dy * weight) in float32 (through the cast to x.dtype):

        dL/dweight = sum over positions of dL/dy * n.to(x.dtype)        (autograd's formula)
        dL/dx      = r * (g - n * mean(g * n, -1))

    The second is what autograd's PowBackward, MeanBackward, RsqrtBackward and two MulBackwards
    add up to (dr/dx_j = -r^3 x_j / D, and r^2 x_j = r n_j), cast back to x.dtype once. A row
    whose mean square overflowed float32 (r = 0, the forward's output zeros) gets NaN: the
    trainers' non-finite guard then skips the step and stops a diverged run. Autograd's chain
    gives NaN there only once sum(g x) overflows too (inf * 0), zeros before, and closed-form
    zeros would let a run with exploded weights go on training a dead network."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        acc = rstd.dtype  # the forward's arithmetic: float32
        normed = x.to(acc) * rstd  # a new tensor: x itself is never written
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:  # y = weight * n: n's share, summed to weight's shape
            grad_weight = (grad_y * normed.to(x.dtype)).sum_to_size(weight.shape)
        if ctx.needs_input_grad[0]:
            grad_n = (grad_y * weight).to(acc)
            mean_gn = (grad_n * normed).mean(-1, keepdim=True)
            # where mean(x^2) overflowed, r = 0 and the forward gave n = 0, not x / rms(x): no
            # gradient is right there, so NaN, which the trainers' guard reads as divergence
            scale = rstd.masked_fill(rstd == 0, float("nan"))
            grad_x = grad_n.sub_(normed.mul_(mean_gn)).mul_(scale).to(x.dtype)
        return grad_x, grad_weight, None


#: RMSNorm classes whose forward is exactly `_RMSNorm`'s formula (tests/rlhf_core/test_lean.py
#: compares their source); others (Gemma's 1 + weight, OLMo's order) keep their own forward.
LEAN_RMSNORM_CLASSES = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm",
    "Qwen3MoeRMSNorm",
})  # fmt: skip


def _exact_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The lean modules compute what the module's own forward and autograd compute (bitwise for
    the MLP, to rounding for the norm's backward) when a graph is built, the input and the weight
    share a dtype (no promotion inside the op) and no autocast region recasts the ops."""
    return (
        torch.is_grad_enabled()
        and x.dtype == weight.dtype
        and not torch.is_autocast_enabled(x.device.type)
    )


def _lean_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _exact_here(x, self.weight):
        return type(self).forward(self, x)  # nothing saved, or mixed dtypes: the module's own
    return _RMSNorm.apply(x, self.weight, self.variance_epsilon)


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


def restore_norms(model: nn.Module) -> int:
    """Give every norm `apply_lean` patched its class's forward back; returns how many."""
    restored = 0
    for module in model.modules():
        patched = vars(module).get("forward")
        if getattr(patched, "__func__", None) is _lean_norm_forward:
            del module.forward
            restored += 1
    return restored
