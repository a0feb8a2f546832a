"""Edge nodes as Docker Swarm services, on as many hosts as the swarm has: one service per edge node.

The coordinator stays a process of ``fcl-emu up`` on a manager and binds all its interfaces; every service runs
``python -m fcl_emu.edge_node --connect tcp://MANAGER_ADDRESS:PORT`` (the manager's swarm address, or
``containers.advertise``) and dials out over the hosts' network, so only the coordinator's port must be open between
hosts (plus Swarm's own 2377/tcp, 7946/tcp+udp, 4789/udp, and the /metrics ports for a Prometheus). Each service:

- is attached to an attachable overlay network of the run with ``endpoint_mode: dnsrr`` (no virtual IP: the
  kernel here has no IPVS, and an edge node needs no load balancer);
- has its device class's CPU and memory limits (``resources``), and, where swarm nodes carry the label
  ``fcl-emu.device-class=<class>``, is placed on them (a class no node is labelled for runs anywhere);
- never restarts on its own (``restart_policy: none``): a crash stays a crash, under the emulator's control;
- gets the run's CurveZMQ keys as Swarm secrets (they reach other hosts with the task; nothing is copied by
  hand), and the data roots bind-mounted read-only from the host it lands on (the dataset must be at the same
  path on every host, docs/containers.md).

Each edge node is pinned to one swarm node (``node.id==``): nodes of a device class go round-robin over the swarm
nodes labelled with that class, others over every ready swarm node, in host-name order, so a run on the same
swarm lands the same way every time. Its /metrics port is published on that host, where Prometheus scrapes it.
With a cluster file (``--cluster``, :mod:`fcl_emu.containers.cluster`) the launcher reaches every host's engine: the
run's image is loaded where it is missing, and the containers on every host are sampled and acted on by fault
plans; without one, only those on the manager's host.

A task that ends is reported at once (its exit code, and an out-of-memory kill named as such where its host's
engine is reachable) and the coordinator records its clients as crashed.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from fcl_emu.containers.cluster import Cluster, distribute_image, engine, engines
from fcl_emu.containers.docker_client import EngineError
from fcl_emu.containers.faults import Target
from fcl_emu.containers.image import image_ref
from fcl_emu.launchers.base import NodeSpec, node_args, node_key_name, node_specs
from fcl_emu.launchers.engine_launcher import (ANY, LABEL_CLASS, LABEL_NODE, LABEL_RUN, LOOPBACK, EngineLauncher,
                                               node_entrypoint, node_exit, remove_when_free, run_label, split_endpoint)
from fcl_emu.runconfig import RunConfig, node_metrics_port
from fcl_emu.scenario.devices import memory_bytes
from fcl_emu.wire.auth import SERVER_NAME, SIGNERS_FILE

log = logging.getLogger("fcl_emu.launchers")

ENDED = {"complete", "failed", "shutdown", "rejected", "orphaned", "remove"}
SECRETS_DIR = "/run/secrets"


def place(specs: list[NodeSpec], nodes: list[dict]) -> dict[str, dict]:
    """Each edge node's swarm node (``nodes``: dicts with ``hostname`` and ``labels``): round-robin, in host-name
    order, over the nodes labelled with its device class, or over all of them where none is (a warning says so)."""
    nodes = sorted(nodes, key=lambda n: (n["hostname"], n.get("id", "")))
    placed: dict[str, dict] = {}
    turns: dict[str | None, int] = {}
    unlabelled: set[str] = set()
    for spec in specs:
        pool = [n for n in nodes if spec.device_class and n["labels"].get(LABEL_CLASS) == spec.device_class]
        if spec.device_class and not pool and spec.device_class not in unlabelled:
            unlabelled.add(spec.device_class)
            log.warning("no swarm node is labelled %s=%s: its services run on any node", LABEL_CLASS,
                        spec.device_class)
        key = spec.device_class if pool else None
        turn = turns.get(key, 0)
        turns[key] = turn + 1
        pool = pool or nodes
        placed[spec.name] = pool[turn % len(pool)]
    return placed


class SwarmLauncher(EngineLauncher):
    """One Swarm service per edge node (:func:`node_specs`), watched by polling its task."""

    poll_s = 0.5

    def __init__(self, cluster: Cluster | None = None) -> None:
        super().__init__(engine(cluster.manager.engine) if cluster is not None else None)
        swarm = self.engine.info().get("Swarm", {})
        if swarm.get("LocalNodeState") != "active" or not swarm.get("ControlAvailable"):
            where = f"the manager of cluster {cluster.name}" if cluster is not None else "this Docker engine"
            raise EngineError(f"{where} is not a Swarm manager: run `docker swarm init` there (or on the manager, "
                              f"and run `fcl-emu up` there)")
        self.cluster = cluster
        self.node_address = swarm.get("NodeAddr", "")
        self._manager_id = swarm.get("NodeID", "")
        self._secrets: list = []
        self._stop = threading.Event()
        self._placement: dict[str, dict] = {}  # edge node -> the swarm node it runs on (id, hostname, address)
        self._host_engines: dict[str, object] = {}  # swarm node id -> that host's engine, where reachable
        self._cluster_engines: dict[str, object] = {}  # the cluster's host name -> its engine, where it answered

    def prepare(self, config: RunConfig, run_dir: Path) -> RunConfig:
        self.image = image_ref(config.containers.image)
        if self.cluster is not None:  # no registry: every host loads it from this machine
            self._cluster_engines = engines(self.cluster)
            distribute_image(self.image, self._cluster_engines, log=log.info)
        self.label = run_label(run_dir)
        self._remove_leftovers()
        name = config.containers.network or f"fcl-emu-{self.label}"
        networks = self.engine.networks.list(names=[name])
        self._network = networks[0] if networks else self.engine.networks.create(
            name, driver="overlay", attachable=True, labels={LABEL_RUN: self.label})
        host, port = split_endpoint(config.network.bind)
        updates: dict = {"data_root": [Path(p).resolve() for p in config.data_root],
                         # the exact image in the run's config.yaml, for whoever repeats the run
                         "containers": config.containers.model_copy(update={"image": self.image})}
        if host in LOOPBACK:  # tasks on any host dial the manager's address: listen beyond loopback
            updates["network"] = config.network.model_copy(update={"bind": f"tcp://0.0.0.0:{port}"})
        return config.model_copy(update=updates)

    def _remove_leftovers(self) -> None:
        """Remove the services and secrets a run in this run directory left (its coordinator killed), and wait up
        to 30 s for their containers to go: a leftover edge node still dials the run's address with the run's
        keys, and would join the resumed coordinator for its clients until its container stopped."""
        services = self.engine.services.list(filters={"label": f"{LABEL_RUN}={self.label}"})
        for service in services:
            log.warning("removing service %s left by an earlier run in this run directory", service.name)
            service.remove()
        reachable = list(self._cluster_engines.values()) or [self.engine]
        deadline = time.monotonic() + 30
        while services and time.monotonic() < deadline and self._containers_left(reachable):
            time.sleep(self.poll_s)
        for secret in self.engine.secrets.list(filters={"label": f"{LABEL_RUN}={self.label}"}):
            remove_when_free(secret)

    def start(self, address: str, config: RunConfig, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log_dir = log_dir
        host, port = split_endpoint(address)
        advertise = config.containers.advertise or (self.cluster.advertise if self.cluster else self.node_address)
        dial = f"tcp://{advertise if host in ANY | LOOPBACK else host}:{port}"
        shared = [self._secret(config, name) for name in (f"{SERVER_NAME}.key", SIGNERS_FILE)
                  if config.security.keys]  # beside each other in /run/secrets, as a node looks for them
        specs = node_specs(config)
        self._host_engines = self._reachable_engines()
        self._placement = self._place(specs)
        for spec in specs:
            service = self._create_service(spec, dial, config, shared)
            with self._lock:
                self._nodes.append((spec, service))
        threading.Thread(target=self._watch, name="swarm-tasks", daemon=True).start()

    def _secret(self, config: RunConfig, filename: str):
        """A Swarm secret holding one file of the run's key directory."""
        import docker

        data = (Path(config.security.keys) / filename).read_bytes()
        secret = self.engine.secrets.create(name=f"fcl-emu-{self.label}-{filename}", data=data,
                                            labels={LABEL_RUN: self.label})
        self._secrets.append(secret)
        return docker.types.SecretReference(secret.id, secret.name, filename=filename, mode=0o400)

    def _create_service(self, spec: NodeSpec, dial: str, config: RunConfig, shared_secrets: list):
        import docker

        args = node_args(dial, spec.clients, config, spec.name, spec.number, metrics_host="0.0.0.0")
        secrets = []
        if shared_secrets:
            key_file = f"{node_key_name(spec.number)}.key_secret"
            secrets = [*shared_secrets, self._secret(config, key_file)]
            args = args.with_paths(server_key=f"{SECRETS_DIR}/{SERVER_NAME}.key", key=f"{SECRETS_DIR}/{key_file}")
        limits = spec.limits
        metrics_port = node_metrics_port(config, spec.number)
        ports = {metrics_port: (metrics_port, "tcp", "host")} if metrics_port is not None else None
        return self.engine.services.create(
            self.image, command=node_entrypoint(limits.uplink_mbit), args=args.to_argv(),
            name=f"fcl-emu-{self.label}-{spec.name}", hostname=spec.name, networks=[self._network.name],
            labels={LABEL_RUN: self.label, LABEL_NODE: spec.name},
            container_labels={LABEL_RUN: self.label, LABEL_NODE: spec.name, LABEL_CLASS: spec.device_class or ""},
            env=["OMP_NUM_THREADS=1"], init=True, secrets=secrets,
            mounts=[docker.types.Mount(str(root), str(root), type="bind", read_only=True)
                    for root in config.data_root if Path(root).is_dir()],
            cap_add=["NET_ADMIN"] if limits.uplink_mbit is not None else None,
            resources=docker.types.Resources(
                cpu_limit=int(limits.cpus * 1e9) if limits.cpus is not None else None,
                mem_limit=memory_bytes(limits.memory) if limits.memory is not None else None),
            restart_policy=docker.types.RestartPolicy(condition="none"),
            endpoint_spec=docker.types.EndpointSpec(mode="dnsrr", ports=ports),
            constraints=[f"node.id=={self._placement[spec.name]['id']}"])

    # -- placement -------------------------------------------------------------------------------------------------

    def _place(self, specs: list[NodeSpec]) -> dict[str, dict]:
        """:func:`place` on the ready, active swarm nodes; with a cluster, a host whose engine does not answer is
        left out even while the swarm still counts it ready (a host lost moments ago)."""
        ready = [{"id": n.id, "hostname": n.attrs["Description"]["Hostname"],
                  "address": n.attrs["Status"].get("Addr", ""), "labels": n.attrs["Spec"].get("Labels", {})}
                 for n in self.engine.nodes.list()
                 if n.attrs["Status"]["State"] == "ready" and n.attrs["Spec"]["Availability"] == "active"
                 and (self.cluster is None or n.id in self._host_engines)]
        if not ready:
            raise EngineError("the swarm has no ready, active node to run edge nodes on")
        return place(specs, ready)

    def _reachable_engines(self) -> dict[str, object]:
        """The engines of the hosts this launcher can reach, by swarm node id: every host of the cluster that
        answered in :meth:`prepare`, else the manager's own."""
        if self.cluster is None:
            return {self._manager_id: self.engine}
        by_name = self._cluster_engines
        return {n.id: by_name[n.attrs["Description"]["Hostname"]] for n in self.engine.nodes.list()
                if n.attrs["Description"]["Hostname"] in by_name}

    def hosts(self) -> dict[str, str]:
        return {name: node["hostname"] for name, node in self._placement.items()}

    def container_target(self) -> Target:
        """As for one engine, plus the hosts of a local cluster for host faults."""
        target = super().container_target()
        if self.cluster is not None and self.cluster.kind == "local":
            from fcl_emu.containers.local_cluster import HostFaults

            target.host_faults, target.hosts = HostFaults(self.cluster), self.hosts()
        return target

    def metrics_addresses(self) -> dict[str, str]:
        return {name: node["address"] for name, node in self._placement.items()}

    # -- watching --------------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                services = list(self._nodes)
            for spec, service in services:
                with self._lock:
                    down = self._down(spec.name)
                if not down:
                    try:
                        self._check(spec, service)
                    except Exception as exc:  # the engine is busy or the service is being removed: next poll
                        log.debug("polling %s: %s", spec.name, exc)

    def _check(self, spec: NodeSpec, service) -> None:
        tasks = service.tasks()
        if not tasks:
            return
        task = max(tasks, key=lambda t: t.get("CreatedAt", ""))
        status = task.get("Status", {})
        if status.get("State") not in ENDED:
            return
        self._record(node_exit(spec, int(status.get("ContainerStatus", {}).get("ExitCode", -1)),
                               self._container(task), reported=status.get("Err") or status.get("Message", "")))

    def _container(self, task: dict):
        """The task's container, through its host's engine (faults, OOM status, logs); None where that engine is
        out of reach (another host without a cluster file, or a host that is lost)."""
        import docker
        import requests

        container_id = task.get("Status", {}).get("ContainerStatus", {}).get("ContainerID")
        host_engine = self._host_engines.get(task.get("NodeID", ""))
        if not container_id or host_engine is None:
            return None
        try:
            return host_engine.containers.get(container_id)
        except (docker.errors.DockerException, requests.exceptions.RequestException):
            return None

    def containers(self) -> dict[str, object]:
        """The services' containers on every reachable host, by node name (faults and container metrics)."""
        out = {}
        with self._lock:
            services = list(self._nodes)
        for spec, service in services:
            for task in service.tasks():
                container = self._container(task)
                if container is not None:
                    out[spec.name] = container
        return out

    # -- tear-down -------------------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and len({n.name for n in self.exited() if not n.back}) < len(self._nodes):
            time.sleep(self.poll_s)
        self._stop.set()
        for spec, service in self._nodes:
            self._save_service_log(spec, service)
            service.remove()
        deadline = time.monotonic() + 30  # a removed service's containers go a moment later
        while time.monotonic() < deadline and self._containers_left(self._host_engines.values()):
            time.sleep(self.poll_s)
        for secret in self._secrets:
            remove_when_free(secret)
        self._remove_network()

    def _containers_left(self, host_engines) -> bool:
        """Whether a container of the run is still on one of ``host_engines``."""
        import docker
        import requests

        for host_engine in host_engines:
            try:
                if host_engine.containers.list(all=True, filters={"label": f"{LABEL_RUN}={self.label}"}):
                    return True
            except (docker.errors.DockerException, requests.exceptions.RequestException):
                continue
        return False

    def _save_service_log(self, spec: NodeSpec, service) -> None:
        """The node's log, from its container through its host's engine; through the manager where that engine is
        out of reach and no cluster says the host is gone (the manager waits for a lost host's log for good)."""
        import docker
        import requests

        tasks = sorted(service.tasks(), key=lambda t: t.get("CreatedAt", ""))
        container = self._container(tasks[-1]) if tasks else None
        try:
            if container is not None:
                text = container.logs(stdout=True, stderr=True)
            elif self.cluster is not None:
                text = b"(no log: its host's engine does not answer)\n"
            else:
                text = b"".join(service.logs(stdout=True, stderr=True, follow=False))
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            text = f"(no log: {exc})\n".encode()  # a service whose task never started
        self._save_log(spec, text)
