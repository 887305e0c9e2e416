"""Rollouts, rewards, the replay buffer and the rollout log, on the real tiny model."""

from __future__ import annotations

import sqlite3

import pytest
import torch

from policy_gradients.experience import Experience, ReplayBuffer
from policy_gradients.rewards import (
    REWARDS,
    CombinedReward,
    GSM8KReward,
    OverlongReward,
    ReasoningGymReward,
    RewardInput,
    extract_answer,
)
from policy_gradients.rollout import RolloutLog, completion_logprobs, generate_rollouts
from rlhf_core.data import ReasoningGymSource, reasoning_gym_dataset
from rlhf_core.generation import Sampling
from rlhf_core.logprobs import token_logprobs
from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

TINY = ModelConfig(name_or_path="tiny-qwen3")


def reward_input(completions, items=None, lengths=None, scorer=None, width=4):
    n = len(completions)
    lengths = torch.tensor(lengths or [width] * n)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return RewardInput(["p"] * n, completions, items or [{}] * n, lengths, mask, scorer)


def test_generated_rollouts_mask_through_the_first_eos_and_flag_truncation():
    tok = load_tokenizer(TINY, padding_side="left")
    model = load_policy(TINY)
    torch.manual_seed(0)
    prompts = [
        "<|user|>abc<|end|><|assistant|>",
        "<|user|>a much longer prompt<|end|><|assistant|>",
    ]
    ro = generate_rollouts(
        model, tok, prompts, group_size=3, max_new_tokens=12, sampling=Sampling(temperature=1.0)
    )
    assert (
        ro.sequence_ids.shape[0] == 6
        and ro.action_mask.shape[1] == ro.sequence_ids.shape[1] - ro.prompt_length
    )
    completion = ro.sequence_ids[:, ro.prompt_length :]
    for b in range(6):
        row = completion[b][ro.action_mask[b].bool()].tolist()
        if ro.truncated[b]:
            assert tok.eos_token_id not in row and len(row) == ro.action_mask.shape[1]
        else:
            assert row[-1] == tok.eos_token_id and tok.eos_token_id not in row[:-1]
        assert ro.completions[b] == tok.decode(row, skip_special_tokens=True)


def test_completion_logprobs_are_those_of_the_tempered_distribution_per_row():
    tok = load_tokenizer(TINY, padding_side="left")
    model = load_policy(TINY)
    torch.manual_seed(1)
    prompts = ["<|user|>x<|end|><|assistant|>", "<|user|>longer one<|end|><|assistant|>"]
    ro = generate_rollouts(
        model, tok, prompts, group_size=2, max_new_tokens=8, sampling=Sampling(temperature=0.7)
    )
    batched = completion_logprobs(model, ro.sequence_ids, ro.attention_mask, ro.prompt_length,
                                  temperature=0.7)  # fmt: skip
    # with the action mask (training): each group's prompt encoded once, the same log-probs
    shared = completion_logprobs(model, ro.sequence_ids, ro.attention_mask, ro.prompt_length,
                                 temperature=0.7, action_mask=ro.action_mask)  # fmt: skip
    keep = ro.action_mask.bool()
    torch.testing.assert_close(shared[keep], batched[keep], rtol=1e-5, atol=1e-5)
    assert (shared[~keep] == 0).all()
    for b in range(4):  # each row alone, without padding
        keep = ro.attention_mask[b].bool()
        ids = ro.sequence_ids[b][keep][None]
        logits = model(input_ids=ids).logits[0, :-1]
        alone = token_logprobs(logits, ids[0, 1:], temperature=0.7)
        n = int(ro.action_mask[b].sum())
        torch.testing.assert_close(batched[b, :n], alone[-n:], rtol=1e-4, atol=1e-4)


