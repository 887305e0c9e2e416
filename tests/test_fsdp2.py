"""FSDP2 (`train.engine: fsdp2`, torch `fully_shard` per decoder layer + root) under
`torchrun --nproc_per_node 2` on CPU (gloo) against one process with the same global batch.

Each 2-process run holds half of every parameter, gradient and optimizer state per process
(checked from summary.json); its per-step losses and final weights equal one process's within
fp32-after-Adam tolerance (see test_multiprocess.assert_same_run); evaluation and sampling run on
every process with the parameters gathered, rank 0 writes; a SIGKILLed sharded run resumes from
its torch.distributed.checkpoint shards to the uninterrupted run's weights; the gathered
Hugging Face `final/` loads in plain transformers and gives the trained model's logits.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, metric_series, tiny_pg_dict, wait_for_checkpoint, write_yaml
from test_multiprocess import assert_same_run, final_weights, free_port, launch

FSDP2 = "--set", "train.engine=fsdp2"


def assert_half_per_rank(run: Path, one: Path) -> None:
    """Each of the 2 processes holds about half of the one-process bytes, and says fsdp2."""
    two_s, one_s = (json.loads((r / "summary.json").read_text()) for r in (run, one))
    assert two_s["engine"] == "fsdp2" and one_s["engine"] == "single"
    for key in ("params", "grads", "optim"):
        whole = one_s[f"memory/{key}_bytes_per_rank"][0]
        parts = two_s[f"memory/{key}_bytes_per_rank"]
        assert len(parts) == 2 and all(0.45 * whole < p < 0.55 * whole for p in parts), key


def torchrun_cmd(module: str, cfg: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            "-m", module, "--config", str(cfg), "--output-dir", str(out), *extra]  # fmt: skip


def untied_copy(preset: str, target: Path) -> Path:
    """The preset with its LM head untied from the input embedding (a copy of it), as in
    Qwen3-8B: under FSDP2 the embedding and the head are then units of their own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.tiny import preset_dir

    model = AutoModelForCausalLM.from_pretrained(preset_dir(preset))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(preset_dir(preset)).save_pretrained(target)
    return target


def test_sft_fsdp2_equals_one_process_resumes_after_sigkill_and_final_loads(
    tiny_sft_dict, tmp_path
):
    data = tiny_sft_dict
    # untied: the embedding and the fused LM head run as FSDP2 units of their own
    data["model"]["name_or_path"] = str(untied_copy("tiny-qwen3", tmp_path / "untied"))
    data["train"].update(micro_batch_size=4, max_steps=4, eval_every=2)  # accumulation
    data["checkpoint"] = {"save_every": 2, "keep_last": 2}
    cfg = write_yaml(tmp_path / "sft.yaml", data)
    launch("instruction_tuning.train", cfg, tmp_path / "one", 1)
    launch("instruction_tuning.train", cfg, tmp_path / "two", 2, *FSDP2)
    assert_same_run(tmp_path / "one", tmp_path / "two", "train/loss")
    assert_half_per_rank(tmp_path / "two", tmp_path / "one")
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    units = set(summary["fsdp/units"])
    assert {"model.embed_tokens", "lm_head", "model.layers.0", "(root)"} <= units
    # glibc's mmap threshold held at 128 KiB on CPU (rlhf_core.fastpath.fix_mmap_threshold)
    assert summary["fsdp/cpu_mmap_threshold_fixed"] is (platform.libc_ver()[0] == "glibc")
    # every process evaluated its share with the parameters gathered: greedy metrics and the
    # eval loss equal one process's
    for key in ("eval/loss", "eval/greedy_exact_match", "eval/greedy_task_score"):
        one, two = (metric_series(tmp_path / r, key) for r in ("one", "two"))
        assert sorted(two) == [2, 4] and all(two[k] == pytest.approx(one[k]) for k in one), key
    ckpt = tmp_path / "two" / "checkpoints" / "checkpoint-4"
    assert (ckpt / "sharded" / ".metadata").is_file() and not (ckpt / "model.safetensors").exists()

    # the gathered final/ is a plain transformers model with the trained sharded model's eval
    # loss (computed by the sharded model, on both processes' shares, during the run)
    from transformers import AutoModelForCausalLM

    from instruction_tuning.data import build_sft_data
    from instruction_tuning.evaluate import evaluate
    from rlhf_core.data import DataSource
    from rlhf_core.models import ModelConfig, load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final")
    tokenizer = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="right")

    def build(split: str, exclude: set[str] | None = None):
        source = DataSource.model_validate(data["data"][split])
        return build_sft_data(source, tokenizer, fmt="auto", max_length=80,
                              max_prompt_length=None, where=split,
                              exclude_prompts=exclude)  # fmt: skip

    eval_data = build("eval", {e.prompt_text for e in build("train").examples})
    loaded = evaluate(model, tokenizer, eval_data, batch_size=64, max_new_tokens=8,
                      sampled=False, seed=0)  # fmt: skip
    assert loaded["eval/loss"] == pytest.approx(metric_series(tmp_path / "two", "eval/loss")[4])

    # SIGKILL a sharded run after its step-2 checkpoint; --resume auto reproduces the end point
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = torchrun_cmd("instruction_tuning.train", cfg, killed, *FSDP2)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    wait_for_checkpoint(proc, killed / "checkpoints" / "checkpoint-2")
    # torchrun and both workers: the workers by pid too (a kill of the group alone has let them
    # run on and finish the run, which --resume then rightly refuses as finished)
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()
    psutil.wait_procs(workers, timeout=60)
    proc.wait()
    assert not (killed / "final").exists()
    launch("instruction_tuning.train", cfg, killed, 2, *FSDP2, "--resume", "auto")
    w_two, w_resumed = final_weights(tmp_path / "two"), final_weights(killed)
    for key in w_two:
        torch.testing.assert_close(w_resumed[key], w_two[key], rtol=0, atol=1e-6, msg=key)
    two, resumed = (metric_series(r, "train/loss") for r in (tmp_path / "two", killed))
    assert resumed.keys() == two.keys() and all(resumed[k] == pytest.approx(two[k]) for k in two)


