"""``python -m fcl_emu.bench.hostile_message``: what one hostile message costs the coordinator's socket.

A sender process (an insider: its messages reach the coordinator's endpoint)
sends one message that the wire layer must refuse, then a heartbeat; the
receiver, a :class:`fcl_emu.wire.sockets.ServerEndpoint` with the default limits
(1 GiB of tensors, 4,096 tensors), measures

- ``peak_rss_mb``: its peak resident memory (``ru_maxrss``) above the level
  just before the message, up to its refusal (libzmq's buffers included: it
  delivers a message only once all its frames have arrived);
- ``loop_s``: the time of the receive call that refuses it, the frames let go
  included: how long the coordinator's main loop is held;
- ``refused``: the reason, and whether the heartbeat after it still arrives.

Cases: ``big-frames`` (a header, then 3 frames of 400 MB: each within the
per-frame bound, 1.2 GB in all) and ``empty-frames`` (a header, then
4,000,000 empty frames). Plain TCP over loopback; each case in a fresh
receiver process so that one case's freed memory does not hide the next's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time
from pathlib import Path

import zmq
from rich.console import Console

from fcl_emu.bench.report import emit
from fcl_emu.wire.framing import WireError, encode
from fcl_emu.wire.messages import Heartbeat
from fcl_emu.wire.sockets import ServerEndpoint

CASES = {"big-frames": (3, 400_000_000), "empty-frames": (4_000_000, 0)}  # (frames after the header, bytes each)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _send(address: str, frames: int, size: int) -> None:
    """The sender process: one hostile message (no tensor table), then a heartbeat."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 60_000)
    sock.connect(address)
    header = encode("heartbeat", Heartbeat(), sender="client-0000", seq=1)[0]
    payload = bytearray(size) if size else b""  # one buffer sent as every frame (zero-copy when large)
    sock.send(header, zmq.SNDMORE)
    for i in range(frames):
        sock.send(payload, zmq.SNDMORE if i < frames - 1 else 0, copy=size == 0)
    sock.send_multipart(encode("heartbeat", Heartbeat(), sender="client-0000", seq=2))
    sock.close()
    ctx.term()


def measure(case: str) -> dict:
    """One case in this process: the receiver's peak memory growth and loop time for one hostile message."""
    frames, size = CASES[case]
    ctx = zmq.Context()
    endpoint = ServerEndpoint(ctx, "tcp://127.0.0.1:0")
    base = _rss()
    sender = mp.get_context("spawn").Process(target=_send, args=(endpoint.address, frames, size))
    sender.start()
    endpoint.sock.poll(600_000)  # the whole message has arrived (libzmq holds it until then)
    started = time.perf_counter()
    reason = "accepted"
    try:
        endpoint.recv()
    except WireError as exc:
        reason = exc.reason
    loop_s = time.perf_counter() - started
    peak = _peak_rss()
    flows = endpoint.sock.poll(60_000) and endpoint.recv()[1].type == "heartbeat"
    sender.join()
    endpoint.close()
    ctx.term()
    return {"case": case, "frames": frames + 1, "bytes": frames * size, "peak_rss_mb": (peak - base) / 1e6,
            "loop_s": loop_s, "refused": reason, "next_message_flows": bool(flows)}


def _measure_into(case: str, queue: mp.Queue) -> None:
    queue.put(measure(case))


def run(cases: list[str], json_path: Path | None, console: Console) -> dict:
    rows = []
    for case in cases:
        queue: mp.Queue = mp.get_context("spawn").Queue()
        receiver = mp.get_context("spawn").Process(target=_measure_into, args=(case, queue))
        receiver.start()
        rows.append(queue.get(timeout=600))
        receiver.join()
    return emit("hostile-message", rows, {"transport": "plain TCP, loopback", "pyzmq": zmq.__version__,
                                          "libzmq": zmq.zmq_version()}, json_path, console)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="a case (default: all)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    run(args.case or list(CASES), args.json, Console())


if __name__ == "__main__":
    main()
