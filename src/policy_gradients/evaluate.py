"""Held-out evaluation of a policy: greedy and sampled completions scored by the reward
components, their length, and the KL to the reference on the sampled ones.

Reported per component c: `eval/greedy_<c>` (mean), `eval/greedy_<c>_exact` (share scoring
1.0: accuracy for a verifier; not for a learned reward, whose scores are not grades, nor for a
penalty such as `overlong`, which never reaches 1), the same for one sample at the rollout
temperature (`sampled_`, i.e. pass@1), `eval/sampled_kl_k3` and `eval/sampled_kl_k1` (per-token
means), and lengths.
Every completion can also go to the rollout log's `eval_rollouts` table.
Sampling runs under a forked RNG, so evaluating never changes the training run.
"""

from __future__ import annotations

import json

import torch

from policy_gradients.rewards import CombinedReward, RewardInput
from policy_gradients.rollout import PromptSet, completion_logprobs, generate_rollouts
from rlhf_core.generation import Sampling
from rlhf_core.kl import kl_estimate
from rlhf_core.logprobs import masked_mean
from rlhf_core.models import ReferencePolicy


@torch.no_grad()
def evaluate_policy(
    policy: torch.nn.Module,
    reference: ReferencePolicy | None,
    tokenizer,
    prompts: PromptSet,
    reward_fn: CombinedReward,
    *,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    log_rows: list[tuple] | None = None,
) -> dict[str, float]:
    """Held-out figures (keys 'eval/...'); with `log_rows`, one row per completion is appended
    to it: (kind, prompt_index, 0, prompt, completion, reward, components JSON, length,
    truncated), the rollout log's `eval_rollouts` columns after `step`."""
    device = next(policy.parameters()).device
    results: dict[str, float] = {}
    graded = {  # components whose 1.0 means "correct": their share of 1.0s is reported
        label for label, _, fn in reward_fn.components
        if not getattr(fn, "learned", False) and not getattr(fn, "penalty", False)
    }  # fmt: skip
    for label, temp in (("greedy", 0.0), ("sampled", temperature)):
        sums: dict[str, float] = {}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for start in range(0, len(prompts.items), batch_size):
                items = prompts.items[start : start + batch_size]
                ro = generate_rollouts(
                    policy, tokenizer, [it["prompt"] for it in items], group_size=1,
                    max_new_tokens=max_new_tokens, sampling=Sampling(temperature=temp),
                )  # fmt: skip
                lengths = ro.action_mask.sum(-1)
                total, parts = reward_fn(RewardInput(
                    prompts=[it["prompt"] for it in items], completions=ro.completions,
                    items=items, lengths=lengths.cpu(), action_mask=ro.action_mask.cpu(),
                    scorer=prompts.scorer, completion_ids=ro.completion_token_ids(),
                    tokenizer=tokenizer,
                ))  # fmt: skip
                per_seq = {"reward": total if total.dim() == 1 else total.sum(-1)}
                for key, value in parts.items():
                    value = value if value.dim() == 1 else value.sum(-1)
                    per_seq[key] = value
                    if key in graded:
                        per_seq[f"{key}_exact"] = (value >= 1.0).float()
                per_seq["length"] = lengths.float().cpu()
                if log_rows is not None:
                    for b, it in enumerate(items):
                        components = json.dumps({k: float(v[b].sum()) for k, v in parts.items()})
                        log_rows.append((
                            label, start + b, 0, it["prompt"], ro.completions[b],
                            float(per_seq["reward"][b]), components, int(lengths[b]),
                            int(ro.truncated[b]),
                        ))  # fmt: skip
                if label == "sampled" and reference is not None:
                    args = (ro.sequence_ids, ro.attention_mask, ro.prompt_length)
                    logp = completion_logprobs(policy, *args, temperature=temp)
                    with reference.model() as ref_model:
                        ref = completion_logprobs(ref_model, *args, temperature=temp)
                    for est in ("k1", "k3"):
                        kl = masked_mean(kl_estimate(logp, ref, est), ro.action_mask, dim=-1)
                        per_seq[f"kl_{est}"] = kl.cpu()
                for key, value in per_seq.items():
                    sums[key] = sums.get(key, 0.0) + float(value.sum())
        for key, value in sums.items():
            results[f"eval/{label}_{key}"] = value / len(prompts.items)
    return results
