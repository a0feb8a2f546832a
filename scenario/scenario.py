"""The emulated world of one run: the task stream and every client's data.

:func:`build_scenario` is deterministic: the same spec and dataset give the
same class order and partitions in any process (each random decision draws
from its own ``numpy.random.Generator`` seeded with ``(seed, stream, task)``).
A :class:`Scenario` holds index arrays into the dataset, never image copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fcl_emu.scenario import partitions, tasks
from fcl_emu.scenario.datasets import ImageDataset, class_subset
from fcl_emu.scenario.spec import ScenarioSpec

# Independent random streams derived from one seed.
_ORDER_STREAM, _PARTITION_STREAM, _POOL_STREAM, _KEEP_STREAM, _NOISE_STREAM, _SUBSET_STREAM = 0, 1, 2, 3, 4, 5


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, *stream])


@dataclass(frozen=True)
class OverlappingShares:
    """Task ``task``'s ``iid`` shares that outnumber its samples: ``per_client`` distinct samples for each of
    ``clients`` clients out of ``samples``, so drawn with replacement across clients; ``minimum``: the share is
    ``min_samples_per_client_task`` (an equal split would have given a client fewer)."""

    task: int
    per_client: int
    clients: int
    samples: int
    minimum: bool

    @property
    def holders(self) -> float:
        """About how many clients hold each of the task's samples."""
        return self.clients * self.per_client / self.samples


def overlapping_shares_text(shares: Sequence[OverlappingShares]) -> str | None:
    """One line for a run's summary (tasks numbered from 1), or None when no client shares a sample:
    ``tasks 1-5: 10 samples per client (the minimum share), drawn with replacement, ~17 clients per sample``."""
    if not shares:
        return None
    groups: dict[tuple[int, bool], list[OverlappingShares]] = {}
    for share in shares:
        groups.setdefault((share.per_client, share.minimum), []).append(share)
    parts = []
    for (per_client, minimum), group in groups.items():
        tasks = [g.task + 1 for g in group]
        if len(tasks) == 1:
            numbers = f"task {tasks[0]}"
        elif tasks == list(range(tasks[0], tasks[-1] + 1)):
            numbers = f"tasks {tasks[0]}-{tasks[-1]}"
        else:
            numbers = f"tasks {', '.join(map(str, tasks))}"
        low, high = (_about(f(g.holders for g in group)) for f in (min, max))
        holders = f"~{low}" if low == high else f"~{low}-{high}"
        parts.append(f"{numbers}: {per_client} samples per client{' (the minimum share)' * minimum}, drawn with "
                     f"replacement, {holders} clients per sample")
    return "; ".join(parts)


