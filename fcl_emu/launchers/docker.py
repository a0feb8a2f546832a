"""Edge nodes as Docker containers on this host: one container per node on a network of the run's own, with the
node's device class's real CPU, memory and uplink limits.

The coordinator stays a process of ``fcl-emu up`` on the host and binds the network's gateway address; every
container runs ``fcl-emu node --connect tcp://GATEWAY:PORT ...`` and dials out, so no port is published except
the /metrics endpoints (published on the run's metrics host at the same port numbers as under the process
backend, so Prometheus targets do not change). Data roots and the run's key directory are mounted read-only at
their host paths. An engine event stream reports each container that dies (with its exit code, and an
out-of-memory kill named as such), and the coordinator records its clients as crashed.

Containers and the network carry the label ``fcl-emu.run=<hash of the run directory>``: ``up --resume`` of a
killed ``up`` removes what the killed one left before it starts its own.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

from containers.engine import client
from containers.faults import Target
from containers.image import image_ref
from coordinator.engine import NodeExit
from fcl_emu.launchers.base import NodeLauncher, NodeSpec, node_args, node_specs
from runconfig import RunConfig, node_metrics_port

log = logging.getLogger("fcl_emu.launchers")

LABEL_RUN = "fcl-emu.run"
LABEL_NODE = "fcl-emu.node"
LABEL_CLASS = "fcl-emu.device-class"
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
ANY = {"0.0.0.0", "*", "::", "[::]"}


def run_label(run_dir: Path) -> str:
    """The label value of a run's containers and network: a hash of its run directory's absolute path."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` -> (HOST, PORT)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host, port


def tbf_entrypoint(uplink_mbit: float) -> list[str]:
    """Cap the container's egress with the kernel's token bucket filter, then run fcl-emu with the arguments."""
    burst_kbit = max(32, int(uplink_mbit * 1000 / 250))  # a 4 ms burst at the rate, at least 32 kbit
    script = (f"tc qdisc replace dev eth0 root tbf rate {uplink_mbit:g}mbit burst {burst_kbit}kbit latency 400ms "
              f"|| exit 3; exec fcl-emu \"$@\"")
    return ["sh", "-c", script, "fcl-emu"]


