"""How models are placed across processes: the one seam every trainer prepares its models through.

    engine   what a process holds                               when
    single   the whole model, its gradients and optimizer state one process
    ddp      the same on every process; gradients all-reduced    accelerate's DDP (the default
                                                                 under torchrun / accelerate)
    fsdp2    1/N of every parameter, gradient and optimizer     train.engine: fsdp2, or an
             state; parameters all-gathered layer by layer       accelerate FSDP config
             around each forward and backward

`train.engine: auto` picks `single` for one process, `fsdp2` when accelerate was launched with an
FSDP config (ACCELERATE_USE_FSDP), else `ddp`. Asking for `fsdp2` (or `ddp`) with one process, or
for `fsdp2` under DeepSpeed, is an error, never a silent fallback.

FSDP2 is torch's `torch.distributed.fsdp.fully_shard` applied here, per decoder layer (the
modules transformers lists in `_no_split_modules`) and then to the root, never through accelerate's
wrapper: accelerate given an FSDP config with `use_cpu` silently runs DDP, so on CPU (gloo) the
sharding must come from `fully_shard` itself, whichever launcher started the processes.

The operations that differ under sharding each have one owner here:
  - `Engine.prepare` shards (or DDP-wraps) a model; build the optimizer afterwards, over the
    sharded parameters (DTensors), and pass it to `prepare_optimizer`;
  - `Engine.grad_sync(model, sync)`: gradient accumulation (DDP's `no_sync`, FSDP2's
    `set_requires_gradient_sync`);
  - `rlhf_core.loop.clip_grad_norm`: the global norm over DTensor gradients;
  - `Engine.gathered(model)`: every FSDP unit all-gathered once, for generation and evaluation
    (a decode loop runs as many forwards as its rows need, which differs between processes; with
    the parameters gathered up front those forwards need no collective);
  - `run_as_root_forward`: the fused completion-only LM head (`rlhf_core.logprobs`) runs the
    decoder and the head weight inside the root module's FSDP forward, so it sees the real,
    gathered head weight and its gradient is reduce-scattered;
  - checkpoints of a sharded model (torch.distributed.checkpoint, every rank writing its shard;
    a gathered Hugging Face `final/`) live with every other checkpoint in `rlhf_core.checkpoint`.

A copy of the policy for a sampler beside the trainer (asynchronous rollouts) goes through
`rlhf_core.weight_sync.WeightChannel`, the seam for that direction.

Left out: DeepSpeed ZeRO-3 (refused in `rlhf_core.loop`), tensor/pipeline parallelism, HSDP,
the fused LM head under DDP (DDP's gradient hooks need its own forward). Learned reward models
used as rewards are sharded at rest and gathered while they score. docs/distributed.md has the
whole picture.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Literal

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from pydantic import Field

from rlhf_core.config import StrictModel
from rlhf_core.errors import UserError
from rlhf_core.fastpath import allocator_policy, announce_plan
from rlhf_core.optim import announced_state_bytes

EngineName = Literal["auto", "single", "ddp", "fsdp2"]
ROOT_FORWARD = "rlhf_root_forward"


class FSDPConfig(StrictModel):
    """FSDP2 settings (used only when the engine is fsdp2)."""

    mixed_precision: Literal["off", "bf16"] = Field(
        "off",
        description="bf16: compute in bf16 from fp32 sharded weights, reduce gradients in fp32 "
        "(load the model with model.dtype: fp32); off: compute in the weights' dtype",
    )
    cpu_offload: bool = Field(
        False, description="keep sharded parameters, gradients and optimizer state in CPU memory"
    )
    reshard_after_forward: bool = Field(
        True, description="free gathered layers after forward (ZeRO-3); false = keep (ZeRO-2-like)"
    )
    cpu_mmap_threshold_mib: float | None = Field(
        0.125,
        gt=0,
        le=32,
        description="CPU runs (glibc) only: blocks of at least this many MiB get their own "
        "memory mapping, returned to the system when freed (mallopt M_MMAP_THRESHOLD, held "
        "fixed), so each step's gathered layers and unsharded gradients do not fragment the "
        "heap between the persistent shards; null keeps glibc's self-raising threshold "
        "(rlhf_core.fastpath.fix_mmap_threshold)",
    )


class EngineSettings(StrictModel):
    """The engine keys every trainer's `train` block has (`train.engine`, `train.fsdp`)."""

    engine: EngineName = Field(
        "auto",
        description="how models are placed across processes: single, ddp (full copies), fsdp2 "
        "(sharded, torch fully_shard); auto = single for one process, fsdp2 under an accelerate "
        "FSDP config, else ddp (rlhf_core.distributed)",
    )
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig, description="FSDP2 settings")


