"""The GPU proof's smoke mode (`bash scripts/gpu_proof.sh --smoke`, docs/gpu_proof.md): the same
script end to end on the CPU at a tiny shape writes gpu_proof.json / .md with every part passed,
the cuda tests skipped each with its reason, the CPU-only speed paths recorded off on CUDA and
the benchmark's figures; and its CPU-only check does see a path that is on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

PATHS = (
    "segmented rows",
    "our CPU SDPA dispatch (short attention, grouped heads, segments_pay)",
    "grouped decode attention",
    "reserved KV cache",
    "lean RMSNorms",
    "glibc allocator (retain_freed_memory / mmap threshold)",
)


def proof_module():
    spec = importlib.util.spec_from_file_location("gpu_proof", REPO / "scripts" / "gpu_proof.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_cpu_only_check_sees_a_path_that_is_on():
    # the same predicates on a CPU plan, where every path is on: none may pass as off
    from transformers import AutoConfig

    from rlhf_core.fastpath import SpeedConfig, plan_speed

    proof = proof_module()
    assert tuple(proof.CPU_ONLY) == PATHS
    spec = {k: v for k, v in proof_module_spec().items() if k != "architectures"}
    config = AutoConfig.for_model(**spec)
    cpu = plan_speed(config, device="cpu", dtype=torch.bfloat16, attention="sdpa",
                     speed=SpeedConfig(), allocator="retain")  # fmt: skip
    assert cpu.layout == "segmented"  # the Qwen3-0.6B shape pays for segmented rows on a CPU
    on = [path for path, (is_off, _) in proof.CPU_ONLY.items() if is_off(cpu)]
    assert not on, on
    cuda = plan_speed(config, device="cuda", dtype=torch.bfloat16, attention="sdpa",
                      speed=SpeedConfig())  # fmt: skip
    assert all(is_off(cuda) for is_off, _ in proof.CPU_ONLY.values())


def proof_module_spec() -> dict:
    """benchmarks.gpu's Qwen3-0.6B shape (loaded from its file: the repository root is not on
    sys.path under pytest)."""
    spec = importlib.util.spec_from_file_location("_gpu_bench", REPO / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.QWEN3_0P6B


@pytest.mark.slow
def test_smoke_mode_runs_end_to_end_and_writes_its_record(tmp_path):
    out = tmp_path / "proof"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("RLHF_CUDA_TESTS_ON_CPU", None)
    cmd = ["bash", "scripts/gpu_proof.sh", "--smoke", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "MiB of the 64 MiB carry" in done.stdout  # the wheels' and repository's sizes
    proof = json.loads((out / "gpu_proof.json").read_text())
    assert proof["mode"] == "smoke" and proof["ok"] is True
    for part in ("environment", "cpu_only_paths", "benchmark", "cuda_tests"):
        assert proof[part]["ok"] is True, (part, proof[part])
    assert all(v == "ok" for v in proof["environment"]["imports"].values())
    assert proof["environment"]["machine"]["cpu_capability"] not in ("", "unknown")

    paths = proof["cpu_only_paths"]
    assert set(paths["paths"]) == set(PATHS) and all(p["off"] for p in paths["paths"].values())
    assert len(paths["plans_checked"]) == 12  # 2 shapes x 2 dtypes x 3 attention kinds
    allocators = paths["paths"][PATHS[-1]]["policy_by_engine"]
    assert set(allocators.values()) == {"torch's (not glibc's)"}

    tests = proof["cuda_tests"]["tests"]
    names = {n.split("[")[0] for n in tests}
    for want in ("test_cuda_trainers::test_sft", "test_cuda_trainers::test_reward_model",
                 "test_cuda_trainers::test_dpo", "test_cuda_trainers::test_policy_gradient",
                 "test_cuda_trainers::test_t5_policy_sft_and_grpo",
                 "test_cuda_numerics::test_packed_and_padded_logprobs_on_cuda_equal_the_cpu_in_float64",
                 "test_cuda_engines::test_greedy_decode_equals_generate_on_cuda",
                 "test_cuda_engines::test_fsdp2_world_size_one_trains_in_bf16_mixed_precision",
                 "test_cuda_engines::test_qlora_step_updates_only_the_adapter"):  # fmt: skip
        assert want in names, (want, sorted(names))
    if not torch.cuda.is_available():  # each skipped, with its reason
        for name, t in tests.items():
            assert t["outcome"] == "skipped" and "CUDA" in t["message"], (name, t)

    bench = proof["benchmark"]["summary"]
    rates = ("sft", "dpo", "grpo_generated", "grpo_training", "decode", "generate")
    for key in (f"{rate}_tokens_per_s" for rate in rates):
        assert bench[key] > 0, (key, bench)
    assert 0 < bench["grpo_generation_share"] < 1
    assert (out / "gpu.json").is_file() and (out / "gpu_proof_junit.xml").is_file()

    text = (out / "gpu_proof.md").read_text()
    assert "| **all** | **True** |" in text
    for path in PATHS:
        assert f"| {path} | True |" in text, path
    assert "test_cuda_trainers::test_sft | skipped" in text or "test_sft | passed" in text


def test_parting_margins_find_where_two_greedy_decodings_part_and_by_what_gap():
    """`benchmarks.gpu.parting_margins` on a real tiny model: `generate`'s own tokens against
    themselves part nowhere; a token changed by hand parts at its position with a gap of
    `generate`'s logits, far wider than bf16 rounding (not counted as a near-tie)."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.tiny import preset_dir

    # from its file: pysbd installs a top-level package also named `benchmarks`
    spec = importlib.util.spec_from_file_location("rlhf_lab_bench_gpu", REPO / "benchmarks/gpu.py")
    gpu = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    parting_margins, parting_text = gpu.parting_margins, gpu.parting_text

    model = AutoModelForCausalLM.from_pretrained(preset_dir("tiny-qwen3"), dtype=torch.float32)
    ids = torch.randint(10, 90, (4, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    eos = model.config.eos_token_id
    model.eval()
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                max_new_tokens=12, eos_token_id=eos, pad_token_id=0)  # fmt: skip
    theirs = theirs[:, ids.shape[1] :]
    assert parting_margins(model, ids, mask, theirs, theirs, eos)["rows"] == 0
    ours = theirs.clone()
    ours[2, 5] = (ours[2, 5] + 1) % 90
    parted = parting_margins(model, ids, mask, ours, theirs, eos)
    assert parted["rows"] == 1 and parted["first_position"] == [5]
    assert parted["gap"][0] > 0.05 and parted["near_tie"] == 0
    assert "part at token 5" in parting_text({"parting": parted})
