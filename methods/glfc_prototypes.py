"""GLFC's client-side samples (Dong et al., CVPR 2022; :mod:`fcl_emu.methods.glfc` describes the method): iCaRL's
herding for the exemplar memory, the class prototype, and the prototype's perturbation before its gradient is
sent (eq. 10-11) in the official code's form (:func:`perturb_prototype`) or the paper's
(:func:`perturb_prototype_paper`)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fcl_emu.methods.glfc_losses import class_bce
from fcl_emu.methods.optim import LocalSGD

PERTURB_WEIGHT_DECAY = 1e-5  # the code's SGD on the prototype; the paper names none (negligible at 100 steps)


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


def _input_noise(x: torch.Tensor, noise: float, generator: torch.Generator) -> torch.Tensor:
    return x + noise * torch.randn(x.shape, generator=generator) if noise > 0 else x


def perturb_prototype(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, noise: float,
                      form: str, generator: torch.Generator) -> torch.Tensor:
    """The code's form: the prototype after ``steps`` SGD steps (weight decay 1e-5) that lower ``model``'s loss
    of label ``y`` (:func:`class_bce` in the run's form), plus Gaussian noise of std ``noise``."""
    x = x.detach().clone().requires_grad_(True)
    opt = LocalSGD([x], lr=lr, weight_decay=PERTURB_WEIGHT_DECAY)
    for _ in range(steps):
        logits = model(x)
        loss = class_bce(logits, F.one_hot(y, logits.shape[1]).float(), form).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return _input_noise(x.detach(), noise, generator)


def feature_noise_std(class_features: torch.Tensor, gamma: float) -> torch.Tensor:
    """The std of the paper's latent noise, per feature dimension: ``gamma`` times the square root of the class's
    feature variance (over all its samples, population variance: 0 for a class of one sample)."""
    return gamma * class_features.detach().var(dim=0, correction=0).sqrt()


def perturb_prototype_paper(model: nn.Module, x: torch.Tensor, y: torch.Tensor, class_features: torch.Tensor,
                            steps: int, lr: float, gamma: float, noise: float, form: str,
                            generator: torch.Generator) -> torch.Tensor:
    """The paper's form (eq. 10-11): ``steps`` SGD steps (lr ``lr``, weight decay 1e-5) on the prototype that
    lower the loss of label ``y`` predicted from its latent feature plus Gaussian noise ``gamma N(0, sigma^2)``,
    ``sigma^2`` the per-dimension variance of the class's features ``class_features`` (:func:`feature_noise_std`),
    a fresh draw at every step; then Gaussian input noise of std ``noise`` (0: none). ``model`` needs
    ``features`` and ``head`` (:class:`~fcl_emu.methods.models.classifier.IncrementalClassifier`)."""
    std = feature_noise_std(class_features, gamma)
    x = x.detach().clone().requires_grad_(True)
    opt = LocalSGD([x], lr=lr, weight_decay=PERTURB_WEIGHT_DECAY)
    for _ in range(steps):
        h = model.features(x)
        logits = model.head(h + std * torch.randn(h.shape, generator=generator))
        loss = class_bce(logits, F.one_hot(y, logits.shape[1]).float(), form).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return _input_noise(x.detach(), noise, generator)
