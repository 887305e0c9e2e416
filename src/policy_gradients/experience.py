"""What a rollout leaves behind for the update: `Experience`, and the `ReplayBuffer` of them.

Shapes: B completions, S = prompt + completion tokens (left-padded prompts, right-padded
completions), T = completion tokens (S = P + T). Per-token tensors (B, T) are aligned with the
completion: column t is the t-th generated token, and `action_mask` is 1 on generated tokens up
to and including the first eos, 0 after it and on padding.

Not here: how rollouts are generated (`rollout.py`) or scored (`rewards.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass(kw_only=True)
class LossInputs:
    """Exactly the per-token tensors the losses in `policy_gradients.losses` read, all (B, T) and
    aligned with the completion tokens. Build one to call a loss from your own code; an
    `Experience` is one too (it adds the sequences, rewards and groups the loop needs)."""

    action_mask: torch.Tensor  # (B, T) 1 on completion tokens through the first eos
    advantages: torch.Tensor | None = None  # (B, T); the policy losses require it
    log_probs_old: torch.Tensor | None = None  # (B, T) pi_old, the trainer's; policy losses need it
    log_probs_ref: torch.Tensor | None = None  # (B, T) under pi_ref (KL in the loss)
    values_old: torch.Tensor | None = None  # (B, T) value model at rollout time (value loss)
    returns: torch.Tensor | None = None  # (B, T) value targets (value loss)


@dataclass(kw_only=True)
class Experience(LossInputs):
    """One batch of rollouts: the loss inputs plus what the loop needs to recompute log-probs
    (sequences) and to log and group (rewards, group ids)."""

    sequence_ids: torch.Tensor  # (B, S) prompt + completion token ids
    attention_mask: torch.Tensor  # (B, S)
    # (B, T) log pi_old(a_t | s_t), the trainer's forward before the update at the sampling
    # temperature (its truncation aside: see log_probs_behaviour); None when the update is
    # on-policy (one optimizer step per batch): the loop then fills in the current log-probs,
    # detached, which are the same numbers without a second forward
    log_probs_old: torch.Tensor | None
    advantages: torch.Tensor  # (B, T)
    rewards: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (B,) or (B, T)
    group_ids: torch.Tensor | None = None  # (B,) which prompt each completion answers
    # (B, T) log mu(a_t | s_t): the sampler's own log-probs, of the distribution it drew from
    # (after temperature and top-k/top-p/min-p truncation, in its dtype); the off-policy
    # corrections (`policy_gradients.off_policy`) turn exp(log_probs_old - these) into
    # `importance_weights` for the loss; the losses themselves never read them
    log_probs_behaviour: torch.Tensor | None = None
    # (B, T) float, logged only: 1 where the sampled token lies outside the set the trainer's
    # own distribution, truncated as the sampler's (top-k/top-p/min-p), would sample from, 0
    # inside, NaN where not measured (`off_policy.outside_sampling_set`); None without truncation
    outside_sampling_set: torch.Tensor | None = None

    @property
    def completion_length(self) -> int:
        return self.action_mask.shape[1]

    def __len__(self) -> int:
        return self.sequence_ids.shape[0]

    def select(self, index: torch.Tensor | list[int]) -> Experience:
        """The rows `index` (a micro-batch), every tensor field indexed alike."""
        index = torch.as_tensor(index, dtype=torch.long)

        def rows(
            value: torch.Tensor,
        ) -> torch.Tensor:  # each field on its own device (rewards: CPU)
            return value[index.to(value.device)]

        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = rows(value)
            elif isinstance(value, dict):
                out[f.name] = {k: rows(v) for k, v in value.items()}
            else:
                out[f.name] = value
        return Experience(**out)

    def to(self, device: torch.device | str) -> Experience:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value.to(device)
            elif isinstance(value, dict):
                out[f.name] = {k: v.to(device) for k, v in value.items()}
            else:
                out[f.name] = value
        return Experience(**out)


class ReplayBuffer:
    """Holds the experiences of one policy step; yields its micro-batches, seeded and shuffled or
    group by group."""

    def __init__(self) -> None:
        self.items: list[Experience] = []

    def add(self, experience: Experience) -> None:
        self.items.append(experience)

    def clear(self) -> None:
        self.items.clear()

    def __len__(self) -> int:
        return sum(len(e) for e in self.items)

    def micro_batches(
        self, micro_batch_size: int, *, seed: int, shuffle: bool = True
    ) -> list[Experience]:
        """All rows cut into micro-batches, shuffled by a generator seeded with `seed` (rows and
        micro-batches) unless `shuffle=False`.

        Rows of different experiences may differ in width (S, T); each micro-batch is drawn from
        one experience so no re-padding is needed. `shuffle=False` keeps the rows in their stored
        order, where a prompt's G completions are consecutive, so a micro-batch holds whole
        groups and encodes each prompt once (`rlhf_core.prefix.shared_prompt_logprobs`) instead
        of once per micro-batch its rows were shuffled into. It is for a pass that is a single
        optimizer step: there the gradient is the sum over all micro-batches whatever their order
        (the same up to float rounding), and shuffling only costs prompt forwards.
        """
        gen = torch.Generator().manual_seed(seed)
        batches = []
        for exp in self.items:
            order = torch.randperm(len(exp), generator=gen) if shuffle else torch.arange(len(exp))
            for start in range(0, len(exp), micro_batch_size):
                batches.append(exp.select(order[start : start + micro_batch_size]))
        if not shuffle:
            return batches
        order = torch.randperm(len(batches), generator=gen).tolist()
        return [batches[i] for i in order]
