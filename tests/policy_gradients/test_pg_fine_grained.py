"""Fine-Grained RLHF on the tiny encoder-decoder policy: each segment reward lands on the token
that ends its segment, and PPO / GRPO / RLOO train tiny-t5-facts through rlhf_core.policy_model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, metric_series
from safetensors.torch import load_file

from policy_gradients.config import PGConfig
from policy_gradients.rewards import CombinedReward, RewardInput
from policy_gradients.train import train
from rlhf_core.config import RunArgs
from rlhf_core.models import ModelConfig, load_tokenizer
from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel
from rlhf_core.tiny import preset_dir

POLICY = ModelConfig(name_or_path="tiny-t5-facts")
RM_BACKBONE = ModelConfig(name_or_path="tiny-qwen3-facts")


@pytest.fixture(scope="session")
def segment_rms(tmp_path_factory) -> dict[str, Path]:
    """Two segment reward models (sentence, sub-sentence level) saved as `reward_models` saves
    them; untrained (a seeded random head): what matters here is where their rewards land."""
    out = tmp_path_factory.mktemp("segment_rms")
    tok = load_tokenizer(RM_BACKBONE, padding_side="right")
    paths = {}
    for seed, level in enumerate(("sentence", "subsentence")):
        torch.manual_seed(seed)
        info = ScalarHeadInfo(kind="segment", head_dim=2, segment_level=level,
                              chat_template=tok.chat_template, max_length=128)  # fmt: skip
        model = ScalarHeadModel.from_config(RM_BACKBONE, info)
        with torch.no_grad():
            model.head.weight.mul_(50)  # spread the class probabilities
        model.tokenizer = tok
        model.save_pretrained(out / level)
        paths[level] = out / level
    return paths


def test_each_component_reward_lands_on_its_segment_end_token(segment_rms):
    tok = load_tokenizer(POLICY, padding_side="left")
    text = "Mira lives in Oslo, and Mira has a cat. I hope this helps."
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    pieces = [tok.decode([i]) for i in ids]
    # by hand: the punctuation tokens that close each sub-sentence / sentence
    comma, first_stop = pieces.index(","), pieces.index(".")
    last_stop = len(pieces) - 2
    assert pieces[last_stop] == "." and pieces[-1] == "<|end|>" and comma < first_stop < last_stop
    width = len(ids) + 3  # the batch is wider than this completion
    mask = torch.zeros(1, width, dtype=torch.long)
    mask[0, : len(ids)] = 1
    batch = RewardInput(
        prompts=["p"], completions=[tok.decode(ids, skip_special_tokens=True)],
        items=[{"messages": [{"role": "user", "content": "Tell me about Mira."}],
                "answer": "Mira lives in Oslo."}],
        lengths=torch.tensor([len(ids)]), action_mask=mask, completion_ids=[ids], tokenizer=tok,
    )  # fmt: skip
    reward = CombinedReward([
        {"name": "segment_reward_model", "label": "factuality", "weight": 0.5,
         "path": str(segment_rms["sentence"])},
        {"name": "segment_reward_model", "label": "relevance", "weight": 0.25,
         "path": str(segment_rms["subsentence"]), "mean": 0.1, "std": 2.0},
        {"name": "rouge", "label": "rouge", "weight": 2.0},
    ])  # fmt: skip
    total, parts = reward(batch)
    assert total.shape == (1, width)
    sentence_at = torch.zeros(width, dtype=torch.bool)
    sentence_at[[first_stop, last_stop]] = True
    sub_at = sentence_at.clone()
    sub_at[comma] = True
    fact, rel = parts["factuality"][0], parts["relevance"][0]
    assert (fact[~sentence_at] == 0).all() and (fact[sentence_at] != 0).all()
    assert (rel[~sub_at] == 0).all() and (rel[sub_at] != 0).all()
    # the values are the models' expected class rewards (0 no error, -1 error), normalised
    msgs = [batch.items[0]["messages"]]
    for label, level, mean, std in (("factuality", "sentence", 0.0, 1.0),
                                    ("relevance", "subsentence", 0.1, 2.0)):  # fmt: skip
        rm = ScalarHeadModel.from_pretrained(segment_rms[level])
        probs = rm.segment_scores(msgs, batch.completions)[0].softmax(-1)
        want = (-probs[:, 1] - mean) / std
        at = sentence_at if level == "sentence" else sub_at
        torch.testing.assert_close(parts[label][0][at], want)
    # ROUGE is sequence-level: on the last completion token (eos), and the total is the weighted sum
    rouge_dense = torch.zeros(width)
    rouge_dense[len(ids) - 1] = parts["rouge"][0]
    torch.testing.assert_close(total[0], 0.5 * fact + 0.25 * rel + 2.0 * rouge_dense)
    assert 0 < parts["rouge"][0] < 1


def test_alone_scores_each_segment_after_the_prompt_only(segment_rms):
    """`alone: true`: each sentence's reward is the model's score of that sentence as the whole
    completion (`segment_scores(alone=True)`), on the same end tokens as without it; without it,
    later sentences are read after the earlier ones and score otherwise."""
    tok = load_tokenizer(POLICY, padding_side="left")
    sentences = ["Mira lives in Oslo, and Mira has a cat.", "Mira eats rice.", "I hope this helps."]
    ids = tok(" ".join(sentences), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    msgs = [{"role": "user", "content": "Tell me about Mira. Notes: Mira lives in Oslo."}]
    batch = RewardInput(
        prompts=["p"], completions=[tok.decode(ids, skip_special_tokens=True)],
        items=[{"messages": msgs, "answer": "Mira lives in Oslo."}],
        lengths=torch.tensor([len(ids)]), action_mask=torch.ones(1, len(ids), dtype=torch.long),
        completion_ids=[ids], tokenizer=tok,
    )  # fmt: skip
    spec = {"name": "segment_reward_model", "label": "f", "path": str(segment_rms["sentence"])}
    alone = CombinedReward([{**spec, "alone": True}])(batch)[1]["f"][0]
    whole = CombinedReward([spec])(batch)[1]["f"][0]
    assert (alone != 0).nonzero().flatten().tolist() == (whole != 0).nonzero().flatten().tolist()
    rm = ScalarHeadModel.from_pretrained(segment_rms["sentence"])
    logits = rm.segment_scores([msgs], batch.completions, alone=True)[0]
    each = torch.cat([rm.segment_scores([msgs], [s])[0][-1:] for s in sentences])
    torch.testing.assert_close(logits, each)
    torch.testing.assert_close(alone[alone != 0], -logits.softmax(-1)[:, 1])
    read_after = rm.segment_scores([msgs], batch.completions)[0]
    torch.testing.assert_close(logits[0], read_after[0])  # the first sentence: the same
    assert not torch.allclose(logits[1:], read_after[1:])
    empty = rm.segment_scores([msgs, msgs], ["", sentences[1]], alone=True)
    assert [tuple(x.shape) for x in empty] == [(0, 2), (1, 2)]


def t5_pg_dict(segment_rms: dict[str, Path], algorithm: dict) -> dict:
    return {
        "name": "test_t5_pg",
        "seed": 0,
        "model": {"name_or_path": "tiny-t5-facts"},
        "data": {
            "train": {"path": str(REPO / "data" / "longform" / "prompts.jsonl"), "limit": 64},
            "prompt_column": "prompt",
            "answer_column": "answer",
        },
        "rewards": [
            {
                "name": "segment_reward_model",
                "label": "factuality",
                "weight": 1.0,
                "path": str(segment_rms["sentence"]),
            },
            {
                "name": "segment_reward_model",
                "label": "relevance",
                "weight": 1.0,
                "path": str(segment_rms["subsentence"]),
            },
            {"name": "rouge", "weight": 1.0},
        ],  # fmt: skip
        "algorithm": algorithm,
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "train": {"max_steps": 2, "micro_batch_size": 16, "threads": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"save_every": 0},
        "tracking": {"log_every": 1, "plot_every": 0},
    }


def preset_algorithm(name: str) -> dict:
    path = REPO / "configs" / "policy_gradients" / f"{name}.yaml"
    return yaml.safe_load(path.read_text())["algorithm"]


@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo"])
def test_t5_policy_trains_with_every_tensor_changing(segment_rms, tmp_path, name):
    algorithm = preset_algorithm(name)
    if name != "ppo":  # group estimators take a sequence reward: sum the dense rewards
        algorithm["advantage"]["dense_reduction"] = "sum"
    algorithm["ppo_epochs"] = min(algorithm.get("ppo_epochs", 1), 2)
    data = t5_pg_dict(segment_rms, algorithm)
    cfg = PGConfig.model_validate(data)
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    losses = metric_series(tmp_path / "run", "train/loss")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    start = load_file(preset_dir("tiny-t5-facts") / "model.safetensors")
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    unchanged = [k for k in final if torch.equal(final[k], start[k])]
    assert not unchanged, unchanged
    if name == "ppo":  # the value model is a T5 backbone + head, saved beside the policy
        assert metric_series(tmp_path / "run", "train/loss/value/value_loss")


def test_t5_ppo_value_model_sharing_the_policy_encoder(segment_rms, tmp_path):
    """value_shares_policy_encoder: PPO's T5 value model reads the prompt through the policy's
    encoder; the run trains, the saved value model holds no encoder layers, and the policy's
    encoder moves (the value loss's gradient reaches it too)."""
    algorithm = preset_algorithm("ppo")
    algorithm["ppo_epochs"] = 1
    data = t5_pg_dict(segment_rms, algorithm) | {"value_shares_policy_encoder": True}
    data["checkpoint"] = {"save_every": 2}
    cfg = PGConfig.model_validate(data)
    assert train(cfg, RunArgs(Path("t.yaml"), output_dir=tmp_path / "run")) == 0
    value_losses = metric_series(tmp_path / "run", "train/loss/value/value_loss")
    assert len(value_losses) == 2 and all(
        torch.isfinite(torch.tensor(v)) for v in value_losses.values()
    )
    saved = list((tmp_path / "run").glob("checkpoints/checkpoint-2/value/*.safetensors"))
    assert saved, "the value model is checkpointed beside the policy"
    value_keys = {k for p in saved for k in load_file(p)}
    assert value_keys and not any("encoder.block" in k for k in value_keys)
    start = load_file(preset_dir("tiny-t5-facts") / "model.safetensors")
    final = load_file(tmp_path / "run" / "final" / "model.safetensors")
    encoder = [k for k in final if k.startswith("encoder.block")]
    assert encoder and all(not torch.equal(final[k], start[k]) for k in encoder)
