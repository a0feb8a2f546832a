"""Flower's SecAgg+ client on the same task as ours: the comparison of ``fcl-emu bench secagg``.

:func:`measure_flower_masking`, on the product's side, runs this module in Flower's environment
(:mod:`fcl_emu.bench.flower_env`): ``python -m fcl_emu.bench.flower_secagg --dim D --neighbors K --json``
prints the measurement as JSON.

There, it drives the client stage functions of Flower's SecAgg+ mod
(``flwr.client.mod.secure_aggregation.secaggplus_mod``: ``_setup``, ``_share_keys``,
``_collect_masked_vectors``) in one process, for ``neighbors + 1`` clients that are all each other's
neighbours: a client's cost depends on its degree k, not on N, so this is one client of an N-client
SecAgg+ round with k neighbours. The parameters match ours (:class:`fcl_emu.secagg.settings.SecAggSettings`):
clipping range 1.0, a 2^32 modulus, a target (quantisation) range of floor((2^32 - 1) / N) levels
so that N clients cannot overflow it, the threshold floor(k/2) + 1, and weight 1 of max weight 1.
The input is one float32 vector of ``dim`` values as a single ndarray in Flower's ``Parameters``, as a
``ClientApp`` would return it; the masked-vector stage includes Flower's (de)serialisation of it. Every
client masks, so every run also checks what it timed: the masked vectors, less their self masks, sum mod 2^32
(the pairwise masks cancel) to the k + 1 quantised inputs.

These functions are private to Flower: they are called directly because this is a benchmark of Flower's
implementation and the public path (a ``ClientApp`` behind a ``SuperLink``) would time the transport too.
If Flower's internals differ from what this module expects, the measurement is an ``error`` instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from fcl_emu.bench.flower_env import NoFlowerEnv, find_python, module_command
from fcl_emu.secagg.protocol import default_threshold

FLOWER_MOD_RANGE = 2**32  # our 32-bit ring; also the default modulus_range of Flower's SecAggPlusWorkflow


def measure_flower_masking(dim: int, neighbors: int, seed: int = 0, clients: int | None = None, clip: float = 1.0,
                           python: Path | None = None) -> dict[str, Any] | None:
    """Flower's client time in the masked-vector stage and in share_keys (each the best of the k + 1 clients), and
    whether their masked vectors sum to the inputs, measured in Flower's environment (``python``, else the one
    :func:`fcl_emu.bench.flower_env.find_python` finds).

    ``None`` when there is no Flower environment; a dict with ``error`` when Flower's internals are not what
    :func:`flower_round` expects or its side fails. ``seed`` draws the input vector (N(0, (clip/4)^2), as ours).
    Raises :class:`fcl_emu.bench.flower_env.FlowerEnvError` for a Flower environment that cannot be used."""
    try:
        flower = find_python(python)
    except NoFlowerEnv:
        return None
    args = ["--dim", str(dim), "--neighbors", str(neighbors), "--seed", str(seed), "--clip", str(clip), "--json",
            *(["--clients", str(clients)] if clients else [])]
    done = subprocess.run(module_command(flower, __name__, args), capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"version": flower.flwr, "error": f"Flower's side failed (exit {done.returncode}): {last}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- Flower's side, in Flower's environment
@dataclass
class FlowerRound:
    """What :func:`flower_round` leaves: the stage timings and the sum of the clients' unmasked inputs."""

    target_range: int
    share_keys_s: list[float] = field(default_factory=list)  # one per client
    masked_input_s: list[float] = field(default_factory=list)  # one per client
    # sum over the clients of (masked vector - its self mask) mod 2^32: [weight element, values]
    unmasked_sum: list[np.ndarray] = field(default_factory=list)


