"""The method interface: a server part (coordinator) and a client part (edge).

A method is registered by name (see :mod:`fcl_emu.methods.registry`) with

- an ``Options`` pydantic model (its hyper-parameters, validated before a run
  starts and sent to edge nodes as a plain dict),
- a :class:`ServerPart`: what to send once per task (assets), what to send
  each round (by default the global model), how to aggregate (by default
  sample-weighted FedAvg of deltas), what to do at the end of a task, which
  model to evaluate;
- a :class:`ClientPart`: what to do when a client starts a task, the loss of
  one batch, and what to upload besides the delta.

Upload tensors are named ``delta/<param>`` for the model delta and
``<method>/<name>`` for extras (:mod:`fcl_emu.aggregation.update`: the update as the
server sees it). What methods share beyond this contract lives where they import it
from: combining updates in :mod:`fcl_emu.aggregation.combine`, state arrays in
:mod:`fcl_emu.methods.models.state`, models in :mod:`fcl_emu.methods.models`.

``ServerPart.summable`` says which prefixes are sums over clients (secure
aggregation and compression may wrap only those);
``ServerPart.individual_payload`` names the payload a server must see per client,
if any, so that combining it with secure aggregation can fail clearly.

A method may also open a *side channel* (``ServerPart.side_channels``, message
types of ``wire.messages.SIDE_CHANNEL_TYPES``): tensors a client puts in
``ClientContext.outbox`` travel as their own message next to the update,
bypass aggregation, and reach ``ServerPart.on_side_channel`` without the
sender's identity (GLFC's prototype gradients).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from torch import nn

from fcl_emu.aggregation.combine import fedavg
from fcl_emu.aggregation.rules import MEAN, Aggregator
from fcl_emu.aggregation.update import DELTA, Arrays, ClientUpdate
from fcl_emu.methods.models.classifier import IncrementalClassifier
from fcl_emu.methods.models.state import (delta_arrays, head_size, load_arrays, model_arrays, read_only,
                                          state_to_arrays)
from fcl_emu.methods.optim import LocalSGD

if TYPE_CHECKING:
    from fcl_emu.scenario.scenario import Scenario


class Options(pydantic.BaseModel):
    """Base of every method's options: unknown keys are an error."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class TrainingSettings:
    """Local-training hyper-parameters shared by all methods.

    Built from the run config's ``training`` section (where the defaults live)
    as the ``welcome`` message carries it.
    """

    local_epochs: int
    lr: float
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    optimizer: str = "sgd"  # or "adam"


class JobRun(Protocol):
    """What a server-side job comes back as (the coordinator's ``gpu_pool.Job``): its output tensors and metrics."""

    outputs: dict[str, np.ndarray]
    metrics: dict[str, float]


class RunJob(Protocol):
    def __call__(self, kind: str, inputs: dict[str, np.ndarray], options: dict | None = None) -> JobRun:
        """Run a job of ``kind`` (methods/jobs.py) on the coordinator's GPU workers and wait for it; raises if it
        failed after its retries."""


class ClientStore(Protocol):
    """A client's persistent large arrays (the edge node's ``store.ArrayStore``: disk-backed, like a device's
    flash)."""

    def save(self, name: str, arrays: Mapping[str, np.ndarray]) -> None: ...

    def load(self, name: str) -> dict[str, np.ndarray] | None: ...


BuildModel = Callable[[int], IncrementalClassifier]  # a model of the run with that many classes


@dataclass
class ServerContext:
    """What a server part may use: its options, the scenario, a model builder, and the GPU worker pool."""

    options: Options
    scenario: Scenario | None  # None: a server part built without a scenario (tools, tests)
    build_model: BuildModel
    seed: int = 0
    run_job: RunJob | None = None  # server-side jobs (methods/jobs.py) on the coordinator's GPU workers
    model_name: str = "cnn"  # the concrete model (methods.models.classifier.BACKBONES): jobs rebuild it by name
    input_shape: tuple[int, int, int] = (1, 28, 28)  # (C, H, W) of the scenario's images
    rounds_per_task: int = 1
    aggregator: Aggregator = MEAN  # how deltas are combined (the run's aggregation.rule, aggregation/rules/)
    # uploads a method uses one by one (side channels, VAEs) beyond this multiple of their round's median norm are
    # refused (the run's aggregation.adaptive_clip; None: no bound): aggregation.clipping.beyond_cohort
    cohort_bound: float | None = None
    # the coordinator's count of such a refusal (a cohort_bound rejection, logged once), given what was refused
    refused: Callable[[str], None] = lambda detail: None


