"""Reward-model training end to end on the tiny world: each kind learns its synthetic task
(held-out figures measured, then asserted with a margin), the saved model scores as trained,
accumulation is exact, LoRA / frozen backbones train what they should, bad configs fail clearly,
and a run killed with SIGKILL resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_kill_resume_reproduces, metric_series, write_yaml
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from reward_models.config import RMConfig
from reward_models.data import build_reward_data
from reward_models.models import preference_rewards
from reward_models.train import main, train
from rlhf_core.config import ConfigError, RunArgs, load_config
from rlhf_core.preference import collate_pairs
from rlhf_core.scalar_head import ScalarHeadModel
from rlhf_core.tiny import preset_dir

SPELL = {"task": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 8}}


def spell(size: int, seed: int) -> dict:
    return {"reasoning_gym": {**SPELL, "size": size, "seed": seed}}


@pytest.fixture
def pref_dict() -> dict:
    """Bradley-Terry on synthetic spell_backward pairs: chosen = the reversed word, rejected =
    the word as given or another word reversed."""
    return {
        "name": "test_rm",
        "seed": 0,
        "model": {"name_or_path": "tiny-qwen3"},
        "data": {
            "train": spell(512, 1),
            "eval": spell(128, 10_000_000),
            "max_length": 64,
            "max_prompt_length": 24,
            "builder": {"wrong_kinds": ["reverse", "other"]},
        },
        "loss": {"name": "bradley_terry"},
        "train": {"batch_size": 16, "max_steps": 4, "threads": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 5},
        "checkpoint": {"save_every": 0},
        "tracking": {"log_every": 1, "plot_every": 0},
    }


def run_cfg(data: dict, out: Path) -> dict:
    assert train(RMConfig.model_validate(data), RunArgs(Path("t.yaml"), output_dir=out)) == 0
    return json.loads((out / "summary.json").read_text())


def run_shipped(name: str, out: Path, *overrides: str) -> dict:
    """Train a shipped tiny-world config as is (evaluating once, at the end, on one thread)."""
    path = REPO / "configs" / "reward_models" / f"{name}.yaml"
    quiet = ["train.eval_every=0", "train.threads=1", "checkpoint.save_every=0"]
    cfg = load_config(RMConfig, path, [*quiet, *overrides])
    assert train(cfg, RunArgs(path, output_dir=out)) == 0
    return json.loads((out / "summary.json").read_text())


# ----------------------------------------------------------------------------- learning


def test_preference_rm_learns_spell_backward_and_saves_what_it_learned(tmp_path):
    summary = run_shipped("tiny_preference", tmp_path / "run")
    # measured: held-out accuracy 0.828 on 128 pairs after 80 steps of 16 (chance 0.5), with and
    # without the shared prompt (lr 3e-3 was unstable: 0.63-0.80 depending on float rounding)
    assert summary["eval/accuracy"] >= 0.72
    # the saved directory scores the held-out pairs exactly as the trainer evaluated them
    model = ScalarHeadModel.from_pretrained(tmp_path / "run" / "final")
    cfg = load_config(RMConfig, REPO / "configs" / "reward_models" / "tiny_preference.yaml")
    pairs = build_reward_data(cfg.data.eval, model.tokenizer, kind="preference",
                              data_cfg=cfg.data, where="eval").examples  # fmt: skip
    with torch.no_grad():
        chosen, rejected = preference_rewards(
            model, collate_pairs(pairs, model.tokenizer.pad_token_id)
        )
    assert (chosen > rejected).float().mean().item() == pytest.approx(summary["eval/accuracy"])
    seqcls = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "final-seqcls")
    assert seqcls.config.num_labels == 1
    start = load_file(preset_dir("tiny-qwen3") / "model.safetensors")
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    for name, value in final.items():  # every backbone tensor trained
        assert not torch.equal(value, start[f"model.{name}"]), name


def test_orm_learns_to_pick_the_right_answer(tmp_path):
    summary = run_shipped("tiny_orm", tmp_path / "run")
    # measured: top-1 0.656 over 64 words x 4 candidates (chance 0.25), pairwise 0.839, auroc 0.741
    assert summary["eval/top1_random_baseline"] == 0.25 and summary["eval/ranked_groups"] == 64
    assert summary["eval/top1_accuracy"] >= 0.55
    assert summary["eval/pairwise_accuracy"] >= 0.75 and summary["eval/auroc"] >= 0.66


def test_prm_learns_to_find_the_wrong_step(tmp_path):
    summary = run_shipped("tiny_prm", tmp_path / "run")
    # measured over 470 held-out steps: step accuracy 0.849 (majority class 0.728), balanced
    # 0.789 (chance 0.5), first-error step 0.547 (guessing the commonest first-error step 0.180)
    assert summary["eval/step_accuracy"] >= summary["eval/step_majority_baseline"] + 0.07
    assert summary["eval/balanced_step_accuracy"] >= 0.72
    assert (
        summary["eval/first_error_accuracy"] >= summary["eval/first_error_majority_baseline"] + 0.25
    )


# ----------------------------------------------------------------------------- the loop


def test_gradient_accumulation_equals_one_big_batch(pref_dict, tmp_path, monkeypatch):
    """Micro-batches of 4 pairs as configured, and 1-pair micro-batches that the speed plan
    merges into forwards of up to 2 x max_length tokens (`fill_micro_batches`), both train as
    one forward of the step's 16 pairs."""
    import reward_models.train as rm_train

    forwards: list[int] = []
    real_compute_loss = rm_train.compute_loss

    def counted(model, loss_fn, batch):
        forwards.append(len(batch["lengths"]) // 2)
        return real_compute_loss(model, loss_fn, batch)

    monkeypatch.setattr(rm_train, "compute_loss", counted)
    pref_dict["data"]["eval"] = None
    pref_dict["train"]["max_steps"] = 3
    run_cfg(pref_dict, tmp_path / "big")
    pref_dict["train"].update(micro_batch_size=4, speed={"fill_micro_batches": False})
    forwards.clear()
    run_cfg(pref_dict, tmp_path / "acc")
    assert forwards == [4] * 12
    pref_dict["train"].update(micro_batch_size=1, speed={"fill_micro_batches": True})
    forwards.clear()
    run_cfg(pref_dict, tmp_path / "filled")
    assert sum(forwards) == 48 and len(forwards) <= 24, forwards  # pairs merged
    big = metric_series(tmp_path / "big", "train/loss")
    a = load_file(tmp_path / "big" / "final" / "scalar_head.safetensors")["weight"]
    for run in ("acc", "filled"):
        other = metric_series(tmp_path / run, "train/loss")
        assert big.keys() == other.keys() and all(abs(big[s] - other[s]) < 1e-5 for s in big)
        b = load_file(tmp_path / run / "final" / "scalar_head.safetensors")["weight"]
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_embedding_grad_buffer_trains_as_the_dense_gradient(pref_dict, tmp_path):
    # on one CPU process the default accumulates the embedding's sparse row gradients into a
    # persistent buffer (rlhf_core.optim.EmbeddingGradBuffer); off, a fresh dense gradient
    pref_dict["data"]["eval"] = None
    pref_dict["train"].update(max_steps=3, micro_batch_size=8)
    run_cfg(pref_dict, tmp_path / "buffer")
    pref_dict["train"]["sparse_embedding_grad"] = False
    run_cfg(pref_dict, tmp_path / "dense")
    a, b = (metric_series(tmp_path / r, "train/loss") for r in ("buffer", "dense"))
    assert a.keys() == b.keys() and all(abs(a[s] - b[s]) < 1e-6 for s in a)
    weights = [load_file(tmp_path / r / "final" / "model.safetensors") for r in ("buffer", "dense")]
    (key,) = (k for k in weights[0] if k.endswith("embed_tokens.weight"))
    initial = load_file(preset_dir("tiny-qwen3") / "model.safetensors")
    (start,) = (v for k, v in initial.items() if k.endswith("embed_tokens.weight"))
    assert not torch.equal(weights[0][key], start)  # the embedding did train
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], rtol=1e-5, atol=1e-6)


