"""Partitions of one task's samples: disjointness, coverage, determinism, skew, class counts, owners."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fcl_emu.scenario import partitions

PER_CLASS = 200


def make_labels(num_classes: int = 10, per_class: int = PER_CLASS, seed: int = 0) -> np.ndarray:
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))
    labels.flags.writeable = False  # partitions must not modify their input
    return labels


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def check_disjoint_cover(parts, labels, classes, cover: bool = True):
    flat = np.concatenate(parts)
    assert all(p.dtype == np.int64 and (np.diff(p) > 0).all() for p in parts)  # sorted, no repeats
    assert len(np.unique(flat)) == len(flat), "a sample is given to two clients"
    assert np.isin(labels[flat], classes).all(), "a sample from outside the task"
    if cover:
        assert set(flat.tolist()) == set(np.flatnonzero(np.isin(labels, classes)).tolist())


def label_entropy(parts, labels, num_classes) -> float:
    """Sample-weighted mean entropy (bits) of the clients' label distributions."""
    total, weighted = 0, 0.0
    for p in parts:
        if len(p):
            q = np.bincount(labels[p], minlength=num_classes) / len(p)
            weighted += len(p) * -(q[q > 0] * np.log2(q[q > 0])).sum()
            total += len(p)
    return weighted / total


ALL = {
    "iid": lambda labels, classes, n, r: partitions.iid(labels, classes, n, r),
    "dirichlet": lambda labels, classes, n, r: partitions.dirichlet(labels, classes, n, r, 0.5),
    "class_fraction": lambda labels, classes, n, r: partitions.class_fraction(labels, classes, n, r, 0.6),
    "private_classes": lambda labels, classes, n, r: partitions.private_classes(labels, classes, n, r, 0.5),
}


@pytest.mark.parametrize("name", ALL)
def test_disjoint_and_covering(name):
    labels = make_labels()
    classes = np.arange(2, 8)
    parts = ALL[name](labels, classes, 30, rng())
    assert len(parts) == 30
    check_disjoint_cover(parts, labels, classes)


