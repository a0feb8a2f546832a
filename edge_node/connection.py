"""What an edge node tells its user about reaching the coordinator, on the log's ``fcl_emu.edge_node.connection``
logger (shown without ``--verbose``): a line when it starts connecting, one when all its clients have joined, and
while they have not, a warning after a few seconds that says how far it got, repeated at doubling intervals. A
handful of lines per run, never one per message or per client.

ZeroMQ connects in the background and retries for ever, silently; a wrong address, a coordinator that is not
running and a key it refuses all look alike from here: no answer.
"""

from __future__ import annotations

import logging

log = logging.getLogger("fcl_emu.edge_node.connection")

FIRST_WARNING_S = 3.0  # no answer for this long: the first warning
MAX_WARNING_INTERVAL_S = 300.0  # the warnings' interval doubles up to this


def show_connection_lines() -> None:
    """Let the connection lines through in a process that logs only warnings (no ``--verbose``)."""
    log.setLevel(logging.INFO)


class JoinWatch:
    """How far a node's clients got in joining the coordinator at ``address``; the node calls :meth:`start`,
    :meth:`welcomed` for each welcome and :meth:`tick` from its loop."""

    def __init__(self, node: str, address: str, clients: int, first_warning_s: float = FIRST_WARNING_S):
        self.node, self.address, self.clients = node, address, clients
        self.first_warning_s = first_warning_s
        self._welcomed: set[str] = set()
        self._joined = False
        self._started = 0.0
        self._next_warning = 0.0
        self._interval = first_warning_s

    def start(self, now: float) -> None:
        log.info("%s: connecting to %s with %d clients", self.node, self.address, self.clients)
        self._started, self._next_warning, self._interval = now, now + self.first_warning_s, self.first_warning_s

    def welcomed(self, client: str, run_id: str) -> None:
        """The coordinator welcomed ``client`` into run ``run_id``."""
        if self._joined:
            return
        self._welcomed.add(client)
        if len(self._welcomed) >= self.clients:
            self._joined = True
            log.info("%s: joined run %s at %s with %d clients", self.node, run_id, self.address, self.clients)

    def tick(self, now: float) -> None:
        """Warn when the clients have not all joined by the next warning's time."""
        if self._joined or now < self._next_warning:
            return
        waited = now - self._started
        if self._welcomed:
            log.warning("%s: %d of %d clients joined the coordinator at %s after %.0f s; still waiting",
                        self.node, len(self._welcomed), self.clients, self.address, waited)
        else:
            log.warning("%s: no answer from the coordinator at %s after %.0f s (is it running, is the address "
                        "right, does it accept this node's key?); still trying", self.node, self.address, waited)
        self._interval = min(2 * self._interval, MAX_WARNING_INTERVAL_S)
        self._next_warning = now + self._interval
