"""Client updates combined into one delta by the run's rule: what a method's ``aggregate`` calls.

Float tensors go through the rule (:class:`~fcl_emu.aggregation.rules.Aggregator`, combined in float64, returned
as float32); integer buffers (BatchNorm's step counter) take the largest value.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fcl_emu.aggregation.rules import MEAN, Aggregator
from fcl_emu.aggregation.update import DELTA, Arrays, ClientUpdate


def fedavg(updates: list[ClientUpdate], aggregate: Aggregator = MEAN) -> Arrays:
    """The clients' deltas combined by ``aggregate`` (default: the sample-weighted mean, McMahan et al. 2017, eq.
    'w <- sum n_k/n w_k'; a robust rule as the run configures it). Updates without samples take no part."""
    weighted = [u for u in updates if u.num_samples > 0]
    if not weighted:
        raise ValueError("no client update carries samples")
    deltas = [u.delta() for u in weighted]
    names = deltas[0].keys()
    for d, u in zip(deltas, weighted):
        if d.keys() != names:
            raise ValueError(f"client {u.client} uploaded delta keys that differ from the others")
    floats = [name for name in names if deltas[0][name].dtype.kind == "f"]
    out = aggregate([(u.num_samples, {name: d[name] for name in floats}) for d, u in zip(deltas, weighted)])
    for name in names - set(floats):
        out[name] = np.asarray(np.max(np.stack([d[name] for d in deltas]), axis=0))  # 0-d stays an array
    return out


def apply_fedavg(arrays: Mapping[str, np.ndarray], updates: list[ClientUpdate], prefix: str,
                 aggregate: Aggregator = MEAN) -> Arrays:
    """``arrays`` plus the clients' deltas uploaded under ``prefix`` combined by ``aggregate`` (:func:`fedavg`;
    a module that rides with the model, such as LANDER's projector or AF-FCL's flow), as read-only arrays."""
    delta = fedavg([ClientUpdate(u.client, u.num_samples,
                                 {DELTA + k[len(prefix):]: v for k, v in u.tensors.items() if k.startswith(prefix)})
                    for u in updates], aggregate)
    out = {}
    for k, v in arrays.items():
        out[k] = v + delta[k]
        out[k].flags.writeable = False
    return out


def group_mean(updates: list[ClientUpdate], prefixes: tuple[str, ...]) -> Arrays:
    """The sample-weighted mean of the tensors under each of ``prefixes`` (:func:`fedavg` of each, under its own
    names): what an edge aggregator sends up for its clients, so that the coordinator's weighted mean of such
    means, each weighing its clients' samples, is their flat mean."""
    out: Arrays = {}
    for prefix in prefixes:
        moved = [ClientUpdate(u.client, u.num_samples,
                              {DELTA + k[len(prefix):]: v for k, v in u.tensors.items() if k.startswith(prefix)})
                 for u in updates]
        out.update({prefix + k: v for k, v in fedavg(moved).items()})
    return out
