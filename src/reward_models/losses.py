"""Reward-model losses, chosen by name from the registry `LOSSES`.

Each loss reads a reward model's outputs (never the model itself) and returns `(loss, metrics)`;
`metrics` holds detached scalar tensors (no device sync). Each class says which model it trains
(`kind`: preference / orm / prm, matching `rlhf_core.scalar_head_format.KINDS`) and how wide the
head is (`head_dim`), so the trainer picks data and heads from the loss, never from its name.

    name           inputs                                              per-example loss
    bradley_terry  rewards r_c, r_r (B,) [, margins m (B,)]            -logsig(r_c - r_r [- m])
                                                                       + eta (r_c + r_r)^2
    orm_bce        token logits z (B, T), labels y (B,), mask (B, T)   mean over the example's
                                                                       masked tokens of
                                                                       BCE(z_t, y)
    segment_ce     segment logits (B, T, C), segment classes (B, T)    mean over the example's
                   (Fine-Grained RLHF, Wu et al. 2023)                 segment ends
    prm_ce         step logits (B, T, C), step classes (B, T)          mean over the example's
                   (-100 = not a step end)                             steps of CE(logits_t, c_t)

The batch loss is the mean of the per-example losses (a fully masked example contributes 0 and
still counts), so gradient accumulation over micro-batches weighted by their share of the batch
gives the one-big-batch loss exactly.

Not here: ensembles, a language-modelling term added to the verifier loss (Cobbe et al. train it
jointly; we do not), listwise (Plackett-Luce) rankings of more than two responses.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from rlhf_core.encoding import last_token_index
from rlhf_core.logprobs import aggregate, masked_mean
from rlhf_core.registry import Configurable, Registry

LOSSES: Registry[type[RewardLoss]] = Registry("reward model loss")

IGNORE_INDEX = -100  # step_labels at positions that are not a step end


class RewardLoss(Configurable, nn.Module):
    """What every reward loss declares; configuration is by keyword only."""

    name: ClassVar[str] = "reward loss"  # replaced by the registered name
    kind: ClassVar[str]  # the model kind it trains: "preference", "orm" or "prm"
    needs_margins: bool = False  # per-pair margins from the data (bradley_terry with use_margin)

    @property
    def head_dim(self) -> int:
        return 1


LOSSES.base = RewardLoss  # what a "module:Class" name in a config must subclass


def _shape_error(name: str, expected: str, **tensors: torch.Tensor) -> ValueError:
    got = ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items())
    return ValueError(f"{name} loss: expected {expected}; got {got}")


@LOSSES.register("bradley_terry")
class BradleyTerryLoss(RewardLoss):
    """Bradley-Terry pairwise loss on scalar rewards (the InstructGPT / Llama 2 reward model).

    Bradley & Terry 1952; Ouyang et al. 2022 (InstructGPT), arXiv:2203.02155, eq. 1:

        loss = -log sigmoid(r_c - r_r)

    with r_c, r_r (B,) the rewards of the chosen and rejected responses (the head's output at the
    last token). Options:
      use_margin    Touvron et al. 2023 (Llama 2), arXiv:2307.09288, eq. 2: a per-pair margin
                    m (B,) from the data, loss = -log sigmoid(r_c - r_r - m).
      centering_eta Eisenstein et al. 2023, arXiv:2312.09244: adds eta (r_c + r_r)^2, which pins
                    the otherwise shift-invariant rewards near zero (the paper uses eta = 0.01).
    Defaults: use_margin False, centering_eta 0 (plain Bradley-Terry).

    Metrics: accuracy (r_c > r_r), margin (mean r_c - r_r), chosen / rejected (mean rewards),
    bt_loss (the Bradley-Terry part alone).
    """

    kind = "preference"

    def __init__(self, *, use_margin: bool = False, centering_eta: float = 0.0) -> None:
        super().__init__()
        self._require(centering_eta >= 0, "centering_eta", centering_eta, ">= 0")
        self.use_margin = bool(use_margin)
        self.centering_eta = float(centering_eta)
        self.needs_margins = self.use_margin

    def per_pair(
        self,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
        *,
        margins: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(full per-pair loss, Bradley-Terry part), both (B,)."""
        if chosen_rewards.dim() != 1 or chosen_rewards.shape != rejected_rewards.shape:
            raise _shape_error(
                self.name,
                "chosen_rewards and rejected_rewards of one shape (B,)",
                chosen_rewards=chosen_rewards,
                rejected_rewards=rejected_rewards,
            )
        diff = chosen_rewards - rejected_rewards
        if self.use_margin:
            if margins is None:
                raise ValueError(f"{self.name} loss with use_margin=True needs margins (B,)")
            if margins.shape != diff.shape:
                raise _shape_error(
                    self.name,
                    "margins of the rewards' shape (B,)",
                    margins=margins,
                    chosen_rewards=chosen_rewards,
                )
            diff = diff - margins.to(diff.dtype)
        bt = -F.logsigmoid(diff)
        total = bt
        if self.centering_eta:
            total = bt + self.centering_eta * (chosen_rewards + rejected_rewards) ** 2
        return total, bt

    def forward(
        self,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
        *,
        margins: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rewards (B,) of the chosen and rejected responses -> (mean loss, metrics)."""
        total, bt = self.per_pair(chosen_rewards, rejected_rewards, margins=margins)
        c, r = chosen_rewards.detach(), rejected_rewards.detach()
        metrics = {
            "accuracy": (c > r).to(c.dtype).mean(),
            "margin": (c - r).mean(),
            "chosen": c.mean(),
            "rejected": r.mean(),
            "bt_loss": bt.detach().mean(),
        }
        return total.mean(), metrics


@LOSSES.register("orm_bce")
class OutcomeBCELoss(RewardLoss):
    """Outcome reward model (verifier): binary cross-entropy of the solution's correctness.

    Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems", arXiv:2110.14168, sec. 4:
    the verifier predicts the final correctness label y in {0, 1} of a whole solution at *every*
    token of the solution ("token-level" verifier, which they found better than predicting once):

        loss = mean_t in completion  BCE(sigmoid(z_t), y)
             = mean_t [ softplus(z_t) - y z_t ]

    z (B, T) are the head's logits, mask (B, T) marks completion tokens, y (B,) the labels (float
    labels in [0, 1] are allowed). With token_level=False only the last completion token is
    trained. At evaluation the prediction is read at the last completion token (Cobbe et al.
    score the final token). Default: token_level True.

    Metrics: accuracy and bce of the last-token prediction (threshold 0.5), p_correct (mean
    sigmoid at the last token). Top-1 / pairwise accuracy and AUROC over a prompt's candidates
    need whole groups and are computed by `reward_models.evaluate`.
    """

    kind = "orm"

    def __init__(self, *, token_level: bool = True) -> None:
        super().__init__()
        self.token_level = bool(token_level)

    def forward(
        self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Token logits (B, T), labels (B,), completion mask (B, T) -> (mean loss, metrics)."""
        if logits.dim() != 2 or mask.shape != logits.shape or labels.shape != logits.shape[:1]:
            raise _shape_error(
                self.name,
                "logits (B, T), labels (B,), mask (B, T)",
                logits=logits,
                labels=labels,
                mask=mask,
            )
        mask = mask.bool()
        target = labels.to(logits.dtype)[:, None].expand_as(logits)
        per_token = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        last = last_token_index(mask)
        rows = torch.arange(logits.shape[0], device=logits.device)
        if self.token_level:
            loss = aggregate(per_token, mask, "seq-mean-token-mean")
        else:
            at_last = torch.zeros_like(mask)
            at_last[rows, last] = mask[rows, last]
            loss = aggregate(per_token, at_last, "seq-mean-token-mean")
        z_last = logits.detach()[rows, last]
        y = labels.detach().to(z_last.dtype)
        metrics = {
            "accuracy": ((z_last > 0).to(y.dtype) == (y > 0.5).to(y.dtype)).to(y.dtype).mean(),
            "bce": per_token.detach()[rows, last].mean(),
            "p_correct": torch.sigmoid(z_last).mean(),
        }
        return loss, metrics