# ----------------------------------------------------------------------------- sizes


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t` (a DTensor's local shard, else `t`)."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Any) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def memory_bytes(
    models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]
) -> dict[str, int]:
    """This process's bytes of parameters, gradients (allocated, or to be: one per trainable
    parameter) and optimizer state (allocated, or before the first step what it will allocate:
    `rlhf_core.optim.announced_state_bytes`)."""
    params = [p for m in models for p in m.parameters()]
    trainable = [p for p in params if p.requires_grad]
    state = [
        v for opt in optimizers for s in opt.state.values() for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    ]  # fmt: skip
    announced = sum(announced_state_bytes(o, local_tensor) for o in optimizers)
    optim = tensor_bytes(state) if state else announced
    return {"params": tensor_bytes(params), "grads": tensor_bytes(trainable), "optim": optim}


# ----------------------------------------------------------------------------- FSDP2 helpers


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unit_names(model: torch.nn.Module) -> list[str]:
    """The qualified names of `model`'s FSDP2 units ("" = the root)."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers says must not be split (its `_no_split_modules`: the decoder
    layers), found anywhere under `model` (a peft wrapper, a scalar-head backbone)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(
            f"engine fsdp2: found no decoder layers to shard in {type(model).__name__} "
            "(transformers' _no_split_modules is empty)"
        )
    return layers


def run_as_root_forward(model: torch.nn.Module, fn: Any, *args: Any) -> Any:
    """`fn(*args)` run as part of `model`'s forward: under FSDP2 inside the unit's pre- and
    post-forward hooks (its parameters gathered, gradients reduce-scattered in backward), so code
    that calls submodules or weights directly (the fused LM head) sees real weights; otherwise
    just `fn`. `model` is the root, or a unit of its own such as an untied LM head."""
    if is_sharded(model):
        return getattr(model, ROOT_FORWARD)(fn, *args)
    return fn(*args)


def _root_forward(self: torch.nn.Module, fn: Any, *args: Any) -> Any:
    return fn(*args)


def _nothing() -> None:
    return None


def own_unit_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embedding and the output head of a decoder-only model, each sharded as a unit
    of its own, when they do not share their weight. Left in the root they would stay gathered,
    with their full gradients, from the first forward to the end of the backward: for a 32k x 1024
    vocabulary that is 4 x 128 MiB more at the peak of every process. A tied pair (Qwen3-0.6B,
    the tiny presets) stays in the root: one parameter cannot belong to two units. Encoder-decoder
    models (T5's shared embedding is called by both stacks) stay as they are."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return []
    emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if emb is not None and head is not None and head.weight is emb.weight:
        return []
    return [
        m
        for m in (emb, head)
        if isinstance(m, torch.nn.Module) and next(m.parameters(), None) is not None
    ]


def shard_model(model: torch.nn.Module, fsdp: FSDPConfig, device: torch.device) -> torch.nn.Module:
    """`fully_shard` each decoder layer, an untied input embedding and output head
    (`own_unit_modules`), then the root (what is left: the final norm, a tied embedding/head, a
    scalar head)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    options: dict[str, Any] = {
        "offload_policy": CPUOffloadPolicy() if fsdp.cpu_offload else OffloadPolicy(),
    }
    if fsdp.mixed_precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in [*decoder_layers(model), *own_unit_modules(model)]:
        fully_shard(layer, reshard_after_forward=fsdp.reshard_after_forward, **options)
    fully_shard(model, **options)
    # a method the fused LM head runs through (see run_as_root_forward), on the root and on each
    # unit the head may be
    for unit in fsdp_units(model):
        unit.rlhf_root_forward = _root_forward.__get__(unit)
        register_fsdp_forward_method(unit, ROOT_FORWARD)
    return model


# ----------------------------------------------------------------------------- the engine


def resolve_engine(
    requested: EngineName, *, processes: int, distributed_type: DistributedType, fsdp_env: bool
) -> Literal["single", "ddp", "fsdp2"]:
    """The engine a run uses, or a UserError for one it asked for and cannot have."""
    if distributed_type == DistributedType.DEEPSPEED:
        if requested == "fsdp2":
            raise UserError("train.engine fsdp2 under DeepSpeed: launch with torchrun instead")
        return "ddp"  # DeepSpeed's engine (ZeRO-1/2) holds full parameters, as DDP does
    if requested == "auto":
        requested = "fsdp2" if (fsdp_env or distributed_type == DistributedType.FSDP) else "ddp"
        if processes == 1:
            requested = "single"
    if requested != "single" and processes == 1:
        raise UserError(
            f"train.engine {requested} needs several processes but this run has one: launch "
            "with `torchrun --nproc_per_node N -m ...` (or accelerate launch), or set "
            "train.engine: single"
        )
    if requested == "single" and processes > 1:
        raise UserError(
            f"train.engine single with {processes} processes: use ddp or fsdp2 (or auto)"
        )
    return requested


class Engine:
    """The resolved engine of a run: prepares models and owns the operations that differ."""

    def __init__(
        self, accelerator: Accelerator, requested: EngineName, fsdp: FSDPConfig | None = None
    ) -> None:
        self.accelerator = accelerator
        self.fsdp = fsdp or FSDPConfig()
        self.name = resolve_engine(
            requested,
            processes=accelerator.num_processes,
            distributed_type=accelerator.distributed_type,
            fsdp_env=os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"),
        )
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        if self.fsdp.mixed_precision == "bf16" and self.name != "fsdp2":
            raise UserError("train.fsdp.mixed_precision bf16 applies to engine fsdp2 only")
        if self.fsdp.cpu_offload and (self.name != "fsdp2" or accelerator.device.type != "cuda"):
            raise UserError(
                "train.fsdp.cpu_offload moves FSDP2 shards from GPU to CPU memory: it needs "
                "engine fsdp2 on CUDA devices (on a CPU run the shards already are in CPU memory)"
            )

    @property
    def sharded(self) -> bool:
        return self.name == "fsdp2"

    # --- preparing models and optimizers

    def prepare(self, model: torch.nn.Module, *, trainable: bool = True) -> torch.nn.Module:
        """Shard (fsdp2) or DDP-wrap (ddp, trainable models only) `model`; then build the
        optimizer over the returned model's parameters. Frozen models (a reference) are sharded
        too under fsdp2, and held whole under ddp/single."""
        if self.name == "fsdp2":
            return shard_model(model, self.fsdp, self.accelerator.device)
        if self.name == "ddp" and trainable:
            return self.accelerator.prepare(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.name == "fsdp2":
            return optimizer
        return self.accelerator.prepare(optimizer)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module itself (DDP's `.module`); a sharded model is its own module."""
        return model if self.sharded else self.accelerator.unwrap_model(model)

    # --- the training step

    @contextmanager
    def grad_sync(self, model: torch.nn.Module | None, sync: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: reduce gradients only when `sync`
        (the last micro-batch of an optimizer step); earlier ones accumulate locally."""
        if sync or self.name == "single" or model is None:
            yield
        elif self.name == "fsdp2":
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:
            with self.accelerator.no_sync(model):
                yield

    # --- generation and evaluation

    @contextmanager
    def gathered(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The model with all its parameters present on this process, for generation and
        evaluation (every process must enter together under fsdp2: the gather is a collective;
        inside, forwards are local). Under ddp/single: the unwrapped module."""
        if not self.sharded:
            yield self.unwrap(model)
            return
        # a forward of the root first: it sets up every unit's FSDP state (lazily, at the first
        # root forward); a decode loop whose first call is a submodule (T5's encoder) would
        # otherwise make that submodule a root of its own and the model's own forward fail
        run_as_root_forward(model, _nothing)
        units = fsdp_units(model)
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in units:
            unit.unshard()
        try:
            yield model
        finally:
            for unit in units:
                unit.reshard()
                keep = self.fsdp.reshard_after_forward and unit is not model
                unit.set_reshard_after_forward(keep, recurse=False)

    @contextmanager
    def gathered_all(self, *models: torch.nn.Module | None) -> Iterator[list[Any]]:
        """`gathered` for several models at once; None entries stay None."""
        with ExitStack() as stack:
            yield [stack.enter_context(self.gathered(m)) if m is not None else None for m in models]

    # --- what a run reports

    def describe(
        self, models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]
    ) -> dict[str, Any]:
        """The engine and every process's bytes of parameters, gradients and optimizer state
        (lists indexed by rank); for the start-up line and summary.json."""
        from accelerate.utils import gather_object

        mine = memory_bytes(models, optimizers)
        ranks = gather_object([mine]) if self.world > 1 else [mine]
        out: dict[str, Any] = {"engine": self.name}
        for key in ("params", "grads", "optim"):
            out[f"memory/{key}_bytes_per_rank"] = [r[key] for r in ranks]
        if self.sharded:
            out["fsdp"] = self.fsdp.model_dump()
            out["fsdp/cpu_mmap_threshold_fixed"] = allocator_policy().startswith("mmap-threshold")
            out["fsdp/units"] = [name or "(root)" for m in models for name in unit_names(m)]
        return out

    def announce(self, models: list[torch.nn.Module], optimizers: list[Any]) -> dict[str, Any]:
        """Print the engine and per-rank bytes (main process) and return `describe`'s dict."""
        facts = self.describe(models, optimizers)
        plan = announce_plan(models)  # the speed plan: printed here, in summary.json
        facts["speed"] = plan.describe()
        if self.accelerator.is_main_process:
            print(plan.line(), flush=True)
            mib = 1 << 20
            per_rank = ", ".join(
                f"rank {r}: params {p / mib:.1f} MiB, grads {g / mib:.1f} MiB, "
                f"optimizer {o / mib:.1f} MiB"
                for r, (p, g, o) in enumerate(zip(
                    facts["memory/params_bytes_per_rank"], facts["memory/grads_bytes_per_rank"],
                    facts["memory/optim_bytes_per_rank"], strict=True,
                ))
            )  # fmt: skip
            print(f"engine {self.name} x{self.world} processes; {per_rank}", flush=True)
        return facts
