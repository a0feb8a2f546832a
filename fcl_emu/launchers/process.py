"""The default backend: every edge node is a child process of ``fcl-emu up`` on this machine."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from coordinator.lifecycle import NodeExit
from fcl_emu.launchers import zygote
from fcl_emu.launchers.base import NodeLauncher, NodeSpec, last_error, node_args, node_specs
from fcl_emu.launchers.zygote import ForkedProcess
from runconfig import RunConfig


def node_command(address: str, indices: list[int], config: RunConfig, name: str, n: int = 0,
                 parent_pid: int | None = None) -> list[str]:
    """The command line of edge node ``n`` as a process of this Python."""
    return [sys.executable, "-m", "fcl_emu", *node_args(address, indices, config, name, n, parent_pid)]


# Added to an edge-node process's environment: one torch thread (nodes are the unit of parallelism).
# (glibc's MALLOC_MMAP_THRESHOLD_ was tried to return freed message buffers to the system: it makes every large
# torch temporary an mmap/munmap pair and slowed local training about 20-fold.)
NODE_ENV = {"OMP_NUM_THREADS": "1"}


def node_env() -> dict[str, str]:
    """The environment of an edge-node process started afresh."""
    return {**os.environ, **NODE_ENV}


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent(parent_pid: int) -> None:
    """End this process as soon as ``parent_pid`` is no longer its parent, even if the parent was SIGKILLed.

    So the edge nodes of a killed ``fcl-emu up`` do not live on beside the nodes that ``up --resume`` starts
    under the same client identities. On Linux the kernel sends SIGKILL when the parent dies
    (``prctl(PR_SET_PDEATHSIG)``, set here in the child, not in a ``preexec_fn``, which is unsafe in a parent
    with threads). SIGKILL, not SIGTERM: with its coordinator gone a node can be blocked in a send that a
    signal handler cannot end, and it has nothing to save (client stores are written atomically). Elsewhere
    a daemon thread polls ``os.getppid()`` twice a second. A parent already gone is caught at once.
    """
    watched = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            watched = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            watched = False
    if os.getppid() != parent_pid:
        os._exit(1)
    if not watched:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ProcessLauncher(NodeLauncher):
    """The edge nodes as processes of this machine, forked by ``up``'s zygote where it has one
    (:mod:`fcl_emu.launchers.zygote`), else children started with ``python -m fcl_emu node``; stopped for sure
    on exit, and ending with ``up`` even if it is killed (``--parent-pid``, :func:`exit_with_parent`)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen | ForkedProcess] = []
        self._nodes: list[tuple[NodeSpec, Path]] = []

    def start(self, address: str, config: RunConfig, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        forks = zygote.current()
        for node in node_specs(config):
            log_file = log_dir / f"{node.name}.log"  # appended to by `up --resume`
            if forks is not None:
                args = node_args(address, node.clients, config, node.name, node.number, forks.pid)
                self.procs.append(forks.spawn(args, log_file, NODE_ENV))
            else:
                command = node_command(address, node.clients, config, node.name, node.number, os.getpid())
                with open(log_file, "ab") as log:
                    self.procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=node_env()))
            self._nodes.append((node, log_file))

    @property
    def count(self) -> int:
        return len(self.procs)

    def pids(self) -> dict[str, int]:
        return {node.name: p.pid for p, (node, _log) in zip(self.procs, self._nodes) if p.poll() is None}

    def exited(self) -> list[NodeExit]:
        return [NodeExit(node.name, p.returncode, len(node.clients), last_error(log_file))
                for p, (node, log_file) in zip(self.procs, self._nodes) if p.poll() is not None]

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
