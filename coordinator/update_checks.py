"""The layout every model delta that reaches the coordinator must have, whoever sends it: a client's update
(:mod:`fcl_emu.coordinator.dispatch`) or an edge aggregator's aggregate of its clients' (:mod:`fcl_emu.coordinator.
edge_tier`). Checked before any arithmetic, so that a delta of another model, shape or dtype is refused with its
reason instead of breaking the round's mean."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fcl_emu.aggregation.update import DELTA
from fcl_emu.wire.framing import WireError


def check_delta(tensors: Mapping[str, np.ndarray], num_samples: int, model: Mapping[str, np.ndarray]) -> None:
    """A delta with samples names exactly ``model``'s tensors (under ``delta/``), each with the model's shape and
    dtype, and counts no negative samples; WireError (``bad_shape``, ``bad_dtype``, ``bad_body``) otherwise. One
    without samples carries nothing the round uses."""
    got = {k[len(DELTA):]: v for k, v in tensors.items() if k.startswith(DELTA)}
    if num_samples == 0:
        return
    if got.keys() != model.keys():
        missing = sorted(model.keys() - got.keys())[:3]
        extra = sorted(got.keys() - model.keys())[:3]
        raise WireError("bad_shape", f"delta keys differ from the model (missing {missing}, unknown {extra})")
    for name, value in got.items():
        if value.shape != model[name].shape:
            raise WireError("bad_shape", f"delta {name!r} has shape {list(value.shape)}, "
                                         f"model has {list(model[name].shape)}")
        if value.dtype != model[name].dtype:  # before any arithmetic: an int32 delta broke the mean
            raise WireError("bad_dtype", f"delta {name!r} is {value.dtype}, model has {model[name].dtype}")
    if num_samples < 0:
        raise WireError("bad_body", "negative num_samples")
