"""The edge-node launcher interface and what every backend shares: which node hosts which clients, and the
arguments (:class:`~fcl_emu.edge_node.args.NodeArgs`) that start one."""

from __future__ import annotations

import abc
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from fcl_emu.coordinator.contracts import NodeExit
from fcl_emu.edge_node.args import NodeArgs
from fcl_emu.wire.auth import SERVER_NAME
from fcl_emu.runconfig import RunConfig, node_metrics_port
from fcl_emu.scenario.devices import ContainerLimits, ProfilesFile, assign_profile, load_profiles


# A progress line of a node's log ("<date> <time> <logger> INFO ..."): it names no error.
PROGRESS_LINE = re.compile(r"\S+ \S+ \S+ (DEBUG|INFO) ")


def last_error_line(text: str, max_chars: int = 300) -> str:
    """The last line of a node's output that is not a progress line (a traceback's last line names the error);
    empty when it wrote nothing else."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not PROGRESS_LINE.match(line.strip())]
    return lines[-1][:max_chars] if lines else ""


def signal_exit(code: int | None) -> str:
    """What an exit code says when a signal ended the process (a subprocess's -N, a container's 128 + N)."""
    number = -code if code is not None and code < 0 else code - 128 if code is not None and code > 128 else None
    if number is None:
        return ""
    try:
        return f"ended by signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"ended by signal {number}"


def last_error(log_file: Path) -> str:
    """:func:`last_error_line` of the end of a node's log file."""
    try:
        with open(log_file, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 8192))
            return last_error_line(f.read().decode("utf-8", "replace"))
    except OSError:
        return ""


def node_assignment(num_clients: int, nodes: int) -> list[list[int]]:
    """Clients striped over nodes (i, i+nodes, ...): balances load and late joiners."""
    return [list(range(n, num_clients, nodes)) for n in range(nodes)]


@dataclass(frozen=True)
class NodeSpec:
    """One edge node of a run: its number, name, the clients it hosts and, under a container backend, the device
    class it stands for and that class's real limits."""

    number: int
    name: str
    clients: list[int]
    device_class: str | None = None
    limits: ContainerLimits = ContainerLimits()


def node_specs(config: RunConfig) -> list[NodeSpec]:
    """The ``config.nodes`` edge nodes of ``up``, named ``node-<n>``.

    Clients are striped over the nodes, except under a container backend with a profiles file that gives some
    class ``container`` limits: there each node hosts clients of one device class only, so the limits are that
    class's (:func:`class_node_specs`).
    """
    defaults = ContainerLimits(cpus=config.containers.cpus, memory=config.containers.memory)
    profiles = load_profiles(config.edge.device_profiles) if config.edge.device_profiles else None
    if (config.containers.backend == "process" or profiles is None
            or not any(p.container for p in profiles.profiles)):
        return [NodeSpec(n, f"node-{n}", indices, limits=defaults)
                for n, indices in enumerate(node_assignment(config.scenario.num_clients, config.nodes))]
    return class_node_specs(config, profiles, defaults)


def class_node_specs(config: RunConfig, profiles: ProfilesFile, defaults: ContainerLimits) -> list[NodeSpec]:
    """Nodes per device class, in proportion to the class's clients (largest remainder, at least one each);
    a class's clients striped over its nodes. Raises ValueError when ``config.nodes`` is below the number of
    classes that have clients."""
    members: dict[str, list[int]] = {p.name: [] for p in profiles.profiles}
    for index in range(config.scenario.num_clients):
        members[assign_profile(profiles, index, config.seed).name].append(index)
    classes = [(p, members[p.name]) for p in profiles.profiles if members[p.name]]
    if config.nodes < len(classes):
        raise ValueError(f"--nodes {config.nodes} is fewer than the {len(classes)} device classes that have clients "
                         f"({', '.join(p.name for p, _ in classes)}): each class needs an edge node of its own")
    sizes = [len(m) for _, m in classes]
    counts = [1] * len(classes)
    spare = config.nodes - len(classes)
    exact = [spare * size / sum(sizes) for size in sizes]
    counts = [c + int(e) for c, e in zip(counts, exact)]
    for k in sorted(range(len(classes)), key=lambda k: int(exact[k]) - exact[k])[:config.nodes - sum(counts)]:
        counts[k] += 1
    specs: list[NodeSpec] = []
    for (profile, indices), count in zip(classes, counts):
        count = min(count, len(indices))
        for j in range(count):
            n = len(specs)
            specs.append(NodeSpec(n, f"node-{n}", indices[j::count], profile.name, profile.container or defaults))
    return specs


