"""FedLwF-2T: Learning without Forgetting with two teachers.

Usmanova, Portet, Lalanda and Vega, "A distillation-based approach integrating
continual learning and federated learning for pervasive services" (2021,
arXiv:2109.04197). Learning without Forgetting (Li & Hoiem, ECCV 2016 /
TPAMI 2018) on every client, with two teachers instead of one:

1. the *old* teacher, the model from a previous task (old-task knowledge);
2. the *server* teacher, the global model the client received this round
   (knowledge of the other clients).

Loss of one batch, with ``k`` the old teacher's class count::

    CE(z, y)                                   over all classes seen so far
    + alpha * KD_T(z[:, :k], z_old)            only the old classes' logits
    + beta  * KD_T(z, z_server)                all the seen classes

``KD_T(s, t) = T^2 * KL(softmax(t / T) || softmax(s / T))``, averaged over
the batch (:func:`kd_loss`). KL differs from LwF's soft cross-entropy
``-sum softmax(t/T) log softmax(s/T)`` only by the teacher's entropy, a
constant: the gradients are the same, and the term is 0 when the student
matches the teacher. The ``T^2`` factor is Hinton et al.'s (2015, section 2):
the soft targets' gradients scale as ``1/T^2``, so without it the weight of
the distillation against the cross-entropy would change with ``T``. LwF's own
loss has no ``T^2``: its ``lambda_o = 1`` at ``T = 2`` is ``alpha = 0.25`` here.

Defaults and their sources:

- ``temperature = 2``: LwF's temperature (Li & Hoiem, section 3).
- ``alpha = beta = 1``: LwF's loss-balance weight ``lambda_o = 1``, applied to
  both teachers. The weights FedLwF-2T itself used could not be checked here
  (only the paper's abstract and introduction were at hand), so these are
  LwF's, not the paper's. Tune them per dataset.
- ``old_teacher = "local"``: the client's own model at the end of its last
  training job in an earlier task, kept in its disk-backed store
  (``fedlwf2t.last`` after every job; promoted to ``fedlwf2t.old`` when the
  client starts a later task): the paper's first teacher, the client's own
previous model.
  ``"global"`` instead uses the previous task's final global model, which
  the server sends once per task as the assets ``fedlwf2t/old/<param>``
  (one more model per client and task on the wire, no client storage).

Behaviour worth knowing:

- A client with no earlier model (its first task, or a client that joins in
  a later task with ``old_teacher = "local"``) trains with the server
  teacher only. A client that skipped tasks uses the last model it has,
  whose head may cover fewer classes than the previous task's.
- At the first local step the student *is* the server teacher, so the
  server term starts at 0 and grows as the client drifts: it works like
  FedProx's proximal term, measured on the outputs instead of the weights.
- Teachers run in eval mode (BatchNorm with running statistics) under
  ``torch.no_grad()``; they are rebuilt for each training job from the
  store / the received arrays and dropped afterwards, so an idle client
  holds no model in memory.
- Data: distillation runs on the current task's data only (no exemplars),
  as in LwF; the paper's experiments are on human activity recognition,
  this project's on image classification.
- Deviation to note: the paper's alpha / beta are not reproduced (see the
  defaults above).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
import pydantic
import torch
import torch.nn.functional as F

from fcl_emu.aggregation.update import Arrays
from fcl_emu.methods.base import ClientContext, ClientPart, Options, ServerPart
from fcl_emu.methods.models.state import read_only, strip_prefix
from fcl_emu.methods.models.state import state_to_arrays
from fcl_emu.methods.registry import MethodSpec, register

NAME = "fedlwf2t"
OLD_ASSET = f"{NAME}/old/"  # prefix of the previous task's global model in the task assets
LAST = f"{NAME}.last"  # store: the client's model after its latest training job
OLD = f"{NAME}.old"  # store: the old teacher of the client's current task
TASK_KEY = "__task__"  # the task a stored model was trained in (int64 scalar)
OLD_STATE = f"{NAME}/old_global/"  # checkpoint: the previous task's final global model


class FedLwF2TOptions(Options):
    alpha: float = pydantic.Field(1.0, ge=0.0, description="weight of the old-model (previous task) distillation")
    beta: float = pydantic.Field(1.0, ge=0.0, description="weight of the server-model distillation")
    temperature: float = pydantic.Field(2.0, gt=0.0, description="distillation temperature T (LwF: 2)")
    old_teacher: Literal["local", "global"] = pydantic.Field(
        "local", description="old-task teacher: the client's own last model of an earlier task ('local') "
                             "or the previous task's global model sent by the server ('global')")


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher/T) || softmax(student/T))``, mean over the batch.

    ``student`` and ``teacher`` are logits of the same shape ``(B, C)``; an
    empty batch or ``C = 0`` gives 0.
    """
    if student.shape != teacher.shape:
        raise ValueError(f"student logits {tuple(student.shape)} and teacher logits {tuple(teacher.shape)} differ")
    if student.numel() == 0:
        return student.sum() * 0.0
    t = temperature
    log_p_student = F.log_softmax(student / t, dim=1)
    log_p_teacher = F.log_softmax(teacher / t, dim=1)
    kl = F.kl_div(log_p_student, log_p_teacher, reduction="batchmean", log_target=True)
    return kl * (t * t)



