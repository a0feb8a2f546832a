"""Task streams: class order, task sizes, incremental labels, the AF-FCL task pool stream."""

from __future__ import annotations

import numpy as np
import pytest

from fcl_emu.scenario import tasks


def test_class_order():
    rng = np.random.default_rng(0)
    order = tasks.class_order(100, True, rng)
    assert sorted(order.tolist()) == list(range(100)) and order.tolist() != list(range(100))
    assert tasks.class_order(10, False, rng).tolist() == list(range(10))


@pytest.mark.parametrize(
    "classes, num_tasks, first, expected",
    [
        (10, 5, None, [2, 2, 2, 2, 2]),
        (10, 3, None, [4, 3, 3]),
        (100, 6, 50, [50, 10, 10, 10, 10, 10]),
        (10, 4, 4, [4, 2, 2, 2]),
        (10, 1, 10, [10]),
        (10, 10, 1, [1] * 10),
    ],
)
def test_task_sizes(classes, num_tasks, first, expected):
    sizes = tasks.task_sizes(classes, num_tasks, first)
    assert sizes.tolist() == expected
    assert tasks.bounds(sizes).tolist() == [0, *np.cumsum(expected).tolist()]


def test_to_incremental_inverts_the_order():
    order = np.array([3, 0, 2, 1])
    labels = np.array([0, 1, 2, 3, 3])
    inc = tasks.to_incremental(labels, order)
    assert inc.tolist() == [1, 3, 2, 0, 0]
    assert (order[inc] == labels).all()


def test_task_sequences_are_distinct_per_client():
    seq = tasks.draw_task_sequences(50, 8, 5, np.random.default_rng(1))
    assert seq.shape == (50, 5)
    assert all(len(set(row)) == 5 for row in seq.tolist()) and seq.max() < 8
    assert len({tuple(row) for row in seq.tolist()}) > 40  # clients draw their own sequences


def test_pool_stream_orders_pool_tasks_by_first_use():
    order = np.arange(10)[::-1].copy()  # pool tasks of 3 classes: [9 8 7] [6 5 4] [3 2 1]; class 0 left out
    sequences = np.array([[2, 0], [1, 2], [0, 1]])
    join = np.array([0, 0, 1])  # the third client joins at step 1: its step-0 task is never used
    new_order, bounds, rank = tasks.pool_stream(order, sequences, join, pool_size=3)
    assert rank.tolist() == [2, 0, 1]  # pools 2 and 1 are first used at step 0, pool 0 at step 1
    assert new_order.tolist() == [6, 5, 4, 3, 2, 1, 9, 8, 7, 0]
    assert bounds.tolist() == [0, 6, 9]


def test_pool_stream_with_a_step_that_introduces_nothing():
    sequences = np.array([[0, 1, 2], [1, 0, 2]])
    _, bounds, _ = tasks.pool_stream(np.arange(6), sequences, np.zeros(2, np.int64), pool_size=3)
    assert bounds.tolist() == [0, 4, 4, 6]
