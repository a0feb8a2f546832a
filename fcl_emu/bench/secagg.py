"""``fcl-emu bench secagg``: what one SecAgg+ round costs, per phase, in one process.

Runs the protocol's client and server state machines (secagg/, driven by
secagg/simulation.py) for one round of ``clients`` clients with ``dim``
values each and ``neighbors`` neighbours; each client drops out with
probability ``dropout`` at a phase drawn uniformly from the four. Reports,
per phase: the median and maximum client time, the server time, and the
bytes down (server to all clients) and up (all clients to the server) as
msgpack would carry them. In the same run it measures the lower bound of a
client's masking: ``neighbors + 1`` plain ChaCha20 expansions of ``dim``
values, against the client's masked-input phase; and (``--flower``, the
default) Flower's SecAgg+ client on the same N, K and D, in Flower's own
environment (:mod:`fcl_emu.bench.flower_secagg`, :mod:`fcl_emu.bench.flower_env`).

This measures the cryptography and the quantisation only: the wire (framing,
ZeroMQ, the coordinator's event loop) comes with the protocol's integration
into rounds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console

from fcl_emu.secagg.protocol import SecAggAbort
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.secagg.simulation import EXCHANGES, PhaseStats, measure_masking, simulate_round
from fcl_emu.bench.flower_secagg import measure_flower_masking
from fcl_emu.bench.report import emit


def dropout_pattern(roster: list[str], dropout: float, rng: np.random.Generator) -> dict[str, int]:
    """Each client drops with probability ``dropout``, from a phase drawn uniformly in 1..4."""
    return {c: int(rng.integers(1, 5)) for c in roster if rng.random() < dropout}


def run(clients: int, dim: int, neighbors: int | None, threshold: int | None, dropout: float, seed: int,
        json_path: Path | None, console: Console, flower: bool = True, flower_python: Path | None = None) -> dict:
    if clients < 3:
        raise ValueError("--clients must be at least 3")
    if not 0 <= dropout < 1:
        raise ValueError("--dropout must be in [0, 1)")
    rng = np.random.default_rng(seed)
    roster = [f"client-{i:04d}" for i in range(clients)]
    settings = SecAggSettings(neighbors=neighbors, threshold=threshold)
    stats = PhaseStats()
    pattern = dropout_pattern(roster, dropout, rng)
    status = "ok"

    def client_input(client: str) -> tuple[np.ndarray, int, np.random.Generator]:
        # drawn when the client masks, so that N x D inputs never sit in memory together
        gen = np.random.default_rng([seed, roster.index(client)])
        return (gen.standard_normal(dim, np.float32) * 0.1, 1, gen)

    try:
        result = simulate_round(roster, dim, client_input, settings, round_id=1, seed=seed, dropout=pattern,
                                stats=stats)
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
    k = settings.neighbors_for(clients)
    masking = measure_masking(dim=dim, neighbors=k, repeats=3, seed=seed)
    extra = {"clients": clients, "dim": dim, "dropout": dropout, "dropped": len(pattern), "status": status,
             "survivors": survivors, "neighbors": masking["neighbors"],
             "threshold": settings.threshold_for(masking["neighbors"]),
             "lower_bound_ms": 1e3 * masking["lower_bound_s"],
             "client_masked_input_ms": 1e3 * masking["client_masked_input_s"],
             "client_mask_ms": 1e3 * masking["client_mask_s"],
             "ratio_masked_input_to_lower_bound": masking["ratio_masked_input"],
             "ratio_mask_to_lower_bound": masking["ratio_mask"]}
    if flower:
        extra.update(flower_fields(measure_flower_masking(dim=dim, neighbors=k, seed=seed, clients=clients,
                                                          python=flower_python), masking["client_masked_input_s"]))
    return emit("secagg", rows, extra, json_path, console)


def flower_fields(measured: dict | None, ours_masked_input_s: float) -> dict:
    """The report's Flower fields: its client times and our speed-up, or why there are none."""
    if measured is None:
        return {"flower": "no Flower environment (fcl-emu bench flower-env)"}
    if "error" in measured:
        return {"flower_version": measured["version"], "flower": measured["error"]}
    return {"flower_version": measured["version"], "flower_masked_input_ms": 1e3 * measured["masked_input_s"],
            "flower_share_keys_ms": 1e3 * measured["share_keys_s"],
            "speedup_vs_flower": measured["masked_input_s"] / ours_masked_input_s,
            "flower_sums_to_inputs": measured["sums_to_inputs"]}
