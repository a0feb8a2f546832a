"""A run's CurveZMQ keys (docs/security.md): who may speak for which clients, written as a key directory.

``fcl-emu keys`` writes one for a multi-host run (copy each ``<grant>.key_secret``, ``coordinator.key`` and
``secagg_signers.json`` to the host that runs it), giving node n a contiguous block of clients, and prints each
host's command (:func:`host_commands`); ``fcl-emu up`` writes its own into the run directory (:class:`RunKeys`),
following its striped nodes (:func:`fcl_emu.launchers.node_assignment`). ``node-<n>`` may speak for the clients
node n hosts, or, with per-device keys, ``client-<i>`` for client i alone; ``gpu-workers`` for the coordinator's
GPU workers; under edge aggregators, ``edge-aggregator-<a>`` for itself and the clients of its nodes (a relay
key: in the roster, not among the signers, its public key kept for the nodes that dial it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fcl_emu.gpu_worker import WORKER_KEY_NAME, worker_identity
from fcl_emu.edge_node.args import format_client_set
from fcl_emu.launchers.base import node_key_name, node_specs
from fcl_emu.wire.auth import write_keys
from fcl_emu.runconfig import RunConfig
from fcl_emu.runconfig.topology import aggregator_name, aggregator_of_node
from fcl_emu.wire.messages import client_id

MAX_GPU_WORKER_GRANTS = 64  # worker identities the GPU workers' key covers (a run has at most this many)


def node_blocks(clients: int, nodes: int) -> list[list[int]]:
    """Contiguous blocks of clients, one per node (node 0: the first ceil(clients / nodes))."""
    size = -(-clients // nodes)
    return [list(range(start, min(start + size, clients))) for start in range(0, clients, size)]


def write_run_keys(directory: Path, assignment: list[list[int]], *, per_device: bool = False,
                   edge_aggregators: int = 0) -> Path:
    """Write the key directory of a run whose node n hosts the clients ``assignment[n]``, with a relay key for
    each of ``edge_aggregators`` aggregators (speaking for itself and its nodes' clients)."""
    relays: dict[str, list[str]] = {aggregator_name(a): [aggregator_name(a)] for a in range(edge_aggregators)}
    for n, indices in enumerate(assignment if edge_aggregators else []):
        relays[aggregator_name(aggregator_of_node(n, edge_aggregators))] += [client_id(i) for i in indices]
    grants: dict[str, list[str]] = {}
    for n, indices in enumerate(assignment):
        if per_device:
            grants.update({client_id(i): [client_id(i)] for i in indices})
        else:
            grants[node_key_name(n)] = [client_id(i) for i in indices]
    grants[WORKER_KEY_NAME] = [worker_identity(i) for i in range(MAX_GPU_WORKER_GRANTS)]
    return write_keys(directory, grants, relays)


def host_commands(path: Path, blocks: list[list[int]], bind: str, host: str, *,
                  per_device: bool = False) -> list[str]:
    """The command of each host of a run under the keys in ``path`` (:func:`write_run_keys` for ``blocks``): the
    coordinator binding ``bind`` (a TCP endpoint with a fixed port), then node n dialling that port on ``host``
    (the coordinator's address as the nodes reach it) with the key files copied beside it."""
    port = bind.rpartition(":")[2]
    clients = sum(len(block) for block in blocks)
    lines = [f"coordinator: fcl-emu coordinator --keys {path} --clients {clients} --bind {bind}"]
    for n, block in enumerate(blocks):
        key = path if per_device else path / f"{node_key_name(n)}.key_secret"
        lines.append(f"node {n}: fcl-emu node --connect tcp://{host}:{port} --clients {format_client_set(block)} "
                     f"--server-key {path / 'coordinator.key'} --key {key}")
    return lines


def with_keys(config: RunConfig, directory: Path, assignment: list[list[int]], *,
              per_device: bool = False) -> RunConfig:
    """``config`` under the keys :func:`write_run_keys` writes in ``directory`` for ``assignment``."""
    keys = write_run_keys(directory, assignment, per_device=per_device,
                          edge_aggregators=config.topology.edge_aggregators)
    return config.model_copy(update={"security": config.security.model_copy(update={"keys": keys})})



class RunKeys:
    """The keys a run started by ``up`` without a key directory writes for itself in RUN_DIR/keys, kept there
    for ``--resume`` once the run has started, and removed if it does not start: no secret keys stay behind from
    a run that never ran, nor the directories made only for them."""

    def __init__(self, run_dir: Path):
        self.directory = Path(run_dir) / "keys"
        self._made: list[Path] = []  # the directories that writing the keys made, deepest (the keys') first

    def write(self, config: RunConfig) -> RunConfig:
        """``config`` under the run's own keys, written now; unchanged if it has keys or runs without CurveZMQ."""
        if config.security.transport != "curve" or config.security.keys is not None:
            return config
        if not self.directory.exists():
            self._made = [d for d in (self.directory, *self.directory.parents) if not d.exists()]
        return with_keys(config, self.directory, [node.clients for node in node_specs(config)])

    def keep(self) -> None:
        """The run has started: its keys stay."""
        self._made = []

    def discard(self) -> None:
        """Remove the keys written (unless kept), and each directory made for them that nothing else is in."""
        if not self._made:
            return
        shutil.rmtree(self.directory, ignore_errors=True)
        for directory in self._made[1:]:
            try:
                directory.rmdir()
            except OSError:  # it holds more than the keys (the nodes' logs, say), or is gone
                break
        self._made = []
