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
    (the ``len(order) % pool_size`` last classes are left out). The stream is
    :func:`first_use_stream` of the pool tasks' classes, so pool tasks stay
    whole and are listed by first use (ties by pool index; unused ones and
    left-out classes last).

    Returns ``(class order, task bounds, rank)`` where ``rank[p]`` is pool task
    ``p``'s position in the new order: its incremental labels are
    ``rank[p]*k : (rank[p]+1)*k``.
    """
    k = len(order) // pool_size
    steps = sequences[:, :, None] * k + np.arange(k)
    new_order, task_bounds, position = first_use_stream(order, steps, join)
    return new_order, task_bounds, position[np.arange(pool_size) * k] // k


def first_use_stream(
    order: np.ndarray, steps: np.ndarray, join: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A global class-incremental stream for clients that follow their own class sequences.

    ``steps[i, t]`` lists the classes (as positions in ``order``) client ``i``
    works on at step ``t``; a client counts from its ``join`` step on. Task
    ``t`` of the stream is the classes some active client meets for the first
    time at step ``t`` (possibly none); within a task, and for classes never
    met (listed last), classes keep their order.

    Returns ``(class order, task bounds, position)`` with ``position[j]`` the
    new incremental label of the class at position ``j`` of ``order``.
    """
    num_tasks = steps.shape[1]
    first_use = np.full(len(order), num_tasks, dtype=np.int64)
    step = np.broadcast_to(np.arange(num_tasks)[None, :, None], steps.shape)
    active = step >= join[:, None, None]
    np.minimum.at(first_use, steps[active], step[active])
    by_use = np.lexsort((np.arange(len(order)), first_use))
    position = np.empty(len(order), dtype=np.int64)
    position[by_use] = np.arange(len(order))
    introduced = np.bincount(first_use, minlength=num_tasks + 1)[:num_tasks]
    return order[by_use], bounds(introduced), position


# ---------------------------------------------------------------- FedCBC accessible classes


def draw_accessible_classes(
    num_clients: int, num_classes: int, per_client: int, private_per_client: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
    """Each client's accessible classes (positions in the class order) and which positions are private.

    Client ``i`` owns the private classes ``i*p .. (i+1)*p - 1`` (``p =
    private_per_client``; the class order is already shuffled) and draws its
    other ``per_client - p`` classes at random from the public ones, the
    classes no client owns. Returns ``(accessible per client, is_private)``.
    """
    private = num_clients * private_per_client
    public = np.arange(private, num_classes)
    accessible = [
        np.sort(np.concatenate([np.arange(i * private_per_client, (i + 1) * private_per_client),
                                rng.choice(public, per_client - private_per_client, replace=False)]))
        for i in range(num_clients)
    ]
    return accessible, np.arange(num_classes) < private


def draw_class_sequences(
    accessible: list[np.ndarray], num_tasks: int, per_task: int, rng: np.random.Generator
) -> np.ndarray:
    """Each client's own tasks: ``per_task`` distinct classes drawn afresh from its accessible classes at
    every step (a class may come back in a later task). Shape (clients, tasks, per_task), sorted per task."""
    return np.stack([
        np.sort(np.stack([rng.choice(classes, per_task, replace=False) for _ in range(num_tasks)]), axis=1)
        for classes in accessible
    ])
