"""Whether a CUDA device asked for is there: one check for the coordinator and its clients (``--device``), the
GPU workers (``--gpu-device``) and the benchmarks, made by the command line before a run starts anything and
again where each device is taken."""

from __future__ import annotations

import torch


class DeviceError(RuntimeError):
    """A CUDA device was asked for and torch sees none."""


def no_cuda(flag: str, instead: str = "cpu or auto") -> str | None:
    """Why ``flag cuda`` cannot be had here, in one line naming what torch found (its version, whether it was
    built for CUDA); None where torch sees a CUDA device."""
    if torch.cuda.is_available():
        return None
    build = f"yes, CUDA {torch.version.cuda}" if torch.version.cuda else "no"
    return (f"{flag} cuda: torch {torch.__version__} sees no CUDA device (CUDA build: {build}); use {flag} "
            f"{instead}")


def check_cuda(flag: str) -> None:
    """Raise :class:`DeviceError` (:func:`no_cuda`'s line) unless torch sees a CUDA device."""
    reason = no_cuda(flag)
    if reason:
        raise DeviceError(reason)
