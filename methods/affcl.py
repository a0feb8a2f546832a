"""AF-FCL: accurate forgetting with a federated normalizing flow over features.

Wuerkaixi, Cui, Zhang, Yan, Han, Niu, Fang, Zhang and Sugiyama, "Accurate
Forgetting for Heterogeneous Federated Continual Learning", ICLR 2024
(arXiv:2502.14205; the authors' code is zaocan666/AF-FCL, "PreciseFCL", read
for every form below). Equation numbers are the paper's; the text at hand
(an extraction missing part of section 5.3) shows eq. 5, eq. 9 and App. C.3,
and eq. 6-8 are as quoted to this project. The exact forms are the code's
(``FLAlgorithms/PreciseFCLNet/model.py``, ``FLAlgorithms/users/userPreciseFCL.py``),
each named where it matters; where the paper and the code differ, each
point below says which one is the default and why.

**Model.** The classifier splits into the flow's feature space ``h = f(x)``
and the layers above it, ``logits = c(h)``. With a
:class:`~fcl_emu.methods.models.backbones.SplitBackbone` (``model: cnn_leaky``, the
code's kind of feature space: LeakyReLU, a 512-d embedding, then a 512-d
``neck`` like the code's ``fc2``, then the head) ``f`` is the backbone's
``embed`` and ``c`` its neck plus the head; with any other backbone ``f`` is
the whole backbone and ``c`` the head. ``model: auto`` gives ``cnn_leaky``
for AF-FCL on small images (``AFFCLServer.small_model``; other methods get
``cnn``, whose ReLU features hold exact zeros, over which a density is
ill-posed); colour images get ``resnet18`` (``AFFCLServer.large_model``; other methods
get ``cnn_bn``, whose ReLU features hold exact zeros too), slow on a CPU. A class-conditional
normalizing flow ``u = g(h; y)`` (:class:`~fcl_emu.methods.models.flows.ConditionalFlow`:
the code's affine couplings with residual conditioners and its bounded
scale; conditioned on the one-hot class over the data set's label space)
models ``p(h | y)``:

    log p(h | y) = log N(g(h; y); 0, I) + log |det dg/dh|.

The flow is trained with FedAvg together with the classifier: its weights ride
with the model in every ``train_request`` as ``affcl/flow/<param>`` and come
back as deltas under the same names (``summable = (DELTA, FLOW)``).

**Client, one local step** on a real batch ``(x, y)`` (B samples), ``K`` the
classes seen so far, ``K_old`` those of the old model (the previous task's
final global classifier ``f_old``/``c_old`` and flow ``g_old``, received
once per task as the ``old_model`` asset ``affcl/old/{model,flow}/...``):

1. Flow (eq. 5), on the features ``h = f(x)`` (detached: the flow's loss does
   not train the extractor) and ``B`` features ``h~`` sampled from ``g_old``
   for labels ``y~`` drawn uniformly from the ``K_old`` old classes::

       L_flow = -mean log p(h | y) - k_flow_last * mean log p(h~ | y~)

   one Adam step on the flow's weights (lr ``flow_lr``). Eq. 5 weighs the
   old flow's samples 1; the default ``k_flow_last = 0.4`` is the code's
   (``k_flow_last: 1`` gives eq. 5).
2. Accurate forgetting (eq. 7-8). The local features' latents ``u = g(h; y)``
   under the updated flow give per-class diagonal Gaussians
   ``mu_c = mean(u | y = c)``, ``var_c = mean((u - mu_c)^2 | y = c)`` (eq. 7,
   over the batch, as the code). ``B`` features are generated from the flow,
   ``h^ = g^{-1}(u^; y^)``, ``u^ ~ N(0, I)``, ``y^`` uniform over the ``K``
   seen classes. Each gets the credibility (eq. 8)::

       w = mean_d N(v_d; mu_{y^,d}, var_{y^,d} + 1e-6)     (y^ present in the batch)
       w = p_bar = mean_i exp(log p(h_i | y_i) / D)        (otherwise)

   the mean over the ``D`` dimensions of the per-dimension Gaussian density
   (code); ``p_bar`` is the real batch's geometric-mean density per
   dimension (under the code's bounded scale at most about 0.4, the
   standard normal's peak; of the standardised features with ``flow_input``
   standardized, see the deviations). ``v`` is set by ``credibility``: ``"latent"`` (default)
   ``v = u^``, the generated sample's own latent, compared with the latent
   statistics in the space they describe (eq. 7-8, as quoted,
   put both in the latent space); ``"feature"`` ``v = h^``, the generated
   *feature* compared with the *latent* statistics, as the code does
   (``probability_in_localdata``) although the two live in different spaces.
   The weight is a constant (no gradient). The ``latent`` default follows
   eq. 8 in its space, not in its reduction: eq. 8 is the joint density of
   the diagonal Gaussian (the product over dimensions), which over hundreds
   of dimensions under- or overflows float32; the code's mean over the
   dimensions is kept. Eq. 7 takes the statistics over the client's task
   data; the code and this module over the batch.
3. Replay on the generated features (eq. 9), with ``KD_T`` below::

       L_replay = k_loss_flow * (((1 - theta) p_bar + theta) * mean_j w_j CE(c(h^_j), y^_j)
                                 + k_kd_last * k_kd_output * KD_T(c(h^), c_old(h^)))

   Eq. 9 is one summed objective, ``CE(real) + weighted CE(generated) +
   L_KD``, weights 1/1/1 and no output distillation. The code, followed
   here by default (the project's results were measured so), takes a
   separate replay step weighted
   ``k_loss_flow = 0.5``, distils outputs on both real and generated features
   and weighs the feature distillation ``k_kd_last * k_kd_feature = 0.1``.
   ``replay: summed, k_loss_flow: 1, theta: 1, k_kd_output: 0, k_kd_last: 1,
   k_kd_feature: 1`` comes closest to eq. 9 as printed.
   ``replay: "step"`` (default, the code): its own Adam step (lr
   ``replay_lr``, the code's classifier lr; betas 0.9/0.999) on the layers
   between the features and the head, i.e. the neck of a ``SplitBackbone``
   (the code's ``fc2``; the head gets no step from it), or the head where the
   backbone has no neck. Adam's step hardly depends on the loss's scale, so
   ``k_loss_flow`` barely matters there. ``replay: "summed"``: ``L_replay``
   is added to the loss of step 4 instead (one step of the classifier's optimiser;
   the replay reaches ``c`` only, as the generated features carry no
   gradient); with SGD its strength then scales with ``k_loss_flow``.
4. Classifier (eq. 6), one step of the classifier's optimiser
   (``classifier_optimizer``, below)::

       L = CE(c(h), y) + k_kd_last * (k_kd_feature * mean (h - f_old(x))^2
                                      + k_kd_output * KD_T(c(h), c_old(f_old(x))))

``KD_T(s, t) = -mean_i sum_k softmax(t_i / T)_k log softmax(s_i / T)_k`` at
``T = 2`` (the code's ``MultiClassCrossEntropy``, no ``T^2``). The code's
head has a row for every class of the data set from the start, so it
distils over all of them. Here the head grows; ``kd_classes: "all"``
(default) distils over all ``K`` classes of the student, the old model
giving no mass to the ``K - K_old`` classes it lacks (the code's old model
gives them little: their rows were only ever pushed down); ``"old"`` over
the first ``K_old`` logits only (iCaRL/LwF's restriction). Terms with the
old model vanish in the first task; generated features are replayed from
the first task on (code).

Defaults. The code's README run commands set ``--flow_lr``, ``--k_loss_flow``,
``--k_flow_lastflow`` and ``--flow_explore_theta`` per data set; the defaults
are those of its EMNIST-Letters command (the first; also the replay weight
0.5 and theta 0 quoted for the paper): ``flow_lr = 1e-4``, ``k_loss_flow = 0.5``,
``k_flow_last = 0.4``, ``theta = 0``, and ``replay_lr = 1e-4`` (its
``--lr``). Its other commands (flow_lr, k_loss_flow, k_flow_last, theta):
EMNIST-shuffle 1e-3, 0.05, 0.02, 0.5; EMNIST-noisy 1e-3, 0.5, 0.1, 0.5;
MNIST-SVHN-FASHION 1e-3, 0.1, 0, 0; CIFAR100 5e-3, 0.5, 0.1, 0.1 (with
``--lr 1e-3``; the last two also set ``--fedprox_k 0.001``, which the code
parses but never uses). The noisy-client rows of the AF-FCL table take the
EMNIST-noisy command's (``experiments/feature_replay_table.py``,
``NOISY_AFFCL``). The README leaves the rest at ``main.py``'s argparse
defaults: ``k_kd_last = 0.2`` (``k_kd_last_cls``), ``k_kd_feature = 0.5``,
``k_kd_output = 0.1``; and ``model.py`` fixes ``flow_layers = 4``,
``flow_blocks = 2`` and ``temperature = 2``. ``flow_hidden = 256``: see the
deviations.

Deviations, on purpose:

- CPU-sized flow: each conditioner has ``flow_hidden = 256`` units (code:
  512). With 10 classes, 512 units make 5.1M parameters over 256-d features
  and 5.8M over 512-d (20-23 MB per flow on the wire each way every round)
  and cost 3-4 times a ``cnn`` step's CPU time per step (batch 32, one
  thread); 256 units make 1.5M / 1.9M parameters and cost 1-1.5 ``cnn``
  steps. Set ``flow_hidden: 512`` for the code's size.
- The flow's input (``flow_input``): ``"standardized"`` (default) standardises
  the features by running per-dimension statistics before the couplings
  (:class:`~fcl_emu.methods.models.flows.RunningStandardization`; the
  clients update them from every real batch and they are averaged with the
  flow; the log-density keeps the map's Jacobian, ``p_bar`` is taken in the
  standardised space, where the code's bound holds); ``"raw"`` is the
  code's. The code's bounded scale can only shrink a dimension on the way to
  the latent, so it cannot fit features narrower than the standard normal.
  ``python -m experiments.flow_fit RUN`` measures it on a finished
  run's features; on ``cnn_leaky``'s MNIST features (per-dimension spread
  0.007, median) after 500 and 2,000 Adam steps at 1e-4 (2026-11-29): the
  raw flow's held-out NLL stays at the prior's floor (473 and 471 nats, 0.92
  a dimension) and its samples have 3-4 times the features' norm (24.8 and
  29.0 against 8.0); standardised, the NLL is -1,529 and -1,563 nats and
  the samples' norm 8.6 and 10.0. Neither makes the samples class-faithful
  yet: a nearest-class-mean rule labels 18 and 27 % of them as their class
  (raw: 14 and 27 %; the real features: 79 %), and the samples' tails grow
  with training (largest value 49.6 against the features' 4.6).
  The paper models ``p(h | y)``; the standardisation serves that intent.
- The conditioners' last layers start at zero (code: PyTorch's default), so
  a fresh flow is a fixed permutation and scaling; see :mod:`fcl_emu.methods.models.flows`.
- The classifier's optimiser: ``classifier_optimizer = "run"`` (default) is
  the run's (``training``: optimizer, lr, momentum, weight decay; the
  project's tables were measured with its SGD, and ``training.optimizer:
  adam`` gives every method of a comparison the paper's Adam at the run's
  lr); ``"adam"`` is the paper's and the code's, Adam at ``classifier_lr``
  (1e-4, App. C.3 for every data set but CIFAR-100, where the code's README
  sets 1e-3), betas 0.9/0.999, no weight decay (the
  code's argparse defaults); the run's ``training`` lr, momentum and weight
  decay then do not apply (the client sees the resolved lr, not whether
  the config set it). The paper's budget, 60 rounds of 100 local
  iterations, is the run config's to set. Every Adam state here (the
  classifier's, the flow's, the replay step's) starts afresh every
  training job (a round); the code keeps them across rounds.
- The real batch's features are computed once, in the model's training mode,
  for the flow, the statistics and the loss (the code computes those for the
  flow in eval mode): the same with ``cnn``/``cnn_leaky``, which have no
  BatchNorm, not with the ResNets.
- The old model is the previous task's final *global* pair (the code: the
  client's own copy at the task switch, which is the global one after the
  last round's broadcast).
- Generated labels are uniform over the ``K`` classes seen so far (the code:
  over the union of all clients' classes so far, the same set when every
  class seen is some client's).
- The credibility's variance floor is 1e-6 (code: 1e-30); both leave a
  one-sample class (variance 0) with weight ~0 away from its mean.
- Evaluation: the code's accuracy (``evaluate_all_``: every client scores
  the global model on each of its tasks' test sets) is the run's
  ``accuracy_clients``; a client's test set for a task is the data set's
  test samples of that task's classes (the code splits each client's own
  data into train and test).
- Not implemented: the code's distillation from the current global
  classifier (``k_kd_global_cls``, 0 by default and in every README command)
  and its ``classifier_global_mode`` variants (the whole classifier is
  federated, the code's default ``all``).

Secure aggregation: the flow's deltas are summable under the model delta's
rule (a sample-weighted mean), but SecAgg's layout (:class:`fcl_emu.methods.base.DeltaLayout`)
masks ``delta/`` tensors only, so ``--secagg`` with affcl is refused at
config time, naming ``affcl/flow/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
import pydantic
import torch
import torch.nn.functional as F

from fcl_emu.aggregation.combine import apply_fedavg
from fcl_emu.aggregation.update import DELTA, Arrays, ClientUpdate
from fcl_emu.methods.base import ClientContext, ClientPart, Options, ServerPart
from fcl_emu.methods.models.state import read_only, strip_prefix
from fcl_emu.methods.datafree import soft_target_ce
from fcl_emu.methods.models.backbones import SplitBackbone
from fcl_emu.methods.models.classifier import IncrementalClassifier
from fcl_emu.methods.models.flows import ConditionalFlow
from fcl_emu.methods.models.state import load_arrays, state_to_arrays
from fcl_emu.methods.optim import LocalSGD
from fcl_emu.methods.registry import MethodSpec, register

NAME = "affcl"
FLOW = f"{NAME}/flow/"  # round tensors / uploads (deltas) / checkpoint: the federated flow
OLD_MODEL = f"{NAME}/old/model/"  # asset + checkpoint: the previous task's final classifier
OLD_FLOW = f"{NAME}/old/flow/"  # asset + checkpoint: the previous task's final flow
VAR_FLOOR = 1e-6


class AFFCLOptions(Options):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    flow_layers: int = pydantic.Field(4, ge=1, description="affine-coupling layers of the flow (code: 4)")
    flow_hidden: int = pydantic.Field(256, ge=1, description="hidden width of each coupling's conditioner "
                                                             "(code: 512; CPU-sized here)")
    flow_blocks: int = pydantic.Field(2, ge=0, description="residual blocks of each conditioner (code: 2)")
    flow_lr: float = pydantic.Field(1e-4, gt=0, description="Adam learning rate of the flow (code's README)")
    k_flow_last: float = pydantic.Field(0.4, ge=0, description="eq. 5: weight of the old flow's samples")
    k_loss_flow: float = pydantic.Field(0.5, ge=0, description="eq. 9: weight of the replay loss")
    k_kd_last: float = pydantic.Field(0.2, ge=0, description="weight of every distillation from the old model")
    k_kd_feature: float = pydantic.Field(0.5, ge=0, description="eq. 6: feature distillation (times k_kd_last)")
    k_kd_output: float = pydantic.Field(0.1, ge=0, description="output distillation (times k_kd_last)")
    theta: float = pydantic.Field(0.0, ge=0, le=1, description="explore-forget floor: the generated CE is scaled "
                                                               "by (1 - theta) p_bar + theta")
    temperature: float = pydantic.Field(2.0, gt=0, description="distillation temperature T")
    replay: Literal["step", "summed"] = pydantic.Field(
        "step", description="step: the replay loss takes its own Adam step on the neck (or head), as the code; "
                            "summed: it is added to the real batch's loss")
    replay_lr: float = pydantic.Field(1e-4, gt=0, description="Adam learning rate of the replay step (code: "
                                                              "its classifier lr)")
    credibility: Literal["latent", "feature"] = pydantic.Field(
        "latent", description="what eq. 8 compares with the local latent statistics: the generated sample's "
                              "latent (paper), or the generated feature (code)")
    classifier_optimizer: Literal["run", "adam"] = pydantic.Field(
        "run", description="the classifier's local optimiser: the run's (training.optimizer, lr, momentum, weight "
                           "decay), or Adam at classifier_lr (paper App. C.3 and code)")
    classifier_lr: float = pydantic.Field(
        1e-4, gt=0, description="Adam learning rate of the classifier with classifier_optimizer adam (paper: "
                                "1e-4; the code's CIFAR-100 command: 1e-3)")
    flow_input: Literal["standardized", "raw"] = pydantic.Field(
        "standardized", description="standardized: the flow models the features standardised by running "
                                    "per-dimension statistics; raw: the features as they are (code)")
    kd_classes: Literal["all", "old"] = pydantic.Field(
        "all", description="output distillation over all of the student's classes, the old model giving "
                           "none to those it lacks (code), or over the old classes only")


# ------------------------------------------------------------------ the model's split
def flow_dim(model: IncrementalClassifier) -> int:
    """Width of the flow's feature space: the embedding of a :class:`SplitBackbone`, else the features."""
    backbone = model.backbone
    return backbone.embed_dim if isinstance(backbone, SplitBackbone) else model.feature_dim