def _stored_task(arrays: Mapping[str, np.ndarray] | None) -> int | None:
    if arrays is None or TASK_KEY not in arrays:
        return None
    return int(np.asarray(arrays[TASK_KEY]).reshape(()))


def _model_arrays(arrays: Mapping[str, np.ndarray]) -> Arrays:
    return {k: v for k, v in arrays.items() if k != TASK_KEY}


class FedLwF2TServer(ServerPart):
    """FedAvg aggregation; with ``old_teacher = "global"`` also sends the previous task's global model."""

    options: FedLwF2TOptions

    def __init__(self, ctx):
        super().__init__(ctx)
        self._old_global: Arrays | None = None  # final global state of the last finished task
        self._assets: dict[int, Arrays] = {}

    def end_task(self, task: int) -> None:
        super().end_task(task)
        # global_state is read-only and replaced (never mutated) by aggregate: keeping the reference is safe.
        self._old_global = self.global_state
        self._assets.clear()

    def task_assets(self, task: int) -> dict[str, Arrays]:
        if self.options.old_teacher != "global" or task == 0 or self._old_global is None:
            return {}
        if task not in self._assets:  # called once per round while clients still lack the assets
            self._assets = {task: {OLD_ASSET + k: v for k, v in self._old_global.items()}}
        return {"old_model": self._assets[task]}

    def state_arrays(self) -> Arrays:
        """The global model, and the previous task's final one where it is sent (``old_teacher = "global"``)."""
        arrays = super().state_arrays()
        if self._old_global is not None and self.options.old_teacher == "global":
            arrays.update({OLD_STATE + k: v for k, v in self._old_global.items()})
        return arrays

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        super().load_state_arrays(arrays)
        old = strip_prefix(arrays, OLD_STATE)
        self._old_global = read_only(old) if old else None
        self._assets = {}  # rebuilt from _old_global on first use


class FedLwF2TClient(ClientPart):
    keeps_state = True  # its store outlives the job
    options: FedLwF2TOptions

    @classmethod
    def work_per_sample(cls, options, batch_size: int, task: int) -> float:
        """A plain step and the teachers' forward passes (1/3 of a step each): the server teacher always, the old one
        from task 1."""
        return 1.0 + (2.0 if task > 0 else 1.0) / 3.0

    # --- task life cycle --------------------------------------------------------
    def start_task(self, ctx: ClientContext) -> None:
        """With a local old teacher: the last model of an earlier task becomes this task's teacher."""
        if self.options.old_teacher != "local":
            return
        last = ctx.store.load(LAST)
        task = _stored_task(last)
        if task is not None and task < ctx.task:
            ctx.store.save(OLD, last)

    def _old_teacher_arrays(self, ctx: ClientContext) -> Arrays | None:
        if self.options.old_teacher == "global":
            arrays = strip_prefix(ctx.assets, OLD_ASSET)
            return arrays or None
        stored = ctx.store.load(OLD)
        task = _stored_task(stored)
        if task is None or task >= ctx.task:
            return None
        return _model_arrays(stored)

    # --- one training job -------------------------------------------------------
    def begin_job(self, ctx: ClientContext, model) -> None:
        """Build the teachers (after start_task, which may have promoted the old one)."""
        o = self.options
        old_arrays = self._old_teacher_arrays(ctx) if o.alpha > 0 else None
        old = ctx.frozen_model(old_arrays) if old_arrays is not None else None
        if old is not None and old.num_classes > model.num_classes:
            raise ValueError(f"old teacher has {old.num_classes} classes, the student only {model.num_classes}")
        server = ctx.frozen_model(ctx.global_state) if o.beta > 0 else None
        ctx.job.update(old=old, server=server, kd_old=0.0, kd_server=0.0, steps=0)

    def loss(self, ctx, model, x, y, logits):
        o = self.options
        job = ctx.job
        job["steps"] += 1
        loss = F.cross_entropy(logits, y)
        if job["old"] is not None:
            with torch.no_grad():
                old_logits = job["old"](x)
            term = kd_loss(logits[:, :old_logits.shape[1]], old_logits, o.temperature)
            job["kd_old"] += float(term.detach())
            loss = loss + o.alpha * term
        if job["server"] is not None:
            with torch.no_grad():
                server_logits = job["server"](x)
            term = kd_loss(logits, server_logits, o.temperature)
            job["kd_server"] += float(term.detach())
            loss = loss + o.beta * term
        return loss

    def after_training(self, ctx: ClientContext, model) -> Arrays:
        job = ctx.job
        steps = max(job["steps"], 1)
        ctx.metrics.update(kd_old=job["kd_old"] / steps, kd_server=job["kd_server"] / steps,
                           old_teacher_classes=float(0 if job["old"] is None else job["old"].num_classes))
        if self.options.old_teacher == "local":
            arrays = dict(state_to_arrays(model))  # the store writes them out (a copy) at once
            arrays[TASK_KEY] = np.asarray(ctx.task, dtype=np.int64)
            ctx.store.save(LAST, arrays)
        return {}


SPEC = register(MethodSpec(
    name=NAME,
    description="FedLwF-2T: LwF distillation from two teachers, the old-task model and the server model",
    options=FedLwF2TOptions,
    server=FedLwF2TServer,
    client=FedLwF2TClient,
))
