"""A GPU worker process's arguments (:class:`GpuWorkerArgs`): what the pool starts it with, as flags of ``python
-m coordinator.gpu_worker`` and ``fcl-emu gpu-worker``; kept apart from the worker (coordinator/gpu_worker.py) so
that reading them does not import torch."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fcl_emu.runtime.process import ArgsError, check, check_keys, check_metrics, parse_with
from fcl_emu.wire.sockets import check_endpoint

DEVICES = ("auto", "cuda", "cpu")

# each flag's help, shared by ``python -m fcl_emu.coordinator.gpu_worker`` and ``fcl-emu gpu-worker``
HELP = {
    "connect": "The GPU pool's endpoint.",
    "index": "Worker index (its identity and CUDA device).",
    "device": "auto, cuda or cpu.",
    "parent_pid": "Exit when this process is gone.",
    "metrics_port": "Serve this worker's Prometheus /metrics on this port.",
    "metrics_host": "Address /metrics listens on.",
    "metrics_linger": "Seconds to keep /metrics up after the shutdown.",
    "server_key": "The coordinator's public key file (coordinator.key from `fcl-emu keys`).",
    "key": "This side's secret key file (gpu-workers.key_secret from `fcl-emu keys`).",
}


@dataclass(frozen=True)
class GpuWorkerArgs:
    """What one worker process runs with (without keys: plain TCP); checked when made (:class:`ArgsError`
    naming the flag)."""

    connect: str
    index: int
    device: str = "auto"
    parent_pid: int | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_linger: float = 0.0
    server_key: Path | None = None
    key: Path | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        for field in ("server_key", "key"):  # path strings as Paths
            if getattr(self, field) is not None:
                object.__setattr__(self, field, Path(getattr(self, field)))
        try:
            check_endpoint(self.connect)
        except ValueError as exc:
            raise ArgsError("--connect", str(exc)) from None
        check(self.index >= 0, "--index", f"{self.index}: give 0 or more")
        check(self.device in DEVICES, "--device", f"{self.device!r}: choose one of {', '.join(DEVICES)}")
        check_metrics(self.metrics_port, self.metrics_linger)
        check_keys(self.server_key, self.key, insecure=self.server_key is None and self.key is None)

    def to_argv(self) -> list[str]:
        """The flags of ``python -m fcl_emu.coordinator.gpu_worker`` that give these arguments back."""
        argv = ["--connect", self.connect, "--index", str(self.index), "--device", self.device]
        if self.parent_pid is not None:
            argv += ["--parent-pid", str(self.parent_pid)]
        if self.server_key is not None:
            argv += ["--server-key", str(self.server_key), "--key", str(self.key)]
        if self.metrics_port is not None:
            argv += ["--metrics-host", self.metrics_host, "--metrics-port", str(self.metrics_port),
                     "--metrics-linger", repr(self.metrics_linger)]
        if self.verbose:
            argv.append("--verbose")
        return argv

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> GpuWorkerArgs:
        """The arguments of ``argv`` (default ``sys.argv[1:]``); a bad value exits 2 with the usage and one line
        naming the flag, as argparse does."""
        parser = argparse.ArgumentParser(prog="python -m fcl_emu.coordinator.gpu_worker",
                                         description="One GPU worker of the coordinator's pool (docs/gpu.md).")
        parser.add_argument("--connect", required=True, help=HELP["connect"])
        parser.add_argument("--index", type=int, required=True, help=HELP["index"])
        parser.add_argument("--device", default="auto", help=HELP["device"])
        parser.add_argument("--parent-pid", type=int, help=HELP["parent_pid"])
        parser.add_argument("--metrics-port", type=int, help=HELP["metrics_port"])
        parser.add_argument("--metrics-host", default="127.0.0.1", help=HELP["metrics_host"])
        parser.add_argument("--metrics-linger", type=float, default=0.0, help=HELP["metrics_linger"])
        parser.add_argument("--server-key", type=Path, help=HELP["server_key"])
        parser.add_argument("--key", type=Path, help=HELP["key"])
        parser.add_argument("--verbose", "-v", action="store_true")
        return parse_with(parser, argv, lambda ns: cls(**vars(ns)))
