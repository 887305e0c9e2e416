"""Configuration of policy-gradient training, loaded from YAML.

An algorithm is a named combination written out in full in its YAML (nothing is filled in
behind the user's back except documented keyword defaults, which the resolved config shows):

    algorithm:
      name: grpo                                   # a label for logs
      advantage: {name: grpo, eps: 1.0e-6}         # policy_gradients.advantages.ADVANTAGES
      loss: {name: clipped, eps_low: 0.2, eps_high: 0.2, aggregation: seq-mean-token-mean,
             kl_beta: 0.04, kl_estimator: k3}      # policy_gradients.losses.LOSSES (KL in loss)
      kl_in_reward: {beta: 0.0, estimator: k1}     # KL as a per-token reward (PPO, REINFORCE)
      value_loss: null                             # PPO: {name: value, eps_value: 0.2}, coef
      dynamic_sampling: false                      # DAPO: drop groups with equal rewards
      correction: null                             # off-policy: {name: tis, cap: 2.0}, mis,
                                                   # decoupled (policy_gradients.off_policy)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlhf_core.bookkeeping import TrainerConfig, run_name
from rlhf_core.config import StrictModel
from rlhf_core.data import DataSource, SplitDataConfig
from rlhf_core.errors import UserError
from rlhf_core.generation import Sampling
from rlhf_core.loop import BaseLoopConfig
from rlhf_core.models import ModelConfig, ReferenceConfig
from rlhf_core.registry import registered_spec, validate_spec

AdvantageSpec = registered_spec(
    "policy_gradients.advantages:ADVANTAGES", where="algorithm.advantage"
)
PolicyLossSpec = registered_spec("policy_gradients.losses:LOSSES", where="algorithm.loss")
ValueLossSpec = registered_spec(
    "policy_gradients.losses:VALUE_LOSSES", where="algorithm.value_loss"
)
CorrectionSpec = registered_spec(
    "policy_gradients.off_policy:CORRECTIONS", where="algorithm.correction"
)


class KLRewardConfig(StrictModel):
    beta: float = Field(0.0, ge=0, description="weight of -beta * k per token in the reward")
    estimator: Literal["k1", "k2", "k3"] = Field("k1", description="KL estimator (rlhf_core.kl)")


class AlgorithmConfig(StrictModel):
    name: str = Field(description="label of this combination, e.g. grpo")
    advantage: AdvantageSpec = Field(description="advantage estimator name and keywords")
    loss: PolicyLossSpec = Field(description="per-token policy loss name and keywords")
    kl_in_reward: KLRewardConfig = Field(
        default_factory=KLRewardConfig, description="KL penalty folded into the reward"
    )
    value_loss: ValueLossSpec | None = Field(None, description="value loss (PPO), name + keywords")
    value_coef: float = Field(0.5, ge=0, description="weight of the value loss")
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    mini_batches: int = Field(
        1, ge=1, description="optimizer steps per pass: the pass's micro-batches are split into "
        "this many consecutive groups, one step each (PPO/DAPO mini-batches); with more than one "
        "step per rollout batch the update is off-policy and the clip acts",
    )  # fmt: skip
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal, resample to fill"
    )
    max_sampling_rounds: int = Field(4, ge=1, description="cap on dynamic-sampling generations")
    correction: CorrectionSpec | None = Field(
        None, description="off-policy correction for the sampler/trainer mismatch, name + "
        "keywords (policy_gradients.off_policy.CORRECTIONS: tis, mis, decoupled); a per-token "
        "weight on the policy term from pi_old / mu; null = none",
    )  # fmt: skip


class PromptDataConfig(SplitDataConfig):
    train: DataSource = Field(description="training prompts (reasoning-gym or a file)")
    eval: DataSource | None = Field(None, description="held-out prompts")
    format: Literal["auto", "plain", "conversational", "hh"] = Field(
        "auto",
        description="how a row's prompt is read (policy_gradients.rollout.prompt_messages): plain "
        "= a string user turn; conversational = a message list (a trailing assistant turn "
        "dropped); hh = Anthropic HH transcripts (the prompt, or the chosen/rejected pair), cut "
        "at the last '\\n\\nAssistant:'; auto = by the row (lists conversational, strings "
        "starting with '\\n\\nHuman:' or a prompt-less chosen/rejected pair hh, other strings "
        "plain)",
    )
    prompt_column: str = Field("prompt", description="question column of file rows")
    answer_column: str = Field(
        "answer",
        description="reference answer column of file rows; read when present, required only "
        "when a reward needs it (gsm8k, exact_match, rouge)",
    )
    prompt_template: str = Field(
        "{question}", description="the last user turn; {question} is replaced by its text"
    )
    system_prompt: str | None = Field(
        None, description="optional system turn (a row's own system turn wins)"
    )


class RolloutConfig(StrictModel):
    prompts_per_step: int = Field(8, gt=0, description="prompts sampled per step")
    group_size: int = Field(8, gt=0, description="completions per prompt")
    max_new_tokens: int = Field(64, gt=0, description="completion length cap")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (log-probs use it)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(0, ge=0, description="top-k sampling; 0 = off")
    min_p: float = Field(0.0, ge=0, lt=1, description="min-p sampling; 0 = off")
    behaviour_logprobs: bool = Field(
        True, description="keep the sampler's log-prob of each token (after temperature and "
        "truncation) and log its mismatch with the trainer's (mismatch/*; with top_p, top_k or "
        "min_p set, one extra no-grad forward of up to train.micro_batch_size rows per round "
        "finds the tokens outside the trainer's truncated set); algorithm.correction needs it",
    )  # fmt: skip
    max_staleness: int = Field(
        0, description="asynchronous rollouts (policy_gradients.async_rollouts): the batch of "
        "step s is sampled with the weights of step max(0, s - k), at most k updates old, by a "
        "generator process while the trainer trains the steps before it; 0 = the synchronous "
        "loop (sample, then train)",
    )  # fmt: skip
    generator: Literal["auto", "inline", "process"] = Field(
        "auto", description="where rollouts are sampled: inline = in the trainer between steps "
        "(max_staleness 0 only); process = a generator process fed the weights through shared "
        "memory (at max_staleness 0 the trainer waits for each batch: the inline loop's numbers "
        "bit for bit, no overlap); auto = inline at max_staleness 0, else process",
    )  # fmt: skip

    @field_validator("max_staleness")
    @classmethod
    def _staleness(cls, k: int) -> int:
        if k < 0:
            raise UserError(
                f"rollout.max_staleness {k}: expected an integer >= 0 (0 = synchronous; k = the "
                "weights that sample a batch are at most k updates old)"
            )
        return k

    @property
    def uses_generator_process(self) -> bool:
        """Whether a generator process samples the rollouts (`generator`, `max_staleness`)."""
        return self.generator == "process" or (self.generator == "auto" and self.max_staleness > 0)

    def sampling(self) -> Sampling:
        """These settings as `rlhf_core.generation.Sampling`, what `decode` takes."""
        return Sampling(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p
        )


EnvironmentSpec = registered_spec(
    "policy_gradients.environments:ENVIRONMENTS", where="environment.env"
)


class EnvironmentConfig(StrictModel):
    env: EnvironmentSpec = Field(
        description="the environment's registered name and keywords "
        "(policy_gradients.environments.ENVIRONMENTS, or module:Class)"
    )
    max_turns: int = Field(4, gt=0, description="model turns per episode at most")
    max_tokens: int = Field(
        256, gt=0, description="token budget of an episode after its first prompt, model and "
        "environment tokens together; an episode whose next turn would pass it ends, truncated",
    )  # fmt: skip
    tool_role: Literal["tool", "user"] = Field(
        "tool", description="tool results rendered with the chat template's 'tool' role (Qwen3 "
        "and most tool-calling templates), or as user turns wrapped in "
        "<tool_response>...</tool_response> for templates without one (the tiny world's)",
    )  # fmt: skip


class PGTrainConfig(BaseLoopConfig):
    max_steps: int = Field(100, gt=0, description="rollout + update steps")
    micro_batch_size: int = Field(16, gt=0, description="completions per forward/backward")


class PGConfig(TrainerConfig):
    name: str = run_name("grpo")
    model: ModelConfig = Field(description="the policy (its starting weights are also pi_ref)")
    value_model: ModelConfig | None = Field(
        None, description="PPO value model backbone; null = the policy's starting checkpoint"
    )
    value_shares_policy_encoder: bool = Field(
        False,
        description="PPO with an encoder-decoder (T5) policy: the value model reads the prompt "
        "through the policy's encoder instead of its own copy (single process; "
        "rlhf_core.policy_model.share_policy_encoder)",
    )
    data: PromptDataConfig = Field(description="prompts")
    rewards: list[dict[str, Any]] = Field(description="reward components with weights")
    strip_thinking: bool = Field(
        True,
        description="reward components (verifiers, reward models) score each completion without "
        "its <think>...</think> blocks; false = the whole text",
    )
    algorithm: AlgorithmConfig = Field(description="estimator + loss + KL placement")
    reference: ReferenceConfig = Field(
        default_factory=ReferenceConfig, description="pi_ref (used when a KL term needs it)"
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="sampling")
    environment: EnvironmentConfig | None = Field(
        None, description="multi-turn episodes against an environment "
        "(policy_gradients.episodes; rollout.max_new_tokens caps each model turn); null = one "
        "prompt, one completion",
    )  # fmt: skip
    train: PGTrainConfig = Field(default_factory=PGTrainConfig, description="loop settings")

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from policy_gradients.rewards import REWARDS

        if not specs:
            raise UserError("rewards: list at least one component")
        out = []
        for i, spec in enumerate(specs):
            extra = {k: spec[k] for k in ("weight", "label") if k in spec}
            core = {k: v for k, v in spec.items() if k not in extra}
            checked = validate_spec(REWARDS, core, where=f"rewards.{i}")
            out.append({**checked, "weight": float(extra.get("weight", 1.0)),
                        "label": extra.get("label", checked["name"])})  # fmt: skip
        return out

    def prompt_args(self) -> dict[str, Any]:
        """The keywords of `policy_gradients.rollout.load_prompts` this config sets: the data
        block's format, columns and template, and the rewards that need each row's answer."""
        from policy_gradients.rewards import answer_needed_by

        d = self.data
        return {
            "prompt_column": d.prompt_column, "answer_column": d.answer_column,
            "prompt_template": d.prompt_template, "system_prompt": d.system_prompt,
            "format": d.format, "columns": d.columns,
            "answer_needed_by": answer_needed_by(self.rewards),
        }  # fmt: skip

    @model_validator(mode="after")
    def _consistent(self) -> PGConfig:
        self.reference.check([self.model], precomputed_ok=False)
        correction = self.algorithm.correction
        if correction is not None and not self.rollout.behaviour_logprobs:
            raise UserError(
                f"algorithm.correction {correction['name']!r} weighs tokens by pi_old / mu and "
                "needs the sampler's log-probs mu, but rollout.behaviour_logprobs is false"
            )
        ro = self.rollout
        if ro.generator == "inline" and ro.max_staleness > 0:
            raise UserError(
                f"rollout.generator inline with rollout.max_staleness {ro.max_staleness}: stale "
                "batches are sampled by a generator process; use generator auto or process"
            )
        if ro.uses_generator_process and self.environment is not None:
            raise UserError(
                "rollout.max_staleness > 0 (or rollout.generator process) with an environment: "
                "multi-turn episodes are sampled inline only; set max_staleness 0"
            )
        uses_gae = self.algorithm.advantage["name"] == "gae"
        if uses_gae != (self.algorithm.value_loss is not None):
            raise UserError("the 'gae' advantage needs algorithm.value_loss, and only it does")
        if self.environment is None and any(r["name"] == "environment" for r in self.rewards):
            raise UserError("rewards: the 'environment' reward needs an environment: block")
        from policy_gradients.advantages import ADVANTAGES

        estimator = ADVANTAGES.get(self.algorithm.advantage["name"])
        if estimator.needs_groups and self.rollout.group_size < 2:
            raise UserError(
                f"rollout.group_size {self.rollout.group_size}: the "
                f"{self.algorithm.advantage['name']!r} advantage compares completions of the same "
                "prompt, so a group of one always gets advantage 0 and nothing is learned; use "
                "group_size >= 2 (or an estimator without groups, e.g. reinforce)"
            )
        if self.environment is not None and estimator.needs_values:
            raise UserError(
                f"algorithm.advantage {self.algorithm.advantage['name']!r} with an environment: "
                "per-token values across environment turns are not supported; use a group "
                "estimator (grpo, dr_grpo, rloo) or reinforce"
            )
        if self.algorithm.advantage["name"] == "turn_grpo" and not any(
            r["name"] == "environment" and r.get("per_turn") for r in self.rewards
        ):
            raise UserError(
                "algorithm.advantage 'turn_grpo' credits each turn with its own reward: it needs "
                "an environment: block and the reward {name: environment, per_turn: true}"
            )
        return self