def test_reasoning_gym_reward_uses_the_task_scorer_on_the_answer_tag():
    source = ReasoningGymSource(task="spell_backward", size=2, seed=5)
    ds = reasoning_gym_dataset(source)
    items = [{"entry": ds[0]}, {"entry": ds[1]}]
    good = f"thinking <answer>{ds[0]['answer']}</answer>"
    batch = reward_input([good, "no tags " + ds[1]["answer"]], items, scorer=ds)
    assert ReasoningGymReward()(batch).tolist() == [1.0, 0.0]
    full = reward_input([ds[0]["answer"], ds[1]["answer"][:-1] + "#"], items, scorer=ds)
    scores = ReasoningGymReward(extract="full")(full).tolist()
    assert scores[0] == 1.0 and 0 < scores[1] < 1  # partial credit from the task's own scorer
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"


def test_gsm8k_reward_matches_the_final_number():
    items = [{"answer": "work <<1+1=2>>\n#### 1,234"}] * 3
    batch = reward_input(["so it is 1234.", "<answer>1234</answer>", "maybe 1233"], items)
    assert GSM8KReward()(batch).tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("length", "expected"), [(10, 0.0), (12, 0.0), (14, -0.5), (16, -1.0), (17, -1.0)]
)
def test_overlong_penalty_is_dapo_piecewise(length, expected):
    batch = reward_input(["x"], lengths=[length], width=20)
    got = OverlongReward(max_length=16, cache_length=4)(batch)
    assert got.item() == pytest.approx(expected)


def test_combined_reward_weights_components_and_places_scalars_on_the_last_token():
    combo = CombinedReward([
        {"name": "format", "weight": 0.5, "label": "fmt"},
        {"name": "overlong", "weight": 2.0, "label": "long", "max_length": 3, "cache_length": 1},
    ])  # fmt: skip
    batch = reward_input(["<answer>a</answer>", "none"], lengths=[2, 4], width=4)
    total, parts = combo(batch)
    assert parts["fmt"].tolist() == [1.0, 0.0] and parts["long"].tolist() == [0.0, -1.0]
    assert total.tolist() == [0.5, -2.0]


class PerTokenLengthPenalty:
    """A dense (B, T) component registered the way a user would add one."""

    def __init__(self, *, per_token: float = -0.1) -> None:
        self.per_token = per_token

    def __call__(self, batch: RewardInput) -> torch.Tensor:
        return self.per_token * batch.action_mask.float()


if "test_per_token_penalty" not in REWARDS:
    REWARDS.register("test_per_token_penalty")(PerTokenLengthPenalty)


def test_dense_components_make_a_dense_total_with_scalars_on_the_last_token():
    combo = CombinedReward([
        {"name": "format", "weight": 1.0},
        {"name": "test_per_token_penalty", "weight": 2.0, "per_token": -0.5},
    ])  # fmt: skip
    batch = reward_input(["<answer>a</answer>", "none"], lengths=[2, 4], width=4)
    total, parts = combo(batch)
    assert parts["test_per_token_penalty"].shape == (2, 4)
    assert total.tolist() == [[-1.0, 0.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]]


def test_replay_buffer_shuffle_is_seeded_and_covers_every_row():
    def exp(n, width):
        return Experience(
            sequence_ids=torch.arange(n)[:, None].repeat(1, width),
            attention_mask=torch.ones(n, width), action_mask=torch.ones(n, 2),
            log_probs_old=torch.zeros(n, 2), advantages=torch.zeros(n, 2),
            rewards={"r": torch.arange(n).float()}, group_ids=torch.arange(n),
        )  # fmt: skip

    buffer = ReplayBuffer()
    buffer.add(exp(5, 3))
    buffer.add(exp(4, 6))
    a = buffer.micro_batches(2, seed=7)
    b = buffer.micro_batches(2, seed=7)
    c = buffer.micro_batches(2, seed=8)
    assert [m.sequence_ids.tolist() for m in a] == [m.sequence_ids.tolist() for m in b]
    assert [m.sequence_ids.tolist() for m in a] != [m.sequence_ids.tolist() for m in c]
    assert len(buffer) == 9 and sum(len(m) for m in a) == 9
    for m in a:
        assert torch.equal(m.rewards["r"].long(), m.sequence_ids[:, 0])
    buffer.clear()
    assert len(buffer) == 0