@pytest.mark.parametrize("name", ALL)
def test_deterministic_given_the_generator(name):
    labels, classes = make_labels(), np.arange(10)
    a = ALL[name](labels, classes, 25, rng(3))
    b = ALL[name](labels, classes, 25, rng(3))
    c = ALL[name](labels, classes, 25, rng(4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(sorted(ALL)),
    num_classes=st.integers(1, 12),
    per_class=st.integers(0, 30),
    num_clients=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_disjoint_and_covering_for_any_size(name, num_classes, per_class, num_clients, seed):
    labels = make_labels(num_classes + 2, per_class, seed)
    classes = np.arange(1, num_classes + 1)
    parts = ALL[name](labels, classes, num_clients, rng(seed))
    assert len(parts) == num_clients
    # class_fraction covers every class only when there are enough client-class slots
    per_client = max(1, round(0.6 * num_classes + 1e-9))
    enough_slots = name != "class_fraction" or num_clients * per_client >= num_classes
    check_disjoint_cover(parts, labels, classes, cover=enough_slots)


def test_iid_is_balanced():
    labels = make_labels()
    sizes = [len(p) for p in partitions.iid(labels, np.arange(10), 300, rng())]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 10 * PER_CLASS


def test_dirichlet_skew_grows_as_beta_shrinks():
    labels, classes = make_labels(per_class=1000), np.arange(10)
    entropy = [
        np.mean([label_entropy(partitions.dirichlet(labels, classes, 50, rng(s), beta), labels, 10) for s in range(3)])
        for beta in (100.0, 1.0, 0.1, 0.01)
    ]
    assert entropy == sorted(entropy, reverse=True), entropy
    assert entropy[0] > 3.2 and entropy[-1] < 0.5  # log2(10) = 3.32 is no skew at all


def test_dirichlet_leaves_no_client_empty_when_avoidable():
    labels = make_labels(per_class=40)  # 400 samples
    for n in (100, 400):
        parts = partitions.dirichlet(labels, np.arange(10), n, rng(), 0.01)
        assert min(len(p) for p in parts) >= 1
        check_disjoint_cover(parts, labels, np.arange(10))
    parts = partitions.dirichlet(labels, np.arange(10), 500, rng(), 0.01)  # unavoidable: more clients than samples
    assert sum(len(p) > 0 for p in parts) == 400


def test_class_fraction_holds_the_right_number_of_classes():
    labels, classes = make_labels(), np.arange(10)
    parts = partitions.class_fraction(labels, classes, 40, rng(), 0.6)  # GLFC: 6 of a task's 10 classes
    held = [np.unique(labels[p]) for p in parts]
    assert all(len(h) == 6 for h in held)
    holders = np.bincount(np.concatenate(held), minlength=10)
    assert holders.sum() == 240 and holders.max() - holders.min() <= 1  # 24 holders per class
    assert len({tuple(h) for h in held}) > 10  # clients draw different class sets
    check_disjoint_cover(parts, labels, classes)


def test_class_fraction_with_too_few_clients_leaves_classes_out():
    labels = make_labels()
    parts = partitions.class_fraction(labels, np.arange(10), 2, rng(), 0.3)  # 2 clients x 3 classes < 10
    held = [set(np.unique(labels[p]).tolist()) for p in parts]
    assert [len(h) for h in held] == [3, 3] and not held[0] & held[1]
    check_disjoint_cover(parts, labels, np.arange(10), cover=False)


@pytest.mark.parametrize("fraction, classes_per_client", [(1.0, 10), (0.01, 1), (0.25, 3)])
def test_class_fraction_rounding(fraction, classes_per_client):
    labels = make_labels()
    parts = partitions.class_fraction(labels, np.arange(10), 20, rng(), fraction)
    assert {len(np.unique(labels[p])) for p in parts} == {classes_per_client}


def test_private_classes_have_exactly_one_owner():
    labels, classes = make_labels(per_class=300), np.arange(10)
    parts = partitions.private_classes(labels, classes, 30, rng(), 0.4)
    holders = np.bincount(np.concatenate([np.unique(labels[p]) for p in parts]), minlength=10)
    private = np.flatnonzero(holders == 1)
    assert len(private) == 4 and (holders[holders != 1] == 30).all()  # 6 public classes held by everyone
    owners = [c for c, p in enumerate(parts) if np.isin(private, labels[p]).any()]
    assert len(owners) == 4  # distinct owners while clients suffice
    for cls in private:
        owner = next(p for p in parts if cls in labels[p])
        assert (labels[owner] == cls).sum() == 300  # the whole class
    check_disjoint_cover(parts, labels, classes)


def test_private_classes_extremes():
    labels, classes = make_labels(), np.arange(10)
    everyone = partitions.private_classes(labels, classes, 4, rng(), 0.0)
    assert all(len(np.unique(labels[p])) == 10 for p in everyone)
    alone = partitions.private_classes(labels, classes, 4, rng(), 1.0)  # more private classes than clients
    assert sorted(len(np.unique(labels[p])) for p in alone) == [2, 2, 3, 3]
    check_disjoint_cover(alone, labels, classes)


def test_task_pool_splits_each_pool_task_among_its_clients():
    labels = make_labels()
    tasks = [np.array([0, 1]), np.array([2, 3]), np.array([0, 1]), np.array([0, 1])]
    parts = partitions.task_pool(labels, tasks, rng())
    for client, task in enumerate(tasks):
        assert set(np.unique(labels[parts[client]])) == set(task.tolist())
    check_disjoint_cover([parts[0], parts[2], parts[3]], labels, np.array([0, 1]))
    check_disjoint_cover([parts[1]], labels, np.array([2, 3]))


def test_task_pool_with_samples_per_client():
    labels = make_labels()
    tasks = [np.array([0, 1, 2]), np.array([0, 1, 2]), np.array([5, 6, 7])]
    parts = partitions.task_pool(labels, tasks, rng(), samples_per_client=100)
    for part, task in zip(parts, tasks):
        assert len(part) == 100 and len(np.unique(part)) == 100
        assert sorted(np.bincount(labels[part])[task].tolist()) == [33, 33, 34]  # even over the task's classes
    capped = partitions.task_pool(labels, tasks[:1], rng(), samples_per_client=10_000)
    assert len(capped[0]) == 3 * PER_CLASS
    again = partitions.task_pool(labels, tasks, rng(), samples_per_client=100)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_iid_with_a_fixed_share_per_client():
    labels = np.repeat(np.arange(4), 25)  # 100 samples
    parts = partitions.iid(labels, np.arange(4), 10, np.random.default_rng(0), per_client=6)
    assert [len(p) for p in parts] == [6] * 10
    assert len(np.unique(np.concatenate(parts))) == 60  # disjoint
    shared = partitions.iid(labels, np.arange(4), 20, np.random.default_rng(0), per_client=6)  # 120 > 100
    assert shared.shape == (20, 6) and all(len(np.unique(p)) == 6 for p in shared)
    with pytest.raises(ValueError, match="exceeds the task's 100 samples"):
        partitions.iid(labels, np.arange(4), 2, np.random.default_rng(0), per_client=101)
