"""Held-out evaluation of reward models, with the baselines each figure should be read against.

`evaluate` runs the held-out examples through the model and the loss (example-weighted means of
the loss and its metrics), then adds figures that need the whole set:

  preference   accuracy = fraction of pairs with r_c > r_r (chance 0.5), margin, mean rewards
  orm          top1_accuracy: per prompt (a question's candidates, >= 2 of them), is the highest
               scored candidate correct? (Cobbe et al.'s verifier re-ranking; its chance level is
               top1_random_baseline, the mean fraction of correct candidates); pairwise_accuracy
               over (correct, wrong) candidate pairs of one prompt; auroc over all examples
               (ties count 1/2)
  prm          step_accuracy over all steps, balanced_step_accuracy (mean per-class recall; chance
               1 / classes), step_majority_baseline, negative_recall / negative_precision (class 0
               = an error), first_error_accuracy (the first step predicted negative is the first
               labelled negative, "no error" included) against first_error_majority_baseline
               (always guessing the most common first-error step: what step position alone gives)
  segment      segment_accuracy and error_f1 (F1 of "has an error", any class > 0) over all
               segments, against the majority baseline's (always the most common class:
               majority_accuracy, majority_error_f1, which is 0 when most segments are fine)
"""

from __future__ import annotations

import torch

from reward_models.data import RewardData, collate_outcomes, collate_steps
from reward_models.losses import IGNORE_INDEX, RewardLoss
from reward_models.models import compute_loss
from rlhf_core.encoding import last_token_index
from rlhf_core.models import eval_mode
from rlhf_core.preference import collate_pairs

COLLATE = {
    "preference": collate_pairs, "orm": collate_outcomes, "prm": collate_steps,
    "segment": collate_steps,
}  # fmt: skip


def _pairwise_hits(pos: torch.Tensor, neg: torch.Tensor, chunk: int = 1024) -> float:
    """Sum over (p, n) pairs of [s_p > s_n] + 1/2 [s_p = s_n]."""
    hits = 0.0
    for start in range(0, len(pos), chunk):
        p = pos[start : start + chunk, None]
        hits += float((p > neg[None]).sum()) + 0.5 * float((p == neg[None]).sum())
    return hits


def orm_ranking_metrics(
    scores: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor
) -> dict[str, float]:
    """Top-1 / pairwise accuracy within prompt groups and AUROC; see the module docstring.
    scores, labels (correct if > 0.5), groups: (N,)."""
    correct = labels > 0.5
    top1, random_top1, pair_hits, pair_total = [], [], 0.0, 0
    for group in torch.unique(groups):
        rows = groups == group
        s, y = scores[rows], correct[rows]
        if len(s) < 2:
            continue
        top1.append(float(y[s.argmax()]))
        random_top1.append(float(y.float().mean()))
        if y.any() and not y.all():
            pair_hits += _pairwise_hits(s[y], s[~y])
            pair_total += int(y.sum()) * int((~y).sum())
    pos, neg = scores[correct], scores[~correct]
    out = {
        "top1_accuracy": sum(top1) / len(top1) if top1 else float("nan"),
        "top1_random_baseline": sum(random_top1) / len(random_top1) if top1 else float("nan"),
        "pairwise_accuracy": pair_hits / pair_total if pair_total else float("nan"),
        "auroc": _pairwise_hits(pos, neg) / (len(pos) * len(neg)) if len(pos) and len(neg)
        else float("nan"),
        "ranked_groups": float(len(top1)),
    }  # fmt: skip
    return out


def _first_negative(classes: list[int]) -> int:
    return next((k for k, c in enumerate(classes) if c == 0), len(classes))


