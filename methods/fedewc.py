"""FedEWC: Elastic Weight Consolidation on every client, FedAvg on the server.

Kirkpatrick et al., "Overcoming catastrophic forgetting in neural networks",
PNAS 2017, eq. 3::

    L(theta) = L_B(theta) + sum_i lambda/2 * F_i * (theta_i - theta*_A,i)^2

Each client adds the penalty to its cross-entropy in every task after the
first it took part in. ``F`` is the diagonal *empirical* Fisher of the
client's own data and ``theta*`` its own parameters after local training:

- After every training job the client computes, on up to ``fisher_samples``
  of the job's samples, ``F_i = mean_n (d/d theta_i log p(y_n | x_n))^2`` with
  per-sample gradients (``torch.func.vmap``) of the cross-entropy at the true
  label, in eval mode (BatchNorm with running statistics). It writes ``F``
  and ``theta*`` to its disk-backed store as ``fedewc.pending``. The client
  cannot know which of its jobs is its last in the task, and its old data
  is gone at the next task, so the estimate is refreshed after each job and
  the last one counts.
- When the client starts a later task, the pending estimate is merged into
  ``fedewc.consolidated``, the penalty used during that task. A client that
  joins late has no estimate and trains with plain cross-entropy.

Across tasks one penalty is kept (one Fisher, one anchor), as in online EWC
(Schwarz et al., ICML 2018) and the EWC of FACIL (Masana et al., TPAMI 2022):
the anchor is the latest ``theta*``, and the Fisher is the running average
``F <- fisher_alpha * F_old + (1 - fisher_alpha) * F_new`` (FACIL's default
``alpha = 0.5``). Kirkpatrick et al. keep one penalty per task; the running
average keeps the memory at two model-sized arrays and the penalty's scale
independent of the number of tasks, so one ``lam`` suits every task count.
The first estimate is taken as it is (FACIL starts from a zero Fisher and so
halves it). Head rows of classes that arrived after an estimate have no
Fisher: the penalty covers only the rows the estimate has, and in a merge
the rows only the new estimate has take its value.

Defaults and their sources:

- ``lam = 5000``: FACIL's default for EWC in class-incremental learning
  (empirical-Fisher values of a trained network are small: per-tensor means
  of 3e-5..1e-2 for the ``cnn`` model on MNIST, hence the large weight). Kirkpatrick et al.
  tuned lambda per experiment; tune it per dataset here too.
- ``stiffness_cap = 1``: a stability guard of this project, not of the paper.
  SGD with momentum ``m`` diverges on a quadratic of curvature ``h`` once
  ``lr * h > 2 (1 + m)``, and the penalty's curvature is ``lam * F_i``. With
  the ``cnn`` model trained on two MNIST classes the largest ``F_i`` were
  0.02-0.045 (head rows and backbone biases), so the default ``lr = 0.05``
  and ``lam = 5000`` give ``lr * lam * F_i`` up to about 11, far past 3.8:
  without a guard an emulated run (8 clients, 2 tasks) had every client's
  loss turn NaN in the first round of the second task, and so did a single
  client in isolation. So each ``lam * F_i`` is capped at
  ``stiffness_cap / lr`` (the learning rate of the run's training settings).
  A capped weight is still pulled back at the largest rate SGD can follow;
  the others get EWC's exact penalty. In the MNIST case 0.02 % of the weights
  were capped and training stayed finite. The metric
  ``ewc_capped_fraction`` reports the share; ``stiffness_cap = None`` is
  plain EWC.
- ``fisher_samples = 128``: a cap on the cost, paid after every job. Per-sample
  gradients cost about three times a batched pass: 128 samples take about
  0.35 s on one CPU core with the ``cnn`` model, against about 0.4 s for one
  local epoch over 600 samples. FACIL uses all samples; raise the cap for a
  less noisy estimate where time allows.
- ``fisher_alpha = 0.5``: FACIL's default.

Deviations: the Fisher is the empirical one (true labels) of each client's
data, not the model's expected Fisher (FACIL's default uses the predicted
class); ``theta*`` and ``F`` are the client's
own (its local model after its last job of a task), not the global model's;
one running-average penalty instead of one penalty per task; the stiffness
cap above; the penalty also covers the old rows of the growing head (FACIL's
multi-head setting excludes heads).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fcl_emu.aggregation.update import Arrays
from fcl_emu.methods.base import ClientContext, ClientPart, Options, ServerPart
from fcl_emu.methods.registry import MethodSpec, register

NAME = "fedewc"
PENDING = f"{NAME}.pending"  # store: Fisher and theta* after the client's latest job
CONSOLIDATED = f"{NAME}.consolidated"  # store: the penalty of the client's current task
TASK_KEY = "__task__"  # pending: task it was computed in; consolidated: newest task merged into it
FISHER, THETA = "fisher/", "theta/"
_GRAD_FLOATS = 1 << 25  # per-sample gradients held at once (128 MiB of float32)


class FedEWCOptions(Options):
    lam: float = pydantic.Field(5000.0, ge=0.0, description="lambda of EWC's penalty lambda/2 F (theta - theta*)^2")
    fisher_samples: int = pydantic.Field(128, ge=1, description="at most this many samples per Fisher estimate")
    fisher_alpha: float = pydantic.Field(0.5, ge=0.0, lt=1.0,
                                         description="weight of the old Fisher in the running average across tasks")
    stiffness_cap: float | None = pydantic.Field(
        1.0, gt=0.0, description="cap on lr * lam * F_i per weight, so that SGD stays stable on the penalty "
                                 "(None: plain EWC)")


def empirical_fisher(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Diagonal empirical Fisher: the mean over samples of the squared per-sample gradient of log p(y|x).

    The model is evaluated as it is (callers put it in eval mode); only
    parameters with ``requires_grad`` get an entry.
    """
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    if len(y) == 0:
        return fisher

    def sample_loss(p, xi, yi):
        out = functional_call(model, (p, frozen, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    n_params = sum(p.numel() for p in params.values())
    chunk = max(1, min(64, _GRAD_FLOATS // max(n_params, 1)))
    for i in range(0, len(y), chunk):
        grads = per_sample(params, x[i:i + chunk], y[i:i + chunk])
        for n, g in grads.items():
            fisher[n] += g.pow(2).sum(0)
    return {n: f / len(y) for n, f in fisher.items()}


def ewc_penalty(model: nn.Module, fisher: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor],
                lam: float) -> torch.Tensor:
    """``lam/2 * sum_i F_i (theta_i - theta*_i)^2`` over the parameters ``fisher`` names.

    A parameter larger than its Fisher (a head grown since) is compared on its
    leading rows only: the new classes' rows have no Fisher.
    """
    params = dict(model.named_parameters())
    total = None
    for name, f in fisher.items():
        p = params[name]
        if p.shape != f.shape:
            if p.shape[1:] != f.shape[1:] or p.shape[0] < f.shape[0]:
                raise ValueError(f"{name}: parameter {tuple(p.shape)} does not extend Fisher {tuple(f.shape)}")
            p = p[: f.shape[0]]
        term = (f * (p - anchor[name]).pow(2)).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros((), device=next(model.parameters()).device)
    return 0.5 * lam * total


def cap_fisher(fisher: Mapping[str, torch.Tensor], lam: float, lr: float,
               cap: float | None) -> tuple[dict[str, torch.Tensor], float]:
    """Each ``F_i`` limited so that ``lr * lam * F_i <= cap``; also the fraction of entries limited."""
    if cap is None or lam <= 0 or lr <= 0:
        return dict(fisher), 0.0
    limit = cap / (lr * lam)
    total = sum(f.numel() for f in fisher.values())
    capped = sum(int((f > limit).sum()) for f in fisher.values())
    return {n: f.clamp(max=limit) for n, f in fisher.items()}, capped / max(total, 1)


def merge_fisher(old: np.ndarray | None, new: np.ndarray, alpha: float) -> np.ndarray:
    """``alpha * old + (1 - alpha) * new`` where both have rows; ``new`` alone elsewhere."""
    new = np.asarray(new, dtype=np.float32)
    if old is None:
        return np.array(new, copy=True)
    old = np.asarray(old, dtype=np.float32)
    if old.shape == new.shape:
        return (alpha * old + (1 - alpha) * new).astype(np.float32)
    if old.ndim == 0 or old.shape[1:] != new.shape[1:] or old.shape[0] > new.shape[0]:
        raise ValueError(f"cannot merge a Fisher of shape {old.shape} into one of shape {new.shape}")
    out = np.array(new, copy=True)
    k = old.shape[0]
    out[:k] = alpha * old + (1 - alpha) * new[:k]
    return out


def _task_of(arrays: Mapping[str, np.ndarray] | None) -> int | None:
    if arrays is None or TASK_KEY not in arrays:
        return None
    return int(np.asarray(arrays[TASK_KEY]).reshape(()))


class FedEWCClient(ClientPart):
    keeps_state = True  # its store outlives the job
    options: FedEWCOptions

    def start_task(self, ctx: ClientContext) -> None:
        """Merge the estimate of the client's latest earlier task into its penalty (idempotent)."""
        pending = ctx.store.load(PENDING)
        p_task = _task_of(pending)
        if p_task is None or p_task >= ctx.task:
            return
        consolidated = ctx.store.load(CONSOLIDATED)
        c_task = _task_of(consolidated)
        if c_task is not None and c_task >= p_task:
            return  # already merged (a job of this task failed and start_task runs again)
        merged: Arrays = {TASK_KEY: np.asarray(p_task, dtype=np.int64)}
        for key, value in pending.items():
            if key.startswith(THETA):
                merged[key] = value
            elif key.startswith(FISHER):
                old = consolidated.get(key) if consolidated is not None else None
                merged[key] = merge_fisher(old, value, self.options.fisher_alpha)
        ctx.store.save(CONSOLIDATED, merged)

    def begin_job(self, ctx: ClientContext, model) -> None:
        """Load the consolidated penalty of earlier tasks (after start_task merged the latest)."""
        job = ctx.job
        job.update(fisher=None, anchor=None, penalty=0.0, steps=0)
        stored = ctx.store.load(CONSOLIDATED) if self.options.lam > 0 else None
        task = _task_of(stored)
        capped = 0.0
        if stored is not None and task is not None and task < ctx.task:
            dev = ctx.device
            fisher = {k[len(FISHER):]: torch.as_tensor(np.asarray(v), device=dev)
                      for k, v in stored.items() if k.startswith(FISHER)}
            job["fisher"], capped = cap_fisher(fisher, self.options.lam, ctx.settings.lr,
                                               self.options.stiffness_cap)
            job["anchor"] = {k[len(THETA):]: torch.as_tensor(np.asarray(v), device=dev)
                             for k, v in stored.items() if k.startswith(THETA)}
        ctx.metrics.update(ewc_active=float(job["fisher"] is not None), ewc_capped_fraction=capped)

    def loss(self, ctx, model, x, y, logits):
        job = ctx.job
        job["steps"] += 1
        loss = F.cross_entropy(logits, y)
        if job["fisher"] is not None:
            penalty = ewc_penalty(model, job["fisher"], job["anchor"], self.options.lam)
            job["penalty"] += float(penalty.detach())
            loss = loss + penalty
        return loss

    def after_training(self, ctx: ClientContext, model) -> Arrays:
        """Estimate F and theta* on this job's data and keep them for the next task."""
        ctx.metrics["ewc_penalty"] = ctx.job["penalty"] / max(ctx.job["steps"], 1)
        if self.options.lam == 0:
            return {}  # no penalty will ever use them
        start = time.perf_counter()
        n = len(ctx.y)
        gen = torch.Generator().manual_seed(ctx.seed + 1)
        idx = torch.randperm(n, generator=gen)[: self.options.fisher_samples]
        x, y = ctx.x[idx].to(ctx.device), ctx.y[idx].to(ctx.device)
        fisher = empirical_fisher(model, x, y)
        arrays: Arrays = {TASK_KEY: np.asarray(ctx.task, dtype=np.int64)}
        for name, p in model.named_parameters():
            if name in fisher:
                arrays[FISHER + name] = fisher[name].detach().cpu().numpy().astype(np.float32)
                arrays[THETA + name] = p.detach().cpu().numpy().astype(np.float32, copy=True)
        ctx.store.save(PENDING, arrays)
        ctx.metrics["fisher_time_s"] = time.perf_counter() - start
        return {}


SPEC = register(MethodSpec(
    name=NAME,
    description="FedEWC: each client adds EWC's Fisher-weighted penalty towards its own earlier-task weights",
    options=FedEWCOptions,
    server=ServerPart,
    client=FedEWCClient,
))
