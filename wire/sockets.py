"""ZeroMQ socket set-up and the two endpoint kinds (server ROUTER, client DEALER).

Socket options follow the design notes: ``ROUTER_MANDATORY`` so a send to a
vanished peer fails loudly instead of vanishing, small send high-water marks
because frames are large, ``MAXMSGSIZE`` so an oversized frame is refused by
libzmq before it is buffered, and a linger long enough that an update in
flight is delivered on close. With keys (:mod:`fcl_emu.wire.auth`) both ends speak
CurveZMQ.

What one message can cost the receiver is bounded at the socket
(:func:`receive_frames`): libzmq refuses a frame over ``MAXMSGSIZE`` while
reading it (it checks each frame, not the message, and drops the connection,
discarding the message's frames received so far); the frames of a message are
taken one at a time, zero-copy, and one with more frames or bytes than the
:class:`~fcl_emu.wire.framing.Limits` allow is refused there, its remaining frames
received and dropped one by one, never kept.

Peers are addressed by the identity their messages name (``client-0004``), not
by a routing id they choose: the ROUTER gives every connection a random one,
and the endpoint routes an identity to the connection its latest accepted
message came on. A connection therefore cannot take over another's route by
claiming its routing id; with keys, a message is accepted only from a key whose
grant holds the identity it names.

A client either has a connection of its own (:class:`ClientEndpoint`, one DEALER
and one CurveZMQ session per client) or speaks over its edge node's *shared
connection* (:class:`SharedConnection`, one DEALER for all the node's clients,
each client a :class:`SharedChannel` on it). A shared connection says so in its
handshake (ZeroMQ metadata ``X-Fcl-Link: shared``) and puts an envelope frame,
the client's identity, before every message in both directions: up, it must
equal the identity the header names; down, it says which client the message is
for. An envelope alone (no message after it) is a *close notice*: the client's
session ended as a closed socket of its own would end it (a crash), so the
coordinator's sends to it fail (EHOSTUNREACH) until it speaks again, and its next
message counts as a new connection. Tensors made once to go to many clients
(:class:`~fcl_emu.wire.framing.WireTensors`: a round's model, a task's assets)
cross a shared connection once: the coordinator first sends them alone, under an
envelope of :data:`HELD` and their key, and the connection keeps them
(:class:`HeldSets`: the most recently used, within a count and a size); each
client's message then carries its header only, its
envelope naming the key after the identity, and the node reads it with the
kept tensors. Envelopes are transport: the byte counts leave them out, as they
leave out a ROUTER's routing id, and count each client's message whole, as a
device on a link of its own would receive it. Everything else a
client does (join, welcome, heartbeats, sequence numbers, grants, limits) is the
same on both (docs/wire.md, "Shared connections").
"""

from __future__ import annotations

import re
import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from fcl_emu.wire.auth import ClientKeys, Grant, ServerKeys, connect_curve, serve_curve
from fcl_emu.wire.framing import Limits, Message, WireError, WireTensors, decode, encode, frames_nbytes, refused_unread
from fcl_emu.wire.messages import Body

LINGER_MS = 5000
SEND_HWM = 16
LINK_PROPERTY = "X-Fcl-Link"  # the handshake metadata that tells a shared connection from a client's own
SHARED = "shared"  # its value on a shared connection

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


#: Bytes a CurveZMQ MESSAGE command adds to a frame (command name, nonce, MAC, flags); libzmq checks MAXMSGSIZE
#: against the encrypted frame.
CURVE_FRAME_OVERHEAD = 64


def configure_socket(sock: zmq.Socket, limits: Limits) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max(limits.max_total_bytes, limits.max_header_bytes) + CURVE_FRAME_OVERHEAD)


