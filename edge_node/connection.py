"""What an edge node tells its user about reaching the coordinator, on the log's ``fcl_emu.edge_node.connection``
logger (shown without ``--verbose``): a line when it starts connecting, one when all its clients have joined, and
while they have not, a warning after a few seconds that says how far it got, repeated at doubling intervals. A
handful of lines per run, never one per message or per client.

ZeroMQ connects in the background and retries for ever, silently: the watch follows one client's socket through
ZeroMQ's socket monitor until every client has joined, so that a warning says how far that socket got (no TCP
connection, a handshake the coordinator refused, or a connection that never answered).
"""

from __future__ import annotations

import logging

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("fcl_emu.edge_node.connection")

# how far the watched socket got, by the monitor event that says so
_LINK = {zmq.EVENT_CONNECT_RETRIED: "retrying", zmq.EVENT_CONNECTED: "connected",
         zmq.EVENT_HANDSHAKE_SUCCEEDED: "connected", zmq.EVENT_DISCONNECTED: "disconnected",
         zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused",
         zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused"}
_WHY = {
    None: "no connection yet (an unknown host, an unreachable one, or nothing listening there?)",
    "retrying": "cannot connect (nothing listens there, an unknown host or an unreachable one: is the coordinator "
                "running, are the host and port right?)",
    "connected": "connected, but no answer (is it an fcl-emu coordinator, does it accept this node's key?)",
    "refused": "the coordinator refused the handshake (a key it does not accept, or --insecure on one side only?)",
    "disconnected": "the connection closed without an answer (a key it does not accept, or --insecure on one side "
                    "only?)",
}

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
        self._watched: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._link: str | None = None

    def watch(self, sock: zmq.Socket) -> None:
        """Follow ``sock`` (one client's socket, before it connects) until every client has joined."""
        self._watched, self._monitor = sock, sock.get_monitor_socket(sum(_LINK))

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
            self.close()
            log.info("%s: joined run %s at %s with %d clients", self.node, run_id, self.address, self.clients)

    def tick(self, now: float) -> None:
        """Warn when the clients have not all joined by the next warning's time."""
        if self._joined:
            return
        self._read_monitor()
        if now < self._next_warning:
            return
        waited = now - self._started
        if self._welcomed:
            log.warning("%s: %d of %d clients joined the coordinator at %s after %.0f s; still waiting",
                        self.node, len(self._welcomed), self.clients, self.address, waited)
        else:
            log.warning("%s: no answer from the coordinator at %s after %.0f s: %s; still trying", self.node,
                        self.address, waited, _WHY[self._link])
        self._interval = min(2 * self._interval, MAX_WARNING_INTERVAL_S)
        self._next_warning = now + self._interval

    def _read_monitor(self) -> None:
        """Take the monitor's events so far; the last one says how far the watched socket got."""
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_MONITOR_STOPPED:  # the socket was closed (its client crashed)
                self.close()
            elif self._link != "refused" or event == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # reconnects fail alike
                self._link = _LINK.get(event, self._link)

    def close(self) -> None:
        """Stop following the watched socket (once every client joined, or when the node closes)."""
        if self._monitor is None:
            return
        if not self._watched.closed:
            self._watched.disable_monitor()
        self._monitor.close(linger=0)
        self._watched = self._monitor = None