class ServerPart:
    """Coordinator side. Holds the global model as immutable numpy arrays."""

    summable: ClassVar[tuple[str, ...]] = (DELTA,)
    individual_payload: ClassVar[str | None] = None
    side_channels: ClassVar[tuple[str, ...]] = ()  # side-channel message types this method accepts
    needs_batchnorm: ClassVar[bool] = False  # the model must have BatchNorm layers (data-free synthesis)
    small_model: ClassVar[str] = "cnn"  # what model "auto" is for small images (methods.models.classifier)
    large_model: ClassVar[str] = "cnn_bn"  # and for larger (colour) images
    # why a server optimiser's step (taken after aggregate) would break this method, if it would
    server_step_refusal: ClassVar[str | None] = None

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.options = ctx.options
        self.model = ctx.build_model(0 if ctx.scenario is None else len(ctx.scenario.task_classes(0)))
        self.global_state: Arrays = read_only(state_to_arrays(self.model))

    # --- task life cycle -------------------------------------------------
    def start_task(self, task: int) -> None:
        """Grow the head to the classes seen so far."""
        self.model.expand(len(self.ctx.scenario.seen_classes(task)))
        self.global_state = read_only(state_to_arrays(self.model))

    def task_assets(self, task: int) -> dict[str, Arrays]:
        """Tensors every participant receives once per task, by asset kind (a message type of
        ``wire.messages.ASSET_TYPES``: ``old_model``, ``generator``, ``synthetic_data``, ``label_text``).
        Tensor names are ``<method>/<...>``; a client sees all kinds merged in ``ClientContext.assets``.
        Called each round while a selected client lacks them: return the same arrays (default: none)."""
        return {}

    def end_task(self, task: int) -> None:
        """Hook after a task's last round (default: nothing)."""

    # --- rounds ------------------------------------------------------------
    def learning_rate(self, task: int, task_round: int, base: float) -> float:
        """The clients' learning rate in round ``task_round`` (0-based) of ``task``; ``base`` is the run's
        ``training.lr`` (default: constant)."""
        return base

    def round_tensors(self, task: int, round: int) -> Arrays:
        """Tensors sent with each train request (default: the global model)."""
        return self.global_state

    def aggregate(self, task: int, round: int, updates: list[ClientUpdate]) -> None:
        """Default: w <- w + FedAvg(deltas), or the run's robust rule (``ctx.aggregator``)."""
        delta = fedavg(updates, self.ctx.aggregator)
        new = {}
        for name, value in self.global_state.items():
            d = delta.get(name)
            if d is None:
                new[name] = value
            elif value.dtype.kind == "f":
                new[name] = value + d
            else:
                new[name] = d
        self.global_state = read_only(new, copy=False)
        load_arrays(self.model, self.global_state)

    def parameter_names(self) -> frozenset[str]:
        """The global model's trainable parameters (state-dict keys; not BatchNorm statistics or counters): what a
        server optimiser steps (:mod:`fcl_emu.aggregation.server_optimizers`)."""
        return frozenset(name for name, _ in self.model.named_parameters())

    def set_global_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Replace the global model by ``arrays`` (same keys and shapes): a server optimiser's step."""
        self.global_state = read_only(arrays, copy=False)
        load_arrays(self.model, self.global_state)

    def check_update(self, task: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Check a received update's method tensors before it joins the round (the engine has checked the
        ``delta/`` tensors against the global model): raise ValueError naming what does not fit, and the
        update is rejected as ``bad_shape`` (counted, logged; the client counts as failed). Default: nothing
        more to check."""

    def on_side_channel(self, task: int, kind: str, tensors: Mapping[str, np.ndarray]) -> None:
        """A side-channel message of ``kind`` from a client of the open round of ``task``; the sender is not
        named. Raise ValueError for tensors that do not fit (the message is then rejected as ``bad_shape``)."""
        raise ValueError(f"method takes no {kind!r} messages")

    def eval_model(self) -> nn.Module:
        """The model whose logits are evaluated (default: the global classifier)."""
        return self.model

    @property
    def accepts_stale_updates(self) -> bool:
        """Whether an update trained from an older global model of the same task may be aggregated in a later
        round (``rounds.late_updates: next_round``, FedBuff-style): true when the only upload is the delta."""
        return self.summable == (DELTA,) and self.individual_payload is None

    # --- persistence (checkpoints) -------------------------------------------
    # A server part built afresh from the same context and given back what these
    # returned (load_state_arrays, then load_state_meta) behaves exactly like the
    # one that returned them. Subclasses that hold more extend all four.
    def state_arrays(self) -> Arrays:
        """The arrays to checkpoint: the global model under its state-dict keys (never with a '/');
        subclasses add their own under ``<method>/...``."""
        return dict(self.global_state)

    def state_meta(self) -> dict[str, Any]:
        """The non-array state to checkpoint, JSON-serialisable (default: the head size)."""
        return {"num_classes": int(self.model.num_classes)}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_arrays`; the head grows to the saved size (torch's RNG is not touched)."""
        load_arrays(self.model, {k: v for k, v in arrays.items() if "/" not in k})
        self.global_state = read_only(state_to_arrays(self.model))

    def load_state_meta(self, meta: Mapping[str, Any]) -> None:
        """Restore :meth:`state_meta` (after :meth:`load_state_arrays`)."""
        if int(meta["num_classes"]) != self.model.num_classes:
            raise ValueError(f"checkpoint: the model head has {self.model.num_classes} classes, "
                             f"the state says {meta['num_classes']}")


