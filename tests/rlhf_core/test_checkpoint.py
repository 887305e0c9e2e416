"""Checkpoints (rlhf_core.checkpoint): layout, atomicity, pruning, plain-HF loading, exact resume,
and the signal-safe stop."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

from rlhf_core.checkpoint import (
    STATE_FILE,
    NonFiniteModelError,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    restore_training_state,
    save_best,
    save_checkpoint,
    save_final,
)
from rlhf_core.models import ModelConfig, load_policy, load_tokenizer, resolve_model_path
from rlhf_core.optim import OptimConfig, build_optimizer, build_scheduler
from rlhf_core.runtime import restore_rng_state, seed_everything
from rlhf_core.stop_signal import StopSignal

TINY = ModelConfig(name_or_path="tiny-qwen3", dtype="fp32", attention="sdpa")
TINY_LORA = ModelConfig(
    name_or_path="tiny-qwen3", dtype="fp32", attention="sdpa", lora={"r": 4, "alpha": 8}
)
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2, schedule="cosine")
TOTAL_STEPS = 10


def train_step(model, optimizer, scheduler) -> float:
    """One real optimizer step on a batch drawn from the torch RNG (so RNG state matters)."""
    ids = torch.randint(6, 100, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def trained(cfg: ModelConfig, steps: int = 2):
    """A tiny model, its tokenizer, AdamW and the lr schedule after `steps` real steps."""
    seed_everything(0)
    model = load_policy(cfg)
    tokenizer = load_tokenizer(cfg, padding_side="right")
    optimizer = build_optimizer(model, OPTIM)
    scheduler = build_scheduler(optimizer, OPTIM, TOTAL_STEPS)
    for _ in range(steps):
        train_step(model, optimizer, scheduler)
    return model, tokenizer, optimizer, scheduler


@pytest.fixture(scope="module")
def full():
    return trained(TINY)


def save(path, step, parts, *, state=None, keep_last=5):
    model, tokenizer, optimizer, scheduler = parts
    return save_checkpoint(
        path,
        step,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        state=state if state is not None else {"sampler": {"epoch": 0, "offset": step}},
        keep_last=keep_last,
    )


# ----------------------------------------------------------------------------- layout


def test_checkpoint_directory_layout(tmp_path, full):
    ckpt = save(tmp_path / "checkpoints", 2, full)
    assert ckpt == tmp_path / "checkpoints" / "checkpoint-2"
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", STATE_FILE} <= names
    assert "tokenizer_config.json" in names
    # nothing left behind: only the final directory, no hidden temporary one
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["checkpoint-2"]


def test_trainer_state_is_weights_only_loadable(tmp_path, full):
    model, _, optimizer, scheduler = full
    state = {"sampler": {"epoch": 1, "offset": 3}, "tokens": torch.tensor([1, 2]), "name": "x"}
    ckpt = save(tmp_path, 2, full, state=state)
    payload = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
    assert payload["step"] == 2
    assert payload["state"]["sampler"] == {"epoch": 1, "offset": 3}
    assert torch.equal(payload["state"]["tokens"], torch.tensor([1, 2]))
    assert payload["state"]["name"] == "x"
    assert payload["scheduler"]["last_epoch"] == scheduler.last_epoch == 2
    # real optimizer state exists (AdamW moments for every trainable parameter)
    opt_state = payload["optimizer"]["state"]
    assert len(opt_state) == sum(p.requires_grad for p in model.parameters())
    first = next(iter(opt_state.values()))
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(first)
    reference = optimizer.state_dict()["state"]
    for key, value in reference.items():
        assert torch.equal(opt_state[key]["exp_avg"], value["exp_avg"])
    assert set(payload["rng"]) >= {"python", "numpy", "torch"}
    assert load_trainer_state(ckpt)["step"] == 2


def test_load_trainer_state_rejects_incomplete_dir(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(FileNotFoundError, match="checkpoint-3"):
        load_trainer_state(tmp_path / "checkpoint-3")


def test_full_checkpoint_loads_with_plain_transformers(tmp_path, full):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = full[0], full[1]
    ckpt = save(tmp_path, 2, full)
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    saved = dict(model.named_parameters())
    got = dict(loaded.named_parameters())
    assert saved.keys() == got.keys()
    for name, param in saved.items():
        assert torch.equal(param.detach(), got[name].detach()), name
    # the weights moved away from the preset: this compares trained parameters, not the init
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen3"))
    base_params = dict(base.named_parameters())
    assert any(not torch.equal(base_params[n], p) for n, p in got.items())
    # the tokenizer in the checkpoint encodes as the original one
    text = "<|user|>hello, world<|end|>"
    assert AutoTokenizer.from_pretrained(ckpt)(text).input_ids == tokenizer(text).input_ids


# peft reads transformers' deprecated `is_gradient_checkpointing`
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_checkpoint_loads_with_plain_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    parts = trained(TINY_LORA, steps=2)
    model = parts[0]
    ckpt = save(tmp_path, 2, parts)
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", STATE_FILE} <= names
    assert "model.safetensors" not in names  # the adapter only, not the merged weights

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen3"))
    ids = torch.randint(6, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(base, str(ckpt))
        loaded.eval()
        model.eval()
        expected = model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert not torch.allclose(expected, base_logits)  # the adapter was trained
    assert torch.equal(got, expected)


# ----------------------------------------------------------------------------- discovery, pruning


def test_latest_checkpoint_ignores_incomplete_and_temporary_dirs(tmp_path, full):
    ckpts = tmp_path / "checkpoints"
    assert latest_checkpoint(ckpts) is None  # no directory at all
    good = save(ckpts, 2, full)
    # an interrupted write: a hidden temporary dir with a full payload, and a checkpoint-<n> dir
    # whose trainer_state.pt was never written
    tmp = ckpts / ".tmp-checkpoint-7-abc123"
    tmp.mkdir()
    (tmp / STATE_FILE).write_bytes((good / STATE_FILE).read_bytes())
    partial = ckpts / "checkpoint-9"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    (ckpts / "checkpoint-final").mkdir()
    (ckpts / "notes.txt").write_text("not a checkpoint")
    assert list_checkpoints(ckpts) == [good]
    assert latest_checkpoint(ckpts) == good


def test_checkpoints_sort_numerically_and_keep_last_prunes_oldest(tmp_path, full):
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        save(ckpts, step, full, keep_last=2)
    assert [p.name for p in list_checkpoints(ckpts)] == ["checkpoint-2", "checkpoint-3"]
    save(ckpts, 10, full, keep_last=2)  # "checkpoint-10" < "checkpoint-3" as strings
    assert [p.name for p in list_checkpoints(ckpts)] == ["checkpoint-3", "checkpoint-10"]
    assert latest_checkpoint(ckpts) == ckpts / "checkpoint-10"
    assert not (ckpts / "checkpoint-1").exists() and not (ckpts / "checkpoint-2").exists()


def test_resaving_a_step_replaces_it(tmp_path, full):
    save(tmp_path, 4, full, state={"marker": 1})
    save(tmp_path, 4, full, state={"marker": 2})
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint-4"]
    assert load_trainer_state(tmp_path / "checkpoint-4")["state"] == {"marker": 2}


def test_failed_save_leaves_nothing_behind(tmp_path, full):
    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full")

    model, _, optimizer, scheduler = full
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 5, (model, BrokenTokenizer(), optimizer, scheduler))
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- exact resume


def draws() -> tuple[torch.Tensor, float, np.ndarray]:
    return torch.rand(4), random.random(), np.random.rand(3)


def test_restore_training_state_reproduces_the_uninterrupted_run(tmp_path):
    model, tokenizer, optimizer, scheduler = trained(TINY, steps=2)
    ckpt = save(tmp_path, 2, (model, tokenizer, optimizer, scheduler), state={"offset": 7})

    # the uninterrupted run: RNG draws, then two more optimizer steps
    expected_draws = draws()
    expected_losses = [train_step(model, optimizer, scheduler) for _ in range(2)]
    expected_lr = scheduler.get_last_lr()
    expected_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    # scramble every RNG, then resume from the checkpoint in fresh objects
    seed_everything(12345)
    resumed = load_policy(TINY, weights_from=ckpt)
    opt2 = build_optimizer(resumed, OPTIM)
    sched2 = build_scheduler(opt2, OPTIM, TOTAL_STEPS)
    state = restore_training_state(load_trainer_state(ckpt), optimizer=opt2, scheduler=sched2)
    assert state == {"offset": 7}
    assert sched2.last_epoch == 2

    got_draws = draws()
    assert torch.equal(got_draws[0], expected_draws[0])
    assert got_draws[1] == expected_draws[1]
    assert np.array_equal(got_draws[2], expected_draws[2])
    got_losses = [train_step(resumed, opt2, sched2) for _ in range(2)]
    assert got_losses == expected_losses
    assert sched2.get_last_lr() == expected_lr
    for name, param in resumed.named_parameters():
        assert torch.equal(param.detach(), expected_params[name]), name


def test_resume_without_optimizer_state_would_differ(tmp_path):
    """Control for the test above: a fresh optimizer (no restored moments) gives other weights,
    so the equality there is evidence that the state was restored."""
    model, tokenizer, optimizer, scheduler = trained(TINY, steps=2)
    ckpt = save(tmp_path, 2, (model, tokenizer, optimizer, scheduler))
    draws()
    train_step(model, optimizer, scheduler)

    resumed = load_policy(TINY, weights_from=ckpt)
    opt2 = build_optimizer(resumed, OPTIM)
    sched2 = build_scheduler(opt2, OPTIM, TOTAL_STEPS)
    restore_rng_state(load_trainer_state(ckpt)["rng"])
    draws()
    train_step(resumed, opt2, sched2)
    params = dict(model.named_parameters())
    assert any(not torch.equal(p, params[n]) for n, p in resumed.named_parameters())


# ----------------------------------------------------------------------------- final/ and best/


def test_final_and_best_are_plain_directories_and_never_hold_nan(tmp_path):
    """`save_final` writes a directory plain transformers loads (replacing an older one whole);
    `save_best` writes best/ the same way with best.json beside it, or best.json alone when
    `checkpoint.best.save_best` is off (model None); a NaN parameter is never written."""
    accelerator = Accelerator(cpu=True)
    model, tokenizer = load_policy(TINY), load_tokenizer(TINY, padding_side="right")
    save_final(accelerator, model, tokenizer, tmp_path / "final")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    save_final(accelerator, model, tokenizer, tmp_path / "final")  # replaces the first
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert torch.equal(next(loaded.parameters()), next(model.parameters()).detach())
    record = {"step": 3, "metric": "eval/loss", "value": 0.5}
    save_best(accelerator, model, tokenizer, tmp_path, record)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "best").num_parameters() > 0
    assert json.loads((tmp_path / "best.json").read_text()) == record
    save_best(accelerator, None, tokenizer, tmp_path / "no_model", record)
    assert (tmp_path / "no_model" / "best.json").is_file()
    assert not (tmp_path / "no_model" / "best").exists()
    with torch.no_grad():
        next(model.parameters())[0] = float("nan")
    with pytest.raises(NonFiniteModelError, match="NaN/inf"):
        save_final(accelerator, model, tokenizer, tmp_path / "broken")
    assert not (tmp_path / "broken").exists()
    assert not list(tmp_path.glob(".tmp-*"))


# ----------------------------------------------------------------------------- signals


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stop_signal_sets_flag_instead_of_killing(signum, code):
    calls = []

    def previous(sig, frame):
        calls.append(sig)

    old = signal.signal(signum, previous)
    try:
        with StopSignal() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signum)
            assert stop.requested
            assert stop.signum == signum
            assert stop.exit_code == code
        assert signal.getsignal(signum) is previous  # the old handler is back
        assert calls == []  # ... and was not called while the context was active
        os.kill(os.getpid(), signum)
        assert calls == [signum]
    finally:
        signal.signal(signum, old)


def test_second_signal_kills_the_process():
    """Ctrl-C twice still kills: the second signal gets the default behaviour."""
    code = textwrap.dedent(
        """
        import os, signal, time
        from rlhf_core.stop_signal import StopSignal
        with StopSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested
            print("first signal caught", flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        print("survived")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "first signal caught" in proc.stdout
    assert "survived" not in proc.stdout
    assert proc.returncode == -signal.SIGINT


def test_nested_stop_signals_hand_a_pending_signal_in_and_out():
    """A pipeline's StopSignal around a trainer's: a Ctrl-C that came before the trainer's block
    starts it stopped, and one inside the trainer's block reaches the pipeline's after it; the
    process is never interrupted by KeyboardInterrupt meanwhile."""
    with StopSignal() as outer:
        os.kill(os.getpid(), signal.SIGINT)  # between stages: caught by the pipeline's
        assert outer.requested
        with StopSignal() as inner:
            assert inner.requested and inner.exit_code == 130
    with StopSignal() as outer:
        with StopSignal() as inner:
            assert not inner.requested
            os.kill(os.getpid(), signal.SIGTERM)
            assert inner.requested and not outer.requested
        assert outer.requested and outer.exit_code == 143
