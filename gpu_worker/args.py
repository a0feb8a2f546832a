"""A GPU worker process's arguments (:class:`GpuWorkerArgs`): what the pool starts it with, as flags of ``python
-m fcl_emu.gpu_worker`` and ``fcl-emu gpu-worker``; kept apart from the worker (gpu_worker/worker.py), which imports
torch and the methods' jobs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fcl_emu.runtime.flags import Flags, flag
from fcl_emu.runtime.process import ArgsError, check, check_keys, check_metrics
from fcl_emu.wire.sockets import check_endpoint

DEVICES = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class GpuWorkerArgs(Flags, prog="python -m fcl_emu.gpu_worker",
                    description="One GPU worker of the coordinator's pool (docs/gpu.md)."):
    """What one worker process runs with (without keys: plain TCP), each field one flag
    (:mod:`fcl_emu.runtime.flags`); checked when made (:class:`ArgsError` naming the flag)."""

    connect: str = flag("The GPU pool's endpoint.")
    index: int = flag("Worker index (its identity and CUDA device).")
    device: str = flag("auto, cuda or cpu.", default="auto")
    parent_pid: int | None = flag("Exit when this process is gone.", default=None)
    metrics_port: int | None = flag("Serve this worker's Prometheus /metrics on this port.", default=None)
    metrics_host: str = flag("Address /metrics listens on.", default="127.0.0.1")
    metrics_linger: float = flag("Seconds to keep /metrics up after the shutdown.", default=0.0)
    server_key: Path | None = flag("The coordinator's public key file (coordinator.key from `fcl-emu keys`).",
                                   default=None)
    key: Path | None = flag("This side's secret key file (gpu-workers.key_secret from `fcl-emu keys`).",
                            default=None)
    verbose: bool = flag("Log progress (INFO and up).", default=False, alias="-v")

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
