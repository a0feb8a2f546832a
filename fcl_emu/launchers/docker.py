"""Edge nodes as Docker containers on this host: one container per node on a network of the run's own, with the
node's device class's real CPU, memory and uplink limits.

The coordinator stays a process of ``fcl-emu up`` on the host and binds the network's gateway address; every
container runs ``python -m fcl_emu.edge_node --connect tcp://GATEWAY:PORT ...`` and dials out, so no port is published
except the /metrics endpoints (published on the run's metrics host at the same port numbers as under the process
backend, so Prometheus targets do not change). Data roots and the run's key directory are mounted read-only at
their host paths. An engine event stream reports each container that dies (with its exit code, and an
out-of-memory kill named as such), and the coordinator records its clients as crashed.

Containers and the network carry the label ``fcl-emu.run=<hash of the run directory>``: ``up --resume`` of a
killed ``up`` removes what the killed one left before it starts its own.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from fcl_emu.containers.image import image_ref
from fcl_emu.launchers.base import NodeSpec, node_args, node_specs
from fcl_emu.launchers.engine_launcher import (ANY, LABEL_CLASS, LABEL_NODE, LABEL_RUN, LOOPBACK, EngineLauncher,
                                               node_entrypoint, node_exit, run_label, split_endpoint)
from fcl_emu.runconfig import RunConfig, node_metrics_port

log = logging.getLogger("fcl_emu.launchers")


class DockerLauncher(EngineLauncher):
    """One container per edge node (:func:`node_specs`, grouped by device class when classes set limits)."""

    def __init__(self) -> None:
        super().__init__()
        self._events = None
        self._gateway = ""

    def hosts(self) -> dict[str, str]:
        name = self.engine.info().get("Name", "")
        return {spec.name: name for spec, _container in self._nodes}

    # -- set-up ------------------------------------------------------------------------------------------------

    def prepare(self, config: RunConfig, run_dir: Path) -> RunConfig:
        self.image = image_ref(config.containers.image)
        self.label = run_label(run_dir)
        self._remove_leftovers()
        self._network = self._open_network(config.containers.network or f"fcl-emu-{self.label}")
        self._gateway = self._network.attrs["IPAM"]["Config"][0]["Gateway"]
        host, port = split_endpoint(config.network.bind)
        updates: dict = {"data_root": [Path(p).resolve() for p in config.data_root],
                         # the exact image in the run's config.yaml, for whoever repeats the run
                         "containers": config.containers.model_copy(update={"image": self.image})}
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
                self._nodes.append((spec, container))
        for spec, container in self._nodes:  # one that died before it was listed had its event ignored
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
            volumes=mounts, environment={"OMP_NUM_THREADS": "1"}, init=True, detach=True,
            entrypoint=node_entrypoint(spec.limits.uplink_mbit))
        limits = spec.limits
        if limits.cpus is not None:
            options["nano_cpus"] = int(limits.cpus * 1e9)
        if limits.memory is not None:
            options["mem_limit"] = options["memswap_limit"] = limits.memory  # no swap: past it, the OOM killer
        if limits.uplink_mbit is not None:
            options["cap_add"] = ["NET_ADMIN"]
        if config.containers.gpus:
            options["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
        metrics_port = node_metrics_port(config, spec.number)
        if metrics_port is not None:
            options["ports"] = {f"{metrics_port}/tcp": (config.metrics.host, metrics_port)}
        return self.engine.containers.run(self.image, args.to_argv(), **options)

    def _watch_events(self) -> None:
        try:
            for event in self._events:
                name = event.get("Actor", {}).get("Attributes", {}).get(LABEL_NODE)
                if name and event.get("status") == "die":
                    self._record_exit(name)
                elif name:
                    self._started_again(name)
        except Exception:  # the stream is closed by stop(), or the engine went away: nothing more to watch
            return

    def _record_exit(self, name: str) -> None:
        with self._lock:
            found = [(s, c) for s, c in self._nodes if s.name == name]
        if found:
            spec, container = found[0]
            container.reload()
            self._record(node_exit(spec, int(container.attrs["State"].get("ExitCode", -1)), container))

    def containers(self) -> dict[str, object]:
        with self._lock:
            return {spec.name: container for spec, container in self._nodes}

    # -- tear-down -------------------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> None:
        import requests

        deadline = time.monotonic() + grace_s
        for _spec, container in self._nodes:
            try:
                container.wait(timeout=max(1, int(deadline - time.monotonic())))
            except requests.exceptions.RequestException:
                container.stop(timeout=5)
        if self._events is not None:
            self._events.close()
        for spec, container in self._nodes:
            self._save_log(spec, container.logs(stdout=True, stderr=True))
            container.remove(force=True)
        self._remove_network()
