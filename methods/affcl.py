"""AF-FCL: accurate forgetting with a federated normalizing flow over features.

Wuerkaixi, Cui, Zhang, Yan, Han, Niu, Fang, Zhang and Sugiyama, "Accurate
Forgetting for Heterogeneous Federated Continual Learning", ICLR 2024
(arXiv:2502.14205; the authors' code is zaocan666/AF-FCL, "PreciseFCL").
Equation numbers follow the paper as cited in this project's issue; the
paper's method section could not be read here, so the exact forms below are
the authors' code's, each named where it matters.

**Model.** The classifier splits into a feature extractor ``h = f(x)`` (the
backbone, :class:`~methods.models.classifier.IncrementalClassifier`) and the
head. A class-conditional normalizing flow ``u = g(h; y)``
(:class:`~methods.models.flows.ConditionalFlow`, affine couplings, conditioned
on the one-hot class over the data set's label space) models ``p(h | y)``:

    log p(h | y) = log N(g(h; y); 0, I) + log |det dg/dh|.

The flow is trained with FedAvg together with the classifier: its weights ride
with the model in every ``train_request`` as ``affcl/flow/<param>`` and come
back as deltas under the same names (``summable = (DELTA, FLOW)``).

**Client, one local step** on a real batch ``(x, y)`` (B samples), ``K`` the
classes seen so far, ``K_old`` those of the old model (the previous task's
final global classifier ``f_old``/``head_old`` and flow ``g_old``, received
once per task as the ``old_model`` asset ``affcl/old/{model,flow}/...``):

1. Flow (eq. 5), on the features ``h = f(x)`` (detached: the flow's loss does
   not train the extractor) and ``B`` features ``h~`` sampled from ``g_old``
   for labels ``y~`` drawn uniformly from the ``K_old`` old classes::

       L_flow = -mean log p(h | y) - k_flow_last * mean log p(h~ | y~)

   one Adam step on the flow's weights (lr ``flow_lr``).
2. Accurate forgetting (eq. 7-8). The local features' latents ``u = g(h; y)``
   under the updated flow give per-class diagonal Gaussians
   ``mu_c = mean(u | y = c)``, ``var_c = mean((u - mu_c)^2 | y = c)`` (eq. 7,
   over the batch, as the code). ``B`` features are generated from the flow,
   ``h^ = g^{-1}(u^; y^)``, ``u^ ~ N(0, I)``, ``y^`` uniform over the ``K``
   seen classes. Each gets the credibility (eq. 8)::

       w = mean_d N(u^_d; mu_{y^,d}, var_{y^,d} + 1e-6)     (y^ present in the batch)
       w = p_bar = mean_i exp(log p(h_i | y_i) / D)         (otherwise)

   the mean over the ``D`` dimensions of the per-dimension Gaussian density
   (code); ``p_bar`` is the real batch's geometric-mean density per dimension.
   The weight is a constant (no gradient).
3. Classifier (eq. 6 and 9), one step of the run's optimiser::

       L = CE(head(h), y)
         + k_kd_last * (k_kd_feature * mean (h - f_old(x))^2                       (eq. 6)
                        + k_kd_output * KD_T(head(h)[:, :K_old], head_old(f_old(x))))
         + k_loss_flow * (((1 - theta) p_bar + theta) * mean_j w_j CE(head(h^_j), y^_j)   (eq. 9)
                          + k_kd_last * k_kd_output * KD_T(head(h^)[:, :K_old], head_old(h^)))

   ``KD_T`` is the soft-target cross-entropy at ``T = 2``
   (:func:`methods.datafree.soft_target_ce`, the code's form, no ``T^2``).
   Terms with the old model vanish in the first task; generated features are
   replayed from the first task on (code).

Defaults, all from the code's ``main.py`` (the paper's hyper-parameter table
was not at hand): ``k_flow_last = 0.4``, ``k_loss_flow = 0.1``,
``k_kd_last = 0.2``, ``k_kd_feature = 0.5``, ``k_kd_output = 0.1``,
``theta = 0.2`` (``flow_explore_theta``), ``flow_lr = 1e-4`` (Adam),
``flow_layers = 4`` (model.py), ``temperature = 2``.

Deviations, on purpose:

- CPU-sized flow: each coupling's conditioner is a two-hidden-layer MLP of
  ``flow_hidden = 128`` units; the code uses residual nets of 512 units
  (two blocks) on 512-d features, several times the classifier's size on the
  wire. Coupling scales are ``exp(tanh(.))`` (the code's nflows uses a shifted
  sigmoid); see :mod:`methods.models.flows`.
- Credibility in the flow's latent space: the code compares the *generated
  features* ``h^`` with the statistics of the local *latents* ``u``; here the
  generated sample's own latent ``u^`` is compared (eq. 7-8 put both in the
  latent space). The variance gets a floor of 1e-6 (code: 1e-30).
- One optimiser step for the classifier: the code takes a separate step on
  the head's last layers for the generated-feature term before the step on
  the real batch; here both terms are summed into one step (the generated
  term reaches only the head either way). The classifier uses the run's
  optimiser (``training``: SGD), not the code's Adam at lr 1e-4.
- Not implemented: the code's distillation from the current global
  classifier (``k_kd_global_cls``, 0 by default there) and its
  ``classifier_global_mode`` variants (the whole classifier is federated).
- The flow's Adam state starts afresh every training job (a round).

Secure aggregation: the flow's deltas are summable under the model delta's
rule (a sample-weighted mean), but SecAgg's layout (:class:`methods.base.DeltaLayout`)
masks ``delta/`` tensors only, so ``--secagg`` with affcl is refused at
config time, naming ``affcl/flow/``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pydantic
import torch
import torch.nn.functional as F

from methods.base import (DELTA, Arrays, ClientContext, ClientPart, ClientUpdate, Options, ServerPart,
                          _frozen_copy, apply_fedavg, strip_prefix)
from methods.datafree import soft_target_ce
from methods.models.flows import ConditionalFlow
from methods.models.state import load_arrays, state_to_arrays
from methods.registry import MethodSpec, register

NAME = "affcl"
FLOW = f"{NAME}/flow/"  # round tensors / uploads (deltas) / checkpoint: the federated flow
OLD_MODEL = f"{NAME}/old/model/"  # asset + checkpoint: the previous task's final classifier
OLD_FLOW = f"{NAME}/old/flow/"  # asset + checkpoint: the previous task's final flow
VAR_FLOOR = 1e-6


class AFFCLOptions(Options):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    flow_layers: int = pydantic.Field(4, ge=1, description="affine-coupling layers of the flow (code: 4)")
    flow_hidden: int = pydantic.Field(128, ge=1, description="hidden width of each coupling's conditioner "
                                                             "(code: 512; CPU-sized here)")
    flow_lr: float = pydantic.Field(1e-4, gt=0, description="Adam learning rate of the flow (code)")
    k_flow_last: float = pydantic.Field(0.4, ge=0, description="eq. 5: weight of the old flow's samples")
    k_loss_flow: float = pydantic.Field(0.1, ge=0, description="eq. 9: weight of the generated-feature terms")
    k_kd_last: float = pydantic.Field(0.2, ge=0, description="weight of every distillation from the old model")
    k_kd_feature: float = pydantic.Field(0.5, ge=0, description="eq. 6: feature distillation (times k_kd_last)")
    k_kd_output: float = pydantic.Field(0.1, ge=0, description="output distillation (times k_kd_last)")
    theta: float = pydantic.Field(0.2, ge=0, le=1, description="explore-forget floor: the generated CE is scaled "
                                                               "by (1 - theta) p_bar + theta")
    temperature: float = pydantic.Field(2.0, gt=0, description="distillation temperature T")


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


def credibility(u_gen: torch.Tensor, y_gen: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                present: torch.Tensor, fallback: torch.Tensor | float) -> torch.Tensor:
    """Eq. 8: each generated latent's mean per-dimension density under its class's local Gaussian;
    ``fallback`` (the real batch's ``p_bar``) for classes absent locally."""
    m, v = mean[y_gen], var[y_gen] + VAR_FLOOR
    density = torch.exp(-0.5 * (u_gen - m).pow(2) / v) / torch.sqrt(2 * torch.pi * v)
    fallback = torch.as_tensor(fallback, dtype=u_gen.dtype, device=u_gen.device)
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
    flow = ConditionalFlow(feature_dim, num_classes, o.flow_layers, o.flow_hidden)
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

    def __init__(self, ctx):
        super().__init__(ctx)
        flow = build_flow(self.model.feature_dim, ctx.scenario.num_classes, self.options)
        self._flow: Arrays = _frozen_copy(state_to_arrays(flow))
        self._old: Arrays | None = None  # OLD_MODEL / OLD_FLOW arrays of the last finished task

    def round_tensors(self, task: int, round: int) -> Arrays:
        return {**self.global_state, **_prefixed(FLOW, self._flow)}

    def aggregate(self, task: int, round: int, updates: list[ClientUpdate]) -> None:
        super().aggregate(task, round, updates)
        self._flow = apply_fedavg(self._flow, updates, FLOW)

    def end_task(self, task: int) -> None:
        super().end_task(task)
        self._old = {**_prefixed(OLD_MODEL, self.global_state), **_prefixed(OLD_FLOW, self._flow)}

    def task_assets(self, task: int) -> dict[str, Arrays]:
        return {"old_model": self._old} if task > 0 and self._old is not None else {}

    def state_arrays(self) -> Arrays:
        return {**super().state_arrays(), **_prefixed(FLOW, self._flow), **(self._old or {})}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        super().load_state_arrays(arrays)
        self._flow = _frozen_copy(strip_prefix(arrays, FLOW))
        old = {k: v for k, v in arrays.items() if k.startswith((OLD_MODEL, OLD_FLOW))}
        self._old = _frozen_copy(old) if old else None


# ------------------------------------------------------------------------ client
class AFFCLClient(ClientPart):
    options: AFFCLOptions

    def begin_job(self, ctx: ClientContext, model) -> None:
        o = self.options
        flow = build_flow(model.feature_dim, ctx.dataset_classes, o, strip_prefix(ctx.global_state, FLOW))
        flow.to(ctx.device)
        old_model, old_flow = None, None
        old_arrays = strip_prefix(ctx.assets, OLD_MODEL)
        if old_arrays:
            old_model = ctx.frozen_model(old_arrays)
            if old_model.num_classes > model.num_classes:
                raise ValueError(f"affcl: the old model has {old_model.num_classes} classes, the student "
                                 f"{model.num_classes}")
            old_flow = build_flow(model.feature_dim, ctx.dataset_classes, o, strip_prefix(ctx.assets, OLD_FLOW))
            old_flow.to(ctx.device).eval().requires_grad_(False)
        ctx.job.update(flow=flow, start=_frozen_copy(state_to_arrays(flow)), old=old_model, old_flow=old_flow,
                       flow_opt=torch.optim.Adam(flow.parameters(), lr=o.flow_lr),
                       draw=torch.Generator().manual_seed(ctx.seed), sums={}, steps=0)

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
        loss, nll, nll_old = flow_loss(job["flow"], h, y, h_old, y_old, o.k_flow_last)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"client {ctx.client}: the flow's loss became {loss.item()}")
        job["flow_opt"].zero_grad(set_to_none=True)
        loss.backward()
        job["flow_opt"].step()
        return {"flow_nll": nll.detach(), "flow_nll_old": nll_old.detach()}

    def step_loss(self, ctx: ClientContext, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o, job = self.options, ctx.job
        h = model.backbone(x)
        logits = model.head(h)
        terms = self._train_flow(ctx, h.detach(), y)
        flow, old = job["flow"], job["old"]
        with torch.no_grad():  # eq. 7-8 under the updated flow
            log_p, u = flow.log_prob(h.detach(), y)
            p_bar = mean_density(log_p, flow.dim)
            mean, var, present = latent_statistics(u, y, flow.num_classes)
            y_gen = self._draw_labels(ctx, model.num_classes, len(y))
            h_gen, u_gen = flow.sample(y_gen, job["draw"])
            weights = credibility(u_gen, y_gen, mean, var, present, p_bar)
        logits_gen = model.head(h_gen)
        replay = generated_ce(logits_gen, y_gen, weights, p_bar, o.theta)
        loss = F.cross_entropy(logits, y)
        if old is not None:
            k_old = old.num_classes
            with torch.no_grad():
                h_old = old.backbone(x)
                t_real, t_gen = old.head(h_old), old.head(h_gen)
            kd_feature = feature_distillation(h, h_old)
            kd_output = soft_target_ce(logits[:, :k_old], t_real, o.temperature)
            kd_gen = soft_target_ce(logits_gen[:, :k_old], t_gen, o.temperature)
            loss = loss + o.k_kd_last * (o.k_kd_feature * kd_feature + o.k_kd_output * kd_output)
            replay = replay + o.k_kd_last * o.k_kd_output * kd_gen
            terms.update(kd_feature=kd_feature.detach(), kd_output=kd_output.detach(), kd_generated=kd_gen.detach())
        terms.update(credibility=weights.mean(), p_bar=p_bar, replay=replay.detach())
        for name, value in terms.items():
            job["sums"][name] = job["sums"].get(name, 0.0) + float(value)
        job["steps"] += 1
        return loss + o.k_loss_flow * replay

    def after_training(self, ctx: ClientContext, model) -> Arrays:
        job = ctx.job
        if job["steps"]:
            ctx.metrics.update({k: v / job["steps"] for k, v in job["sums"].items()})
        new = state_to_arrays(job["flow"].cpu())
        return {FLOW + k: new[k] - job["start"][k] for k in new}


SPEC = register(MethodSpec(
    name=NAME,
    description="AF-FCL (Wuerkaixi et al., ICLR 2024): a federated class-conditional normalizing flow over "
                "features replays old classes, each generated feature weighted by its credibility under the "
                "client's own data (accurate forgetting)",
    options=AFFCLOptions, server=AFFCLServer, client=AFFCLClient,
))
