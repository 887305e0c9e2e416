"""Where the time of one DPO step goes: torch.profiler tables for our shipped log-probs and for the
completion-only LM head prototype, on the DPO benchmark's median batch.

    uv run --group bench python -m benchmarks.profile_dpo [--threads 1] [--rows 12]

Prints, for each variant, the operators with the most self CPU time (one profiled run after a
warm-up) and the user/kernel CPU split of that run. Nothing is written to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path

from benchmarks.dpo import Workload, prepare
from benchmarks.techniques import Bench


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_dpo")
    parser.add_argument("--threads", type=int, default=Workload().threads)
    parser.add_argument("--rows", type=int, default=12, help="operators shown per variant")
    args = parser.parse_args(argv)
    w = dataclasses.replace(Workload(), threads=args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from torch.profiler import ProfilerActivity, profile

    with tempfile.TemporaryDirectory(prefix="rlhf-bench-prof-") as tmp:
        prepare(w, Path(tmp))
        bench = Bench(w, Path(tmp))
    print(
        f"batch {bench.batch_index + 1}: {bench.tokens} non-pad tokens, "
        f"{bench.batches[0]['input_ids'].numel()} positions, {w.threads} thread(s)"
    )
    for variant in ("shipped", "completion_head"):
        bench.run(variant)  # warm-up
        before = os.times()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            bench.run(variant)
        after = os.times()
        user, system = after.user - before.user, after.system - before.system
        print(f"\n== {variant}: CPU {user + system:.2f} s ({system / (user + system):.0%} kernel)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
