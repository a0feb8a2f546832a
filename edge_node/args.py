"""An edge-node process's arguments (:class:`NodeArgs`) and its run (:func:`run_node`).

``python -m fcl_emu.edge_node FLAGS`` and ``fcl-emu node FLAGS`` take the same flags and run the same node; launchers
build a :class:`NodeArgs` and start it with :meth:`NodeArgs.to_argv` (a process started afresh, a container) or
hand it to a forked process (``fcl_emu/launchers/zygote.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fcl_emu.runtime.flags import Flags, flag
from fcl_emu.runtime.process import (ArgsError, check, check_keys, check_metrics, exit_with_parent, fail, setup_logging,
                                     setup_process, warn_insecure)
from fcl_emu.scenario.datasets import default_data_roots
from fcl_emu.wire.sockets import check_endpoint

log = logging.getLogger("fcl_emu.edge_node")


def parse_client_set(text: str) -> list[int]:
    """'0-3,7,9-10,20-28/4' -> [0, 1, 2, 3, 7, 9, 10, 20, 24, 28] (``/N``: every N-th of the range); ArgsError
    (``--clients``) for anything else."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        span, slash, step_text = part.partition("/")
        lo, sep, hi = span.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
            step = int(step_text) if slash else 1
        except ValueError:
            raise ArgsError("--clients", f"bad client set {text!r}: use forms like '0-149', '0,5,7-9' or "
                                         f"'0-98/2'") from None
        check(0 <= first <= last and step >= 1, "--clients", f"bad client range {part!r}")
        out.extend(range(first, last + 1, step))
    check(bool(out), "--clients", "the client set is empty")
    return sorted(set(out))


def format_client_set(indices: Sequence[int]) -> str:
    """Inverse of :func:`parse_client_set`, compact: runs of consecutive clients as 'a-b', evenly spaced runs of
    three or more as 'a-b/step' (a node's striped clients: 50,000 of them in a few characters, within the
    operating system's limit on one argument)."""
    parts, i = [], 0
    while i < len(indices):
        j = i + 1
        step = indices[j] - indices[i] if j < len(indices) else 1
        while j + 1 < len(indices) and indices[j + 1] - indices[j] == step:
            j += 1
        if j < len(indices) and (step == 1 or j - i >= 2):
            parts.append(f"{indices[i]}-{indices[j]}" + (f"/{step}" if step > 1 else ""))
            i = j + 1
        else:
            parts.append(str(indices[i]))
            i += 1
    return ",".join(parts)