def receive_frames(sock: zmq.Socket, limits: Limits, first: zmq.Frame | None = None) -> list[zmq.Frame]:
    """The frames of the message being received (after a ROUTER's routing id and any envelope; ``first``: its
    first frame where the caller has read it already), zero-copy, within ``limits``:
    a header of at most ``max_header_bytes``, then at most ``max_tensors`` tensor frames of ``max_total_bytes``
    in all.

    Beyond any bound the message is refused (WireError ``frame_count`` or ``too_large``): the frames taken so
    far are let go and the rest of the message is received and dropped frame by frame, so the receiver never
    holds more than the limits whatever the frame count. libzmq delivers a message whole: until it is drained,
    its frames stay in libzmq's queue (docs/results/security.md has the numbers)."""
    frames: list[zmq.Frame] = []
    tensor_bytes = 0
    more = True
    while more:
        frame, first = (sock.recv(copy=False) if first is None else first), None
        more = frame.more
        frames.append(frame)
        if len(frames) == 1:
            too_large = len(frame) > limits.max_header_bytes
        else:
            tensor_bytes += len(frame)
            too_large = tensor_bytes > limits.max_total_bytes
        if too_large or len(frames) > limits.max_tensors + 1:
            head = frames[0]
            frames.clear()
            dropped = drop_rest(sock, more)
            if too_large:
                raise refused_unread("too_large", f"a header over {limits.max_header_bytes} bytes or tensors over "
                                                  f"{limits.max_total_bytes} bytes ({dropped} frames dropped "
                                                  f"unread)", head, limits)
            raise refused_unread("frame_count", f"more than {limits.max_tensors + 1} frames in one message (a "
                                                f"header and at most {limits.max_tensors} tensors; {dropped} more "
                                                f"dropped unread)", head, limits)
    return frames


def drop_rest(sock: zmq.Socket, more: bool) -> int:
    """Receive and drop the rest of the message being received; returns how many frames that was."""
    dropped = 0
    while more:
        more = sock.recv(copy=False).more
        dropped += 1
    return dropped


MAX_ENVELOPE_BYTES = 256  # a shared connection's envelope holds one identity
HELD = b"\0"  # in an envelope: what follows is the key of tensors the shared connection holds
HELD_SETS = 8  # sets of tensors a shared connection holds at most
HELD_BYTES = 64 << 20  # and their bytes, but for the set sent last (a large model: one set at a time)
MAX_ROUTES = 1_000_000  # identities remembered; the least recently heard from is forgotten first


def _key_bytes(key: int) -> bytes:
    return key.to_bytes(8, "big")


class HeldSets:
    """The sets of tensors a shared connection holds, by key, least recently used first: at most
    :data:`HELD_SETS`, and :data:`HELD_BYTES` but for the set kept last. The coordinator keeps one per shared
    connection (of keys and sizes), the node the frames themselves; both see the same sets kept and named in the
    same order on the one connection, so they drop the same ones."""

    def __init__(self) -> None:
        self._sets: dict[bytes, tuple[int, Any]] = {}  # key -> (bytes, what is kept)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._sets)

    def use(self, key: bytes) -> Any:
        """What is kept under ``key`` (now the most recently used), or None."""
        entry = self._sets.pop(key, None)
        if entry is None:
            return None
        self._sets[key] = entry
        return entry[1]

    def keep(self, key: bytes, nbytes: int, value: Any) -> None:
        if key in self._sets:  # kept again: replaced
            self._bytes -= self._sets.pop(key)[0]
        self._sets[key] = (nbytes, value)
        self._bytes += nbytes
        while len(self._sets) > 1 and (len(self._sets) > HELD_SETS or self._bytes > HELD_BYTES):
            oldest = next(iter(self._sets))
            self._bytes -= self._sets.pop(oldest)[0]


def check_grant(grants: Mapping[str, Grant] | None, frame: zmq.Frame, identity: str) -> None:
    """With ``grants`` (keys): refuse a message whose connection's key (the ``frame``'s) may not speak for
    ``identity`` (WireError ``not_authorized``, its ``peer`` the key's name)."""
    if grants is None:
        return
    grant = grants.get(frame.get("User-Id"))
    if grant is None or identity not in grant.identities:
        exc = WireError("not_authorized", f"key {grant.name if grant else '?'!r} may not speak for {identity!r}")
        exc.peer = grant.name if grant else None
        raise exc