class DockerLauncher(NodeLauncher):
    """One container per edge node (:func:`node_specs`, grouped by device class when classes set limits)."""

    def __init__(self) -> None:
        self.engine = client()
        self._started: list[tuple[NodeSpec, object]] = []
        self._exits: dict[str, NodeExit] = {}
        self._lock = threading.Lock()
        self._events = None
        self._network = None
        self._gateway = ""
        self._log_dir: Path | None = None
        self.label = ""
        self.image = ""

    # -- set-up ------------------------------------------------------------------------------------------------

    def prepare(self, config: RunConfig, run_dir: Path) -> RunConfig:
        self.image = image_ref(config.containers.image)
        self.label = run_label(run_dir)
        self._remove_leftovers()
        self._network = self._open_network(config.containers.network or f"fcl-emu-{self.label}")
        self._gateway = self._network.attrs["IPAM"]["Config"][0]["Gateway"]
        host, port = split_endpoint(config.network.bind)
        updates: dict = {"data_root": [Path(p).resolve() for p in config.data_root]}
        if host in LOOPBACK:  # the containers cannot reach the host's loopback: bind the network's gateway
            updates["network"] = config.network.model_copy(update={"bind": f"tcp://{self._gateway}:{port}"})
        if config.security.keys is not None:
            updates["security"] = config.security.model_copy(update={"keys": Path(config.security.keys).resolve()})
        return config.model_copy(update=updates)

    def _remove_leftovers(self) -> None:
        for container in self.engine.containers.list(all=True, filters={"label": f"{LABEL_RUN}={self.label}"}):
            log.warning("removing container %s left by an earlier run in this run directory", container.name)
            container.remove(force=True)

    def _open_network(self, name: str):
        import docker

        try:
            return self.engine.networks.get(name)
        except docker.errors.NotFound:
            return self.engine.networks.create(name, driver="bridge", labels={LABEL_RUN: self.label})

    # -- nodes ---------------------------------------------------------------------------------------------------

    def start(self, address: str, config: RunConfig, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log_dir = log_dir
        host, port = split_endpoint(address)
        dial = f"tcp://{self._gateway if host in ANY | LOOPBACK else host}:{port}"
        self._events = self.engine.events(decode=True, filters={"label": f"{LABEL_RUN}={self.label}",
                                                                "type": "container", "event": ["die", "start"]})
        threading.Thread(target=self._watch_events, name="docker-events", daemon=True).start()
        for spec in node_specs(config):
            container = self._run_container(spec, dial, config)
            with self._lock:
                self._started.append((spec, container))
        for spec, container in self._started:  # one that died before it was listed had its event ignored
            container.reload()
            if container.status in ("exited", "dead"):
                self._record_exit(spec.name)

    def _run_container(self, spec: NodeSpec, dial: str, config: RunConfig):
        import docker

        args = node_args(dial, spec.clients, config, spec.name, spec.number, metrics_host="0.0.0.0")
        mounts = {str(root): {"bind": str(root), "mode": "ro"} for root in config.data_root if Path(root).is_dir()}
        if config.security.keys is not None:
            mounts[str(config.security.keys)] = {"bind": str(config.security.keys), "mode": "ro"}
        options: dict = dict(
            name=f"fcl-emu-{self.label}-{spec.name}", hostname=spec.name, network=self._network.name,
            labels={LABEL_RUN: self.label, LABEL_NODE: spec.name, LABEL_CLASS: spec.device_class or ""},
            volumes=mounts, environment={"OMP_NUM_THREADS": "1"}, init=True, detach=True)
        limits = spec.limits
        if limits.cpus is not None:
            options["nano_cpus"] = int(limits.cpus * 1e9)
        if limits.memory is not None:
            options["mem_limit"] = options["memswap_limit"] = limits.memory  # no swap: past it, the OOM killer
        if limits.uplink_mbit is not None:
            options["entrypoint"] = tbf_entrypoint(limits.uplink_mbit)
            options["cap_add"] = ["NET_ADMIN"]
        if config.containers.gpus:
            options["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
        metrics_port = node_metrics_port(config, spec.number)
        if metrics_port is not None:
            options["ports"] = {f"{metrics_port}/tcp": (config.metrics.host, metrics_port)}
        return self.engine.containers.run(self.image, args, **options)

    def _watch_events(self) -> None:
        try:
            for event in self._events:
                name = event.get("Actor", {}).get("Attributes", {}).get(LABEL_NODE)
                if name and event.get("status") == "die":
                    self._record_exit(name)
                elif name:  # started again (a restart fault): running, its clients rejoin
                    with self._lock:
                        self._exits.pop(name, None)
        except Exception:  # the stream is closed by stop(), or the engine went away: nothing more to watch
            return

    def _record_exit(self, name: str) -> None:
        with self._lock:
            found = [(s, c) for s, c in self._started if s.name == name]
        if not found or name in self._exits:
            return
        spec, container = found[0]
        container.reload()
        state = container.attrs["State"]
        if state.get("OOMKilled"):
            error = f"out of memory: the kernel killed it at its container's {spec.limits.memory} memory limit"
        else:
            error = last_log_line(container)
        code = int(state.get("ExitCode", -1))
        if not error and code > 128:
            error = f"ended by signal {code - 128}" + (" (SIGKILL)" if code == 137 else "")
        with self._lock:
            self._exits[name] = NodeExit(name, code, len(spec.clients), error)

    def exited(self) -> list[NodeExit]:
        with self._lock:
            return list(self._exits.values())

    def pids(self) -> dict[str, int]:
        out = {}
        for name, container in self.containers().items():
            container.reload()
            if container.attrs["State"].get("Pid"):
                out[name] = int(container.attrs["State"]["Pid"])
        return out

    @property
    def count(self) -> int:
        return len(self._started)

    def containers(self) -> dict[str, object]:
        """The run's containers by node name (for fault injection and container metrics)."""
        with self._lock:
            return {spec.name: container for spec, container in self._started}

    def container_target(self) -> Target:
        """These containers, their device classes and the run's network (for fault plans and container metrics)."""
        return Target(self.containers, {spec.name: spec.device_class for spec, _ in self._started}, self._network)

    # -- tear-down -------------------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> None:
        import requests

        deadline = time.monotonic() + grace_s
        for _spec, container in self._started:
            try:
                container.wait(timeout=max(1, int(deadline - time.monotonic())))
            except requests.exceptions.RequestException:
                container.stop(timeout=5)
        if self._events is not None:
            self._events.close()
        for spec, container in self._started:
            self._save_log(spec, container)
            container.remove(force=True)
        self._remove_network()

    def _save_log(self, spec: NodeSpec, container) -> None:
        if self._log_dir is None:
            return
        with open(self._log_dir / f"{spec.name}.log", "ab") as f:  # appended to by `up --resume`
            f.write(container.logs(stdout=True, stderr=True))

    def _remove_network(self) -> None:
        import docker

        if self._network is None or self._network.attrs.get("Labels", {}).get(LABEL_RUN) != self.label:
            return  # a network the user named and made: theirs to keep
        try:
            self._network.remove()
        except docker.errors.APIError as exc:
            log.warning("network %s not removed: %s", self._network.name, exc)


def last_log_line(container, max_chars: int = 300) -> str:
    """The last non-empty line a container wrote (a traceback's last line names the error)."""
    text = container.logs(stdout=True, stderr=True, tail=50).decode("utf-8", "replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:max_chars] if lines else ""
