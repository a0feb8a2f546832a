"""Watching the edge nodes a launcher started: a node that exits is reported at once, with its last error.

Without this, clients of a dead node looked like clients that had not joined yet (the coordinator waited out
its join timeout) or that had stopped sending heartbeats (noticed after the liveness timeout). With a watch
(``fcl-emu up`` sets one), the coordinator, each time it serves its socket, asks the launcher which nodes
have exited; for each new one it logs and records the exit, declares the node's clients dead, stops waiting for
those that never joined, and ends the run if no node is left and no client is online.

:class:`NodeWatch` uses the run state's registry, metrics, progress hook and event recorder; the dispatcher calls
its :meth:`NodeWatch.check` each time it wakes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fcl_emu.coordinator.contracts import NodeExit, RunAborted
from fcl_emu.coordinator.state import RunState

log = logging.getLogger("fcl_emu.coordinator")


class NodeWatch:
    """The coordinator's view of the edge-node processes."""

    def __init__(self, state: RunState):
        self.state = state
        self._exited: Callable[[], list[NodeExit]] | None = None
        self.started = 0
        self._handled: dict[tuple[str, int], NodeExit] = {}  # every exit handled, by (node, seq)
        self.unreachable_clients = 0  # clients of exited nodes that had not joined: never to be waited for
        self.hosts: dict[str, str] = {}  # node name -> the host it runs on

    def watch(self, exited: Callable[[], list[NodeExit]], started: int, hosts: dict[str, str] | None = None) -> None:
        """Ask ``exited()`` for the nodes that have ended, each time the socket is served; ``started`` nodes, on
        ``hosts``."""
        self._exited, self.started, self._handled = exited, started, {}
        self.hosts = dict(hosts or {})

    def record_fault(self, action: str, **fields) -> None:
        """A fault injected into an edge node's container or a host (containers/faults.py): an event and a count.
        Called from the injector's thread."""
        if fields.get("applied", True):
            counter = self.state.metrics.host_faults if "host" in fields else self.state.metrics.container_faults
            counter.labels(action).inc()
        self.state.event("fault", action=action, **fields)
        self.state.progress("fault", {"action": action, **fields})

    def check(self) -> None:
        """Handle the nodes that exited since the last call; end the run if none is left and no client is
        online."""
        if self._exited is None:
            return
        state, registry = self.state, self.state.registry
        exits = self._exited()
        for node in exits:
            if (node.name, node.seq) in self._handled:
                continue
            self._handled[(node.name, node.seq)] = node
            hosted = [r for r in registry.records.values() if r.node == node.name or r.node in node.cut_off]
            for record in hosted:  # connected, or awaited after a resume: neither comes back through this node
                if registry.drop(record.client_id) or registry.drop_awaited(record.client_id):
                    state.metrics.client_dropped("node_exited")
            self.unreachable_clients += max(0, node.clients - len(hosted)) if node.seq == 0 else 0
            log.error("%s", node.describe())
            state.event("node_exit", node=node.name, host=self.hosts.get(node.name), code=node.code,
                        error=node.last_error)
            state.progress("node_exit", {"node": node.name, "code": node.code, "error": node.last_error})
        down = {node.name: node for node in exits if not node.back}  # a restarted node's clients join again
        if len(down) >= self.started > 0 and registry.online_count == 0:
            raise RunAborted("every edge node exited: " + "; ".join(n.describe() for n in down.values()))
