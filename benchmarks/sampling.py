"""What top-p sampling's nucleus costs per decode step: `keep_nucleus` (settle each row from its
top-64 / top-1024 candidates, sort only rows whose nucleus is larger) against sorting every row
of the vocabulary (`_nucleus_by_sort`, transformers' `TopPLogitsWarper` way), same kept sets.

Workloads, 64 rows each (a GRPO batch of 8 prompts x 8 samples), float32, top-p 0.9 (and the
`--top-p` given):
- `model`: the next-token logits of a trained checkpoint (`--model DIR`, e.g. the quickstart's
  SFT model) at the first answer position of 64 spell_backward prompts, and the same logits at
  temperature 1.5 (flatter);
- synthetic rows `randn * scale` at the two tokenizer sizes we ship (GPT-2 50,257, Qwen2
  151,936) and three scales, from peaked to flat (the nucleus size is printed).

The two arms alternate after a warm-up; medians of wall time; one torch thread by default.

    uv run --group bench python -m benchmarks.sampling [--model DIR] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.measure import median


def _model_logits(model_dir: str, rows: int):
    import torch

    from rlhf_core.chat import render_prompt
    from rlhf_core.data import ReasoningGymSource, reasoning_gym_dataset
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

    cfg = ModelConfig(name_or_path=model_dir, dtype="fp32")
    tokenizer = load_tokenizer(cfg, padding_side="left")
    model = load_policy(cfg).eval()
    entries = reasoning_gym_dataset(ReasoningGymSource(task="spell_backward", size=rows, seed=1))
    prompts = [
        render_prompt(tokenizer, [{"role": "user", "content": e["question"]}], where="bench")
        for e in entries
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        return model(**enc).logits[:, -1].float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint dir for real logits")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    import torch

    from rlhf_core.generation import _nucleus_by_sort, keep_nucleus

    torch.set_num_threads(args.threads)
    workloads = {}
    if args.model:
        logits = _model_logits(args.model, 64)
        workloads[f"model T=1 (vocab {logits.shape[-1]})"] = logits
        workloads[f"model T=1.5 (vocab {logits.shape[-1]})"] = logits / 1.5
    g = torch.Generator().manual_seed(0)
    for vocab in (50_257, 151_936):
        for scale in (8.0, 4.0, 2.0):
            workloads[f"randn x {scale:g} (vocab {vocab})"] = (
                torch.randn(64, vocab, generator=g) * scale
            )

    tail = 1.0 - args.top_p
    results = []
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, threads {args.threads}, "
          f"top-p {args.top_p}, 64 rows")  # fmt: skip
    print("| workload | nucleus size (median, max) | sort (ms) | candidates (ms) | speed-up |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, logits in workloads.items():
        fast, full = (
            keep_nucleus(logits.clone(), args.top_p),
            _nucleus_by_sort(logits.clone(), tail),
        )
        assert torch.equal(torch.isinf(fast), torch.isinf(full)), name
        kept = (~torch.isinf(fast)).sum(-1).float()
        times: dict[str, list[float]] = {"sort": [], "candidates": []}
        for _ in range(args.repeats):
            for arm, fn in (("sort", lambda x: _nucleus_by_sort(x, tail)),
                            ("candidates", lambda x: keep_nucleus(x, args.top_p))):  # fmt: skip
                x = logits.clone()
                t0 = time.perf_counter()
                fn(x)
                times[arm].append(time.perf_counter() - t0)
        sort_ms, cand_ms = median(times["sort"]) * 1e3, median(times["candidates"]) * 1e3
        row = {"workload": name, "nucleus_median": kept.median().item(),
               "nucleus_max": kept.max().item(), "sort_ms": sort_ms, "candidates_ms": cand_ms,
               "speedup": sort_ms / cand_ms}  # fmt: skip
        results.append(row)
        print(f"| {name} | {kept.median():.0f}, {kept.max():.0f} | {sort_ms:.1f} | "
              f"{cand_ms:.1f} | {sort_ms / cand_ms:.2f}x |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"top_p": args.top_p, "threads": args.threads,
                                        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                        "rows": results}, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
