"""Turning stored uint8 images into normalised float tensors and back, and train-time augmentation."""

from __future__ import annotations

import numpy as np
import torch


def to_tensor(images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 (N, H, W, C) -> float32 (N, C, H, W), scaled to [0, 1] and normalised per channel. ``images`` are
    never written; read-only ones (a memory-mapped dataset) are copied first, as torch wants writable memory."""
    images = np.ascontiguousarray(images)
    if not images.flags.writeable:
        images = images.copy()
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def denormalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """The inverse of :func:`to_tensor`'s normalisation: (N, C, H, W) back to [0, 1] pixel values."""
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return x * s + m


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4, flip: bool = True) -> torch.Tensor:
    """The standard CIFAR augmentation: pad-and-crop plus (``flip``) horizontal flip, per sample.
    Differentiable: data-free synthesis augments generated images with it."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding,) * 4, mode="reflect")
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    rows = (dy.view(n, 1) + torch.arange(h).view(1, h))  # (n, h)
    cols = (dx.view(n, 1) + torch.arange(w).view(1, w))  # (n, w)
    batch = torch.arange(n).view(n, 1, 1)
    out = padded.permute(0, 2, 3, 1)[batch, rows.view(n, h, 1), cols.view(n, 1, w)].permute(0, 3, 1, 2)
    if flip:
        flipped = torch.rand(n, generator=generator) < 0.5
        out[flipped] = out[flipped].flip(-1)
    return out.contiguous()
