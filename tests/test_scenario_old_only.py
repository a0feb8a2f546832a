"""GLFC's clients with only old classes: who keeps its data, where the new task's samples go, groups, validation."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pydantic
import pytest

from fcl_emu.scenario.datasets import ImageDataset, load_dataset
from fcl_emu.scenario.scenario import Scenario, build_scenario
from fcl_emu.scenario.spec import ScenarioSpec

REPO = Path(__file__).resolve().parents[1]
# 10 initial clients, 2 more at each of the 4 later tasks: 10, 12, 14, 16, 18 active.
GLFC = dict(num_tasks=5, num_clients=18, new_clients_per_task=2, old_only_fraction=0.2)
KEPT = [0, 2, 2, 3, 3]  # round(0.2 x the clients of the previous task)


@pytest.fixture(scope="module")
def mnist(mnist_root) -> ImageDataset:
    return load_dataset("mnist", [mnist_root])


def digest(s: Scenario) -> str:
    h = hashlib.sha256(s.class_order.tobytes())
    for t in range(s.num_tasks):
        h.update(s.old_only_clients(t).tobytes() + b"#")
        for c in s.active_clients(t):
            h.update(s.client_indices(c, t).tobytes() + b"|")
    return h.hexdigest()


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "class_fraction", "private_classes"])
def test_kept_clients_hold_their_previous_data(mnist, partition):
    s = build_scenario(ScenarioSpec(**GLFC, partition=partition), mnist)
    assert [len(s.old_only_clients(t)) for t in range(5)] == KEPT
    for t in range(1, 5):
        kept = s.old_only_clients(t)
        assert (np.diff(kept) > 0).all() and kept.dtype == np.int64
        assert (kept < len(s.active_clients(t - 1))).all()  # clients joining at t are never kept
        new_samples = set(np.flatnonzero(np.isin(s.train_labels, s.task_classes(t))).tolist())
        for c in kept:
            assert np.array_equal(s.client_indices(c, t), s.client_indices(c, t - 1))
            assert np.isin(s.client_classes(c, t), s.seen_classes(t - 1)).all()  # old classes only
            assert not new_samples & set(s.client_indices(c, t).tolist())
        receivers = np.setdiff1d(s.active_clients(t), kept)
        parts = [s.client_indices(c, t) for c in receivers]
        flat = np.concatenate(parts)
        assert len(np.unique(flat)) == len(flat) and set(flat.tolist()) == new_samples  # all of it, to receivers
        if partition == "iid":
            sizes = [len(p) for p in parts]
            assert max(sizes) - min(sizes) <= 1


def test_clients_kept_twice_keep_their_first_data(mnist):
    s = build_scenario(ScenarioSpec(**{**GLFC, "old_only_fraction": 0.5}), mnist)
    twice = np.intersect1d(s.old_only_clients(1), s.old_only_clients(2))
    assert len(twice) > 0
    for c in twice:
        assert np.array_equal(s.client_indices(c, 2), s.client_indices(c, 0))
        assert np.isin(s.client_classes(c, 2), s.task_classes(0)).all()


def test_groups(mnist):
    s = build_scenario(ScenarioSpec(**GLFC), mnist)
    assert {s.client_group(c, 0) for c in s.active_clients(0)} == {"new"}
    for t in range(1, 5):
        groups = {c: s.client_group(c, t) for c in s.active_clients(t).tolist()}
        assert [c for c, g in groups.items() if g == "new"] == list(range(10 + 2 * (t - 1), 10 + 2 * t))
        assert [c for c, g in groups.items() if g == "old_only"] == s.old_only_clients(t).tolist()
        assert sum(g == "old_and_new" for g in groups.values()) == 10 + 2 * (t - 1) - KEPT[t]
        for c, g in groups.items():
            gets_new_classes = np.isin(s.client_classes(c, t), s.task_classes(t)).any()
            assert gets_new_classes == (g != "old_only")
    with pytest.raises(ValueError, match="client 17 joins at task 4, after task 3"):
        s.client_group(17, 3)


def test_deterministic_in_any_process(mnist, mnist_root):
    spec = ScenarioSpec(**GLFC, seed=5)
    s = build_scenario(spec, mnist)
    assert digest(build_scenario(spec, mnist)) == digest(s)
    code = (
        "import sys; sys.path.insert(0, 'tests'); from test_scenario_old_only import digest;"
        "from fcl_emu.scenario.datasets import load_dataset; from fcl_emu.scenario.scenario import build_scenario;"
        f"from fcl_emu.scenario.spec import ScenarioSpec; ds = load_dataset('mnist', [{str(mnist_root)!r}]);"
        f"print(digest(build_scenario(ScenarioSpec(**{spec.model_dump()!r}), ds)))"
    )
    there = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert there.stdout.strip() == digest(s)
    other = build_scenario(spec.model_copy(update={"seed": 6}), mnist)
    assert [other.old_only_clients(t).tolist() for t in range(5)] != [s.old_only_clients(t).tolist() for t in range(5)]


def test_zero_fraction_is_the_plain_scenario(mnist):
    plain = {k: v for k, v in ScenarioSpec(**GLFC).model_dump().items() if k != "old_only_fraction"}
    without = build_scenario(ScenarioSpec(**plain), mnist)
    zero = build_scenario(ScenarioSpec(**plain, old_only_fraction=0.0), mnist)
    assert digest(zero) == digest(without)
    assert all(len(zero.old_only_clients(t)) == 0 for t in range(5))
    assert all(zero.client_group(c, 2) == "old_and_new" for c in range(12))
    # Drawing the kept clients leaves the other random streams alone: task 0 is the same.
    glfc = build_scenario(ScenarioSpec(**GLFC), mnist)
    assert all(np.array_equal(glfc.client_indices(c, 0), zero.client_indices(c, 0)) for c in range(10))


@pytest.mark.parametrize("kwargs", [{"partition": "task_pool", "old_only_fraction": 0.1},
                                    {"old_only_fraction": 1.0}, {"old_only_fraction": -0.1}])  # fmt: skip
def test_bad_values_name_the_field(kwargs):
    with pytest.raises(pydantic.ValidationError) as info:
        ScenarioSpec(**kwargs)
    assert [e["loc"] for e in info.value.errors()] == [("old_only_fraction",)]
    assert "old_only_fraction" in str(info.value)
    assert ScenarioSpec(partition="task_pool", old_only_fraction=0.0).old_only_fraction == 0


@pytest.mark.parametrize("num_clients, new_clients_per_task", [(2, 0), (4, 2)])
def test_rounding_leaves_a_receiver(mnist, num_clients, new_clients_per_task):
    spec = ScenarioSpec(num_tasks=2, num_clients=num_clients, new_clients_per_task=new_clients_per_task,
                        old_only_fraction=0.95)  # round(0.95 x 2) = 2: every old client
    s = build_scenario(spec, mnist)
    kept = s.old_only_clients(1)
    receivers = np.setdiff1d(s.active_clients(1), kept)
    assert len(kept) == min(2, num_clients - 1) and len(receivers) >= 1
    flat = np.concatenate([s.client_indices(c, 1) for c in receivers])
    assert set(flat.tolist()) == set(np.flatnonzero(np.isin(s.train_labels, s.task_classes(1))).tolist())
