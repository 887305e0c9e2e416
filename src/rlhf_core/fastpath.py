"""The speed seam: which fast paths a run takes, decided once from the model, device and dtype.

`speed_plan(model)` returns a frozen `SpeedPlan`, a function of the model's config, device and
dtype and of the run's switches (`train.speed`, `SpeedConfig`, set once at start by
`start_speed`), so every reader gets the same plan: trainers read its batch layout, attention
(`rlhf_core.attention.fast_attention`) and generation (`rlhf_core.generation.decode`) the rest.
Each decision can be switched off in the config; the run's plan is printed at start and written
to summary.json under `speed` (`rlhf_core.distributed.Engine.announce`). A CPU run in bf16 also
gets a warning at start when a ~50 ms matmul probe finds bf16 much slower than fp32 (no native
bf16 on this CPU: `warn_if_bf16_is_slow`).

    layout          how a step's sequences are laid out (`rlhf_core.layout`): "segmented" rows
                    of many groups with attention one group at a time (CPU SDPA, wide enough
                    models), "mask" rows no longer than the longest group (a 4D mask: SDPA or
                    eager), "flat" (flash attention's varlen: sequences told apart by position
                    ids) or "padded" (one sequence per row: encoder-decoder models and others)
    micro-batches   packed preference pairs (DPO, reward models) merged into forwards of up to
                    the tokens a padded micro-batch could hold (`pair_token_budget`)
    attention       our SDPA dispatch on the CPU (`rlhf_core.attention`): `short_attention` for
                    bf16/fp16 calls with few keys, grouped key/value heads without copies, and
                    one call per segment of a packed row where that pays (`segments_pay`)
    decode          a decoding step's grouped query heads as rows of one SDPA call (bf16/fp16)
                    and the KV cache reserved ahead (`reserve_positions`)
    lean norms      the Llama/Qwen RMSNorms' recomputing backward (`rlhf_core.lean`)
    allocator       glibc's allocator: freed memory kept for the next step ("retain"), or under
                    FSDP2 a fixed mmap threshold ("mmap-threshold"); never both

Every rule here is for the CPU: on CUDA every one of them is off (transformers' attention and
cache, torch's caching allocator; tested), so what a GPU user runs is the plain path. The
layout threshold scales with the model's shape instead of naming one calibrated model: what a
padded position costs is a layer's matmul work per token (its parameters), what an extra
attention call costs is fixed (`SEGMENT_CALL_UNITS`). Short attention's key limit is one measured
constant for every shape (a GQA-scaled limit lost on a second shape; see `short_attention_keys`).
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from pydantic import Field

from rlhf_core.config import StrictModel
from rlhf_core.lean import restore_norms

# ----------------------------------------------------------------------------- CPU constants

#: What one more SDPA call per layer costs (forward and backward, the split and the autograd
#: nodes around it) in units of attention work (score entries x query heads x head size).
#: Measured on a 2-core x86 CPU (fp32 and bf16 alike): ~0.15-0.2 ms a call, ~1e-10 s a unit.
SEGMENT_CALL_UNITS = 2_000_000
#: Padding per group that segmented rows save over rows no longer than the longest group:
#: measured 4.3 on quickstart SFT batches of 64, 45 on HH pairs in batches of 4 (gpt2 tokenizer).
#: 8 sits between the break-evens timed on a 2-core CPU: width 128 (15 tokens) lost, 512 (1.3) won.
SEGMENT_PADDING_TOKENS = 8
#: Row capacity of segmented rows: bounds the (L, L) boolean mask a row builds (16M entries).
SEGMENTED_ROW_TOKENS = 4096
#: Keys up to which `short_attention` beats the CPU flash kernel's bf16 backward: measured at
#: 8/4 heads of width 64 on a 2-core CPU; on the `wide` shape (12/3 heads) 128 also beat 90.
SHORT_ATTENTION_KEYS = 128
#: How far ahead `decode` reserves its KV cache (positions per layer); measured on a 2-core CPU
#: (GRPO rollouts of the benchmarks' `real` model).
RESERVE_POSITIONS = 256


class SpeedConfig(StrictModel):
    """`train.speed`: each fast path can be switched off (none is used on CUDA anyway)."""

    segmented_rows: bool = Field(
        True,
        description="CPU: pack a step's groups into long rows with attention one group at a "
        "time, where the model is wide enough to pay for the extra calls; false = rows no "
        "longer than the longest group (rlhf_core.fastpath)",
    )
    cpu_attention: bool = Field(
        True,
        description="CPU SDPA models: short attention for bf16 calls with few keys, grouped "
        "key/value heads without copies, a call per segment of packed rows; false = "
        "transformers' SDPA (rlhf_core.attention)",
    )
    grouped_decode: bool = Field(
        True,
        description="CPU: a decoding step's grouped query heads as rows of one SDPA call (bf16); "
        "false = transformers' path",
    )
    reserved_cache: bool = Field(
        True,
        description="CPU: decode writes keys and values into a KV cache reserved ahead instead "
        "of concatenating every token; false = transformers' DynamicLayer",
    )
    fill_micro_batches: bool = Field(
        True,
        description="CPU, packed preference pairs: merge a step's micro-batches into forwards "
        "of up to the tokens a padded micro-batch could hold (train.micro_batch_size x 2 x "
        "data.max_length), where the loss is a mean of per-pair losses; false = "
        "train.micro_batch_size pairs per forward",
    )
    lean_norms: bool = Field(
        True,
        description="CPU: Llama/Qwen RMSNorms save their input only and recompute in a closed-"
        "form backward (rlhf_core.lean); false = the module's own forward",
    )
    allocator: bool = Field(
        True,
        description="CPU (glibc): keep freed memory for the next step (no mmap, trim at 2 GiB), "
        "or under FSDP2 a fixed mmap threshold (train.fsdp.cpu_mmap_threshold_mib); false = "
        "glibc's defaults",
    )


Layout = Literal["segmented", "mask", "flat", "padded"]


@dataclass(frozen=True)
class SpeedPlan:
    """What a run uses; see the module docstring. Zero means off for the numeric fields."""

    device: str
    dtype: str
    layout: Layout
    row_tokens: int  # capacity of a segmented row (0 unless layout is "segmented")
    cpu_attention: bool  # our SDPA dispatch for multi-token calls
    short_attention_keys: int  # bf16/fp16 calls with at most this many keys: short_attention
    segment_call_units: int  # the cost of a call per segment (`rlhf_core.attention.segments_pay`)
    fill_micro_batches: bool  # packed pairs: micro-batches merged up to `pair_token_budget`
    grouped_decode: bool
    reserve_positions: int
    lean_norms: bool
    allocator: str

    @property
    def dispatch(self) -> bool:
        """Whether the model's SDPA goes through `rlhf_core.attention`'s dispatch at all."""
        return self.cpu_attention or self.grouped_decode

    def pair_token_budget(self, micro_pairs: int, max_length: int) -> int:
        """Tokens one forward of packed preference pairs may hold when `fill_micro_batches`:
        what a padded micro-batch of `micro_pairs` pairs (two rows of up to `max_length` each)
        could, so a forward never needs more than the configured micro-batch might; 0 = off.
        Small packed micro-batches make small matrices, which run slowly on a CPU (on the
        benchmarks' `wide` shape, bf16, 2 threads: a 2-pair micro-batch is one row of 217-480
        tokens, matmuls at ~100 GFLOP/s against ~160 at ~1,000 rows)."""
        return 2 * micro_pairs * max_length if self.fill_micro_batches else 0

    def describe(self) -> dict[str, Any]:
        """The plan as summary.json holds it."""
        return asdict(self)

    def line(self) -> str:
        """One line for the start of a run."""
        rows = f" of {self.row_tokens} tokens" if self.layout == "segmented" else ""
        attention = (
            f"ours (short attention up to {self.short_attention_keys} keys in bf16, grouped "
            "heads, per-segment calls where they pay)"
            if self.cpu_attention
            else "transformers'"
        )
        return (
            f"speed plan ({self.device}, {self.dtype}): layout {self.layout}{rows}; attention "
            f"{attention}; micro-batches "
            f"{'filled' if self.fill_micro_batches else 'as configured'}; grouped decode "
            f"{'on' if self.grouped_decode else 'off'}; KV cache reserve "
            f"{self.reserve_positions or 'off'}; lean norms "
            f"{'on' if self.lean_norms else 'off'}; allocator {self.allocator}"
        )


# ----------------------------------------------------------------------------- the model's shape


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP/FSDP1 (`.module`) and peft (`get_base_model()`)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def text_config(config: Any) -> Any:
    """A multimodal config's text part (`get_text_config`), or the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def query_groups(config: Any) -> int:
    """Query heads per key/value head (1 without grouped-query attention)."""
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None) or 1
    return max(1, heads // (getattr(text, "num_key_value_heads", None) or heads))


def layer_token_macs(config: Any) -> int:
    """Multiply-adds of one token through one decoder layer's matmuls: the q, k, v and o
    projections and a gated MLP (three matrices; two for a plain one), from the config."""
    text = text_config(config)
    hidden = getattr(text, "hidden_size", 0) or 0
    heads = getattr(text, "num_attention_heads", 1) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    inner = getattr(text, "intermediate_size", None) or 4 * hidden
    mlp = 3 if getattr(text, "hidden_act", "silu") in ("silu", "swish") else 2
    return hidden * head_dim * (2 * heads + 2 * kv_heads) + mlp * hidden * inner


def segmented_rows_pay(config: Any) -> bool:
    """Whether segmented rows beat rows no longer than the longest group for a model of this
    shape: a group's extra attention call per layer (`SEGMENT_CALL_UNITS`) must cost less than
    the padding it saves (`SEGMENT_PADDING_TOKENS` positions, each a layer's matmul work per
    token; an attention unit is two multiply-adds, q k^T and p v). Depth cancels (both are per
    layer); GQA and the MLP's width enter through the layer's parameters. The tiny world's
    models (width 64-128) stay on max-length rows, the benchmarks' `small`, `real` and `wide`
    take segmented rows."""
    return SEGMENT_PADDING_TOKENS * layer_token_macs(config) // 2 >= SEGMENT_CALL_UNITS


def short_attention_keys(config: Any) -> int:
    """The most keys a bf16/fp16 call may have to take `short_attention`: `SHORT_ATTENTION_KEYS`
    for every shape. A limit shrinking with the query heads per key/value head (a fixed float32
    score block) was tried and lost on the `wide` shape (90 keys slower than 128; docs/
    performance.md), so the limit stays the measured one until a per-CPU probe replaces it."""
    del config  # the same limit for every shape (see above)
    return SHORT_ATTENTION_KEYS


# ----------------------------------------------------------------------------- the plan

_RUN = SpeedConfig()  # the run's switches: `start_speed` sets them, every plan reads them
_ALLOCATOR = "glibc defaults"  # what `start_speed` applied


def plan_speed(
    config: Any,
    *,
    device: str,
    dtype: torch.dtype,
    attention: str,
    speed: SpeedConfig | None = None,
    allocator: str | None = None,
) -> SpeedPlan:
    """The plan for a model of `config` (a transformers config) running `attention` (its
    `_attn_implementation`) on `device` ("cpu", "cuda", ...) in `dtype`, under the switches
    `speed` (default: the run's). Needs no model and no GPU."""
    speed = _RUN if speed is None else speed
    cpu = device == "cpu"
    causal = not getattr(config, "is_encoder_decoder", False)
    ours = cpu and causal and attention == "sdpa"
    cpu_attention = ours and speed.cpu_attention
    if causal and attention in ("sdpa", "eager"):
        pays = cpu_attention and speed.segmented_rows and segmented_rows_pay(config)
        layout: Layout = "segmented" if pays else "mask"
    elif causal and "flash" in (attention or ""):
        layout = "flat"
    else:
        layout = "padded"
    return SpeedPlan(
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        layout=layout,
        row_tokens=SEGMENTED_ROW_TOKENS if layout == "segmented" else 0,
        cpu_attention=cpu_attention,
        short_attention_keys=short_attention_keys(config) if cpu_attention else 0,
        segment_call_units=SEGMENT_CALL_UNITS,
        fill_micro_batches=cpu and speed.fill_micro_batches and layout in ("segmented", "mask"),
        grouped_decode=ours and speed.grouped_decode and query_groups(config) > 1,
        reserve_positions=RESERVE_POSITIONS if cpu and speed.reserved_cache else 0,
        lean_norms=cpu and speed.lean_norms,
        allocator=(allocator or _ALLOCATOR) if cpu else "torch's (not glibc's)",
    )


def model_device(model: torch.nn.Module) -> str:
    """ "cpu" when every parameter is on the CPU, else the first other device type."""
    kinds = {p.device.type for p in model.parameters()}
    return "cpu" if kinds <= {"cpu"} else sorted(kinds - {"cpu"})[0]


def transformer(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside `model`'s wrappers (a scalar-head model's backbone)."""
    inner = unwrapped(model)
    if not hasattr(inner, "config") and isinstance(
        getattr(inner, "backbone", None), torch.nn.Module
    ):
        inner = unwrapped(inner.backbone)
    return inner


def speed_plan(model: torch.nn.Module) -> SpeedPlan:
    """The run's plan for `model` (its config, device, dtype and attention; the run's switches)."""
    inner = transformer(model)
    config = inner.config
    embed = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    dtype = weight.dtype if weight is not None else next(inner.parameters()).dtype
    return plan_speed(
        config,
        device=model_device(inner),
        dtype=dtype,
        attention=getattr(config, "_attn_implementation", None) or "",
    )


# ----------------------------------------------------------------------------- bf16 on a CPU

#: bf16 matmuls this many times slower than fp32 mean the CPU has no native bf16 (AVX-512 BF16,
#: AMX): a 1024^2 matmul ran 66x slower in bf16 on an AVX2 CPU; with native bf16 it is ~0.5-2x.
SLOW_BF16_RATIO = 4.0
_BF16_CHECKED = False


def bf16_probe(size: int = 256, budget_s: float = 0.05) -> tuple[float, float]:
    """Seconds per (size x size) matmul on this CPU in bf16 and in fp32, each timed for about
    `budget_s / 2` after one warm-up call (at least one timed call)."""
    import time

    timings = []
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(size, size).to(dtype)
        torch.mm(a, a)
        calls, start = 0, time.perf_counter()
        while calls == 0 or (time.perf_counter() - start < budget_s / 2 and calls < 1000):
            torch.mm(a, a)
            calls += 1
        timings.append((time.perf_counter() - start) / calls)
    return timings[0], timings[1]


def slow_bf16_warning(*, bf16_seconds: float, fp32_seconds: float, capability: str) -> str | None:
    """The warning for a CPU whose bf16 matmuls are `SLOW_BF16_RATIO` times slower than fp32
    (`bf16_probe`'s timings; `capability` is torch's CPU capability, e.g. "AVX2"); None if not."""
    ratio = bf16_seconds / max(fp32_seconds, 1e-12)
    if ratio < SLOW_BF16_RATIO:
        return None
    return (
        f"warning: this CPU ({capability}) has no native bf16: a bf16 matmul ran {ratio:.0f}x "
        "slower than fp32 here. Use model.dtype: fp32 on this machine (bf16 pays on GPUs and "
        "CPUs with AVX-512 BF16 or AMX)"
    )


def warn_if_bf16_is_slow(device: str, dtype: torch.dtype) -> str | None:
    """On a CPU run in bf16, probe once per process and print `slow_bf16_warning` if it holds."""
    global _BF16_CHECKED
    if device != "cpu" or dtype != torch.bfloat16 or _BF16_CHECKED:
        return None
    _BF16_CHECKED = True
    bf16_s, fp32_s = bf16_probe()
    capability = torch.backends.cpu.get_cpu_capability()
    warning = slow_bf16_warning(bf16_seconds=bf16_s, fp32_seconds=fp32_s, capability=capability)
    if warning:
        print(warning, file=sys.stderr)
    return warning


def announce_plan(models: list[torch.nn.Module]) -> SpeedPlan:
    """The run's plan for its first model (the one trained), applied to every model where it
    acts on the modules themselves (lean norms off: `rlhf_core.lean.restore_norms`). The caller
    prints `plan.line()` and writes `plan.describe()` to summary.json
    (`rlhf_core.distributed.Engine.announce`)."""
    plan = speed_plan(models[0])
    warn_if_bf16_is_slow(plan.device, getattr(torch, plan.dtype, None))  # at start, once
    if not plan.lean_norms:
        for model in models:
            restore_norms(model)
    return plan


# ----------------------------------------------------------------------------- process settings


def choose_allocator(
    device: str, engine: str, *, enabled: bool, mmap_threshold_mib: float | None, glibc: bool
) -> str:
    """The allocator policy of a run: on a glibc CPU run a fixed mmap threshold under FSDP2
    (each step gathers and frees whole layers between persistent shards; "glibc defaults" when
    `train.fsdp.cpu_mmap_threshold_mib` is null) and otherwise freed memory kept ("retain");
    never both (`retain_freed_memory` turns mmap off, which would cancel the threshold). Nothing
    on CUDA or with `train.speed.allocator` false."""
    if device != "cpu" or not enabled or not glibc:
        return "glibc defaults" if device == "cpu" else "torch's (not glibc's)"
    if engine == "fsdp2":
        if mmap_threshold_mib is None:
            return "glibc defaults"
        return f"mmap-threshold {mmap_threshold_mib:g} MiB"
    return "retain"


def start_speed(
    speed: SpeedConfig, device: str, engine: str, mmap_threshold_mib: float | None
) -> str:
    """Set the run's switches and apply its allocator policy (`choose_allocator`), once, at
    start (`rlhf_core.loop.start_engine`). Returns the policy in force."""
    global _RUN, _ALLOCATOR
    _RUN = speed
    policy = choose_allocator(
        device, engine, enabled=speed.allocator, mmap_threshold_mib=mmap_threshold_mib,
        glibc=_glibc_mallopt() is not None,
    )  # fmt: skip
    applied = True
    if policy == "retain":
        applied = retain_freed_memory()
    elif policy.startswith("mmap-threshold") and mmap_threshold_mib is not None:
        applied = fix_mmap_threshold(mmap_threshold_mib)
    _ALLOCATOR = policy if applied else "glibc defaults"
    return _ALLOCATOR


def allocator_policy() -> str:
    """The policy `start_speed` applied ("glibc defaults" before it runs)."""
    return _ALLOCATOR


def _glibc_mallopt():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def retain_freed_memory() -> bool:
    """Keep freed memory in this process for reuse instead of returning it to the kernel (glibc
    only; a no-op elsewhere). Returns whether it applied.

    glibc hands every allocation above 32 MiB (and, once such a block has been freed, smaller
    ones down to its size) a mapping of its own and unmaps it on free, and returns the top of its
    heap once more than twice that is free. A CPU training step allocates and frees the same
    large activations and gradients every step, so each step faults them all in again from fresh
    zeroed pages. With mmap off (`M_MMAP_MAX` 0) and trimming at 2 GiB of free heap
    (`M_TRIM_THRESHOLD`) the heap keeps those pages; resident memory then stays at its
    high-water mark instead of shrinking between steps (docs/performance.md)."""
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def fix_mmap_threshold(mib: float) -> bool:
    """Hold glibc malloc's mmap threshold at `mib` MiB; False where libc is not glibc.

    glibc serves a block from the heap unless it is at least the mmap threshold, and raises that
    threshold (up to 32 MiB) to the size of every mapped block freed. Under FSDP2 on CPU each
    step gathers every layer and frees it again, interleaved with the persistent gradient
    shards; once the threshold has risen those transients come from the heap, and the holes
    between the shards are memory the process keeps but cannot use (benchmarks/fsdp2_memory.py).
    A fixed threshold maps and unmaps such blocks on their own, at a page fault per fresh
    mapping. `retain_freed_memory` turns mmap off altogether, which would cancel this: a run
    gets one or the other (`start_speed`)."""
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    m_mmap_threshold = -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, int(mib * (1 << 20))))