@dataclass(frozen=True)
class NodeArgs(Flags, prog="python -m fcl_emu.edge_node",
               description="Run one edge node hosting many emulated clients."):
    """What one edge-node process runs with, each field one flag (:mod:`fcl_emu.runtime.flags`); checked when made
    (:class:`ArgsError` naming the flag)."""

    connect: str = flag("Coordinator endpoint, e.g. tcp://HOST:5555.")
    clients: tuple[int, ...] = flag("Client indices hosted here, e.g. 0-149, 0,5,7-9 or 1-99/2 (every second).",
                                    parse=parse_client_set, format=format_client_set)
    data_roots: tuple[Path, ...] = flag("Where datasets are looked for (repeatable; default $FCL_EMU_DATA_ROOT or "
                                        "./data).", default=(), repeat="--data-root")
    name: str | None = flag("Node name (default node-<pid>).", default=None)
    threads: int = flag("Torch threads for local training.", default=1)
    metrics_port: int | None = flag("Serve this node's Prometheus /metrics on this port.", default=None)
    metrics_host: str = flag("Address /metrics listens on.", default="127.0.0.1")
    metrics_linger: float = flag("Seconds to keep /metrics up after the clients shut down.", default=0.0)
    parent_pid: int | None = flag("Exit as soon as this process, the node's parent, is gone (set by `fcl-emu up`).",
                                  default=None)
    server_key: Path | None = flag("The coordinator's public key file (coordinator.key from `fcl-emu keys`).",
                                   default=None)
    key: Path | None = flag("This side's secret key file (<name>.key_secret from `fcl-emu keys`), or a directory of "
                            "per-device keys (<client>.key_secret).", default=None)
    insecure: bool = flag("Connect over plain TCP without keys (a coordinator started with --insecure).",
                          default=False)
    secagg: bool = flag("The run aggregates under SecAgg+ (a coordinator started with --secagg): the clients send "
                        "masked inputs only. Without it they send plain updates only. A train request or a welcome "
                        "that says otherwise is refused (no relay can turn a secure run plain).", default=False)
    skip_model_check: bool = flag("Research only: under --secagg, release a client's shares without checking that "
                                  "every survivor signed the model it trained (the check that stops a coordinator "
                                  "from isolating one client's update by sending the others other models).",
                                  default=False)
    own_connections: bool = flag("Give each client a connection of its own (a socket and a CurveZMQ handshake per "
                                 "client) instead of one connection shared by the node's clients.", default=False)
    verbose: bool = flag("Log progress (INFO and up).", default=False, alias="-v")

    def __post_init__(self) -> None:
        assign = object.__setattr__  # any sequence of clients, sorted; path strings as Paths
        assign(self, "clients", tuple(sorted(set(self.clients))))
        assign(self, "data_roots", tuple(Path(p) for p in self.data_roots))
        for field in ("server_key", "key"):
            if getattr(self, field) is not None:
                assign(self, field, Path(getattr(self, field)))
        try:
            check_endpoint(self.connect)
        except ValueError as exc:
            raise ArgsError("--connect", str(exc)) from None
        check(bool(self.clients) and min(self.clients) >= 0, "--clients", "give one client index or more, each >= 0")
        check(self.threads >= 1, "--threads", f"{self.threads}: give 1 or more")
        check_metrics(self.metrics_port, self.metrics_linger)
        check_keys(self.server_key, self.key, self.insecure)

    def with_paths(self, server_key: Path | str, key: Path | str) -> NodeArgs:
        """These arguments with the key files at other paths (where a container sees them)."""
        return dataclasses.replace(self, server_key=Path(server_key), key=Path(key))


def run_node(args: NodeArgs) -> int:
    """Run the node of ``args`` until the coordinator's shutdown, SIGTERM or SIGINT; its exit code: 0, or 1 after
    one error line when it cannot run (no data root, an unreadable key, too few sockets, a failed set-up)."""
    from fcl_emu.edge_node.connection import show_connection_lines
    from fcl_emu.edge_node.node import EdgeNode, NodeSetupError
    from fcl_emu.wire.auth import ClientKeyring, KeyFileError
    from fcl_emu.wire.sockets import SocketCapacityError

    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    roots = list(args.data_roots or default_data_roots())
    if not any(root.is_dir() for root in roots):
        return fail(f"no data root exists ({', '.join(map(str, roots))}): give --data-root DIR or set "
                    f"FCL_EMU_DATA_ROOT")
    keys = None
    if args.insecure:
        warn_insecure()
    else:
        try:
            keys = ClientKeyring(args.server_key, args.key)
        except KeyFileError as exc:
            return fail(str(exc))
    setup_logging(args.verbose)
    show_connection_lines()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        edge = EdgeNode(args.connect, list(args.clients), name=args.name, data_roots=roots, threads=args.threads,
                        keys=keys, own_connections=args.own_connections, secure=args.secagg,
                        check_models=not args.skip_model_check)
    except SocketCapacityError as exc:
        return fail(str(exc))
    serving = args.metrics_port is not None and edge.metrics.serve_as_aid(args.metrics_port, args.metrics_host, log)
    try:
        edge.run(stop)
        if serving and args.metrics_linger > 0:
            stop.wait(args.metrics_linger)  # a last scrape sees the end
    except NodeSetupError as exc:
        return fail(str(exc))
    finally:
        edge.metrics.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fcl_emu.edge_node FLAGS``."""
    setup_process()
    return run_node(NodeArgs.from_argv(argv))
