"""`rlhf_core.distributed.resolve_engine`: the engine a run gets, or a message for one it asked
for and cannot have (never a silent fallback); `memory_bytes`, the sizes the engine announces.
The engines themselves run in tests/test_fsdp2.py and tests/test_multiprocess.py under torchrun."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import DistributedType

from rlhf_core.distributed import memory_bytes, resolve_engine
from rlhf_core.errors import UserError
from rlhf_core.optim import OptimConfig, build_optimizer

NO, CPU, GPU = DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU


@pytest.mark.parametrize(
    ("requested", "processes", "kind", "fsdp_env", "expected"),
    [("auto", 1, NO, False, "single"), ("auto", 2, CPU, False, "ddp"),
     ("auto", 8, GPU, False, "ddp"), ("auto", 2, CPU, True, "fsdp2"),  # accelerate FSDP on CPU
     ("auto", 8, DistributedType.FSDP, True, "fsdp2"), ("fsdp2", 2, CPU, False, "fsdp2"),
     ("ddp", 2, CPU, False, "ddp"), ("single", 1, NO, False, "single"),
     ("auto", 8, DistributedType.DEEPSPEED, False, "ddp")],
)  # fmt: skip
def test_resolved_engine(requested, processes, kind, fsdp_env, expected):
    got = resolve_engine(requested, processes=processes, distributed_type=kind, fsdp_env=fsdp_env)
    assert got == expected


@pytest.mark.parametrize(
    ("requested", "processes", "kind", "message"),
    [("fsdp2", 1, NO, "needs several processes"), ("ddp", 1, NO, "needs several processes"),
     ("single", 2, CPU, "use ddp or fsdp2"), ("fsdp2", 8, DistributedType.DEEPSPEED, "DeepSpeed")],
)  # fmt: skip
def test_engine_a_run_cannot_have_is_a_user_error(requested, processes, kind, message):
    with pytest.raises(UserError, match=message):
        resolve_engine(requested, processes=processes, distributed_type=kind, fsdp_env=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_bytes_announced_before_the_first_step_are_the_ones_it_allocates(dtype):
    """`memory_bytes` reports the optimizer's state before it exists (the engine announces it
    at start): two moments in an fp32 parameter's dtype; for a bf16 one (fp32 masters, the
    default) an fp32 master and two fp32 moments, 6x the bf16 parameter's bytes."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(dtype)
    model[0].requires_grad_(False)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    before = memory_bytes([model], [optimizer])
    model(torch.randn(3, 8, dtype=dtype)).sum().backward()
    optimizer.step()
    after = memory_bytes([model], [optimizer])
    trainable = sum(p.numel() for p in model[1].parameters()) * dtype.itemsize
    per = 2 if dtype == torch.float32 else 6
    assert before["optim"] == after["optim"] == per * trainable
    assert before["grads"] == after["grads"] == trainable
