"""Flower's SecAgg+ client on the same task as ours: the comparison of ``fcl-emu bench secagg``.

Drives the client stage functions of Flower's SecAgg+ mod
(``flwr.client.mod.secure_aggregation.secaggplus_mod``: ``_setup``, ``_share_keys``,
``_collect_masked_vectors``) in one process, for ``neighbors + 1`` clients that are all each other's
neighbours: a client's cost depends on its degree k, not on N, so this is one client of an N-client
SecAgg+ round with k neighbours. The parameters match ours (:class:`fcl_emu.secagg.settings.SecAggSettings`):
clipping range 1.0, a 2^32 modulus, a target (quantisation) range of floor((2^32 - 1) / N) levels
so that N clients cannot overflow it, the threshold floor(k/2) + 1, and weight 1 of max weight 1.
The input is one float32 vector of ``dim`` values as a single ndarray in Flower's ``Parameters``, as a
``ClientApp`` would return it; the masked-vector stage includes Flower's (de)serialisation of it.

These functions are private to Flower: they are called directly because this is a benchmark of Flower's
implementation and the public path (a ``ClientApp`` behind a ``SuperLink``) would time the transport too.
If Flower's internals differ from what this module expects, :func:`measure_flower_masking` returns an
``error`` instead of raising.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fcl_emu.secagg.protocol import default_threshold

FLOWER_MOD_RANGE = 2**32  # our 32-bit ring; also the default modulus_range of Flower's SecAggPlusWorkflow


@dataclass
class FlowerRound:
    """What :func:`flower_round` leaves: Flower's client states and replies, and the stage timings."""

    states: dict[int, Any]  # node id -> Flower's SecAggPlusState
    masked: dict[int, list[bytes]] = field(default_factory=dict)  # node id -> serialised masked ndarrays
    share_keys_s: list[float] = field(default_factory=list)  # one per client
    masked_input_s: list[float] = field(default_factory=list)  # one per client that ran the stage
    target_range: int = 0


def flower_version() -> str | None:
    """The installed flwr version, ``None`` when flwr cannot be imported."""
    try:
        flwr = importlib.import_module("flwr")
    except ImportError:
        return None
    try:
        from importlib.metadata import version

        return version("flwr")
    except Exception:  # noqa: BLE001 - an odd install: fall back to the module attribute
        return str(getattr(flwr, "__version__", "unknown"))


def flower_round(vector: np.ndarray, neighbors: int, clients: int | None = None, masked_clients: int | None = None,
                 clip: float = 1.0) -> FlowerRound:
    """Flower's client stages for ``neighbors + 1`` mutual neighbours, up to the masked vectors.

    Every client runs setup and share_keys (ciphertexts are routed to their destinations as Flower's
    server would); the first ``masked_clients`` (default all) then mask ``vector`` with weight 1. The
    target range is sized for ``clients`` clients (default ``neighbors + 1``). Raises whatever Flower raises.
    """
    mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
    from flwr.common import ndarrays_to_parameters
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    n = neighbors + 1
    target_range = (FLOWER_MOD_RANGE - 1) // (clients or n)
    setup = {Key.SAMPLE_NUMBER: n, Key.SHARE_NUMBER: n, Key.THRESHOLD: default_threshold(neighbors),
             Key.CLIPPING_RANGE: float(clip), Key.TARGET_RANGE: target_range, Key.MOD_RANGE: FLOWER_MOD_RANGE,
             Key.MAX_WEIGHT: 1.0}
    node_ids = list(range(1, n + 1))
    out = FlowerRound(states={}, target_range=target_range)
    public_keys: dict[str, list[bytes]] = {}
    for nid in node_ids:
        state = mod.SecAggPlusState()
        state.nid = nid  # the mod takes it from the message's destination
        reply = mod._setup(state, dict(setup))
        out.states[nid] = state
        public_keys[str(nid)] = [reply[Key.PUBLIC_KEY_1], reply[Key.PUBLIC_KEY_2]]
    inbox: dict[int, tuple[list[int], list[bytes]]] = {nid: ([], []) for nid in node_ids}
    for nid in node_ids:
        start = time.perf_counter()
        reply = mod._share_keys(out.states[nid], dict(public_keys))
        out.share_keys_s.append(time.perf_counter() - start)
        for dst, ciphertext in zip(reply[Key.DESTINATION_LIST], reply[Key.CIPHERTEXT_LIST], strict=True):
            inbox[dst][0].append(nid)
            inbox[dst][1].append(ciphertext)
    parameters = ndarrays_to_parameters([np.asarray(vector, dtype=np.float32)])
    for nid in node_ids[:masked_clients]:
        sources, ciphertexts = inbox[nid]
        configs = {Key.SOURCE_LIST: list(sources), Key.CIPHERTEXT_LIST: list(ciphertexts)}
        start = time.perf_counter()
        reply = mod._collect_masked_vectors(out.states[nid], configs, 1, parameters)
        out.masked_input_s.append(time.perf_counter() - start)
        out.masked[nid] = reply[Key.MASKED_PARAMETERS]
    return out


def measure_flower_masking(dim: int, neighbors: int, repeats: int = 3, seed: int = 0, clients: int | None = None,
                           clip: float = 1.0) -> dict[str, Any] | None:
    """Flower's client time in the masked-vector stage (best of ``repeats`` clients) and in share_keys (best of
    all k + 1 clients, which all run it).

    ``None`` when flwr is not installed; a dict with ``error`` when Flower's internals are not what
    :func:`flower_round` expects. ``seed`` draws the input vector (N(0, (clip/4)^2), as ours).
    """
    version = flower_version()
    if version is None:
        return None
    k = int(neighbors)
    vector = (np.random.default_rng(seed).standard_normal(dim) * (clip / 4)).astype(np.float32)
    try:
        result = flower_round(vector, k, clients=clients, masked_clients=max(1, repeats), clip=clip)
    except (ImportError, AttributeError, TypeError, KeyError, ValueError, IndexError) as exc:
        return {"version": version, "error": f"Flower's SecAgg+ client API differs: {type(exc).__name__}: {exc}"}
    return {"version": version, "dim": dim, "neighbors": k, "clients": clients or k + 1, "repeats": max(1, repeats),
            "target_range": result.target_range, "mod_range": FLOWER_MOD_RANGE,
            "share_keys_s": min(result.share_keys_s), "masked_input_s": min(result.masked_input_s)}
