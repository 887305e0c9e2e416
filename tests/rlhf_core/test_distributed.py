"""`rlhf_core.distributed.resolve_engine`: the engine a run gets, or a message for one it asked
for and cannot have (never a silent fallback). The engines themselves run in tests/test_fsdp2.py
and tests/test_multiprocess.py under torchrun."""

from __future__ import annotations

import pytest
from accelerate.utils import DistributedType

from rlhf_core.distributed import resolve_engine
from rlhf_core.errors import UserError

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
