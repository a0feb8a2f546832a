"""GLFC: Global-Local Forgetting Compensation.

Dong, Wang, Fang, Sun, Xu, Wang and Zhu, "Federated Class-Incremental
Learning", CVPR 2022. Facts from the paper and its official code
(conditionWang/FCIL: ``GLFC.py``, ``ProxyServer.py``, ``fl_main.py``).

**Client** (every participant, every round):

- *Task-transition detection* (eq. 7): the mean prediction entropy
  ``H = mean_i -sum_c p_ic log p_ic`` of the received global model on the
  local data; a rise ``H - H_last > entropy_threshold`` (paper: 1.2) since the
  client's previous job means new classes arrived. ``H_last`` starts at 0, as
  in the code, so a first job with ``H > threshold`` counts as a transition;
  it is kept in the client's store, so it survives a crash.
  ``task_detection = "oracle"`` uses the emulator's task start instead.
- *Exemplar memory* (iCaRL): after every job the client selects by herding
  (features L2-normalised, the sample that keeps the running mean closest to
  the class mean) up to ``memory_size / classes`` candidates per class of its
  fresh data with its trained model; on a detected transition they join the
  memory and every class is cut to ``memory_size // classes`` (paper: 2,000
  in all). Memory samples are stored as uint8 in the client's disk store and
  trained on with the fresh data. Classes in the memory are the client's
  *old* classes, the others *new*.
- *Class-aware gradient compensation* (eq. 1-4; :mod:`fcl_emu.methods.glfc_losses`):
  each sample's gradient size ``G_i = |P_{i,y_i} - 1|`` with eq. 2's softmax
  probability ``P = softmax(z)`` over the seen classes, and each sample
  weighted by ``G_i`` divided by the mean ``G`` of its group (old or new
  classes), so both groups weigh the same whatever their sizes:
  ``L_GC = mean_i w_i D_BCE(sigmoid(z_i), y_i)``, ``D_BCE`` eq. 1's binary
  cross-entropy of the sigmoid probabilities against the one-hot label,
  summed over the classes (:func:`class_bce`). Weights are constants
  (detached). A client with no old classes has ``w_i = 1``.
- *Class-semantic relation distillation* (eq. 5): the target of sample ``i``
  is the one-hot label whose old-class entries are the old model's sigmoid
  probabilities, ``[P_old(x_i), y_i]``, and ``L_RD = mean_i sum_c
  KL(target_ic || P_ic)``, each class's probability a Bernoulli (zero when
  the student matches the target).
- ``L = w_gc L_GC + w_rd L_RD`` with an old model, ``L_GC`` alone without
  (``w_gc = w_rd = 0.5``, code). ``loss_form = "code"`` takes the code's
  forms: ``G_i`` from the sigmoid probability of the true class (the gradient
  of the binary cross-entropy at its logit), and ``L_GC`` and the binary
  cross-entropy to the relation target averaged over the classes instead of
  summed (1/K of the paper's gradient, which the code's learning rate of 2.0
  on 100 classes offsets; here the run's learning rate applies to both forms).
- *Prototype-gradient communication* (eq. 10-11), after a detected
  transition: for every new class, the prototype is the sample whose
  (normalised) feature is closest to the class mean; it is perturbed by
  ``perturb_steps`` SGD steps (lr = training lr x ``perturb_lr_ratio``,
  weight decay 1e-5) that lower the local model's loss of its label, plus
  Gaussian noise of std ``perturb_noise`` (in the normalised input's units;
  0: off, as in the code), and
  the gradient of the cross-entropy of a small gradient-encoding LeNet
  (:class:`GradientEncoder`, identical everywhere from ``encoder_seed``) at
  the perturbed prototype is sent as a ``prototype_gradients`` message: no
  image, no label, never aggregated.

**Proxy server** (job ``glfc.proxy`` on the coordinator's GPU workers, after
each round's FedAvg): the round's gradients, pooled and shuffled with no
client identity, each give their label by the sign of the last layer's
gradient (the row of the classifier weight whose gradient sums lowest) and a
reconstruction by gradient matching (DLG): L-BFGS (lr ``proxy_lr``) on a
random image so that the encoder's gradient at it matches, for
``proxy_iterations`` steps (torch's default 20 evaluations each, as the
code's); the last ``proxy_keep`` iterates (code: 20 of 250) join the task's
monitoring set. The round's reconstructions run side by side on the CPU at
one thread (``methods/glfc_proxy.py``: one batched L-BFGS with each image's
own steps; small problems, where a GPU or more threads only add overhead). The proxy scores each new global model
by its accuracy on that set and keeps the best model of the task (on a tie,
the later one); at the next task that model is the clients' old model (the
``old_model`` asset, once per task).

Deviations, on purpose:

- The paper's softmax ``G`` and sums over classes are the default; the
  code's sigmoid ``G`` and means over classes are ``loss_form = "code"``.
- The code's learning-rate schedule is not reproduced: the run's lr stays
  constant. The code trains 10 rounds per task of 20 local epochs each and
  rebuilds its optimiser at the lr 2.0 every round, except that the lr is
  divided by 5 for all of a task's round 5 (counting from 0), by 25 from the
  11th local epoch of round 7 and by 125 for all of round 9.
- The code sends two candidate old models every round (best of the last and
  of the current task) and each client picks one by its detection signal;
  both are the previous task's best model except for a client that detects
  late. Here the proxy's best model of the previous task is fixed when the
  task starts and travels once per task per client.
- The code replaces the monitoring set at every round that brings gradients
  and never resets the best score across tasks; here the set gathers a
  task's reconstructions and the best score restarts with each task.
- The code re-selects every client's exemplars each round with the global
  model; here a client selects candidates with its own trained model after
  each job (what it can do on a device) and keeps them at its next transition.
- The paper's eq. 10-11 perturbation was not at hand beyond its description;
  the optimisation-based perturbation is the code's.
- A defence neither has: a prototype gradient whose L2 norm lies beyond
  ``security.adaptive_clip`` (default 10) times the median of the round's
  and the task's earlier pooled gradients is left out of the proxy, a
  ``cohort_bound`` rejection (``aggregation.clipping.beyond_cohort``); its
  sender stays unknown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import pydantic
import torch
import torch.nn.functional as F
from torch import nn

from fcl_emu.methods import jobs
from fcl_emu.aggregation.clipping import beyond_cohort, l2_norm
from fcl_emu.aggregation.update import Arrays
from fcl_emu.methods.base import ClientContext, ClientPart, Options, ServerPart
from fcl_emu.methods.models.state import read_only, strip_prefix
from fcl_emu.methods.datafree import frozen_classifier, from_uint8, to_uint8
from fcl_emu.methods.glfc_losses import class_bce, gradient_compensation_loss, relation_distillation
from fcl_emu.methods.glfc_proxy import (GradientEncoder, gradient_groups, label_from_gradients, reconstruct,
                                 reconstruct_batch)
from fcl_emu.methods.optim import LocalSGD
from fcl_emu.methods.registry import MethodSpec, register
from fcl_emu.scenario.transforms import denormalize

NAME = "glfc"
OLD = f"{NAME}/old/"  # asset / checkpoint prefix of the proxy's best model of the previous task
BEST = f"{NAME}/best/"  # checkpoint: the best model of the current task so far
MONITOR = f"{NAME}/monitor/"  # checkpoint: the current task's reconstructions (x, y)
MEMORY, CANDIDATES = f"{NAME}.memory", f"{NAME}.candidates"  # client store: exemplars {x: uint8, y}
DETECTOR = f"{NAME}.detector"  # client store: the entropy and classes of the client's previous job
CHANNEL = "prototype_gradients"
MONITOR_INPUT = "monitor/"  # job input prefix of the monitoring set
MATCHED = 1e-3  # a reconstruction whose final gradient distance is below this counts as matched


class GLFCOptions(Options):
    memory_size: int = pydantic.Field(2000, ge=1, description="exemplars per client in all (paper: 2000)")
    loss_form: Literal["paper", "code"] = pydantic.Field(
        "paper", description="sigmoid BCE / Bernoulli KL summed over the classes (paper) or averaged (code)")
    w_gc: float = pydantic.Field(0.5, ge=0, description="weight of the gradient-compensation loss (code: 0.5)")
    w_rd: float = pydantic.Field(0.5, ge=0, description="weight of the relation distillation (code: 0.5)")
    task_detection: Literal["entropy", "oracle"] = pydantic.Field(
        "entropy", description="detect new classes by the entropy rise (paper) or take the task start")
    entropy_threshold: float = pydantic.Field(1.2, gt=0, description="entropy rise that signals a new task (1.2)")
    perturb_steps: int = pydantic.Field(50, ge=0, description="SGD steps that perturb a prototype (code: 50)")
    perturb_lr_ratio: float = pydantic.Field(0.1, gt=0, description="their lr / the training lr (code: 0.1)")
    perturb_noise: float = pydantic.Field(0.0, ge=0, description="std of Gaussian noise added to a prototype")
    encoder_seed: int = pydantic.Field(0, ge=0, description="seed of the shared gradient-encoding LeNet")
    proxy_iterations: int = pydantic.Field(250, ge=1, description="L-BFGS steps per reconstruction (code: 250)")
    proxy_lr: float = pydantic.Field(0.1, gt=0, description="L-BFGS learning rate of the reconstruction")
    proxy_keep: int = pydantic.Field(20, ge=1, description="last iterates kept per gradient (code: 20)")

    @pydantic.model_validator(mode="after")
    def _keep_fits(self) -> GLFCOptions:
        if self.proxy_keep > self.proxy_iterations:
            raise ValueError(f"proxy_keep ({self.proxy_keep}) exceeds proxy_iterations ({self.proxy_iterations})")
        return self


# ---------------------------------------------------------- task-transition detection
@torch.no_grad()
def mean_entropy(model: nn.Module, x: torch.Tensor, batch: int = 512) -> float:
    """Eq. 7's ``H``: the mean entropy (nats) of the model's softmax over ``x`` (the model's mode is kept)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(x), batch):
        logp = F.log_softmax(model(x[i:i + batch]), dim=1)
        total += float(-(logp.exp() * logp).sum())
    model.train(was_training)
    return total / max(len(x), 1)


# --------------------------------------------------------- exemplars, prototypes
def herding(features: torch.Tensor, m: int) -> torch.Tensor:
    """iCaRL's herding: indices of up to ``m`` samples, in selection order, whose running mean of L2-normalised
    features stays closest to the class mean."""
    f = F.normalize(features, dim=1)
    mu = f.mean(dim=0)
    chosen: list[int] = []
    running = torch.zeros_like(mu)
    available = torch.ones(len(f), dtype=torch.bool)
    for k in range(1, min(m, len(f)) + 1):
        dist = (mu - (running + f) / k).norm(dim=1)
        dist[~available] = math.inf
        i = int(dist.argmin())
        chosen.append(i)
        available[i] = False
        running += f[i]
    return torch.tensor(chosen, dtype=torch.long)


def prototype_index(features: torch.Tensor) -> int:
    """The sample whose normalised feature is closest to the (normalised) class mean."""
    f = F.normalize(features, dim=1)
    return int((f - F.normalize(f.mean(dim=0), dim=0)).norm(dim=1).argmin())


def merge_memory(memory: Mapping[str, np.ndarray] | None, candidates: Mapping[str, np.ndarray] | None,
                 size: int) -> dict[str, np.ndarray] | None:
    """The memory after a transition: candidates replace the memory of their classes, then every class keeps
    its first ``size // classes`` samples (herding order, so the best ones)."""
    parts = [p for p in (memory, candidates) if p is not None and len(p["y"])]
    if not parts:
        return None
    fresh = set(np.unique(candidates["y"]).tolist()) if candidates is not None else set()
    xs, ys = [], []
    for part in parts:
        keep = np.ones(len(part["y"]), bool) if part is candidates else ~np.isin(part["y"], list(fresh))
        xs.append(part["x"][keep])
        ys.append(part["y"][keep])
    x, y = np.concatenate(xs), np.concatenate(ys)
    classes = np.unique(y)
    quota = max(1, size // len(classes))
    keep = np.concatenate([np.flatnonzero(y == c)[:quota] for c in classes])
    return {"x": x[keep], "y": y[keep]}


def perturb_prototype(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, noise: float,
                      form: str, generator: torch.Generator) -> torch.Tensor:
    """The prototype after ``steps`` SGD steps (weight decay 1e-5) that lower ``model``'s loss of label ``y``
    (:func:`class_bce` in the run's form), plus Gaussian noise of std ``noise``."""
    x = x.detach().clone().requires_grad_(True)
    opt = LocalSGD([x], lr=lr, weight_decay=1e-5)
    for _ in range(steps):
        logits = model(x)
        loss = class_bce(logits, F.one_hot(y, logits.shape[1]).float(), form).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    x = x.detach()
    if noise > 0:
        x = x + noise * torch.randn(x.shape, generator=generator)
    return x


@jobs.job("glfc.proxy")
def proxy_step(inputs: Mapping[str, np.ndarray], options: Mapping[str, Any], device: torch.device) -> jobs.JobOutput:
    """The proxy server's round: reconstruct the pooled gradients (inputs ``grad/<k>/<param>``, no identities)
    and score the global model (``model/<key>``) on the task's monitoring set (``monitor/x``, ``monitor/y``)
    plus the new reconstructions. Options: ``method_options``, ``model``, ``input_shape``, ``num_classes``
    (the encoder's), ``seed``, ``sequential`` (one image after another, the reference the batched default is
    checked against; default false). Outputs ``recon/x``, ``recon/y`` (float32 images as the model sees them)."""
    o = GLFCOptions(**options["method_options"])
    shape = tuple(options["input_shape"])
    encoder = GradientEncoder(shape, int(options["num_classes"]), o.encoder_seed)
    names = [n for n, _ in encoder.named_parameters()]
    targets = [{n: torch.from_numpy(np.asarray(group[n], np.float32)) for n in names}
               for group in gradient_groups(inputs, names, encoder)]
    labels = [label_from_gradients(target) for target in targets]
    gen = torch.Generator().manual_seed(int(options.get("seed", 0)))
    with jobs.torch_threads(1):  # small problems on the CPU (on any worker): threads only cost
        if options.get("sequential", False):
            done = [reconstruct(encoder, target, label, shape, o.proxy_iterations, o.proxy_lr, o.proxy_keep, gen)
                    for target, label in zip(targets, labels)]
        else:
            done = reconstruct_batch(encoder, targets, labels, shape, o.proxy_iterations, o.proxy_lr, o.proxy_keep,
                                     gen)
    xs = [images for images, _ in done]
    ys = [torch.full((len(images),), label, dtype=torch.long) for (images, _), label in zip(done, labels)]
    losses = [loss for _, loss in done]
    recon_x = torch.cat(xs) if xs else torch.empty((0, *shape))
    recon_y = torch.cat(ys) if ys else torch.empty(0, dtype=torch.long)
    metrics = {"gradients": float(len(targets)), "reconstructions": float(len(recon_y))}
    if losses:  # a few matchings stall far from 0 (L-BFGS from a bad start): the median and a count show it
        metrics.update(match_loss_median=float(np.median(losses)), match_loss_max=float(np.max(losses)),
                       matched=float(np.sum(np.asarray(losses) < MATCHED)))
    x_all = torch.cat([torch.from_numpy(np.asarray(inputs.get("monitor/x", np.empty((0, *shape), np.float32)))),
                       recon_x])
    y_all = torch.cat([torch.from_numpy(np.asarray(inputs.get("monitor/y", np.empty(0, np.int64)))), recon_y])
    model_arrays = strip_prefix(inputs, "model/")
    if model_arrays and len(y_all):
        model = frozen_classifier(options["model"], shape, model_arrays, device)
        with torch.no_grad():
            predicted = torch.cat([model(x_all[i:i + 256].to(device)).argmax(dim=1).cpu()
                                   for i in range(0, len(x_all), 256)])
        metrics["score"] = float((predicted == y_all).float().mean())
    return jobs.JobOutput({"recon/x": recon_x.numpy().astype(np.float32), "recon/y": recon_y.numpy()}, metrics)


# ------------------------------------------------------------------- server
class GLFCServer(ServerPart):
    """FedAvg; pools the prototype gradients (without identities) for the proxy, which picks each task's best
    global model; that model is the next task's old model."""

    options: GLFCOptions
    side_channels = (CHANNEL,)

    def __init__(self, ctx):
        super().__init__(ctx)
        self._encoder = GradientEncoder(ctx.input_shape, self._encoder_classes(), self.options.encoder_seed)
        self._pool: list[dict[str, np.ndarray]] = []  # this round's gradients, in arrival order
        self._pooled_norms: list[float] = []  # the L2 norms of the task's gradients that reached the proxy
        self._monitor: dict[str, np.ndarray] | None = None  # the task's reconstructions {x, y}
        self._best: Arrays | None = None  # best global model of the current task (by the proxy's score)
        self._best_score = -math.inf
        self._old: Arrays | None = None  # best model of the previous task: the clients' old model
        self._rng = np.random.default_rng([ctx.seed, 0x61FC])

    def _encoder_classes(self) -> int:
        return 0 if self.ctx.scenario is None else int(self.ctx.scenario.num_classes)

    def on_side_channel(self, task: int, kind: str, tensors: Mapping[str, np.ndarray]) -> None:
        if kind != CHANNEL:
            super().on_side_channel(task, kind, tensors)
        names = [n for n, _ in self._encoder.named_parameters()]
        self._pool.extend(gradient_groups(tensors, names, self._encoder, prefix=""))

    def aggregate(self, task: int, round: int, updates) -> None:
        super().aggregate(task, round, updates)
        if not self._pool and self._monitor is None:
            return
        pool, self._pool = self._within_cohort(self._pool), []
        order = self._rng.permutation(len(pool))  # the proxy learns nothing from the arrival order either
        inputs = {f"grad/{i}/{n}": v for i, k in enumerate(order) for n, v in pool[k].items()}
        inputs.update({"model/" + k: v for k, v in self.global_state.items()})
        if self._monitor is not None:
            inputs.update({MONITOR_INPUT + k: v for k, v in self._monitor.items()})
        job = self.ctx.run_job("glfc.proxy", inputs, {
            "method_options": self.options.model_dump(), "model": self.ctx.model_name,
            "input_shape": list(self.ctx.input_shape), "num_classes": self._encoder_classes(),
            "seed": self.ctx.seed * 100_003 + round})
        new = {"x": np.asarray(job.outputs["recon/x"], np.float32), "y": np.asarray(job.outputs["recon/y"], np.int64)}
        if len(new["y"]):
            self._monitor = new if self._monitor is None else {
                k: np.concatenate([self._monitor[k], new[k]]) for k in ("x", "y")}
        score = job.metrics.get("score")
        if score is not None and score >= self._best_score:
            self._best, self._best_score = self.global_state, score

    def _within_cohort(self, pool: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """The round's prototype gradients without those beyond the cohort bound (their L2 norm against the
        median of this round's and the task's earlier pooled ones: clients send them on a new task, so a later
        round may bring only one), each refused one counted; their senders stay unknown."""
        if self.ctx.cohort_bound is None:
            return pool
        norms = [l2_norm(g.values()) for g in pool]
        beyond = beyond_cohort(norms, self.ctx.cohort_bound, self._pooled_norms)
        for norm, out in zip(norms, beyond):
            if out:
                self.ctx.refused(f"a prototype gradient of L2 norm {norm:.4g}, beyond {self.ctx.cohort_bound:g} x "
                                 f"the median of the task's prototype gradients; left out of the proxy")
        self._pooled_norms += [n for n, out in zip(norms, beyond) if not out]
        return [g for g, out in zip(pool, beyond) if not out]

    def end_task(self, task: int) -> None:
        if self._best is None:  # no reconstruction this task: the final global model
            self._best = self.global_state

    def start_task(self, task: int) -> None:
        super().start_task(task)
        if task > 0:
            self._old = self._best
            self._best, self._best_score, self._monitor, self._pool = None, -math.inf, None, []
            self._pooled_norms = []

    def task_assets(self, task: int) -> dict[str, Arrays]:
        if task == 0 or self._old is None:
            return {}
        return {"old_model": {OLD + k: v for k, v in self._old.items()}}

    def state_arrays(self) -> Arrays:
        arrays = super().state_arrays()
        for prefix, part in ((OLD, self._old), (BEST, self._best), (MONITOR, self._monitor)):
            if part is not None:
                arrays.update({prefix + k: v for k, v in part.items()})
        return arrays

    def state_meta(self) -> dict[str, Any]:
        return {**super().state_meta(), "best_score": None if self._best is None else self._best_score,
                "pooled_norms": self._pooled_norms}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        super().load_state_arrays(arrays)
        old, best, monitor = (strip_prefix(arrays, p) for p in (OLD, BEST, MONITOR))
        self._old = read_only(old) if old else None
        self._best = read_only(best) if best else None
        self._monitor = {k: np.array(v) for k, v in monitor.items()} if monitor else None

    def load_state_meta(self, meta: Mapping[str, Any]) -> None:
        super().load_state_meta(meta)
        score = meta.get("best_score")
        self._best_score = -math.inf if score is None else float(score)
        self._pooled_norms = [float(n) for n in meta.get("pooled_norms", [])]


# ------------------------------------------------------------------- client
class GLFCClient(ClientPart):
    keeps_state = True  # its store outlives the job
    options: GLFCOptions

    @classmethod
    def work_per_sample(cls, options, batch_size: int, task: int) -> float:
        """A plain step, and from task 1 the old model's forward pass for distillation (1/3 of a step); the prototype
        gradient computed once per job is left out."""
        return 1.0 + (1.0 / 3.0 if task > 0 else 0.0)

    def __init__(self, options: GLFCOptions):
        super().__init__(options)
        self._encoder: GradientEncoder | None = None

    def begin_job(self, ctx: ClientContext, model) -> None:
        o = self.options
        # the detector's memory is on the device's storage: it survives a crash or a node restart
        last = ctx.store.load(DETECTOR) or {"entropy": np.float64(0.0), "classes": np.empty(0, np.int64)}
        entropy = mean_entropy(model, ctx.x)
        fresh = np.unique(ctx.y.numpy())
        detected = (entropy - float(last["entropy"]) > o.entropy_threshold if o.task_detection == "entropy"
                    else ctx.new_task)
        transition = not np.array_equal(fresh, last["classes"])  # the truth the detection is judged by
        ctx.store.save(DETECTOR, {"entropy": np.float64(entropy), "classes": fresh})
        memory = ctx.store.load(MEMORY)
        if detected:
            memory = merge_memory(memory, ctx.store.load(CANDIDATES), o.memory_size)
            if memory is not None:
                ctx.store.save(MEMORY, memory)
        old_classes = np.unique(memory["y"]) if memory is not None else np.empty(0, np.int64)
        n_fresh = len(ctx.y)
        if memory is not None:
            ctx.x = torch.cat([ctx.x, from_uint8(memory["x"], ctx.mean, ctx.std)])
            ctx.y = torch.cat([ctx.y, torch.from_numpy(memory["y"].astype(np.int64))])
        old_arrays = strip_prefix(ctx.assets, OLD)
        teacher = ctx.frozen_model(old_arrays) if old_arrays else None
        if teacher is not None and teacher.num_classes > model.num_classes:
            raise ValueError(f"glfc: the old model has {teacher.num_classes} classes, the student "
                             f"{model.num_classes}")
        ctx.job.update(detected=detected, n_fresh=n_fresh, old_classes=torch.from_numpy(old_classes),
                       new_classes=[int(c) for c in fresh if c not in set(old_classes.tolist())], teacher=teacher,
                       sums=np.zeros(2), steps=0)
        ctx.metrics.update(entropy=entropy, task_detected=float(detected), transition=float(transition),
                           detection_missed=float(transition and not detected),
                           detection_false_alarm=float(detected and not transition),
                           exemplars=float(0 if memory is None else len(memory["y"])))

    def loss(self, ctx: ClientContext, model, x, y, logits) -> torch.Tensor:
        job, o = ctx.job, self.options
        is_old = torch.isin(y, job["old_classes"]) if len(job["old_classes"]) else None
        gc = gradient_compensation_loss(logits, y, is_old, o.loss_form)
        job["steps"] += 1
        job["sums"][0] += gc.item()
        if job["teacher"] is None:
            return gc
        with torch.no_grad():
            old_logits = job["teacher"](x)
        rd = relation_distillation(logits, old_logits, y, o.loss_form)
        job["sums"][1] += rd.item()
        return o.w_gc * gc + o.w_rd * rd

    def after_training(self, ctx: ClientContext, model) -> Arrays:
        job, o = ctx.job, self.options
        x, y = ctx.x[:job["n_fresh"]], ctx.y[:job["n_fresh"]]
        with torch.no_grad():
            features = torch.cat([model.features(x[i:i + 512]) for i in range(0, len(x), 512)])
        classes = set(y.tolist()) | set(job["old_classes"].tolist())
        quota = max(1, o.memory_size // max(len(classes), 1))
        keep = torch.cat([torch.nonzero(y == c).flatten()[herding(features[y == c], quota)]
                          for c in sorted(set(y.tolist()))])
        ctx.store.save(CANDIDATES, {"x": to_uint8(denormalize(x[keep], ctx.mean, ctx.std)),
                                    "y": y[keep].numpy()})
        if job["detected"] and job["new_classes"]:
            tensors = self._prototype_gradients(ctx, model, x, y, features, job["new_classes"])
            ctx.outbox[CHANNEL] = (len(job["new_classes"]), tensors)
        steps = max(job["steps"], 1)
        ctx.metrics.update(gradient_compensation=float(job["sums"][0] / steps),
                           prototype_gradients=float(len(job["new_classes"]) if job["detected"] else 0))
        if job["teacher"] is not None:
            ctx.metrics["relation_distillation"] = float(job["sums"][1] / steps)
        return {}

    def _prototype_gradients(self, ctx: ClientContext, model, x, y, features, classes: list[int]) -> Arrays:
        """Eq. 10-11: per new class, the perturbed prototype's gradient of the shared encoder."""
        o = self.options
        if self._encoder is None:
            self._encoder = GradientEncoder(tuple(x.shape[1:]), ctx.dataset_classes, o.encoder_seed)
        gen = torch.Generator().manual_seed(ctx.seed)
        tensors: Arrays = {}
        for k, c in enumerate(classes):
            idx = torch.nonzero(y == c).flatten()
            proto = x[idx[prototype_index(features[idx])]][None]
            label = torch.tensor([c])
            proto = perturb_prototype(model, proto, label, o.perturb_steps, ctx.settings.lr * o.perturb_lr_ratio,
                                      o.perturb_noise, o.loss_form, gen)
            grads = self._encoder.gradients(proto, label)
            for (name, _), g in zip(self._encoder.named_parameters(), grads):
                tensors[f"{k}/{name}"] = g.numpy().astype(np.float32)
        return tensors


SPEC = register(MethodSpec(
    name=NAME,
    description="GLFC (Dong et al., CVPR 2022): exemplars, gradient compensation, relation distillation from "
                "the proxy's best old model, prototype gradients reconstructed by a proxy server",
    options=GLFCOptions, server=GLFCServer, client=GLFCClient,
    # the code's SGD has no momentum and weight decay 1e-5; its lr 2.0 goes with its loss averaged over 100
    # classes (loss_form "code"): the paper's summed form takes the run's lr
    training={"momentum": 0.0, "weight_decay": 1e-5},
))
