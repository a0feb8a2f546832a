"""A backbone with a linear head that grows as new classes arrive.

State-dict keys are ``backbone.<...>`` for the feature extractor and
``head.weight`` (``(num_classes, feature_dim)``) / ``head.bias``
(``(num_classes,)``) for the head: the same in every process, so a state
sent over the wire loads anywhere. Row ``k`` of the head is the logit of
class index ``k``; class indices are the order in which the scenario
reveals classes, so old rows keep their meaning when the head grows.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
from torch import nn

from fcl_emu.methods.models.backbones import Backbone, ResNet18Cifar, ResNet32, SmallCNN, SmallCNNBN, SmallCNNLeaky

__all__ = ["IncrementalClassifier", "build_model", "resolve_model", "MODELS", "BACKBONES"]

#: Concrete backbones by model name.
BACKBONES: dict[str, type[Backbone]] = {
    "cnn": SmallCNN,
    "cnn_bn": SmallCNNBN,
    "resnet18": ResNet18Cifar,
    "resnet32": ResNet32,
    "cnn_leaky": SmallCNNLeaky,  # AF-FCL's feature space (LeakyReLU, a 512-d embedding and a neck)
}

#: Every name :func:`build_model` accepts ("auto" picks one from the input shape).
MODELS: tuple[str, ...] = (*BACKBONES, "auto")

#: ``auto`` picks ``cnn`` when both sides of the input are at most this many pixels, ``cnn_bn`` above.
AUTO_CNN_MAX_SIZE = 28


def _init_head_rows(weight: torch.Tensor, bias: torch.Tensor, generator: torch.Generator | None) -> None:
    """The initialisation of ``nn.Linear.reset_parameters``, drawn from ``generator``.

    Weight first, then bias, both uniform in ``+-1/sqrt(fan_in)`` (Kaiming
    uniform with ``a = sqrt(5)``), so a head built with ``n`` rows and a head
    grown from 0 to ``n`` rows under the same seed are equal.
    """
    fan_in = weight.shape[1]
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(bias, -bound, bound, generator=generator)


def _empty_linear(in_features: int, out_features: int, device: torch.device, dtype: torch.dtype) -> nn.Linear:
    """A plain ``nn.Linear`` with uninitialised parameters, built without touching any RNG.

    It is constructed on the meta device (no memory, no random draws, and
    no zero-element warning when ``out_features`` is 0), then given real
    parameters of the right shape.
    """
    lin = nn.Linear(in_features, max(out_features, 1), device="meta")
    lin.out_features = out_features
    lin.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
    lin.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
    return lin


class IncrementalClassifier(nn.Module):
    """``backbone`` followed by ``head``, a plain ``nn.Linear`` over the classes seen so far.

    ``num_classes`` may be 0 (the logits are then ``(B, 0)``); :meth:`expand`
    grows the head. Growing replaces ``self.head`` by a new ``nn.Linear``, so
    an optimiser built before :meth:`expand` must be rebuilt after it.
    """

    def __init__(self, backbone: Backbone, num_classes: int = 0):
        super().__init__()
        if not isinstance(getattr(backbone, "out_dim", None), int):
            raise TypeError("backbone must have an integer out_dim (see methods.models.backbones.Backbone)")
        self.backbone = backbone
        like = next(backbone.parameters(), None)
        device = like.device if like is not None else torch.device("cpu")
        dtype = like.dtype if like is not None else torch.float32
        self.head = _empty_linear(backbone.out_dim, 0, device, dtype)
        self.expand(num_classes)

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    @property
    def feature_dim(self) -> int:
        return self.head.in_features

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone features ``(B, feature_dim)``."""
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)``."""
        return self.head(self.backbone(x))

    def logits_and_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both in one backbone pass (methods with feature losses or prototypes)."""
        f = self.backbone(x)
        return self.head(f), f

    def expand(self, num_classes_total: int, *, generator: torch.Generator | None = None) -> IncrementalClassifier:
        """Grow the head to ``num_classes_total`` rows; returns ``self``.

        Old rows (weights and biases) are copied exactly; new rows get
        ``nn.Linear``'s default initialisation drawn on the CPU from
        ``generator`` (default: torch's global generator, so the result is
        deterministic under ``torch.manual_seed`` on any device). Same size:
        no-op. Smaller: ``ValueError`` (classes are never forgotten by
        shrinking the head). The new head keeps the old one's device, dtype,
        ``requires_grad`` and train/eval mode.
        """
        try:
            n = operator.index(num_classes_total)
        except TypeError:
            raise TypeError(f"num_classes_total must be an integer, got {num_classes_total!r}") from None
        old_head = self.head
        old = old_head.out_features
        if n < old:
            raise ValueError(f"cannot shrink the head from {old} to {n} classes")
        if n == old:
            return self
        d = old_head.in_features
        w_new = torch.empty(n - old, d)
        b_new = torch.empty(n - old)
        _init_head_rows(w_new, b_new, generator)
        weight, bias = old_head.weight, old_head.bias
        head = _empty_linear(d, n, weight.device, weight.dtype)
        with torch.no_grad():
            head.weight[:old].copy_(weight)
            head.weight[old:].copy_(w_new)
            head.bias[:old].copy_(bias)
            head.bias[old:].copy_(b_new)
        head.weight.requires_grad_(weight.requires_grad)
        head.bias.requires_grad_(bias.requires_grad)
        head.train(old_head.training)
        self.head = head
        return self


