"""Starting a whole emulation on this machine: the coordinator here, edge nodes as processes."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fcl_emu.config import RunConfig


def parse_client_set(text: str) -> list[int]:
    """'0-3,7,9-10' -> [0, 1, 2, 3, 7, 9, 10]."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad client set {text!r}: use forms like '0-149' or '0,5,7-9'") from None
        if first < 0 or last < first:
            raise ValueError(f"bad client range {part!r}")
        out.extend(range(first, last + 1))
    if not out:
        raise ValueError("the client set is empty")
    return sorted(set(out))


def format_client_set(indices: list[int]) -> str:
    """Inverse of :func:`parse_client_set`, compact."""
    parts, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            parts.append(f"{start}-{value}" if value != start else str(value))
            start = None
    return ",".join(parts)


def node_assignment(num_clients: int, nodes: int) -> list[list[int]]:
    """Clients striped over nodes (i, i+nodes, ...): balances load and late joiners."""
    return [list(range(n, num_clients, nodes)) for n in range(nodes)]


def default_run_dir(config: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{config.method}-{config.scenario.dataset}-s{config.seed}"


def node_metrics_port(config: RunConfig, n: int) -> int | None:
    """Edge node ``n`` of ``up`` serves /metrics on the coordinator's port + 1 + n."""
    return None if config.metrics.port is None else config.metrics.port + 1 + n


def gpu_worker_metrics_port(config: RunConfig, j: int) -> int | None:
    """GPU worker ``j`` serves /metrics on the coordinator's port + 1 + nodes + j."""
    return None if config.metrics.port is None else config.metrics.port + 1 + config.nodes + j


def metrics_ports(config: RunConfig, start_nodes: bool) -> list[int]:
    """Every /metrics port of a run: the coordinator's, its edge nodes' (when it starts them), its workers'."""
    port = config.metrics.port
    nodes = [node_metrics_port(config, n) for n in range(config.nodes)] if start_nodes else []
    return [port, *nodes, *(gpu_worker_metrics_port(config, j) for j in range(config.gpu.workers))]


def node_command(address: str, indices: list[int], config: RunConfig, name: str, n: int = 0,
                 parent_pid: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "fcl_emu", "node", "--connect", address,
           "--clients", format_client_set(indices), "--name", name]
    if parent_pid is not None:
        cmd += ["--parent-pid", str(parent_pid)]
    for root in config.data_root:
        cmd += ["--data-root", str(root)]
    port = node_metrics_port(config, n)
    if port is not None:
        cmd += ["--metrics-port", str(port), "--metrics-host", config.metrics.host,
                "--metrics-linger", f"{config.metrics.linger:g}"]
    return cmd


def node_env() -> dict[str, str]:
    """Environment of an edge-node process: one torch thread (nodes are the unit of parallelism).

    (glibc's MALLOC_MMAP_THRESHOLD_ was tried to return freed message buffers
    to the system: it makes every large torch temporary an mmap/munmap pair and
    slowed local training about 20-fold.)
    """
    return {**os.environ, "OMP_NUM_THREADS": "1"}


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


class NodeProcesses:
    """The edge-node child processes of ``fcl-emu up``; stopped for sure on exit, and ending with it even
    if it is killed (``--parent-pid``, :func:`exit_with_parent`)."""

    def __init__(self, address: str, config: RunConfig, log_dir: Path):
        self.procs: list[subprocess.Popen] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        env = node_env()
        for n, indices in enumerate(node_assignment(config.scenario.num_clients, config.nodes)):
            name = f"node-{n}"
            log = open(log_dir / f"{name}.log", "ab")  # appended to by `up --resume`
            self.procs.append(subprocess.Popen(node_command(address, indices, config, name, n, os.getpid()),
                                               stdout=log, stderr=subprocess.STDOUT, env=env))
            log.close()

    def check(self) -> list[int]:
        """Exit codes of nodes that have exited."""
        return [p.returncode for p in self.procs if p.poll() is not None]

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
