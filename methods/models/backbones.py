"""Feature extractors shared by every learning method.

Every backbone is a :class:`Backbone`: an ``nn.Module`` whose ``forward``
maps a batch ``(B, C, H, W)`` to features ``(B, out_dim)``. All of them end
in adaptive average pooling, so one network takes 28x28 (MNIST family),
32x32 (CIFAR) and 64x64 (Tiny-ImageNet) inputs; only ``min_size`` (the
smallest height / width that still leaves a non-degenerate feature map) is
checked, by :func:`fcl_emu.methods.models.classifier.build_model`.

Submodules have fixed explicit names, so state-dict keys are identical in
every process (the wire carries state dicts as flat ``name -> array`` maps).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Backbone", "SplitBackbone", "SmallCNN", "SmallCNNBN", "SmallCNNLeaky", "ResNet18Cifar", "ResNet32",
           "BasicBlock"]


class Backbone(nn.Module):
    """Base of all feature extractors: ``forward(x) -> (B, out_dim)``."""

    #: Smallest input height and width the backbone accepts.
    min_size: ClassVar[int] = 8
    #: Width of the feature vector.
    out_dim: int
    #: Channels of the input images.
    in_channels: int

    def __init__(self, in_channels: int, out_dim: int):
        super().__init__()
        if in_channels < 1:
            raise ValueError(f"in_channels must be >= 1, got {in_channels}")
        self.in_channels = int(in_channels)
        self.out_dim = int(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class SmallCNN(Backbone):
    """Two conv-ReLU-max-pool blocks and a 256-d fully connected feature layer.

    ``conv3x3(C->32) - ReLU - pool2 - conv3x3(32->64) - ReLU - pool2 -
    adaptive-avg-pool(4x4) - fc(1024->256) - ReLU``: about 281K parameters
    (281,216 for one input channel), a few MFLOPs per 28x28 image, so
    hundreds of emulated clients can train it on a CPU.

    No BatchNorm, on purpose: BatchNorm's running mean / variance are
    buffers that plain FedAvg averages although they are not parameters of
    the loss, and under non-IID client data the averaged statistics match
    none of the clients (FedBN, Li et al. 2021, is a whole method about
    this); its integer step counter also needs a special rule. Without it
    the state is parameters only, the FedAvg of deltas is exactly FedAvg of
    the weights, and small local batches do not add noise. The ResNets keep
    their BatchNorm because that is how they are defined.
    """

    min_size = 8  # two 2x poolings leave at least a 2x2 map

    def __init__(self, in_channels: int = 1, width: int = 32, out_dim: int = 256):
        super().__init__(in_channels, out_dim)
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3, padding=1)
        self.bn1, self.bn2 = self._norm(width), self._norm(2 * width)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(2 * width * 4 * 4, out_dim)

    def _norm(self, channels: int) -> nn.Module:
        return nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = torch.flatten(self.pool(x), 1)
        return F.relu(self.fc(x))


class SmallCNNBN(SmallCNN):
    """:class:`SmallCNN` with BatchNorm after each convolution (``bn1``, ``bn2``): 192 more parameters.

    For the data-free generative methods (MFCL, TARGET, LANDER): their
    generators are trained to match the statistics a model's BatchNorm layers
    keep (DeepInversion, Yin et al. 2020), so the model must have some. The
    running statistics are averaged by FedAvg like the weights.
    """

    def _norm(self, channels: int) -> nn.Module:
        return nn.BatchNorm2d(channels)


class SplitBackbone(Backbone):
    """A backbone whose output is ``from_embedding(embed(x))``: an intermediate *embedding* (``embed_dim``)
    and a ``neck`` (the layers between it and the head).

    For methods that model features below the classifier's last layers: AF-FCL's flow models the
    embedding, and its replay step trains the neck (the code's ``fc2``).
    """

    embed_dim: int
    neck: nn.Module

    def embed(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def from_embedding(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_embedding(self.embed(x))


class SmallCNNLeaky(SplitBackbone):
    """:class:`SmallCNN`'s convolutions with LeakyReLU, a 512-d LeakyReLU embedding and a 512-d neck.

    ``conv3x3(C->32) - LReLU - pool2 - conv3x3(32->64) - LReLU - pool2 - adaptive-avg-pool(4x4) -
    fc(1024->512) - LReLU`` is the embedding; ``neck = fc(512->512) - LReLU`` gives the features
    (``out_dim = 512``). This is the feature space of AF-FCL's code (its ``S_ConvNet``: LeakyReLU
    everywhere, the flow's 512-d features ``xa`` after ``fc1``, then ``fc2`` and the classifier layer);
    the convolutions are :class:`SmallCNN`'s (CPU-sized), not the code's three 4x4 stride-2 convolutions
    of 64/128/256 channels. LeakyReLU (slope 0.01) leaves no exact zeros, over which a density is
    ill-posed. 806,272 parameters for one input channel; no BatchNorm.
    """

    min_size = 8

    def __init__(self, in_channels: int = 1, width: int = 32, embed_dim: int = 512):
        super().__init__(in_channels, embed_dim)
        self.embed_dim = int(embed_dim)
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(2 * width * 4 * 4, embed_dim)
        self.neck = nn.Linear(embed_dim, embed_dim)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.leaky_relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.leaky_relu(self.conv2(x)), 2)
        x = torch.flatten(self.pool(x), 1)
        return F.leaky_relu(self.fc(x))

    def from_embedding(self, h: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(self.neck(h))


class _PadShortcut(nn.Module):
    """Option-A shortcut of He et al. (2016): subsample, then zero-pad new channels.

    Parameter-free, so a ResNet-32 built with it has the paper's 0.46M
    parameters. ``x[..., ::s, ::s]`` gives ``ceil(H / s)`` rows, the same as
    the residual branch's stride-``s`` 3x3 convolution with padding 1.
    """

    def __init__(self, extra_channels: int, stride: int):
        super().__init__()
        self.extra_channels = extra_channels
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection.

    ``shortcut`` chooses what happens when the shape changes: ``"B"`` a 1x1
    convolution and BatchNorm (projection), ``"A"`` subsampling and zero
    padding (no parameters). With equal shapes the shortcut is the identity.
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1, shortcut: str = "B"):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        if stride == 1 and in_planes == planes:
            self.shortcut: nn.Module = nn.Identity()
        elif shortcut == "A":
            if planes < in_planes:
                raise ValueError("option-A shortcuts can only add channels")
            self.shortcut = _PadShortcut(planes - in_planes, stride)
        elif shortcut == "B":
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )
        else:
            raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def _init_resnet(module: nn.Module) -> None:
    """He (fan-out) initialisation for convolutions, BatchNorm at (1, 0)."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class _CifarResNet(Backbone):
    """A stem (3x3 conv, stride 1, BN, ReLU, no max-pool), stages of BasicBlocks, global average pool."""

    def __init__(self, in_channels: int, widths: tuple[int, ...], blocks: tuple[int, ...],
                 shortcut: str):
        super().__init__(in_channels, widths[-1])
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        in_planes = widths[0]
        stages = []
        for i, (planes, n) in enumerate(zip(widths, blocks)):
            stride = 1 if i == 0 else 2
            layer = []
            for j in range(n):
                layer.append(BasicBlock(in_planes, planes, stride if j == 0 else 1, shortcut))
                in_planes = planes
            stages.append(nn.Sequential(*layer))
        # layer1 .. layerN, registered in order (stable state-dict keys).
        self.num_stages = len(stages)
        for i, stage in enumerate(stages, start=1):
            self.add_module(f"layer{i}", stage)
        self.pool = nn.AdaptiveAvgPool2d(1)
        _init_resnet(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        for i in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{i}")(x)
        return torch.flatten(self.pool(x), 1)


class ResNet18Cifar(_CifarResNet):
    """ResNet-18 with the CIFAR stem: 3x3 conv stride 1, no max-pool; 512-d features.

    BasicBlocks [2, 2, 2, 2] at 64/128/256/512 channels, projection (option-B)
    shortcuts where the shape changes, as in the ImageNet ResNet-18.
    11,168,832 parameters for 3 input channels (11.17M; plus the head).
    A 32x32 input ends as a 4x4 map, 64x64 as 8x8, both pooled to 1x1.
    """

    def __init__(self, in_channels: int = 3):
        super().__init__(in_channels, (64, 128, 256, 512), (2, 2, 2, 2), shortcut="B")


class ResNet32(_CifarResNet):
    """The CIFAR ResNet-32 of He et al. (2016, section 4.2): 6n+2 layers with n = 5.

    A 3x3 stem to 16 channels, three stages of five BasicBlocks at 16/32/64
    channels (strides 1, 2, 2), global average pooling: 64-d features.

    Shortcuts are option A (identity, zero-padding the extra channels when
    the width doubles), the choice of the paper for its CIFAR networks and of
    iCaRL-style class-incremental baselines: it adds no parameters, so the
    count is the paper's 0.46M (463,504 for 3 input channels; 464,154 with
    a 10-class head) and all the
    weights live in the residual branches.
    """

    def __init__(self, in_channels: int = 3):
        super().__init__(in_channels, (16, 32, 64), (5, 5, 5), shortcut="A")
