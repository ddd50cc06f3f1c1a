"""Per-model accuracy metrics as the field reports them."""

from __future__ import annotations

import math

import pytest

from dlbricks.evaluation import accuracy_metrics


def test_within_shares_rmspe_and_rank_correlation():
    m = accuracy_metrics([1.0, 1.04, 0.93, 1.2], measured=[1.0, 2.0, 3.0, 4.0], predicted=[1.0, 2.08, 2.79, 4.8])
    assert m["within_5pct"] == 0.5 and m["within_10pct"] == 0.75
    assert m["rmspe"] == pytest.approx(math.sqrt((0 + 0.04**2 + 0.07**2 + 0.2**2) / 4))
    assert m["spearman"] == pytest.approx(1.0)


def test_rank_correlation_sees_a_swapped_order():
    m = accuracy_metrics([1.0, 1.0, 1.0], measured=[1.0, 2.0, 3.0], predicted=[2.0, 1.0, 3.0])
    assert m["spearman"] == pytest.approx(0.5)


def test_no_models_and_too_few_for_a_rank_correlation_are_nan():
    assert all(math.isnan(v) for v in accuracy_metrics([]).values())
    assert math.isnan(accuracy_metrics([1.0, 1.1], measured=[1, 2], predicted=[1, 2])["spearman"])