def test_unshuffled_micro_batches_keep_each_group_together():
    # 3 prompts x G = 4 completions, stored group by group as decode returns them
    n, group = 12, 4
    experience = Experience(
        sequence_ids=torch.arange(n)[:, None].repeat(1, 3), attention_mask=torch.ones(n, 3),
        action_mask=torch.ones(n, 2), log_probs_old=torch.zeros(n, 2),
        advantages=torch.zeros(n, 2), rewards={"r": torch.arange(n).float()},
        group_ids=torch.arange(n) // group,
    )  # fmt: skip
    buffer = ReplayBuffer()
    buffer.add(experience)
    whole = buffer.micro_batches(group, seed=7, shuffle=False)
    assert [m.group_ids.tolist() for m in whole] == [[0] * 4, [1] * 4, [2] * 4]
    # micro-batches of 8 rows: each holds two groups, not rows of all three prompts
    assert [m.sequence_ids[:, 0].tolist() for m in buffer.micro_batches(8, seed=7, shuffle=False)
            ] == [list(range(8)), list(range(8, 12))]  # fmt: skip
    shuffled = buffer.micro_batches(group, seed=7)
    assert any(len(set(m.group_ids.tolist())) > 1 for m in shuffled)  # what shuffling costs
    assert sorted(i for m in shuffled for i in m.sequence_ids[:, 0].tolist()) == list(range(n))


def test_rollout_log_is_queryable_and_resume_drops_redone_steps(tmp_path):
    path = tmp_path / "rollouts.sqlite"
    log = RolloutLog(path)
    log.write([(1, 0, 7, 0, "p", "c", 1.0, "{}", 0.5, 3, 0, 0),
               (2, 0, 7, 1, "p", "d", 0.0, "{}", -0.5, 4, 1, 1)])  # fmt: skip
    log.write_eval([(2, "greedy", 0, 0, "q", "e", 1.0, "{}", 2, 0)])
    log.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*), SUM(truncated) FROM rollouts").fetchone() == (2, 1)
        assert conn.execute("SELECT prompt_index, rollout_index FROM rollouts").fetchall() == [
            (7, 0), (7, 1)]  # fmt: skip
        assert conn.execute("SELECT step - 1 - policy_version FROM rollouts").fetchall() == [
            (0,), (0,)]  # fmt: skip
    RolloutLog(path, resume_step=1).close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT step FROM rollouts").fetchall() == [(1,)]
        assert conn.execute("SELECT COUNT(*) FROM eval_rollouts").fetchone() == (0,)


def test_a_rollout_log_without_policy_versions_gets_the_column_on_resume(tmp_path):
    path = tmp_path / "rollouts.sqlite"
    old_columns = RolloutLog.COLUMNS.replace(", policy_version INTEGER", "")
    assert old_columns != RolloutLog.COLUMNS
    with sqlite3.connect(path) as conn:
        conn.execute(f"CREATE TABLE rollouts ({old_columns})")
        conn.execute("INSERT INTO rollouts VALUES (1, 0, 7, 0, 'p', 'c', 1.0, '{}', 0.5, 3, 0)")
    log = RolloutLog(path, resume_step=1)
    log.write([(2, 0, 7, 1, "p", "d", 0.0, "{}", -0.5, 4, 1, 0)])
    log.close()
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT step, policy_version FROM rollouts ORDER BY rowid").fetchall()
    assert rows == [(1, None), (2, 0)]


def test_reward_model_component_loads_a_saved_scalar_head_directory(tmp_path):
    from policy_gradients.rewards import RewardModelReward
    from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel

    torch.manual_seed(0)
    model = ScalarHeadModel.from_config(TINY, ScalarHeadInfo(kind="preference", max_length=64))
    model.tokenizer = load_tokenizer(TINY, padding_side="right")
    model.save_pretrained(tmp_path / "rm")
    messages = [[{"role": "user", "content": "Spell: abc"}], [{"role": "user", "content": "hi"}]]
    batch = reward_input(["cba", "hello"], [{"messages": m} for m in messages])
    expected = model.eval().score(messages, ["cba", "hello"])
    reward = RewardModelReward(path=str(tmp_path / "rm"), mean=0.5, std=2.0, scale=3.0, bias=1.0)
    torch.testing.assert_close(reward(batch), (expected - 0.5) / 2.0 * 3.0 + 1.0)


