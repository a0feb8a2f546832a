"""``fcl-emu bench wire``: the project's framing against raw zero-copy pyzmq and pickle.

A sender process pushes one float32 tensor per message to a receiver process
over TCP loopback for a fixed time; the receiver measures bytes per second
from its first to its last message. Three codecs, same sockets:

- ``raw``: the tensor buffer alone, ``copy=False`` both ways, ``np.frombuffer``
  on receipt: the ceiling for any framing;
- ``framed``: the project's header + tensor frames, with full validation on
  receipt (schema, dtype, sizes, finite values);
- ``framed-unscanned``: the same without the NaN/infinity scan of the tensor
  values (``Limits(check_finite=False)``), to separate the framing's own cost
  from the value scan's;
- ``pickle``: ``pickle.dumps`` of a dict holding the tensor (protocol 5), the
  common unsafe shortcut, for reference.

``raw`` and ``framed`` are also measured over CurveZMQ (``+curve``, the default
transport of a run, docs/security.md): what encryption costs in throughput. And
the connection cost: how long N clients take from their first connect to the
server having one message from each, plain and under CurveZMQ with the run's
ZAP allow-list (the handshake's key agreement and one ZAP request per client).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq
from rich.console import Console

from fcl_emu.bench.report import emit
from fcl_emu.wire.auth import (
    Allowlist,
    ClientKeyring,
    ClientKeys,
    ServerKeys,
    connect_curve,
    load_server_keys,
    serve_curve,
    write_keys,
)
from fcl_emu.wire.framing import Limits, decode, encode
from fcl_emu.wire.messages import Join, Update, client_id
from fcl_emu.wire.sockets import ClientEndpoint, ServerEndpoint, ensure_socket_capacity

SIZES = {"1KiB": 1 << 10, "1MiB": 1 << 20, "45MiB": 45 << 20}
CODECS = ("raw", "framed", "framed-unscanned", "pickle", "raw+curve", "framed+curve")
UNSCANNED = Limits(check_finite=False)
HANDSHAKE_CLIENTS = 300


def _frames(codec: str, array: np.ndarray, seq: int) -> list:
    codec = codec.removesuffix("+curve")
    if codec == "raw":
        return [array]
    if codec.startswith("framed"):
        return encode("update", Update(num_samples=1, train_time_s=0.0, loss=0.0), sender="bench", seq=seq,
                      tensors={"delta/w": array})
    return [pickle.dumps({"delta/w": array}, protocol=5)]


def _consume(codec: str, frames: list) -> int:
    codec = codec.removesuffix("+curve")
    if codec == "raw":
        return np.frombuffer(frames[0].buffer, dtype=np.float32).nbytes
    if codec == "framed":
        return decode(frames).tensors["delta/w"].nbytes
    if codec == "framed-unscanned":
        return decode(frames, UNSCANNED).tensors["delta/w"].nbytes
    return pickle.loads(frames[0].buffer)["delta/w"].nbytes


def _receiver(address: str, codec: str, out: mp.Queue, server_public: bytes | None) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 4)
    if server_public is not None:
        public, secret = zmq.curve_keypair()
        connect_curve(sock, ClientKeys(server_public, public, secret))
    sock.connect(address)
    first = last = None
    total = count = 0
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames[0]) == 0:  # the sender's end marker
            break
        total += _consume(codec, frames)
        last = time.perf_counter()
        if first is None:
            first, total, count = last, 0, 0  # time from the first message on
        else:
            count += 1
    out.put((total, count, (last - first) if first and last and count else float("nan")))
    sock.close()
    ctx.term()


def measure(codec: str, nbytes: int, seconds: float) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 4)
    server_public = None
    if codec.endswith("+curve"):  # no ZAP handler: any client key, the same encryption
        server_public, secret = zmq.curve_keypair()
        serve_curve(sock, ServerKeys(server_public, secret, {}))
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    results: mp.Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(f"tcp://127.0.0.1:{port}", codec, results,
                                                                   server_public))
    proc.start()
    array = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    seq, end = 0, None
    while True:
        seq += 1
        sock.send_multipart(_frames(codec, array, seq), copy=False)
        if end is None:
            end = time.perf_counter() + seconds  # clock starts once the receiver is connected
        elif time.perf_counter() > end and seq > 3:
            break
    sock.send(b"")
    total, count, elapsed = results.get(timeout=120)
    proc.join(timeout=30)
    sock.close(linger=0)
    ctx.term()
    return {"messages": count, "bytes": total, "seconds": elapsed, "MiB_per_s": total / elapsed / (1 << 20)}


def connect_clients(clients: int, curve: bool, directory: Path) -> float:
    """Seconds from the first of ``clients`` DEALERs connecting to a ROUTER until it has a join from each (all
    in this process; under CurveZMQ with a roster and the ZAP allow-list, as a coordinator runs)."""
    ctx = zmq.Context()
    ensure_socket_capacity(ctx, clients + 8)
    identities = [client_id(i) for i in range(clients)]
    keys = allowlist = ring = None
    if curve:
        key_dir = write_keys(directory / "keys", {"node": identities})
        keys = load_server_keys(key_dir)
        allowlist = Allowlist(ctx, keys)
        ring = ClientKeyring(key_dir / "coordinator.key", key_dir / "node.key_secret")
    server = ServerEndpoint(ctx, "tcp://127.0.0.1:0", keys=keys)
    started = time.perf_counter()
    endpoints = [ClientEndpoint(ctx, server.address, i, keys=ring.for_identity(i) if ring else None)
                 for i in identities]
    for i, endpoint in enumerate(endpoints):
        endpoint.send("join", Join(node="bench", pid=1, client_index=i))
    seen = set()
    while len(seen) < clients:
        seen.add(server.recv()[0])
    elapsed = time.perf_counter() - started
    for endpoint in endpoints:
        endpoint.close(0)
    server.close()
    if allowlist is not None:
        allowlist.stop()
    ctx.term()
    return elapsed


def run(json_path: Path | None, seconds: float, console: Console) -> dict:
    rows = []
    for label, nbytes in SIZES.items():
        measured = {codec: measure(codec, nbytes, seconds) for codec in CODECS}
        raw = measured["raw"]["MiB_per_s"]
        for codec in CODECS:
            rate = measured[codec]["MiB_per_s"]
            rows.append({"size": label, "codec": codec, "messages": measured[codec]["messages"],
                         "MiB_per_s": rate, "ratio_to_raw": rate / raw})
    ratios = {codec: {r["size"]: round(r["ratio_to_raw"], 3) for r in rows if r["codec"] == codec}
              for codec in CODECS[1:]}
    with tempfile.TemporaryDirectory() as tmp:
        plain = connect_clients(HANDSHAKE_CLIENTS, False, Path(tmp))
        curve = connect_clients(HANDSHAKE_CLIENTS, True, Path(tmp))
    return emit("wire", rows, {"ratio_to_raw": ratios,
                               "curve_framed_to_plain_framed": {
                                   size: round(ratios["framed+curve"][size] / ratios["framed"][size], 3)
                                   for size in SIZES},
                               f"connect_{HANDSHAKE_CLIENTS}_clients_s": {
                                   "plain": round(plain, 3), "curve": round(curve, 3),
                                   "ratio_curve_to_plain": round(curve / plain, 2)},
                               "target": "framed >= 0.85 of raw at 1MiB and 45MiB"},
                json_path, console)
