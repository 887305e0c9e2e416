"""RL prompts from any data set: Anthropic HH transcripts, conversations, prompt-only rows and
`data.columns` (policy_gradients.rollout.load_prompts); the answer column is required only when
a configured reward reads it; GRPO trains on the vendored HH prompts with an RM-only reward."""

from __future__ import annotations

import gzip
import json
import math
import sqlite3
from pathlib import Path

import pytest
import torch
from conftest import REPO, metric_series
from safetensors.torch import load_file

from policy_gradients.config import PGConfig
from policy_gradients.rewards import answer_needed_by
from policy_gradients.rollout import load_prompts
from policy_gradients.train import train
from rlhf_core.chat import split_hh_pair
from rlhf_core.columns import Columns
from rlhf_core.config import RunArgs
from rlhf_core.data import DataSource
from rlhf_core.errors import UserError
from rlhf_core.models import ModelConfig, load_tokenizer
from rlhf_core.tiny import preset_dir

HH = REPO / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
GPT2_MODEL = "tiny-qwen3-gpt2"  # the tiny world's model with the real GPT-2 tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=GPT2_MODEL), padding_side="left")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hh_rows(n: int) -> list[dict]:
    with gzip.open(HH, "rt", encoding="utf-8") as fh:
        return [json.loads(next(fh)) for _ in range(n)]


@pytest.mark.parametrize("fmt", ["hh", "auto"])
def test_hh_pairs_become_their_multi_turn_prompts(tokenizer, fmt):
    prompts = load_prompts(
        DataSource(path=str(HH), limit=6), tokenizer, where="data.train", format=fmt
    )
    assert len(prompts.items) == 6
    for item, row in zip(prompts.items, hh_rows(6), strict=True):
        expected, _, _ = split_hh_pair(row["chosen"], row["rejected"], where="t")
        assert item["messages"] == expected
        assert item["messages"][-1]["role"] == "user" and item["answer"] is None
        # the rendered prompt (GPT-2 has no chat template: the HH default) ends asking for the
        # assistant's reply, and holds every human turn of the shared transcript
        assert item["prompt"].endswith("\n\nAssistant:")
        for turn in expected:
            assert turn["content"] in item["prompt"]
    assert sum(len(it["messages"]) > 1 for it in prompts.items) >= 3  # multi-turn prompts


