"""The edge aggregators of a hierarchical run (``--edge-aggregators M``, docs/hierarchy.md): processes of this
machine that ``up`` starts before the edge nodes, each bound to a free local port; node n dials aggregator
n mod M (:func:`fcl_emu.runconfig.topology.aggregator_of_node`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from fcl_emu.coordinator.contracts import NodeExit
from fcl_emu.edge_aggregator.args import AggregatorArgs
from fcl_emu.launchers.base import last_error, signal_exit
from fcl_emu.runconfig import RunConfig
from fcl_emu.runconfig.topology import aggregator_name, aggregator_of_node
from fcl_emu.wire.auth import SERVER_NAME


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the operating system's pick; the aggregator binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def aggregator_args(index: int, coordinator: str, bind: str, config: RunConfig,
                    parent_pid: int | None = None) -> AggregatorArgs:
    """The arguments of aggregator ``index``, dialling ``coordinator`` and bound to ``bind``, under the run's keys,
    with the run's defences for its edge rounds."""
    keys: dict = {"insecure": True}
    if config.security.transport != "plain":
        directory = Path(config.security.keys)
        keys = {"server_key": directory / f"{SERVER_NAME}.key",
                "key": directory / f"{aggregator_name(index)}.key_secret"}
    interval, _ = config.network.liveness(config.scenario.num_clients)
    defences = config.aggregation  # the bounds on its edge rounds before the last (the last's come with the collect)
    return AggregatorArgs(coordinator, bind, aggregator_name(index), heartbeat_interval=interval,
                          edge_rounds=config.topology.edge_rounds, edge_round_timeout=config.rounds.deadline_s,
                          max_update_norm=defences.max_update_norm, direction_check=defences.direction_check,
                          clip_norm=defences.clip_norm, adaptive_clip=defences.adaptive_clip,
                          parent_pid=parent_pid, **keys)


class AggregatorProcesses:
    """The run's aggregators: started, asked after, stopped. ``nodes[a]``: the names of aggregator a's nodes."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self._logs: list[Path] = []
        self.nodes: list[tuple[str, ...]] = []

    def start(self, coordinator: str, config: RunConfig, log_dir: Path, node_names: list[str]) -> None:
        """Start the config's aggregators (none in a star), dialling ``coordinator``; node n of ``node_names``
        will sit under aggregator n mod M."""
        m = config.topology.edge_aggregators
        if m:
            log_dir.mkdir(parents=True, exist_ok=True)
        for index, under in enumerate(tuple(node_names[a::m]) for a in range(m)):
            address = f"tcp://127.0.0.1:{free_port()}"
            args = aggregator_args(index, coordinator, address, config, parent_pid=os.getpid())
            log_file = log_dir / f"{aggregator_name(index)}.log"
            with open(log_file, "ab") as log:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "fcl_emu.edge_aggregator", *args.to_argv()],
                                                   stdout=log, stderr=subprocess.STDOUT))
            self.addresses.append(address)
            self._logs.append(log_file)
            self.nodes.append(under)

    def dial(self, node: int, coordinator: str) -> tuple[str, str]:
        """Where edge node ``node`` connects, and the name of the key it expects there: its aggregator's, or the
        coordinator's in a star."""
        if not self.addresses:
            return coordinator, SERVER_NAME
        a = aggregator_of_node(node, len(self.addresses))
        return self.addresses[a], aggregator_name(a)

    def exited(self) -> list[NodeExit]:
        return [NodeExit(aggregator_name(a), p.returncode, 0, last_error(log) or signal_exit(p.returncode),
                         cut_off=self.nodes[a])
                for a, (p, log) in enumerate(zip(self.procs, self._logs)) if p.poll() is not None]

    def pids(self) -> dict[str, int]:
        return {aggregator_name(a): p.pid for a, p in enumerate(self.procs) if p.poll() is None}

    def stop(self, grace_s: float) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
