"""Measurement plumbing shared by the benchmarks: peak RSS, fresh worker processes, medians, the
machine description, and result files.

Peak RSS is the kernel's high-water mark of the process's resident memory (`VmHWM` in
/proc/self/status, the same figure `getrusage(RUSAGE_SELF).ru_maxrss` reports). Every measured run
is its own fresh `python -m ...` process started from a small parent that never imports torch, so
the figure belongs to that run alone. `reset_peak_rss` writes 5 to /proc/self/clear_refs (Linux >=
4.0), which restarts the high-water mark, so one phase of a run (the timed training steps) can be
measured on its own; `PeakRSS` keeps the maximum over such resets (the whole-process peak).

Not here: anything that imports torch at module level (the parent process must stay small).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# ----------------------------------------------------------------------------- memory


def _status_mb(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")
    return int(match.group(1)) / 1024


def rss_mb() -> float:
    """Resident memory of this process now, MiB."""
    return _status_mb("VmRSS")


def malloc_trim() -> bool:
    """Hand glibc's free heap back to the kernel (`malloc_trim(0)`), so freed pages stop counting
    in RSS; False where there is no glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def peak_rss_mb() -> float:
    """High-water mark of resident memory since start (or the last reset), MiB."""
    return _status_mb("VmHWM")


def reset_peak_rss() -> bool:
    """Restart the high-water mark at the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakRSS:
    """Peak RSS of the whole process across phases: `phase()` closes a phase and starts the next.

    `phases` maps each closed phase's name to its own peak (MiB); `overall()` is the maximum."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.resettable = True

    def phase(self, name: str) -> float:
        peak = peak_rss_mb()
        self.phases[name] = peak
        self.resettable = reset_peak_rss() and self.resettable
        return peak

    def overall(self) -> float:
        return max([peak_rss_mb(), *self.phases.values()])


# ----------------------------------------------------------------------------- workers


#: Set to 1 in the environment of a benchmark command to run *every* measured process, the
#: peer's too, with glibc keeping freed memory (what our trainers do on the CPU since
#: `train.speed.allocator`): the comparison in which neither arm pays glibc's page faults.
RETAIN_ALL = "RLHF_BENCH_RETAIN_FREED_MEMORY"
#: The glibc setting `rlhf_core.fastpath.retain_freed_memory` applies, as a startup tunable.
RETAIN_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"


def worker_env(threads: int) -> dict[str, str]:
    """Environment of a measured process: fixed thread counts, no network, quiet libraries;
    with `RLHF_BENCH_RETAIN_FREED_MEMORY=1`, glibc keeping freed memory in every arm."""
    env = dict(os.environ)
    if env.get(RETAIN_ALL) == "1":
        env["GLIBC_TUNABLES"] = RETAIN_TUNABLES
    env.update({
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "WANDB_MODE": "disabled",
        "PYTHONWARNINGS": "ignore",
    })  # fmt: skip
    return env


def run_worker(
    module: str,
    args: list[str],
    *,
    threads: int,
    timeout: float,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run `python -m module *args --result FILE` in a fresh process and return FILE's JSON.
    `env` adds to `worker_env(threads)`.

    Added: `process_wall_s` (the whole process, imports included) and `load_average_before`
    (the 1-minute load average when it started: other work on a shared machine shows here)."""
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, *args, "--result", str(result)]
        load = round(os.getloadavg()[0], 2)
        start = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env=worker_env(threads) | (env or {}), capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not result.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            raise RuntimeError(
                f"worker {' '.join(cmd[2:])} failed (exit {proc.returncode}):\n{tail}"
            )
        out = json.loads(result.read_text())
    out["process_wall_s"] = wall
    out["load_average_before"] = load
    return out


def write_result_file(path: str | Path, payload: dict[str, Any]) -> None:
    """A worker's answer to its parent (atomic, so a crash never leaves half a file)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- statistics


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def phase_medians(records: list[dict[str, Any]], before_loop_mb: float) -> list[dict[str, Any]]:
    """Per phase of a step, in step order: the medians of its peak and end RSS (and, where every
    record has one, of its RSS after `malloc_trim`) over the steps after the first, with the peak
    above the RSS before the loop. `records`: {"step", "phase", "peak_mb", "rss_end_mb"[,
    "rss_trimmed_mb"]} per phase and step (`benchmarks.dpo_memory`, `benchmarks.grpo_memory`)."""
    later = [r for r in records if r["step"] >= 1 and r["phase"] != "end"]
    rows = []
    for name in dict.fromkeys(r["phase"] for r in later):
        mine = [r for r in later if r["phase"] == name]
        peak, end = median([r["peak_mb"] for r in mine]), median([r["rss_end_mb"] for r in mine])
        row = {"phase": name, "peak_mb": peak, "rss_end_mb": end,
               "peak_above_loop_start_mb": peak - before_loop_mb}  # fmt: skip
        if all("rss_trimmed_mb" in r for r in mine):
            row["rss_trimmed_mb"] = median([r["rss_trimmed_mb"] for r in mine])
        rows.append(row)
    return rows


def spread(values: list[float]) -> str:
    """`min-max` of a list, for the tables."""
    return f"{min(values):.4g}-{max(values):.4g}"


# ----------------------------------------------------------------------------- reporting


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_capability() -> str:
    """The vector instruction set torch's CPU kernels dispatch to here
    (`torch.backends.cpu.get_cpu_capability()`: "AVX512", "AVX2", "DEFAULT", ...). Asked of a
    short child process when torch is not imported yet, so the parent stays small."""
    if "torch" in sys.modules:
        return sys.modules["torch"].backends.cpu.get_cpu_capability()
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        cpu = match.group(1).strip() if match else cpu
    meminfo = Path("/proc/meminfo")
    mem_gib = None
    if meminfo.is_file():
        match = re.search(r"^MemTotal:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
        mem_gib = round(int(match.group(1)) / 2**20, 1) if match else None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        "cpu": cpu,
        "cpu_capability": cpu_capability(),
        "cores_available": cores,
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "every_arm_retains_freed_memory": os.environ.get(RETAIN_ALL) == "1",
        "versions": {
            d: _version(d) for d in ("torch", "transformers", "trl", "accelerate", "datasets")
        },
    }


def timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def write_results(
    stem: str, payload: dict[str, Any], markdown: str, *, latest: bool = True
) -> tuple[Path, Path]:
    """`results/<stem>.json` and `.md`, plus (`latest`) `results/latest.md`, the newest table of
    the headline run (`benchmarks.run`)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS_DIR / f"{stem}.json"
    md_path = RESULTS_DIR / f"{stem}.md"
    for path, text in ((json_path, json.dumps(payload, indent=1) + "\n"), (md_path, markdown)):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    if latest:
        newest = RESULTS_DIR / "latest.md"
        tmp = newest.with_suffix(".md.tmp")
        tmp.write_text(markdown)
        os.replace(tmp, newest)
    return json_path, md_path