def bound_router(ctx: zmq.Context, bind: str, limits: Limits, keys: ServerKeys | None) -> tuple[zmq.Socket, str]:
    """A ROUTER bound to ``bind`` (a port of 0: any free one) as the coordinator's and an edge aggregator's: with
    ``keys`` a CurveZMQ server; and the address it is bound to."""
    sock = ctx.socket(zmq.ROUTER)
    configure_socket(sock, limits)
    # no send high-water mark: a shared connection carries thousands of clients' messages, and the protocol
    # itself bounds what waits for any one client (a round's request and assets)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if keys is not None:
        serve_curve(sock, keys)
    if bind.endswith(":0"):
        host = bind.rsplit(":", 1)[0]
        return sock, f"{host}:{sock.bind_to_random_port(host)}"
    sock.bind(bind)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def shared_dealer(ctx: zmq.Context, connect: str, limits: Limits, keys: ClientKeys | None) -> zmq.Socket:
    """A DEALER connected to ``connect`` that says in its handshake it is a shared connection (an edge node's,
    or an edge aggregator's): no high-water marks (see :class:`SharedConnection`); with ``keys`` over CurveZMQ."""
    sock = ctx.socket(zmq.DEALER)
    configure_socket(sock, limits)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.METADATA, f"{LINK_PROPERTY}:{SHARED}".encode())
    if keys is not None:
        connect_curve(sock, keys)
    sock.connect(connect)
    return sock


