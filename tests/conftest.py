"""Shared test helpers: small configs for the tiny world, written as real YAML files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Under pytest-xdist each worker, and every process it starts, keeps to its own share of
    the cores (worker k of n: the k-th n-th of them). Most tests wait on a trainer subprocess
    whose default thread count is the cores it may use (rlhf_core.runtime.configure_threads):
    unpinned, on 2 cores, each took 2 threads that contended with the other worker's process."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not worker or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if count > len(cores):
        return
    share = len(cores) // count
    k = int(worker.removeprefix("gw"))
    os.sched_setaffinity(0, cores[k * share : (k + 1) * share])
    import torch

    torch.set_num_threads(share)


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_module(
    module: str, *args: str, cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run `python -m module args...` in a fresh interpreter (how users run trainers)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def tiny_sft_dict() -> dict:
    """A few-second SFT config on reasoning-gym spell_backward with the tiny-qwen3 preset."""
    rg = {"task": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 6}}
    return {
        "name": "test_sft",
        "seed": 0,
        "model": {"name_or_path": "tiny-qwen3"},
        "data": {
            "train": {"reasoning_gym": {**rg, "size": 256, "seed": 1}},
            "eval": {"reasoning_gym": {**rg, "size": 16, "seed": 10_000_000}},
            "max_length": 80,
        },
        "train": {
            "batch_size": 16,
            "max_steps": 6,
            "eval_every": 0,
            "eval_max_new_tokens": 8,
            "threads": 1,
        },
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "checkpoint": {"save_every": 0, "keep_last": 2},
        "tracking": {"log_every": 1, "plot_every": 0},  # no curves.png: ~1-2 s a run
    }


def start_module(module: str, *args: str, cwd: Path) -> subprocess.Popen:
    """Start `python -m module args...` in the background, output captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_checkpoint(proc: subprocess.Popen, ckpt: Path, timeout: float = 240) -> None:
    """Poll until `ckpt` is a complete checkpoint; fail if the process ends first."""
    deadline = time.time() + timeout
    while not (ckpt / "trainer_state.pt").is_file():
        if proc.poll() is not None:
            pytest.fail(f"run ended before {ckpt.name}:\n{proc.stdout.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"no {ckpt.name} after {timeout} s")
        time.sleep(0.005)


def metric_series(run_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def assert_kill_resume_reproduces(
    module: str, cfg_path: Path, tmp_path: Path, *, kill_after: int, total_steps: int
) -> None:
    """Run once uninterrupted; run again, SIGKILL it after checkpoint-<kill_after>, resume with
    --resume auto; every logged train/loss and every final parameter must be identical."""
    import torch
    from safetensors.torch import load_file

    ref = run_module(module, "--config", str(cfg_path), "--output-dir", str(tmp_path / "ref"),
                     cwd=tmp_path)  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]

    killed = tmp_path / "killed"
    proc = start_module(module, "--config", str(cfg_path), "--output-dir", str(killed),
                        cwd=tmp_path)  # fmt: skip
    wait_for_checkpoint(proc, killed / "checkpoints" / f"checkpoint-{kill_after}")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "final").exists()

    resumed = run_module(module, "--config", str(cfg_path), "--output-dir", str(killed),
                         "--resume", "auto", cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr

    ref_losses = metric_series(tmp_path / "ref", "train/loss")
    res_losses = metric_series(killed, "train/loss")
    assert sorted(res_losses) == list(range(1, total_steps + 1))
    assert res_losses == ref_losses  # exact float equality, every step
    weights = sorted((tmp_path / "ref" / "final").glob("*.safetensors"))
    assert weights
    for path in weights:
        a, b = load_file(path), load_file(killed / "final" / path.name)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


@pytest.fixture
def tiny_dpo_dict() -> dict:
    """DPO on 32 synthetic spell_backward pairs with the tiny-qwen3 preset."""
    rg = {"task": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 8}}
    return {
        "name": "test_dpo",
        "seed": 0,
        "model": {"name_or_path": "tiny-qwen3"},
        "data": {
            "train": {"reasoning_gym": {**rg, "size": 32, "seed": 1}},
            "eval": {"reasoning_gym": {**rg, "size": 16, "seed": 10_000_000}},
            "max_length": 80,
        },
        "loss": {"name": "dpo", "beta": 0.1},
        "reference": {"mode": "model"},
        "train": {"batch_size": 8, "max_steps": 4, "threads": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "checkpoint": {"save_every": 0},
        "tracking": {"log_every": 1, "plot_every": 0},  # no curves.png: ~1-2 s a run
    }


@pytest.fixture(scope="session")
def sft_checkpoint(tmp_path_factory) -> Path:
    """The shipped tiny SFT recipe (configs/instruction_tuning/tiny_sft.yaml, 300 steps, no
    held-out eval): a tiny-qwen3 partly right on spell_backward, shared by the RL tests. Measured
    here: held-out greedy exact match ~0.7, sampled (T=1) ~0.17, partial-credit reward ~0.67."""
    from instruction_tuning.config import SFTConfig
    from instruction_tuning.train import train
    from rlhf_core.config import RunArgs, load_config

    # Under pytest-xdist every worker is its own session: the first to get here trains, into
    # the directory all workers share, and the others wait on the lock and reuse its final/.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / "sft_checkpoint"
    with FileLock(str(shared / "sft_checkpoint.lock")):
        if not (out / "final" / "config.json").exists():
            path = REPO / "configs" / "instruction_tuning" / "tiny_sft.yaml"
            cfg = load_config(SFTConfig, path, ["data.eval=null", "checkpoint.save_every=0"])
            assert train(cfg, RunArgs(config_path=path, output_dir=out)) == 0
    return out / "final"


def tiny_pg_dict(model_path: Path, **algorithm) -> dict:
    """A seconds-long policy-gradient config on spell_backward from `model_path`."""
    rg = {"task": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 10}}
    return {
        "name": "test_pg",
        "seed": 0,
        "model": {"name_or_path": str(model_path)},
        "data": {
            "train": {"reasoning_gym": {**rg, "size": 2000, "seed": 1}},
            "eval": {"reasoning_gym": {**rg, "size": 16, "seed": 10_000_000}},
        },
        "rewards": [{"name": "reasoning_gym", "extract": "full"}],
        "algorithm": algorithm,
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 12},
        "train": {"max_steps": 2, "micro_batch_size": 16, "threads": 1},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"save_every": 0},
        "tracking": {"log_every": 1, "plot_every": 0},  # no curves.png: ~1-2 s a run
    }