def test_seeded_rollouts_do_not_depend_on_how_prompts_are_split():
    """What a 2-process run relies on: with per-prompt seeds, rank 0's prompts {0, 2} and rank 1's
    {1, 3} get exactly the completions they get when one process samples all four."""
    tok = load_tokenizer(TINY, padding_side="left")
    torch.manual_seed(0)
    model = load_policy(TINY)
    prompts = [f"<|user|>{w}<|end|><|assistant|>" for w in ("ab", "a longer one", "xyz", "q")]
    seeds = [101, 202, 303, 404]
    kwargs = {"group_size": 3, "max_new_tokens": 12, "sampling": Sampling(temperature=1.0)}
    whole = generate_rollouts(model, tok, prompts, seeds=seeds, **kwargs)
    for rank in (0, 1):
        part = generate_rollouts(model, tok, prompts[rank::2], seeds=seeds[rank::2], **kwargs)
        rows = [g * 3 + j for g in range(rank, 4, 2) for j in range(3)]
        assert part.completions == [whole.completions[i] for i in rows]
    assert len(set(whole.completions)) > 4  # really sampled, not greedy
    again = generate_rollouts(model, tok, prompts, seeds=[s + 1 for s in seeds], **kwargs)
    assert again.completions != whole.completions


def test_implicit_reward_model_is_simpo_and_dpo_reward_of_a_saved_policy(tmp_path):
    """SimPO's beta/|y| log pi(y|x) and DPO's beta (log pi - log pi_ref), checked against a plain
    forward of the whole sequence (float64) on prompts and completions of different lengths."""
    from policy_gradients.rewards import ImplicitRewardModel

    tok = load_tokenizer(TINY, padding_side="right")
    torch.manual_seed(0)
    for name in ("policy", "ref"):
        model = load_policy(TINY)
        if name == "ref":  # another model, so that log pi - log pi_ref is not 0
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.05 * torch.randn_like(param))
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    prompts = ["<|user|>abc<|end|><|assistant|>", "<|user|>a longer prompt<|end|><|assistant|>"]
    completions = ["cba", "a much longer completion"]

    def summed(path):  # log p(completion + eos | prompt), one sequence at a time, float64
        model = load_policy(ModelConfig(name_or_path=str(path))).double().eval()
        out = []
        for p, c in zip(prompts, completions, strict=True):
            p_ids = tok(p, add_special_tokens=False)["input_ids"]
            c_ids = tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([p_ids + c_ids])
            logps = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append((logps[len(p_ids) - 1 :].sum().item(), len(c_ids)))
        return torch.tensor(out, dtype=torch.float64)

    pi, ref = summed(tmp_path / "policy"), summed(tmp_path / "ref")
    batch = RewardInput(prompts, completions, [{}, {}], torch.tensor([4, 6]),
                        torch.ones(2, 6, dtype=torch.long))  # fmt: skip
    simpo = ImplicitRewardModel(path=str(tmp_path / "policy"), beta=2.0, batch_size=1)
    torch.testing.assert_close(simpo(batch).double(), 2.0 * pi[:, 0] / pi[:, 1], atol=1e-4, rtol=0)
    dpo = ImplicitRewardModel(
        path=str(tmp_path / "policy"), reference=str(tmp_path / "ref"), beta=0.5, std=2.0
    )
    expected = 0.5 * (pi[:, 0] - ref[:, 0]) / 2.0
    assert expected.abs().min() > 1e-2
    torch.testing.assert_close(dpo(batch).double(), expected, atol=1e-4, rtol=0)