def test_dpo_lora_fsdp2_equals_one_process(tiny_dpo_dict, tmp_path):
    """A LoRA policy, sharded, whose reference is the same sharded model with its adapter
    disabled (a separately sharded frozen reference is the policy-gradient tests' `copy`)."""
    data = tiny_dpo_dict
    data["train"].update(batch_size=8, micro_batch_size=2, max_steps=3, eval_every=3,
                         samples_every=3, num_samples=4, sample_max_new_tokens=6)  # fmt: skip
    data["reference"] = {"mode": "adapter"}
    data["model"]["lora"] = {"r": 4, "alpha": 8}
    cfg = write_yaml(tmp_path / "dpo.yaml", data)
    launch("direct_alignment.train", cfg, tmp_path / "one", 1)
    launch("direct_alignment.train", cfg, tmp_path / "two", 2, *FSDP2)
    assert_same_run(tmp_path / "one", tmp_path / "two", "train/loss")
    for key in ("eval/loss", "eval/rewards/accuracy"):
        one, two = (metric_series(tmp_path / r, key) for r in ("one", "two"))
        assert one.keys() == two.keys() and all(two[k] == pytest.approx(one[k]) for k in one)
    # samples are drawn by every process (parameters gathered) and written once, by rank 0
    rows = (tmp_path / "two" / "samples.jsonl").read_text().splitlines()
    assert len(rows) == 4


