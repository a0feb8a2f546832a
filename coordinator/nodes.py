"""Watching the edge nodes a launcher started: a node that exits is reported at once, with its last error.

Without this, clients of a dead node looked like clients that had not joined yet (the coordinator waited out
its join timeout) or that had stopped sending heartbeats (noticed after the liveness timeout). With a watch
(``fcl-emu up`` sets one), the coordinator, each time it serves its socket, asks the launcher which nodes
have exited; for each new one it logs and records the exit, declares the node's clients dead, stops waiting for
those that never joined, and ends the run if no node is left and no client is online.

A mixin of :class:`coordinator.engine.Coordinator` (it uses ``registry``, ``metrics``, ``progress`` and the
run's recorder).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.errors import RunAborted

log = logging.getLogger("fcl_emu.coordinator")


@dataclass(frozen=True)
class NodeExit:
    """An edge node that has ended: its name, exit code, how many clients it hosted, its last error line; ``seq``
    counts the node's exits (a restarted container can end again) and ``back`` says it has started again since."""

    name: str
    code: int
    clients: int
    last_error: str
    seq: int = 0
    back: bool = False

    def describe(self) -> str:
        return f"edge node {self.name} exited with code {self.code}: {self.last_error or '(its log is empty)'}"


class NodeWatch:
    """The coordinator's view of the edge-node processes (mixin of Coordinator)."""

    _node_watch: Callable[[], list[NodeExit]] | None = None
    _nodes_started = 0
    _exited_nodes: dict[tuple[str, int], NodeExit]  # every exit handled, by (node, seq)
    _unreachable_clients = 0  # clients of exited nodes that had not joined: never to be waited for

    def watch_nodes(self, exited: Callable[[], list[NodeExit]], started: int) -> None:
        """Ask ``exited()`` for the nodes that have ended, each time the socket is served; ``started`` nodes."""
        self._node_watch, self._nodes_started, self._exited_nodes = exited, started, {}

    def record_fault(self, action: str, **fields) -> None:
        """A fault injected into an edge node's container (containers/faults.py): an event and a count. Called
        from the injector's thread."""
        if fields.get("applied", True):
            self.metrics.container_faults.labels(action).inc()
        if self._recorder is not None:
            self._recorder.event("fault", action=action, **fields)
        self.progress("fault", {"action": action, **fields})

    def _check_nodes(self) -> None:
        if self._node_watch is None:
            return
        exits = self._node_watch()
        for node in exits:
            if (node.name, node.seq) in self._exited_nodes:
                continue
            self._exited_nodes[(node.name, node.seq)] = node
            hosted = [r for r in self.registry.records.values() if r.node == node.name]
            for record in hosted:
                if self.registry.drop(record.client_id):
                    self.metrics.client_dropped("node_exited")
            self._unreachable_clients += max(0, node.clients - len(hosted)) if node.seq == 0 else 0
            log.error("%s", node.describe())
            if self._recorder is not None:
                self._recorder.event("node_exit", node=node.name, code=node.code, error=node.last_error)
            self.progress("node_exit", {"node": node.name, "code": node.code, "error": node.last_error})
        down = {node.name: node for node in exits if not node.back}  # a restarted node's clients join again
        if len(down) >= self._nodes_started > 0 and self.registry.online_count == 0:
            raise RunAborted("every edge node exited: " + "; ".join(n.describe() for n in down.values()))
