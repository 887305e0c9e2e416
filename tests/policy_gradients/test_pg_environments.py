"""Multi-turn episodes with environments and tools (policy_gradients.environments, .tools,
.episodes): the trainer's ids are the sampled ids plus the environment's rendered tokens, turn by
turn, on the tiny template and on Qwen's ChatML tokenizer; environment tokens carry no loss; the
multi-turn GRPO loss against a float64 hand computation; bad tool calls and hanging tools."""

from __future__ import annotations

import json
import math
import re
import shlex
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, eos_prone_model, run_module

from policy_gradients.advantages import ADVANTAGES, GRPOAdvantage
from policy_gradients.environments import (
    ENVIRONMENTS,
    CalculatorArithmetic,
    Environment,
    GuessNumber,
)
from policy_gradients.episodes import (
    Episode,
    EpisodeRunner,
    Turn,
    environment_text,
    environment_tokens,
    turn_rewards,
)
from policy_gradients.experience import LossInputs
from policy_gradients.losses import LOSSES
from policy_gradients.rollout import completion_logprobs
from policy_gradients.tools import TOOLS, ToolBox, ToolCall, parse_tool_calls
from rlhf_core.chat import render_prompt
from rlhf_core.errors import UserError
from rlhf_core.generation import Sampling, decode, row_generators
from rlhf_core.models import ModelConfig, load_tokenizer

QWEN2 = REPO.parent / "shared" / "data" / "tokenizers" / "qwen2"

# A Qwen3-style tool template written for these tests (not Qwen3's own file): ChatML turns, tool
# results as user turns wrapped in <tool_response>, and, as Qwen3 does, an assistant turn before
# the last real user query rendered without its <think> block. Re-rendering a conversation with
# it changes earlier turns, which is what the episode's token ids must not depend on.
QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' and loop.index0 < ns.last_query -%}"
    "{{ '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1].lstrip('\\n') "
    "+ '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def tiny_tokenizer():
    return load_tokenizer(ModelConfig(name_or_path="tiny-qwen3"), padding_side="left")


def qwen_tokenizer(template: str | None = None):
    if not (QWEN2 / "tokenizer.json").is_file():
        pytest.skip(f"no Qwen2 tokenizer at {QWEN2}")
    return load_tokenizer(
        ModelConfig(name_or_path=str(QWEN2), chat_template=template), padding_side="left"
    )


@ENVIRONMENTS.register("test_echo_tool")
class EchoToolEnvironment(Environment):
    """Answers every reply with a tool message echoing its length, and a user note on every
    second turn; reward 0.25 per turn. Never ends by itself."""

    def reset(self, row):
        self.turn = 0
        return [dict(m) for m in row["messages"]]

    def step(self, messages, completion):
        self.turn += 1
        new = [{"role": "tool", "name": "echo", "content": f"echo:{len(completion)}"}]
        if self.turn % 2 == 0:
            new.append({"role": "user", "content": "go on"})
        return new, 0.25, False


def prompt_item(text: str, answer: str = "5") -> dict:
    messages = [{"role": "user", "content": text}]
    return {"prompt": text, "messages": messages, "answer": answer}


def rendered_environment(messages: list[dict], *, chatml: bool, tool_role: str) -> str:
    """What the environment's messages must look like after a model turn's eos, written out by
    hand for the two templates (tool results as the Qwen3-style template or tool_role user
    wraps them)."""
    out = "\n" if chatml else ""
    for m in messages:
        content = m["content"]
        if m["role"] == "tool":
            content = (f"<tool_response>\n{content}\n</tool_response>" if tool_role == "tool"
                       else f"<tool_response>{content}</tool_response>")  # fmt: skip
        out += (f"<|im_start|>user\n{content}<|im_end|>\n" if chatml
                else f"<|user|>{content}<|end|>")  # fmt: skip
    return out + ("<|im_start|>assistant\n" if chatml else "<|assistant|>")