def test_reward_model_fsdp2_equals_one_process(tmp_path):
    """A preference RM with the shared-prompt forward (the prompt's KV cache reused by chosen
    and rejected) sharded; evaluation on every process; the sequence-classification export."""
    import yaml

    data = yaml.safe_load((REPO / "configs/reward_models/tiny_preference.yaml").read_text())
    data["data"]["eval"]["reasoning_gym"]["size"] = 16
    data["train"].update(batch_size=8, micro_batch_size=2, max_steps=3, eval_every=3,
                         share_prompt=True)  # fmt: skip
    data["checkpoint"] = {"save_every": 0}
    data["tracking"] = {"log_every": 1}
    cfg = write_yaml(tmp_path / "rm.yaml", data)
    launch("reward_models.train", cfg, tmp_path / "one", 1)
    launch("reward_models.train", cfg, tmp_path / "two", 2, *FSDP2)
    assert_same_run(tmp_path / "one", tmp_path / "two", "train/loss")
    assert_half_per_rank(tmp_path / "two", tmp_path / "one")
    one, two = (metric_series(tmp_path / r, "eval/loss") for r in ("one", "two"))
    assert one.keys() == two.keys() == {3} and two[3] == pytest.approx(one[3])
    assert (tmp_path / "two" / "final-seqcls" / "config.json").is_file()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_policy_gradient_fsdp2_equals_one_process(tmp_path, algo):
    """GRPO (reference sharded, KL in the loss) and PPO (value model sharded, KL in the reward,
    GAE): every process decodes its own prompts with the policy gathered; the rollout log and
    the losses equal one process's."""
    import yaml
    from test_multiprocess import rollouts

    spec = yaml.safe_load((REPO / f"configs/policy_gradients/{algo}.yaml").read_text())
    algorithm = {**spec["algorithm"], "ppo_epochs": 2}
    # PPO whitens GAE advantages over the whole step's batch, across the processes
    data = tiny_pg_dict("tiny-qwen3", **algorithm)
    if algo == "ppo":  # a learned reward too: sharded at rest, gathered while it scores
        from rlhf_core.models import ModelConfig, load_tokenizer
        from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel

        torch.manual_seed(0)
        tiny = ModelConfig(name_or_path="tiny-qwen3")
        rm = ScalarHeadModel.from_config(tiny, ScalarHeadInfo(kind="preference", max_length=64))
        rm.tokenizer = load_tokenizer(tiny, padding_side="right")
        rm.save_pretrained(tmp_path / "rm")
        data["rewards"].append({"name": "reward_model", "path": str(tmp_path / "rm"),
                                "weight": 0.5, "device": "cpu"})  # fmt: skip
    data["data"]["eval"]["reasoning_gym"]["size"] = 8
    data["rollout"].update(prompts_per_step=4, group_size=4 if algo == "grpo" else 2,
                           max_new_tokens=8)  # fmt: skip
    data["train"].update(max_steps=2, micro_batch_size=4, eval_every=2)
    data["optim"]["lr"] = 1e-3
    cfg = write_yaml(tmp_path / f"{algo}.yaml", data)
    launch("policy_gradients.train", cfg, tmp_path / "one", 1)
    launch("policy_gradients.train", cfg, tmp_path / "two", 2, *FSDP2)
    assert_same_run(tmp_path / "one", tmp_path / "two", "train/loss")
    assert rollouts(tmp_path / "two") == rollouts(tmp_path / "one")
    for key in ("train/reward/total", "eval/greedy_reward", "eval/sampled_kl_k3"):
        one, two = (metric_series(tmp_path / r, key) for r in ("one", "two"))
        assert one and one.keys() == two.keys(), key
        assert all(two[k] == pytest.approx(one[k]) for k in one), key
    # loss components are micro-batch means weighted by each micro-batch's share of the step:
    # summed over the processes they are the step's mean (one process's, up to how the rows
    # fall into micro-batches); one process's share alone would be about half of it
    for key in ("train/loss/ratio_mean", "train/loss/entropy"):
        one, two = (metric_series(tmp_path / r, key) for r in ("one", "two"))
        assert one and one.keys() == two.keys(), key
        assert all(two[k] == pytest.approx(one[k], rel=0.1) for k in one), (key, one, two)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["engine"] == "fsdp2"
    assert_half_per_rank(tmp_path / "two", tmp_path / "one")  # the reward model's shards too


def test_t5_ppo_ddp_and_fsdp2_equal_one_process(tmp_path):
    """An encoder-decoder policy (the tiny-t5-facts preset) with PPO's T5 value model and
    reference: 2-process DDP and FSDP2 runs equal one process (the value model's forward goes
    through its wrapper, so DDP syncs its gradients; the decode loop's first call, T5's encoder,
    comes after the root's own forward set up FSDP2)."""
    import yaml

    data = yaml.safe_load((REPO / "configs/policy_gradients/holistic_ppo.yaml").read_text())
    data["model"]["name_or_path"] = "tiny-t5-facts"
    data["rewards"] = [{"name": "rouge", "weight": 1.0}]
    data["data"]["eval"]["limit"] = 4
    data["rollout"].update(prompts_per_step=4, max_new_tokens=12)
    data["train"].update(max_steps=2, micro_batch_size=4, eval_every=2)
    cfg = write_yaml(tmp_path / "t5_ppo.yaml", data)
    launch("policy_gradients.train", cfg, tmp_path / "one", 1)
    from test_multiprocess import rollouts

    for engine in ("ddp", "fsdp2"):
        launch("policy_gradients.train", cfg, tmp_path / engine, 2, "--set",
               f"train.engine={engine}")  # fmt: skip
        assert_same_run(tmp_path / "one", tmp_path / engine, "train/loss")
        assert rollouts(tmp_path / engine) == rollouts(tmp_path / "one")
