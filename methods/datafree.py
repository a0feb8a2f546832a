"""Loss terms and tools shared by the data-free generative methods (MFCL, TARGET, LANDER).

All three invert a frozen classifier: a generator is trained so that the
classifier's BatchNorm layers see the statistics they stored while training on
real data (DeepInversion, Yin et al. CVPR 2020), and so that the classifier
is confident on, and spread over, the classes it knows. The papers use two
forms of the BatchNorm term (:class:`BatchNormStatistics`):

- ``"kl"`` (MFCL's code): per layer, the channel mean of
  ``KL(N(mu_run, var_run) || N(mu_batch, var_batch))``, averaged over the layers;
- ``"l2"`` (DeepInversion, TARGET, LANDER): per layer
  ``||var_run - var_batch||_2 + ||mu_run - mu_batch||_2`` (norms, not squared),
  summed over the layers.

Statistics are those of each BatchNorm layer's input over (batch, height,
width), the biased variance as BatchNorm itself computes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fcl_emu.methods import jobs
from fcl_emu.methods.models.classifier import IncrementalClassifier, build_model
from fcl_emu.methods.models.state import load_arrays, state_to_arrays
from fcl_emu.scenario.transforms import random_crop_flip

__all__ = ["BatchNormStatistics", "information_entropy_loss", "smoothness_prior", "soft_target_ce",
           "adversarial_divergence", "frozen_classifier", "to_uint8", "from_uint8",
           "bounding_loss", "SynthesisSettings", "SynthesisProblem", "synthesize", "normalizer"]


class BatchNormStatistics:
    """Forward hooks on every ``BatchNorm2d`` of ``model`` that measure how far a batch's statistics are from
    the stored running ones. Use as a context manager; :meth:`loss` after each forward pass.

    ``momentum`` (TARGET / LANDER's ``bn_mmt``, 0.9 in their code; 0 = off) blends the batch statistics with
    an exponential average of earlier synthesis rounds' (:meth:`end_round` updates it), so that a round's
    batch is pushed towards the running statistics together with the batches before it.
    """

    def __init__(self, model: nn.Module, form: str = "l2", momentum: float = 0.0):
        if form not in ("kl", "l2"):
            raise ValueError(f"BatchNorm statistics loss form must be 'kl' or 'l2', got {form!r}")
        self.form, self.momentum = form, momentum
        self.layers = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no BatchNorm2d layer: data-free synthesis needs stored "
                             f"BatchNorm statistics (use a model with BatchNorm, such as cnn_bn or resnet32)")
        self._terms: list[torch.Tensor] = []
        self._batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ema: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._handles: list = []
        self.active = True  # False: forward passes are not measured (a teacher used for something else)

    def __enter__(self) -> BatchNormStatistics:
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.layers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, index: int):
        def hook(module: nn.BatchNorm2d, inputs, output) -> None:
            if not self.active:
                return
            x = inputs[0]
            mean = x.mean(dim=(0, 2, 3))
            var = x.var(dim=(0, 2, 3), unbiased=False)
            self._batch.append((mean.detach(), var.detach()))
            if self._ema is not None and self.momentum > 0:
                ema_mean, ema_var = self._ema[index]
                mean = (1 - self.momentum) * mean + self.momentum * ema_mean
                var = (1 - self.momentum) * var + self.momentum * ema_var
            self._terms.append(self.distance(mean, var, module.running_mean, module.running_var))
        return hook

    def distance(self, mean: torch.Tensor, var: torch.Tensor, run_mean: torch.Tensor,
                 run_var: torch.Tensor) -> torch.Tensor:
        """The term of one layer (see the module docstring)."""
        if self.form == "l2":
            return torch.linalg.vector_norm(run_var - var) + torch.linalg.vector_norm(run_mean - mean)
        var = var + 1e-8
        kl = 0.5 * torch.log(var / run_var) + (run_var + (run_mean - mean) ** 2) / (2 * var) - 0.5
        return kl.mean()

    def loss(self) -> torch.Tensor:
        """The term of the forward pass(es) since the last call: summed (``l2``) or averaged (``kl``) over
        the layers; the measured batch statistics are kept for :meth:`end_round`."""
        if not self._terms:
            raise RuntimeError("no forward pass through the model since the last loss()")
        terms, self._terms = self._terms, []
        total = torch.stack(terms).sum()
        return total / len(terms) if self.form == "kl" else total

    def end_round(self) -> None:
        """Fold the last measured batch statistics into the exponential average (``momentum > 0``)."""
        last = self._batch[-len(self.layers):]
        self._batch = []
        if len(last) != len(self.layers):
            return
        if self._ema is None:
            self._ema = last
        else:
            m = self.momentum
            self._ema = [(m * em + (1 - m) * bm, m * ev + (1 - m) * bv)
                         for (em, ev), (bm, bv) in zip(self._ema, last)]


def information_entropy_loss(logits: torch.Tensor) -> torch.Tensor:
    """MFCL's diversity term: ``1 - H(p_mean) / log K`` with ``p_mean`` the batch mean of the softmax over
    the ``K`` classes. In [0, 1]; 0 when the batch covers the classes evenly."""
    k = logits.shape[1]
    if k < 2:
        return logits.sum() * 0.0
    p = F.softmax(logits, dim=1).mean(dim=0)
    return 1.0 + (p * torch.log(p.clamp_min(1e-12))).sum() / math.log(k)


def _gaussian_kernel(size: int, sigma: float, channels: int, device: torch.device) -> torch.Tensor:
    r = torch.arange(size, dtype=torch.float32, device=device) - (size - 1) / 2
    g = torch.exp(-(r ** 2) / (2 * sigma ** 2))
    k2 = torch.outer(g, g)
    k2 = k2 / k2.sum()
    return k2.expand(channels, 1, size, size).contiguous()


def smoothness_prior(x: torch.Tensor, size: int = 5, sigma: float = 1.0) -> torch.Tensor:
    """MFCL's image prior: mean squared difference between the images and their Gaussian-blurred copy
    (``size`` x ``size`` kernel, std ``sigma``, reflect padding). 0 for a constant image."""
    c = x.shape[1]
    pad = size // 2
    blurred = F.conv2d(F.pad(x, (pad,) * 4, mode="reflect"), _gaussian_kernel(size, sigma, c, x.device).to(x.dtype),
                       groups=c)
    return F.mse_loss(x, blurred)


def soft_target_ce(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``-1/B sum_i sum_k softmax(t_i / T)_k log softmax(s_i / T)_k``: the distillation loss of iCaRL /
    LwF / TARGET / LANDER (no ``T^2`` factor). It equals KL plus the teacher's entropy, a constant."""
    if student.shape != teacher.shape:
        raise ValueError(f"student logits {tuple(student.shape)} and teacher logits {tuple(teacher.shape)} differ")
    if student.numel() == 0:
        return student.sum() * 0.0
    p = F.softmax(teacher / temperature, dim=1)
    return -(p * F.log_softmax(student / temperature, dim=1)).sum(dim=1).mean()


def adversarial_divergence(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """TARGET / LANDER's adversarial term: ``-mean_i(m_i * KL(softmax(t_i) || softmax(s_i)))`` with
    ``m_i = 1`` where the teacher's and the student's top classes agree. Minimising it makes the generator
    produce samples the student has not learnt to imitate yet (it never pushes on samples already in
    dispute)."""
    agree = (teacher.argmax(dim=1) == student.argmax(dim=1)).float()
    kl = F.kl_div(F.log_softmax(student, dim=1), F.log_softmax(teacher, dim=1), reduction="none",
                  log_target=True).sum(dim=1)
    return -(agree * kl).mean()


def bounding_loss(projected: torch.Tensor, anchors: torch.Tensor, radius: float) -> torch.Tensor:
    """LANDER's Bounding loss as its official code computes it: ``max(0, MSE(projected, anchors) - r)``, the
    mean squared error over the batch and the embedding dimensions, pulled inside a ball of radius ``r``
    around the label-text embeddings and left free within it."""
    return F.relu(F.mse_loss(projected, anchors) - radius)


def frozen_classifier(model_name: str, input_shape, arrays: Mapping[str, np.ndarray],
                      device: torch.device) -> IncrementalClassifier:
    """A classifier with these weights, in eval mode, without gradients (a teacher)."""
    head = int(arrays["head.weight"].shape[0])
    model = load_arrays(build_model(model_name, tuple(input_shape), head), arrays).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def sample_teacher(input_shape: tuple[int, int, int], classes: int) -> dict[str, np.ndarray]:
    """A synthesis job's inputs, ``model/<key>``: a ``cnn_bn`` classifier with random weights from seed 0 and
    BatchNorm statistics of three batches of 64 random images (what the job inverts); torch's RNG left as it
    was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model("cnn_bn", tuple(input_shape), classes).train()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(64, *input_shape) * 0.8 + 0.2)
    return {"model/" + k: v for k, v in state_to_arrays(model.eval()).items()}


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Images in [0, 1] as uint8 (what the official code's PNG files hold; a quarter of float32's bytes)."""
    return (images.detach().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()


def from_uint8(images: np.ndarray, mean, std) -> torch.Tensor:
    """uint8 images back to float, normalised with the data set's per-channel ``mean`` and ``std``."""
    return normalizer(mean, std, torch.device("cpu"))(torch.from_numpy(np.asarray(images, dtype=np.float32) / 255.0))


@dataclass(frozen=True)
class SynthesisSettings:
    """The synthesis loop of TARGET and LANDER (both from Fast-Datafree / NAYER lineages; see :func:`synthesize`)."""

    rounds: int  # synthesis rounds, one kept batch each (after the warm-up, where keep_warmup is off)
    warmup: int  # rounds before the adversarial term and the student's training start
    steps: int  # generator steps per round
    batch: int  # images per round
    lr_generator: float
    lr_inputs: float  # learnable inputs of a round (TARGET's z, LANDER's data statistics)
    w_bn: float
    w_oh: float
    w_adv: float
    bn_momentum: float  # TARGET / LANDER's bn_mmt
    student_steps: int  # student distillation steps after each round past the warm-up
    student_lr: float
    student_temperature: float
    student_batch: int
    keep_warmup: bool  # keep the warm-up rounds' images (TARGET) or not (LANDER)
    flip: bool  # horizontal flips in the augmentation (off for digits and letters)


class SynthesisProblem:
    """What TARGET and LANDER do differently inside :func:`synthesize`."""

    generator: nn.Module

    def begin_round(self, round: int) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
        """The generator input and the target classes of this round, and extra Adam parameter groups."""
        raise NotImplementedError

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] as the teacher sees them."""
        raise NotImplementedError

    def extra_loss(self, teacher_features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | float:
        """A method's own generator term (default: none)."""
        return 0.0

    def student_extra(self, student_features: torch.Tensor, teacher_features: torch.Tensor) -> torch.Tensor | float:
        """A method's own student term (default: none)."""
        return 0.0

    def student_parameters(self) -> list[torch.Tensor]:
        """Parameters the student trains besides its network's (default: none)."""
        return []


def synthesize(teacher: IncrementalClassifier, student: IncrementalClassifier, problem: SynthesisProblem,
               s: SynthesisSettings, data_normalize, seed: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Invert ``teacher`` into a synthetic set (TARGET's server step; LANDER's with its problem).

    Each round: Adam over the generator (``lr_generator``) and the round's learnable inputs, ``steps`` times
    ``L = w_bn L_BN(l2) + w_oh CE(T(x), targets) + w_adv L_adv(T(x), S(x)) + extra``, the images augmented
    (random crop, flips) before the teacher sees them; ``L_adv`` (:func:`adversarial_divergence`) only after
    ``warmup`` rounds. The lowest-loss batch of the round is kept. After each round past the warm-up the
    student imitates the teacher on every kept image (``T^2 KL`` at ``student_temperature``, SGD with
    momentum 0.9, weight decay 1e-4), so later rounds look for what it has not learnt yet. In the generator's
    steps the student's parameters are out of autograd: the adversarial term needs its gradients with respect
    to the images only.
    Returns the kept images in [0, 1] (``(N, C, H, W)``, on the CPU) and loss metrics.
    """
    gen = torch.Generator().manual_seed(seed)
    device = next(teacher.parameters()).device
    kept: list[torch.Tensor] = []
    metrics: dict[str, float] = {}
    done, total = 0, s.rounds * s.steps + max(0, s.rounds - s.warmup) * s.student_steps  # the job's steps
    with BatchNormStatistics(teacher, "l2", s.bn_momentum) as bn:
        for r in range(s.rounds):
            inputs, targets, extra_groups = problem.begin_round(r)
            opt = torch.optim.Adam([{"params": problem.generator.parameters(), "lr": s.lr_generator},
                                    *extra_groups], betas=(0.5, 0.999))
            adversarial = s.w_adv > 0 and r >= s.warmup
            student.eval().requires_grad_(False)  # the generator's steps need gradients through it, not its own
            best, best_loss = None, math.inf
            for _ in range(s.steps):
                jobs.step(done, total)
                done += 1
                images = problem.generator(inputs)
                seen = problem.normalize(random_crop_flip(images, gen, flip=s.flip))
                t_feat = teacher.backbone(seen)
                t_out = teacher.head(t_feat)
                terms = {"bn": bn.loss(), "oh": F.cross_entropy(t_out, targets)}
                loss = s.w_bn * terms["bn"] + s.w_oh * terms["oh"] + problem.extra_loss(t_feat, targets)
                if adversarial:
                    terms["adv"] = adversarial_divergence(t_out, student(seen))
                    loss = loss + s.w_adv * terms["adv"]
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"synthesis loss became {loss.item()} in round {r}")
                if loss.item() < best_loss:
                    best, best_loss = images.detach().clone(), loss.item()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            bn.end_round()
            metrics.update({f"final_{k}": v.item() for k, v in terms.items()})
            if r >= s.warmup or s.keep_warmup:
                kept.append(best.cpu())
            if r >= s.warmup and s.student_steps:
                bn.active = False
                student.requires_grad_(True)
                metrics["student_kd"] = _train_student(teacher, student, problem, torch.cat(kept), s,
                                                       data_normalize, gen, device)
                done += s.student_steps
                jobs.step(done, total)
                bn.active = True
    if not kept:
        raise ValueError(f"synthesis kept no images: rounds ({s.rounds}) must exceed warmup ({s.warmup}) when "
                         f"the warm-up rounds are not kept")
    return torch.cat(kept), metrics


def _train_student(teacher, student, problem: SynthesisProblem, images: torch.Tensor, s: SynthesisSettings,
                   data_normalize, gen: torch.Generator, device) -> float:
    opt = torch.optim.SGD([*student.parameters(), *problem.student_parameters()], lr=s.student_lr, momentum=0.9,
                          weight_decay=1e-4)
    student.train()
    t = s.student_temperature
    total = 0.0
    for _ in range(s.student_steps):
        idx = torch.randint(0, len(images), (min(s.student_batch, len(images)),), generator=gen)
        x = data_normalize(random_crop_flip(images[idx].to(device), gen, flip=s.flip))
        with torch.no_grad():
            t_feat = teacher.backbone(x)
            t_out = teacher.head(t_feat)
        s_feat = student.backbone(x)
        kd = F.kl_div(F.log_softmax(student.head(s_feat) / t, dim=1), F.log_softmax(t_out / t, dim=1),
                      reduction="batchmean", log_target=True) * t * t
        loss = kd + problem.student_extra(s_feat, t_feat)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total = kd.item()
    student.eval()
    return total


def normalizer(mean, std, device: torch.device):
    """``x -> (x - mean) / std`` per channel."""
    m = torch.as_tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    sd = torch.as_tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return lambda x: (x - m) / sd
