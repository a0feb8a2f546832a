"""Image generators of the data-free generative methods (MFCL, TARGET, LANDER).

All three use the generator of Data-Free Adversarial Distillation (Fang et al.
2019), the DCGAN-like stack MFCL lists in its Table 6 and TARGET / LANDER's
official code builds::

    input -> Linear(in, 128 * s * s) -> (128, s, s) -> BN
          -> n x [upsample x2 -> conv3x3 -> BN -> LeakyReLU(0.2)]   channels 128 -> 128 (-> 128) -> 64
          -> conv3x3(64 -> C) -> output

``n`` is 2 for images up to 32 pixels (``s = H / 4``: 7 for 28x28, 8 for
32x32) and 3 for 64x64 (``s = 8``, MFCL's Tiny-ImageNet generator). The
output is ``tanh`` followed by a BatchNorm without affine parameters
(``output="tanh_bn"``, MFCL: images come out standardised, fed to the model as
they are) or a ``sigmoid`` (``output="sigmoid"``, TARGET / LANDER: images in
[0, 1], normalised with the data set's mean and std before the model sees
them, and quantised to 8 bits when they are sent, like the PNG files of the
official code).

The hidden BatchNorms use eps = 0.8 in MFCL's code (the second positional
argument of ``BatchNorm2d``, a DCGAN legacy) and the default 1e-5 in TARGET's;
``bn_eps`` chooses (default 1e-5; MFCL passes 0.8).

Each ``upsample x2 -> conv3x3`` pair runs as :func:`upsample_conv`: the same
function of the same weights computed on the small image with 2x2 kernels,
2.25 times fewer multiply-adds and no upsampled copy (the results differ from
the two layers' only in float rounding, about 1e-6 relative;
``Generator.phase_conv = False`` runs the two layers as written).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Generator", "NoisyLayer", "TextConditionedGenerator", "upsample_conv", "upsamplings"]


def upsamplings(size: int) -> int:
    """How many 2x upsamplings the generator uses for ``size`` x ``size`` images."""
    n = 2 if size <= 32 else 3
    if size % (2 ** n) or size // (2 ** n) < 2:
        raise ValueError(f"the generator makes square images whose side is a multiple of {2 ** n}; got {size}")
    return n


def _phase_kernels(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3-tap kernel along ``dim`` folded onto the taps of a 2x nearest upsampling: even outputs see the
    input at offsets (-1, 0) with taps (w0, w1 + w2), odd outputs at (0, +1) with (w0 + w1, w2)."""
    w0, w1, w2 = w.unbind(dim)
    return torch.stack([w0, w1 + w2], dim), torch.stack([w0 + w1, w2], dim)


def upsample_conv(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """``conv(upsample_nearest_x2(x))`` for a 3x3 ``conv`` with padding 1, as four 2x2 convolutions of ``x``
    (one per output phase: row and column parity), run as one convolution and interleaved."""
    b, _, h, w = x.shape
    kernels = [k for rows in _phase_kernels(conv.weight, 2) for k in _phase_kernels(rows, 3)]  # (a, c) order
    bias = None if conv.bias is None else conv.bias.repeat(4)
    y = F.conv2d(x, torch.cat(kernels), bias, padding=1)  # (B, 4 * out, H + 1, W + 1)
    y = y.view(b, 2, 2, conv.out_channels, h + 1, w + 1)
    rows = [torch.stack([y[:, a, c, :, a:a + h, c:c + w] for c in (0, 1)], -1) for a in (0, 1)]
    return torch.stack(rows, 3).reshape(b, conv.out_channels, 2 * h, 2 * w)


class Generator(nn.Module):
    """``forward(z: (B, in_dim)) -> images (B, C, H, H)`` (see the module docstring)."""

    phase_conv = True  # False: each upsampling and convolution as two layers (the reference computation)

    def __init__(self, in_dim: int, image_shape: tuple[int, int, int], width: int = 128,
                 output: str = "tanh_bn", bn_eps: float = 1e-5):
        super().__init__()
        channels, height, w = image_shape
        if height != w:
            raise ValueError(f"the generator makes square images, got {height}x{w}")
        if output not in ("tanh_bn", "sigmoid"):
            raise ValueError(f"output must be 'tanh_bn' or 'sigmoid', got {output!r}")
        self.in_dim, self.image_shape, self.output = in_dim, tuple(image_shape), output
        n = upsamplings(height)
        self.init_size = height // 2 ** n
        self.fc = nn.Linear(in_dim, width * self.init_size ** 2)
        self.bn0 = nn.BatchNorm2d(width)
        widths = [width] * n + [width // 2]
        blocks = []
        for i in range(n):
            blocks += [nn.Upsample(scale_factor=2), nn.Conv2d(widths[i], widths[i + 1], 3, padding=1, bias=False),
                       nn.BatchNorm2d(widths[i + 1], eps=bn_eps), nn.LeakyReLU(0.2)]
        self.blocks = nn.Sequential(*blocks)
        self.out = nn.Conv2d(widths[-1], channels, 3, padding=1)
        self.out_bn = nn.BatchNorm2d(channels, affine=False) if output == "tanh_bn" else nn.Identity()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.bn0(self.fc(z).view(z.shape[0], -1, self.init_size, self.init_size))
        if self.phase_conv:
            layers = list(self.blocks)
            for i in range(0, len(layers), 4):  # upsample, conv, BatchNorm, LeakyReLU
                _, conv, norm, act = layers[i:i + 4]
                x = act(norm(upsample_conv(x, conv)))
        else:
            x = self.blocks(x)
        x = self.out(x)
        return self.out_bn(torch.tanh(x)) if self.output == "tanh_bn" else torch.sigmoid(x)


class NoisyLayer(nn.Module):
    """LANDER's noisy layer (from the authors' NAYER): consecutive chunks of ``chunk`` samples each go
    through their own linear map, all re-drawn from N(0, 1) (bias 0) by :meth:`reinit` at every synthesis
    round, so the same label embedding gives different generator inputs from round to round."""

    def __init__(self, in_dim: int, out_dim: int, batch: int, chunk: int = 10):
        super().__init__()
        self.chunk = chunk
        self.maps = nn.ModuleList(nn.Linear(in_dim, out_dim) for _ in range(math.ceil(batch / chunk)))
        self.reinit()

    def reinit(self, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            for m in self.maps:
                m.weight.normal_(0.0, 1.0, generator=generator)
                m.bias.zero_()

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        parts = e.split(self.chunk)
        if len(parts) > len(self.maps):
            raise ValueError(f"batch of {e.shape[0]} is larger than the noisy layer's {len(self.maps) * self.chunk}")
        return torch.cat([m(p) for m, p in zip(self.maps, parts)])


class TextConditionedGenerator(nn.Module):
    """LANDER's generator: label-text embedding -> BatchNorm1d -> :class:`NoisyLayer` -> :class:`Generator`
    (sigmoid output). No random ``z``: the noise is in the noisy layer's weights."""

    def __init__(self, text_dim: int, image_shape: tuple[int, int, int], batch: int, noise_dim: int = 256,
                 chunk: int = 10, width: int = 128):
        super().__init__()
        self.text_bn = nn.BatchNorm1d(text_dim)
        self.noisy = NoisyLayer(text_dim, noise_dim, batch, chunk)
        self.body = Generator(noise_dim, image_shape, width=width, output="sigmoid")

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.body(self.noisy(self.text_bn(text)))
