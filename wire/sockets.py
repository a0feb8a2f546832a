"""ZeroMQ socket set-up and the two endpoint kinds (server ROUTER, client DEALER).

Socket options follow the design notes: ``ROUTER_MANDATORY`` so a send to a
vanished peer fails loudly instead of vanishing, ``ROUTER_HANDOVER`` so a
client that reconnects under the same identity takes over its old pipe, small
send high-water marks because frames are large, ``MAXMSGSIZE`` so an
oversized frame is refused by libzmq before it is buffered, and a linger long
enough that an update in flight is delivered on close.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from wire.framing import Limits, Message, WireError, decode, encode, frames_nbytes
from wire.messages import Body

LINGER_MS = 5000
SEND_HWM = 16

#: Called with (message type, direction "sent"/"received", bytes) for every message.
ByteCounter = Callable[[str, str, int], None]


def _no_count(msg_type: str, direction: str, nbytes: int) -> None:
    return None


@dataclass
class Counters:
    """Byte and message tallies by (message type, direction)."""

    bytes: dict[tuple[str, str], int]
    messages: dict[tuple[str, str], int]

    @classmethod
    def empty(cls) -> "Counters":
        return cls({}, {})

    def __call__(self, msg_type: str, direction: str, nbytes: int) -> None:
        key = (msg_type, direction)
        self.bytes[key] = self.bytes.get(key, 0) + nbytes
        self.messages[key] = self.messages.get(key, 0) + 1

    def nested(self) -> dict[str, dict[str, int]]:
        """``{type: {direction: bytes}}`` for result files."""
        out: dict[str, dict[str, int]] = {}
        for (msg_type, direction), n in sorted(self.bytes.items()):
            out.setdefault(msg_type, {})[direction] = n
        return out


def tee(*counters: ByteCounter) -> ByteCounter:
    """One ByteCounter that calls each of ``counters`` (e.g. the result tallies and Prometheus metrics)."""
    def each(msg_type: str, direction: str, nbytes: int) -> None:
        for count in counters:
            count(msg_type, direction, nbytes)
    return each


def _configure(sock: zmq.Socket, limits: Limits) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_total_bytes + limits.max_header_bytes)


class ServerEndpoint:
    """A bound ROUTER: receives from and sends to many identified peers."""

    def __init__(self, ctx: zmq.Context, bind: str, *, name: str = "coordinator",
                 limits: Limits = Limits(), count: ByteCounter = _no_count):
        self.sock = ctx.socket(zmq.ROUTER)
        _configure(self.sock, limits)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if bind.endswith(":0"):
            port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            self.sock.bind(bind)
            self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.name = name
        self.limits = limits
        self.count = count
        self._seq = 0

    def send(self, peer: str, msg_type: str, body: Body, *, round: int = 0, task: int = 0,
             tensors: Mapping[str, Any] | None = None) -> int:
        """Send to ``peer``; returns bytes sent. Raises ``zmq.ZMQError`` (EHOSTUNREACH) if the peer is gone."""
        self._seq += 1
        frames = encode(msg_type, body, sender=self.name, seq=self._seq, round=round, task=task, tensors=tensors)
        self.sock.send_multipart([peer.encode()] + frames, copy=False)
        nbytes = frames_nbytes(frames)
        self.count(msg_type, "sent", nbytes)
        return nbytes

    def recv(self) -> tuple[str, Message]:
        """Receive one message (blocking). A bad one raises WireError with ``.peer`` set."""
        frames = self.sock.recv_multipart(copy=False)
        peer = bytes(frames[0].buffer).decode("utf-8", "replace")
        try:
            msg = decode(frames[1:], self.limits)
            if msg.sender != peer:
                raise WireError("sender_mismatch", f"header says {msg.sender!r}, connection is {peer!r}")
        except WireError as exc:
            exc.peer = peer
            raise
        self.count(msg.type, "received", msg.nbytes)
        return peer, msg

    def close(self) -> None:
        self.sock.close()


FDS_PER_SOCKET = 2  # a connected DEALER holds its mailbox's eventfd and its TCP connection
FD_RESERVE = 256  # files, logs, torch, the metrics server and the context's own descriptors


class SocketCapacityError(RuntimeError):
    """This process cannot open the sockets it needs (the message says which limit and what to do)."""


def ensure_socket_capacity(ctx: zmq.Context, sockets: int) -> None:
    """Make room for ``sockets`` more sockets in ``ctx`` and in this process's descriptor limit, or say why not.

    A ZeroMQ context allows 1,023 sockets by default and a process often only 1,024 open files (soft limit):
    an edge node hosting more clients than that used to die in the middle of starting them with "Too many
    open files". Call it before the context's first socket: libzmq sizes the context's socket table then. The
    soft descriptor limit is raised up to the hard one.
    """
    needed_fds = sockets * FDS_PER_SOCKET + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed_fds:
        if hard != resource.RLIM_INFINITY and hard < needed_fds:
            raise SocketCapacityError(
                f"{sockets} client sockets need about {needed_fds} open files, but this process may open at most "
                f"{hard} (hard limit, `ulimit -Hn`): raise it, or spread the clients over more edge nodes")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed_fds, hard))
    if ctx.get(zmq.MAX_SOCKETS) < sockets + 16:  # libzmq reads it when the context's first socket opens
        ctx.set(zmq.MAX_SOCKETS, sockets + 16)


class ClientEndpoint:
    """A DEALER with its own identity, connected to the coordinator."""

    def __init__(self, ctx: zmq.Context, connect: str, identity: str, *,
                 limits: Limits = Limits(), count: ByteCounter = _no_count):
        self.sock = ctx.socket(zmq.DEALER)
        _configure(self.sock, limits)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.connect(connect)
        self.identity = identity
        self.limits = limits
        self.count = count
        self._seq = 0

    def send(self, msg_type: str, body: Body, *, round: int = 0, task: int = 0,
             tensors: Mapping[str, Any] | None = None) -> int:
        return self.send_frames(msg_type, self.encode(msg_type, body, round=round, task=task, tensors=tensors))

    def encode(self, msg_type: str, body: Body, *, round: int = 0, task: int = 0,
               tensors: Mapping[str, Any] | None = None) -> list:
        """The frames of a message, to send now or later (an emulated slow link sends them later)."""
        self._seq += 1
        return encode(msg_type, body, sender=self.identity, seq=self._seq, round=round, task=task, tensors=tensors)

    def send_frames(self, msg_type: str, frames: list) -> int:
        """Send frames from :meth:`encode`; returns bytes sent."""
        self.sock.send_multipart(frames, copy=False)
        nbytes = frames_nbytes(frames)
        self.count(msg_type, "sent", nbytes)
        return nbytes

    def recv(self) -> Message:
        msg = decode(self.sock.recv_multipart(copy=False), self.limits)
        self.count(msg.type, "received", msg.nbytes)
        return msg

    def close(self, linger_ms: int | None = None) -> None:
        self.sock.close(linger=linger_ms)
