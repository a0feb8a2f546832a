"""A class-conditional normalizing flow over feature vectors (RealNVP-style affine couplings).

``z = f(x; y)`` maps a feature vector ``x`` of a class ``y`` to a latent
``z`` with a standard normal prior; by the change of variables

    log p(x | y) = log N(f(x; y); 0, I) + log |det df/dx|

and a sample of class ``y`` is ``f^{-1}(z; y)`` with ``z ~ N(0, I)``.

Each layer first permutes the dimensions (a fixed permutation: the reversal
in the first half of the layers, a seeded random one in the second half, as
in AF-FCL's code), then applies an affine coupling (Dinh et al., "Density
estimation using Real NVP", ICLR 2017): the first ``d = D // 2`` dimensions
pass unchanged and condition the others,

    (s_raw, t) = net([x_a, onehot(y)]),   s = tanh(s_raw),
    z_a = x_a,   z_b = x_b * exp(s) + t,   log |det| = sum(s).

``tanh`` bounds each layer's log-scale to [-1, 1], so a layer can neither
blow up nor collapse a dimension (features after a ReLU hold exact zeros).
The last layer of each conditioner starts at zero: a fresh flow only
permutes (log-det 0). Permutations are non-persistent buffers, so the state dict (what
travels on the wire) holds the conditioners' weights only.

Why not a library: ``zuko`` and ``nflows`` install from PyPI and run on the
CPU, but this module needs stable state-dict names that travel as model
state, weights a test can set by hand, and a bounded scale for ReLU
features; the whole flow is some sixty lines, so no dependency is added.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AffineCoupling", "ConditionalFlow"]

LOG_2PI = math.log(2 * math.pi)


class AffineCoupling(nn.Module):
    """``z_b = x_b * exp(tanh(s_raw)) + t`` with ``(s_raw, t)`` from the first ``dim // 2`` dimensions
    and the one-hot class; the first half passes unchanged."""

    def __init__(self, dim: int, num_classes: int, hidden: int):
        super().__init__()
        self.split = dim // 2
        out = dim - self.split
        self.net = nn.Sequential(nn.Linear(self.split + num_classes, hidden), nn.LeakyReLU(),
                                 nn.Linear(hidden, hidden), nn.LeakyReLU(), nn.Linear(hidden, 2 * out))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def _scale_shift(self, x_a: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s_raw, t = self.net(torch.cat([x_a, context], dim=1)).chunk(2, dim=1)
        return torch.tanh(s_raw), t

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, log|det J|)`` per sample."""
        x_a, x_b = x[:, :self.split], x[:, self.split:]
        s, t = self._scale_shift(x_a, context)
        return torch.cat([x_a, x_b * torch.exp(s) + t], dim=1), s.sum(dim=1)

    def inverse(self, z: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        z_a, z_b = z[:, :self.split], z[:, self.split:]
        s, t = self._scale_shift(z_a, context)
        return torch.cat([z_a, (z_b - t) * torch.exp(-s)], dim=1)


class ConditionalFlow(nn.Module):
    """``layers`` (permutation, affine coupling) pairs over ``dim``-d features, conditioned on one of
    ``num_classes`` classes (class indices, one-hot inside)."""

    def __init__(self, dim: int, num_classes: int, layers: int = 4, hidden: int = 128):
        super().__init__()
        if dim < 2 or num_classes < 1 or layers < 1 or hidden < 1:
            raise ValueError(f"a flow needs dim >= 2, num_classes, layers and hidden >= 1; got dim={dim}, "
                             f"num_classes={num_classes}, layers={layers}, hidden={hidden}")
        self.dim, self.num_classes = dim, num_classes
        self.couplings = nn.ModuleList(AffineCoupling(dim, num_classes, hidden) for _ in range(layers))
        for i in range(layers):
            perm = (torch.arange(dim - 1, -1, -1) if i < layers // 2
                    else torch.randperm(dim, generator=torch.Generator().manual_seed(i)))
            self.register_buffer(f"perm{i}", perm, persistent=False)

    def _check(self, x: torch.Tensor, y: torch.Tensor, what: str) -> torch.Tensor:
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"flow: {what} of shape {tuple(x.shape)}, expected (batch, {self.dim})")
        if y.shape != (x.shape[0],):
            raise ValueError(f"flow: labels of shape {tuple(y.shape)} for {x.shape[0]} {what}")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise ValueError(f"flow: labels must lie in 0..{self.num_classes - 1}")
        if not torch.isfinite(x).all():
            raise ValueError(f"flow: {what} hold NaN or infinite values")
        return F.one_hot(y.long(), self.num_classes).to(x.dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, log|det df/dx|)`` for features ``x`` (B, dim) of classes ``y`` (B,)."""
        context = self._check(x, y, "features")
        logdet = x.new_zeros(x.shape[0])
        for i, coupling in enumerate(self.couplings):
            x, ld = coupling(x[:, getattr(self, f"perm{i}")], context)
            logdet = logdet + ld
        return x, logdet

    def inverse(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The features whose latent is ``z`` (B, dim), for classes ``y`` (B,)."""
        context = self._check(z, y, "latents")
        for i in reversed(range(len(self.couplings))):
            z = self.couplings[i].inverse(z, context)
            z = z[:, torch.argsort(getattr(self, f"perm{i}"))]
        return z

    def log_prob(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p(x | y), z)`` per sample: the standard normal log-density of ``z`` plus log|det J|."""
        z, logdet = self(x, y)
        return -0.5 * (z.pow(2).sum(dim=1) + self.dim * LOG_2PI) + logdet, z

    def sample(self, y: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, z)``: one feature vector per label in ``y``, and the latent it came from."""
        z = torch.randn(len(y), self.dim, generator=generator).to(self.couplings[0].net[0].weight.device)
        return self.inverse(z, y.to(z.device)), z
