"""Short attention vs SDPA on the CPU, side by side: forward + backward of one masked attention
call, per shape, alternating the two in one process.

    sdpa   torch's `scaled_dot_product_attention` with the mask and `enable_gqa=True` (its CPU
           flash kernel; what `rlhf_core.attention._grouped_sdpa` calls above the key limit)
    short  `rlhf_core.attention.short_attention` (below it)

The shapes are a benchmark model's heads (`--model real`: 8 query heads over 4 key/value heads;
`wide`: 12 over 3; width 64) at the
lengths our trainers meet: a GRPO micro-batch's completions over prompt + completion keys, its
distinct prompts, longer completions, a DPO pair's packed segment (one row), and beyond the
crossover. Each shape gets a causal mask over its keys with left padding on some rows, as in
training. Reported: the median milliseconds of forward + backward, the ratio, the forward alone
without gradients (a reference model's or an evaluation's call), and the largest relative error
of each arm's output and gradients against float64 (the same inputs), so a speed-up is never
bought with accuracy.

    uv run --group bench python -m benchmarks.attention --threads 2 --dtype bf16 [--model wide]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from benchmarks.measure import median, timestamp, write_results

#: (name, rows, queries, keys)
SHAPES = [
    ("GRPO micro-batch: 32 completions x 32 tokens over 56 keys", 32, 32, 56),
    ("GRPO micro-batch: its 4 distinct prompts of 24 tokens", 4, 24, 24),
    ("16 completions x 96 tokens over 120 keys", 16, 96, 120),
    ("DPO pair segment: one row of 120 tokens", 1, 120, 120),
    ("16 completions x 128 tokens over 160 keys", 16, 128, 160),
    ("DPO pair segment: one row of 200 tokens", 1, 200, 200),
    ("DPO pair segment: one row of 256 tokens", 1, 256, 256),
    ("DPO pair segment: one row of 384 tokens", 1, 384, 384),
    ("8 completions x 256 tokens over 300 keys", 8, 256, 300),
    ("4 completions x 512 tokens over 600 keys", 4, 512, 600),
]
#: (query heads, key/value heads) of the benchmark models (`benchmarks.workload.BENCH_MODELS`);
#: both have heads of width 64
MODEL_HEADS = {"real": (8, 4), "wide": (12, 3)}
WIDTH = 64


def measure(threads: int, dtype: str, repeats: int, model: str = "real") -> dict[str, Any]:
    import torch

    from rlhf_core.attention import short_attention

    torch.set_num_threads(threads)
    HEADS, KV_HEADS = MODEL_HEADS[model]  # noqa: N806 (constants of the shape measured)
    low = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]

    def sdpa(q, k, v, mask, scale):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )

    arms = {"sdpa": sdpa, "short": short_attention}
    rows_out = []
    for name, rows, queries, keys in SHAPES:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(rows, HEADS, queries, WIDTH, generator=g, dtype=torch.float64)
        k, v = (torch.randn(rows, KV_HEADS, keys, WIDTH, generator=g, dtype=torch.float64)
                for _ in range(2))  # fmt: skip
        grad = torch.randn(rows, HEADS, queries, WIDTH, generator=g, dtype=torch.float64)
        mask = torch.ones(rows, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
        mask[: rows // 2, :, :, :3] = False  # left padding on half the rows
        scale = WIDTH**-0.5

        def run(fn, dt, q=q, k=k, v=v, grad=grad, mask=mask, scale=scale):
            leaves = [x.detach().to(dt, copy=True).requires_grad_() for x in (q, k, v)]
            out = fn(*leaves, mask, scale)
            out.backward(grad.to(dt))
            return [out.detach()] + [x.grad for x in leaves]

        exact = run(sdpa, torch.float64)
        errors = {}
        for arm, fn in arms.items():
            got = run(fn, low)
            errors[arm] = max(
                float((a.double() - e).norm() / e.norm()) for a, e in zip(got, exact, strict=True)
            )

        def forward(fn, dt, q=q, k=k, v=v, mask=mask, scale=scale):
            with torch.no_grad():
                fn(q.to(dt), k.to(dt), v.to(dt), mask, scale)

        def timed(call) -> dict[str, float]:
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            for arm in arms:
                call(arms[arm], low)  # warm-up
            for r in range(repeats):
                for arm in arms if r % 2 == 0 else reversed(list(arms)):
                    start = time.perf_counter()
                    call(arms[arm], low)
                    times[arm].append(time.perf_counter() - start)
            return {arm: 1e3 * median(t) for arm, t in times.items()}

        ms, forward_ms = timed(run), timed(forward)
        rows_out.append({"shape": name, "rows": rows, "queries": queries, "keys": keys,
                         "ms": ms, "forward_ms": forward_ms, "max_rel_error": errors,
                         "sdpa_over_short": ms["sdpa"] / ms["short"]})  # fmt: skip
        print(f"  {name}: sdpa {ms['sdpa']:.2f} ms, short {ms['short']:.2f} ms", flush=True)
    return {"threads": threads, "dtype": dtype, "repeats": repeats, "model": model, "heads": HEADS,
            "kv_heads": KV_HEADS, "width": WIDTH, "load_average": os.getloadavg(),
            "torch": torch.__version__, "shapes": rows_out}  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"### Short attention vs SDPA (CPU flash kernel): forward + backward of one masked call, "
        f"{r['dtype']}, {r['threads']} threads, {r['heads']} query heads over {r['kv_heads']} "
        f"key/value heads of width {r['width']}; median of {r['repeats']}, alternating; torch "
        f"{r['torch']}; load average {', '.join(f'{x:.1f}' for x in r['load_average'])}",
        "",
        "| shape | SDPA ms | short ms | SDPA / short | forward only (no grad): SDPA ms | "
        "short ms | max rel. error vs float64: SDPA | short |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in r["shapes"]:
        lines.append(
            f"| {s['shape']} | {s['ms']['sdpa']:.2f} | {s['ms']['short']:.2f} | "
            f"{s['sdpa_over_short']:.2f}x | {s['forward_ms']['sdpa']:.2f} | "
            f"{s['forward_ms']['short']:.2f} | {s['max_rel_error']['sdpa']:.2e} | "
            f"{s['max_rel_error']['short']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", choices=tuple(MODEL_HEADS), default="real",
                        help="whose heads: real (8 over 4) or wide (12 over 3)")  # fmt: skip
    a = parser.parse_args(argv)
    result = measure(a.threads, a.dtype, a.repeats, a.model)
    text = markdown(result)
    name = f"{timestamp()}-attention-{a.model}-{a.dtype}"
    paths = write_results(name, result, text, latest=False)
    print("\n" + text + f"\nwrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
