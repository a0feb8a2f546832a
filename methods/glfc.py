"""GLFC: Global-Local Forgetting Compensation.

Dong, Wang, Fang, Sun, Xu, Wang and Zhu, "Federated Class-Incremental
Learning", CVPR 2022. Facts from the paper and its official code
(conditionWang/FCIL: ``GLFC.py``, ``ProxyServer.py``, ``fl_main.py``).

**Client** (every participant, every round):

- *Task-transition detection* (eq. 7): the mean prediction entropy
  ``H = mean_i -sum_c p_ic log p_ic`` of the received global model on the
  local data; a rise ``H - H_last > entropy_threshold`` (1.2; the paper's
  value is not legible in the text at hand) since the client's previous job
  means new classes arrived. ``H_last`` starts at 0, as
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
  summed over the classes (``glfc_losses.class_bce``). Weights are constants
  (detached). A client with no old classes has ``w_i = 1``.
  ``compensation = "off"`` is the paper's *w/o CGC* ablation (§5.3, App.
  C.2): every ``w_i = 1``, eq. 1's plain BCE, in either loss form.
- *Class-semantic relation distillation* (eq. 5): the target of sample ``i``
  is the one-hot label whose old-class entries are the old model's sigmoid
  probabilities, ``[P_old(x_i), y_i]``, and ``L_RD = mean_i sum_c
  KL(target_ic || P_ic)``, each class's probability a Bernoulli (zero when
  the student matches the target). ``distillation = "icarl"`` is the *w/o
  CRD* ablation, iCaRL's distillation in its place (Rebuffi et al., CVPR
  2017): ``L_KD = mean_i sum_{c < K_old} D_BCE(sigmoid(z_ic),
  sigmoid(z_old_ic))``, the old model's sigmoid outputs as soft targets of the
  student's old-class outputs (code form: divided by the K classes).
  ``"off"``: no distillation term, what ``w_rd = 0`` gives (the old model's
  forward pass is then skipped).
- ``L = w_gc L_GC + w_rd L_RD`` with an old model, ``L_GC`` alone without
  (``w_gc = w_rd = 0.5``, code; eq. 6's weights are not legible in the paper's
  text). ``loss_form = "code"`` takes the code's
  forms: ``G_i`` from the sigmoid probability of the true class (the gradient
  of the binary cross-entropy at its logit), and ``L_GC`` and the binary
  cross-entropy to the relation target averaged over the classes instead of
  summed (1/K of the paper's gradient, which the code's learning rate of 2.0
  on 100 classes offsets; here the run's learning rate applies to both forms).
- *Prototype-gradient communication* (eq. 10-11), after a detected
  transition: for every new class, the prototype is the sample whose
  (normalised) feature is closest to the class mean
  (:mod:`fcl_emu.methods.glfc_prototypes`); it is perturbed, and the gradient of
  the cross-entropy of a small gradient-encoding LeNet (:class:`GradientEncoder`,
  identical everywhere from ``encoder_seed``) at the perturbed prototype is sent
  as a ``prototype_gradients`` message: no image, no label, never aggregated.
  ``perturbation = "code"`` (default): ``perturb_steps`` (50) SGD steps at lr
  ``perturb_lr`` or else training lr x ``perturb_lr_ratio`` (0.1), weight
  decay 1e-5, that lower the local model's loss of the label, as the code
  does. ``"paper"`` (§4.2, §5.1, App. A.2): SGD at the absolute lr
  ``perturb_lr`` (default 0.1) for ``perturb_steps`` (default 100) steps,
  each lowering the loss of the label as the head predicts it from the
  prototype's latent feature plus Gaussian noise ``gamma N(0, sigma_c^2)``,
  ``sigma_c^2`` the variance of the features of the class's samples. The
  equations are lost in the text at hand, so these are inferred: the variance
  is per feature dimension (population variance over the client's fresh
  samples of the class, under its trained model), the noise is drawn afresh
  at every step, the loss is eq. 1's BCE in the run's form, the weight decay
  1e-5 is the code's, and ``gamma = perturb_gamma`` (default 0.1) is a guess:
  its value is not legible. Either form then adds Gaussian input noise of std
  ``perturb_noise`` (in the normalised input's units; 0: off, as the code).

**Proxy server** (job ``glfc.proxy`` on the coordinator's GPU workers, after
each round's FedAvg): the round's gradients, pooled and shuffled with no
client identity, each give their label by the sign of the last layer's
gradient (the row of the classifier weight whose gradient sums lowest) and a
reconstruction by gradient matching (DLG): L-BFGS (lr ``proxy_lr``) on a
random image so that the encoder's gradient at it matches, for
``proxy_iterations`` steps (torch's default 20 evaluations each, as the
code's); the last ``proxy_keep`` iterates (code: 20 of 250) join the task's
monitoring set. The paper reconstructs with L-BFGS at lr 1.0 for 200
iterations (§5.1, App. A.2); the defaults are the code's (lr 0.1, 250).
The round's reconstructions run side by side on the CPU at
one thread (``methods/glfc_proxy.py``: one batched L-BFGS with each image's
own steps; small problems, where a GPU or more threads only add overhead). The proxy scores each new global model
by its accuracy on that set and keeps the best model of the task (on a tie,
the later one); at the next task that model is the clients' old model (the
``old_model`` asset, once per task). ``old_model = "last"`` is the *w/o PRS*
ablation: the old model is the previous task's final global model; clients
then send no prototype gradients (the server refuses any as bad input) and
the proxy job never runs.

**Learning rate**: ``lr_schedule = "paper"`` (§5.1, App. A.2) divides the lr by
5, 25 and 125 once a task's accumulated local epochs reach 100, 150 and 180
of its 200 (10 rounds of 20 epochs): here 0.5, 0.75 and 0.9 of the task's
``rounds_per_task x local_epochs``, since runs are far shorter. A client
arrives at round ``r`` of a task after ``r x local_epochs`` of them, so round
``r`` takes the divisor of the milestones ``r / rounds_per_task`` has
reached (the lr is set per round: a milestone inside a round takes effect at
the next, so the paper's round 7 of 10, half at /25 there, runs at /5 here).
Default ``"constant"``: the project's result tables were made with it.

**Options and their defaults**: the three ablations, ``compensation``
(``"gradient"``), ``distillation`` (``"relation"``) and ``old_model``
(``"proxy"``), default to GLFC itself; ``lr_schedule`` (``"constant"``) and
``perturbation`` (``"code"``) keep what the existing results used;
``loss_form`` (``"paper"``) and ``memory_size`` (2,000) are the paper's,
``w_gc``, ``w_rd``, ``perturb_*`` and ``proxy_*`` the code's (the field
descriptions say which), ``entropy_threshold`` (1.2) is unchecked (above).
The iCaRL+FL baseline of the paper's tables is the method ``icarl``
(:mod:`fcl_emu.methods.icarl`).

Deviations, on purpose:

- The paper's softmax ``G`` and sums over classes are the default; the
  code's sigmoid ``G`` and means over classes are ``loss_form = "code"``.
- The code's learning-rate schedule is not reproduced: the code trains 10
  rounds per task of 20 local epochs each and rebuilds its optimiser at the
  lr 2.0 every round, except that the lr is divided by 5 for all of a task's
  round 5 (counting from 0), by 25 from the 11th local epoch of round 7 and by
  125 for all of round 9. The paper's monotone schedule is ``lr_schedule =
  "paper"``, per round (above); the default keeps the lr constant.
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
- The perturbation defaults to the code's form (no latent noise); the paper's
  (``perturbation = "paper"``) rests on the inferences above.
- The proxy's L-BFGS defaults to the code's lr and iterations, not the
  paper's (above).
- The paper (§5.3) says only that its ablations replace a component: CGC by
  a loss whose symbol is lost in the text at hand (read as eq. 1's BCE), CRD
  by iCaRL's distillation, and PRS is left out (here: the last global model
  is the old model); each here swaps that one part and keeps the rest
  (weights, memory, detection, loss form).
- A defence neither has: a prototype gradient whose L2 norm lies beyond
  ``aggregation.adaptive_clip`` (default 10) times the median of the round's
  and the task's earlier pooled gradients is left out of the proxy, a
  ``cohort_bound`` rejection (``aggregation.clipping.beyond_cohort``); its
  sender stays unknown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
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
from fcl_emu.methods.glfc_losses import (gradient_compensation_loss, icarl_distillation, plain_bce_loss,
                                         relation_distillation)
from fcl_emu.methods.glfc_prototypes import (herding, merge_memory, perturb_prototype, perturb_prototype_paper,
                                             prototype_index)
from fcl_emu.methods.glfc_proxy import (GradientEncoder, gradient_groups, label_from_gradients, reconstruct,
                                 reconstruct_batch)
from fcl_emu.methods.registry import MethodSpec, register
from fcl_emu.scenario.transforms import denormalize

NAME = "glfc"
OLD = f"{NAME}/old/"  # asset / checkpoint prefix of the previous task's old model (the proxy's best, or its last)
BEST = f"{NAME}/best/"  # checkpoint: the best model of the current task so far
MONITOR = f"{NAME}/monitor/"  # checkpoint: the current task's reconstructions (x, y)
MEMORY, CANDIDATES = f"{NAME}.memory", f"{NAME}.candidates"  # client store: exemplars {x: uint8, y}
DETECTOR = f"{NAME}.detector"  # client store: the entropy and classes of the client's previous job
CHANNEL = "prototype_gradients"
MONITOR_INPUT = "monitor/"  # job input prefix of the monitoring set
MATCHED = 1e-3  # a reconstruction whose final gradient distance is below this counts as matched
# lr_schedule "paper": (fraction of a task's local epochs done, lr divisor), from 100, 150, 180 of 200 epochs
PAPER_LR_STEPS = ((Fraction(1, 2), 5), (Fraction(3, 4), 25), (Fraction(9, 10), 125))
PAPER_PERTURBATION = {"perturb_steps": 100, "perturb_lr": 0.1}  # perturbation "paper": its defaults (§5.1)


class ReplayOptions(Options):
    """What GLFC and its iCaRL+FL baseline (:mod:`fcl_emu.methods.icarl`) share: the exemplar memory, the task
    detection, the classification and distillation terms and the lr schedule."""

    memory_size: int = pydantic.Field(2000, ge=1, description="exemplars per client in all (paper: 2000)")
    loss_form: Literal["paper", "code"] = pydantic.Field(
        "paper", description="sigmoid BCE / Bernoulli KL summed over the classes (paper) or averaged (code)")
    compensation: Literal["gradient", "off"] = pydantic.Field(
        "gradient", description="class-aware gradient compensation (eq. 2-4) or plain BCE (the paper's w/o CGC)")
    distillation: Literal["relation", "icarl", "off"] = pydantic.Field(
        "relation", description="class-semantic relation distillation (eq. 5), iCaRL's (w/o CRD) or none")
    w_gc: float = pydantic.Field(0.5, ge=0, description="weight of the classification term from task 1 (code: 0.5)")
    w_rd: float = pydantic.Field(0.5, ge=0, description="weight of the distillation (code: 0.5)")
    task_detection: Literal["entropy", "oracle"] = pydantic.Field(
        "entropy", description="detect new classes by the entropy rise (paper) or take the task start")
    entropy_threshold: float = pydantic.Field(1.2, gt=0, description="entropy rise that signals a new task (1.2)")
    lr_schedule: Literal["constant", "paper"] = pydantic.Field(
        "constant", description="constant lr, or the paper's /5, /25, /125 at 0.5, 0.75, 0.9 of a task's epochs")


class GLFCOptions(ReplayOptions):
    old_model: Literal["proxy", "last"] = pydantic.Field(
        "proxy", description="the proxy's best model of the last task, or its final global model (w/o PRS)")
    perturbation: Literal["code", "paper"] = pydantic.Field(
        "code", description="prototype perturbation: the code's SGD, or the paper's with latent feature noise")
    perturb_steps: int = pydantic.Field(
        50, ge=0, description="SGD steps that perturb a prototype (code: 50; perturbation paper: 100)")
    perturb_lr: float | None = pydantic.Field(
        None, gt=0, description="their absolute lr (perturbation paper: 0.1); unset: training lr x perturb_lr_ratio")
    perturb_lr_ratio: float = pydantic.Field(0.1, gt=0, description="their lr / the training lr (code: 0.1)")
    perturb_gamma: float = pydantic.Field(
        0.1, ge=0, description="perturbation paper: latent noise std / the class's feature std (value lost: a guess)")
    perturb_noise: float = pydantic.Field(0.0, ge=0, description="std of Gaussian noise added to a prototype")
    encoder_seed: int = pydantic.Field(0, ge=0, description="seed of the shared gradient-encoding LeNet")
    proxy_iterations: int = pydantic.Field(
        250, ge=1, description="L-BFGS steps per reconstruction (code: 250; paper: 200)")
    proxy_lr: float = pydantic.Field(0.1, gt=0, description="L-BFGS learning rate (code: 0.1; paper: 1.0)")
    proxy_keep: int = pydantic.Field(20, ge=1, description="last iterates kept per gradient (code: 20)")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _paper_perturbation_defaults(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("perturbation") == "paper":
            data = {**data, **{k: v for k, v in PAPER_PERTURBATION.items() if data.get(k) is None}}
        return data

    @pydantic.model_validator(mode="after")
    def _keep_fits(self) -> GLFCOptions:
        if self.proxy_keep > self.proxy_iterations:
            raise ValueError(f"proxy_keep ({self.proxy_keep}) exceeds proxy_iterations ({self.proxy_iterations})")
        return self


def paper_lr(base: float, task_round: int, rounds: int) -> float:
    """The paper's lr in round ``task_round`` (0-based) of a task of ``rounds``: ``base`` divided by the largest
    divisor of :data:`PAPER_LR_STEPS` whose fraction of the task's local epochs the earlier rounds have done."""
    done = Fraction(task_round, max(rounds, 1))
    return base / max((divisor for fraction, divisor in PAPER_LR_STEPS if done >= fraction), default=1)


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


