"""One SecAgg+ round driven in a single process, with its per-phase costs (tests and ``fcl-emu bench secagg``).

:func:`simulate_round` passes the server's messages to :class:`fcl_emu.secagg.client.SecAggClient` objects and their
replies back, with scripted dropouts; :func:`measure_masking` times a client's masking against its lower bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from fcl_emu.secagg.client import SecAggClient
from fcl_emu.secagg.protocol import PHASES, RING_DTYPE, prg_into
from fcl_emu.secagg.server import SecAggResult, SecAggServer
from fcl_emu.secagg.settings import SecAggSettings

def wire_size(obj: Any) -> int:
    """Approximate bytes of a phase message on the wire: arrays as raw bytes (tensor frames), the rest as
    msgpack (the header); the framing's fixed overhead is not counted."""
    arrays: list[int] = []

    def strip(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            arrays.append(o.nbytes)
            return None
        if isinstance(o, Mapping):
            return {k: strip(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [strip(v) for v in o]
        return o

    return len(msgspec.msgpack.encode(strip(obj))) + sum(arrays)


EXCHANGES = PHASES[1:]


@dataclass
class PhaseStats:
    """Per exchange (the server's message opening phase p, the clients' replies in phase p; named after p):
    seconds of each client that replied, seconds of the server, bytes down (all messages sent) and up."""

    client_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in EXCHANGES})
    server_s: dict[str, float] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=lambda: {p: 0 for p in EXCHANGES})
    bytes_up: dict[str, int] = field(default_factory=lambda: {p: 0 for p in EXCHANGES})


def simulate_round(roster: Sequence[str], dim: int, inputs: Callable[[str], tuple[Any, int, np.random.Generator]],
                   settings: SecAggSettings | None = None, round_id: int = 0, seed: int = 0,
                   dropout: Mapping[str, int] | None = None, stats: PhaseStats | None = None,
                   server: SecAggServer | None = None,
                   clients: Mapping[str, SecAggClient] | None = None,
                   models: Mapping[str, bytes] | None = None) -> SecAggResult:
    """Runs one round in this process (tests, benchmarks): ``inputs(client)`` gives (vector, weight, rng)
    when the client masks; ``dropout[client] = p`` makes it go silent from phase p on (1: no keys,
    2: no shares, 3: no masked input, 4: no unmasking answer); ``clients``: the clients' protocol objects (default:
    plain ones); ``models``: the digest of the model each client trained (:mod:`fcl_emu.secagg.consistency`).
    Raises :class:`SecAggAbort` as the server does.
    """
    dropout = dict(dropout or {})
    server = server or SecAggServer(roster, dim, settings, round_id, seed)
    clients = dict(clients or {c: SecAggClient(c) for c in roster})
    st = stats

    def exchange(phase: int, msgs: Mapping[str, Any], step: Callable[[SecAggClient, Any], Any],
                 receive: Callable[[str, Any], None]) -> None:
        for c, msg in msgs.items():
            if st is not None:
                st.bytes_down[PHASES[phase]] += wire_size(msg)
            if dropout.get(c, 99) <= phase:
                continue
            reply = step(clients[c], msg)
            if st is not None:
                st.client_s[PHASES[phase]].append(clients[c].timings[PHASES[phase]])
                st.bytes_up[PHASES[phase]] += wire_size(reply)
            receive(c, reply)

    def masked(cl: SecAggClient, msg: Any) -> Any:
        vector, weight, rng = inputs(cl.client)
        return cl.on_shares(msg, vector, weight, rng, None if models is None else models[cl.client])

    try:
        exchange(1, server.setup(), SecAggClient.on_setup, server.receive_keys)
        exchange(2, server.close_keys(), SecAggClient.on_keys, server.receive_shares)
        exchange(3, server.close_shares(), masked, server.receive_masked)
        exchange(4, server.close_masked(), SecAggClient.on_unmask, server.receive_unmask)
        return server.close_unmask()
    finally:
        if st is not None:
            st.server_s.update(server.timings)


def measure_masking(dim: int = 1_000_000, neighbors: int = 10, clients: int | None = None, repeats: int = 3,
                    seed: int = 0, clip: float = 1.0) -> dict[str, Any]:
    """Client phase-3 time (quantise + decrypt shares + k + 1 mask expansions and additions) against its lower
    bound, k + 1 plain ChaCha20 expansions of dim + 1 values into a preallocated array (best of ``repeats``).

    Builds a round of ``clients`` (default k + 1) clients, runs the first phases for all of them and phase 3
    for ``repeats`` of them; nothing is aggregated. Returns seconds (best of the repeats) and the ratios.
    """
    n = clients or neighbors + 1
    roster = [f"c{i:04d}" for i in range(n)]
    server = SecAggServer(roster, dim, SecAggSettings(neighbors=neighbors, clip=clip), round_id=1, seed=seed)
    cls = {c: SecAggClient(c) for c in roster}
    for c, m in server.setup().items():
        server.receive_keys(c, cls[c].on_setup(m))
    for c, m in server.close_keys().items():
        server.receive_shares(c, cls[c].on_keys(m))
    msgs = server.close_shares()
    k = server.params.neighbors
    rng = np.random.default_rng(seed)
    vector = rng.standard_normal(dim) * (clip / 4)
    phase3, quant, mask = [], [], []
    for c in roster[:repeats]:
        cls[c].on_shares(msgs[c], vector, 1, np.random.default_rng(seed))
        tm = cls[c].timings
        phase3.append(tm["masked_input"])
        quant.append(tm["quantize"])
        mask.append(tm["mask"])
    out = np.empty(dim + 1, RING_DTYPE)
    bound = []
    keys = [rng.bytes(32) for _ in range(k + 1)]
    for _ in range(repeats):
        start = time.perf_counter()
        for key in keys:
            prg_into(key, out)
        bound.append(time.perf_counter() - start)
    lb = min(bound)
    return {"dim": dim, "neighbors": k, "clients": n, "repeats": repeats,
            "lower_bound_s": lb, "expansion_s": lb / (k + 1),
            "client_masked_input_s": min(phase3), "client_quantize_s": min(quant), "client_mask_s": min(mask),
            "ratio_masked_input": min(phase3) / lb, "ratio_mask": min(mask) / lb}