def node_key_name(number: int) -> str:
    """The grant of edge node ``number`` in a run's key directory (fcl_emu/keys.py)."""
    return f"node-{number}"


def node_key_files(keys: Path, number: int, server: str = SERVER_NAME) -> tuple[Path, Path]:
    """The key files of edge node ``number`` of a run keyed in ``keys``: the public key of the ``server`` it dials
    (the coordinator, or its edge aggregator), and its node key or the directory of per-device keys."""
    node_key = Path(keys) / f"{node_key_name(number)}.key_secret"
    return Path(keys) / f"{server}.key", node_key if node_key.is_file() else Path(keys)


def node_args(address: str, indices: list[int], config: RunConfig, name: str, n: int = 0,
              parent_pid: int | None = None, metrics_host: str | None = None, server: str = SERVER_NAME) -> NodeArgs:
    """The arguments of edge node ``n`` dialling ``server`` at ``address`` (its keys, data roots and /metrics port,
    served on ``metrics_host`` or the run's metrics host, and whether the run aggregates securely: the node learns
    it from its launcher, never from a message an edge aggregator relays)."""
    keys: dict = {"insecure": True}
    if config.security.transport != "plain":
        if config.security.keys is None:
            raise ValueError("a CurveZMQ run needs its key directory before its nodes start (fcl_emu.keys.RunKeys)")
        server_key, key = node_key_files(config.security.keys, n, server)
        keys = {"server_key": server_key, "key": key}
    port = node_metrics_port(config, n)
    metrics = {} if port is None else {"metrics_port": port, "metrics_host": metrics_host or config.metrics.host,
                                       "metrics_linger": config.metrics.linger}
    return NodeArgs(address, indices, data_roots=config.data_root, name=name, parent_pid=parent_pid, **keys,
                    own_connections=config.network.client_connections == "own", secagg=config.secagg.enabled,
                    skip_model_check=config.secagg.enabled and not config.secagg.model_check, **metrics)


class NodeLauncher(abc.ABC):
    """Starts the edge nodes of one run and stops them for sure when it ends."""

    def prepare(self, config: RunConfig, run_dir: Path) -> RunConfig:
        """Set up what the nodes need before the coordinator binds (a network, an image); returns the config
        the run goes on with (a backend may move the coordinator's bind address to where its nodes reach it)."""
        return config

    @abc.abstractmethod
    def start(self, address: str, config: RunConfig, log_dir: Path) -> None:
        """Start one edge node per :func:`node_specs` entry, each dialling ``address``; logs go to ``log_dir``."""

    @abc.abstractmethod
    def exited(self) -> list[NodeExit]:
        """The nodes that have ended, each with its exit code and last error line."""

    @abc.abstractmethod
    def pids(self) -> dict[str, int]:
        """Each running node's top process id on this host (a container's init), by node name (benchmarks)."""

    @property
    @abc.abstractmethod
    def count(self) -> int:
        """How many nodes were started."""

    @abc.abstractmethod
    def hosts(self) -> dict[str, str]:
        """The host each started node runs on, by node name (summary.json's ``edge_node_hosts``)."""

    def metrics_addresses(self) -> dict[str, str]:
        """The address each node's /metrics is reached at where it is not the run's metrics host (a node on
        another host), by node name."""
        return {}

    @abc.abstractmethod
    def stop(self, grace_s: float = 10.0) -> None:
        """Wait up to ``grace_s`` for the nodes to end on their own (after the coordinator's shutdown), then end
        them."""
