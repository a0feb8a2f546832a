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
``<method>/<name>`` for extras. ``ServerPart.summable`` says which prefixes are
sums over clients (secure aggregation and compression may wrap only those);
``ServerPart.individual_payload`` names the payload a server must see per client,
if any, so that combining it with secure aggregation can fail clearly.

A method may also open a *side channel* (``ServerPart.side_channels``, message
types of ``wire.messages.SIDE_CHANNEL_TYPES``): tensors a client puts in
``ClientContext.outbox`` travel as their own message next to the update,
bypass aggregation, and reach ``ServerPart.on_side_channel`` without the
sender's identity (GLFC's prototype gradients).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from torch import nn

from fcl_emu.methods.models.classifier import IncrementalClassifier
from fcl_emu.methods.models.state import delta_arrays, load_arrays, state_to_arrays
from fcl_emu.methods.optim import LocalSGD
from fcl_emu.methods.robust import MEAN, Aggregator

Arrays = dict[str, np.ndarray]

DELTA = "delta/"


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


@dataclass
class ClientUpdate:
    """One client's upload as the server part sees it."""

    client: str
    num_samples: int
    tensors: Mapping[str, np.ndarray]
    loss: float = float("nan")
    metrics: Mapping[str, float] = field(default_factory=dict)  # the method's own terms, as reported

    def delta(self) -> Arrays:
        return {k[len(DELTA):]: v for k, v in self.tensors.items() if k.startswith(DELTA)}


def fedavg(updates: list[ClientUpdate], aggregate: Aggregator = MEAN) -> Arrays:
    """The clients' deltas combined by ``aggregate`` (default: the sample-weighted mean, McMahan et al. 2017, eq.
    'w <- sum n_k/n w_k'; a robust rule of :mod:`fcl_emu.methods.robust` as the run configures it).

    Float tensors are combined in float64 and returned as float32; integer
    buffers (BatchNorm's step counter) take the largest value.
    """
    weighted = [u for u in updates if u.num_samples > 0]
    if not weighted:
        raise ValueError("no client update carries samples")
    deltas = [u.delta() for u in weighted]
    names = deltas[0].keys()
    for d, u in zip(deltas, weighted):
        if d.keys() != names:
            raise ValueError(f"client {u.client} uploaded delta keys that differ from the others")
    floats = [name for name in names if deltas[0][name].dtype.kind == "f"]
    out = aggregate([(u.num_samples, {name: d[name] for name in floats}) for d, u in zip(deltas, weighted)])
    for name in names - set(floats):
        out[name] = np.asarray(np.max(np.stack([d[name] for d in deltas]), axis=0))  # 0-d stays an array
    return out


def apply_fedavg(arrays: Mapping[str, np.ndarray], updates: list[ClientUpdate], prefix: str,
                 aggregate: Aggregator = MEAN) -> Arrays:
    """``arrays`` plus the clients' deltas uploaded under ``prefix`` combined by ``aggregate`` (:func:`fedavg`;
    a module that rides with the model, such as LANDER's projector or AF-FCL's flow), as read-only arrays."""
    delta = fedavg([ClientUpdate(u.client, u.num_samples,
                                 {DELTA + k: v for k, v in strip_prefix(u.tensors, prefix).items()})
                    for u in updates], aggregate)
    return _frozen_copy({k: v + delta[k] for k, v in arrays.items()}, copy=False)


