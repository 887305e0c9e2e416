"""`BaseRewardModel`: a causal-LM backbone with a linear head, trained as a preference, outcome
or process reward model.

All of the machinery (backbone loading, per-token scores, last-token pooling, the saved directory,
`score`) is `rlhf_core.scalar_head.ScalarHeadModel`, so that `policy_gradients` can load a reward
model from its directory without importing this package. This module adds what only training
needs: building the model for a config, the two forwards that encode each pair's prompt once
(packed rows with a 4D mask, or a shared prefix through the KV cache; both
`rlhf_core.layout`), running a collated batch
through it into the loss of its kind (`compute_loss`), and the sequence-classification export of
preference models.

    kind         head_dim      read at                       trained by
    preference   1             the last token (eos), or the  bradley_terry
                               mean / sum over the
                               completion (`pooling`)
    orm          1             every completion token        orm_bce
    prm          2 or 3        each step's separator token   prm_ce
    segment      >= 2          each segment's last token     segment_ce

The backbone is a causal LM's, or with `encoder_only` a bidirectional encoder's (BERT / DeBERTa /
Longformer family; `rlhf_core.scalar_head`): then every token's score reads the whole row, the
encoder ForTokenClassification models of Fine-Grained RLHF; such rows are never packed or
prefix-shared (a prompt would see its completions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from reward_models.config import RMConfig
from reward_models.losses import RewardLoss
from rlhf_core.attention import fast_attention
from rlhf_core.layout import packed_attention_mask
from rlhf_core.lm_likelihood import add_lm_likelihood
from rlhf_core.prefix import shared_prefix_forward
from rlhf_core.scalar_head import ScalarHeadModel
from rlhf_core.scalar_head_format import ScalarHeadInfo
from rlhf_core.scalar_head_scoring import pool_completion
from rlhf_core.sequence_classification import export_sequence_classification


class BaseRewardModel(ScalarHeadModel):
    """A reward model: `forward(input_ids, attention_mask) -> (B, T, head_dim)` scores; the loss
    never lives in `forward`. See `rlhf_core.scalar_head.ScalarHeadModel`."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
        prefix_mask: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores of every position, (B, T, head_dim), float32. Padding positions hold garbage.

        Packed rows: `attention_mask` may be a 4D boolean mask (B, 1, T, T), True where a query
        may attend to a key, with explicit `position_ids` (B, T); several sequences then share
        one row (SDPA and eager attention; flash-attention 2 takes 2D masks only). A preference
        pair packs as [prompt | chosen | rejected] with the rejected tokens blind to the chosen
        ones and positions restarting after the prompt (`rlhf_core.preference.pack_pairs`, laid out
        by `rlhf_core.layout.pack_groups`, the layout shared-prompt DPO uses too). With its
        `segments`, attention runs one pair at a time where that applies
        (`rlhf_core.attention.fast_attention`).

        Shared prefix: with `prefix_ids` / `prefix_mask` (Bp, P), left-padded, the rows of
        `input_ids` (B = Bp x r, right-padded) are continuations of those prefixes, r per prefix
        and grouped (rows b*r ... b*r + r - 1 continue prefix b). The prefix runs once, its keys
        and values are repeated for the r continuations, and the continuations attend to them
        through the KV cache; gradients flow through the cache into the prefix. The scores are
        those of the continuation tokens only, equal (up to float rounding; tested) to scoring
        prefix + continuation as one row. A preference batch shares each prompt between its
        chosen and rejected completions this way (Wang et al. 2024, "Accelerating Direct
        Preference Optimization with Prefix Sharing"), so the prompt is encoded once, not twice.

        Otherwise it is `ScalarHeadModel.forward`.
        """
        if self.info.encoder_only and (attention_mask.dim() == 4 or prefix_ids is not None):
            raise ValueError(
                "an encoder backbone (encoder_only) reads whole rows: no packed pairs or shared "
                "prefix (train.share_prompt: false)"
            )
        if attention_mask.dim() == 4:
            return self._packed_forward(input_ids, attention_mask, position_ids, segments)
        if prefix_ids is not None:
            return self._shared_prefix_forward(input_ids, attention_mask, prefix_ids, prefix_mask)
        return super().forward(input_ids, attention_mask)

    def _packed_forward(
        self,
        input_ids: torch.Tensor,
        allowed: torch.Tensor,
        position_ids: torch.Tensor | None,
        segments: torch.Tensor | None,
    ) -> torch.Tensor:
        if position_ids is None:
            raise ValueError("a 4D attention mask (packed rows) needs explicit position_ids")
        # the boolean mask as the additive one transformers passes on untouched
        dtype = self.backbone.get_input_embeddings().weight.dtype
        mask = packed_attention_mask(self.backbone.config, allowed, position_ids, dtype)
        with self._grad_context(), fast_attention(self.backbone, segments):
            hidden = self.backbone(
                input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state  # fmt: skip
        scores = self.head(hidden.to(self.head.weight.dtype))
        if self.info.lm_likelihood:  # a token is predicted from the last key before it it sees
            length = allowed.shape[-1]
            before = torch.ones(length, length, dtype=torch.bool, device=allowed.device).tril(-1)
            keys = torch.arange(length, device=allowed.device)
            source = torch.where(allowed[:, 0] & before, keys, -1).amax(-1)  # (R, L)
            previous = hidden.gather(
                1, source.clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1])
            )
            scores = add_lm_likelihood(
                scores, self.likelihood_weight, self.backbone, previous, input_ids, source >= 0
            )
        return scores

    def _shared_prefix_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prefix_ids: torch.Tensor,
        prefix_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if prefix_mask is None or input_ids.shape[0] % prefix_ids.shape[0]:
            raise ValueError(
                f"shared prefix: need prefix_mask and a row count ({input_ids.shape[0]}) that is "
                f"a multiple of the prefixes' ({prefix_ids.shape[0]})"
            )
        repeats = input_ids.shape[0] // prefix_ids.shape[0]
        prefix_of = torch.arange(prefix_ids.shape[0], device=input_ids.device)
        prefix_of = prefix_of.repeat_interleave(repeats)
        with self._grad_context():
            prefix_hidden, hidden = shared_prefix_forward(
                self.backbone, prefix_ids, prefix_mask, input_ids, attention_mask, prefix_of
            )
        scores = self.head(hidden.to(self.head.weight.dtype))
        if self.info.lm_likelihood:  # the first token is predicted from its prefix's last one
            previous = torch.cat([prefix_hidden[prefix_of, -1:], hidden[:, :-1]], 1)
            predicted = torch.ones_like(input_ids, dtype=torch.bool)
            scores = add_lm_likelihood(
                scores, self.likelihood_weight, self.backbone, previous, input_ids, predicted
            )
        return scores

    @classmethod
    def for_config(
        cls,
        cfg: RMConfig,
        loss_fn: RewardLoss,
        tokenizer: Any,
        device: torch.device | str = "cpu",
        *,
        weights_from: str | Path | None = None,
    ) -> BaseRewardModel:
        """The model `cfg` describes, with the head `loss_fn` needs; `weights_from` resumes."""
        info = ScalarHeadInfo(
            kind=loss_fn.kind,
            head_dim=loss_fn.head_dim,
            chat_template=tokenizer.chat_template,
            max_length=cfg.data.max_length,
            max_prompt_length=cfg.data.max_prompt_length,
            step_separator=cfg.data.step_separator if loss_fn.kind == "prm" else None,
            segment_level=cfg.data.segment_level if loss_fn.kind == "segment" else None,
            pooling=cfg.pooling,
            lm_likelihood=cfg.lm_likelihood is not None,
            encoder_only=cfg.encoder_only,
        )
        model = cls.from_config(
            cfg.model, info, device, weights_from=weights_from,
            freeze_backbone=cfg.freeze_backbone,
        )  # fmt: skip
        if cfg.lm_likelihood is not None and weights_from is None:
            with torch.no_grad():
                model.likelihood_weight.fill_(cfg.lm_likelihood)
        return model

    def export_sequence_classification(self, out_dir: str | Path, *, tokenizer: Any = None) -> Path:
        """Write a transformers `AutoModelForSequenceClassification` directory (preference only);
        see `rlhf_core.sequence_classification.export_sequence_classification`."""
        if self.info.kind != "preference":
            raise ValueError(f"only preference models export to sequence classification, this "
                             f"one is {self.info.kind!r}")  # fmt: skip
        return export_sequence_classification(self, out_dir, tokenizer=tokenizer)


def preference_rewards(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards (B,) of a `collate_pairs` batch, from one forward of 2B rows
    (or, with a shared prompt, one forward of the B prompts and one of the 2B completions).

    The model's `info.pooling` says which scores make a reward: the last token's (eos), or the
    mean or sum over the completion's tokens (eos included, the prompt never). Every layout
    pools the same tokens, so the rewards do not depend on it (tested)."""
    pooling = getattr(model, "module", model).info.pooling  # DDP wraps the model in .module
    if "ends" in batch:  # pairs packed as [prompt | chosen | rejected] segments (`pack_pairs`)
        scores = model(batch["input_ids"], batch["attention_mask"],
                       position_ids=batch["position_ids"],
                       segments=batch.get("segments"))[..., 0]  # fmt: skip
        ends = batch["ends"]  # flat indices (2B,), chosen_0, rejected_0, ...: where each ends
        if pooling == "last":
            picked = scores.reshape(-1)[ends].view(-1, 2)
        else:  # each completion's tokens lie contiguously before its end
            lengths = batch["branch_lengths"]  # (2B,) in the order of `ends`
            back = torch.arange(int(lengths.max()), device=ends.device)
            spans = (ends.reshape(-1, 1) - back).clamp(min=0)
            picked = pool_completion(
                scores.reshape(-1)[spans], back < lengths.reshape(-1, 1), pooling
            ).view(-1, 2)
        return picked[:, 0], picked[:, 1]
    if "prompt_ids" in batch:  # completions interleaved chosen_0, rejected_0, chosen_1, ...
        prefix = {"prefix_ids": batch["prompt_ids"], "prefix_mask": batch["prompt_mask"]}
        scores = model(batch["input_ids"], batch["attention_mask"], **prefix)[..., 0]
        rewards = pool_completion(scores, batch["attention_mask"], pooling)  # completions only
        return rewards[0::2], rewards[1::2]
    scores = model(batch["input_ids"], batch["attention_mask"])[..., 0]
    mask = batch["attention_mask"] if pooling == "last" else batch["completion_mask"]
    rewards = pool_completion(scores, mask, pooling)
    half = rewards.shape[0] // 2
    return rewards[:half], rewards[half:]


def compute_loss(
    model: torch.nn.Module, loss_fn: RewardLoss, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(loss, metrics, outputs) of one collated batch of the loss's kind. `outputs` are the
    detached scores the loss read: chosen/rejected rewards (B,), or logits (B, T[, C])."""
    if loss_fn.kind == "preference":
        chosen, rejected = preference_rewards(model, batch)
        loss, metrics = loss_fn(chosen, rejected, margins=batch.get("margins"))
        return loss, metrics, {"chosen": chosen.detach(), "rejected": rejected.detach()}
    scores = model(batch["input_ids"], batch["attention_mask"])
    if loss_fn.kind == "orm":
        loss, metrics = loss_fn(scores[..., 0], batch["labels"], batch["completion_mask"])
        return loss, metrics, {"logits": scores[..., 0].detach()}
    loss, metrics = loss_fn(scores, batch["step_labels"])
    return loss, metrics, {"logits": scores.detach()}
