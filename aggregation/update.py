"""A client's update as the server sees it (:class:`ClientUpdate`), and the model delta as one flat vector
(:class:`DeltaLayout`, what secure aggregation sums).

Upload tensors are named ``delta/<param>`` for the model delta and ``<method>/<name>`` for a method's extras.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

Arrays = dict[str, np.ndarray]

DELTA = "delta/"


@dataclass
class ClientUpdate:
    """One client's upload as the server part sees it."""

    client: str
    num_samples: int
    tensors: Mapping[str, np.ndarray]
    loss: float = float("nan")
    metrics: Mapping[str, float] = field(default_factory=dict)  # the method's own terms, as reported
    # the sum of the squares of each float tensor where known (the wire's finite check computes it on receipt):
    # what the norm bounds read instead of another pass over the tensors
    square_sums: Mapping[str, float] = field(default_factory=dict)

    def delta(self) -> Arrays:
        return {k[len(DELTA):]: v for k, v in self.tensors.items() if k.startswith(DELTA)}

    def float_names(self, prefixes: str | tuple[str, ...] = DELTA) -> list[str]:
        """The names of its float tensors under ``prefixes`` (default: the model delta)."""
        return [n for n, v in self.tensors.items() if n.startswith(prefixes) and v.dtype.kind == "f"]

    def scaled(self, factor: float, names: list[str]) -> ClientUpdate:
        """The same client's update with the tensors ``names`` multiplied by ``factor`` (each in its dtype)."""
        chosen = set(names)
        return self.with_tensors({n: (v * factor).astype(v.dtype) if n in chosen else v
                                  for n, v in self.tensors.items()})

    def with_tensors(self, tensors: Mapping[str, np.ndarray]) -> ClientUpdate:
        """The same client's update carrying ``tensors`` instead (clipped, weighted, mixed; their square sums are
        not known)."""
        return ClientUpdate(self.client, self.num_samples, tensors, self.loss, self.metrics)


@dataclass(frozen=True)
class DeltaLayout:
    """The model delta as one flat float vector: what secure aggregation sums.

    The float tensors of the model, in name order, each flattened. Integer
    buffers (BatchNorm's step counter) are not summable and stay out: under
    secure aggregation the server keeps its own value of them.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: Mapping[str, np.ndarray]) -> DeltaLayout:
        names = tuple(sorted(k for k, v in model.items() if v.dtype.kind == "f"))
        return cls(names, tuple(tuple(model[k].shape) for k in names))

    @property
    def dim(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def flatten(self, uploads: Mapping[str, np.ndarray]) -> np.ndarray:
        """The ``delta/<name>`` tensors of an upload as one float32 vector (ValueError if they do not fit)."""
        got = {k[len(DELTA):] for k in uploads if k.startswith(DELTA)} & set(self.names)
        if got != set(self.names):
            raise ValueError(f"the upload lacks the deltas of {sorted(set(self.names) - got)[:3]}")
        out = np.empty(self.dim, np.float32)
        at = 0
        for name, shape in zip(self.names, self.shapes):
            value = uploads[DELTA + name]
            if tuple(value.shape) != shape:
                raise ValueError(f"delta {name!r} has shape {list(value.shape)}, the model has {list(shape)}")
            out[at:at + value.size] = value.reshape(-1)
            at += value.size
        return out

    def unflatten(self, vector: np.ndarray) -> Arrays:
        """The inverse of :meth:`flatten`: ``{delta/<name>: float32 array}``."""
        if vector.shape != (self.dim,):
            raise ValueError(f"a vector of shape {vector.shape} does not fit a delta of {self.dim} values")
        out, at = {}, 0
        for name, shape in zip(self.names, self.shapes):
            size = math.prod(shape)
            out[DELTA + name] = vector[at:at + size].astype(np.float32).reshape(shape)
            at += size
        return out
