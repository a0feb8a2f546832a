"""What the Docker and Swarm backends share: labels, addresses, the node exits they report, the containers they
hand to fault plans and container metrics, and the clean-up of the run's network."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from pathlib import Path

from fcl_emu.containers.cluster import LABEL_CLASS  # noqa: F401 (beside LABEL_RUN and LABEL_NODE for the launchers)
from fcl_emu.containers.docker_client import client
from fcl_emu.containers.faults import Target
from fcl_emu.coordinator.contracts import NodeExit
from fcl_emu.launchers.base import NodeLauncher, NodeSpec, last_error_line, signal_exit

log = logging.getLogger("fcl_emu.launchers")

LABEL_RUN = "fcl-emu.run"
LABEL_NODE = "fcl-emu.node"
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
ANY = {"0.0.0.0", "*", "::", "[::]"}


def run_label(run_dir: Path) -> str:
    """The label value of a run's containers, services and network: a hash of its run directory's path."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` -> (HOST, PORT)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host, port


NODE_PROGRAM = "python -m fcl_emu.edge_node"  # what an edge-node container runs (the image's Python, on its PATH)


def tbf_entrypoint(uplink_mbit: float, program: str = NODE_PROGRAM) -> list[str]:
    """Cap the container's egress with the kernel's token bucket filter, then run ``program`` (a command line)
    with the arguments (exit 3 if the cap cannot be set)."""
    burst_kbit = max(32, int(uplink_mbit * 1000 / 250))  # a 4 ms burst at the rate, at least 32 kbit
    script = (f"tc qdisc replace dev eth0 root tbf rate {uplink_mbit:g}mbit burst {burst_kbit}kbit latency 400ms "
              f"|| exit 3; exec {program} \"$@\"")
    return ["sh", "-c", script, program.split()[0]]


def node_entrypoint(uplink_mbit: float | None) -> list[str]:
    """The entrypoint of an edge-node container (its arguments: :meth:`~fcl_emu.edge_node.args.NodeArgs.to_argv`):
    ``python -m fcl_emu.edge_node``, behind a cap on its egress where its device class has an uplink rate."""
    return NODE_PROGRAM.split() if uplink_mbit is None else tbf_entrypoint(uplink_mbit)


def node_exit(spec: NodeSpec, code: int, container=None, reported: str = "") -> NodeExit:
    """The exit of ``spec``'s node: an out-of-memory kill named as such, else its last log line (``container``
    when it is on this host), else what the engine ``reported``, else the signal that ended it."""
    error = reported
    if container is not None:
        container.reload()
        if container.attrs["State"].get("OOMKilled"):
            error = f"out of memory: the kernel killed it at its container's {spec.limits.memory} memory limit"
        else:
            output = container.logs(stdout=True, stderr=True, tail=50).decode("utf-8", "replace")
            error = last_error_line(output) or error
    return NodeExit(spec.name, code, len(spec.clients), error or signal_exit(code))


def remove_when_free(obj, timeout_s: float = 20.0) -> None:
    """Remove a network or secret once the run's containers have let go of it."""
    import docker

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            obj.remove()
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            if time.monotonic() > deadline:
                log.warning("%s not removed: %s", getattr(obj, "name", obj), exc)
                return
            time.sleep(0.5)


class EngineLauncher(NodeLauncher):
    """A backend on a Docker engine: edge nodes as containers (or services), labelled with the run."""

    def __init__(self, engine=None) -> None:
        self.engine = engine or client()
        self._nodes: list[tuple[NodeSpec, object]] = []  # (spec, container or service)
        self._exits: dict[str, list[NodeExit]] = {}  # every exit of each node, in order
        self._lock = threading.Lock()
        self._network = None
        self._log_dir: Path | None = None
        self.label = ""
        self.image = ""

    def containers(self) -> dict[str, object]:
        """The run's containers on this host, by node name."""
        raise NotImplementedError

    def _down(self, name: str) -> bool:
        """Whether node ``name``'s latest exit is recorded and it has not started again (hold the lock)."""
        history = self._exits.get(name)
        return bool(history) and not history[-1].back

    def _record(self, node: NodeExit) -> None:
        """A node ended (once per death: a second report of the same one is ignored)."""
        with self._lock:
            if not self._down(node.name):
                history = self._exits.setdefault(node.name, [])
                history.append(dataclasses.replace(node, seq=len(history)))

    def _started_again(self, name: str) -> None:
        """A node that ended has started again (a restart): its clients join again."""
        with self._lock:
            if self._down(name):
                self._exits[name][-1] = dataclasses.replace(self._exits[name][-1], back=True)

    def exited(self) -> list[NodeExit]:
        with self._lock:
            return [node for history in self._exits.values() for node in history]

    @property
    def count(self) -> int:
        return len(self._nodes)

    def pids(self) -> dict[str, int]:
        out = {}
        for name, container in self.containers().items():
            container.reload()
            if container.attrs["State"].get("Pid"):
                out[name] = int(container.attrs["State"]["Pid"])
        return out

    def container_target(self) -> Target:
        """The run's containers, their device classes and its network (for fault plans and container metrics)."""
        return Target(self.containers, {spec.name: spec.device_class for spec, _ in self._nodes}, self._network)

    def _save_log(self, spec: NodeSpec, text: bytes) -> None:
        """Append the node's log to its file in the run directory (``up --resume`` appends again); a write that
        fails (a full disk) is a warning: the run's containers must still be removed, and its end reported."""
        if self._log_dir is None:
            return
        try:
            with open(self._log_dir / f"{spec.name}.log", "ab") as f:
                f.write(text)
        except OSError as exc:
            log.warning("the log of %s was not saved: %s", spec.name, exc)

    def _remove_network(self) -> None:
        """Remove the run's network, unless the user named and made it."""
        if self._network is not None and self._network.attrs.get("Labels", {}).get(LABEL_RUN) == self.label:
            remove_when_free(self._network)
