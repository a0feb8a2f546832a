"""``fcl-emu bench round``: coordinator cost per round and memory per idle emulated client.

A real emulation on this machine (MNIST, the small CNN, one task, every
client sampled every round, evaluation off) with two edge nodes: node A
hosts one client, node B hosts the other ``clients - 1``. After the timed
rounds, while both nodes still run:

- coordinator time per round outside client training: the round's own work
  on the coordinator (encoding and sending the train requests, receiving,
  validating and decoding the updates, aggregating), against the round's
  wall-clock time; also the coordinator process's whole CPU time during the
  round, which adds serving every client's heartbeats for as long as the
  round lasts, and ZeroMQ's I/O threads;
- memory per idle client: (RSS of node B - RSS of node A) / (clients - 2),
  against the bytes of one model copy (an idle client must hold none).
"""

from __future__ import annotations

from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import psutil
from rich.console import Console

from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.bench.nodes import run_with_nodes
from fcl_emu.bench.report import emit
from fcl_emu.keys import with_keys
from fcl_emu.runconfig import RunConfig, default_data_roots


def run(clients: int, rounds: int, json_path: Path | None, data_root: list[Path] | None,
        console: Console) -> dict:
    if clients < 3:
        raise ValueError("--clients must be at least 3")
    config = RunConfig.model_validate({
        "scenario": {"dataset": "mnist", "num_tasks": 1, "num_clients": clients},
        "rounds": {"clients_per_round": clients, "rounds_per_task": rounds, "eval_every": 10**6},
        "training": {"local_epochs": 1}, "model": "cnn", "nodes": 2, "device": "cpu",
        "data_root": [str(p) for p in (data_root or default_data_roots())],
    })
    memory: dict[str, int] = {}
    pids: dict[int, int] = {}  # node -> pid: node 0 (A) hosts client 0, node 1 (B) the others

    def sample_memory(kind: str, info: dict) -> None:
        if kind == "round" and info["task_round"] == rounds - 1:
            memory["node_a"] = psutil.Process(pids[0]).memory_info().rss
            memory["node_b"] = psutil.Process(pids[1]).memory_info().rss

    with TemporaryDirectory() as tmp:
        assignment = [[0], list(range(1, clients))]
        config = with_keys(config, Path(tmp) / "keys", assignment)  # the run's default transport: CurveZMQ
        coordinator = Coordinator(config, progress=sample_memory)
        summary, records = run_with_nodes(coordinator, config, assignment, Path(tmp) / "run",
                                          started=pids.__setitem__, wait_s=20)
    model_bytes = sum(a.nbytes for a in coordinator.server.global_state.values())
    work = float(np.mean([sum(r["phases_s"][k] for k in ("dispatch", "receive_updates", "aggregate"))
                          for r in records]))
    cpu = float(np.mean([r["coordinator_cpu_s"] for r in records]))
    wall = float(np.mean([r["duration_s"] for r in records]))
    per_client = (memory["node_b"] - memory["node_a"]) / (clients - 2)
    rows = [
        {"quantity": "coordinator work per round (s)", "value": work, "baseline": wall,
         "ratio": work / wall, "target": "< 0.5 s"},
        {"quantity": "coordinator CPU during the round (s)", "value": cpu, "baseline": wall,
         "ratio": cpu / wall, "target": "-"},
        {"quantity": "memory per idle client (MB)", "value": per_client / 1e6, "baseline": model_bytes / 1e6,
         "ratio": per_client / model_bytes, "target": "< 2 MB"},
    ]
    return emit("round", rows, {
        "clients": clients, "rounds": rounds, "round_wall_clock_s": wall,
        "phases_s_mean": {k: float(np.mean([r["phases_s"][k] for r in records])) for k in records[0]["phases_s"]},
        "node_rss_bytes": memory, "model_bytes": model_bytes, "status": summary.status,
        "baselines": "coordinator CPU vs round wall-clock; idle-client memory vs one model copy",
    }, json_path, console)