def first_error_step(negative: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """(B,) number of the first masked step flagged negative (0-based), or the row's step count
    if none is: `negative` and `step_mask` are (B, T) bool over token positions."""
    step_number = step_mask.long().cumsum(-1) - 1
    count = step_mask.long().sum(-1)
    flagged = torch.where(negative & step_mask, step_number, count[:, None].expand_as(step_number))
    return flagged.min(-1).values if flagged.shape[-1] else count


class PositionCELoss(RewardLoss):
    """The shared part of `prm_ce` and `segment_ce`: a class per labelled position (a step's or a
    segment's last token), read from logits (B, T, C) where the labels (B, T) are not -100."""

    num_classes: int

    @property
    def head_dim(self) -> int:
        return self.num_classes

    def position_ce(
        self, logits: torch.Tensor, step_labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, mask, targets): the cross-entropy averaged over each example's labelled
        positions, then over the batch ("seq-mean-token-mean"); mask (B, T) = labelled."""
        if (
            logits.dim() != 3
            or logits.shape[:2] != step_labels.shape
            or logits.shape[-1] != self.num_classes
        ):
            raise _shape_error(
                self.name, f"logits (B, T, {self.num_classes}) and step_labels (B, T)",
                logits=logits, step_labels=step_labels,
            )  # fmt: skip
        mask = step_labels != IGNORE_INDEX
        targets = step_labels.clamp(min=0)
        per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        return aggregate(per_token, mask, "seq-mean-token-mean"), mask, targets


@LOSSES.register("prm_ce")
class ProcessCELoss(PositionCELoss):
    """Process reward model: cross-entropy of each step's rating, read at step-separator tokens.

    Lightman et al. 2023, "Let's Verify Step by Step", arXiv:2305.20050, sec. 2.6: the PRM
    predicts the rating of every step at the last token of the step (here: the one-token step
    separator that follows it), trained with cross-entropy on those positions only:

        loss = mean_b [ mean_{t : c_bt != -100} CE(softmax(logits_bt), c_bt) ]

    a per-example mean over its steps, then the mean over the batch (an example without steps
    contributes 0 and still counts), so each solution weighs the same however many steps it has.

    logits (B, T, C); classes c (B, T) hold -100 everywhere but step ends. C = num_classes:
    3 = PRM800K's ratings -1 / 0 / +1 as classes 0 / 1 / 2; 2 = binary (0 = the step is an error,
    1 = it is not). Class 0 is always "negative". Default: num_classes 3 (as PRM800K).

    Metrics: step_accuracy (argmax = label over all steps in the batch) and first_error_accuracy
    (per example: the first step predicted negative equals the first labelled negative, "none"
    counting as a step index past the end).
    """

    kind = "prm"

    def __init__(self, *, num_classes: int = 3) -> None:
        super().__init__()
        self._require(num_classes in (2, 3), "num_classes", num_classes, "2 or 3")
        self.num_classes = int(num_classes)

    def forward(
        self, logits: torch.Tensor, step_labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Step logits (B, T, C) and classes (B, T), -100 off step ends -> (mean loss, metrics)."""
        loss, mask, targets = self.position_ce(logits, step_labels)
        predicted = logits.detach().argmax(-1)
        correct = (predicted == targets).to(logits.dtype)
        has_steps = mask.any(-1).to(logits.dtype)
        same_first = (
            first_error_step(predicted == 0, mask) == first_error_step(targets == 0, mask)
        ).to(logits.dtype)
        metrics = {
            "step_accuracy": masked_mean(correct, mask),
            "first_error_accuracy": (same_first * has_steps).sum() / has_steps.sum().clamp(min=1),
        }
        return loss, metrics