def _sample_prototype_gradients(input_shape: tuple[int, int, int], classes: int) -> Arrays:
    """A proxy round's inputs: the pooled prototype gradients (``grad/<k>/<param>``), one per class, each of a
    random image (seed 0) through the encoder of the default ``encoder_seed``."""
    encoder = GradientEncoder(input_shape, classes, GLFCOptions().encoder_seed)
    gen = torch.Generator().manual_seed(0)
    inputs = {}
    for k in range(classes):
        grads = encoder.gradients(torch.rand((1, *input_shape), generator=gen), torch.tensor([k]))
        inputs.update({f"grad/{k}/{n}": g.numpy() for (n, _), g in zip(encoder.named_parameters(), grads)})
    return inputs


@jobs.job("glfc.proxy", sample=_sample_prototype_gradients)
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
    global model; that model is the next task's old model (``old_model = "last"``: the task's final global
    model, no proxy)."""

    options: GLFCOptions
    side_channels = (CHANNEL,)
    server_step_refusal = ("scores each round's aggregate with its proxy and keeps the best as the next task's old "
                           "model: a server step would replace the model it scored")

    def __init__(self, ctx):
        super().__init__(ctx)
        self._proxy = self.uses_proxy()
        self._encoder = (GradientEncoder(ctx.input_shape, self._encoder_classes(), self.options.encoder_seed)
                         if self._proxy else None)
        self._pool: list[dict[str, np.ndarray]] = []  # this round's gradients, in arrival order
        self._pooled_norms: list[float] = []  # the L2 norms of the task's gradients that reached the proxy
        self._monitor: dict[str, np.ndarray] | None = None  # the task's reconstructions {x, y}
        self._best: Arrays | None = None  # best global model of the current task (by the proxy's score)
        self._best_score = -math.inf
        self._old: Arrays | None = None  # best model of the previous task: the clients' old model
        self._rng = np.random.default_rng([ctx.seed, 0x61FC])

    def uses_proxy(self) -> bool:
        """Whether the proxy picks the old model (else it is the previous task's final global model)."""
        return self.options.old_model == "proxy"

    def learning_rate(self, task: int, task_round: int, base: float) -> float:
        """Constant (lr_schedule constant), or the paper's steps: training.lr divided by 5, 25 and 125 from the
        rounds that start past 0.5, 0.75 and 0.9 of a task's local epochs (lr_schedule paper)."""
        if self.options.lr_schedule == "constant":
            return base
        return paper_lr(base, task_round, self.ctx.rounds_per_task)

    def _encoder_classes(self) -> int:
        return 0 if self.ctx.scenario is None else int(self.ctx.scenario.num_classes)

    def on_side_channel(self, task: int, kind: str, tensors: Mapping[str, np.ndarray]) -> None:
        if kind != CHANNEL:
            super().on_side_channel(task, kind, tensors)
        if not self._proxy:
            raise ValueError("prototype gradients while the old model is the last global model (no proxy)")
        names = [n for n, _ in self._encoder.named_parameters()]
        self._pool.extend(gradient_groups(tensors, names, self._encoder, prefix=""))

    def aggregate(self, task: int, round: int, updates) -> None:
        super().aggregate(task, round, updates)
        if not self._proxy or (not self._pool and self._monitor is None):
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
        if self._best is None or not self._proxy:  # no reconstruction this task, or no proxy: the final model
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
        """A plain step, and from task 1 the old model's forward pass for distillation (1/3 of a step; none with
        distillation off); the prototype gradient computed once per job is left out."""
        return 1.0 + (1.0 / 3.0 if task > 0 and options.distillation != "off" else 0.0)

    def sends_prototypes(self) -> bool:
        """Whether a detected transition sends prototype gradients (only the proxy reads them)."""
        return self.options.old_model == "proxy"

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
        if o.compensation == "off":
            gc = plain_bce_loss(logits, y, o.loss_form)
        else:
            is_old = torch.isin(y, job["old_classes"]) if len(job["old_classes"]) else None
            gc = gradient_compensation_loss(logits, y, is_old, o.loss_form)
        job["steps"] += 1
        job["sums"][0] += gc.item()
        if job["teacher"] is None:
            return gc
        if o.distillation == "off":  # as w_rd = 0
            return o.w_gc * gc
        with torch.no_grad():
            old_logits = job["teacher"](x)
        if o.distillation == "icarl":
            rd = icarl_distillation(logits, old_logits, o.loss_form)
        else:
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
        sends = job["detected"] and job["new_classes"] and self.sends_prototypes()
        if sends:
            tensors = self._prototype_gradients(ctx, model, x, y, features, job["new_classes"])
            ctx.outbox[CHANNEL] = (len(job["new_classes"]), tensors)
        steps = max(job["steps"], 1)
        classification = "gradient_compensation" if o.compensation == "gradient" else "plain_bce"
        ctx.metrics.update({classification: float(job["sums"][0] / steps),
                            "prototype_gradients": float(len(job["new_classes"]) if sends else 0)})
        if job["teacher"] is not None and o.distillation != "off":
            ctx.metrics[f"{o.distillation}_distillation"] = float(job["sums"][1] / steps)
        return {}

    def _prototype_gradients(self, ctx: ClientContext, model, x, y, features, classes: list[int]) -> Arrays:
        """Eq. 10-11: per new class, the perturbed prototype's gradient of the shared encoder."""
        o = self.options
        if self._encoder is None:
            self._encoder = GradientEncoder(tuple(x.shape[1:]), ctx.dataset_classes, o.encoder_seed)
        gen = torch.Generator().manual_seed(ctx.seed)
        lr = o.perturb_lr if o.perturb_lr is not None else ctx.settings.lr * o.perturb_lr_ratio
        tensors: Arrays = {}
        for k, c in enumerate(classes):
            idx = torch.nonzero(y == c).flatten()
            proto = x[idx[prototype_index(features[idx])]][None]
            label = torch.tensor([c])
            if o.perturbation == "paper":
                proto = perturb_prototype_paper(model, proto, label, features[idx], o.perturb_steps, lr,
                                                o.perturb_gamma, o.perturb_noise, o.loss_form, gen)
            else:
                proto = perturb_prototype(model, proto, label, o.perturb_steps, lr, o.perturb_noise, o.loss_form,
                                          gen)
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
