"""ScenarioSpec: defaults, round trip, and a clear ValidationError for every bad value."""

from __future__ import annotations

import pydantic
import pytest

from fcl_emu.scenario.spec import ScenarioSpec


def test_defaults():
    spec = ScenarioSpec()
    assert (spec.dataset, spec.num_tasks, spec.num_clients, spec.partition) == ("mnist", 5, 300, "iid")
    assert spec.initial_clients == 300 and spec.classes_first_task is None and spec.seed == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {
            "dataset": "cifar100",
            "num_tasks": 6,
            "classes_first_task": 50,
            "partition": "dirichlet",
            "dirichlet_beta": 0.1,
        },
        {"num_clients": 50, "new_clients_per_task": 10, "partition": "class_fraction", "class_fraction": 0.5},
        {"partition": "task_pool", "task_pool_size": 10, "samples_per_client_task": 100, "seed": 7},
        {"partition": "private_classes", "private_fraction": 1.0, "shuffle_classes": False},
    ],
)
def test_round_trip_as_plain_dict(kwargs):
    spec = ScenarioSpec(**kwargs)
    plain = spec.model_dump()
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in plain.values())
    assert ScenarioSpec(**plain) == spec
    assert ScenarioSpec.model_validate_json(spec.model_dump_json()) == spec


def test_frozen():
    spec = ScenarioSpec()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.num_tasks = 3


def test_derived_sizes():
    spec = ScenarioSpec(num_clients=100, new_clients_per_task=10, num_tasks=5)
    assert spec.initial_clients == 60
    assert ScenarioSpec(partition="task_pool").pool_size == 5


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dataset": "svhn"}, "dataset"),
        ({"num_tasks": 0}, "num_tasks"),
        ({"num_tasks": 11}, "num_tasks"),
        ({"classes_first_task": 0}, "classes_first_task"),
        ({"classes_first_task": 7}, "classes_first_task"),  # leaves 3 classes for 4 later tasks
        ({"num_tasks": 1, "classes_first_task": 5}, "classes_first_task"),
        ({"num_clients": 0}, "num_clients"),
        ({"new_clients_per_task": -1}, "new_clients_per_task"),
        ({"num_clients": 8, "new_clients_per_task": 2}, "new_clients_per_task"),
        ({"partition": "shards"}, "partition"),
        ({"dirichlet_beta": 0}, "dirichlet_beta"),
        ({"dirichlet_beta": float("inf")}, "dirichlet_beta"),
        ({"class_fraction": 0}, "class_fraction"),
        ({"class_fraction": 1.5}, "class_fraction"),
        ({"private_fraction": -0.1}, "private_fraction"),
        ({"private_fraction": 1.1}, "private_fraction"),
        ({"partition": "task_pool", "task_pool_size": 3}, "task_pool_size"),
        ({"partition": "task_pool", "task_pool_size": 11}, "task_pool_size"),
        ({"task_pool_size": 10}, "task_pool_size"),
        ({"partition": "dirichlet", "samples_per_client_task": 10}, "samples_per_client_task"),
        ({"partition": "task_pool", "samples_per_client_task": 0}, "samples_per_client_task"),
        ({"partition": "task_pool", "classes_first_task": 2}, "classes_first_task"),
        ({"seed": -1}, "seed"),
        ({"num_tasks": "many"}, "num_tasks"),
        ({"shuffle": True}, "shuffle"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(pydantic.ValidationError) as info:
        ScenarioSpec(**kwargs)
    assert [e["loc"] for e in info.value.errors()] == [(field,)]
    assert field in str(info.value)


def test_class_count_depends_on_dataset():
    assert ScenarioSpec(dataset="cifar100", num_tasks=100).num_tasks == 100
    with pytest.raises(pydantic.ValidationError, match="exceeds the 26 classes of emnist-letters"):
        ScenarioSpec(dataset="emnist-letters", num_tasks=27)
