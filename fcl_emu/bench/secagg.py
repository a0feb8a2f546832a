"""``fcl-emu bench secagg``: what one SecAgg+ round costs, per phase, in one process.

Runs the protocol's client and server state machines (coordinator/secagg.py,
edge_node/secagg.py) for one round of ``clients`` clients with ``dim``
values each and ``neighbors`` neighbours; each client drops out with
probability ``dropout`` at a phase drawn uniformly from the four. Reports,
per phase: the median and maximum client time, the server time, and the
bytes down (server to all clients) and up (all clients to the server) as
msgpack would carry them. In the same run it measures the lower bound of a
client's masking: ``neighbors + 1`` plain ChaCha20 expansions of ``dim``
values, against the client's masked-input phase.

This measures the cryptography and the quantisation only: the wire (framing,
ZeroMQ, the coordinator's event loop) comes with the protocol's integration
into rounds, and so does the comparison with Flower's SecAgg+.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console

from coordinator.secagg import EXCHANGES, PhaseStats, SecAggConfig, log_neighbors, measure_masking, simulate_round
from edge_node.secagg import SecAggAbort
from fcl_emu.bench.report import emit


def dropout_pattern(roster: list[str], dropout: float, rng: np.random.Generator) -> dict[str, int]:
    """Each client drops with probability ``dropout``, from a phase drawn uniformly in 1..4."""
    return {c: int(rng.integers(1, 5)) for c in roster if rng.random() < dropout}


def run(clients: int, dim: int, neighbors: int | None, threshold: int | None, dropout: float, seed: int,
        json_path: Path | None, console: Console) -> dict:
    if clients < 3:
        raise ValueError("--clients must be at least 3")
    if not 0 <= dropout < 1:
        raise ValueError("--dropout must be in [0, 1)")
    rng = np.random.default_rng(seed)
    roster = [f"client-{i:04d}" for i in range(clients)]
    vectors = {c: rng.standard_normal(dim).astype(np.float32) * 0.1 for c in roster}
    config = SecAggConfig(neighbors=neighbors, threshold=threshold)
    stats = PhaseStats()
    pattern = dropout_pattern(roster, dropout, rng)
    status = "ok"
    try:
        result = simulate_round(roster, dim, lambda c: (vectors[c], 1, np.random.default_rng(seed)), config,
                                round_id=1, seed=seed, dropout=pattern, stats=stats)
        survivors = len(result.clients)
    except SecAggAbort as exc:
        status, survivors = f"aborted: {exc}", 0
    rows = []
    for phase in EXCHANGES:
        times = stats.client_s[phase]
        rows.append({"phase": phase, "clients": len(times),
                     "client_median_ms": 1e3 * float(np.median(times)) if times else float("nan"),
                     "client_max_ms": 1e3 * max(times) if times else float("nan"),
                     "server_ms": 1e3 * stats.server_s.get(phase, 0.0),
                     "bytes_down": stats.bytes_down[phase], "bytes_up": stats.bytes_up[phase]})
    k = log_neighbors(clients) if neighbors is None else min(neighbors, clients - 1)
    masking = measure_masking(dim=dim, neighbors=k, repeats=3, seed=seed)
    extra = {"clients": clients, "dim": dim, "dropout": dropout, "dropped": len(pattern), "status": status,
             "survivors": survivors, "neighbors": masking["neighbors"],
             "lower_bound_ms": 1e3 * masking["lower_bound_s"],
             "client_masked_input_ms": 1e3 * masking["client_masked_input_s"],
             "client_mask_ms": 1e3 * masking["client_mask_s"],
             "ratio_masked_input_to_lower_bound": masking["ratio_masked_input"],
             "ratio_mask_to_lower_bound": masking["ratio_mask"]}
    return emit("secagg", rows, extra, json_path, console)