#: The name `flash_attention_stand_in` registers its attention function under ("flash" in it:
#: transformers and `rlhf_core.fastpath.plan_speed` treat it as flash attention).
FLASH_STAND_IN = "cpu_flash_varlen_stand_in"


def flash_attention_stand_in(monkeypatch, train_module) -> list[int]:
    """Make `train_module`'s `load_policy` give models whose attention is a CPU stand-in for a
    flash-attention kernel (which needs a GPU): registered under a flash name (its mask function
    passes no mask), it takes one row whose sequences are told apart by position ids restarting
    at 0 (the varlen layout) and runs causal SDPA on each sequence; anything else fails. Returns
    the list of sequence counts, one per attention call."""
    import torch
    import torch.nn.functional as F
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    calls: list[int] = []

    def varlen_sdpa(module, query, key, value, attention_mask, *, scaling=None, **kwargs):
        positions = kwargs["position_ids"]
        assert attention_mask is None and query.shape[0] == 1 == positions.shape[0]
        starts = (positions[0] == 0).nonzero().view(-1).tolist() + [positions.shape[1]]
        calls.append(len(starts) - 1)
        out = [
            F.scaled_dot_product_attention(
                query[:, :, a:b],
                key[:, :, a:b],
                value[:, :, a:b],
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            )
            for a, b in zip(starts, starts[1:], strict=False)
        ]
        return torch.cat(out, 2).transpose(1, 2).contiguous(), None

    AttentionInterface.register(FLASH_STAND_IN, varlen_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FLASH_STAND_IN, flash_attention_mask)
    load_policy = train_module.load_policy

    def load_with_stand_in(*args, **kwargs):
        # loading under a flash name would fetch a kernel: switch after loading, as transformers'
        # `set_attn_implementation` does, without its kernel check
        model = load_policy(*args, **kwargs)
        model.config._attn_implementation_internal = FLASH_STAND_IN
        return model

    monkeypatch.setattr(train_module, "load_policy", load_with_stand_in)
    return calls


def eos_prone_model(tokenizer, p_eos: float = 0.3, seed: int = 0) -> torch.nn.Module:  # noqa: F821 (imported inside)
    """A real (randomly initialised, one-layer) Qwen3 causal LM whose next-token distribution
    puts about `p_eos` on eos at every position, so turns end after a few tokens: every token's
    embedding carries a constant feature (dimension 0) and only eos's output row reads it."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    hidden, vocab, eos = 32, len(tokenizer), tokenizer.eos_token_id
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        max_position_embeddings=2048, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        # the final norm maps the feature to about sqrt(hidden); eos's logit = log-odds target
        target = math.log(p_eos / (1 - p_eos) * (vocab - 1))
        model.lm_head.weight[eos].zero_()
        model.lm_head.weight[eos, 0] = target / math.sqrt(hidden)
    return model.eval()