@dataclass(frozen=True)
class DeltaLayout:
    """The model delta as one flat float vector: what secure aggregation sums.

    The float tensors of the model, in name order, each flattened. Integer
    buffers (BatchNorm's step counter) are not summable and stay out: under
    secure aggregation the server keeps its own value of them.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: Mapping[str, np.ndarray]) -> DeltaLayout:
        names = tuple(sorted(k for k, v in model.items() if v.dtype.kind == "f"))
        return cls(names, tuple(tuple(model[k].shape) for k in names))

    @property
    def dim(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def flatten(self, uploads: Mapping[str, np.ndarray]) -> np.ndarray:
        """The ``delta/<name>`` tensors of an upload as one float32 vector (ValueError if they do not fit)."""
        got = {k[len(DELTA):] for k in uploads if k.startswith(DELTA)} & set(self.names)
        if got != set(self.names):
            raise ValueError(f"the upload lacks the deltas of {sorted(set(self.names) - got)[:3]}")
        out = np.empty(self.dim, np.float32)
        at = 0
        for name, shape in zip(self.names, self.shapes):
            value = uploads[DELTA + name]
            if tuple(value.shape) != shape:
                raise ValueError(f"delta {name!r} has shape {list(value.shape)}, the model has {list(shape)}")
            out[at:at + value.size] = value.reshape(-1)
            at += value.size
        return out

    def unflatten(self, vector: np.ndarray) -> Arrays:
        """The inverse of :meth:`flatten`: ``{delta/<name>: float32 array}``."""
        if vector.shape != (self.dim,):
            raise ValueError(f"a vector of shape {vector.shape} does not fit a delta of {self.dim} values")
        out, at = {}, 0
        for name, shape in zip(self.names, self.shapes):
            size = math.prod(shape)
            out[DELTA + name] = vector[at:at + size].astype(np.float32).reshape(shape)
            at += size
        return out


@dataclass
class ServerContext:
    """What a server part may use: its options, the scenario, a model builder, and the GPU worker pool."""

    options: Options
    scenario: Any  # scenario.scenario.Scenario
    build_model: Any  # Callable[[int], IncrementalClassifier]: model with that many classes
    seed: int = 0
    # run_job(kind, inputs, options) -> coordinator.gpu_pool.Job (.outputs, .metrics): a server-side job
    # (methods/jobs.py) on the coordinator's GPU workers; raises if it failed after its retries
    run_job: Any = None
    model_name: str = "cnn"  # the concrete model (methods.models.classifier.BACKBONES): jobs rebuild it by name
    input_shape: tuple[int, int, int] = (1, 28, 28)  # (C, H, W) of the scenario's images
    rounds_per_task: int = 1
    aggregator: Aggregator = MEAN  # how deltas are combined (the run's security.aggregator, methods/robust.py)


class ServerPart:
    """Coordinator side. Holds the global model as immutable numpy arrays."""

    summable: ClassVar[tuple[str, ...]] = (DELTA,)
    individual_payload: ClassVar[str | None] = None
    side_channels: ClassVar[tuple[str, ...]] = ()  # side-channel message types this method accepts
    needs_batchnorm: ClassVar[bool] = False  # the model must have BatchNorm layers (data-free synthesis)
    small_model: ClassVar[str] = "cnn"  # what model "auto" is for small images (methods.models.classifier)

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.options = ctx.options
        self.model = ctx.build_model(0 if ctx.scenario is None else len(ctx.scenario.task_classes(0)))
        self.global_state: Arrays = _frozen_copy(state_to_arrays(self.model))

    # --- task life cycle -------------------------------------------------
    def start_task(self, task: int) -> None:
        """Grow the head to the classes seen so far."""
        self.model.expand(len(self.ctx.scenario.seen_classes(task)))
        self.global_state = _frozen_copy(state_to_arrays(self.model))

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
        self.global_state = _frozen_copy(new, copy=False)
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
        self.global_state = _frozen_copy(state_to_arrays(self.model))

    def load_state_meta(self, meta: Mapping[str, Any]) -> None:
        """Restore :meth:`state_meta` (after :meth:`load_state_arrays`)."""
        if int(meta["num_classes"]) != self.model.num_classes:
            raise ValueError(f"checkpoint: the model head has {self.model.num_classes} classes, "
                             f"the state says {meta['num_classes']}")


def _frozen_copy(arrays: Mapping[str, np.ndarray], copy: bool = True) -> Arrays:
    """Read-only arrays: sent zero-copy, so they must never change after sending."""
    out = {}
    for k, v in arrays.items():
        a = np.array(v, copy=True) if copy else v
        a.flags.writeable = False
        out[k] = a
    return out


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
    store: Any  # edge_node.store.ArrayStore
    build_model: Any  # Callable[[int], IncrementalClassifier]
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
    cancelled: Any = lambda: False  # Callable[[], bool]: the coordinator cancelled this job (checked per batch)

    def frozen_model(self, arrays: Mapping[str, np.ndarray]) -> IncrementalClassifier:
        """A model in eval mode with these weights (method tensors ``<method>/...`` ignored) and no
        gradients (teachers)."""
        model = self.build_model(_head_size(arrays))
        load_arrays(model, model_arrays(arrays))
        model.to(self.device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model


def strip_prefix(arrays: Mapping[str, np.ndarray], prefix: str) -> Arrays:
    """The tensors whose names start with ``prefix``, under the rest of their names."""
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def model_arrays(arrays: Mapping[str, np.ndarray]) -> Arrays:
    """The classifier's own tensors of a received state: state-dict keys never hold a '/', method tensors
    that ride along (``<method>/...``, such as LANDER's projector) always do."""
    return {k: v for k, v in arrays.items() if "/" not in k}


def _head_size(arrays: Mapping[str, np.ndarray]) -> int:
    return int(arrays["head.weight"].shape[0]) if "head.weight" in arrays else 0


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

    def make_optimizer(self, ctx: ClientContext, model: nn.Module) -> LocalSGD:
        """SGD over the model's parameters."""
        s = ctx.settings
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
