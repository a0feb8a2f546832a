"""A class-conditional normalizing flow over feature vectors (RealNVP-style affine couplings).

``z = f(x; y)`` maps a feature vector ``x`` of a class ``y`` to a latent
``z`` with a standard normal prior; by the change of variables

    log p(x | y) = log N(f(x; y); 0, I) + log |det df/dx|

and a sample of class ``y`` is ``f^{-1}(z; y)`` with ``z ~ N(0, I)``.

The structure follows AF-FCL's code (zaocan666/AF-FCL, ``model.py`` with its
vendored ``nflows``). Each layer first permutes the dimensions (a fixed
permutation: the reversal in the first half of the layers, a seeded random
one in the second half), then applies an affine coupling (Dinh et al.,
"Density estimation using Real NVP", ICLR 2017): the first ``d = D // 2``
dimensions pass unchanged and condition the others,

    (t, s_raw) = net(x_a, onehot(y)),   s = sigmoid(s_raw + 2) + 1e-3,
    z_a = x_a,   z_b = x_b * s + t,   log |det| = sum(log s).

The scale is nflows' default ``scale_activation`` (the code's): it lies in
``(0.001, 1.001)``, so in the direction features -> latents a layer can
shrink a dimension up to 1000-fold but hardly stretch it. The density of the
features is thus bounded (at most about the standard normal's peak per
dimension): it cannot blow up on features with exact zeros (ReLU), and a
sample ``f^{-1}(z)`` is at most 1000-fold wider per layer than ``z``.

The conditioner ``net`` is the code's residual net (nflows'
``ResidualNet``): a linear layer from ``[x_a, onehot(y)]`` to ``hidden``
units, ``blocks`` residual blocks, a linear layer to ``(t, s_raw)``. A block
adds to its input

    linear_1(act(linear_0(act(v)))) * sigmoid(context(onehot(y)))

(``act`` LeakyReLU; the product is the code's GLU gate on the class). As in
nflows, ``linear_1`` of every block starts uniform in ``+-1e-3``; the last
layer of the conditioner starts at zero here (nflows: PyTorch's default), so
a fresh flow permutes and scales every transformed dimension by
``sigmoid(2) + 1e-3`` with no shift. Permutations are non-persistent
buffers, so the state dict (what travels on the wire) holds the
conditioners' weights only (and the standardisation's statistics, below).

With ``standardize`` the flow first standardises its input by running
per-dimension statistics, ``x' = (x - mean) / sqrt(var + 1e-6)`` (log |det|
``-sum log sqrt(var + 1e-6)``), the running averages of RealNVP's batch
normalisation (Dinh et al. 2017, section 3.7) without the per-batch
statistics: ``mean`` and ``var`` are float buffers that :meth:`ConditionalFlow.observe`
moves towards a batch's statistics (momentum 0.1) and no gradient
touches; they travel and are averaged with the weights. The bounded scale
above cannot stretch, so without it features narrower than the standard
normal (per-dimension spreads of 0.01 are common below a classifier's last
layers) get a density no higher than the prior's, and samples far wider
than the features.

Why not a library: ``zuko`` and ``nflows`` install from PyPI and run on the
CPU, but this module needs stable state-dict names that travel as model
state and weights a test can set by hand; the flow is a hundred lines, so
no dependency is added.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AffineCoupling", "ConditionalFlow", "ResidualBlock", "RunningStandardization", "SCALE_SHIFT",
           "SCALE_FLOOR"]

LOG_2PI = math.log(2 * math.pi)
SCALE_SHIFT = 2.0  # s = sigmoid(s_raw + SCALE_SHIFT) + SCALE_FLOOR (nflows' default scale activation)
SCALE_FLOOR = 1e-3


class ResidualBlock(nn.Module):
    """``v + linear_1(act(linear_0(act(v)))) * sigmoid(context(c))``: nflows' residual block with its GLU
    gate on the context (no batch norm, no dropout: the code's settings)."""

    def __init__(self, hidden: int, num_classes: int):
        super().__init__()
        self.linear_0 = nn.Linear(hidden, hidden)
        self.linear_1 = nn.Linear(hidden, hidden)
        self.context = nn.Linear(num_classes, hidden)
        nn.init.uniform_(self.linear_1.weight, -1e-3, 1e-3)
        nn.init.uniform_(self.linear_1.bias, -1e-3, 1e-3)

    def forward(self, v: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        branch = self.linear_1(F.leaky_relu(self.linear_0(F.leaky_relu(v))))
        return v + branch * torch.sigmoid(self.context(context))


class AffineCoupling(nn.Module):
    """``z_b = x_b * (sigmoid(s_raw + 2) + 1e-3) + t`` with ``(t, s_raw)`` from the first ``dim // 2``
    dimensions and the one-hot class; the first half passes unchanged."""

    def __init__(self, dim: int, num_classes: int, hidden: int, blocks: int):
        super().__init__()
        self.split = dim // 2
        self.initial = nn.Linear(self.split + num_classes, hidden)
        self.blocks = nn.ModuleList(ResidualBlock(hidden, num_classes) for _ in range(blocks))
        self.final = nn.Linear(hidden, 2 * (dim - self.split))
        nn.init.zeros_(self.final.weight)
        nn.init.zeros_(self.final.bias)

    def _log_scale_shift(self, x_a: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.initial(torch.cat([x_a, context], dim=1))
        for block in self.blocks:
            v = block(v, context)
        t, s_raw = self.final(v).chunk(2, dim=1)
        return torch.log(torch.sigmoid(s_raw + SCALE_SHIFT) + SCALE_FLOOR), t

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, log|det J|)`` per sample."""
        x_a, x_b = x[:, :self.split], x[:, self.split:]
        log_s, t = self._log_scale_shift(x_a, context)
        return torch.cat([x_a, x_b * torch.exp(log_s) + t], dim=1), log_s.sum(dim=1)

    def inverse(self, z: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        z_a, z_b = z[:, :self.split], z[:, self.split:]
        log_s, t = self._log_scale_shift(z_a, context)
        return torch.cat([z_a, (z_b - t) * torch.exp(-log_s)], dim=1)


class RunningStandardization(nn.Module):
    """``x -> (x - mean) / sqrt(var + eps)`` per dimension, ``mean`` and ``var`` running averages (buffers)
    that only :meth:`observe` changes; a fresh one (mean 0, var 1) is the identity up to ``eps``."""

    def __init__(self, dim: int, momentum: float = 0.1, eps: float = 1e-6):
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        """Move the statistics towards those of the batch ``x`` (B, dim)."""
        self.mean.lerp_(x.mean(dim=0), self.momentum)
        self.var.lerp_(x.var(dim=0, unbiased=False), self.momentum)

    def log_det(self) -> torch.Tensor:
        """``log |det|`` of the map (the same for every sample)."""
        return -0.5 * torch.log(self.var + self.eps).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) * torch.rsqrt(self.var + self.eps)

    def inverse(self, z: torch.Tensor) -> torch.Tensor:
        return z * torch.sqrt(self.var + self.eps) + self.mean


class ConditionalFlow(nn.Module):
    """``layers`` (permutation, affine coupling) pairs over ``dim``-d features, conditioned on one of
    ``num_classes`` classes (class indices, one-hot inside); each conditioner has ``hidden`` units and
    ``blocks`` residual blocks; ``standardize``: a :class:`RunningStandardization` of the input first."""

    def __init__(self, dim: int, num_classes: int, layers: int = 4, hidden: int = 128, blocks: int = 2,
                 standardize: bool = False):
        super().__init__()
        if dim < 2 or num_classes < 1 or layers < 1 or hidden < 1 or blocks < 0:
            raise ValueError(f"a flow needs dim >= 2, num_classes, layers and hidden >= 1, blocks >= 0; got "
                             f"dim={dim}, num_classes={num_classes}, layers={layers}, hidden={hidden}, "
                             f"blocks={blocks}")
        self.dim, self.num_classes = dim, num_classes
        self.standardization = RunningStandardization(dim) if standardize else None
        self.couplings = nn.ModuleList(AffineCoupling(dim, num_classes, hidden, blocks) for _ in range(layers))
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
        logdet = x.new_zeros(x.shape[0]) + self.input_log_det()
        if self.standardization is not None:
            x = self.standardization(x)
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
        return z if self.standardization is None else self.standardization.inverse(z)

    def observe(self, x: torch.Tensor) -> None:
        """Move the input standardisation's statistics towards the features ``x`` (B, dim); nothing without
        one."""
        if self.standardization is not None:
            if x.ndim != 2 or x.shape[1] != self.dim or not torch.isfinite(x).all():
                raise ValueError(f"flow: cannot observe features of shape {tuple(x.shape)} (finite, (batch, "
                                 f"{self.dim}) expected)")
            self.standardization.observe(x)

    def input_log_det(self) -> torch.Tensor:
        """``log |det|`` of the input standardisation (0 without one): ``log p(x)`` minus the density of the
        standardised features."""
        if self.standardization is None:
            return self.couplings[0].final.weight.new_zeros(())
        return self.standardization.log_det()

    def log_prob(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p(x | y), z)`` per sample: the standard normal log-density of ``z`` plus log|det J|."""
        z, logdet = self(x, y)
        return -0.5 * (z.pow(2).sum(dim=1) + self.dim * LOG_2PI) + logdet, z

    def sample(self, y: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, z)``: one feature vector per label in ``y``, and the latent it came from."""
        z = torch.randn(len(y), self.dim, generator=generator).to(self.couplings[0].final.weight.device)
        return self.inverse(z, y.to(z.device)), z
