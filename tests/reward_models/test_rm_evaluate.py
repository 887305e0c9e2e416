"""Whole-set evaluation figures of reward models, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from reward_models.evaluate import orm_ranking_metrics, prm_step_metrics


def test_orm_ranking_metrics_by_hand():
    # group 0: the right answer scores highest; group 1: a wrong one does; group 2: all wrong
    # and a tie; group 3 has one candidate (not ranked)
    scores = torch.tensor([2.0, 1.0, 0.5, 0.3, 0.9, 0.1, 0.4, 0.4, 7.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3])
    m = orm_ranking_metrics(scores, labels, groups)
    assert m["ranked_groups"] == 3
    assert m["top1_accuracy"] == pytest.approx(1 / 3)
    assert m["top1_random_baseline"] == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)
    # (correct, wrong) pairs within groups: g0 2.0>1.0, 2.0>0.5; g1 0.3<0.9, 0.1<0.9
    assert m["pairwise_accuracy"] == pytest.approx(2 / 4)
    # all 4 positives (2.0, 0.3, 0.1, 7.0) x 5 negatives (1.0, 0.5, 0.9, 0.4, 0.4)
    wins = 5 + 0 + 0 + 5  # 0.3 and 0.1 beat none
    assert m["auroc"] == pytest.approx(wins / 20)


def test_prm_step_metrics_by_hand():
    labels = [[1, 1, 0], [1, 1], [0]]
    predicted = [[1, 0, 0], [1, 1], [1]]
    m = prm_step_metrics(predicted, labels)
    assert m["step_accuracy"] == pytest.approx(4 / 6)
    assert m["balanced_step_accuracy"] == pytest.approx((1 / 2 + 3 / 4) / 2)
    assert m["step_majority_baseline"] == pytest.approx(4 / 6)
    assert m["negative_recall"] == pytest.approx(1 / 2)
    assert m["negative_precision"] == pytest.approx(1 / 2)
    # first errors: true [2, none=2, 0], predicted [1, 2, none=1] -> only row 1 matches
    assert m["first_error_accuracy"] == pytest.approx(1 / 3)
    assert m["first_error_majority_baseline"] == pytest.approx(2 / 3)  # "step 2" twice
