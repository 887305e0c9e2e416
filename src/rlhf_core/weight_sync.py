"""A policy's weights, from the trainer to a generator process on the same machine: `WeightChannel`.

The one seam through which weights flow to a process that samples with them (asynchronous
rollouts, `policy_gradients.async_rollouts`); `rlhf_core.distributed` owns how models are placed
across the *training* processes, this owns how a copy reaches a sampler beside them.

The channel holds `slots` copies of the model's parameters in shared memory (torch's
`share_memory_`), one flat buffer per dtype and slot, so a spawned process receives a handful of
file descriptors, not one per tensor. Version v lives in slot v % slots: the trainer writes it
(`publish`, a copy out of its parameters) and the generator reads it into its own model (`load`,
a copy into its parameters); both are bit-for-bit copies. Who may overwrite which slot when (the
versions a generator can still need) is the caller's protocol: with staleness at most k, k + 1
slots suffice (docs/policy_gradients/async_rollouts.md).

Left out: GPU tensors (the buffers are CPU shared memory; a CUDA model is copied through them,
device to host and back), sharded (FSDP2) or DDP-wrapped models across several trainer
processes, and torch.distributed broadcast to a sampler on another machine: each would be
another implementation of `publish` / `load`.
"""

from __future__ import annotations

import torch
import torch.multiprocessing  # noqa: F401 - registers the pickling of shared tensors


class WeightChannel:
    """`slots` shared-memory copies of `model`'s parameters (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"WeightChannel: slots must be >= 1, got {slots}")
        self.slots = slots
        # name -> (dtype, offset, shape): where each parameter lives in its dtype's buffer
        self.layout: dict[str, tuple[torch.dtype, int, torch.Size]] = {}
        sizes: dict[torch.dtype, int] = {}
        for name, p in model.named_parameters():
            offset = sizes.get(p.dtype, 0)
            self.layout[name] = (p.dtype, offset, p.shape)
            sizes[p.dtype] = offset + p.numel()
        self.buffers = [
            {dtype: torch.empty(n, dtype=dtype).share_memory_() for dtype, n in sizes.items()}
            for _ in range(slots)
        ]

    def _check(self, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        params = dict(model.named_parameters())
        if params.keys() != self.layout.keys() or any(
            (p.dtype, p.shape) != self.layout[n][::2] for n, p in params.items()
        ):
            raise ValueError("WeightChannel: the model's parameters differ from the channel's")
        return params

    @torch.no_grad()
    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Copy `model`'s parameters into the slot of `version`."""
        slot = self.buffers[version % self.slots]
        for name, p in self._check(model).items():
            dtype, offset, _ = self.layout[name]
            slot[dtype][offset : offset + p.numel()].copy_(p.detach().reshape(-1))

    @torch.no_grad()
    def load(self, version: int, model: torch.nn.Module) -> None:
        """Copy the slot of `version` into `model`'s parameters."""
        slot = self.buffers[version % self.slots]
        for name, p in self._check(model).items():
            dtype, offset, shape = self.layout[name]
            p.copy_(slot[dtype][offset : offset + p.numel()].view(shape))

    @property
    def bytes(self) -> int:
        """Shared memory held, all slots."""
        return sum(b.numel() * b.element_size() for slot in self.buffers for b in slot.values())