class ServerEndpoint:
    """A bound ROUTER: receives from and sends to many identified peers.

    ``keys``: speak CurveZMQ and accept a message only if its connection's key may speak for its sender (the
    context must run an :class:`fcl_emu.wire.auth.Allowlist`). Without keys any peer may claim any identity.
    """

    def __init__(self, ctx: zmq.Context, bind: str, *, name: str = "coordinator",
                 limits: Limits = Limits(), count: ByteCounter = _no_count, keys: ServerKeys | None = None):
        self.sock, self.address = bound_router(ctx, bind, limits, keys)
        self.name = name
        self.limits = limits
        self.count = count
        self.grants = None if keys is None else keys.grants
        self._routes: dict[str, bytes] = {}  # identity -> routing id of its latest connection
        self._identities: dict[bytes, str] = {}  # and back, for connections of one client's own
        self._shared: dict[bytes, bool] = {}  # routing id -> whether it is a shared connection
        self._closed: set[str] = set()  # identities whose session on a shared connection ended (a close notice)
        self._held: dict[bytes, HeldSets] = {}  # shared connection -> what it holds (keys and sizes)
        self._seq = 0
        self.switched = False  # the last message received moved its sender to another connection
        self._last: tuple[bytes, Grant | None] | None = None  # the last message's connection and its key's grant
        # bytes put on the wire (tensors held by a shared connection counted once, envelopes left out), where the
        # byte counts count each message whole
        self.wire_sent = 0

    def send(self, peer: str, msg_type: str, body: Body, *, round: int = 0, task: int = 0,
             tensors: Mapping[str, Any] | WireTensors | None = None, sequenced: bool = True) -> int:
        """Send to ``peer``; returns bytes sent. Raises ``zmq.ZMQError`` (EHOSTUNREACH) if the peer is gone.
        An unsequenced message carries seq 0 and leaves the others' numbers, and so their sizes, as they were."""
        route = self._routes.get(peer)
        if route is None or peer in self._closed:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        self._seq += sequenced
        frames = encode(msg_type, body, sender=self.name, seq=self._seq if sequenced else 0, round=round, task=task,
                        tensors=tensors)
        if not self._shared.get(route):
            self.sock.send_multipart([route, *frames], copy=False)
        elif isinstance(tensors, WireTensors) and len(frames) > 1:
            key = _key_bytes(tensors.key)
            self._hold(route, key, frames[1:])
            self.sock.send_multipart([route, peer.encode() + HELD + key, frames[0]], copy=False)
        else:
            self.sock.send_multipart([route, peer.encode(), *frames], copy=False)
        nbytes = frames_nbytes(frames)
        self.count(msg_type, "sent", nbytes)
        self.wire_sent += frames_nbytes(frames[:1]) if self._shared.get(route) and isinstance(tensors, WireTensors) \
            else nbytes
        return nbytes

    def _hold(self, route: bytes, key: bytes, buffers: list[Any]) -> None:
        """Make the shared connection ``route`` hold the tensor frames ``buffers`` under ``key``: sent once, with
        an empty header frame, unless it holds them already."""
        held = self._held.setdefault(route, HeldSets())
        if held.use(key):
            return
        self.sock.send_multipart([route, HELD + key, b"", *buffers], copy=False)
        held.keep(key, frames_nbytes(buffers), True)
        self.wire_sent += frames_nbytes(buffers)

    def recv(self) -> tuple[str, Message] | None:
        """Receive one message (blocking); returns its sender's identity, or None for a close notice on a shared
        connection (handled here). A bad one raises WireError with ``.peer`` set to the identity it claimed (or,
        for a key speaking for another, the key's name).

        Messages to an identity go over the connection it last spoke on: after it spoke on another one (a
        restart, a reconnect after a network break, or a second holder of its key), :attr:`switched` is True
        until the next message, and what was sent over the old connection may never arrive."""
        self.switched = False
        route = self.sock.recv(copy=False).bytes
        first = self.sock.recv(copy=False)
        shared = self._is_shared(route, first)
        if shared and len(first) > MAX_ENVELOPE_BYTES:
            dropped = drop_rest(self.sock, first.more)
            raise WireError("bad_header", f"an envelope of {len(first)} bytes ({dropped} frames dropped unread)")
        claimed = first.bytes.decode("utf-8", "replace") if shared else self._identities.get(route)
        if shared and not first.more:
            self._close_notice(claimed, route, first)
            return None
        try:
            frames = receive_frames(self.sock, self.limits, first=None if shared else first)
            msg = decode(frames, self.limits)
            if shared and msg.sender != claimed:
                raise WireError("not_authorized", f"a message naming {msg.sender!r} in an envelope for {claimed!r}")
        except WireError as exc:
            exc.peer = claimed  # to answer on that connection
            raise
        check_grant(self.grants, frames[0], msg.sender)
        self._last = (route, None if self.grants is None else self.grants[frames[0].get("User-Id")])
        self._route(msg.sender, route)
        self.count(msg.type, "received", msg.nbytes)
        return msg.sender, msg

    def came_from(self, identity: str) -> bool:
        """Whether the message :meth:`recv` returned last came over a connection that may speak for ``identity`` (an
        edge aggregator's, for a notice it sends in a client's name): with keys, one whose key's grant holds
        ``identity``; without, the connection ``identity``'s own latest message came on."""
        if self._last is None:
            return False
        route, grant = self._last
        return identity in grant.identities if grant is not None else self._routes.get(identity) == route

    def _is_shared(self, route: bytes, frame: zmq.Frame) -> bool:
        """Whether the connection ``route`` is a shared one (its handshake metadata, read once per connection)."""
        shared = self._shared.get(route)
        if shared is None:
            try:
                shared = frame.get(LINK_PROPERTY) == SHARED
            except zmq.ZMQError:  # a peer that sent no such property: a connection of its own
                shared = False
            if len(self._shared) >= MAX_ROUTES:
                forgotten = next(iter(self._shared))
                del self._shared[forgotten]
                self._held.pop(forgotten, None)
            self._shared[route] = shared
        return shared

    def _close_notice(self, identity: str, route: bytes, frame: zmq.Frame) -> None:
        """A client's session on the shared connection ``route`` ended: sends to it fail until it speaks again.
        Only its own connection (and key) may say so; another's notice is ignored."""
        if self._routes.get(identity) != route:
            return
        try:
            check_grant(self.grants, frame, identity)
        except WireError:
            return
        self._closed.add(identity)

    def _route(self, identity: str, routing_id: bytes) -> None:
        routes, identities = self._routes, self._identities
        old = routes.get(identity)
        if identity in self._closed:  # back after its session on a shared connection closed: a new connection
            self._closed.discard(identity)
        elif old == routing_id:
            return
        if old is not None:
            del routes[identity]
            if identities.get(old) == identity:
                del identities[old]
            self.switched = True
        if len(routes) >= MAX_ROUTES:
            forgotten = next(iter(routes))
            identities.pop(routes.pop(forgotten), None)
            self._closed.discard(forgotten)
        routes[identity] = routing_id
        if not self._shared.get(routing_id):
            identities[routing_id] = identity

    def close(self) -> None:
        self.sock.close()


_ENDPOINT = re.compile(r"^(tcp://(\[[0-9a-fA-F:.]+\]|[^\s:/\[\]]+):\d{1,5}|ipc://\S+|inproc://\S+)$")


