"""Data at large populations: fixed shares drawn with replacement across clients, the minimum-share rule, and the
line that says so in a run's summary."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pydantic
import pytest
from rich.console import Console

from fcl_emu.monitoring.results import Clients, RunSummary
from fcl_emu.runconfig.config import RunConfig, load_config
from fcl_emu.runconfig.errors import error_lines
from fcl_emu.scenario import partitions
from fcl_emu.scenario.datasets import DatasetNotFoundError, load_dataset, roots_from_env
from fcl_emu.scenario.scenario import OverlappingShares, build_scenario, overlapping_shares_text
from fcl_emu.scenario.spec import ScenarioSpec
from tests.test_scenario_build import REPO, digest, fake_dataset


def test_draws_that_fit_are_those_of_earlier_versions():
    """Pinned against the partitions of the version before shares could overlap."""
    labels, classes = np.repeat(np.arange(4), 5), np.arange(3)  # the task's samples: indices 0..14
    fixed = partitions.iid(labels, classes, 4, np.random.default_rng(7), per_client=3)
    assert fixed.tolist() == [[3, 6, 10], [1, 8, 13], [0, 4, 7], [2, 12, 14]]
    dealt = partitions.iid(labels, classes, 4, np.random.default_rng(7))
    assert [p.tolist() for p in dealt] == [[3, 6, 8, 10], [0, 1, 7, 13], [2, 4, 12, 14], [5, 9, 11]]
    ds = fake_dataset()  # 200 samples a task
    pinned = {
        "a59f542f50e84129": {"num_clients": 20},
        "8053066be6b35605": {"num_clients": 8, "samples_per_client_task": 25, "new_clients_per_task": 1},
        "b4e1eaa2afdb5311": {"num_clients": 8, "old_only_fraction": 0.3, "new_clients_per_task": 1,
                             "samples_per_client_task": 20},
    }
    for expected, kwargs in pinned.items():
        s = build_scenario(ScenarioSpec(**kwargs), ds)
        assert digest(s)[:16] == expected and s.overlapping_shares == ()


def test_shares_that_outnumber_the_samples_overlap_evenly():
    indices = np.arange(100, 200)
    parts = partitions.shares(indices, 30, 10, np.random.default_rng(0))
    assert parts.shape == (30, 10) and parts.dtype == np.int64
    assert all(len(np.unique(p)) == 10 and (np.diff(p) > 0).all() for p in parts)  # distinct, sorted
    assert np.isin(parts, indices).all()
    assert (np.bincount(parts.ravel() - 100, minlength=100) == 3).all()  # 300 = 3 shuffles of all 100
    assert (np.bincount(np.concatenate(parts[:10]) - 100, minlength=100) == 1).all()  # one shuffle: disjoint
    uneven = partitions.shares(indices, 7, 30, np.random.default_rng(0))  # 3 whole shares a shuffle
    held = np.bincount(uneven.ravel() - 100, minlength=100)
    assert uneven.shape == (7, 30) and held.sum() == 210 and held.max() <= 3
    assert all(len(np.unique(p)) == 30 for p in uneven)


def test_shares_are_seeded():
    indices = np.arange(50)
    a, b = (partitions.shares(indices, 40, 5, np.random.default_rng(3)) for _ in range(2))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, partitions.shares(indices, 40, 5, np.random.default_rng(4)))


def test_a_fixed_share_larger_than_the_task_is_refused():
    labels = np.repeat(np.arange(4), 25)
    with pytest.raises(ValueError, match=r"^samples_per_client_task=101 exceeds the task's 100 samples \(a client's "
                       r"samples are distinct\)$"):
        partitions.iid(labels, np.arange(4), 1, np.random.default_rng(0), per_client=101)


def test_the_minimum_share_rule():
    assert partitions.iid_share(12_000, 1_200, None, 10) is None  # an equal split gives everyone 10
    assert partitions.iid_share(12_000, 1_201, None, 10) == 10
    assert partitions.iid_share(12_000, 100_000, None, 0) is None  # the rule is off
    assert partitions.iid_share(12_000, 100_000, None, None) is None
    assert partitions.iid_share(12_000, 100_000, 3, 10) == 3  # a fixed share wins
    assert partitions.iid_share(5, 1, None, 10) is None  # one client holds all 5
    assert partitions.iid_share(5, 2, None, 10) == 5  # at most the task's samples


def test_a_population_past_the_minimum_share_trains_the_same_amount():
    ds = fake_dataset()  # 10 classes of 100 samples: 5 tasks of 200
    split = build_scenario(ScenarioSpec(num_clients=20), ds)
    assert [len(split.client_indices(c, 0)) for c in range(20)] == [10] * 20 and split.overlapping_shares == ()
    s = build_scenario(ScenarioSpec(num_clients=30), ds)
    for t in range(5):
        parts = [s.client_indices(c, t) for c in range(30)]
        assert all(len(np.unique(p)) == 10 for p in parts)
        assert np.isin(np.concatenate(parts), np.flatnonzero(np.isin(s.train_labels, s.task_classes(t)))).all()
    assert s.overlapping_shares == tuple(OverlappingShares(t, 10, 30, 200, True) for t in range(5))
    assert s.overlapping_shares[0].holders == 1.5
    assert digest(s) == digest(build_scenario(ScenarioSpec(num_clients=30), ds))
    off = build_scenario(ScenarioSpec(num_clients=30, min_samples_per_client_task=0), ds)
    assert sorted({len(off.client_indices(c, 0)) for c in range(30)}) == [6, 7] and off.overlapping_shares == ()
    fixed = build_scenario(ScenarioSpec(num_clients=30, samples_per_client_task=8), ds)
    assert fixed.overlapping_shares[0] == OverlappingShares(0, 8, 30, 200, False)


def test_the_minimum_share_is_validated_in_one_line():
    for value, words in ((-1, "must be at least 0 (got -1)"), (2.5, "must be a valid integer")):
        with pytest.raises(pydantic.ValidationError) as info:
            load_config(None, {"scenario": {"min_samples_per_client_task": value}})
        [line] = error_lines(info.value, RunConfig)
        assert line.startswith(f"scenario.min_samples_per_client_task: {words}")
    assert ScenarioSpec(min_samples_per_client_task=None).min_samples_per_client_task is None


def test_the_summary_says_when_clients_share_samples():
    assert overlapping_shares_text(()) is None
    shares = [OverlappingShares(t, 10, 100_000, 12_000, True) for t in range(5)]
    assert overlapping_shares_text(shares) == ("tasks 1-5: 10 samples per client (the minimum share), drawn with "
                                               "replacement, ~83 clients per sample")
    mixed = [OverlappingShares(0, 20, 30, 200, False), OverlappingShares(2, 20, 40, 200, False)]
    assert overlapping_shares_text(mixed) == "tasks 1, 3: 20 samples per client, drawn with replacement, ~3.0-4.0 " \
                                             "clients per sample"
    from fcl_emu.run import summary_table

    line = overlapping_shares_text(shares)
    summary = RunSummary(status="completed", method="fedavg", dataset="mnist", accuracy_matrix=[[90.0]],
                         bytes_total=0, rounds=1, wall_clock_s=1.0, clients=Clients(), overlapping_shares=line)
    assert RunSummary.from_dict(summary.to_dict()).overlapping_shares == line
    console = Console(record=True, width=300)
    console.print(summary_table(summary))
    [row] = [r for r in console.export_text().splitlines() if "clients sharing samples" in r]
    assert line in row
    plain = RunSummary.from_dict({**summary.to_dict(), "overlapping_shares": None})
    console.print(summary_table(plain))
    assert console.export_text().count("clients sharing samples") == 0  # export_text clears what it returned


def test_100000_clients_on_mnist_build_in_well_under_two_seconds():
    """Both the coordinator and every edge node build this: one task, every client the minimum share."""
    try:
        mnist = load_dataset("mnist", roots_from_env() or [REPO.parent / "shared" / "data"])
    except DatasetNotFoundError as e:
        pytest.skip(f"dataset 'mnist' is absent; looked at {', '.join(map(str, e.looked_at))}")
    tracemalloc.start()
    start = time.perf_counter()
    s = build_scenario(ScenarioSpec(num_tasks=1, num_clients=100_000), mnist)
    seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 2.0 and peak < 64e6  # about 0.15 s and 26 MB on the project's 2-core VM
    assert len(s.client_indices(99_999, 0)) == 10 and s.overlapping_shares[0].holders == 100_000 * 10 / 60_000