def test_lora_and_frozen_backbones_train_what_they_should(pref_dict, tmp_path):
    pref_dict["data"]["eval"] = None
    pref_dict["train"]["max_steps"] = 2
    pref_dict["model"]["lora"] = {"r": 4, "alpha": 8}
    run_cfg(pref_dict, tmp_path / "lora")
    final = tmp_path / "lora" / "final"
    assert (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()
    assert ScalarHeadModel.from_pretrained(final).is_adapter

    pref_dict["model"].pop("lora")
    pref_dict["freeze_backbone"] = True
    run_cfg(pref_dict, tmp_path / "frozen")
    start = load_file(preset_dir("tiny-qwen3") / "model.safetensors")
    final = load_file(tmp_path / "frozen" / "final" / "model.safetensors")
    assert all(torch.equal(v, start[f"model.{k}"]) for k, v in final.items())


def test_sigkill_then_resume_reproduces_the_uninterrupted_run(pref_dict, tmp_path):
    # pairs written to a file, so the three trainer processes need not import reasoning-gym
    from reward_models.build_data import write_jsonl
    from rlhf_core.data import ReasoningGymSource, reasoning_gym_dataset
    from rlhf_core.wrong_answers import reasoning_gym_preference_rows

    entries = list(reasoning_gym_dataset(ReasoningGymSource(**SPELL, size=64, seed=1)))
    pairs = write_jsonl(reasoning_gym_preference_rows(entries), tmp_path / "pairs.jsonl")
    assert pairs == 64
    pref_dict["data"].update(train={"path": str(tmp_path / "pairs.jsonl")}, eval=None)
    pref_dict["train"].update(max_steps=24, batch_size=8)
    pref_dict["checkpoint"].update(save_every=4, keep_last=2)
    cfg_path = write_yaml(tmp_path / "rm.yaml", pref_dict)
    assert_kill_resume_reproduces(
        "reward_models.train", cfg_path, tmp_path, kill_after=8, total_steps=24
    )
    assert sorted(p.name for p in (tmp_path / "ref" / "final").glob("*.safetensors")) == [
        "model.safetensors", "scalar_head.safetensors",
    ]  # fmt: skip


# ----------------------------------------------------------------------------- configs


def test_dry_run_reports_the_plan_and_trains_nothing(pref_dict, tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", pref_dict)
    assert main(["--config", str(path), "--output-dir", str(tmp_path / "run"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "kind:" in out and "preference (head 1; backbone trained)" in out
    assert "would run:" in out and "4 steps x 16 examples" in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["data"].update(format="prm800k"), r"data.format 'prm800k' does not suit"),
        (lambda d: d["loss"].update(use_margin=True), r"loss.use_margin needs data.margin_column"),
        (lambda d: d.update(loss={"name": "orm_bce"}, train={"export_sequence_classification":
                            True}), r"export_sequence_classification is for preference"),
        (lambda d: d.update(freeze_backbone=True, model={"name_or_path": "tiny-qwen3",
                            "lora": {"r": 2}}), r"freeze_backbone with model.lora"),
        (lambda d: d["loss"].update(centering=1), r"unknown key\(s\) centering"),
    ],
)  # fmt: skip
def test_bad_configs_are_clear_errors(pref_dict, tmp_path, edit, message):
    edit(pref_dict)
    path = write_yaml(tmp_path / "bad.yaml", pref_dict)
    with pytest.raises(ConfigError, match=message) as info:
        main(["--config", str(path), "--dry-run"])
    assert str(path) in str(info.value)
