"""How `rlhf-lab compare` runs its trainings: one after another in this process (`jobs: 1`), or
`jobs` at a time in worker processes (`concurrent.futures`, spawn start method), the runs with
the largest `cost` first so that the workers finish together.

A run's result does not depend on `jobs`: each run seeds itself and sets its own torch thread
count (`train.threads`), so in a worker it trains exactly as it would alone with that thread
count (tests/rlhf_lab/test_compare.py). A worker writes each run's stdout and stderr to
`<out>/logs/<run>.log` (parallel output would interleave); this process prints one line when a
run starts and one when it finishes, with its wall time. When a run fails, the runs already
running finish, none is started, and `RunFailed` names the failed runs and their logs; every
finished run stays in place for `--resume`.

Why processes, not threads: the tiny models' small matrices gain little from a second intra-op
thread (docs/performance.md), while two runs at a time keep two cores busy.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the family of a run -> the module whose `train(cfg, RunArgs)` trains it
TRAINERS = {
    "policy_gradients": "policy_gradients.train",
    "direct_alignment": "direct_alignment.train",
}


class RunFailed(RuntimeError):
    """One or more runs of a compare failed; the message names each and its log (one line)."""


@dataclass(frozen=True)
class Run:
    """One training of the compare: `config` (a validated PGConfig / DAConfig) into out/<name>."""

    name: str
    family: str  # a key of TRAINERS
    config: Any
    config_path: str  # the YAML it was built from, recorded in the run dir
    preset: str
    cost: float = 1.0  # relative training time, only for the order (largest first)


def say(text: str) -> None:
    print(f"compare: {text}", file=sys.stderr, flush=True)


def train_run(run: Run, out: Path, resume: bool) -> dict[str, Any]:
    """Train `run` into out/<name> (with `resume`, a finished run is reused and one stopped
    part-way continues from its newest checkpoint); its summary.json plus `wall_s`."""
    from rlhf_core.config import RunArgs
    from rlhf_core.rundir import run_status

    t0, run_dir = time.perf_counter(), out / run.name
    done = run_status(run_dir).get("status") == "finished"
    if not (resume and done and (run_dir / "summary.json").is_file()):
        again = "auto" if resume and run_dir.exists() else None
        args = RunArgs(config_path=Path(run.config_path), output_dir=run_dir, resume=again)
        code = importlib.import_module(TRAINERS[run.family]).train(run.config, args)
        if code != 0:
            raise RuntimeError(f"compare: {run.name} exited with {code}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {**summary, "wall_s": summary.get("wall_time_s", time.perf_counter() - t0)}


def call_logged(log: Path, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """In a worker: `fn(*args)` with this process's stdout and stderr (file descriptors 1 and
    2, so C-level output too) appended to `log`. Returns {"result": ...} or, if it raised,
    {"error": "<type>: <message>"} with the traceback written to the log."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "a", encoding="utf-8") as f:
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
        try:
            return {"result": fn(*args)}
        except Exception as exc:  # reported to the parent by name; the traceback is in the log
            traceback.print_exc()
            return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def in_workers(
    tasks: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]], logs: Path, jobs: int,
) -> dict[str, Any]:  # fmt: skip
    """Run each task (name -> (fn, args), in the given order) in one of `jobs` worker processes,
    at most `jobs` at a time, `fn`'s output to logs/<name>.log; returns name -> result. A
    failure lets the running tasks finish, starts no other and raises `RunFailed`."""
    logs.mkdir(parents=True, exist_ok=True)
    queue, results, failed = list(tasks), {}, []
    running: dict[Future, tuple[str, float]] = {}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        try:
            while queue or running:
                while queue and len(running) < jobs and not failed:
                    name = queue.pop(0)
                    fn, args = tasks[name]
                    future = pool.submit(call_logged, logs / f"{name}.log", fn, *args)
                    running[future] = (name, time.perf_counter())
                    say(f"start {name} (log {logs / name}.log)")
                if failed:
                    queue.clear()
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    name, t0 = running.pop(future)
                    try:
                        outcome = future.result()
                    except Exception as exc:  # the worker died (killed, out of memory)
                        outcome = {"error": f"its worker process died ({type(exc).__name__})"}
                    wall = time.perf_counter() - t0
                    if "error" in outcome:
                        failed.append(f"{name} ({outcome['error']}; log {logs / name}.log)")
                        say(f"FAILED {name} after {wall:.0f} s: {outcome['error']}")
                    else:
                        results[name] = outcome["result"]
                        say(f"done {name} in {wall:.0f} s ({len(results)}/{len(tasks)})")
        except KeyboardInterrupt:  # the workers got the signal too: let them save and stop
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    if failed:
        raise RunFailed(
            f"compare: {len(failed)} run(s) failed: {'; '.join(failed)}; the {len(results)} "
            "finished here are kept: fix the cause and rerun with --resume"
        )
    return results


def train_runs(runs: list[Run], out: Path, *, resume: bool, jobs: int) -> dict[str, dict]:
    """Train every run (see the module docstring); run name -> its summary plus `wall_s`."""
    order = sorted(runs, key=lambda r: -r.cost)  # stable: equal costs keep the config's order
    if jobs == 1:
        results = {}
        for run in order:
            print(f"\n=== compare: {run.name} ({run.preset}) ===", file=sys.stderr, flush=True)
            results[run.name] = train_run(run, out, resume)
            say(f"done {run.name} in {results[run.name]['wall_s']:.0f} s")
    else:
        tasks = {run.name: (train_run, (run, out, resume)) for run in order}
        results = in_workers(tasks, out / "logs", jobs)
    return {run.name: results[run.name] for run in runs}
