"""The scenario specification: which world a run emulates.

A :class:`ScenarioSpec` is validated once on the coordinator and sent to edge
nodes as a plain dict (``spec.model_dump()``); ``ScenarioSpec(**d)`` rebuilds
the same spec there, and :func:`scenario.scenario.build_scenario` turns it
into the same partitions in every process.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from scenario.datasets import DATASETS, NUM_CLASSES

Partition = Literal["iid", "dirichlet", "class_fraction", "private_classes", "task_pool"]


class ScenarioSpec(BaseModel):
    """Dataset, class-incremental task stream, clients and how data is split among them.

    - ``num_tasks`` tasks; task 0 gets ``classes_first_task`` classes (``None``:
      classes are split evenly, earlier tasks taking one more when the split is
      uneven) and the remaining classes are split evenly over the later tasks.
    - ``num_clients`` clients in all; ``new_clients_per_task`` of them join at
      each later task boundary, so ``initial_clients`` are there from task 0.
    - ``partition`` splits each task's training samples among the task's
      active clients (see :mod:`scenario.partitions`):

      - ``iid``: uniformly at random, equal sizes;
      - ``dirichlet``: per class, Dirichlet(``dirichlet_beta``) shares over
        clients (smaller beta, more skew);
      - ``class_fraction``: GLFC's setting, each client holds a random
        ``class_fraction`` of the current task's classes (0.6 in GLFC);
      - ``private_classes``: FedCBC-style, a ``private_fraction`` of each
        task's classes belongs to a single client each, the rest is public and
        spread IID;
      - ``task_pool``: AF-FCL's limitless task pool; the classes form
        ``task_pool_size`` (default ``num_tasks``) pool tasks of equal size and
        every client works through its own random sequence of ``num_tasks``
        distinct pool tasks, with ``samples_per_client_task`` samples per task
        (default: the pool task's samples split among the clients on it).
    - ``old_only_fraction``: at each later task boundary, this fraction of the
      clients already there keep their previous data (only old classes) and
      the task's samples go to the others and the newly joined clients; GLFC's
      clients with only old classes (0.1 in its code). The default 0 gives
      every active client the new task's data. Not with ``task_pool``.
    - ``seed`` fixes the class order (shuffled unless ``shuffle_classes`` is
      false) and every partition.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dataset: str = "mnist"
    num_tasks: int = Field(5, ge=1)
    classes_first_task: int | None = Field(None, ge=1)
    num_clients: int = Field(300, ge=1)
    new_clients_per_task: int = Field(0, ge=0)
    partition: Partition = "iid"
    dirichlet_beta: float = Field(0.5, gt=0, allow_inf_nan=False)
    class_fraction: float = Field(0.6, gt=0, le=1)
    private_fraction: float = Field(0.5, ge=0, le=1)
    task_pool_size: int | None = Field(None, ge=1)
    samples_per_client_task: int | None = Field(None, ge=1)
    old_only_fraction: float = Field(0.0, ge=0, lt=1)
    shuffle_classes: bool = True
    seed: int = Field(0, ge=0)

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, name: str) -> str:
        if name not in DATASETS:
            raise ValueError(f"unknown dataset {name!r}; supported: {', '.join(DATASETS)}")
        return name

    @model_validator(mode="after")
    def _consistent(self) -> ScenarioSpec:
        classes, tasks = NUM_CLASSES[self.dataset], self.num_tasks
        if tasks > classes:
            self._fail("num_tasks", f"num_tasks={tasks} exceeds the {classes} classes of {self.dataset}")
        if self.classes_first_task is not None:
            if self.partition == "task_pool":
                self._fail("classes_first_task", "does not apply to partition='task_pool' (pool tasks are equal)")
            if tasks == 1 and self.classes_first_task != classes:
                self._fail("classes_first_task", f"must be {classes} (all classes) when num_tasks=1")
            if classes - self.classes_first_task < tasks - 1:
                self._fail(
                    "classes_first_task",
                    f"classes_first_task={self.classes_first_task} leaves {classes - self.classes_first_task} "
                    f"classes of {self.dataset} for the {tasks - 1} later tasks (num_tasks={tasks})",
                )
        if self.initial_clients < 1:
            self._fail(
                "new_clients_per_task",
                f"new_clients_per_task={self.new_clients_per_task} x {tasks - 1} later tasks leaves no "
                f"initial client out of num_clients={self.num_clients}",
            )
        if self.partition != "task_pool":
            for name in ("task_pool_size", "samples_per_client_task"):
                if getattr(self, name) is not None:
                    self._fail(name, f"applies only to partition='task_pool', not {self.partition!r}")
        elif self.old_only_fraction > 0:
            self._fail("old_only_fraction", "does not apply to partition='task_pool' (clients follow their own tasks)")
        elif not tasks <= self.pool_size <= classes:
            self._fail(
                "task_pool_size",
                f"task_pool_size={self.pool_size} must be between num_tasks={tasks} and the {classes} "
                f"classes of {self.dataset}",
            )
        return self

    def _fail(self, field: str, message: str) -> None:
        """Raise a ValidationError located at ``field`` (cross-field checks have no location otherwise)."""
        error = InitErrorDetails(
            type=PydanticCustomError("value_error", message), loc=(field,), input=getattr(self, field)
        )
        raise ValidationError.from_exception_data(type(self).__name__, [error])

    @property
    def initial_clients(self) -> int:
        """Clients present from task 0."""
        return self.num_clients - self.new_clients_per_task * (self.num_tasks - 1)

    @property
    def pool_size(self) -> int:
        """Number of pool tasks for ``partition='task_pool'``."""
        return self.task_pool_size or self.num_tasks