def check_endpoint(text: str) -> str:
    """``text`` if it is a ZeroMQ endpoint to connect to (tcp://HOST:PORT, ipc://PATH, inproc://NAME); else
    ValueError saying what one looks like."""
    if not _ENDPOINT.match(text) or (text.startswith("tcp://") and not 0 < int(text.rsplit(":", 1)[1]) < 65536):
        raise ValueError(f"{text!r} is not a ZeroMQ endpoint: use tcp://HOST:PORT with a port from 1 to 65535 "
                         f"(e.g. tcp://10.0.0.5:5555), ipc://PATH or inproc://NAME")
    return text


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
    """A DEALER speaking for one identity, connected to the coordinator (with ``keys``: over CurveZMQ)."""

    def __init__(self, ctx: zmq.Context, connect: str, identity: str, *,
                 limits: Limits = Limits(), count: ByteCounter = _no_count, keys: ClientKeys | None = None):
        self.sock = ctx.socket(zmq.DEALER)
        configure_socket(self.sock, limits)
        if keys is not None:
            connect_curve(self.sock, keys)
        self.sock.connect(connect)
        self.identity = identity
        self.limits = limits
        self.count = count
        self._seq = 0
        self._envelope: list[bytes] = []  # what precedes each message: nothing on a connection of its own

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
        self.sock.send_multipart(self._envelope + frames, copy=False)
        nbytes = frames_nbytes(frames)
        self.count(msg_type, "sent", nbytes)
        return nbytes

    def recv(self) -> Message:
        msg = decode(receive_frames(self.sock, self.limits), self.limits)
        self.count(msg.type, "received", msg.nbytes)
        return msg

    def close(self, linger_ms: int | None = None) -> None:
        self.sock.close(linger=linger_ms)


class SharedConnection:
    """One DEALER to the coordinator that carries the messages of many identities (an edge node's clients, each a
    :meth:`channel`), with an envelope frame naming the identity before each message (module docstring).

    No high-water marks: the node's main thread must never block on a send while the coordinator, busy sending
    to the same connection, does not read (each side's queue holds what the protocol bounds: a round's messages).
    """

    def __init__(self, ctx: zmq.Context, connect: str, *, limits: Limits = Limits(), count: ByteCounter = _no_count,
                 keys: ClientKeys | None = None):
        self.sock = shared_dealer(ctx, connect, limits, keys)
        self.limits, self.count = limits, count
        self._held = HeldSets()  # the tensor frames the coordinator sent to be held

    def channel(self, identity: str) -> "SharedChannel":
        """A new session of ``identity`` on this connection (its sequence numbers start again)."""
        return SharedChannel(self, identity)

    def recv(self) -> tuple[str, Message] | None:
        """Receive one message (blocking); returns the identity it is for, or None for tensors to hold (kept for
        the messages that name them, module docstring). A bad one raises WireError with ``.peer`` set to that
        identity."""
        envelope = self.sock.recv(copy=False)
        name, _, key = envelope.bytes.partition(HELD)
        identity = name.decode("utf-8", "replace")
        try:
            if len(envelope) > MAX_ENVELOPE_BYTES or not envelope.more:
                drop_rest(self.sock, envelope.more)
                raise WireError("bad_header", f"an envelope of {len(envelope)} bytes without a message")
            frames = receive_frames(self.sock, self.limits)
            if key and not identity:
                self._held.keep(key, sum(len(f) for f in frames[1:]), frames[1:])
                return None
            if key:
                held = self._held.use(key)
                if len(frames) > 1 or held is None:
                    raise WireError("bad_header", f"a message naming tensors this connection does not hold "
                                                  f"({len(self._held)} held)")
                frames += held
            msg = decode(frames, self.limits)
        except WireError as exc:
            exc.peer = identity
            raise
        self.count(msg.type, "received", msg.nbytes)
        return identity, msg

    def close(self, linger_ms: int | None = None) -> None:
        self.sock.close(linger=linger_ms)


class SharedChannel(ClientEndpoint):
    """One identity's session on a :class:`SharedConnection`: what a :class:`ClientEndpoint` offers for sending;
    the connection receives for all its channels. Closing it sends the close notice."""

    def __init__(self, connection: SharedConnection, identity: str):
        self.sock = connection.sock
        self.identity, self.limits, self.count = identity, connection.limits, connection.count
        self._seq = 0
        self._envelope = [identity.encode()]

    def recv(self) -> Message:
        raise TypeError("a shared connection receives for all its channels: SharedConnection.recv")

    def close(self, linger_ms: int | None = None) -> None:
        """End this session as a closed socket of its own would: the close notice (the connection stays)."""
        if not self.sock.closed:
            self.sock.send(self._envelope[0])
