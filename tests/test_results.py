"""The FCIL metric definitions, against hand-computed values."""

import numpy as np
import pytest

from monitoring.results import (average_accuracy, average_forgetting, average_incremental_accuracy,
                                 client_test_accuracy, spatial_retention, temporal_retention)

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


def test_tasks_without_classes_are_left_out():
    # task 1 introduced no class (clients on their own sequences): its column is None
    matrix = [[80.0, None, None], [40.0, None, None], [20.0, None, 60.0]]
    assert average_accuracy(matrix) == pytest.approx(40.0)
    assert average_forgetting(matrix) == pytest.approx(80.0 - 20.0)  # only task 0 counts


def test_temporal_retention_is_the_final_share_of_the_best_accuracy():
    # task 0: 30 of its best 90; task 1: 50 of its best 80
    assert temporal_retention(MATRIX) == pytest.approx(100 * (30 / 90 + 50 / 80) / 2)
    # a task whose accuracy rises later (its classes came back) counts its best: never more than 100
    assert temporal_retention([[10.0, None, None], [40.0, 70.0, None], [20.0, 35.0, 50.0]]) == pytest.approx(
        100 * (20 / 40 + 35 / 70) / 2)
    assert temporal_retention([[55.0]]) is None


def test_spatial_retention_per_client_and_private_classes():
    hits, totals = np.array([9, 5, 0, 8]), np.array([10, 10, 10, 10])
    clients = [np.array([0, 1]), np.array([1, 2]), np.array([1, 3]), np.array([], dtype=np.int64)]
    kr = spatial_retention(hits, totals, clients)
    # client 0: 14/20, client 1: 5/20, client 2: 13/20 (the empty client is left out)
    assert kr["spatial"] == pytest.approx(100 * (14 / 20 + 5 / 20 + 13 / 20) / 3)
    assert kr["private"] == pytest.approx(100 * (9 + 0 + 8) / 30)  # classes 0, 2, 3 have one owner each
    assert spatial_retention(hits, totals, [np.array([0, 1])] * 2)["private"] is None


def test_client_test_accuracy_sums_every_clients_task_test_sets():
    hits, totals = np.array([9, 5, 0, 8]), np.array([10, 10, 10, 20])
    # client 0: task 0 classes {0, 1}, task 1 class {3}; client 1: task 0 {1}, task 1 nothing new
    clients = [[np.array([0, 1]), np.array([3])], [np.array([1]), np.array([], dtype=np.int64)]]
    # correct: 9 + 5 + 8 + 5 = 27 of 10 + 10 + 20 + 10 = 50 (class 1 counted once per holder)
    assert client_test_accuracy(hits, totals, clients) == pytest.approx(100 * 27 / 50)
    assert client_test_accuracy(hits, totals, [[np.array([], dtype=np.int64)]]) is None
