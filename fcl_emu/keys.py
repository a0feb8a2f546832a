"""A run's CurveZMQ keys (docs/security.md): who may speak for which clients, written as a key directory.

``fcl-emu keys`` writes one for a multi-host run (copy each ``<grant>.key_secret`` and ``coordinator.key`` to the
host that runs it), giving node n a contiguous block of clients; ``fcl-emu up`` writes its own into the run
directory, following its striped nodes (:func:`fcl_emu.launchers.node_assignment`). ``node-<n>`` may speak for
the clients node n hosts, or, with per-device keys, ``client-<i>`` for client i alone; ``gpu-workers`` for the
coordinator's GPU workers.
"""

from __future__ import annotations

from pathlib import Path

from coordinator.gpu_worker import WORKER_KEY_NAME, worker_identity
from fcl_emu.launchers.base import node_key_name
from wire.auth import write_keys
from runconfig import RunConfig
from wire.messages import client_id

MAX_GPU_WORKER_GRANTS = 64  # worker identities the GPU workers' key covers (a run has at most this many)


def node_blocks(clients: int, nodes: int) -> list[list[int]]:
    """Contiguous blocks of clients, one per node (node 0: the first ceil(clients / nodes))."""
    size = -(-clients // nodes)
    return [list(range(start, min(start + size, clients))) for start in range(0, clients, size)]


def write_run_keys(directory: Path, assignment: list[list[int]], *, per_device: bool = False) -> Path:
    """Write the key directory of a run whose node n hosts the clients ``assignment[n]``."""
    grants: dict[str, list[str]] = {}
    for n, indices in enumerate(assignment):
        if per_device:
            grants.update({client_id(i): [client_id(i)] for i in indices})
        else:
            grants[node_key_name(n)] = [client_id(i) for i in indices]
    grants[WORKER_KEY_NAME] = [worker_identity(i) for i in range(MAX_GPU_WORKER_GRANTS)]
    return write_keys(directory, grants)


def with_keys(config: RunConfig, directory: Path, assignment: list[list[int]], *,
              per_device: bool = False) -> RunConfig:
    """``config`` under the keys :func:`write_run_keys` writes in ``directory`` for ``assignment``."""
    keys = write_run_keys(directory, assignment, per_device=per_device)
    return config.model_copy(update={"security": config.security.model_copy(update={"keys": keys})})

