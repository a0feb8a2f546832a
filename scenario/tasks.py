"""Class-incremental task streams.

The rest of the system speaks *incremental labels*: a class's position in the
run's class order. Task ``t`` then introduces the contiguous label range
``bounds[t]:bounds[t + 1]`` and the classes seen up to ``t`` are the prefix
``0:bounds[t + 1]``.
"""

from __future__ import annotations

import numpy as np


def class_order(num_classes: int, shuffle: bool, rng: np.random.Generator) -> np.ndarray:
    """Original class ids in incremental order: a permutation, or the identity."""
    return rng.permutation(num_classes) if shuffle else np.arange(num_classes)


def task_sizes(num_classes: int, num_tasks: int, classes_first_task: int | None = None) -> np.ndarray:
    """Classes per task: an even split (earlier tasks take the remainder, one each),
    or ``classes_first_task`` first and the rest split evenly over later tasks."""
    if classes_first_task is None:
        return np.array([len(s) for s in np.array_split(np.arange(num_classes), num_tasks)], dtype=np.int64)
    later = num_classes - classes_first_task
    rest = [len(s) for s in np.array_split(np.arange(later), num_tasks - 1)] if num_tasks > 1 else []
    return np.array([classes_first_task, *rest], dtype=np.int64)


def bounds(sizes: np.ndarray) -> np.ndarray:
    """Task boundaries in incremental labels: ``[0, s0, s0 + s1, ...]``."""
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def to_incremental(labels: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Map original labels to incremental labels (positions in ``order``)."""
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    return position[labels]


# ---------------------------------------------------------------- AF-FCL task pool


def draw_task_sequences(num_clients: int, pool_size: int, num_tasks: int, rng: np.random.Generator) -> np.ndarray:
    """Each client's own random sequence of ``num_tasks`` distinct pool tasks, shape (clients, tasks)."""
    return np.argsort(rng.random((num_clients, pool_size)), axis=1)[:, :num_tasks]


def pool_stream(
    order: np.ndarray, sequences: np.ndarray, join: np.ndarray, pool_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The global task stream of a task pool, for evaluation.

    Pool task ``p`` holds ``order[p*k:(p+1)*k]`` with ``k = len(order) // pool_size``
    (the ``len(order) % pool_size`` last classes are left out). The stream's
    task ``t`` is the pool tasks that some active client starts at step ``t``
    for the first time, so the returned class order lists pool tasks by first
    use (ties by pool index; unused ones and left-out classes last).

    Returns ``(class order, task bounds, rank)`` where ``rank[p]`` is pool task
    ``p``'s position in the new order: its incremental labels are
    ``rank[p]*k : (rank[p]+1)*k``.
    """
    k = len(order) // pool_size
    num_tasks = sequences.shape[1]
    first_use = np.full(pool_size, num_tasks, dtype=np.int64)
    step = np.broadcast_to(np.arange(num_tasks), sequences.shape)
    active = step >= join[:, None]
    np.minimum.at(first_use, sequences[active], step[active])
    by_use = np.lexsort((np.arange(pool_size), first_use))
    rank = np.empty(pool_size, dtype=np.int64)
    rank[by_use] = np.arange(pool_size)
    new_order = np.concatenate([order[p * k : (p + 1) * k] for p in by_use] + [order[pool_size * k :]])
    introduced = np.bincount(first_use, minlength=num_tasks + 1)[:num_tasks] * k
    return new_order, bounds(introduced), rank
