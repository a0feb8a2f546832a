"""Variational auto-encoders over feature vectors, and a classifier made of one VAE per class.

:class:`VAE` is the MLP VAE of FedCBC's official code (SkyOfBeginning/FedCBC,
``models/VAE_PRETRAINED.py``): encoder ``Linear(d, h) - tanh`` into two linear
maps to the latent mean and log-variance, decoder ``Linear(k, h) - tanh -
Linear(h, d)``, ending in a sigmoid as the code's does (``sigmoid_output``:
outputs in ``(0, 1)``, as pixels are) or linearly (features of the project's
backbones, which end in a ReLU and average pooling: non-negative but not
bounded by 1). The sigmoid has no parameters: both have the same state.

Loss (FedCBC eq. 5, the code's ``loss_fn``), per sample::

    l(x) = ||x - dec(z)||^2 + beta * KL(N(mu(x), diag sigma^2(x)) || N(0, I))

with ``z = mu + sigma * eps`` while training; the batch loss is the mean of
``l`` over the batch (the code's sums divided by the batch size).

:class:`VAEClassifier` (FedCBC eq. 6) scores each class by its VAE, the
latent at the posterior mean: ``prediction = "reconstruction"`` (default, the
paper's eq. 6) by the squared reconstruction error ``||x - dec(mu(x))||^2``
alone; ``"loss"`` (the official code) by the whole of ``l``, KL included.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

__all__ = ["VAE", "VAEClassifier", "gaussian_kl", "reconstruction_error", "vae_loss_per_sample", "vae_loss"]


class VAE(nn.Module):
    """MLP VAE ``d -> h -> k (mean, log-variance) -> h -> d`` (see the module docstring)."""

    def __init__(self, input_dim: int, hidden_dim: int = 256, latent_dim: int = 128, sigmoid_output: bool = False):
        super().__init__()
        if min(input_dim, hidden_dim, latent_dim) < 1:
            raise ValueError(f"VAE sizes must be positive, got input {input_dim}, hidden {hidden_dim}, "
                             f"latent {latent_dim}")
        self.input_dim, self.latent_dim = int(input_dim), int(latent_dim)
        self.encoder = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.Tanh())
        self.mean = nn.Linear(hidden_dim, latent_dim)
        self.log_var = nn.Linear(hidden_dim, latent_dim)
        self.decoder = nn.Sequential(nn.Linear(latent_dim, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, input_dim),
                                     *([nn.Sigmoid()] if sigmoid_output else []))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The posterior's mean and log-variance, each ``(B, latent_dim)``."""
        h = self.encoder(x)
        return self.mean(h), self.log_var(h)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)

    def forward(self, x: torch.Tensor, sample: bool = True,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(reconstruction, mean, log_var)``; the latent is a reparameterised draw (``sample``, noise from
        ``generator``) or the posterior mean."""
        mean, log_var = self.encode(x)
        z = mean
        if sample:
            eps = torch.randn(mean.shape, generator=generator).to(mean.device)
            z = mean + torch.exp(0.5 * log_var) * eps
        return self.decode(z), mean, log_var


def gaussian_kl(mean: torch.Tensor, log_var: torch.Tensor, mean_to: torch.Tensor | float = 0.0,
                log_var_to: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``KL(N(mean, e^log_var) || N(mean_to, e^log_var_to))`` of diagonal Gaussians, summed over the last
    dimension: one value per row. The defaults give the KL to the standard normal prior."""
    mean_to, log_var_to = torch.as_tensor(mean_to, dtype=mean.dtype), torch.as_tensor(log_var_to, dtype=mean.dtype)
    ratio = (log_var.exp() + (mean - mean_to) ** 2) / log_var_to.exp()
    return 0.5 * (log_var_to - log_var - 1 + ratio).sum(dim=-1)


def reconstruction_error(recon: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The squared reconstruction error of each row, ``||x - recon||^2``."""
    return ((recon - x) ** 2).sum(dim=-1)


def vae_loss_per_sample(recon: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, log_var: torch.Tensor,
                        beta: float) -> torch.Tensor:
    """Eq. 5 for each row: squared reconstruction error plus ``beta`` times the KL to the prior."""
    return reconstruction_error(recon, x) + beta * gaussian_kl(mean, log_var)


def vae_loss(recon: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, log_var: torch.Tensor,
             beta: float) -> torch.Tensor:
    """Eq. 5 averaged over the batch."""
    return vae_loss_per_sample(recon, x, mean, log_var, beta).mean()


Prediction = Literal["reconstruction", "loss"]


class VAEClassifier(nn.Module):
    """Logits from per-class VAEs (FedCBC eq. 6): the logit of class ``c`` is minus the score of ``c``'s VAE on
    the features of the input, with the latent at the posterior mean (deterministic): its squared
    reconstruction error (``prediction = "reconstruction"``, the paper's eq. 6) or its eq.-5 loss, KL to the
    prior included (``"loss"``, the official code's). A class without a VAE gets ``-inf``; ``argmax`` of the
    logits is eq. 6's ``argmin``."""

    def __init__(self, extractor: nn.Module, vaes: dict[int, VAE], num_classes: int, beta: float,
                 prediction: Prediction = "reconstruction"):
        super().__init__()
        if any(not 0 <= c < num_classes for c in vaes):
            raise ValueError(f"VAE classes {sorted(vaes)} do not fit {num_classes} classes")
        if prediction not in ("reconstruction", "loss"):
            raise ValueError(f"prediction must be 'reconstruction' or 'loss', got {prediction!r}")
        self.extractor = extractor
        self.vaes = nn.ModuleDict({str(c): v for c, v in sorted(vaes.items())})
        self.num_classes, self.beta, self.prediction = int(num_classes), float(beta), prediction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scores(self.extractor(x))

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        """The logits of already extracted features ``(B, d)``."""
        logits = torch.full((len(features), self.num_classes), -torch.inf, device=features.device)
        for c, vae in self.vaes.items():
            recon, mean, log_var = vae(features, sample=False)
            if self.prediction == "reconstruction":
                logits[:, int(c)] = -reconstruction_error(recon, features)
            else:
                logits[:, int(c)] = -vae_loss_per_sample(recon, features, mean, log_var, self.beta)
        return logits
