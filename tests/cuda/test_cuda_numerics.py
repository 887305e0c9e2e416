"""On CUDA in float32 our log-prob paths and losses give what the CPU gives in float64, on the
tiny world's Qwen3 (`tiny-qwen3`): padded and packed batches (`rlhf_core.sequences.
sequence_logprobs`) with their gradients, the fused completion-only LM head
(`causal_lm_selected_logprobs`) against the full head, the DPO loss and the GRPO (clipped,
seq-mean-token-mean, k3 KL) loss with their gradients.

Tolerances: TF32 is off in these tests (torch's default for matmuls), so what is left is float32
rounding, Qwen3's RMSNorm computing in float32 in both (absolute 1e-4 on log-probs and losses,
1e-3 relative on a parameter tensor's gradient)."""

from __future__ import annotations

import pytest
import torch
from cuda_world import DEVICE, needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]


@pytest.fixture(scope="module")
def models():
    from rlhf_core.models import ModelConfig, load_policy

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cpu = load_policy(ModelConfig(name_or_path="tiny-qwen3", dtype="fp32"), "cpu")
    cpu = cpu.double().train()
    gpu = load_policy(ModelConfig(name_or_path="tiny-qwen3", dtype="fp32"), DEVICE)
    gpu.load_state_dict({k: v.float() for k, v in cpu.state_dict().items()})
    return cpu, gpu.train()


def grads_of(model) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None
    }


def assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and want
    for name, g in got.items():
        relative = (g - want[name]).norm() / want[name].norm().clamp_min(1e-30)
        assert relative <= 1e-3, (name, float(relative))


def sft_examples():
    from instruction_tuning.data import SFTExample

    g = torch.Generator().manual_seed(1)
    lengths = [(4, 9), (2, 3), (7, 1), (1, 5), (3, 3)]
    return [
        SFTExample(torch.randint(6, 100, (p,), generator=g).tolist(),
                   torch.randint(6, 100, (c,), generator=g).tolist(), "", "")
        for p, c in lengths
    ]  # fmt: skip


def sft_loss_and_grads(model, batch, device):
    from instruction_tuning.losses import CompletionNLLLoss
    from rlhf_core.sequences import sequence_logprobs

    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    model.zero_grad(set_to_none=True)
    logps = sequence_logprobs(model, batch)
    loss, _ = CompletionNLLLoss()(logps, batch["loss_mask"], 21.0)
    loss.backward()
    return float(loss), grads_of(model)


def test_packed_and_padded_logprobs_on_cuda_equal_the_cpu_in_float64(models):
    from instruction_tuning.data import collate, pack

    cpu, gpu = models
    examples = sft_examples()
    want_loss, want_grads = sft_loss_and_grads(cpu, collate(examples, 0), "cpu")
    for batch in (collate(examples, 0), pack(examples, 0), pack(examples, 0, flat=True)):
        loss, grads = sft_loss_and_grads(gpu, batch, DEVICE)
        assert abs(loss - want_loss) <= 1e-4, (loss, want_loss)
        assert_grads_close(grads, want_grads)


def test_fused_completion_head_on_cuda_equals_the_full_head_on_the_cpu(models):
    from rlhf_core.logprobs import causal_lm_selected_logprobs, causal_lm_token_logprobs

    cpu, gpu = models
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(6, 100, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0  # a right-padded row
    target = torch.zeros(3, 11, dtype=torch.bool)
    target[:, 5:] = True
    target &= mask[:, 1:].bool()
    cpu.zero_grad(set_to_none=True)
    full = causal_lm_token_logprobs(cpu, ids, mask)
    want = torch.where(target, full, torch.zeros_like(full))
    want.sum().backward()
    want_grads = grads_of(cpu)
    gpu.zero_grad(set_to_none=True)
    got = causal_lm_selected_logprobs(gpu, ids.to(DEVICE), mask.to(DEVICE), target.to(DEVICE))
    got.sum().backward()
    torch.testing.assert_close(got.double().cpu(), want.detach(), rtol=0, atol=1e-4)
    assert_grads_close(grads_of(gpu), want_grads)


def loss_inputs(seed: int, shape: tuple[int, ...], scale: float = 5.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).requires_grad_()


def test_dpo_loss_and_gradient_on_cuda_equal_the_cpu_in_float64():
    from direct_alignment.losses import LOSSES

    loss_fn = LOSSES.get("dpo")(beta=0.1)
    cpu = [loss_inputs(i, (8,), 40.0) for i in range(4)]
    gpu = [x.detach().float().to(DEVICE).requires_grad_() for x in cpu]
    want, _ = loss_fn(*cpu)
    got, _ = loss_fn(*gpu)
    want.backward()
    got.backward()
    assert abs(float(got) - float(want)) <= 1e-5
    for a, b in zip(gpu, cpu, strict=True):
        torch.testing.assert_close(a.grad.double().cpu(), b.grad, rtol=1e-4, atol=1e-6)


def test_grpo_loss_and_gradient_on_cuda_equal_the_cpu_in_float64():
    from policy_gradients.experience import LossInputs
    from policy_gradients.losses import LOSSES

    loss_fn = LOSSES.get("clipped")(aggregation="seq-mean-token-mean", kl_beta=0.04)
    b, t = 6, 10
    g = torch.Generator().manual_seed(3)
    action = (torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=g)[:, None]).long()
    logp = -loss_inputs(4, (b, t), 1.0).detach().abs()
    old = (logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp_max(0)
    ref = (logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp_max(0)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()

    def run(device, dtype):
        x = logp.detach().to(device, dtype).clone().requires_grad_()
        exp = LossInputs(
            action_mask=action.to(device), advantages=adv.to(device, dtype),
            log_probs_old=old.to(device, dtype), log_probs_ref=ref.to(device, dtype),
        )  # fmt: skip
        loss, _ = loss_fn(x, exp, total_sequences=float(b))
        loss.backward()
        return float(loss), x.grad.double().cpu()

    want, want_grad = run("cpu", torch.float64)
    got, got_grad = run(DEVICE, torch.float32)
    assert abs(got - want) <= 1e-5, (got, want)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