@LOSSES.register("segment_ce")
class SegmentCELoss(PositionCELoss):
    """Token-level (segment) reward model: cross-entropy of each segment's class, read at the token
    that ends the segment (a sentence or a sub-sentence).

    Wu et al. 2023, "Fine-Grained Human Feedback Gives Better Rewards for Language Model
    Training", arXiv:2306.01693, sec. 2.2 / 4: each fine-grained reward model is a token
    classifier over the completion that predicts, at the end of every segment it judges, whether
    that segment has its error type (irrelevance per sub-sentence, a factual error per sentence):

        loss = mean_{t : c_t != -100} CE(softmax(logits_t), c_t)

    logits (B, T, C); classes c (B, T) hold -100 everywhere but segment ends. Class 0 = no error,
    classes 1..C-1 = error kinds (binary: 1 = the segment has the error). It differs from
    `prm_ce` only in what a position is (a segment's last token of free text, found by the
    segmenter, instead of a separator token after a step) and in the class convention.

    Metrics: segment_accuracy (argmax = label over all segments in the batch).
    """

    kind = "segment"

    def __init__(self, *, num_classes: int = 2) -> None:
        super().__init__()
        self._require(num_classes >= 2, "num_classes", num_classes, ">= 2")
        self.num_classes = int(num_classes)

    def forward(
        self, logits: torch.Tensor, step_labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Segment logits (B, T, C), classes (B, T), -100 off segment ends -> (loss, metrics)."""
        loss, mask, targets = self.position_ce(logits, step_labels)
        correct = (logits.detach().argmax(-1) == targets).to(logits.dtype)
        return loss, {"segment_accuracy": masked_mean(correct, mask)}