def test_hh_prompt_strings_end_at_the_last_assistant_turn(tmp_path, tokenizer):
    rows = [
        {"prompt": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant:"},
        {"prompt": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye"},  # ends on a human turn
        {"prompt": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: a reply to drop"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    items = load_prompts(DataSource(path=str(path)), tokenizer, where="d", format="hh").items
    assert [m["content"] for m in items[0]["messages"]] == ["hi", "hello", "how are you?"]
    assert [m["content"] for m in items[1]["messages"]] == ["hi", "hello", "bye"]
    assert [m["role"] for m in items[2]["messages"]] == ["user", "assistant", "user"]
    assert "a reply to drop" not in items[2]["prompt"]
    plain = load_prompts(DataSource(path=str(path)), tokenizer, where="d", format="plain").items
    assert plain[0]["messages"] == [{"role": "user", "content": rows[0]["prompt"]}]


def test_conversations_prompt_only_rows_and_column_mapping(tmp_path, tokenizer):
    user, reply = {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}
    system = {"role": "system", "content": "Be brief."}
    conv = write_jsonl(tmp_path / "conv.jsonl", [
        {"messages": [system, user, reply]},  # an SFT conversation: its reply is dropped
        {"messages": [user, reply, {"role": "user", "content": "And 3+3?"}]},
    ])  # fmt: skip
    items = load_prompts(
        DataSource(path=str(conv)), tokenizer, where="d", format="conversational",
        system_prompt="ignored: the row has its own",
    ).items  # fmt: skip
    assert items[0]["messages"] == [system, user]
    assert items[1]["messages"][0] == {"role": "system", "content": "ignored: the row has its own"}
    assert items[1]["messages"][-1]["content"] == "And 3+3?"
    assert items[0]["prompt"] == tokenizer.apply_chat_template(
        [system, user], tokenize=False, add_generation_prompt=True
    )

    only = write_jsonl(tmp_path / "only.jsonl", [{"prompt": "Tell me a joke."}, {"prompt": [user]}])
    items = load_prompts(DataSource(path=str(only)), tokenizer, where="d",
                         prompt_template="{question} Answer briefly.").items  # fmt: skip
    assert items[0]["messages"] == [{"role": "user", "content": "Tell me a joke. Answer briefly."}]
    assert items[1]["messages"] == [{"role": "user", "content": "What is 2+2? Answer briefly."}]
    assert all(it["answer"] is None for it in items)

    orca = write_jsonl(tmp_path / "orca.jsonl", [
        {"system": "You are a calculator.", "question": "2+2?", "gold": 4, "chosen": "4",
         "rejected": "5"},
    ])  # fmt: skip
    columns = Columns(prompt="question", answer="gold")
    (item,) = load_prompts(DataSource(path=str(orca)), tokenizer, where="d", columns=columns).items
    assert item["messages"] == [
        {"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "2+2?"}
    ]  # fmt: skip
    assert item["answer"] == "4"
    # the older prompt_column / answer_column keys name the same columns
    (old,) = load_prompts(DataSource(path=str(orca)), tokenizer, where="d",
                          prompt_column="question", answer_column="gold").items  # fmt: skip
    assert old["answer"] == "4" and old["messages"][-1]["content"] == "2+2?"
    with pytest.raises(UserError, match="name different columns"):
        load_prompts(DataSource(path=str(orca)), tokenizer, where="d", columns=columns,
                     prompt_column="system")  # fmt: skip


def test_bad_rows_get_one_clear_error(tmp_path, tokenizer):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "hello", "score": 1}])
    with pytest.raises(UserError, match=r"bad.jsonl.*row 0.*\['score', 'text'\].*data.columns"):
        load_prompts(DataSource(path=str(bad)), tokenizer, where="data.train")
    conv = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a string"}])
    with pytest.raises(UserError, match="conversational needs a message list"):
        load_prompts(DataSource(path=str(conv)), tokenizer, where="d", format="conversational")


def pg_config(model: str, rm: Path, prompts: dict, rewards: list[dict] | None = None) -> dict:
    return {
        "name": "hh_grpo", "seed": 0, "model": {"name_or_path": model},
        "data": prompts,
        "rewards": rewards or [{"name": "reward_model", "path": str(rm), "device": "cpu"}],
        "algorithm": {
            "name": "grpo", "advantage": {"name": "grpo", "eps": 1e-6, "scale_rewards": True},
            "loss": {"name": "clipped", "aggregation": "seq-mean-token-mean", "kl_beta": 0.0},
        },
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8},
        "train": {"max_steps": 2, "micro_batch_size": 16, "threads": 1, "eval_size": 4},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"save_every": 0},
        "tracking": {"log_every": 1, "plot_every": 0},
    }  # fmt: skip


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory) -> Path:
    """A reward model on the GPT-2-tokenizer tiny backbone, built from config (as
    test_pg_overoptimization builds its RM): a real scalar-head directory, random head."""
    from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel

    torch.manual_seed(0)
    base = ModelConfig(name_or_path=GPT2_MODEL)
    rm = ScalarHeadModel.from_config(base, ScalarHeadInfo(kind="preference", max_length=512))
    rm.tokenizer = load_tokenizer(base, padding_side="right")
    out = tmp_path_factory.mktemp("rm") / "rm"
    rm.save_pretrained(out)
    return out


def test_grpo_trains_on_hh_prompts_with_an_rm_only_reward(tmp_path, tiny_rm):
    """Vendored HH pairs as RL prompts (no answer column anywhere) and a learned RM as the only
    reward: two GRPO steps end to end; held-out evaluation reports the RM's mean score but no
    `_exact` share (a learned score is not a grade)."""
    prompts = {
        "train": {"path": str(HH), "limit": 16},
        "eval": {"path": str(HH), "offset": 2000, "limit": 4},
        "format": "hh",
    }
    cfg = PGConfig.model_validate(pg_config(GPT2_MODEL, tiny_rm, prompts))
    assert cfg.prompt_args()["answer_needed_by"] == []
    run = tmp_path / "run"
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=run)) == 0
    losses = metric_series(run, "train/loss")
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    rewards = metric_series(run, "train/reward/reward_model")
    assert all(math.isfinite(v) for v in rewards.values())
    start = load_file(preset_dir(GPT2_MODEL) / "model.safetensors")
    final = load_file(run / "final" / "model.safetensors")
    unchanged = [k for k in final if torch.equal(final[k], start[k])]
    assert not unchanged, f"{len(unchanged)} tensors unchanged: {unchanged[:3]}"
    with sqlite3.connect(run / "rollouts.sqlite") as conn:
        logged = [r[0] for r in conn.execute("SELECT prompt FROM rollouts")]
    assert len(logged) == 2 * 4 * 4
    assert all(p.startswith("\n\nHuman:") and p.endswith("\n\nAssistant:") for p in logged)
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["eval/greedy_reward_model"])
    assert not [k for k in summary if k.endswith("reward_model_exact")]