def prm_step_metrics(predicted: list[list[int]], labels: list[list[int]]) -> dict[str, float]:
    """Step and first-error figures from per-example predicted and true step classes."""
    flat_p = torch.tensor([c for row in predicted for c in row])
    flat_y = torch.tensor([c for row in labels for c in row])
    if flat_y.numel() == 0:
        return {}
    recalls = [float((flat_p[flat_y == c] == c).float().mean()) for c in torch.unique(flat_y)]
    flagged = flat_p == 0
    pairs = zip(predicted, labels, strict=True)
    first = [_first_negative(p) == _first_negative(y) for p, y in pairs if y]
    true_first = [_first_negative(y) for y in labels if y]
    mode = max(true_first.count(k) for k in set(true_first)) if true_first else 0
    return {
        "step_accuracy": float((flat_p == flat_y).float().mean()),
        "balanced_step_accuracy": sum(recalls) / len(recalls),
        "step_majority_baseline": float(torch.bincount(flat_y).max()) / flat_y.numel(),
        "negative_recall": float(flagged[flat_y == 0].float().mean())
        if (flat_y == 0).any() else float("nan"),
        "negative_precision": float((flat_y[flagged] == 0).float().mean())
        if flagged.any() else float("nan"),
        "first_error_accuracy": sum(first) / len(first) if first else float("nan"),
        "first_error_majority_baseline": mode / len(true_first) if true_first else float("nan"),
    }  # fmt: skip


def _f1(predicted: torch.Tensor, truth: torch.Tensor) -> float:
    """F1 of the positive (error) class for boolean predictions and truths."""
    tp = float((predicted & truth).sum())
    fp, fn = float((predicted & ~truth).sum()), float((~predicted & truth).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def segment_metrics(predicted: list[list[int]], labels: list[list[int]]) -> dict[str, float]:
    """Per-segment accuracy and error F1, and the majority-class baseline's."""
    flat_p = torch.tensor([c for row in predicted for c in row], dtype=torch.long)
    flat_y = torch.tensor([c for row in labels for c in row], dtype=torch.long)
    if flat_y.numel() == 0:
        return {}
    majority = int(torch.bincount(flat_y).argmax())
    baseline = torch.full_like(flat_y, majority)
    return {
        "segment_accuracy": float((flat_p == flat_y).float().mean()),
        "error_f1": _f1(flat_p > 0, flat_y > 0),
        "majority_accuracy": float((baseline == flat_y).float().mean()),
        "majority_error_f1": _f1(baseline > 0, flat_y > 0),
        "error_rate": float((flat_y > 0).float().mean()),
        "segments": float(flat_y.numel()),
    }


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loss_fn: RewardLoss,
    data: RewardData,
    *,
    pad_id: int,
    batch_size: int,
) -> dict[str, float]:
    """Held-out loss, metrics and whole-set figures of `data`, keys prefixed 'eval/'."""
    device = next(model.parameters()).device
    kind, examples = loss_fn.kind, data.examples
    totals: dict[str, float] = {}
    orm_scores, predicted, truth = [], [], []
    with eval_mode(model):
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            batch = {k: v.to(device) for k, v in COLLATE[kind](chunk, pad_id).items()}
            loss, metrics, out = compute_loss(model, loss_fn, batch)
            for key, value in {"loss": loss, **metrics}.items():
                totals[key] = totals.get(key, 0.0) + float(value) * len(chunk)
            if kind == "orm":
                last = last_token_index(batch["completion_mask"])
                rows = torch.arange(len(chunk), device=device)
                orm_scores.append(out["logits"][rows, last].cpu())
            elif kind in ("prm", "segment"):
                classes = out["logits"].argmax(-1).cpu()
                steps = batch["step_labels"].cpu()
                for b in range(len(chunk)):
                    at = steps[b] != IGNORE_INDEX
                    predicted.append(classes[b][at].tolist())
                    truth.append(steps[b][at].tolist())
    result = {k: v / len(examples) for k, v in totals.items()}
    if kind == "orm":
        labels = torch.tensor([e.label for e in examples])
        groups = torch.tensor([e.group for e in examples])
        result.update(orm_ranking_metrics(torch.cat(orm_scores).float(), labels, groups))
    elif kind == "prm":
        result.update(prm_step_metrics(predicted, truth))
    elif kind == "segment":
        result.update(segment_metrics(predicted, truth))
    return {f"eval/{k}": v for k, v in result.items()}
