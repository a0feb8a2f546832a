"""The FCIL metric definitions, against hand-computed values."""

import pytest

from coordinator.results import average_accuracy, average_forgetting, average_incremental_accuracy

# After task 0: 90 on task 0. After task 1: 60 on task 0, 80 on task 1.
# After task 2: 30 on task 0, 50 on task 1, 70 on task 2.
MATRIX = [[90.0, None, None], [60.0, 80.0, None], [30.0, 50.0, 70.0]]


def test_average_accuracy_is_the_mean_of_the_last_row():
    assert average_accuracy(MATRIX) == pytest.approx((30 + 50 + 70) / 3)


def test_average_incremental_accuracy_averages_each_rows_seen_tasks():
    assert average_incremental_accuracy(MATRIX) == pytest.approx((90 + (60 + 80) / 2 + 50) / 3)


def test_forgetting_is_the_drop_from_the_best_earlier_accuracy():
    # task 0: best 90 (after task 0) -> 30; task 1: best 80 -> 50
    assert average_forgetting(MATRIX) == pytest.approx(((90 - 30) + (80 - 50)) / 2)
    assert average_forgetting([[55.0]]) == 0.0
