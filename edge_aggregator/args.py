"""An edge aggregator's arguments (:class:`AggregatorArgs`) and its run (:func:`run_aggregator`):
``python -m fcl_emu.edge_aggregator FLAGS``, which ``fcl-emu up --edge-aggregators M`` starts M times."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fcl_emu.aggregation.defences import Defences
from fcl_emu.aggregation.settings import AggregationSettings
from fcl_emu.runtime.flags import Flags, flag
from fcl_emu.runtime.process import (ArgsError, check, check_keys, exit_with_parent, fail, setup_logging,
                                     setup_process, warn_insecure)
from fcl_emu.wire.sockets import check_endpoint

log = logging.getLogger("fcl_emu.edge_aggregator")

_DEFAULTS = AggregationSettings()  # a run's defences unless it sets them: an aggregator's without its flags


def _number_or_off(text: str) -> float | None:
    return None if text == "off" else float(text)


def _format_or_off(value: float | None) -> str:
    return "off" if value is None else repr(value)


@dataclass(frozen=True)
class AggregatorArgs(Flags, prog="python -m fcl_emu.edge_aggregator",
                     description="Run one edge aggregator between edge nodes and the coordinator."):
    """What one edge-aggregator process runs with, each field one flag (:mod:`fcl_emu.runtime.flags`)."""

    connect: str = flag("Coordinator endpoint, e.g. tcp://HOST:5555.")
    bind: str = flag("Endpoint its edge nodes dial, e.g. tcp://0.0.0.0:5600.")
    name: str = flag("Its identity, edge-aggregator-<i> (its grant in the run's key directory).")
    server_key: Path | None = flag("The coordinator's public key file (coordinator.key).", default=None)
    key: Path | None = flag("Its secret key file (<name>.key_secret); the roster.json beside it says which keys "
                            "its nodes may connect with.", default=None)
    insecure: bool = flag("Plain TCP without keys, both ways (a coordinator started with --insecure).",
                          default=False)
    heartbeat_interval: float = flag("Seconds between its heartbeats to the coordinator.", default=1.0)
    edge_rounds: int = flag("Edge aggregations per cloud round (HierFAVG).", default=1)
    edge_round_timeout: float = flag("Seconds an edge round waits for its clients' updates.", default=120.0)
    # the plain round's defences on each edge round before the last (the last takes the coordinator's collect's)
    max_update_norm: float | None = flag("Edge rounds: refuse an update of L2 norm above this (norm_bound).",
                                         default=None)
    direction_check: float | None = flag(
        "Edge rounds: refuse an update that agrees with nothing of its edge group by Z standard deviations of "
        "chance (off_cohort); off: no check.", default=_DEFAULTS.direction_check, parse=_number_or_off,
        format=_format_or_off)
    clip_norm: float | None = flag("Edge rounds: scale every update down to this L2 norm.", default=None)
    adaptive_clip: float | None = flag(
        "Edge rounds: scale every update down to this multiple of its edge group's median norm (then each tensor); "
        "off: no adaptive bound.", default=_DEFAULTS.adaptive_clip, parse=_number_or_off, format=_format_or_off)
    max_held_bytes: int | None = flag("The most bytes its clients' held updates may take together; beyond it an "
                                      "update is refused (too_large). Default: one update of the round's model size "
                                      "per client relayed.", default=None)
    parent_pid: int | None = flag("Exit as soon as this process, its parent, is gone (set by `fcl-emu up`).",
                                  default=None)
    verbose: bool = flag("Log progress (INFO and up).", default=False, alias="-v")

    def __post_init__(self) -> None:
        for field in ("server_key", "key"):
            if getattr(self, field) is not None:
                object.__setattr__(self, field, Path(getattr(self, field)))
        for name, endpoint in (("--connect", self.connect), ("--bind", self.bind)):
            try:
                check_endpoint(endpoint)
            except ValueError as exc:
                raise ArgsError(name, str(exc)) from None
        check(self.heartbeat_interval > 0, "--heartbeat-interval", f"{self.heartbeat_interval}: give more than 0")
        check(self.edge_rounds >= 1, "--edge-rounds", f"{self.edge_rounds}: give 1 or more")
        check(self.edge_round_timeout > 0, "--edge-round-timeout", f"{self.edge_round_timeout}: give more than 0")
        for name, value in (("--max-update-norm", self.max_update_norm), ("--direction-check", self.direction_check),
                            ("--clip-norm", self.clip_norm)):
            check(value is None or value > 0, name, f"{value}: give more than 0")
        check(self.adaptive_clip is None or self.adaptive_clip >= 1, "--adaptive-clip",
              f"{self.adaptive_clip}: give 1 or more")
        check(self.max_held_bytes is None or self.max_held_bytes > 0, "--max-held-bytes",
              f"{self.max_held_bytes}: give more than 0")
        check_keys(self.server_key, self.key, self.insecure)


def run_aggregator(args: AggregatorArgs) -> int:
    """Run the aggregator of ``args`` until the coordinator's shutdown, SIGTERM or SIGINT; its exit code: 0, or 1
    after one error line when it cannot start (an unreadable key)."""
    from fcl_emu.edge_aggregator.relay import EdgeAggregator
    from fcl_emu.wire.auth import ClientKeyring, KeyFileError, ServerKeys, load_roster

    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    server_keys = client_keys = None
    if args.insecure:
        warn_insecure()
    else:
        try:
            client_keys = ClientKeyring(args.server_key, args.key).for_identity(args.name)
            server_keys = ServerKeys(client_keys.public, client_keys.secret, load_roster(args.key.parent))
        except KeyFileError as exc:
            return fail(str(exc))
    setup_logging(args.verbose)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    aggregator = EdgeAggregator(args.name, args.connect, args.bind, server_keys=server_keys,
                                client_keys=client_keys, heartbeat_interval_s=args.heartbeat_interval,
                                edge_rounds=args.edge_rounds, edge_round_timeout_s=args.edge_round_timeout,
                                defences=Defences.of(args), max_held_bytes=args.max_held_bytes)
    log.info("%s: nodes dial %s; coordinator %s", args.name, aggregator.address, args.connect)
    try:
        aggregator.run(stop)
    finally:
        aggregator.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fcl_emu.edge_aggregator FLAGS``."""
    setup_process()
    return run_aggregator(AggregatorArgs.from_argv(argv))
