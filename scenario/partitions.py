"""Partitions of one task's training samples among the task's active clients.

Every function is pure: it reads the incremental training ``labels``, the
task's ``classes`` and the number of active clients, draws only from the
numpy ``Generator`` it is given, and returns one sorted int64 array of
training-set indices per client (position ``i`` = the task's ``i``-th active
client; equal shares come as the rows of one 2-D array). Apart from
``task_pool`` with a per-client sample count and ``iid`` shares that outnumber
the task's samples, clients' arrays are disjoint.

Sources for the FCIL splits:

- GLFC: Dong et al., "Federated Class-Incremental Learning", CVPR 2022;
  official code github.com/conditionWang/FCIL (``src/option.py``:
  ``--iid_level 6``, "number of data classes for local clients", with
  ``--task_size 10``; each client ``random.sample``s that many of the current
  task's classes when the task starts).
- AF-FCL: Wuerkaixi et al., "Accurate Forgetting for Heterogeneous Federated
  Continual Learning", ICLR 2024; official code github.com/zaocan666/AF-FCL
  (``split_dataset.py``: every client shuffles the classes on its own and
  takes ``task_num x class_each_task`` distinct ones as its task sequence,
  then a random subset of each class's samples).
- FedCBC: ``private_classes`` follows the project's description (private
  classes with a single owner, public classes shared IID);
  ``accessible_classes`` is the paper's MNIST protocol as the project's issue
  states it (3 clients; each client's 5 tasks of 3 classes drawn from its 6
  accessible classes, 2 of them private); its paper and code were not
  available to check the details (how samples recur, see the function).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def iid(labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator,
        per_client: int | None = None) -> list[np.ndarray] | np.ndarray:
    """All of the task's samples, shuffled and dealt in equal shares (sizes differ by at most one); with
    ``per_client``, exactly that many each, a fixed share whatever the population, drawn by :func:`shares`
    (one row per client; the rest unused, or samples shared by clients where the shares outnumber them)."""
    indices = np.flatnonzero(np.isin(labels, classes))
    if per_client is None:
        return _deal(indices, num_clients, rng)
    if per_client > len(indices):
        raise ValueError(f"samples_per_client_task={per_client} exceeds the task's {len(indices)} samples "
                         "(a client's samples are distinct)")
    return shares(indices, num_clients, per_client, rng)


def iid_share(samples: int, num_clients: int, per_client: int | None, min_share: int | None) -> int | None:
    """Each client's share of a task's ``samples`` under ``iid``: ``per_client`` if set; else ``min_share``
    (at most ``samples``) where an equal deal would give a client fewer; else None (the equal deal)."""
    if per_client is not None:
        return per_client
    floor = min(min_share or 0, samples)
    return floor if samples // num_clients < floor else None


def shares(indices: np.ndarray, num_clients: int, per_client: int, rng: np.random.Generator) -> np.ndarray:
    """``per_client`` distinct samples of ``indices`` for every client: row ``i`` (sorted) is client ``i``'s.

    The samples are shuffled and dealt in whole shares; while clients remain, they are shuffled again on their
    own and dealt again. So no share repeats a sample, clients share samples only when ``num_clients x
    per_client`` exceeds ``len(indices)``, and then every sample is held by about ``num_clients x per_client /
    len(indices)`` clients (one per shuffle it was dealt in). Where all shares fit, one shuffle deals them.
    """
    per_shuffle = len(indices) // per_client
    shuffles = -(-num_clients // per_shuffle)
    if shuffles == 1:
        chosen = rng.permutation(indices)
    else:
        chosen = rng.permuted(np.broadcast_to(indices, (shuffles, len(indices))), axis=1)
        chosen = chosen[:, : per_shuffle * per_client]
    return np.sort(chosen.ravel()[: num_clients * per_client].astype(np.int64).reshape(num_clients, per_client),
                   axis=1)


def dirichlet(
    labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator, beta: float
) -> list[np.ndarray]:
    """Per class, shares over clients drawn from Dirichlet(beta, ..., beta).

    The usual label-skew benchmark (Hsu et al. 2019; Li et al., NIID-Bench):
    smaller ``beta``, more skew. Every sample is assigned. Rule against empty
    clients: while a client has no sample and another has at least two, the
    client with the most samples gives it one random sample, so nobody is
    empty whenever the task has at least ``num_clients`` samples.
    """
    indices, owners = [], []
    for idx in _class_indices(labels, classes):
        shares = rng.dirichlet(np.full(num_clients, beta))
        cuts = np.minimum((np.cumsum(shares)[:-1] * len(idx)).astype(np.int64), len(idx))
        counts = np.diff(np.concatenate([[0], cuts, [len(idx)]]))
        indices.append(rng.permutation(idx))
        owners.append(np.repeat(np.arange(num_clients), counts))
    owner = np.concatenate(owners)
    counts = np.bincount(owner, minlength=num_clients)
    for empty in np.flatnonzero(counts == 0):
        donor = int(np.argmax(counts))
        if counts[donor] < 2:
            break
        owner[rng.choice(np.flatnonzero(owner == donor))] = empty
        counts[donor] -= 1
        counts[empty] += 1
    return _group(np.concatenate(indices), owner, num_clients)


def class_fraction(
    labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator, fraction: float
) -> list[np.ndarray]:
    """GLFC's split: each client holds ``round(fraction * len(classes))`` (at least one) of the task's classes.

    In GLFC's official code (``--iid_level 6`` of ``task_size 10`` classes)
    each client draws its classes uniformly and takes *all* their samples, so
    clients share samples. Here a client draws its classes at random among
    the least-held ones, so every class has about the same number of holders
    and all are covered when ``num_clients * per_client >= len(classes)``; each
    class's samples are then dealt disjointly among its holders.
    """
    per_client = max(1, min(len(classes), math.floor(fraction * len(classes) + 0.5)))
    held = np.zeros(len(classes), dtype=np.int64)
    holders: list[list[int]] = [[] for _ in classes]
    for client in range(num_clients):
        for j in np.lexsort((rng.random(len(classes)), held))[:per_client]:
            held[j] += 1
            holders[j].append(client)
    indices, owners = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    for idx, who in zip(_class_indices(labels, classes), holders):
        if not who:  # nobody drew this class (only when clients x per_client < classes): left out
            continue
        for client, part in zip(who, _deal(idx, len(who), rng)):
            indices.append(part)
            owners.append(np.full(len(part), client))
    return _group(np.concatenate(indices), np.concatenate(owners), num_clients)


def private_classes(
    labels: np.ndarray, classes: np.ndarray, num_clients: int, rng: np.random.Generator, fraction: float
) -> list[np.ndarray]:
    """FedCBC-style split: ``round(fraction * len(classes))`` random classes are private, the rest public.

    Each private class belongs whole to one client (distinct owners while
    there are enough clients, then spread evenly); the public classes' samples
    are dealt IID over all the task's clients.
    """
    num_private = math.floor(fraction * len(classes) + 0.5)
    is_private = np.zeros(len(classes), dtype=bool)
    is_private[rng.choice(len(classes), num_private, replace=False)] = True
    # Owners: a random order of all clients, repeated while private classes remain.
    owners = [c for _ in range(math.ceil(num_private / num_clients)) for c in rng.permutation(num_clients)]
    per_class = _class_indices(labels, classes)
    private = [idx for idx, p in zip(per_class, is_private) if p]
    public = np.concatenate([idx for idx, p in zip(per_class, is_private) if not p] + [np.empty(0, np.int64)])
    public_parts = _deal(public, num_clients, rng)
    owner = [np.full(len(idx), o) for idx, o in zip(private, owners)]
    owner += [np.full(len(part), c) for c, part in enumerate(public_parts)]
    return _group(np.concatenate(private + public_parts), np.concatenate(owner), num_clients)


def task_pool(
    labels: np.ndarray,
    client_tasks: Sequence[np.ndarray],
    rng: np.random.Generator,
    samples_per_client: int | None = None,
) -> list[np.ndarray]:
    """AF-FCL's limitless task pool: client ``i`` works on the classes ``client_tasks[i]``.

    The pool here is fixed (equal, disjoint pool tasks, see
    :func:`fcl_emu.scenario.tasks.pool_stream`), where AF-FCL lets each client group
    classes into tasks freely; many small pool tasks come close to that.

    With ``samples_per_client=None`` the samples of each pool task are dealt
    IID, disjointly, among the clients working on it. With a number, every
    client draws that many samples of its task on its own (spread evenly over
    the task's classes, capped by their sizes), so clients may share samples,
    as in AF-FCL's official split (each client takes a random subset of each
    of its classes: 400 images on CIFAR-100, half the class on EMNIST).
    """
    out = [np.empty(0, dtype=np.int64)] * len(client_tasks)
    if samples_per_client is None:
        groups: dict[tuple[int, ...], list[int]] = {}
        for client, task in enumerate(client_tasks):
            groups.setdefault(tuple(int(c) for c in task), []).append(client)
        for task, clients in sorted(groups.items()):
            for client, part in zip(clients, _deal(np.flatnonzero(np.isin(labels, task)), len(clients), rng)):
                out[client] = part
        return out
    for client, task in enumerate(client_tasks):
        quotas = [len(q) for q in np.array_split(np.arange(samples_per_client), len(task))]
        picks = [rng.choice(i, min(q, len(i)), replace=False) for i, q in zip(_class_indices(labels, task), quotas)]
        out[client] = np.sort(np.concatenate(picks)).astype(np.int64)
    return out


def accessible_classes(
    labels: np.ndarray, steps: np.ndarray, active: Sequence[int], rng: np.random.Generator
) -> list[list[np.ndarray]]:
    """FedCBC's protocol: client ``i`` works on the classes ``steps[i, t]`` at task ``t`` (from
    :func:`fcl_emu.scenario.tasks.draw_class_sequences`, incremental labels), once it is active
    (``i < active[t]``).

    A class comes back in several of a client's tasks and is held by several
    clients; its samples are dealt IID and disjointly over all these
    (client, task) occurrences, so every task brings fresh samples. Returns
    ``[task][client]`` index arrays for the active clients of each task.
    """
    num_tasks = steps.shape[1]
    occurrences: dict[int, list[tuple[int, int]]] = {}
    for t in range(num_tasks):
        for client in range(active[t]):
            for c in steps[client, t].tolist():
                occurrences.setdefault(c, []).append((t, client))
    indices = [[np.empty(0, np.int64)] for _ in range(num_tasks)]
    owners = [[np.empty(0, np.int64)] for _ in range(num_tasks)]
    for c, where in sorted(occurrences.items()):
        for (t, client), part in zip(where, _deal(np.flatnonzero(labels == c), len(where), rng)):
            indices[t].append(part)
            owners[t].append(np.full(len(part), client))
    return [_group(np.concatenate(indices[t]), np.concatenate(owners[t]), active[t]) for t in range(num_tasks)]


def _class_indices(labels: np.ndarray, classes: np.ndarray) -> list[np.ndarray]:
    return [np.flatnonzero(labels == c) for c in classes]


def _deal(indices: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and split into ``num_clients`` near-equal sorted parts."""
    return [np.sort(part) for part in np.array_split(rng.permutation(indices).astype(np.int64), num_clients)]


def _group(indices: np.ndarray, owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Sorted per-client index arrays from parallel (index, owner) arrays."""
    order = np.lexsort((indices, owner))
    counts = np.bincount(owner, minlength=num_clients)
    return np.split(indices[order].astype(np.int64), np.cumsum(counts)[:-1])
