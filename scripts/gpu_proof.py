"""The GPU proof's driver (`bash scripts/gpu_proof.sh` runs it; docs/gpu_proof.md): on the
machine it runs on, it records what it is, checks that every CPU-only speed path of
`rlhf_core.fastpath` is off on CUDA, runs `pytest -m cuda` (tests/cuda) and `benchmarks.gpu`, and
writes gpu_proof.json and gpu_proof.md to `--out` after each part, so a run cut short still
leaves what it finished.

    python scripts/gpu_proof.py --out DIR            # on a GPU: Qwen3-0.6B shape, bf16
    python scripts/gpu_proof.py --out DIR --smoke    # on the CPU: the same parts at a tiny
                                                     # shape; the cuda tests skip with reasons

Files in DIR: gpu_proof.json, gpu_proof.md, gpu_proof_junit.xml and gpu_proof_pytest.log (the
cuda tests), gpu.json, gpu.md and gpu_bench.log (the benchmark). Exit status 0 when every part
passed (skips are not failures), 1 otherwise. Needs the repository's src/ and root on PYTHONPATH
(the shell script sets them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "wheels"
WHEEL_LIST = REPO / "scripts" / "gpu_wheels.txt"
#: wall-clock limits of the two long parts (the whole proof must fit one 10-minute device call,
#: 8 minutes planned)
PYTEST_TIMEOUT_S = {"full": 270, "smoke": 240}
BENCH_TIMEOUT_S = {"full": 180, "smoke": 240}
#: the benchmark's settings in the proof: fewer timed steps than its defaults and GRPO rollouts
#: of 128 new tokens (256 by default), to fit the time
BENCH_ARGS = ["--steps", "4", "--warmup", "1", "--grpo-new-tokens", "128"]
#: the packages whose versions the record names
PACKAGES = ("torch", "transformers", "peft", "accelerate", "tokenizers", "safetensors",
            "pydantic", "pydantic-core", "datasets", "pyarrow", "bitsandbytes", "flash-attn",
            "liger-kernel", "trl")  # fmt: skip
OUR_MODULES = ("rlhf_core.fastpath", "instruction_tuning.train", "reward_models.train",
               "direct_alignment.train", "policy_gradients.train", "benchmarks.gpu")  # fmt: skip


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    import torch

    from benchmarks.measure import machine

    cuda = torch.cuda.is_available()
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    imports = {}
    for module in OUR_MODULES:
        try:
            __import__(module)
            imports[module] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded, the part fails
            imports[module] = f"{type(exc).__name__}: {exc}"
    return {
        "python": platform.python_version(),
        "cuda_available": cuda,
        "device_name": torch.cuda.get_device_name() if cuda else "CPU",
        "cuda_version": torch.version.cuda,
        "machine": machine(),
        "packages": {d: version(d) for d in PACKAGES},
        "wheels_carried": {w.name: w.stat().st_size for w in wheels},
        "wheels_bytes": sum(w.stat().st_size for w in wheels),
        "imports": imports,
        "ok": all(v == "ok" for v in imports.values()),
    }


# ----------------------------------------------------------------------------- CPU-only paths

#: `rlhf_core.fastpath`'s allocator policy on CUDA: none of glibc's settings applied
TORCH_ALLOCATOR = "torch's (not glibc's)"
#: Each CPU-only speed path, how the plan shows it is off, and what "off" means.
CPU_ONLY = {
    "segmented rows": (lambda p: p.layout != "segmented" and p.row_tokens == 0,
                       "layout is not 'segmented', row_tokens 0"),
    "our CPU SDPA dispatch (short attention, grouped heads, segments_pay)": (
        lambda p: not p.cpu_attention and p.short_attention_keys == 0 and not p.dispatch,
        "cpu_attention off, short_attention_keys 0, no dispatch"),
    "grouped decode attention": (lambda p: not p.grouped_decode, "grouped_decode off"),
    "reserved KV cache": (lambda p: p.reserve_positions == 0, "reserve_positions 0"),
    "lean RMSNorms": (lambda p: not p.lean_norms, "lean_norms off"),
    "glibc allocator (retain_freed_memory / mmap threshold)": (
        lambda p: p.allocator == TORCH_ALLOCATOR, "torch's caching allocator, glibc untouched"),
}  # fmt: skip


def cpu_only_paths_off() -> dict[str, Any]:
    """Every CPU-only path of the speed plan off on CUDA: `rlhf_core.fastpath.plan_speed` for
    the benchmark's Qwen3-0.6B and tiny shapes, bf16 / fp32, SDPA / eager / flash attention,
    under the default switches (all on); the allocator policy for every engine; and, where a GPU
    is here, the plan of a real model on it (`speed_plan`)."""
    import torch
    from transformers import AutoConfig

    from benchmarks.gpu import QWEN3_0P6B, SMOKE
    from rlhf_core.fastpath import SpeedConfig, choose_allocator, plan_speed, speed_plan

    plans = {}
    for shape, spec in (("qwen3-0.6b", QWEN3_0P6B), ("tiny", SMOKE)):
        config = AutoConfig.for_model(**{k: v for k, v in spec.items() if k != "architectures"})
        for dtype in (torch.bfloat16, torch.float32):
            for attention in ("sdpa", "eager", "flash_attention_2"):
                name = f"{shape}/{str(dtype).removeprefix('torch.')}/{attention}"
                plans[name] = plan_speed(config, device="cuda", dtype=dtype, attention=attention,
                                         speed=SpeedConfig())  # fmt: skip
    if torch.cuda.is_available():
        from rlhf_core.models import ModelConfig, load_policy

        model = load_policy(ModelConfig(name_or_path="tiny-qwen3", dtype="bf16"), "cuda")
        plans["live: tiny-qwen3 on cuda, bf16"] = speed_plan(model)
    paths = {}
    for path, (is_off, meaning) in CPU_ONLY.items():
        bad = [name for name, plan in plans.items() if not is_off(plan)]
        paths[path] = {"off": not bad, "means": meaning, "on_in": bad}
    allocators = {
        engine: choose_allocator(
            "cuda", engine, enabled=True, mmap_threshold_mib=0.125, glibc=True
        )  # fmt: skip
        for engine in ("single", "ddp", "fsdp2")
    }
    paths["glibc allocator (retain_freed_memory / mmap threshold)"]["policy_by_engine"] = allocators
    if any(v != TORCH_ALLOCATOR for v in allocators.values()):
        paths["glibc allocator (retain_freed_memory / mmap threshold)"]["off"] = False
    return {
        "paths": paths,
        "plans_checked": sorted(plans),
        "live": any(name.startswith("live") for name in plans),
        "ok": all(p["off"] for p in paths.values()),
    }


# ----------------------------------------------------------------------------- parts


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", f"{REPO / 'src'}{os.pathsep}{REPO}")
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="disabled")  # fmt: skip
    return env


def run_logged(cmd: list[str], log: Path, timeout: float) -> dict[str, Any]:
    start = time.perf_counter()
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=child_env(), stdout=fh,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"command": " ".join(cmd), "returncode": rc,
            "seconds": round(time.perf_counter() - start, 1), "log": log.name}  # fmt: skip


def cuda_tests(out: Path, mode: str) -> dict[str, Any]:
    junit = out / "gpu_proof_junit.xml"
    # One process on the one GPU, and pyproject's `-n 2` dropped: the device installs only
    # scripts/gpu_wheels.txt, which has no pytest-xdist.
    cmd = [sys.executable, "-m", "pytest", "tests/cuda", "-m", "cuda", "-q", "-rs",
           "-o", "addopts=--strict-markers", "-p", "no:cacheprovider",
           f"--junitxml={junit}"]  # fmt: skip
    part = run_logged(cmd, out / "gpu_proof_pytest.log", PYTEST_TIMEOUT_S[mode])
    tests = {}
    if junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    outcome = {"failure": "failed"}.get(kind, kind)
                    message = (found.get("message") or found.text or "")[:500]
                    break
            tests[name] = {"outcome": outcome, "seconds": float(case.get("time", 0)),
                           "message": message}  # fmt: skip
    counts = {k: sum(t["outcome"] == k for t in tests.values())
              for k in ("passed", "failed", "error", "skipped")}  # fmt: skip
    part.update(tests=tests, counts=counts)
    ran = bool(tests) and part["returncode"] in (0, 5)  # 5: nothing collected to run
    part["ok"] = ran and counts["failed"] == counts["error"] == 0
    if mode == "full":  # on a GPU every test runs, QLoRA's where bitsandbytes was carried
        unexpected = [
            n for n, t in tests.items()
            if t["outcome"] == "skipped" and "bitsandbytes" not in t["message"]
        ]  # fmt: skip
        part["unexpected_skips"] = unexpected
        part["ok"] = part["ok"] and not unexpected
    return part


def benchmark(out: Path, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--out", str(out), *BENCH_ARGS]
    if mode == "smoke":
        cmd.append("--smoke")
    part = run_logged(cmd, out / "gpu_bench.log", BENCH_TIMEOUT_S[mode])
    result = out / "gpu.json"
    part["ok"] = part["returncode"] == 0 and result.is_file()
    if part["ok"]:
        r = json.loads(result.read_text())
        sd, g = r["sft_dpo"], r["grpo"]
        part["summary"] = {
            "device_name": r["device_name"], "dtype": r["dtype"], "attention": sd["attention"],
            "peak_tflops": r["peak_tflops"],
            "sft_tokens_per_s": sd["sft"]["tokens_per_s"], "sft_mfu": sd["sft"]["mfu"],
            "dpo_tokens_per_s": sd["dpo"]["tokens_per_s"], "dpo_mfu": sd["dpo"]["mfu"],
            "grpo_generated_tokens_per_s": g["generated_tokens_per_s"],
            "grpo_training_tokens_per_s": g["training_tokens_per_s"],
            "grpo_generation_share": g["share"]["generate_s"],
            "decode_tokens_per_s": g["decode_vs_generate"]["decode"]["tokens_per_s"],
            "generate_tokens_per_s": g["decode_vs_generate"]["generate"]["tokens_per_s"],
            "decode_speedup_vs_generate": g["decode_vs_generate"]["speedup"],
            "decode_rows_equal_generate": g["decode_vs_generate"]["rows_equal"],
            "decode_parting": g["decode_vs_generate"].get("parting"),
            "speed_plan": sd["speed_plan"],
        }  # fmt: skip
    return part


# ----------------------------------------------------------------------------- report


def render(proof: dict[str, Any]) -> str:
    env = proof.get("environment", {})
    lines = [
        f"# GPU proof ({proof['mode']}) on {env.get('device_name', '?')}",
        "",
        f"Started {proof['started']}, {proof.get('seconds', '?')} s; Python {env.get('python')}, "
        f"torch {env.get('packages', {}).get('torch')} (CUDA {env.get('cuda_version')}), CPU "
        f"capability {env.get('machine', {}).get('cpu_capability')}; carried wheels "
        f"{env.get('wheels_bytes', 0) / 2**20:.1f} MiB ({len(env.get('wheels_carried', {}))}).",
        "",
        "| part | ok |",
        "| --- | --- |",
    ]
    for name in ("environment", "cpu_only_paths", "cuda_tests", "benchmark"):
        if name in proof:
            lines.append(f"| {name} | {proof[name]['ok']} |")
    lines.append(f"| **all** | **{proof.get('ok')}** |")
    if "cpu_only_paths" in proof:
        lines += ["", "CPU-only speed paths on CUDA (`rlhf_core.fastpath`), "
                  f"{len(proof['cpu_only_paths']['plans_checked'])} plans checked "
                  f"(live model: {proof['cpu_only_paths']['live']}):", "",
                  "| path | off | means |", "| --- | --- | --- |"]  # fmt: skip
        for path, p in proof["cpu_only_paths"]["paths"].items():
            lines.append(f"| {path} | {p['off']} | {p['means']} |")
    if "cuda_tests" in proof:
        t = proof["cuda_tests"]
        lines += ["", f"`pytest -m cuda`: {t['counts']} in {t['seconds']} s "
                  f"(return code {t['returncode']}).", "",
                  "| test | outcome | s | message |", "| --- | --- | ---: | --- |"]  # fmt: skip
        for name, r in t["tests"].items():
            msg = r["message"].replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {name} | {r['outcome']} | {r['seconds']:.1f} | {msg} |")
    if "benchmark" in proof and "summary" in proof["benchmark"]:
        from benchmarks.gpu import parting_text

        b = proof["benchmark"]["summary"]
        lines += [
            "", f"Benchmark (`benchmarks.gpu`, {b['dtype']}, attention `{b['attention']}`, "
            f"measured matmul peak {b['peak_tflops']:.0f} TFLOP/s):", "",
            f"- SFT {b['sft_tokens_per_s']:.0f} tokens/s, MFU {b['sft_mfu']:.1%}; DPO "
            f"{b['dpo_tokens_per_s']:.0f} tokens/s, MFU {b['dpo_mfu']:.1%}",
            f"- GRPO: generated {b['grpo_generated_tokens_per_s']:.0f} tokens/s, training "
            f"{b['grpo_training_tokens_per_s']:.0f} tokens/s, generation "
            f"{b['grpo_generation_share']:.0%} of the step",
            f"- greedy decode {b['decode_tokens_per_s']:.0f} tokens/s vs `generate` "
            f"{b['generate_tokens_per_s']:.0f} ({b['decode_speedup_vs_generate']:.2f}x), rows "
            f"equal {b['decode_rows_equal_generate']:.0%}. "
            f"{parting_text({'parting': b.get('decode_parting')})}",
            "", "Full tables: gpu.md.",
        ]  # fmt: skip
    return "\n".join(lines) + "\n"


def write(out: Path, proof: dict[str, Any]) -> None:
    for name, text in (("gpu_proof.json", json.dumps(proof, indent=1, default=str) + "\n"),
                       ("gpu_proof.md", render(proof))):  # fmt: skip
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/gpu_proof.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--smoke", action="store_true", help="the CPU check at a tiny shape")
    parser.add_argument(
        "--skip-benchmark",
        action="store_true",
        help="leave the benchmark out (a rerun of the checks after a fix)",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    mode = "smoke" if args.smoke else "full"
    start = time.perf_counter()
    proof: dict[str, Any] = {"mode": mode, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def part(name: str, fn, *fn_args) -> None:
        print(f"gpu_proof: {name} ...", flush=True)
        try:
            proof[name] = fn(*fn_args)
        except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
            proof[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        proof["seconds"] = round(time.perf_counter() - start, 1)
        proof["ok"] = all(proof[k]["ok"] for k in proof if isinstance(proof[k], dict))
        write(out, proof)
        print(f"gpu_proof: {name} ok={proof[name]['ok']} ({proof['seconds']} s)", flush=True)

    part("environment", environment)
    if mode == "full" and not proof["environment"]["cuda_available"]:
        proof["environment"]["ok"] = False
        proof["environment"]["error"] = "no CUDA device: use --smoke on a CPU machine"
        write(out, proof)
        print("gpu_proof: no CUDA device here; --smoke checks the script on the CPU")
        return 1
    part("cpu_only_paths", cpu_only_paths_off)
    if not args.skip_benchmark:
        part("benchmark", benchmark, out, mode)
    part("cuda_tests", cuda_tests, out, mode)
    print(render(proof))
    return 0 if proof["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
