"""What the in-process benchmarks share: a coordinator of this process run with one edge-node process per entry of
an assignment, and the round records it wrote."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.launchers.aggregators import AggregatorProcesses
from fcl_emu.launchers.base import node_args
from fcl_emu.launchers.process import node_command, node_env
from fcl_emu.monitoring.results import RunSummary
from fcl_emu.runconfig import RunConfig


def run_with_nodes(coordinator: Coordinator, config: RunConfig, assignment: list[list[int]], run_dir: Path, *,
                   started: Callable[[int, int], None] = lambda n, pid: None,
                   wait_s: float = 60.0) -> tuple[RunSummary, list[dict]]:
    """Start node ``n`` (``node-<n>``, the clients ``assignment[n]``; ``started(n, pid)`` is told), under the
    config's edge aggregators if it has any (node n dials aggregator n mod M), run the coordinator into ``run_dir``,
    wait up to ``wait_s`` for each node to end (then kill it) and close the coordinator. Returns the summary and the
    round records."""
    procs: list[subprocess.Popen] = []
    aggregators = AggregatorProcesses()
    try:
        aggregators.start(coordinator.address, config, run_dir / "logs", [f"node-{n}" for n in range(len(assignment))])
        for n, indices in enumerate(assignment):
            address, server = aggregators.dial(n, coordinator.address)
            args = node_args(address, indices, config, f"node-{n}", n, server=server)
            procs.append(subprocess.Popen(node_command(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          env=node_env()))
            started(n, procs[-1].pid)
        summary = coordinator.run(run_dir)
    finally:
        for p in procs:
            try:
                p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                p.kill()
        aggregators.stop(grace_s=wait_s)
        coordinator.close()
    events = (run_dir / "events.jsonl").read_text().splitlines()
    return summary, [e for e in map(json.loads, events) if e["event"] == "round"]