def _check_input_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    try:
        shape = tuple(operator.index(v) for v in input_shape)
    except TypeError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"input_shape must be (channels, height, width) with positive integers, "
                         f"got {input_shape!r}")
    return shape  # type: ignore[return-value]


#: Models without BatchNorm layers (the data-free generative methods cannot use them).
NO_BATCHNORM = frozenset({"cnn", "cnn_leaky"})


def resolve_model(name: str, input_shape: Sequence[int], batchnorm: bool = False, small: str = "cnn",
                  large: str = "cnn_bn") -> str:
    """The concrete model ``name`` stands for with these inputs (resolves ``auto``).

    ``auto`` is ``small`` (default ``cnn``; a method may name its own, such as
    AF-FCL's ``cnn_leaky``) when height and width are both at most 28 pixels
    (MNIST, Fashion-MNIST, EMNIST), ``cnn_bn`` there when the method needs
    BatchNorm statistics (``batchnorm``), and ``large`` (default ``cnn_bn``;
    AF-FCL names ``resnet18``) on larger images (CIFAR, Tiny-ImageNet): on
    colour images BatchNorm learns a first task faster than the plain CNN,
    and ``resnet18``, the backbone most FCIL papers use there, trains over 30
    times slower on a CPU (docs/scenarios.md has the pilot runs).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    _, h, w = _check_input_shape(input_shape)
    if name == "auto":
        name = small if max(h, w) <= AUTO_CNN_MAX_SIZE else large
        name = "cnn_bn" if batchnorm and name in NO_BATCHNORM else name
    if batchnorm and name in NO_BATCHNORM:
        raise ValueError(f"model {name!r} has no BatchNorm layers, which this method needs; use cnn_bn, "
                         f"resnet32 or resnet18")
    return name


def build_model(name: str, input_shape: Sequence[int], num_classes: int) -> IncrementalClassifier:
    """A fresh :class:`IncrementalClassifier` for inputs of ``input_shape = (C, H, W)``.

    ``name`` is one of :data:`MODELS`; the backbone gets ``C`` input
    channels. Raises ``ValueError`` for an unknown name, a malformed shape,
    an image smaller than the backbone's ``min_size`` or a negative
    ``num_classes``. Weights come from torch's global generator:
    deterministic under ``torch.manual_seed``.
    """
    concrete = resolve_model(name, input_shape)
    c, h, w = _check_input_shape(input_shape)
    cls = BACKBONES[concrete]
    if min(h, w) < cls.min_size:
        raise ValueError(f"model {concrete!r} needs inputs of at least {cls.min_size}x{cls.min_size} pixels, "
                         f"got {h}x{w} (input_shape is (channels, height, width): {tuple(input_shape)})")
    try:
        n = operator.index(num_classes)
    except TypeError:
        raise ValueError(f"num_classes must be an integer, got {num_classes!r}") from None
    if n < 0:
        raise ValueError(f"num_classes must be >= 0, got {n}")
    return IncrementalClassifier(cls(in_channels=c), n)
