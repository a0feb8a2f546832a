"""The default backend: every edge node is a child process of ``fcl-emu up`` on this machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fcl_emu.coordinator.contracts import NodeExit
from fcl_emu.edge_node.args import NodeArgs
from fcl_emu.launchers import zygote
from fcl_emu.launchers.base import NodeLauncher, NodeSpec, last_error, node_args, node_specs, signal_exit
from fcl_emu.launchers.aggregators import AggregatorProcesses
from fcl_emu.launchers.zygote import ForkedProcess
from fcl_emu.runconfig import RunConfig


def node_command(args: NodeArgs) -> list[str]:
    """The command line of an edge node with ``args`` as a process of this Python started afresh."""
    return [sys.executable, "-m", "fcl_emu.edge_node", *args.to_argv()]


# Added to an edge-node process's environment: one torch thread (nodes are the unit of parallelism).
# (glibc's MALLOC_MMAP_THRESHOLD_ was tried to return freed message buffers to the system: it makes every large
# torch temporary an mmap/munmap pair and slowed local training about 20-fold.)
NODE_ENV = {"OMP_NUM_THREADS": "1"}


def node_env() -> dict[str, str]:
    """The environment of an edge-node process started afresh."""
    return {**os.environ, **NODE_ENV}


class ProcessLauncher(NodeLauncher):
    """The edge nodes as processes of this machine, forked by ``up``'s zygote where it has one
    (:mod:`fcl_emu.launchers.zygote`), else children started with ``python -m fcl_emu.edge_node``; stopped for sure
    on exit, and ending with ``up`` even if it is killed (``--parent-pid``,
    :func:`fcl_emu.runtime.process.exit_with_parent`)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen | ForkedProcess] = []
        self._nodes: list[tuple[NodeSpec, Path]] = []
        self.aggregators = AggregatorProcesses()

    def start(self, address: str, config: RunConfig, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        forks = zygote.current()
        specs = node_specs(config)
        self.aggregators.start(address, config, log_dir, [node.name for node in specs])  # first what nodes dial
        for node in specs:
            log_file = log_dir / f"{node.name}.log"  # appended to by `up --resume`
            dial, server = self.aggregators.dial(node.number, address)
            args = node_args(dial, node.clients, config, node.name, node.number,
                             parent_pid=os.getpid() if forks is None else forks.pid, server=server)
            if forks is not None:
                self.procs.append(forks.spawn(args, log_file, NODE_ENV))
            else:
                with open(log_file, "ab") as log:
                    self.procs.append(subprocess.Popen(node_command(args), stdout=log, stderr=subprocess.STDOUT,
                                                       env=node_env()))
            self._nodes.append((node, log_file))

    @property
    def count(self) -> int:
        return len(self.procs)

    def hosts(self) -> dict[str, str]:
        return {node.name: socket.gethostname() for node, _log in self._nodes}

    def pids(self) -> dict[str, int]:
        return {**{node.name: p.pid for p, (node, _log) in zip(self.procs, self._nodes) if p.poll() is None},
                **self.aggregators.pids()}

    def exited(self) -> list[NodeExit]:
        return [NodeExit(node.name, p.returncode, len(node.clients), last_error(log_file) or signal_exit(p.returncode))
                for p, (node, log_file) in zip(self.procs, self._nodes) if p.poll() is not None] + \
            self.aggregators.exited()

    def stop(self, grace_s: float = 10.0) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.aggregators.stop(grace_s=max(0.1, deadline - time.monotonic()))