def check_token_identity(model, tokenizer, *, tool_role: str, chatml: bool) -> None:
    runner = EpisodeRunner({"name": "test_echo_tool"}, max_turns=4, max_tokens=300,
                           tool_role=tool_role)  # fmt: skip
    items = [prompt_item("Echo a word."), prompt_item("Another prompt, a longer one.")]
    seeds = [11, 12]
    sampling = Sampling(temperature=1.0)
    ep = runner.rollouts(model, tokenizer, items, group_size=3, max_new_tokens=8,
                         sampling=sampling, seeds=seeds)  # fmt: skip
    eos = tokenizer.eos_token_id
    multi = 0
    for b, episode in enumerate(ep.episodes):
        item = items[b // 3]
        prompt = tokenizer(render_prompt(tokenizer, item["messages"]), add_special_tokens=False)
        assert episode.prompt_ids == prompt["input_ids"]
        context = list(episode.prompt_ids)
        env_messages_seen = 0
        for index, turn in enumerate(episode.turns):
            if turn.role == "assistant":
                # the sampled ids: this turn re-drawn alone, from the same context and seed
                seed = (seeds[b // 3] * 1_000_003 + b % 3) * 7_919 + index // 2
                ids = torch.tensor([context])
                out = decode(
                    model, ids, torch.ones_like(ids), max_new_tokens=8, eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id, sampling=sampling,
                    generator=row_generators([seed], "cpu"),
                )[0, len(context) :].tolist()  # fmt: skip
                cut = out.index(eos) + 1 if eos in out else len(out)
                assert turn.token_ids == out[:cut], (b, index)
                assert turn.text == tokenizer.decode(turn.token_ids, skip_special_tokens=True)
            elif turn.token_ids:
                env_messages_seen += 1
                new = [{"role": "tool", "name": "echo", "content": turn.text.split("\n")[0]}]
                if "\ngo on" in turn.text:
                    new.append({"role": "user", "content": "go on"})
                expected = rendered_environment(new, chatml=chatml, tool_role=tool_role)
                assert turn.token_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
            context += turn.token_ids
        multi += env_messages_seen >= 2
        # the trainer's row: prompt | turns, exactly, with loss weight on the model's turns only
        row = ep.sequence_ids[b][ep.attention_mask[b].bool()].tolist()
        assert row == context
        completion = ep.sequence_ids[b, ep.prompt_length :]
        action = ep.action_mask[b].bool()
        expected_action = [t.role == "assistant" for t in episode.turns for _ in t.token_ids]
        n = len(expected_action)
        assert action[:n].tolist() == expected_action and not action[n:].any()
        assert completion[:n].tolist() == context[len(episode.prompt_ids) :]
        assert episode.reward == pytest.approx(0.25 * sum(t.role == "assistant" and
                                                         t.token_ids[-1:] == [eos]
                                                         for t in episode.turns))  # fmt: skip
    assert multi >= 1, "no episode reached a second environment turn; the test saw too little"


def test_token_identity_on_the_tiny_template():
    tokenizer = tiny_tokenizer()
    check_token_identity(eos_prone_model(tokenizer), tokenizer, tool_role="user", chatml=False)


def test_token_identity_on_qwen_chatml_with_a_qwen3_style_tool_template():
    tokenizer = qwen_tokenizer(QWEN3_STYLE_TEMPLATE)
    check_token_identity(eos_prone_model(tokenizer), tokenizer, tool_role="tool", chatml=True)


def test_token_identity_on_the_shipped_qwen2_chatml_template():
    tokenizer = qwen_tokenizer()  # its own plain ChatML template: no tool role, so "user"
    check_token_identity(eos_prone_model(tokenizer), tokenizer, tool_role="user", chatml=True)


def test_environment_turns_never_re_render_earlier_turns():
    """Qwen3 drops an earlier turn's <think> block when the conversation is re-rendered; the
    episode keeps the reply as sampled and renders only what the environment adds."""
    tokenizer = qwen_tokenizer(QWEN3_STYLE_TEMPLATE)
    question = [{"role": "user", "content": "Guess my number, 1 to 8."}]
    reply = "<think>\nmid is 4\n</think>\n4"
    prompt = tokenizer(render_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]
    sampled = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    feedback = [{"role": "user", "content": "higher"}]
    ours = prompt + sampled + environment_tokens(tokenizer, feedback)
    re_rendered = render_prompt(tokenizer, [*question, {"role": "assistant", "content": reply},
                                            *feedback])  # fmt: skip
    assert tokenizer.decode(ours) == render_prompt(tokenizer, question) + reply + (
        "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    assert "<think>" not in re_rendered  # the hazard the episode avoids
    assert tokenizer(re_rendered, add_special_tokens=False)["input_ids"] != ours


def test_environment_text_needs_a_tool_role_or_tool_role_user():
    tokenizer = tiny_tokenizer()
    tool = [{"role": "tool", "name": "calculator", "content": "42"}]
    with pytest.raises(UserError, match="tool_role: user"):
        environment_text(tokenizer, tool)
    text = environment_text(tokenizer, tool, tool_role="user")
    assert text == "<|user|><tool_response>42</tool_response><|end|><|assistant|>"


def test_behaviour_logprobs_of_episodes_are_the_samplers():
    """With `behaviour_logprobs`, each model token keeps the log-prob it was drawn with: the
    trainer's recomputed log-prob of the same token (same model, temperature, no truncation),
    and 0 on environment tokens."""
    tokenizer = tiny_tokenizer()
    model = eos_prone_model(tokenizer)
    runner = EpisodeRunner({"name": "test_echo_tool"}, max_turns=3, max_tokens=200,
                           tool_role="user")  # fmt: skip
    ep = runner.rollouts(model, tokenizer, [prompt_item("Echo.")] * 2, group_size=2,
                         max_new_tokens=8, sampling=Sampling(temperature=0.7), seeds=[3, 4],
                         behaviour_logprobs=True)  # fmt: skip
    action = ep.action_mask.bool()
    assert ep.log_probs_behaviour is not None and (ep.log_probs_behaviour[~action] == 0).all()
    args = (ep.sequence_ids, ep.attention_mask, ep.prompt_length)
    trainer = completion_logprobs(model, *args, temperature=0.7, action_mask=ep.action_mask)
    assert torch.allclose(ep.log_probs_behaviour[action], trainer[action], atol=1e-4)


def test_environment_tokens_have_zero_loss_weight():
    """Per-token log-probs over the whole episode (environment positions included) into the GRPO
    loss: the gradient reaches the model's tokens and not one environment token."""
    tokenizer = tiny_tokenizer()
    model = eos_prone_model(tokenizer)
    runner = EpisodeRunner({"name": "test_echo_tool"}, max_turns=3, max_tokens=200,
                           tool_role="user")  # fmt: skip
    ep = runner.rollouts(
        model,
        tokenizer,
        [prompt_item("Echo.")] * 2,
        group_size=2,
        max_new_tokens=8,
        sampling=Sampling(temperature=1.0),
        seeds=[3, 4],
    )
    env = torch.zeros_like(ep.action_mask, dtype=torch.bool)  # from the turns, not the mask
    for b, episode in enumerate(ep.episodes):
        roles = [t.role == "environment" for t in episode.turns for _ in t.token_ids]
        env[b, : len(roles)] = torch.tensor(roles)
    assert env.any(), "no environment tokens to check"
    args = (ep.sequence_ids, ep.attention_mask, ep.prompt_length)
    masked = completion_logprobs(model, *args, temperature=1.0, action_mask=ep.action_mask)
    assert (masked[env] == 0).all()
    every = completion_logprobs(model, *args, temperature=1.0).detach().requires_grad_(True)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    advantages, _ = GRPOAdvantage()(rewards, action_mask=ep.action_mask.bool(),
                                    group_ids=torch.tensor([0, 0, 1, 1]))  # fmt: skip
    inputs = LossInputs(
        action_mask=ep.action_mask,
        advantages=advantages,
        log_probs_old=every.detach() - 0.1,
        log_probs_ref=every.detach() + 0.2,
    )
    loss_fn = LOSSES.get("clipped")(eps_low=0.2, eps_high=0.2, kl_beta=0.1,
                                    aggregation="seq-mean-token-mean")  # fmt: skip
    loss, _ = loss_fn(every, inputs)
    loss.backward()
    assert (every.grad[env] == 0).all()
    assert (every.grad[ep.action_mask.bool()] != 0).any()


def test_multi_turn_grpo_loss_matches_a_float64_hand_computation():
    """Two groups of two episodes whose model tokens are interrupted by environment tokens
    (mask 0 inside the row): GRPO advantages, the clipped surrogate and k3 KL, per-episode token
    mean, summed over episodes and divided by their number; all written out in loops."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 1],
                         [1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 1, 0]])  # fmt: skip
    rewards = torch.tensor([1.0, 0.25, 0.5, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    logp = (-torch.rand(4, 6, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(4, 6, dtype=torch.float64)
    ref = logp.detach() + 0.5 * torch.randn(4, 6, dtype=torch.float64)
    beta, eps = 0.05, 0.2
    advantages, _ = GRPOAdvantage(eps=1e-6)(rewards, action_mask=mask.bool(), group_ids=groups)
    loss_fn = LOSSES.get("clipped")(eps_low=eps, eps_high=eps, kl_beta=beta, kl_estimator="k3",
                                    aggregation="seq-mean-token-mean")  # fmt: skip
    inputs = LossInputs(action_mask=mask, advantages=advantages, log_probs_old=old,
                        log_probs_ref=ref)  # fmt: skip
    loss, _ = loss_fn(logp, inputs)

    r = rewards.tolist()
    total = 0.0
    for i in range(4):
        mates = [r[j] for j in range(4) if groups[j] == groups[i]]
        mean = sum(mates) / len(mates)
        std = math.sqrt(sum((x - mean) ** 2 for x in mates) / (len(mates) - 1))
        a = (r[i] - mean) / (std + 1e-6)
        terms = []
        for t in range(6):
            if not mask[i, t]:
                continue
            lp, lo, lr = float(logp[i, t].detach()), float(old[i, t]), float(ref[i, t])
            ratio = math.exp(lp - lo)
            policy = -min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
            kl = math.exp(lr - lp) - (lr - lp) - 1
            terms.append(policy + beta * kl)
        total += sum(terms) / len(terms)
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(total / 4, abs=1e-12, rel=1e-12)
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all()


# ---------------------------------------------------------------------------- tools


@pytest.mark.parametrize("scale", [True, False])
def test_turn_grpo_matches_a_float64_hand_computation(scale: bool):
    """MT-GRPO's turn-level advantage (arXiv:2505.11821), written out in loops: turns are runs of
    the action mask; each turn's reward is normalised over the group, a turn an episode never
    reached counting 0; a token of turn j gets A_j + lam * sum of the later turns' A_k."""
    lam, eps = 0.5, 1e-6
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1],
                         [1, 0, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0]]).bool()  # fmt: skip
    groups = torch.tensor([7, 7, 7, 3, 3])
    rewards = torch.zeros(5, 7, dtype=torch.float64)
    for (b, t), v in {
        (0, 1): 0.5,
        (0, 4): 1.0,
        (0, 6): -0.25,
        (1, 0): 0.0,
        (1, 3): 1.0,
        (2, 6): 1.5,
        (3, 0): 0.5,
        (3, 3): 1.0,
        (4, 1): 0.0,
        (4, 3): 0.25,
    }.items():
        rewards[b, t] = v  # fmt: skip
    got, returns = ADVANTAGES.get("turn_grpo")(lam=lam, eps=eps, scale_rewards=scale)(
        rewards, action_mask=mask, group_ids=groups
    )
    assert returns is None

    turns = []  # per row: [(token positions, reward)] in order
    for b in range(5):
        row, t = [], 0
        while t < 7:
            if mask[b, t]:
                span = []
                while t < 7 and mask[b, t]:
                    span.append(t)
                    t += 1
                row.append((span, sum(float(rewards[b, u]) for u in span)))
            else:
                t += 1
        turns.append(row)
    assert [len(r) for r in turns] == [3, 2, 1, 2, 2]
    adv = {}
    for b in range(5):
        for j in range(3):
            r = turns[b][j][1] if len(turns[b]) > j else 0.0
            mates = [turns[c][j][1] if len(turns[c]) > j else 0.0
                     for c in range(5) if groups[c] == groups[b]]  # fmt: skip
            mean = sum(mates) / len(mates)
            std = math.sqrt(sum((x - mean) ** 2 for x in mates) / (len(mates) - 1))
            adv[b, j] = (r - mean) / (std + eps) if scale else r - mean
    want = torch.zeros(5, 7, dtype=torch.float64)
    for b in range(5):
        for j, (span, _) in enumerate(turns[b]):
            value = adv[b, j] + lam * sum(adv[b, k] for k in range(j + 1, 3))
            for t in span:
                want[b, t] = value
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    # one turn per episode: GRPO's advantage of the summed reward
    full = torch.ones(5, 7, dtype=torch.bool)
    one, _ = ADVANTAGES.get("turn_grpo")(lam=lam, scale_rewards=scale)(
        rewards, action_mask=full, group_ids=groups
    )
    grpo, _ = GRPOAdvantage(scale_rewards=scale, dense_reduction="sum")(
        rewards, action_mask=full, group_ids=groups
    )
    torch.testing.assert_close(one, grpo, rtol=1e-12, atol=1e-12)
    # lam 1, unscaled: a first turn's advantage is Dr. GRPO's of the episode's summed reward
    first, _ = ADVANTAGES.get("turn_grpo")(lam=1.0, scale_rewards=False)(
        rewards, action_mask=mask, group_ids=groups
    )
    dr, _ = GRPOAdvantage(scale_rewards=False, dense_reduction="sum")(
        rewards, action_mask=mask, group_ids=groups
    )
    torch.testing.assert_close(first[:, 0], dr[:, 0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="needs per-turn rewards"):
        ADVANTAGES.get("turn_grpo")()(rewards.sum(-1), action_mask=mask, group_ids=groups)


def test_turn_rewards_sit_on_each_model_turns_last_token():
    episode = Episode([1, 2], turns=[
        Turn("assistant", [5, 6, 7], "call", 0.5), Turn("environment", [8, 9], "result"),
        Turn("assistant", [10, 11], "answer", 1.0), Turn("environment", [], "closing"),
    ], reward=1.5)  # fmt: skip
    short = Episode([1], turns=[Turn("assistant", [5], "answer", -0.25)], reward=-0.25)
    got = turn_rewards([episode, short], width=8)
    want = torch.zeros(2, 8)
    want[0, 2], want[0, 6], want[1, 0] = 0.5, 1.0, -0.25
    torch.testing.assert_close(got, want)
    assert got.sum(-1).tolist() == [1.5, -0.25]


def test_parse_tool_calls_reads_valid_and_flags_invalid_blocks():
    text = (
        'a <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call> '
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call><tool_call>{"name": "y"'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "2+3"}, True),
        ("calculator", {"expression": "1"}, True),
    ]
    assert [c.error is not None for c in calls[2:]] == [True] * 4
    assert "invalid JSON" in calls[2].error and "</tool_call>" in calls[5].error
    assert parse_tool_calls("no calls here") == []
    # a garbled opening tag (as sampled): a call that did not run, not an answer
    garbled = parse_tool_calls('<tool_caol>{"name":"calculator","arguments":{}}</tool_call>')
    assert len(garbled) == 1 and garbled[0].error == "</tool_call> without <tool_call>"


def test_bad_tool_calls_become_error_messages():
    box = ToolBox(["calculator"], timeout_s=2.0)
    assert box.run(ToolCall("calculator", {"expression": "37 * 48"})).content == "1776"
    cases = {
        "unknown tool": ToolCall("search", {"q": "x"}),
        "missing argument": ToolCall("calculator", {}),
        "unknown argument": ToolCall("calculator", {"expression": "1", "mode": "x"}),
        "must be of type string": ToolCall("calculator", {"expression": 12}),
        "ZeroDivisionError": ToolCall("calculator", {"expression": "1 / 0"}),
        "unsupported expression": ToolCall("calculator", {"expression": "__import__('os')"}),
        "invalid JSON": parse_tool_calls("<tool_call>{oops}</tool_call>")[0],
    }
    for expected, call in cases.items():
        result = box.run(call)
        assert not result.ok and result.content.startswith("error") and expected in result.content
        assert result.message()["role"] == "tool"


@TOOLS.register("test_spin")
def spin(n: int) -> str:
    """Loop forever, swallowing ordinary exceptions."""
    while True:
        try:
            n += 1
        except Exception:
            pass


@TOOLS.register("test_sleep")
def sleep(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "woke"


def test_a_hanging_tool_is_stopped_and_reported():
    box = ToolBox(["test_spin", "test_sleep"], timeout_s=0.2)
    for call in (ToolCall("test_spin", {"n": 0}), ToolCall("test_sleep", {"seconds": 30})):
        start = time.perf_counter()
        result = box.run(call)
        assert time.perf_counter() - start < 5
        assert not result.ok and "timed out after 0.2 s" in result.content
    assert box.run(ToolCall("test_sleep", {"seconds": 0.01})).content == "woke"  # timer cleared
    time.sleep(0.3)  # no stray alarm fires after the calls
    found = {}  # off the main thread: no signals, the call is abandoned after the timeout
    worker = threading.Thread(
        target=lambda: found.update(r=box.run(ToolCall("test_sleep", {"seconds": 30})))
    )
    start = time.perf_counter()
    worker.start()
    worker.join(10)
    assert time.perf_counter() - start < 5 and "timed out" in found["r"].content


def test_tool_environment_answers_calls_and_scores_the_answer():
    env = CalculatorArithmetic()
    messages = env.reset(prompt_item("37*48=?", answer="1776"))
    new, reward, done = env.step(messages, '<tool_call>{"name": "calculator", "arguments": '
                                 '{"expression": "37*48"}}</tool_call>')  # fmt: skip
    assert new == [{"role": "tool", "name": "calculator", "content": "1776"}]
    assert (reward, done) == (0.0, False)
    new, reward, done = env.step(messages, "<tool_call>{bad</tool_call>")
    assert new[0]["content"].startswith("error") and not done
    assert env.stats == {"tool_calls": 2.0, "invalid_tool_calls": 1.0, "right_calls": 1.0}
    assert env.step(messages, "<answer>1776</answer>") == ([], 1.0, True)
    assert env.step(messages, "<answer>1777</answer>")[1] == 0.0


def call(expression: str) -> str:
    return ('<tool_call>{"name": "calculator", "arguments": {"expression": "'
            + expression + '"}}</tool_call>')  # fmt: skip


def test_right_call_reward_is_paid_once_for_the_questions_operands():
    """right_call_reward: a call that ran and returned the row's answer earns it, once per
    episode; a call with other operands, a broken call and a second right call earn nothing; an
    episode is a success (reward >= 1) only with the right answer."""
    env = CalculatorArithmetic(right_call_reward=0.5)
    messages = env.reset(prompt_item("37*48=?", answer="1776"))
    assert env.stats == {"tool_calls": 0.0, "invalid_tool_calls": 0.0, "right_calls": 0.0}
    assert env.step(messages, call("37*84"))[1] == 0.0  # valid, wrong operands
    assert env.step(messages, call("37*48)"))[1] == 0.0  # a syntax error comes back as error:
    assert env.step(messages, call("48*37")) == (
        [{"role": "tool", "name": "calculator", "content": "1776"}], 0.5, False)  # fmt: skip
    assert env.step(messages, call("37*48"))[1] == 0.0  # paid once
    assert env.stats == {"tool_calls": 4.0, "invalid_tool_calls": 1.0, "right_calls": 1.0}
    assert env.step(messages, "<answer>1776</answer>") == ([], 1.0, True)
    env.reset(prompt_item("37*48=?", answer="1776"))  # a new episode pays again
    assert env.step(messages, call("37*48"))[1] == 0.5 and env.stats["right_calls"] == 1.0
    assert env.step(messages, "<answer>1775</answer>")[1] == 0.0  # 0.5 in all: not solved
    with pytest.raises(UserError, match=r"environment.env.right_call_reward: .*\[0, 1\)"):
        CalculatorArithmetic(right_call_reward=1.0)


def test_invalid_call_penalty_is_taken_per_invalid_call():
    """invalid_call_penalty: minus p for each call that did not run (bad JSON, an unknown tool,
    a failing expression), beside call_reward per valid call; the right call's reward stays."""
    env = CalculatorArithmetic(invalid_call_penalty=0.5, call_reward=0.1, right_call_reward=0.25)
    messages = env.reset(prompt_item("37*48=?", answer="1776"))
    assert env.step(messages, "<tool_call>{bad</tool_call>")[1] == -0.5
    two_bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>' + call("37*48)")
    assert env.step(messages, two_bad)[1] == -1.0
    assert env.step(messages, call("37*84"))[1] == pytest.approx(0.1)  # valid, wrong operands
    assert env.step(messages, call("37*48") + "<tool_call>{bad</tool_call>")[1] == pytest.approx(
        0.1 + 0.25 - 0.5)  # fmt: skip
    assert env.stats == {"tool_calls": 6.0, "invalid_tool_calls": 4.0, "right_calls": 1.0}
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(UserError, match="environment.env.invalid_call_penalty: .*>= 0"):
            CalculatorArithmetic(invalid_call_penalty=bad)


def test_guess_number_gives_feedback_until_right():
    env = GuessNumber()
    messages = env.reset(prompt_item("Guess my number, 1 to 8.", answer="6"))
    assert env.step(messages, "<answer>3</answer>") == ([{"role": "user", "content": "higher"}],
                                                        0.0, False)  # fmt: skip
    assert env.step(messages, "7")[0][0]["content"] == "lower"
    assert env.step(messages, "no idea")[0][0]["content"] == "Say a number."
    assert env.step(messages, "<answer>6</answer>")[1:] == (1.0, True)


def test_budget_and_max_turns_end_episodes():
    tokenizer = tiny_tokenizer()
    model = eos_prone_model(tokenizer, p_eos=0.5)
    for max_turns, max_tokens in ((2, 400), (6, 40)):
        runner = EpisodeRunner({"name": "test_echo_tool"}, max_turns=max_turns,
                               max_tokens=max_tokens, tool_role="user")  # fmt: skip
        ep = runner.rollouts(
            model,
            tokenizer,
            [prompt_item("Echo.")],
            group_size=4,
            max_new_tokens=6,
            sampling=Sampling(temperature=1.0),
            seeds=[5],
        )
        for e in ep.episodes:
            assert sum(t.role == "assistant" for t in e.turns) <= max_turns
            assert len(e.completion_ids) <= max_tokens
        if max_tokens == 40:
            assert any(e.truncated for e in ep.episodes)


def test_config_environment_block(tmp_path: Path):
    from policy_gradients.config import PGConfig

    base = {
        "model": {"name_or_path": "tiny-qwen3"},
        "data": {"train": {"path": str(tmp_path / "rows.jsonl")}},
        "algorithm": {"name": "grpo", "advantage": {"name": "grpo"},
                      "loss": {"name": "clipped", "eps_low": 0.2, "eps_high": 0.2}},
    }  # fmt: skip
    cfg = PGConfig.model_validate(
        {
            **base,
            "rewards": [{"name": "environment"}],
            "environment": {"env": {"name": "guess_number"}},
        }
    )
    assert cfg.environment.env == {"name": "guess_number"} and cfg.environment.max_turns == 4
    assert PGConfig.model_validate({**base, "rewards": [{"name": "format"}]}).environment is None
    with pytest.raises(ValueError, match="needs an environment"):
        PGConfig.model_validate({**base, "rewards": [{"name": "environment"}]})
    with pytest.raises(ValueError, match="unknown environment"):
        PGConfig.model_validate(
            {**base, "rewards": [{"name": "environment"}], "environment": {"env": {"name": "nope"}}}
        )


# ---------------------------------------------------------------------------- end to end


def save_eos_prone_model(directory: Path) -> Path:
    """The tiny tokenizer and an `eos_prone_model` saved as a Hugging Face directory, so a
    trainer loads it by path and its episodes reach environment turns."""
    tokenizer = tiny_tokenizer()
    eos_prone_model(tokenizer, p_eos=0.25).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def code_block(text: str, lang: str) -> str:
    (block,) = re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)
    return block


def check_run(run_dir: Path, start: Path) -> sqlite3.Connection:
    """A finished run: finite losses, every trained tensor changed, turns in the rollout log."""
    from safetensors.torch import load_file

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)
    before, after = load_file(start / "model.safetensors"), load_file(
        run_dir / "final" / "model.safetensors")  # fmt: skip
    assert not [k for k in before if torch.equal(before[k], after[k])]
    return sqlite3.connect(run_dir / "rollouts.sqlite")


@pytest.mark.slow
def test_docs_example_trains(tmp_path: Path):
    """docs/policy_gradients/environments.md's environment and config, run with the page's
    command (the policy swapped for an eos-prone tiny model so episodes reach a second turn)."""
    page = (REPO / "docs" / "policy_gradients" / "environments.md").read_text()
    (tmp_path / "my_env.py").write_text(code_block(page, "python"))
    blocks = re.findall(r"^```yaml\n(.*?)^```$", page, flags=re.S | re.M)
    (tmp_path / "my_env.yaml").write_text(next(b for b in blocks if b.startswith("# my_env")))
    (command,) = [b.strip() for b in re.findall(r"^```bash\n(.*?)^```$", page, re.S | re.M)
                  if "policy_gradients.train" in b]  # fmt: skip
    argv = shlex.split(command)
    assert argv[:5] == ["uv", "run", "python", "-m", "policy_gradients.train"]
    model = save_eos_prone_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    result = run_module(argv[4], *argv[5:], "--output-dir", str(run_dir),
                        "--set", f"model.name_or_path={model}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    with check_run(run_dir, model) as db:
        roles = dict(db.execute("SELECT role, COUNT(*) FROM turns GROUP BY role").fetchall())
        retries = db.execute("SELECT COUNT(*) FROM turns WHERE text = 'No. Try again.'")
        assert roles.get("assistant", 0) >= 16 and retries.fetchone()[0] >= 1
        steps = db.execute("SELECT DISTINCT step FROM turns ORDER BY step").fetchall()
        assert steps == [(1,), (2,)]


@pytest.mark.slow
@pytest.mark.parametrize("env", ["calculator", "guess"])
def test_shipped_environment_configs_train(env: str, tmp_path: Path):
    """configs/policy_gradients/tiny_<env>_grpo.yaml for two steps on its own data (from
    rlhf_lab.multi_turn), the eos-prone tiny model as the policy; held-out episodes evaluated."""
    from rlhf_lab.multi_turn import ENVS, write_data

    write_data(tmp_path, env, train=32, held_out=4, worked=2)
    model = save_eos_prone_model(tmp_path / "model")
    config = REPO / "configs" / "policy_gradients" / f"{ENVS[env]}.yaml"
    run_dir = tmp_path / "run"
    result = run_module(
        "policy_gradients.train", "--config", str(config), "--output-dir", str(run_dir),
        "--set", f"model.name_or_path={model}", "--set", f"data.train.path={tmp_path}/train.jsonl",
        "--set", f"data.eval.path={tmp_path}/eval.jsonl", "--set", "train.max_steps=2",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
        "--set", "train.threads=1", "--set", "algorithm.loss.entropy_coef=0.01",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    with check_run(run_dir, model) as db:
        assert db.execute("SELECT COUNT(*) FROM turns").fetchone()[0] >= 8
    summary = json.loads((run_dir / "summary.json").read_text())
    final = json.dumps(summary)
    assert "eval/greedy_success" in final and "eval/sampled_turns" in final
    if env == "calculator":
        assert "eval/sampled_tool_call_valid" in final


def test_turn_grpo_trains_the_calculator_and_is_refused_without_per_turn_rewards(tmp_path: Path):
    """algorithm.advantage turn_grpo with the environment's per-turn rewards, 2 steps of the
    shipped calculator config; without per_turn the config is refused in one line."""
    from rlhf_lab.multi_turn import ENVS, write_data

    write_data(tmp_path, "calculator", train=32, held_out=4, worked=2)
    model = save_eos_prone_model(tmp_path / "model")
    config = REPO / "configs" / "policy_gradients" / f"{ENVS['calculator']}.yaml"
    common = [
        "--config", str(config), "--set", f"model.name_or_path={model}",
        "--set", f"data.train.path={tmp_path}/train.jsonl",
        "--set", f"data.eval.path={tmp_path}/eval.jsonl", "--set", "train.max_steps=2",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
        "--set", "train.threads=1", "--set", "train.eval_every=0",
        "--set", "algorithm.advantage={name: turn_grpo, lam: 0.5, scale_rewards: false}",
    ]  # fmt: skip
    refused = run_module("policy_gradients.train", *common, "--output-dir", str(tmp_path / "no"),
                         cwd=tmp_path)  # fmt: skip
    assert refused.returncode != 0 and "per_turn: true" in refused.stderr
    run_dir = tmp_path / "run"
    result = run_module(
        "policy_gradients.train", *common, "--output-dir", str(run_dir),
        "--set", "rewards=[{name: environment, per_turn: true}]", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum("train/loss" in r for r in rows) == 2


@pytest.mark.parametrize("env_name", ["calculator", "guess"])
def test_worked_trajectories_solve_their_environment(env_name: str):
    """The SFT data of rlhf_lab.multi_turn: replayed through the environment, every worked
    episode gets back exactly its own environment messages and ends solved within max_turns."""
    from policy_gradients.config import PGConfig
    from policy_gradients.environments import arithmetic_rows, guess_rows
    from rlhf_core.config import load_config
    from rlhf_lab.multi_turn import ENVS, worked_calculator, worked_guess

    cfg = load_config(PGConfig, REPO / "configs" / "policy_gradients" / f"{ENVS[env_name]}.yaml")
    rows = arithmetic_rows(20, seed=3) if env_name == "calculator" else guess_rows(20, seed=3)
    worker = worked_calculator if env_name == "calculator" else worked_guess
    runner = EpisodeRunner.from_config(cfg.environment)
    for row in rows:
        worked = worker(row)
        env = runner.new_environment()
        messages = env.reset({**row, "messages": worked[:1]})
        total, replies = 0.0, [i for i, m in enumerate(worked) if m["role"] == "assistant"]
        assert len(replies) <= cfg.environment.max_turns
        for k, i in enumerate(replies):
            new, reward, done = env.step(messages, worked[i]["content"])
            total += reward
            following = worked[i + 1 : replies[k + 1]] if k + 1 < len(replies) else []
            if not done:
                assert new == following
            messages = [*messages, worked[i], *new]
        assert done and total == 1.0 + getattr(env, "right_call_reward", 0.0)


def test_advantage_share_counts_groups_that_had_a_signal(tmp_path: Path):
    """rlhf_lab.multi_turn.advantage_share: the share of (step, prompt) groups with a nonzero
    advantage, read from a rollout log written by RolloutLog."""
    from policy_gradients.rollout import RolloutLog
    from rlhf_lab.multi_turn import advantage_share

    log = RolloutLog(tmp_path / "rollouts.sqlite")
    rows = [(step, 0, prompt, k, "p", "c", 0.0, "{}", adv, 3, 0, step - 1)
            for step, prompt, advs in ((1, 0, [0.0, 0.0]), (1, 1, [0.5, -0.5]),
                                       (2, 0, [0.0, -0.0]), (2, 3, [0.0, 1.0]))
            for k, adv in enumerate(advs)]  # fmt: skip
    log.write(rows)
    log.close()
    assert advantage_share(tmp_path) == 0.5


def test_held_out_episodes_are_paired_and_match_the_trainers_evaluation(tmp_path: Path):
    """rlhf_lab.multi_turn.held_out: the same seed draws the same episodes (a paired comparison
    of two models), pass 0 is `evaluate_episodes(seed=...)`'s sampled pass, and every sampled
    pass has one record per prompt."""
    from policy_gradients.config import PGConfig
    from policy_gradients.episodes import evaluate_episodes
    from policy_gradients.rollout import load_prompts
    from rlhf_core.config import load_config
    from rlhf_core.models import load_policy
    from rlhf_lab.multi_turn import ENVS, episode_figures, held_out, write_data

    write_data(tmp_path, "calculator", train=4, held_out=6, worked=2)
    model = save_eos_prone_model(tmp_path / "model")
    config = REPO / "configs" / "policy_gradients" / f"{ENVS['calculator']}.yaml"
    cfg = load_config(PGConfig, config, [f"model.name_or_path={model}",
                      f"data.train.path={tmp_path}/train.jsonl",
                      f"data.eval.path={tmp_path}/eval.jsonl"])  # fmt: skip
    first, again = held_out(cfg, model, seed=3, samples=2), held_out(cfg, model, seed=3, samples=2)
    assert first == again
    sampled = first["episodes"]["sampled"]
    assert [r[0] for r in sampled] == [0, 1, 2, 3, 4, 5] * 2
    assert len(first["episodes"]["greedy"]) == 6
    assert first["eval/sampled_success"] == episode_figures(sampled)["success"]
    model_cfg = ModelConfig(name_or_path=str(model))
    tokenizer = load_tokenizer(model_cfg, padding_side="left")
    items = load_prompts(cfg.data.eval, tokenizer, where="data.eval", **cfg.prompt_args()).items
    trainer = evaluate_episodes(
        EpisodeRunner.from_config(cfg.environment), load_policy(model_cfg), tokenizer, items,
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        batch_size=100, seed=3,
    )  # fmt: skip
    pass0 = episode_figures(sampled[:6])
    assert trainer["eval/sampled_success"] == pass0["success"]
    assert trainer["eval/sampled_turns"] == pytest.approx(pass0["turns"])


def test_paired_difference_bootstraps_over_prompts():
    """rlhf_lab.multi_turn.paired_difference: after minus before of a figure, with a bootstrap
    interval over prompts; no change gives 0 and a zero-width interval."""
    from rlhf_lab.multi_turn import paired_difference

    before = [[p, float(p % 2), 1.0, float(p % 3 == 0), 2.0] for p in range(10)] * 2
    assert paired_difference(before, before, "success") == (0.0, 0.0, 0.0)
    after = [[p, 1.0, 1.0, 0.0, 2.0] for p, *_ in before]
    diff, low, high = paired_difference(before, after, "success")
    assert diff == 0.5 and 0.0 <= low <= diff <= high <= 1.0
    diff, low, high = paired_difference(before, after, "tool_call_valid")
    assert diff == pytest.approx(0.4) and low <= diff <= high