@dataclass
class ClientContext:
    """Everything one local-training job of one client can see.

    ``state`` is the client's own persistent state across rounds and tasks
    (small values); ``store`` its persistent large arrays (disk-backed on the
    node, like a device's flash); ``assets`` the per-task tensors it received.
    """

    client: str
    task: int
    task_classes: np.ndarray
    seen_classes: np.ndarray
    x: torch.Tensor
    y: torch.Tensor
    settings: TrainingSettings
    global_state: Mapping[str, np.ndarray]
    assets: Mapping[str, np.ndarray]
    state: dict[str, Any]
    store: ClientStore
    build_model: BuildModel
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mean: tuple[float, ...] = (0.0,)  # the data set's per-channel normalisation (x is already normalised)
    std: tuple[float, ...] = (1.0,)
    seed: int = 0
    dataset_classes: int = 0  # classes of the whole data set (a label space fixed before any task)
    new_task: bool = False  # first job of this client in this task
    job: dict[str, Any] = field(default_factory=dict)  # scratch state of this job (teachers, anchors, sums)
    metrics: dict[str, float] = field(default_factory=dict)  # method metrics of this job, reported upstream
    # side-channel messages of this job, by kind (ServerPart.side_channels): {kind: (items, tensors)}
    outbox: dict[str, tuple[int, Arrays]] = field(default_factory=dict)
    cancelled: Callable[[], bool] = lambda: False  # the coordinator cancelled this job (checked per batch)

    def frozen_model(self, arrays: Mapping[str, np.ndarray]) -> IncrementalClassifier:
        """A model in eval mode with these weights (method tensors ``<method>/...`` ignored) and no
        gradients (teachers)."""
        model = self.build_model(head_size(arrays))
        load_arrays(model, model_arrays(arrays))
        model.to(self.device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model


class TrainingCancelled(Exception):
    """The coordinator cancelled the job (a ``cancel`` message): its update could no longer count."""


class ClientPart:
    """Edge side. One instance per edge node; per-client state lives in the context.

    ``keeps_state``: a job leaves something behind for the client's later jobs (``ctx.store``, ``ctx.state``).
    The coordinator never cancels such a method's late jobs: a later job would see another state."""

    keeps_state: ClassVar[bool] = False

    def __init__(self, options: Options):
        self.options = options

    def start_task(self, ctx: ClientContext) -> None:
        """Called before the first training job of a client in a task."""

    def begin_job(self, ctx: ClientContext, model: IncrementalClassifier) -> None:
        """Called before the first batch of every job: put per-job state (teachers, anchors) in ``ctx.job``.
        A method that replays stored samples (exemplars) may extend ``ctx.x`` / ``ctx.y`` here."""

    def step_loss(self, ctx: ClientContext, model: IncrementalClassifier, x: torch.Tensor,
                  y: torch.Tensor) -> torch.Tensor:
        """Loss of one local step on the real batch ``(x, y)`` (default: :meth:`loss` of ``model(x)``).
        Methods that add other data to the step (synthetic replay) override this."""
        return self.loss(ctx, model, x, y, model(x))

    def loss(self, ctx: ClientContext, model: IncrementalClassifier, x: torch.Tensor, y: torch.Tensor,
             logits: torch.Tensor) -> torch.Tensor:
        """Loss of one batch (default: cross-entropy over all seen classes)."""
        return F.cross_entropy(logits, y)

    def after_training(self, ctx: ClientContext, model: IncrementalClassifier) -> Arrays:
        """Extra tensors to upload, and the place to update client state (default: none)."""
        return {}

    @classmethod
    def work_per_sample(cls, options: Options, batch_size: int, task: int) -> float:
        """The client's work per real sample it trains in ``task``, in plain training steps (a forward and
        backward pass of the model on one sample; 1 here). Methods that add forward passes (teachers) or
        synthetic batches say what they add; per-job extras that do not grow with the samples are left out.
        What the emulated clock turns into compute time and energy (:mod:`fcl_emu.methods.models.flops`)."""
        return 1.0

    def make_optimizer(self, ctx: ClientContext, model: nn.Module) -> LocalSGD | torch.optim.Adam:
        """The run's optimiser over the model's parameters: SGD, or Adam (torch's betas 0.9/0.999, no state
        kept from an earlier round)."""
        s = ctx.settings
        if s.optimizer == "adam":
            return torch.optim.Adam(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
        return LocalSGD(model.parameters(), lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay)

    def train(self, ctx: ClientContext, model: IncrementalClassifier | None) -> tuple[Arrays, dict[str, float]]:
        """One round of local training; returns the upload tensors and metrics."""
        if ctx.new_task:
            self.start_task(ctx)
        model.to(ctx.device).train()
        self.begin_job(ctx, model)
        opt = self.make_optimizer(ctx, model)
        gen = torch.Generator().manual_seed(ctx.seed)
        n = len(ctx.y)
        total, batches = 0.0, 0
        start = time.perf_counter()
        for _ in range(ctx.settings.local_epochs):
            order = torch.randperm(n, generator=gen)
            for i in range(0, n, ctx.settings.batch_size):
                if ctx.cancelled():
                    raise TrainingCancelled(ctx.client)
                idx = order[i:i + ctx.settings.batch_size]
                x, y = ctx.x[idx].to(ctx.device), ctx.y[idx].to(ctx.device)
                loss = self.step_loss(ctx, model, x, y)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"client {ctx.client}: loss became {loss.item()}")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach())
                batches += 1
        model.eval()
        extras = self.after_training(ctx, model)
        new = state_to_arrays(model.cpu())
        uploads = {DELTA + k: v for k, v in delta_arrays(new, model_arrays(ctx.global_state)).items()}
        uploads.update(extras)
        metrics = {**ctx.metrics, "loss": total / max(batches, 1), "train_time_s": time.perf_counter() - start}
        return uploads, metrics
