"""The scenario specification: which world a run emulates.

A :class:`ScenarioSpec` is validated once on the coordinator and sent to edge
nodes as a plain dict (``spec.model_dump()``); ``ScenarioSpec(**d)`` rebuilds
the same spec there, and :func:`fcl_emu.scenario.scenario.build_scenario` turns it
into the same partitions in every process.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from fcl_emu.scenario.datasets import DATASETS, NUM_CLASSES

Partition = Literal["iid", "dirichlet", "class_fraction", "private_classes", "task_pool", "accessible_classes"]
_ACCESSIBLE_FIELDS = ("classes_per_client", "private_per_client", "classes_per_task")


class ScenarioSpec(BaseModel):
    """Dataset, class-incremental task stream, clients and how data is split among them.

    - ``num_tasks`` tasks; task 0 gets ``classes_first_task`` classes (``None``:
      classes are split evenly, earlier tasks taking one more when the split is
      uneven) and the remaining classes are split evenly over the later tasks.
    - ``num_clients`` clients in all; ``new_clients_per_task`` of them join at
      each later task boundary, so ``initial_clients`` are there from task 0.
    - ``partition`` splits each task's training samples among the task's
      active clients (see :mod:`fcl_emu.scenario.partitions`):

      - ``iid``: uniformly at random, equal sizes (with ``samples_per_client_task``:
        exactly that many per client and task, the rest unused); where equal
        sizes would leave a client fewer than ``min_samples_per_client_task``,
        each client gets that many instead; shares that outnumber the task's
        samples are drawn with replacement across clients (never within one);
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
        (default: the pool task's samples split among the clients on it);
      - ``accessible_classes``: FedCBC's protocol; client ``i`` owns
        ``private_per_client`` private classes and draws the rest of its
        ``classes_per_client`` accessible classes from the public ones (those
        nobody owns); at every task it works on ``classes_per_task`` of its
        accessible classes drawn afresh, so classes come back, each time with
        fresh samples (defaults 6, 2 and 3: the paper's MNIST protocol with 3
        clients). The evaluated task stream is, as for ``task_pool``, the
        classes in order of first use.
    - ``noisy_client_fraction``: that fraction of the clients (drawn once)
      train on random labels in their first ``noisy_tasks`` tasks: every
      sample's label is drawn uniformly from the classes of the client's data
      at that task (AF-FCL's noisy clients, its EMNIST-noisy study).
    - ``old_only_fraction``: at each later task boundary, this fraction of the
      clients already there keep their previous data (only old classes) and
      the task's samples go to the others and the newly joined clients; GLFC's
      clients with only old classes (0.1 in its code). The default 0 gives
      every active client the new task's data. Not with ``task_pool``.
    - ``class_subset``: the run uses only this many of the dataset's classes,
      drawn with the seed (every process draws the same) and relabelled
      ``0..N-1``; the images keep the whole dataset's normalisation. A
      50-class Tiny-ImageNet-32 in 5 tasks is a protocol the 2-core machine
      learns (docs/reproduction.md); ``None``: every class.
    - ``seed`` fixes the class subset, the class order (shuffled unless
      ``shuffle_classes`` is false) and every partition.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dataset: str = Field("mnist", description="dataset name")
    class_subset: int | None = Field(None, ge=2, description="use a seeded subset of this many of the dataset's "
                                     "classes, relabelled 0..N-1 (null: all)")
    num_tasks: int = Field(5, ge=1, description="number of class-incremental tasks")
    classes_first_task: int | None = Field(None, ge=1)
    num_clients: int = Field(300, ge=1, description="number of emulated clients")
    new_clients_per_task: int = Field(0, ge=0)
    partition: Partition = Field("iid", description="how each task's samples are split among its clients: iid, "
                                                    "dirichlet, class_fraction, private_classes, task_pool or "
                                                    "accessible_classes (their options: a --config YAML)")
    dirichlet_beta: float = Field(0.5, gt=0, allow_inf_nan=False,
                                  description="Dirichlet concentration of partition dirichlet (smaller: more skew)")
    class_fraction: float = Field(0.6, gt=0, le=1)
    private_fraction: float = Field(0.5, ge=0, le=1)
    task_pool_size: int | None = Field(None, ge=1)
    samples_per_client_task: int | None = Field(None, ge=1)
    min_samples_per_client_task: int | None = Field(
        10, ge=0, description="partition iid without samples_per_client_task: when an equal split of a task's "
        "samples would give a client fewer than this, every client of the task gets this many instead, drawn with "
        "replacement across clients, so a round trains as much at any population (0 or null: always split)")
    classes_per_client: int | None = Field(None, ge=1)
    private_per_client: int | None = Field(None, ge=0)
    classes_per_task: int | None = Field(None, ge=1)
    old_only_fraction: float = Field(0.0, ge=0, lt=1)
    noisy_client_fraction: float = Field(0.0, ge=0, le=1)
    noisy_tasks: int = Field(1, ge=1)
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
        if self.class_subset is not None and self.class_subset > NUM_CLASSES[self.dataset]:
            self._fail("class_subset", f"class_subset={self.class_subset} exceeds the {NUM_CLASSES[self.dataset]} "
                       f"classes of {self.dataset}")
        classes, tasks = self.num_classes, self.num_tasks
        if tasks > classes:
            self._fail("num_tasks", f"num_tasks={tasks} exceeds the {classes} classes of {self.dataset}")
        if self.classes_first_task is not None:
            if self.partition in ("task_pool", "accessible_classes"):
                self._fail("classes_first_task", f"does not apply to partition={self.partition!r} (clients follow "
                           "their own tasks)")
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
        if self.partition == "accessible_classes":
            self._check_accessible(classes)
        else:
            for name in _ACCESSIBLE_FIELDS:
                if getattr(self, name) is not None:
                    self._fail(name, f"applies only to partition='accessible_classes', not {self.partition!r}")
        if self.partition != "task_pool":
            if self.task_pool_size is not None:
                self._fail("task_pool_size", f"applies only to partition='task_pool', not {self.partition!r}")
            if self.samples_per_client_task is not None and self.partition != "iid":
                self._fail("samples_per_client_task",
                           f"applies only to partition='iid' or 'task_pool', not {self.partition!r}")
        elif self.old_only_fraction > 0:
            self._fail("old_only_fraction", "does not apply to partition='task_pool' (clients follow their own tasks)")
        elif not tasks <= self.pool_size <= classes:
            self._fail(
                "task_pool_size",
                f"task_pool_size={self.pool_size} must be between num_tasks={tasks} and the {classes} "
                f"classes of {self.dataset}",
            )
        return self

    def _check_accessible(self, classes: int) -> None:
        per_client, private, per_task = self.accessible
        if private > per_client:
            self._fail("private_per_client", f"private_per_client={private} exceeds classes_per_client={per_client}")
        if per_task > per_client:
            self._fail("classes_per_task", f"classes_per_task={per_task} exceeds classes_per_client={per_client}")
        public = classes - self.num_clients * private
        if public < per_client - private:
            self._fail(
                "private_per_client",
                f"{self.num_clients} clients x private_per_client={private} leave {max(public, 0)} public classes "
                f"of {self.dataset}'s {classes}, fewer than the {per_client - private} each client draws",
            )
        if self.old_only_fraction > 0:
            self._fail("old_only_fraction", "does not apply to partition='accessible_classes'")

    def _fail(self, field: str, message: str) -> None:
        """Raise a ValidationError located at ``field`` (cross-field checks have no location otherwise)."""
        error = InitErrorDetails(
            type=PydanticCustomError("value_error", message), loc=(field,), input=getattr(self, field)
        )
        raise ValidationError.from_exception_data(type(self).__name__, [error])

    @property
    def num_classes(self) -> int:
        """The classes the run uses: ``class_subset``, or all the dataset's."""
        return self.class_subset or NUM_CLASSES[self.dataset]

    @property
    def initial_clients(self) -> int:
        """Clients present from task 0."""
        return self.num_clients - self.new_clients_per_task * (self.num_tasks - 1)

    @property
    def accessible(self) -> tuple[int, int, int]:
        """``(classes_per_client, private_per_client, classes_per_task)`` of ``accessible_classes``, defaults
        filled in (6, 2, 3: FedCBC's MNIST protocol)."""
        defaults = (6, 2, 3)
        return tuple(d if v is None else v for v, d in zip((getattr(self, n) for n in _ACCESSIBLE_FIELDS), defaults))

    @property
    def pool_size(self) -> int:
        """Number of pool tasks for ``partition='task_pool'``."""
        return self.task_pool_size or self.num_tasks