def test_a_verifier_without_answers_is_refused_naming_the_reward(tmp_path, tiny_rm, tokenizer):
    """A reward that reads the reference answer (gsm8k) on prompts that have none: one error
    that names the reward and where it lives, before any training."""
    only = write_jsonl(tmp_path / "only.jsonl", [{"prompt": f"Say {i}."} for i in range(8)])
    rewards = [
        {"name": "reward_model", "path": str(tiny_rm), "device": "cpu"},
        {"name": "gsm8k", "weight": 0.5, "label": "math"},
    ]
    cfg = PGConfig.model_validate(
        pg_config(GPT2_MODEL, tiny_rm, {"train": {"path": str(only)}}, rewards)
    )
    assert answer_needed_by(cfg.rewards) == ["math"]
    with pytest.raises(UserError, match=r"reward 'math' \(policy_gradients/rewards.py\).*8 of 8"):
        load_prompts(cfg.data.train, tokenizer, where="data.train", **cfg.prompt_args())
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"reward 'math' \(policy_gradients/rewards.py\)"):
        train(cfg, RunArgs(Path("t.yaml"), output_dir=run))
    assert not (run / "final").exists()


def test_compare_labels_a_reward_total_that_includes_a_penalty(tmp_path, monkeypatch):
    """DAPO's overlong shaping is in its run's total reward: compare.png's label says so."""
    from conftest import tiny_pg_dict

    from rlhf_core.config import dump_config
    from rlhf_lab.compare_report import _penalties, plot_curves

    runs = {}
    for name, extra in (
        ("grpo", []),
        ("dapo", [{"name": "overlong", "max_length": 12, "cache_length": 4, "label": "too_long"}]),
    ):
        data = tiny_pg_dict(Path("tiny-qwen3"), name="grpo", advantage={"name": "grpo"},
                            loss={"name": "clipped"})  # fmt: skip
        data["rewards"] += extra
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(dump_config(PGConfig.model_validate(data)))
        rows = [{"step": s, "train/reward/total": 0.1 * s} for s in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[name] = {"family": "policy_gradients"}
    assert _penalties(tmp_path / "grpo") == [] and _penalties(tmp_path / "dapo") == ["too_long"]
    import matplotlib.axes

    labels, plot = [], matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):  # the real plot, its labels recorded
        labels.append(kwargs.get("label"))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    plot_curves(tmp_path, {"runs": runs})
    assert labels == ["grpo", "dapo (incl. too_long penalty)"]
    assert (tmp_path / "compare.png").stat().st_size > 1000


def test_eval_reports_exact_shares_for_verifiers_only(tiny_rm, tokenizer):
    """`eval/*_exact` (the share scoring 1.0) is a verifier's accuracy: kept for gsm8k, not
    reported for a learned reward model (its scores are not grades) nor for the overlong
    penalty (never above 0)."""
    from policy_gradients.evaluate import evaluate_policy
    from policy_gradients.rewards import CombinedReward
    from rlhf_core.models import load_policy

    prompts = load_prompts(
        DataSource(path=str(REPO / "data" / "gsm8k" / "test.jsonl"), limit=3), tokenizer,
        where="data.eval", prompt_column="question",
    )  # fmt: skip
    reward = CombinedReward([
        {"name": "gsm8k"}, {"name": "reward_model", "path": str(tiny_rm), "device": "cpu"},
        {"name": "overlong", "max_length": 4, "cache_length": 2},
    ])  # fmt: skip
    policy = load_policy(ModelConfig(name_or_path=GPT2_MODEL)).eval()
    results = evaluate_policy(policy, None, tokenizer, prompts, reward, max_new_tokens=6,
                              temperature=1.0, batch_size=3, seed=0)  # fmt: skip
    for kind in ("greedy", "sampled"):
        assert 0 <= results[f"eval/{kind}_gsm8k_exact"] <= 1
        assert math.isfinite(results[f"eval/{kind}_reward_model"])
        assert results[f"eval/{kind}_overlong"] < 0  # 6 new tokens > max_length 4
        assert f"eval/{kind}_reward_model_exact" not in results
        assert f"eval/{kind}_overlong_exact" not in results
