"""Scenario: task stream, clients joining, per-client data, determinism across processes, speed."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fcl_emu.scenario.datasets import DatasetNotFoundError, ImageDataset, load_dataset, roots_from_env
from fcl_emu.scenario.scenario import Scenario, build_scenario
from fcl_emu.scenario.spec import ScenarioSpec

REPO = Path(__file__).resolve().parents[1]
PARTITIONS = ["iid", "dirichlet", "class_fraction", "private_classes", "task_pool"]


def fake_dataset(name: str = "mnist", num_classes: int = 10, per_class: int = 100, seed: int = 0) -> ImageDataset:
    """A small dataset with real shapes and balanced, shuffled labels (no image content needed)."""
    rng = np.random.default_rng(seed)
    train_y = rng.permutation(np.repeat(np.arange(num_classes), per_class)).astype(np.int64)
    test_y = rng.permutation(np.repeat(np.arange(num_classes), per_class // 5)).astype(np.int64)
    train_x, test_x = np.zeros((len(train_y), 2, 2, 1), np.uint8), np.zeros((len(test_y), 2, 2, 1), np.uint8)
    names = tuple(str(i) for i in range(num_classes))
    return ImageDataset(name, train_x, train_y, test_x, test_y, num_classes, names, (0.0,), (1.0,))


def digest(s: Scenario) -> str:
    h = hashlib.sha256(s.class_order.tobytes())
    for t in range(s.num_tasks):
        h.update(s.task_classes(t).tobytes())
        for c in s.active_clients(t):
            h.update(s.client_indices(c, t).tobytes() + b"|")
    return h.hexdigest()


def test_class_order_and_incremental_labels():
    ds = fake_dataset()
    s = build_scenario(ScenarioSpec(num_clients=10, seed=3), ds)
    assert sorted(s.class_order.tolist()) == list(range(10)) and s.class_order.tolist() != list(range(10))
    assert (s.class_order[s.train_labels] == ds.train_y).all() and (s.class_order[s.test_labels] == ds.test_y).all()
    plain = build_scenario(ScenarioSpec(num_clients=10, shuffle_classes=False), ds)
    assert plain.class_order.tolist() == list(range(10)) and (plain.train_labels == ds.train_y).all()


def test_task_stream():
    s = build_scenario(ScenarioSpec(num_tasks=4, classes_first_task=4, num_clients=5), fake_dataset())
    assert (s.num_tasks, s.num_classes) == (4, 10)
    assert [s.task_classes(t).tolist() for t in range(4)] == [[0, 1, 2, 3], [4, 5], [6, 7], [8, 9]]
    assert s.seen_classes(2).tolist() == list(range(8))
    with pytest.raises(ValueError, match="task 4 out of range"):
        s.task_classes(4)


@pytest.mark.parametrize("partition", PARTITIONS)
def test_clients_join_and_get_data(partition):
    spec = ScenarioSpec(num_tasks=5, num_clients=14, new_clients_per_task=2, partition=partition)
    s = build_scenario(spec, fake_dataset())
    assert [len(s.active_clients(t)) for t in range(5)] == [6, 8, 10, 12, 14]
    assert [s.join_task(c) for c in (0, 5, 6, 7, 8, 13)] == [0, 0, 1, 1, 2, 4]
    assert len(s.client_indices(13, 3)) == 0 and len(s.client_classes(13, 3)) == 0
    assert len(s.client_indices(13, 4)) > 0
    for t in range(5):
        parts = [s.client_indices(c, t) for c in s.active_clients(t)]
        flat = np.concatenate(parts)
        assert all(p.dtype == np.int64 for p in parts)
        if partition != "task_pool":
            assert len(np.unique(flat)) == len(flat)  # disjoint
            assert set(flat.tolist()) == set(np.flatnonzero(np.isin(s.train_labels, s.task_classes(t))).tolist())
        for c in s.active_clients(t):
            assert np.isin(s.client_classes(c, t), s.seen_classes(t)).all()
    with pytest.raises(ValueError, match="client 14 out of range"):
        s.join_task(14)


def test_client_indices_are_read_only_views():
    s = build_scenario(ScenarioSpec(num_clients=4), fake_dataset())
    idx = s.client_indices(1, 0)
    with pytest.raises(ValueError):
        idx[0] = 0
    assert idx.base is not None  # a view into the task's index array, not a copy


def test_test_indices():
    s = build_scenario(ScenarioSpec(num_clients=4, seed=1), fake_dataset())
    idx = s.test_indices(s.task_classes(1))
    assert len(idx) == 2 * 20 and set(s.test_labels[idx].tolist()) == set(s.task_classes(1).tolist())
    assert len(s.test_indices(s.seen_classes(4))) == len(s.test_labels)


def test_class_fraction_scenario():
    spec = ScenarioSpec(dataset="cifar100", num_tasks=10, num_clients=30, partition="class_fraction")
    s = build_scenario(spec, fake_dataset("cifar100", 100, 20))
    for t in (0, 9):
        assert {len(s.client_classes(c, t)) for c in s.active_clients(t)} == {6}


def test_task_pool_scenario():
    spec = ScenarioSpec(num_tasks=3, num_clients=4, new_clients_per_task=1, partition="task_pool", task_pool_size=10)
    s = build_scenario(spec, fake_dataset())
    seen_by_clients: set[int] = set()
    for t in range(3):
        held = [tuple(s.client_classes(c, t).tolist()) for c in s.active_clients(t)]
        assert all(len(h) == 1 for h in held)  # pool tasks of one class each
        seen_by_clients |= {h[0] for h in held}
        assert seen_by_clients == set(s.seen_classes(t).tolist())  # the stream = pool tasks in order of first use
    for c in range(4):
        mine = [tuple(s.client_classes(c, t).tolist()) for t in range(s.join_task(c), 3)]
        assert len(set(mine)) == len(mine)  # a client never repeats a pool task


def test_same_spec_same_scenario_in_another_process():
    spec = ScenarioSpec(num_clients=37, new_clients_per_task=3, partition="dirichlet", dirichlet_beta=0.3, seed=11)
    here = digest(build_scenario(spec, fake_dataset()))
    code = (
        "import sys; sys.path.insert(0, 'tests');"
        "from test_scenario_build import digest, fake_dataset;"
        "from fcl_emu.scenario.scenario import build_scenario; from fcl_emu.scenario.spec import ScenarioSpec;"
        f"print(digest(build_scenario(ScenarioSpec(**{spec.model_dump()!r}), fake_dataset())))"
    )
    there = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert there.stdout.strip() == here
    other = digest(build_scenario(spec.model_copy(update={"seed": 12}), fake_dataset()))
    assert other != here


def test_spec_must_match_dataset():
    with pytest.raises(ValueError, match="spec is for dataset 'cifar10' but got 'mnist'"):
        build_scenario(ScenarioSpec(dataset="cifar10"), fake_dataset())


@pytest.fixture(scope="module")
def real_mnist() -> ImageDataset:
    roots = roots_from_env() or [REPO.parent / "shared" / "data"]
    try:
        return load_dataset("mnist", roots)
    except DatasetNotFoundError as e:
        pytest.skip(f"dataset 'mnist' is absent; looked at {', '.join(map(str, e.looked_at))}")


@pytest.mark.parametrize("partition", PARTITIONS)
def test_real_mnist_300_clients_is_fast(real_mnist, partition):
    spec = ScenarioSpec(num_clients=300, partition=partition)
    start = time.perf_counter()
    s = build_scenario(spec, real_mnist)
    assert time.perf_counter() - start < 1.0
    assert min(len(s.client_indices(c, 0)) for c in s.active_clients(0)) > 0


def test_accessible_classes_scenario_is_fedcbcs_protocol():
    spec = ScenarioSpec(num_tasks=5, num_clients=3, partition="accessible_classes")
    s = build_scenario(spec, fake_dataset(per_class=300))
    held = [[set(s.client_classes(c, t).tolist()) for t in range(5)] for c in range(3)]
    accessible = [set().union(*tasks) for tasks in held]
    assert all(len(t) == 3 for tasks in held for t in tasks)  # 3 classes per task
    assert all(len(a) <= 6 for a in accessible)  # drawn from 6 accessible classes
    owners = np.bincount([c for a in accessible for c in a], minlength=10)
    assert (owners >= 1).all() and (owners == 1).sum() <= 6  # at most 2 private classes per client
    seen: set[int] = set()
    for t in range(5):
        seen |= set().union(*(held[c][t] for c in range(3)))
        assert seen == set(s.seen_classes(t).tolist())  # the stream: classes in order of first use
    # a class that comes back brings fresh samples: no index is dealt twice over all tasks and clients
    dealt = np.concatenate([s.client_indices(c, t) for c in range(3) for t in range(5)])
    assert len(dealt) == len(np.unique(dealt))
    assert digest(s) == digest(build_scenario(spec, fake_dataset(per_class=300)))


def test_accessible_classes_refuses_too_many_private_classes():
    with pytest.raises(ValueError, match="private_per_client"):
        ScenarioSpec(num_clients=4, partition="accessible_classes")
    with pytest.raises(ValueError, match="classes_per_task"):
        ScenarioSpec(num_clients=3, partition="accessible_classes", classes_per_task=7)
    with pytest.raises(ValueError, match="applies only to partition='accessible_classes'"):
        ScenarioSpec(num_clients=3, classes_per_task=2)


def test_noisy_clients_train_on_random_labels_in_their_first_tasks():
    spec = ScenarioSpec(num_tasks=3, num_clients=10, partition="task_pool", noisy_client_fraction=0.3, noisy_tasks=2)
    s = build_scenario(spec, fake_dataset(per_class=300))
    assert len(s.noisy_clients) == 3
    for c in range(10):
        for t in range(3):
            true, seen = s.train_labels[s.client_indices(c, t)], s.client_labels(c, t)
            assert len(seen) == len(true) and set(seen.tolist()) <= set(true.tolist())
            if c in s.noisy_clients and t < 2:
                assert 0.2 < (seen == true).mean() < 0.7  # uniform over the task's classes (2 here: ~1/2)
            else:
                assert (seen == true).all()


def test_class_subset_is_seeded_relabelled_and_the_same_in_every_build():
    ds = fake_dataset(num_classes=10, per_class=20)
    ds = ImageDataset(ds.name, ds.train_x, ds.train_y, ds.test_x, ds.test_y, 10, tuple("abcdefghij"), ds.mean, ds.std)
    spec = ScenarioSpec(dataset="mnist", class_subset=4, num_tasks=2, num_clients=3, seed=5)
    s = build_scenario(spec, ds)
    assert s.num_classes == 4 and len(s.dataset.class_names) == 4
    kept = [ord(n) - ord("a") for n in s.dataset.class_names]  # the original ids, ascending
    assert kept == sorted(kept) and len(set(kept)) == 4
    assert len(s.dataset.train_y) == 4 * 20 and len(s.dataset.test_y) == 4 * 4
    for new, old in enumerate(kept):  # relabelled in order of id, every sample of the class kept
        assert np.array_equal(s.dataset.train_x[s.dataset.train_y == new], ds.train_x[ds.train_y == old])
    assert sorted(np.concatenate([s.task_classes(t) for t in range(2)])) == [0, 1, 2, 3]
    assert digest(build_scenario(spec, ds)) == digest(s)
    other = build_scenario(spec.model_copy(update={"seed": 6}), ds)
    assert other.dataset.class_names != s.dataset.class_names  # another seed, another subset (for these seeds)


def test_class_subset_bad_values_are_refused():
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="class_subset=11 exceeds the 10 classes of mnist"):
        ScenarioSpec(dataset="mnist", class_subset=11)
    with pytest.raises(ValidationError, match="num_tasks=5 exceeds the 4 classes"):
        ScenarioSpec(dataset="mnist", class_subset=4, num_tasks=5)
    with pytest.raises(ValidationError, match="greater than or equal to 2"):
        ScenarioSpec(dataset="mnist", class_subset=1)
