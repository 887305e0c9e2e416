"""Multi-turn rollouts: model turns and environment turns, as the trainer's token rows.

`EpisodeRunner.rollouts` plays `group_size` episodes of each prompt row against the configured
environment (`policy_gradients.environments`), all episodes of a batch decoding together:

    prompt ids  = the tokenizer's chat template of `env.reset(row)`, with the generation prompt
    model turn  = the ids `rlhf_core.generation.decode` sampled, through the eos token, kept as
                  sampled (the text goes to `env.step`; it is never re-tokenized)
    env turn    = `environment_tokens`: the environment's new messages rendered by the chat
                  template as the text that follows an assistant turn's eos, through the next
                  generation prompt, tokenized once
    episode     = prompt ids | model | env | model | ... up to `max_turns` model turns

Re-rendering a whole conversation is what this avoids: a template may render earlier turns
differently (Qwen3 drops earlier <think> blocks) and text may tokenize differently from what was
sampled, so the trainer would score tokens the sampler never drew. Each environment turn is
rendered once, against a fixed one-exchange conversation, so earlier turns are never re-rendered.

The rows are an `Episodes` (a `rollout.Rollouts`): the completion is everything after the prompt,
`attention_mask` is 1 on every real token and `action_mask` only on the model's tokens, so the
environment's tokens are context with loss weight 0 in the policy loss and the KL. An episode ends
when the environment says so, after `max_turns` model turns, when a model turn reaches
`max_new_tokens` without eos (truncated), or when its next turn would pass `max_tokens`, the
budget of model and environment tokens after the prompt (truncated). Its reward is the sum of the
per-turn rewards (`rewards` (B,), the `environment` reward component); group estimators then
compare whole trajectories, and `turn_grpo` compares turns (with `environment`'s `per_turn`).
Not here: dense per-turn rewards for GAE, KV-cache reuse across turns (each turn re-encodes the
episode so far), environments that run asynchronously.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from jinja2.exceptions import TemplateError

from policy_gradients.environments import ENVIRONMENTS, Environment
from policy_gradients.rollout import Rollouts
from policy_gradients.tools import parse_tool_calls
from rlhf_core.chat import Messages, render_prompt
from rlhf_core.errors import UserError
from rlhf_core.generation import Sampling, decode, row_generators

REPLY_MARK = "rlhf-lab-reply-7f3a"  # the fixed assistant reply environment turns follow
TURN_PRIME = 7_919  # mixes a model turn's index into its rows' sampling seeds


def shown_messages(messages: Messages, tool_role: str) -> Messages:
    """The environment's messages as the template gets them: with `tool_role` "user", tool
    results become user turns wrapped in <tool_response>...</tool_response> (as Qwen3's own
    template renders them), for templates without a tool role."""
    if tool_role == "tool":
        return [{k: v for k, v in m.items() if k in ("role", "content", "name")} for m in messages]
    return [
        {"role": "user", "content": f"<tool_response>{m['content']}</tool_response>"}
        if m["role"] == "tool" else {"role": m["role"], "content": m["content"]}
        for m in messages
    ]  # fmt: skip


def environment_text(tokenizer: Any, messages: Messages, *, tool_role: str = "tool") -> str:
    """The text the chat template puts after an assistant turn's eos token when `messages`
    follow it, through the next generation prompt (rendered against a fixed one-exchange
    conversation, so no earlier turn is re-rendered)."""
    eos = tokenizer.eos_token
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": REPLY_MARK}]
    try:
        full = tokenizer.apply_chat_template(
            base + shown_messages(messages, tool_role), tokenize=False,
            add_generation_prompt=True, **getattr(tokenizer, "rlhf_template_kwargs", {}),
        )  # fmt: skip
    except TemplateError as exc:
        raise UserError(
            f"the chat template cannot render the environment's messages "
            f"({[m['role'] for m in messages]}): {exc}; for a template without a 'tool' role "
            "set environment.tool_role: user"
        ) from None
    reply = full.find(REPLY_MARK)
    end = full.find(eos, reply + len(REPLY_MARK)) if reply >= 0 and eos else -1
    if end < 0:
        raise UserError(
            f"the chat template does not close an assistant turn with the eos token {eos!r}, "
            "so a sampled turn (which ends at eos) cannot be followed by environment turns"
        )
    return full[end + len(eos) :]


def environment_tokens(tokenizer: Any, messages: Messages, *, tool_role: str = "tool") -> list[int]:
    """`environment_text`, tokenized (no special tokens added)."""
    text = environment_text(tokenizer, messages, tool_role=tool_role)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Turn:
    role: str  # "assistant" (sampled, trained) or "environment" (context, loss weight 0)
    token_ids: list[int]  # as sampled / as rendered; empty for a closing message not shown
    text: str
    reward: float = 0.0  # the environment's reward for this model turn
    tools: str = ""  # the tools called (assistant) or answering (environment), comma-separated
    logprobs: list[float] | None = None  # assistant: the sampler's log-prob of each token


@dataclass
class Episode:
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    finished: bool = False  # the environment ended it
    truncated: bool = False  # a model turn without eos, or the token budget
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def completion_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]


@dataclass(kw_only=True)
class Episodes(Rollouts):
    """Rollouts of whole episodes (see the module docstring); `completions` are the decoded
    transcripts after the prompt, special tokens kept."""

    episodes: list[Episode]
    rewards: torch.Tensor  # (B,) each episode's summed rewards

    def turn_rewards(self) -> torch.Tensor:
        """(B, T) each model turn's reward on its last token (`turn_rewards`)."""
        return turn_rewards(self.episodes, self.action_mask.shape[1])

    def completion_token_ids(self) -> list[list[int]]:
        return [e.completion_ids for e in self.episodes]


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
    return ids, mask