def flower_round(vector: np.ndarray, neighbors: int, clients: int | None = None, clip: float = 1.0) -> FlowerRound:
    """Flower's client stages for ``neighbors + 1`` mutual neighbours, up to the masked vectors.

    Every client runs setup and share_keys (ciphertexts are routed to their destinations as Flower's
    server would), then masks ``vector`` with weight 1. The target range is sized for ``clients`` clients
    (default ``neighbors + 1``). Raises whatever Flower raises.
    """
    mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
    from flwr.common import bytes_to_ndarray, ndarrays_to_parameters
    from flwr.common.secure_aggregation.secaggplus_constants import Key
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    n = neighbors + 1
    out = FlowerRound(target_range=(FLOWER_MOD_RANGE - 1) // (clients or n))
    setup = {Key.SAMPLE_NUMBER: n, Key.SHARE_NUMBER: n, Key.THRESHOLD: default_threshold(neighbors),
             Key.CLIPPING_RANGE: float(clip), Key.TARGET_RANGE: out.target_range, Key.MOD_RANGE: FLOWER_MOD_RANGE,
             Key.MAX_WEIGHT: 1.0}
    node_ids = list(range(1, n + 1))
    states: dict[int, Any] = {}  # node id -> Flower's SecAggPlusState
    public_keys: dict[str, list[bytes]] = {}
    for nid in node_ids:
        state = mod.SecAggPlusState()
        state.nid = nid  # the mod takes it from the message's destination
        reply = mod._setup(state, dict(setup))
        states[nid] = state
        public_keys[str(nid)] = [reply[Key.PUBLIC_KEY_1], reply[Key.PUBLIC_KEY_2]]
    inbox: dict[int, tuple[list[int], list[bytes]]] = {nid: ([], []) for nid in node_ids}
    for nid in node_ids:
        start = time.perf_counter()
        reply = mod._share_keys(states[nid], dict(public_keys))
        out.share_keys_s.append(time.perf_counter() - start)
        for dst, ciphertext in zip(reply[Key.DESTINATION_LIST], reply[Key.CIPHERTEXT_LIST], strict=True):
            inbox[dst][0].append(nid)
            inbox[dst][1].append(ciphertext)
    parameters = ndarrays_to_parameters([np.asarray(vector, dtype=np.float32)])
    for nid in node_ids:
        sources, ciphertexts = inbox[nid]
        configs = {Key.SOURCE_LIST: list(sources), Key.CIPHERTEXT_LIST: list(ciphertexts)}
        start = time.perf_counter()
        reply = mod._collect_masked_vectors(states[nid], configs, 1, parameters)
        out.masked_input_s.append(time.perf_counter() - start)
        masked = [bytes_to_ndarray(a).astype(np.int64) for a in reply[Key.MASKED_PARAMETERS]]
        self_mask = pseudo_rand_gen(states[nid].rd_seed, FLOWER_MOD_RANGE, [a.shape for a in masked])
        unmasked = [m - s for m, s in zip(masked, self_mask, strict=True)]
        out.unmasked_sum = ([t + u for t, u in zip(out.unmasked_sum, unmasked, strict=True)] if out.unmasked_sum
                            else unmasked)
    out.unmasked_sum = [a % FLOWER_MOD_RANGE for a in out.unmasked_sum]
    return out


def sums_to_inputs(result: FlowerRound, vector: np.ndarray, clip: float = 1.0) -> bool:
    """Whether the k + 1 clients' unmasked sum is, mod 2^32, k + 1 times the quantised ``vector``: the weight element
    exactly (q_ratio = target range for weight 1 of 1), each value within one quantisation level per client (Flower
    rounds stochastically) and float32's rounding (Flower quantises in float32: about 2^-23 of the range)."""
    weight, values = result.unmasked_sum
    n, levels = len(result.masked_input_s), result.target_range
    exact = n * (np.clip(vector.astype(np.float64), -clip, clip) + clip) * (levels / (2 * clip))
    off = (values - exact + FLOWER_MOD_RANGE / 2) % FLOWER_MOD_RANGE - FLOWER_MOD_RANGE / 2
    return int(weight[0]) == n * levels % FLOWER_MOD_RANGE and bool(np.all(np.abs(off) <= n * (1 + levels * 2**-22)))


def flower_masking(dim: int, neighbors: int, seed: int = 0, clients: int | None = None,
                   clip: float = 1.0) -> dict[str, Any]:
    """Flower's side of :func:`measure_flower_masking`."""
    flwr = version("flwr")
    vector = (np.random.default_rng(seed).standard_normal(dim) * (clip / 4)).astype(np.float32)
    try:
        result = flower_round(vector, neighbors, clients=clients, clip=clip)
    except (ImportError, AttributeError, TypeError, KeyError, ValueError, IndexError) as exc:
        return {"version": flwr, "error": f"Flower's SecAgg+ client API differs: {type(exc).__name__}: {exc}"}
    return {"version": flwr, "dim": dim, "neighbors": neighbors, "clients": clients or neighbors + 1,
            "target_range": result.target_range, "mod_range": FLOWER_MOD_RANGE,
            "share_keys_s": min(result.share_keys_s), "masked_input_s": min(result.masked_input_s),
            "sums_to_inputs": sums_to_inputs(result, vector, clip)}


def main() -> None:
    parser = argparse.ArgumentParser(description="Flower's side of `fcl-emu bench secagg` (in Flower's environment).")
    parser.add_argument("--dim", type=int, required=True, help="values per client (D)")
    parser.add_argument("--neighbors", type=int, required=True, help="neighbours per client (K)")
    parser.add_argument("--clients", type=int, default=None, help="clients the target range is sized for (N)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input vector")
    parser.add_argument("--clip", type=float, default=1.0, help="clipping range")
    parser.add_argument("--json", action="store_true", help="print the result as one line of JSON")
    args = parser.parse_args()
    result = flower_masking(args.dim, args.neighbors, args.seed, args.clients, args.clip)
    print(json.dumps(result) if args.json else "\n".join(f"{key}: {value}" for key, value in result.items()))


if __name__ == "__main__":
    main()
