"""Direct alignment end to end on the tiny world: it learns the preferences, the three reference
modes agree, several models run from one config, and a killed run resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_kill_resume_reproduces,
    flash_attention_stand_in,
    metric_series,
    write_yaml,
)
from safetensors.torch import load_file

from direct_alignment.config import DAConfig
from direct_alignment.data import build_preference_data
from direct_alignment.losses import LOSSES
from direct_alignment.reference import pair_logps, precompute_reference, reference_pair_logps
from direct_alignment.train import main, train_all
from rlhf_core.config import ConfigError, RunArgs
from rlhf_core.data import DataSource
from rlhf_core.models import ModelConfig, ReferencePolicy, load_policy, load_tokenizer
from rlhf_core.preference import collate_pairs
from rlhf_core.tiny import preset_dir


def run_cfg(data: dict, out: Path) -> int:
    return train_all(DAConfig.model_validate(data), RunArgs(Path("t.yaml"), output_dir=out))


def test_dpo_on_32_pairs_reaches_high_train_reward_accuracy(tiny_dpo_dict, tmp_path):
    tiny_dpo_dict["train"].update(max_steps=16, eval_every=8, samples_every=8, num_samples=2)
    tiny_dpo_dict["checkpoint"]["save_every"] = 8
    assert run_cfg(tiny_dpo_dict, tmp_path / "run") == 0
    run = tmp_path / "run"
    accuracy = metric_series(run, "train/rewards/accuracy")
    # measured: 1.0 from step 5 on (8 pairs per step); the last four steps cover all 32 pairs
    assert min(accuracy[s] for s in (13, 14, 15, 16)) >= 0.9
    assert all(torch.isfinite(torch.tensor(v)) for v in metric_series(run, "train/loss").values())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval/rewards/accuracy"] > 0.5 and summary["train_pairs"] == 32
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [8, 8, 16, 16]
    start = load_file(preset_dir("tiny-qwen3") / "model.safetensors")
    final = load_file(run / "final" / "model.safetensors")
    for name, value in final.items():
        assert not torch.equal(value, start[name]), f"{name} did not change"


def test_micro_batches_train_as_one_forward_per_step(tiny_dpo_dict, tmp_path):
    """A step's pairs in micro-batches (less activation memory, as in the real-proportions
    benchmark) give the one-forward step: the same losses and the same weights."""
    tiny_dpo_dict["train"]["max_steps"] = 2
    tiny_dpo_dict["data"]["eval"] = None
    assert run_cfg(tiny_dpo_dict, tmp_path / "one") == 0
    tiny_dpo_dict["train"]["micro_batch_size"] = 2  # 8 pairs: 4 micro-batches
    tiny_dpo_dict["train"]["speed"] = {"fill_micro_batches": False}  # as configured
    assert run_cfg(tiny_dpo_dict, tmp_path / "micro") == 0
    one, micro = (metric_series(tmp_path / r, "train/loss") for r in ("one", "micro"))
    assert one.keys() == micro.keys() == {1, 2}
    for step in one:
        assert abs(one[step] - micro[step]) < 1e-6
    a, b = (load_file(tmp_path / r / "final" / "model.safetensors") for r in ("one", "micro"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)  # fp32 sums


@pytest.mark.parametrize("loss, merges", [("dpo", True), ("kto", False)])
def test_filled_micro_batches_make_fewer_forwards_and_train_the_same(
    tiny_dpo_dict, tmp_path, monkeypatch, loss, merges
):
    """The speed plan's filled micro-batches (`SpeedPlan.pair_token_budget`): packed pairs of
    1-pair micro-batches merge into forwards of up to 2 x max_length tokens. The losses and the
    weights are those of one forward per pair, up to float32 rounding; KTO, whose
    reference point is a batch mean, keeps its micro-batches."""
    import direct_alignment.train as da_train

    forwards: list[int] = []
    real_pair_logps = da_train.pair_logps

    def counted(model, batch):
        forwards.append(len(batch["lengths"]) // 2)
        return real_pair_logps(model, batch)

    monkeypatch.setattr(da_train, "pair_logps", counted)
    tiny_dpo_dict["loss"] = {"name": loss}
    tiny_dpo_dict["data"]["eval"] = None
    tiny_dpo_dict["train"].update(max_steps=2, micro_batch_size=1)
    runs = {}
    for fill in (False, True):
        tiny_dpo_dict["train"]["speed"] = {"fill_micro_batches": fill}
        forwards.clear()
        assert run_cfg(tiny_dpo_dict, tmp_path / f"fill{fill}") == 0
        runs[fill] = list(forwards)
    assert runs[False] == [1] * 16  # 2 steps of 8 pairs, one pair per forward
    assert sum(runs[True]) == 16
    if merges:
        assert len(runs[True]) <= 8 and min(runs[True]) >= 2, runs[True]  # pairs of <= 80 tokens
    else:
        assert runs[True] == runs[False]
    plain, filled = (metric_series(tmp_path / f"fill{f}", "train/loss") for f in (False, True))
    assert plain.keys() == filled.keys() == {1, 2}
    for step in plain:
        assert abs(plain[step] - filled[step]) < 1e-6, (step, plain[step], filled[step])
    a, b = (load_file(tmp_path / f"fill{f}" / "final" / "model.safetensors") for f in (False, True))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)  # fp32 sums


def test_under_flash_attention_pairs_are_one_row_packed_by_position_ids(
    tiny_dpo_dict, tmp_path, monkeypatch
):
    """A flash-attention policy gets the varlen layout (`conftest.flash_attention_stand_in`):
    the step's 8 pairs as 16 sequences [prompt chosen], [prompt rejected] in one row; the
    losses equal those of the run with SDPA and shared-prompt packing."""
    import direct_alignment.train

    tiny_dpo_dict["data"]["eval"] = None
    tiny_dpo_dict["train"]["max_steps"] = 2
    assert run_cfg(tiny_dpo_dict, tmp_path / "sdpa") == 0
    calls = flash_attention_stand_in(monkeypatch, direct_alignment.train)
    assert run_cfg(tiny_dpo_dict, tmp_path / "flat") == 0
    assert calls and set(calls) == {16}
    sdpa, flat = (metric_series(tmp_path / run, "train/loss") for run in ("sdpa", "flat"))
    assert sdpa.keys() == flat.keys() == {1, 2}
    for step in sdpa:
        assert abs(sdpa[step] - flat[step]) < 1e-5, (step, sdpa[step], flat[step])


@pytest.mark.parametrize("loss", ["ipo", "simpo", "orpo", "kto", "robust", "hinge"])
def test_other_losses_run_and_change_the_policy(tiny_dpo_dict, tmp_path, loss):
    tiny_dpo_dict["loss"] = {"name": loss}
    tiny_dpo_dict["train"]["max_steps"] = 2
    tiny_dpo_dict["data"]["eval"] = None
    assert run_cfg(tiny_dpo_dict, tmp_path / "run") == 0
    losses = metric_series(tmp_path / "run", "train/loss")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reference"] == ("model" if LOSSES.get(loss).needs_reference else
                                    "none (reference-free loss)")  # fmt: skip


def test_three_reference_modes_give_the_same_loss():
    lora = ModelConfig(name_or_path="tiny-qwen3", lora={"r": 4, "alpha": 8})
    tokenizer = load_tokenizer(lora, padding_side="right")
    source = DataSource.model_validate(
        {"reasoning_gym": {"task": "spell_backward", "size": 6, "seed": 3}}
    )
    pairs = build_preference_data(
        source, tokenizer, fmt="auto", max_length=80, max_prompt_length=None, where="t"
    ).pairs
    policy = load_policy(lora)
    with torch.no_grad():  # move the adapter away from zero so policy != reference
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    batch = collate_pairs(pairs, tokenizer.pad_token_id)
    loss_fn = LOSSES.get("dpo")(beta=0.1)
    chosen, rejected = pair_logps(policy, batch)
    frozen = ReferencePolicy(load_policy(lora.model_copy(update={"lora": None})), "frozen")
    by_model = reference_pair_logps(frozen, batch)
    by_adapter = reference_pair_logps(ReferencePolicy(policy, "adapter"), batch)
    cached = precompute_reference(frozen, pairs, pad_id=tokenizer.pad_token_id, batch_size=4,
                                  device=torch.device("cpu"))  # fmt: skip
    by_cache = (cached[:, 0], cached[:, 1])
    losses = [loss_fn(chosen, rejected, *refs)[0] for refs in (by_model, by_adapter, by_cache)]
    assert not torch.allclose(chosen, by_model[0])  # the adapter really changes the policy
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[0], losses[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["adapter", "precomputed"])
def test_reference_modes_train_end_to_end(tiny_dpo_dict, tmp_path, mode):
    tiny_dpo_dict["reference"]["mode"] = mode
    tiny_dpo_dict["model"]["lora"] = {"r": 4, "alpha": 8}
    tiny_dpo_dict["train"].update(max_steps=2, eval_every=1)
    assert run_cfg(tiny_dpo_dict, tmp_path / "run") == 0
    assert (tmp_path / "run" / "reference_logps.pt").is_file() == (mode == "precomputed")
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()


def test_adapter_reference_without_lora_is_a_config_error(tiny_dpo_dict, tmp_path):
    tiny_dpo_dict["reference"]["mode"] = "adapter"
    path = write_yaml(tmp_path / "c.yaml", tiny_dpo_dict)
    with pytest.raises(ConfigError, match="reference.mode 'adapter' needs LoRA"):
        main(["--config", str(path), "--dry-run"])


def test_unknown_loss_key_names_the_allowed_keys(tiny_dpo_dict, tmp_path):
    tiny_dpo_dict["loss"] = {"name": "dpo", "betta": 0.1}
    path = write_yaml(tmp_path / "c.yaml", tiny_dpo_dict)
    with pytest.raises(
        ConfigError, match=r"unknown key\(s\) betta for direct alignment loss 'dpo'"
    ):
        main(["--config", str(path), "--dry-run"])
    tiny_dpo_dict["loss"] = {"name": "dpoo"}
    path = write_yaml(tmp_path / "c.yaml", tiny_dpo_dict)
    with pytest.raises(ConfigError, match=r"unknown direct alignment loss 'dpoo'; registered: "):
        main(["--config", str(path), "--dry-run"])


def test_models_list_continues_after_a_failure(tiny_dpo_dict, tmp_path, capsys):
    tiny_dpo_dict.pop("model")
    tiny_dpo_dict["models"] = [
        {"name_or_path": "tiny-qwen3"},
        {"name_or_path": str(tmp_path / "no-such-model")},
        {"name_or_path": "tiny-qwen3", "lora": {"r": 2, "alpha": 4}},
    ]
    tiny_dpo_dict["train"]["max_steps"] = 1
    assert run_cfg(tiny_dpo_dict, tmp_path / "runs") == 1
    out = capsys.readouterr().out
    assert "trained 2/3 models; failed: " in out and "no-such-model" in out
    assert (tmp_path / "runs" / "test_dpo-0-tiny-qwen3" / "final").is_dir()
    assert (tmp_path / "runs" / "test_dpo-2-tiny-qwen3" / "final").is_dir()


def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tiny_dpo_dict, tmp_path):
    tiny_dpo_dict["data"]["eval"] = None
    tiny_dpo_dict["train"].update(max_steps=30, batch_size=8)
    tiny_dpo_dict["checkpoint"].update(save_every=5, keep_last=3)
    cfg_path = write_yaml(tmp_path / "dpo.yaml", tiny_dpo_dict)
    assert_kill_resume_reproduces(
        "direct_alignment.train", cfg_path, tmp_path, kill_after=10, total_steps=30
    )


def test_bf16_weights_train_through_fp32_masters_and_resume_exactly(tiny_dpo_dict, tmp_path):
    """model.dtype bf16 (the CUDA default) at a small lr: the optimizer keeps fp32 masters
    (optim.master_weights auto), a SIGKILLed run resumes from them exactly, and the final bf16
    weights moved where plain bf16 AdamW (master_weights false) leaves nearly all as they were."""
    tiny_dpo_dict["data"]["eval"] = None
    tiny_dpo_dict["model"]["dtype"] = "bf16"
    tiny_dpo_dict["optim"].update(lr=2e-5, warmup_steps=0)
    tiny_dpo_dict["train"].update(max_steps=12, batch_size=8)
    tiny_dpo_dict["checkpoint"].update(save_every=4, keep_last=3)
    cfg_path = write_yaml(tmp_path / "dpo.yaml", tiny_dpo_dict)
    assert_kill_resume_reproduces(
        "direct_alignment.train", cfg_path, tmp_path, kill_after=4, total_steps=12
    )
    tiny_dpo_dict["optim"]["master_weights"] = False
    assert run_cfg(tiny_dpo_dict, tmp_path / "pure") == 0
    from rlhf_core.models import resolve_model_path

    start = Path(resolve_model_path(tiny_dpo_dict["model"]["name_or_path"]))
    begin = {k: v.bfloat16() for p in start.glob("*.safetensors") for k, v in load_file(p).items()}

    def moved(run: str) -> float:
        (path,) = sorted((tmp_path / run / "final").glob("*.safetensors"))
        end = load_file(path)
        changed = sum(int((end[k] != begin[k]).sum()) for k in end if k in begin)
        return changed / sum(end[k].numel() for k in end if k in begin)

    # measured: 0.61 of the weights moved with masters, 0.30 without (12 steps at lr 2e-5)
    assert moved("ref") > 1.5 * moved("pure")


def test_dry_run_reports_pairs_and_trains_nothing(tiny_dpo_dict, tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", tiny_dpo_dict)
    assert main(["--config", str(path), "--output-dir", str(tmp_path / "run"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "train pairs: 32" in out and "would run:   4 steps x 8 pairs" in out
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- KTO, unpaired


def tiny_kto_dict() -> dict:
    import yaml

    path = Path(__file__).parents[2] / "configs" / "direct_alignment" / "tiny_kto_unpaired.yaml"
    return yaml.safe_load(path.read_text())


def test_kto_on_unpaired_rows_learns_which_completions_are_desirable(tmp_path):
    # the shipped tiny config: 64 labelled rows (32 words, the reversed word true, the word as
    # given false), 16 steps; held-out 64 words. Measured: accuracy 0.703 (chance 0.5), reward
    # of desirable rows 0.176 against -0.084
    cfg = tiny_kto_dict()
    cfg["checkpoint"]["save_every"] = 0
    assert run_cfg(cfg, tmp_path / "run") == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval/rewards/accuracy"] >= 0.6
    assert summary["eval/rewards/desirable"] > summary["eval/rewards/undesirable"] + 0.1
    assert summary["eval/rewards/desirable_fraction"] == 0.5


def test_unpaired_kto_precomputed_reference_trains_as_the_model_reference(tmp_path):
    losses = {}
    for mode in ("model", "precomputed"):
        cfg = tiny_kto_dict()
        cfg["reference"]["mode"] = mode
        cfg["train"].update(max_steps=3, eval_every=0)
        cfg["data"]["eval"] = None
        cfg["checkpoint"]["save_every"] = 0
        assert run_cfg(cfg, tmp_path / mode) == 0
        losses[mode] = metric_series(tmp_path / mode, "train/loss")
    assert losses["model"].keys() == losses["precomputed"].keys()
    for step, value in losses["model"].items():
        assert abs(value - losses["precomputed"][step]) < 1e-5


@pytest.mark.parametrize(
    ("loss", "fmt", "message"),
    [
        ("kto_unpaired", "auto", r"loss 'kto_unpaired' reads unpaired rows but data.format is"),
        ("dpo", "unpaired", r"loss 'dpo' reads preference pairs but data.format is 'unpaired'"),
    ],
)
def test_unpaired_loss_and_data_must_match(tmp_path, loss, fmt, message):
    cfg = tiny_kto_dict()
    cfg["loss"] = {"name": loss}
    cfg["data"]["format"] = fmt
    path = write_yaml(tmp_path / "c.yaml", cfg)
    with pytest.raises(ConfigError, match=message):
        main(["--config", str(path), "--dry-run"])


def test_lopsided_labels_warn_with_the_weight_that_balances_them(tmp_path):
    cfg = tiny_kto_dict()
    cfg["loss"]["undesirable_weight"] = 3.0
    cfg["train"]["max_steps"] = 1
    cfg["data"]["eval"] = None
    with pytest.warns(UserWarning, match=r"= 0.33, outside the paper's recommended \[1, 4/3\]"):
        assert run_cfg(cfg, tmp_path / "run") == 0