def _about(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def subset_of(spec: ScenarioSpec, dataset: ImageDataset) -> ImageDataset:
    """The classes of ``dataset`` that run ``spec`` uses: ``spec.class_subset`` of them drawn with its seed (the
    same in every process), or all."""
    if spec.class_subset is None or spec.class_subset == dataset.num_classes:
        return dataset
    chosen = _rng(spec.seed, _SUBSET_STREAM).choice(dataset.num_classes, spec.class_subset, replace=False)
    return class_subset(dataset, sorted(chosen.tolist()))


class Scenario:
    """Class-incremental tasks and the clients' training data at each task.

    Class ids are incremental labels (see :mod:`fcl_emu.scenario.tasks`). Clients are
    numbered by join order: the first ``spec.initial_clients`` are active from
    task 0 and ``spec.new_clients_per_task`` more join at each later task; a
    client stays active once it has joined.

    GLFC's three groups of clients at task ``t`` (:meth:`client_group`):
    ``"new"``, those joining at ``t`` (all clients at task 0);
    ``"old_only"``, the :meth:`old_only_clients` that keep their task ``t - 1``
    data, so hold only old classes (``spec.old_only_fraction``); and
    ``"old_and_new"``, the other earlier clients, which get task ``t``'s data.

    With ``partition='task_pool'`` clients work on different pool tasks at the
    same step; the task stream used for evaluation is then the pool tasks in
    order of first use: ``task_classes(t)`` are the classes some client meets
    for the first time at step ``t`` (possibly none) and ``seen_classes(t)``
    everything any client has met so far.

    ``overlapping_shares`` names the ``iid`` tasks whose clients share samples
    (their shares outnumber the task's samples, see :func:`partitions.shares`).
    """

    def __init__(
        self,
        spec: ScenarioSpec,
        dataset: ImageDataset,
        class_order: np.ndarray,
        task_bounds: np.ndarray,
        client_data: list[Sequence[np.ndarray]],
        old_only: list[np.ndarray],
        noisy_labels: dict[tuple[int, int], np.ndarray] | None = None,
        overlapping_shares: Sequence[OverlappingShares] = (),
    ):
        self.spec = spec
        self.dataset = dataset
        self.class_order = _frozen(class_order)
        self.train_labels = _frozen(tasks.to_incremental(dataset.train_y, class_order))
        self.test_labels = _frozen(tasks.to_incremental(dataset.test_y, class_order))
        self._bounds = task_bounds
        # Per task, all clients' indices back to back and where each client's start (equal shares: one 2-D array).
        self._offsets = [np.arange(len(parts) + 1) * parts.shape[1] if isinstance(parts, np.ndarray)
                         else np.concatenate([[0], np.cumsum([len(p) for p in parts])]) for parts in client_data]
        self._indices = [_frozen(np.ravel(parts) if isinstance(parts, np.ndarray) else np.concatenate(parts))
                         for parts in client_data]
        self.overlapping_shares = tuple(overlapping_shares)
        self._old_only = [_frozen(kept) for kept in old_only]
        self._noisy_labels = {key: _frozen(y) for key, y in (noisy_labels or {}).items()}

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def num_tasks(self) -> int:
        return self.spec.num_tasks

    def task_classes(self, t: int) -> np.ndarray:
        """Incremental labels introduced at task ``t``."""
        self._check_task(t)
        return np.arange(self._bounds[t], self._bounds[t + 1])

    def seen_classes(self, t: int) -> np.ndarray:
        """Incremental labels introduced at tasks ``0..t``."""
        self._check_task(t)
        return np.arange(self._bounds[t + 1])

    def join_task(self, client: int) -> int:
        """The task at which ``client`` joins."""
        if not 0 <= client < self.spec.num_clients:
            raise ValueError(f"client {client} out of range 0..{self.spec.num_clients - 1}")
        first = self.spec.initial_clients
        return 0 if client < first else 1 + (client - first) // self.spec.new_clients_per_task

    def active_clients(self, t: int) -> np.ndarray:
        """Clients that have joined by task ``t``."""
        self._check_task(t)
        return np.arange(len(self._offsets[t]) - 1)

    def client_indices(self, client: int, t: int) -> np.ndarray:
        """Read-only training-set indices of ``client`` at task ``t`` (empty if not active)."""
        self._check_task(t)
        if self.join_task(client) > t:
            return np.empty(0, dtype=np.int64)
        return self._indices[t][self._offsets[t][client] : self._offsets[t][client + 1]]

    def client_labels(self, client: int, t: int) -> np.ndarray:
        """Incremental labels of ``client``'s training samples at task ``t`` (aligned with
        :meth:`client_indices`), as the client sees them: noisy for a noisy client's early tasks."""
        noisy = self._noisy_labels.get((client, t))
        return noisy if noisy is not None else self.train_labels[self.client_indices(client, t)]

    @property
    def noisy_clients(self) -> np.ndarray:
        """Sorted clients that train on random labels in their first ``spec.noisy_tasks`` tasks."""
        return np.unique(np.array([c for c, _ in self._noisy_labels], dtype=np.int64))

    def old_only_clients(self, t: int) -> np.ndarray:
        """Sorted clients that keep their task ``t - 1`` data at task ``t`` instead of getting task ``t``'s."""
        self._check_task(t)
        return self._old_only[t]

    def client_group(self, client: int, t: int) -> str:
        """``client``'s group at task ``t``: ``"new"``, ``"old_only"`` or ``"old_and_new"`` (see the class)."""
        self._check_task(t)
        joined = self.join_task(client)
        if joined > t:
            raise ValueError(f"client {client} joins at task {joined}, after task {t}")
        if joined == t:
            return "new"
        return "old_only" if client in self._old_only[t] else "old_and_new"

    def client_classes(self, client: int, t: int) -> np.ndarray:
        """Incremental labels present in ``client``'s data at task ``t``."""
        return np.unique(self.train_labels[self.client_indices(client, t)])

    def test_indices(self, classes: np.ndarray) -> np.ndarray:
        """Test-set indices whose incremental label is in ``classes``."""
        return np.flatnonzero(np.isin(self.test_labels, classes))

    def _check_task(self, t: int) -> None:
        if not 0 <= t < self.num_tasks:
            raise ValueError(f"task {t} out of range 0..{self.num_tasks - 1}")

    def __repr__(self) -> str:
        s = self.spec
        return f"Scenario({s.dataset}, {s.num_tasks} tasks, {s.num_clients} clients, {s.partition}, seed={s.seed})"


def build_scenario(spec: ScenarioSpec, dataset: ImageDataset) -> Scenario:
    """Class order, task stream and every client's data at every task; with ``spec.class_subset``, on that many
    of ``dataset``'s classes (:func:`subset_of`)."""
    if spec.dataset != dataset.name:
        raise ValueError(f"spec is for dataset {spec.dataset!r} but got {dataset.name!r}")
    dataset = subset_of(spec, dataset)
    order = tasks.class_order(dataset.num_classes, spec.shuffle_classes, _rng(spec.seed, _ORDER_STREAM))
    active = [spec.initial_clients + spec.new_clients_per_task * t for t in range(spec.num_tasks)]

    if spec.partition == "task_pool":
        join = np.repeat(np.arange(spec.num_tasks), [active[0], *np.diff(active)])
        sequences = tasks.draw_task_sequences(
            spec.num_clients, spec.pool_size, spec.num_tasks, _rng(spec.seed, _POOL_STREAM)
        )
        order, bounds, rank = tasks.pool_stream(order, sequences, join, spec.pool_size)
        per_task = dataset.num_classes // spec.pool_size
    elif spec.partition == "accessible_classes":
        join = np.repeat(np.arange(spec.num_tasks), [active[0], *np.diff(active)])
        rng = _rng(spec.seed, _POOL_STREAM)
        per_client, private, per_task = spec.accessible
        accessible, _ = tasks.draw_accessible_classes(spec.num_clients, dataset.num_classes, per_client, private, rng)
        steps = tasks.draw_class_sequences(accessible, spec.num_tasks, per_task, rng)
        order, bounds, position = tasks.first_use_stream(order, steps, join)
        steps = position[steps]  # incremental labels
    else:
        bounds = tasks.bounds(tasks.task_sizes(dataset.num_classes, spec.num_tasks, spec.classes_first_task))
    labels = tasks.to_incremental(dataset.train_y, order)

    client_data, old_only, overlapping = [], [], []
    if spec.partition == "accessible_classes":
        client_data = partitions.accessible_classes(labels, steps, active, _rng(spec.seed, _PARTITION_STREAM))
        old_only = [np.empty(0, dtype=np.int64)] * spec.num_tasks
    for t in range(len(client_data), spec.num_tasks):
        rng = _rng(spec.seed, _PARTITION_STREAM, t)
        classes = np.arange(bounds[t], bounds[t + 1])
        kept = _old_only(spec, active, t)
        receivers = np.setdiff1d(np.arange(active[t]), kept)  # the task's data goes to these only
        n = len(receivers)
        if spec.partition == "iid":
            samples = int(np.isin(labels, classes).sum())
            share = partitions.iid_share(samples, n, spec.samples_per_client_task, spec.min_samples_per_client_task)
            parts = partitions.iid(labels, classes, n, rng, share)
            if share is not None and n * share > samples:
                overlapping.append(OverlappingShares(t, share, n, samples, spec.samples_per_client_task is None))
        elif spec.partition == "dirichlet":
            parts = partitions.dirichlet(labels, classes, n, rng, spec.dirichlet_beta)
        elif spec.partition == "class_fraction":
            parts = partitions.class_fraction(labels, classes, n, rng, spec.class_fraction)
        elif spec.partition == "private_classes":
            parts = partitions.private_classes(labels, classes, n, rng, spec.private_fraction)
        else:
            client_tasks = [rank[p] * per_task + np.arange(per_task) for p in sequences[:n, t]]
            parts = partitions.task_pool(labels, client_tasks, rng, spec.samples_per_client_task)
        if len(kept):
            data = dict(zip(receivers.tolist(), parts)) | {c: client_data[t - 1][c] for c in kept.tolist()}
            parts = [data[c] for c in range(active[t])]
        client_data.append(parts)
        old_only.append(kept)
    noisy = _noisy_labels(spec, labels, active, client_data)
    return Scenario(spec, dataset, order, bounds, client_data, old_only, noisy, overlapping)


def _noisy_labels(spec: ScenarioSpec, labels: np.ndarray, active: list[int],
                  client_data: list[list[np.ndarray]]) -> dict[tuple[int, int], np.ndarray]:
    """Random labels of the noisy clients' first ``spec.noisy_tasks`` tasks: uniform over the classes of the
    client's data at that task, by ``(client, task)``."""
    count = round(spec.noisy_client_fraction * spec.num_clients)
    if count == 0:
        return {}
    rng = _rng(spec.seed, _NOISE_STREAM)
    noisy = np.sort(rng.choice(spec.num_clients, count, replace=False))
    out = {}
    for t in range(spec.num_tasks):
        for client in noisy[noisy < active[t]].tolist():
            joined = next(j for j in range(spec.num_tasks) if client < active[j])
            true = labels[client_data[t][client]]
            if t - joined < spec.noisy_tasks and len(true):
                out[(client, t)] = rng.choice(np.unique(true), len(true))
    return out


def _old_only(spec: ScenarioSpec, active: list[int], t: int) -> np.ndarray:
    """The clients of task ``t - 1`` that keep their data at task ``t``, leaving at least one to get task ``t``'s."""
    if t == 0 or spec.old_only_fraction == 0:
        return np.empty(0, dtype=np.int64)
    count = min(round(spec.old_only_fraction * active[t - 1]), active[t] - 1)
    return np.sort(_rng(spec.seed, _KEEP_STREAM, t).choice(active[t - 1], count, replace=False))


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    a.flags.writeable = False
    return a