def embed(model: IncrementalClassifier, x: torch.Tensor) -> torch.Tensor:
    """``f(x)``: the features the flow models."""
    backbone = model.backbone
    return backbone.embed(x) if isinstance(backbone, SplitBackbone) else backbone(x)


def classify(model: IncrementalClassifier, h: torch.Tensor) -> torch.Tensor:
    """``c(h)``: the logits of features ``h`` of the flow's space."""
    backbone = model.backbone
    return model.head(backbone.from_embedding(h) if isinstance(backbone, SplitBackbone) else h)


def replay_parameters(model: IncrementalClassifier) -> list[torch.nn.Parameter]:
    """What the replay step trains: the neck of a :class:`SplitBackbone` (the code's ``fc2``), else the head."""
    backbone = model.backbone
    return list((backbone.neck if isinstance(backbone, SplitBackbone) else model.head).parameters())


# ------------------------------------------------------------------ loss terms
def flow_loss(flow: ConditionalFlow, h: torch.Tensor, y: torch.Tensor, h_old: torch.Tensor | None,
              y_old: torch.Tensor | None, k_flow_last: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 5: ``(L_flow, NLL of the real features, NLL of the old flow's samples)``; the last is 0 without
    them."""
    nll = -flow.log_prob(h, y)[0].mean()
    nll_old = -flow.log_prob(h_old, y_old)[0].mean() if h_old is not None and len(h_old) else nll * 0.0
    return nll + k_flow_last * nll_old, nll, nll_old


def feature_distillation(h: torch.Tensor, h_old: torch.Tensor) -> torch.Tensor:
    """Eq. 6: ``mean (h - h_old)^2`` over the batch and the feature dimensions."""
    if h.shape != h_old.shape:
        raise ValueError(f"features {tuple(h.shape)} and old features {tuple(h_old.shape)} differ")
    return (h - h_old).pow(2).mean()


def output_distillation(student: torch.Tensor, teacher: torch.Tensor, temperature: float,
                        all_classes: bool) -> torch.Tensor:
    """``KD_T``: soft-target cross-entropy of the student's ``K`` logits against the old model's ``K_old``.
    ``all_classes``: over all ``K`` (softmax over all of them; the teacher gives the last ``K - K_old`` no
    mass); else over the first ``K_old`` logits only."""
    k_old = teacher.shape[1]
    if student.ndim != 2 or student.shape[0] != teacher.shape[0] or student.shape[1] < k_old:
        raise ValueError(f"student logits {tuple(student.shape)} do not cover teacher logits {tuple(teacher.shape)}")
    if not all_classes:
        return soft_target_ce(student[:, :k_old], teacher, temperature)
    target = F.pad(F.softmax(teacher / temperature, dim=1), (0, student.shape[1] - k_old))
    return -(target * F.log_softmax(student / temperature, dim=1)).sum(dim=1).mean()


def latent_statistics(u: torch.Tensor, y: torch.Tensor, num_classes: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 7: per class, the mean and (biased) variance of the latents ``u`` (B, D) of the samples with
    that label: ``(mean (C, D), var (C, D), present (C,) bool)``; absent classes hold zeros."""
    if u.ndim != 2 or y.shape != (u.shape[0],):
        raise ValueError(f"latents {tuple(u.shape)} and labels {tuple(y.shape)} do not fit")
    onehot = F.one_hot(y.long(), num_classes).to(u.dtype)  # (B, C)
    count = onehot.sum(dim=0)
    present = count > 0
    mean = (onehot.T @ u) / count.clamp(min=1).unsqueeze(1)
    var = (onehot.T @ u.pow(2)) / count.clamp(min=1).unsqueeze(1) - mean.pow(2)
    return mean, var.clamp(min=0), present


def credibility(v: torch.Tensor, y_gen: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                present: torch.Tensor, fallback: torch.Tensor | float) -> torch.Tensor:
    """Eq. 8: each generated sample's point ``v`` (its latent or its feature, see ``AFFCLOptions.credibility``)
    scored by the mean per-dimension density under its class's local latent Gaussian; ``fallback`` (the real
    batch's ``p_bar``) for classes absent locally."""
    m, s2 = mean[y_gen], var[y_gen] + VAR_FLOOR
    density = torch.exp(-0.5 * (v - m).pow(2) / s2) / torch.sqrt(2 * torch.pi * s2)
    fallback = torch.as_tensor(fallback, dtype=v.dtype, device=v.device)
    return torch.where(present[y_gen], density.mean(dim=1), fallback)


def mean_density(log_prob: torch.Tensor, dim: int) -> torch.Tensor:
    """``p_bar = mean_i exp(log p(h_i | y_i) / D)``: the real batch's geometric-mean density per dimension."""
    return torch.exp(log_prob / dim).mean()


def generated_ce(logits: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, p_bar: torch.Tensor | float,
                 theta: float) -> torch.Tensor:
    """Eq. 9's replay term: ``((1 - theta) p_bar + theta) * mean_j w_j CE(logits_j, y_j)``."""
    return ((1 - theta) * p_bar + theta) * (F.cross_entropy(logits, y, reduction="none") * weights).mean()


# ---------------------------------------------------------------------- helpers
def build_flow(feature_dim: int, num_classes: int, o: AFFCLOptions,
               arrays: Mapping[str, np.ndarray] | None = None) -> ConditionalFlow:
    flow = ConditionalFlow(feature_dim, num_classes, o.flow_layers, o.flow_hidden, o.flow_blocks,
                           standardize=o.flow_input == "standardized")
    if arrays:
        load_arrays(flow, arrays)
    return flow


def _prefixed(prefix: str, arrays: Mapping[str, np.ndarray]) -> Arrays:
    return {prefix + k: v for k, v in arrays.items()}


# ------------------------------------------------------------------------ server
class AFFCLServer(ServerPart):
    """FedAvg of the classifier and the flow; the previous task's final pair goes to clients once per task."""

    options: AFFCLOptions
    summable = (DELTA, FLOW)  # the flow's deltas are averaged like the model's
    small_model = "cnn_leaky"  # the code's kind of feature space under model "auto"
    large_model = "resnet18"  # pooled features: a density over them is well-posed (the paper's backbone)

    def __init__(self, ctx):
        super().__init__(ctx)
        flow = build_flow(flow_dim(self.model), ctx.scenario.num_classes, self.options)
        self._flow: Arrays = read_only(state_to_arrays(flow))
        self._old: Arrays | None = None  # OLD_MODEL / OLD_FLOW arrays of the last finished task

    def round_tensors(self, task: int, round: int) -> Arrays:
        return {**self.global_state, **_prefixed(FLOW, self._flow)}

    def aggregate(self, task: int, round: int, updates: list[ClientUpdate]) -> None:
        super().aggregate(task, round, updates)
        self._flow = apply_fedavg(self._flow, updates, FLOW, self.ctx.aggregator)

    def end_task(self, task: int) -> None:
        super().end_task(task)
        self._old = {**_prefixed(OLD_MODEL, self.global_state), **_prefixed(OLD_FLOW, self._flow)}

    def task_assets(self, task: int) -> dict[str, Arrays]:
        return {"old_model": self._old} if task > 0 and self._old is not None else {}

    def state_arrays(self) -> Arrays:
        return {**super().state_arrays(), **_prefixed(FLOW, self._flow), **(self._old or {})}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        super().load_state_arrays(arrays)
        self._flow = read_only(strip_prefix(arrays, FLOW))
        old = {k: v for k, v in arrays.items() if k.startswith((OLD_MODEL, OLD_FLOW))}
        self._old = read_only(old) if old else None


# ------------------------------------------------------------------------ client
class AFFCLClient(ClientPart):
    options: AFFCLOptions

    @classmethod
    def work_per_sample(cls, options, batch_size: int, task: int) -> float:
        """A plain step, and from task 1 the old model's forward pass (1/3 of a step); the flow's own training on
        feature vectors is small beside the backbone and left out."""
        return 1.0 + (1.0 / 3.0 if task > 0 else 0.0)

    def begin_job(self, ctx: ClientContext, model) -> None:
        o = self.options
        dim = flow_dim(model)
        flow = build_flow(dim, ctx.dataset_classes, o, strip_prefix(ctx.global_state, FLOW))
        flow.to(ctx.device)
        old_model, old_flow = None, None
        old_arrays = strip_prefix(ctx.assets, OLD_MODEL)
        if old_arrays:
            old_model = ctx.frozen_model(old_arrays)
            if old_model.num_classes > model.num_classes:
                raise ValueError(f"affcl: the old model has {old_model.num_classes} classes, the student "
                                 f"{model.num_classes}")
            old_flow = build_flow(dim, ctx.dataset_classes, o, strip_prefix(ctx.assets, OLD_FLOW))
            old_flow.to(ctx.device).eval().requires_grad_(False)
        replay_opt = torch.optim.Adam(replay_parameters(model), lr=o.replay_lr) if o.replay == "step" else None
        ctx.job.update(flow=flow, start=read_only(state_to_arrays(flow)), old=old_model, old_flow=old_flow,
                       flow_opt=torch.optim.Adam(flow.parameters(), lr=o.flow_lr), replay_opt=replay_opt,
                       draw=torch.Generator().manual_seed(ctx.seed), sums={}, counts={})

    def make_optimizer(self, ctx: ClientContext, model) -> LocalSGD | torch.optim.Adam:
        """The run's optimiser, or Adam at ``classifier_lr`` (``classifier_optimizer``; the code's betas, no
        decay)."""
        if self.options.classifier_optimizer == "adam":
            return torch.optim.Adam(model.parameters(), lr=self.options.classifier_lr, betas=(0.9, 0.999))
        return super().make_optimizer(ctx, model)

    def _draw_labels(self, ctx: ClientContext, classes: int, n: int) -> torch.Tensor:
        return torch.randint(0, classes, (n,), generator=ctx.job["draw"]).to(ctx.device)

    def _train_flow(self, ctx: ClientContext, h: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """One Adam step of eq. 5 on the (detached) features."""
        job, o = ctx.job, self.options
        h_old = y_old = None
        if job["old_flow"] is not None and job["old"].num_classes > 0:
            y_old = self._draw_labels(ctx, job["old"].num_classes, len(y))
            with torch.no_grad():
                h_old = job["old_flow"].sample(y_old, job["draw"])[0]
        job["flow"].observe(h)
        loss, nll, nll_old = flow_loss(job["flow"], h, y, h_old, y_old, o.k_flow_last)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"client {ctx.client}: the flow's loss became {loss.item()}")
        job["flow_opt"].zero_grad(set_to_none=True)
        loss.backward()
        job["flow_opt"].step()
        return {"flow_nll": nll.detach(), "flow_nll_old": nll_old.detach()}

    def _replay_loss(self, ctx: ClientContext, model, h: torch.Tensor, y: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Eq. 7-9 under the updated flow: ``L_replay`` on ``B`` generated features, and its terms."""
        o, job = self.options, ctx.job
        flow, old = job["flow"], job["old"]
        with torch.no_grad():
            log_p, u = flow.log_prob(h, y)
            p_bar = mean_density(log_p - flow.input_log_det(), flow.dim)
            mean, var, present = latent_statistics(u, y, flow.num_classes)
            y_gen = self._draw_labels(ctx, model.num_classes, len(y))
            h_gen, u_gen = flow.sample(y_gen, job["draw"])
            weights = credibility(u_gen if o.credibility == "latent" else h_gen, y_gen, mean, var, present, p_bar)
        logits_gen = classify(model, h_gen)
        replay = generated_ce(logits_gen, y_gen, weights, p_bar, o.theta)
        terms = {"credibility": weights.mean(), "p_bar": p_bar,
                 "generated_agreement": (logits_gen.detach().argmax(dim=1) == y_gen).float().mean()}
        local = present[y_gen]
        if local.any():  # eq. 8's own density, on the samples of classes in the batch (the others get p_bar)
            terms["credibility_local"] = weights[local].mean()
        if old is not None:
            with torch.no_grad():
                teacher = classify(old, h_gen)
            kd_gen = output_distillation(logits_gen, teacher, o.temperature, o.kd_classes == "all")
            replay = replay + o.k_kd_last * o.k_kd_output * kd_gen
            terms["kd_generated"] = kd_gen.detach()
        replay = o.k_loss_flow * replay
        terms["replay"] = replay.detach()
        return replay, terms

    def step_loss(self, ctx: ClientContext, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o, job = self.options, ctx.job
        h = embed(model, x)
        terms = self._train_flow(ctx, h.detach(), y)
        replay, replay_terms = self._replay_loss(ctx, model, h.detach(), y)
        terms.update(replay_terms)
        if job["replay_opt"] is not None:  # the code's own step on the neck (or head), before the real batch's
            job["replay_opt"].zero_grad(set_to_none=True)
            replay.backward()
            job["replay_opt"].step()
        logits = classify(model, h)  # after that step: it changed the layers above h
        loss = F.cross_entropy(logits, y)
        old = job["old"]
        if old is not None:
            with torch.no_grad():
                h_old = embed(old, x)
                teacher = classify(old, h_old)
            kd_feature = feature_distillation(h, h_old)
            kd_output = output_distillation(logits, teacher, o.temperature, o.kd_classes == "all")
            loss = loss + o.k_kd_last * (o.k_kd_feature * kd_feature + o.k_kd_output * kd_output)
            terms.update(kd_feature=kd_feature.detach(), kd_output=kd_output.detach())
        for name, value in terms.items():
            job["sums"][name] = job["sums"].get(name, 0.0) + float(value)
            job["counts"][name] = job["counts"].get(name, 0) + 1
        return loss if job["replay_opt"] is not None else loss + replay

    def after_training(self, ctx: ClientContext, model) -> Arrays:
        job = ctx.job
        ctx.metrics.update({k: v / job["counts"][k] for k, v in job["sums"].items()})
        new = state_to_arrays(job["flow"].cpu())
        return {FLOW + k: new[k] - job["start"][k] for k in new}


SPEC = register(MethodSpec(
    name=NAME,
    description="AF-FCL (Wuerkaixi et al., ICLR 2024): a federated class-conditional normalizing flow over "
                "features replays old classes, each generated feature weighted by its credibility under the "
                "client's own data (accurate forgetting)",
    options=AFFCLOptions, server=AFFCLServer, client=AFFCLClient,
))