def turn_rewards(episodes: list[Episode], width: int) -> torch.Tensor:
    """(B, `width`) float32: each model turn's reward on that turn's last token, 0 elsewhere
    (aligned with `episode_rows`' completion); a row sums to its episode's reward when every
    rewarded turn has tokens. What `environment` with `per_turn: true` gives the trainer."""
    out = torch.zeros((len(episodes), width), dtype=torch.float32)
    for b, episode in enumerate(episodes):
        at = 0
        for turn in episode.turns:
            at += len(turn.token_ids)
            if turn.role == "assistant" and turn.token_ids:
                out[b, at - 1] = turn.reward
    return out


def episode_rows(episodes: list[Episode], pad_id: int) -> tuple[Any, ...]:
    """(sequence_ids (B, P + T), attention_mask, action_mask (B, T), P, the sampler's log-probs
    (B, T) float32 or None): left-padded prompts, then each episode's turns, right-padded."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_id)
    width = max(1, max(len(e.completion_ids) for e in episodes))
    ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(episodes), width), dtype=torch.long)
    action = torch.zeros((len(episodes), width), dtype=torch.long)
    recorded = all(
        t.logprobs is not None for e in episodes for t in e.turns if t.role != "environment"
    )
    behaviour = torch.zeros((len(episodes), width), dtype=torch.float32) if recorded else None
    for b, episode in enumerate(episodes):
        at = 0
        for turn in episode.turns:
            n = len(turn.token_ids)
            if n:
                ids[b, at : at + n] = torch.tensor(turn.token_ids)
                attention[b, at : at + n] = 1
                action[b, at : at + n] = int(turn.role == "assistant")
                if behaviour is not None and turn.role == "assistant":
                    behaviour[b, at : at + n] = torch.tensor(turn.logprobs)
            at += n
    sequence_ids = torch.cat([prompt_ids, ids], 1)
    attention = torch.cat([prompt_mask, attention], 1)
    return sequence_ids, attention, action, prompt_ids.shape[1], behaviour


class EpisodeRunner:
    """Plays episodes of the configured environment (`PGConfig.environment`)."""

    def __init__(self, env: dict[str, Any], *, max_turns: int, max_tokens: int,
                 tool_role: str = "tool") -> None:  # fmt: skip
        self.cls = ENVIRONMENTS.get(env["name"])
        self.kwargs = {k: v for k, v in env.items() if k != "name"}
        self.max_turns, self.max_tokens, self.tool_role = max_turns, max_tokens, tool_role

    @classmethod
    def from_config(cls, cfg: Any) -> EpisodeRunner | None:
        """The runner of a config's `environment:` block; None without one."""
        if cfg is None:
            return None
        return cls(cfg.env, max_turns=cfg.max_turns, max_tokens=cfg.max_tokens,
                   tool_role=cfg.tool_role)  # fmt: skip

    def new_environment(self) -> Environment:
        return self.cls(**self.kwargs)

    @torch.no_grad()
    def rollouts(
        self, model: torch.nn.Module, tokenizer: Any, items: list[dict[str, Any]], *,
        group_size: int, max_new_tokens: int, sampling: Sampling, seeds: list[int] | None = None,
        behaviour_logprobs: bool = False,
    ) -> Episodes:  # fmt: skip
        """`group_size` episodes of each prompt item, grouped consecutively; `seeds` (one per
        item) seed each episode's model turns (as `rollout.generate_rollouts` seeds its rows);
        `behaviour_logprobs` keeps the sampler's log-prob of each model token (`decode`'s
        `with_logprobs`) as `log_probs_behaviour`, 0 on environment tokens."""
        device = next(model.parameters()).device
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        rows = [it for it in items for _ in range(group_size)]
        envs = [self.new_environment() for _ in rows]
        messages = [env.reset(row) for env, row in zip(envs, rows, strict=True)]
        episodes = [Episode(tokenizer(render_prompt(tokenizer, m), add_special_tokens=False)
                            ["input_ids"]) for m in messages]  # fmt: skip
        context = [list(e.prompt_ids) for e in episodes]
        used = [0] * len(rows)
        active = list(range(len(rows)))
        was_training = model.training
        model.eval()
        try:
            for turn in range(self.max_turns):
                if not active:
                    break
                room = {b: min(max_new_tokens, self.max_tokens - used[b]) for b in active}
                ids, mask = left_pad([context[b] for b in active], pad)
                generator = None
                if seeds is not None:  # episode b's turn `turn`: its own generator
                    row_seeds = [(seeds[b // group_size] * 1_000_003 + b % group_size)
                                 * TURN_PRIME + turn for b in active]  # fmt: skip
                    generator = row_generators(row_seeds, device)
                out = decode(
                    model, ids.to(device), mask.to(device), max_new_tokens=max(room.values()),
                    eos_token_id=eos, pad_token_id=pad, sampling=sampling, generator=generator,
                    with_logprobs=behaviour_logprobs,
                )  # fmt: skip
                out, logprobs = out if behaviour_logprobs else (out, None)
                sampled = out[:, ids.shape[1] :].tolist()
                logprobs = (
                    logprobs.float().cpu().tolist()
                    if logprobs is not None
                    else [None] * len(active)
                )
                active = [
                    b for k, b in enumerate(active)
                    if self._step(b, sampled[k][: room[b]], turn, envs, messages, episodes,
                                  context, used, tokenizer, logprobs[k])
                ]  # fmt: skip
        finally:
            model.train(was_training)
        for episode, env in zip(episodes, envs, strict=True):
            episode.stats = dict(getattr(env, "stats", {}))
        sequence_ids, attention, action, prompt_length, behaviour = episode_rows(episodes, pad)
        completions = tokenizer.batch_decode(
            [e.completion_ids for e in episodes], skip_special_tokens=False
        )
        return Episodes(
            sequence_ids=sequence_ids, attention_mask=attention, action_mask=action,
            prompt_length=prompt_length, completions=completions,
            truncated=torch.tensor([e.truncated for e in episodes]), episodes=episodes,
            rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            log_probs_behaviour=behaviour,
        )  # fmt: skip

    def _step(self, b: int, sampled: list[int], turn: int, envs: list[Environment],
              messages: list[Messages], episodes: list[Episode], context: list[list[int]],
              used: list[int], tokenizer: Any, logprobs: list[float] | None) -> bool:  # fmt: skip
        """Record episode b's sampled model turn (and the sampler's log-probs of its tokens),
        let the environment answer, and append its tokens; True while the episode goes on."""
        episode, eos = episodes[b], tokenizer.eos_token_id
        closed = eos in sampled
        if closed:
            sampled = sampled[: sampled.index(eos) + 1]
        logprobs = logprobs[: len(sampled)] if logprobs is not None else None
        text = tokenizer.decode(sampled, skip_special_tokens=True)
        called = ",".join(c.name or "?" for c in parse_tool_calls(text))
        context[b] += sampled
        used[b] += len(sampled)
        if not closed:  # cut at max_new_tokens or the budget: the episode ends here
            episode.turns.append(Turn("assistant", sampled, text, 0.0, called, logprobs))
            episode.truncated = True
            return False
        new, reward, done = envs[b].step([dict(m) for m in messages[b]], text)
        episode.reward += float(reward)
        episode.turns.append(Turn("assistant", sampled, text, float(reward), called, logprobs))
        messages[b] = [*messages[b], {"role": "assistant", "content": text}, *new]
        answered = ",".join(m.get("name", "") for m in new if m["role"] == "tool")
        content = "\n".join(m["content"] for m in new)
        if done or turn == self.max_turns - 1:  # nothing more is shown to the model
            episode.finished = bool(done)
            if new:
                episode.turns.append(Turn("environment", [], content, 0.0, answered))
            return False
        env_ids = environment_tokens(tokenizer, new, tool_role=self.tool_role)
        if used[b] + len(env_ids) >= self.max_tokens:  # no room left for another reply
            episode.turns.append(Turn("environment", [], content, 0.0, answered))
            episode.truncated = True
            return False
        episode.turns.append(Turn("environment", env_ids, content, 0.0, answered))
        context[b] += env_ids
        used[b] += len(env_ids)
        return True


def episode_sums(episodes: list[Episode], rows: list[int]) -> dict[str, float]:
    """Sums over the episodes `rows` for the step's metrics (`collect.rollout_metrics` divides
    by the number of completions): model turns, tool calls, successes, the environment's stats."""
    sums: dict[str, float] = {}
    for b in rows:
        e = episodes[b]
        values = {"turns": sum(t.role == "assistant" for t in e.turns),
                  "finished": float(e.finished), **e.stats}  # fmt: skip
        for key, value in values.items():
            sums[f"env/{key}"] = sums.get(f"env/{key}", 0.0) + float(value)
    return sums


def episode_records(
    episodes: Episodes, rows: list[int], *, step: int, prompt_indices: list[int],
    group_ids: torch.Tensor, group_size: int,
) -> tuple[dict[str, float], list[tuple]]:  # fmt: skip
    """For the episodes `rows` of one round (`collect.collect_experience`): their metric sums
    (`episode_sums`) and the rollout log's `turns` rows, trajectory id = group id x G + index."""
    trajectories = [int(group_ids[b]) * group_size + b % group_size for b in rows]
    indices = [prompt_indices[b // group_size] for b in rows]
    turns = turn_log_rows(episodes, rows, step=step, prompt_indices=indices,
                          trajectory_ids=trajectories, group_size=group_size)  # fmt: skip
    return episode_sums(episodes.episodes, rows), turns


def turn_log_rows(episodes: Episodes, rows: list[int], *, step: int, prompt_indices: list[int],
                  trajectory_ids: list[int], group_size: int) -> list[tuple]:  # fmt: skip
    """The rollout log's `turns` rows of episodes `rows` (`RolloutLog.TURN_COLUMNS`): step,
    prompt index, rollout index, trajectory id, turn index, role, text, tools, turn reward."""
    out = []
    for b, prompt_index, trajectory in zip(rows, prompt_indices, trajectory_ids, strict=True):
        for index, turn in enumerate(episodes.episodes[b].turns):
            out.append((step, prompt_index, b % group_size, trajectory, index, turn.role,
                        turn.text, turn.tools, turn.reward))  # fmt: skip
    return out


@torch.no_grad()
def evaluate_episodes(
    runner: EpisodeRunner, policy: torch.nn.Module, tokenizer: Any, items: list[dict[str, Any]],
    *, max_new_tokens: int, temperature: float, batch_size: int, seed: int,
    log_rows: list[tuple] | None = None, kinds: tuple[str, ...] = ("greedy", "sampled"),
    records: list[dict[str, float]] | None = None,
) -> dict[str, float]:  # fmt: skip
    """Held-out episodes, greedy and sampled at `temperature` (`kinds`): `eval/<kind>_reward`
    (mean episode reward), `_success` (share reaching the environment's `success_reward`),
    `_turns`, `_tool_calls`, `_tool_call_valid` (share of calls that ran), `_truncated`. Episode i
    is seeded by (seed, i) alone. With `log_rows`, one `eval_rollouts` row per episode (after its
    `step` column), the transcript as completion; with `records`, one dict per episode (`kind`,
    `index`, and the values summed above)."""
    threshold = runner.cls.success_reward
    results: dict[str, float] = {}
    temperatures = {"greedy": 0.0, "sampled": temperature}
    for kind, temp in ((k, temperatures[k]) for k in kinds):
        sums: dict[str, float] = {}
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            seeds = [seed * 1_000_003 + start + i for i in range(len(chunk))]
            ep = runner.rollouts(
                policy, tokenizer, chunk, group_size=1, sampling=Sampling(temperature=temp),
                max_new_tokens=max_new_tokens, seeds=seeds,
            )  # fmt: skip
            for b, e in enumerate(ep.episodes):
                values = {"reward": e.reward, "success": float(e.reward >= threshold),
                          "truncated": float(e.truncated),
                          **episode_sums(ep.episodes, [b])}  # fmt: skip
                for key, value in values.items():
                    sums[key] = sums.get(key, 0.0) + value
                if records is not None:
                    records.append({"kind": kind, "index": start + b, **values})
                if log_rows is not None:
                    log_rows.append((kind, start + b, 0, chunk[b]["prompt"], ep.completions[b],
                                     e.reward, json.dumps({"environment": e.reward}),
                                     len(e.completion_ids), int(e.truncated)))  # fmt: skip
        n = max(1, len(items))
        for key in ("reward", "success", "truncated", "env/turns"):
            results[f"eval/{kind}_{key.removeprefix('env/')}"] = sums.get(key, 0.0) / n
        calls = sums.get("env/tool_calls", 0.0)
        if calls or "env/tool_calls" in sums:
            results[f"eval/{kind}_tool_calls"] = calls / n
            results[f"eval/{kind}_tool_call_valid"] = (
                1.0 - sums.get("env/invalid_tool_calls", 0.0) / calls if calls else 0.0
            )
    return results


def gather_rows(rows: list[tuple], world: int) -> list[tuple]:
    """Every process's rows (rank 0 writes them); the rows themselves with one process."""
    if world == 1:
        return rows
    from accelerate.utils import gather_object

    return gather_object(rows)
