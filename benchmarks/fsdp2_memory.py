"""Per-process peak memory of full fine-tuning: one process vs 2-process FSDP2 (CPU, gloo).

    uv run python benchmarks/fsdp2_memory.py                  # 267M: ~15 min, ~9 GB RAM
    uv run python benchmarks/fsdp2_memory.py --model 505m     # ~25 min, ~11 GB
    uv run python benchmarks/fsdp2_memory.py --model 505m --malloc shipped   # ~8 min

A transformers Qwen3 (random weights: memory does not depend on the values; untied 32k vocabulary)
of 267M parameters (hidden 1024, 16 layers) or 505M (Qwen3-0.6B's body: hidden 1024, 28 layers,
head_dim 128) trains a few AdamW steps on a fixed global batch of random
tokens through the trainers' own path: `rlhf_core.distributed.Engine.prepare` (fully_shard per
decoder layer + root under fsdp2), `build_optimizer`, the fused completion-only log-probs. Each
run is a fresh process (`torchrun --nproc_per_node 2` for FSDP2); each reports its peak RSS (the
kernel's VmHWM, whole process: imports, model build, sharding, training) and the bytes of its
parameters, gradients and optimizer state as `Engine.describe` counts them for summary.json.

It also prints the memory model the README's "Several GPUs" table is computed from, checked
against the measured per-rank bytes: full fine-tuning with AdamW holds per parameter
    weights w + gradients w + two Adam moments 2 x 4 bytes  (w = 4 fp32, 2 bf16)
replicated under single/DDP, divided by the number of processes under FSDP2; a LoRA run holds
the frozen base at w bytes (divided under FSDP2) and the adapter's few parameters in full.
Each process also holds a fixed cost no sharding divides: ~0.73 GiB of imported libraries (torch,
transformers) and ~0.08 GiB more for the process group, and, under FSDP2, the one unit being
gathered with its unsharded gradient (the untied LM head, 2 x 125 MiB at 32k x 1024). So the ratio
falls towards 1/2 as the model grows: (b + S/2 + t) / (b + S) for state S.

The CPU allocator: glibc raises its mmap threshold (up to 32 MiB) the first time a large block is
freed, after which the transient gathers and unsharded gradients of every step come from the heap
and fragment it; RSS then keeps hundreds of MiB nobody uses. So the fsdp2 engine on CPU holds the
threshold at 128 KiB (`train.fsdp.cpu_mmap_threshold_mib`, glibc's initial value; see
`rlhf_core.fastpath.fix_mmap_threshold`). `--malloc` picks what each arm runs with:
`shipped` = as the trainers run (one process: glibc's default; FSDP2: the engine's 128 KiB),
`default` = glibc's self-raising threshold in both arms (the engine's setting off), `release` =
128 KiB in both (MALLOC_MMAP_THRESHOLD_=131072), the like-for-like comparison. The held threshold
costs CPU step time (a page fault per fresh mapping); the seconds per step are printed but are
only as good as the machine's quiet. GPU memory does not have this issue (CUDA's caching
allocator).

Not measured here: GPU activations (they scale with micro-batch x sequence length, and gradient
checkpointing cuts them to about one layer's) and the CUDA context; the table leaves a reserve.

Not a test: nothing here is asserted, the numbers are written to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import peak_rss_mb, write_results  # noqa: E402

MODELS = {
    "267m": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
             "vocab_size": 32000, "tie_word_embeddings": False},
    "505m": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "vocab_size": 32000, "tie_word_embeddings": False},
}  # fmt: skip
# allocator settings: (environment of both arms, whether the fsdp2 arm keeps the engine's own
# mmap threshold (train.fsdp.cpu_mmap_threshold_mib) or turns it off)
MALLOC = {
    "shipped": ({}, True),  # as the trainers run: single keeps freed memory, fsdp2 fixes 128 KiB
    "default": ({}, False),  # glibc's self-raising threshold in both arms
    "release": ({"MALLOC_MMAP_THRESHOLD_": "131072"}, False),  # 128 KiB fixed in both arms
}
GLOBAL_BATCH, SEQ, STEPS = 4, 64, 3
KINDS = ("params", "grads", "optim")


def worker(out: Path, engine_name: str, model_name: str, engine_mmap: bool) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlhf_core.distributed import Engine, FSDPConfig
    from rlhf_core.fastpath import SpeedConfig, start_speed
    from rlhf_core.logprobs import causal_lm_selected_logprobs
    from rlhf_core.loop import clip_grad_norm, start_accelerator
    from rlhf_core.optim import OptimConfig, build_optimizer

    class Loop:
        threads, device = None, "cpu"

    accelerator, _ = start_accelerator(Loop)
    fsdp = FSDPConfig() if engine_mmap else FSDPConfig(cpu_mmap_threshold_mib=None)
    engine = Engine(accelerator, engine_name, fsdp)
    speed = SpeedConfig(allocator=engine_mmap)  # the trainers' allocator policy (start_engine)
    start_speed(speed, "cpu", engine.name, fsdp.cpu_mmap_threshold_mib)
    torch.manual_seed(0)
    spec = MODELS[model_name]
    model = Qwen3ForCausalLM(Qwen3Config(**spec)).train()
    n_params = sum(p.numel() for p in model.parameters())
    model = engine.prepare(model)
    optimizer = engine.prepare_optimizer(build_optimizer(model, OptimConfig(lr=1e-5)))
    ids = torch.randint(0, spec["vocab_size"], (GLOBAL_BATCH, SEQ), generator=torch.Generator()
                        .manual_seed(1))[engine.rank :: engine.world]  # fmt: skip
    mask = torch.ones_like(ids)
    target = torch.zeros(ids.shape[0], SEQ - 1, dtype=torch.bool)
    target[:, SEQ // 2 :] = True
    losses, seconds = [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        logps = causal_lm_selected_logprobs(model, ids, mask, target)
        loss = -logps.sum() / (target.sum() * engine.world) * engine.world
        accelerator.backward(loss)
        clip_grad_norm(accelerator, model, 1.0)
        optimizer.step()
        facts = engine.describe([model], [optimizer])  # grads still allocated: the peak state
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(accelerator.reduce(loss.detach(), reduction="sum")) / engine.world)
        seconds.append(time.perf_counter() - start)
    peaks = [peak_rss_mb()]
    if engine.world > 1:
        from accelerate.utils import gather_object

        peaks = gather_object(peaks)
    if accelerator.is_main_process:
        out.write_text(json.dumps({"engine": engine.name, "processes": engine.world,
                                   "params": n_params, "peak_rss_mb_per_rank": peaks,
                                   "losses": losses, "step_seconds": seconds,
                                   **facts}))  # fmt: skip


def run(engine: str, nproc: int, tmp: Path, model: str, malloc: str) -> dict:
    out = tmp / f"{engine}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env.update(MALLOC[malloc][0])
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    cmd = [sys.executable, __file__, "--worker", "--engine", engine, "--out", str(out),
           "--model", model, *(["--engine-mmap"] if MALLOC[malloc][1] else [])]  # fmt: skip
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", "29533", *cmd[1:]]  # fmt: skip
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


GIB = 1 << 30


def state_bytes(params: float, *, processes: int, sharded: bool, lora_share: float = 0.0,
                weight_bytes: int = 4) -> dict[str, float]:  # fmt: skip
    """Per-process bytes of weights, gradients and AdamW state (the memory model above).
    `lora_share`: trainable adapter parameters as a share of the base (0 = full fine-tuning)."""
    div = processes if sharded else 1
    trainable = params * lora_share if lora_share else params
    weights = params * weight_bytes / div
    if lora_share:
        weights += trainable * 4 / div  # fp32 adapter
    grads = trainable * (4 if lora_share else weight_bytes) / div
    return {"params": weights, "grads": grads, "optim": trainable * 8 / div}


def fits_table(gpu_gib: tuple[int, ...] = (24, 48, 80), reserve_gib: float = 6.0) -> str:
    """Markdown: which (model, engine, mode) fit a GPU of each size on 8 GPUs, bf16 weights."""
    rows = ["| model | mode | engine (8 GPUs) | weights+grads+Adam per GPU | "
            + " | ".join(f"{g} GB" for g in gpu_gib) + " |",
            "| --- | --- | --- | --- | " + " | ".join("---" for _ in gpu_gib) + " |"]  # fmt: skip
    for name, params in (("0.6B", 0.6e9), ("1.7B", 1.7e9), ("4B", 4.0e9), ("8B", 8.2e9)):
        for mode, share in (("full", 0.0), ("LoRA r16", 0.005)):
            for engine, sharded in (("DDP", False), ("FSDP2", True)):
                # full: FSDP2 mixed precision keeps fp32 sharded weights (bf16 compute copies of
                # one layer at a time); DDP holds bf16 weights + fp32 Adam. LoRA: bf16 base.
                wb = 4 if (sharded and not share) else 2
                b = state_bytes(params, processes=8, sharded=sharded, lora_share=share,
                                weight_bytes=wb)  # fmt: skip
                total = sum(b.values()) / GIB
                cells = ["yes" if total + reserve_gib <= g else "no" for g in gpu_gib]
                rows.append(f"| {name} | {mode} | {engine} | {total:.1f} GiB | "
                            + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(rows)


def later_steps(run_: dict) -> float:
    """Mean seconds of the steps after the first (which also allocates the AdamW moments)."""
    return sum(run_["step_seconds"][1:]) / (len(run_["step_seconds"]) - 1)


def describe(one: dict, two: dict, malloc: str) -> list[str]:
    mib = 1 << 20
    lines = [f"\n### allocator: {malloc}\n"]
    for run_ in (one, two):
        for r, peak in enumerate(run_["peak_rss_mb_per_rank"]):
            b = {k: run_[f"memory/{k}_bytes_per_rank"][r] / mib for k in KINDS}
            lines.append(f"- {run_['engine']} rank {r}: peak RSS {peak:.0f} MiB; params "
                         f"{b['params']:.0f} MiB, grads {b['grads']:.0f} MiB, optimizer "
                         f"{b['optim']:.0f} MiB")  # fmt: skip
    ratio = max(two["peak_rss_mb_per_rank"]) / one["peak_rss_mb_per_rank"][0]
    lines.append(f"\nFSDP2 x2 per-rank peak RSS / one process ({malloc}): **{ratio:.2f}**\n")
    n = one["params"]
    for label, run_, procs, sharded in (("single", one, 1, False), ("fsdp2", two, 2, True)):
        model = state_bytes(n, processes=procs, sharded=sharded)
        measured = {k: run_[f"memory/{k}_bytes_per_rank"][0] for k in model}
        err = max(abs(measured[k] - model[k]) / model[k] for k in model)
        lines.append(f"- memory model vs measured bytes ({label}, rank 0): max relative error "
                     f"{err:.4f}")  # fmt: skip
    lines.append(f"- losses single {one['losses']}, fsdp2 {two['losses']}")
    lines.append(f"- FSDP2 units: {len(two['fsdp/units'])} ({', '.join(two['fsdp/units'][:2])}, "
                 f"..., {', '.join(two['fsdp/units'][-2:])})")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--engine", default="single")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", choices=list(MODELS), default="267m")
    ap.add_argument("--engine-mmap", action="store_true")
    ap.add_argument(
        "--malloc",
        choices=list(MALLOC),
        nargs="+",
        default=list(MALLOC),
        help="allocator settings to measure (each: one process, then FSDP2 x2): shipped = as "
        "the trainers run (fsdp2 on CPU fixes glibc's mmap threshold at 128 KiB, single keeps "
        "glibc's default); default / release = glibc's default / 128 KiB in both arms",
    )
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.engine, args.model, args.engine_mmap)
        return
    results: dict[str, dict] = {}
    mib = 1 << 20
    lines: list[str] = []
    for malloc in args.malloc:
        with tempfile.TemporaryDirectory() as tmp:
            one = run("single", 1, Path(tmp), args.model, malloc)
            two = run("fsdp2", 2, Path(tmp), args.model, malloc)
        ratio = max(two["peak_rss_mb_per_rank"]) / one["peak_rss_mb_per_rank"][0]
        results[malloc] = {"single": one, "fsdp2": two, "peak_ratio": ratio}
        lines += describe(one, two, malloc)
    n = one["params"]
    head = [
        f"model: Qwen3 {args.model}, {n / 1e6:.0f}M parameters ({n * 4 / mib:.0f} MiB fp32), "
        f"global batch {GLOBAL_BATCH} x {SEQ} tokens, {STEPS} AdamW steps, CPU\n",
        "| allocator | one process | FSDP2 x2 (max rank) | ratio | s/step one / FSDP2 x2 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for malloc, r in results.items():
        head.append(f"| {malloc} | {r['single']['peak_rss_mb_per_rank'][0]:.0f} MiB | "
                    f"{max(r['fsdp2']['peak_rss_mb_per_rank']):.0f} MiB | "
                    f"**{r['peak_ratio']:.2f}** | {later_steps(r['single']):.1f} / "
                    f"{later_steps(r['fsdp2']):.1f} |")  # fmt: skip
    lines = head + lines
    lines.append("\nWhat fits (weights + gradients + AdamW; 6 GiB kept for activations/CUDA):\n")
    lines.append(fits_table())
    text = "\n".join(lines) + "\n"
    print(text)
    stem = "fsdp2_memory" if args.model == "267m" else f"fsdp2_memory-{args.model}"
    write_results(stem, {"model": args.model, **results}, text)


if __name__ == "__main__":
    main()
