"""A GPU worker: one process that runs server-side jobs on one device for the coordinator (docs/gpu.md).

It connects a DEALER (identity ``gpu-worker-<index>``) to the pool's ROUTER,
says which device it owns (``worker_hello``), then runs ``job`` messages one
at a time and answers each with a ``job_result``: the output arrays, or the
error. While a job runs, its step reports go out as ``job_progress`` (at most
four a second). Everything travels in the project's wire framing; nothing received is
unpickled. A ``shutdown`` ends it; so does its parent's death (the pool starts
it with ``--parent-pid``).

The pool starts it as ``python -m fcl_emu.gpu_worker FLAGS`` (the flags of
:class:`~fcl_emu.gpu_worker.args.GpuWorkerArgs`); ``fcl-emu gpu-worker``
takes the same flags.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch
import zmq

from fcl_emu.gpu_worker.args import GpuWorkerArgs
from fcl_emu.gpu_worker.devices import check_cuda
from fcl_emu.methods import jobs
from fcl_emu.monitoring.metrics import GpuWorkerMetrics
from fcl_emu.runtime.process import exit_with_parent, fail, setup_logging, setup_process, warn_insecure
from fcl_emu.wire.framing import Limits, WireError
from fcl_emu.wire.messages import Error, JobProgress, JobResult, WorkerHello
from fcl_emu.wire.auth import ClientKeyring, KeyFileError
from fcl_emu.wire.sockets import ClientEndpoint

log = logging.getLogger("fcl_emu.gpu_worker")


WORKER_KEY_NAME = "gpu-workers"  # the grant whose key the workers share (wire/auth.py)


def worker_identity(index: int) -> str:
    return f"gpu-worker-{index}"


def worker_device(choice: str, index: int) -> torch.device:
    """``cuda``: device ``index`` modulo the visible CUDA devices; ``auto``: that, or the CPU without CUDA."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    check_cuda("--gpu-device")
    return torch.device("cuda", index % torch.cuda.device_count())


def serve(connect: str, index: int, device: str = "auto", max_message_bytes: int = 1 << 30,
          metrics: GpuWorkerMetrics | None = None, context: zmq.Context | None = None,
          keys: ClientKeyring | None = None) -> None:
    """Run jobs until a ``shutdown`` arrives. ``metrics``: counts the wire and marks the busy time (the
    caller serves it, see :func:`run_worker`); ``keys``: connect over CurveZMQ."""
    dev = worker_device(device, index)
    metrics = metrics or GpuWorkerMetrics(dev)
    identity = worker_identity(index)
    endpoint = ClientEndpoint(context or zmq.Context.instance(), connect, identity,
                              limits=Limits(max_total_bytes=max_message_bytes), count=metrics.count_message,
                              keys=None if keys is None else keys.for_identity(identity))
    endpoint.send("worker_hello", WorkerHello(index=index, device=str(dev), pid=os.getpid()))
    log.info("gpu worker %d on %s connected to %s", index, dev, connect)
    try:
        while True:
            try:
                msg = endpoint.recv()
            except WireError as exc:  # a worker runs one job at a time: the pool charges it to that job
                log.warning("gpu worker %d: rejected a message (%s)", index, exc)
                endpoint.send("error", Error(code=exc.reason, detail=f"the worker rejected the job: {exc}"[:1000]))
                continue
            if msg.type == "shutdown":
                return
            if msg.type != "job":
                log.warning("gpu worker %d: ignoring unexpected %s", index, msg.type)
                continue
            metrics.busy.set(1)
            job_id = msg.body.job_id
            result, arrays = _run(msg.body, msg.tensors, dev, lambda done, total: endpoint.send(
                "job_progress", JobProgress(job_id=job_id, done=done, total=total)))
            metrics.busy.set(0)
            endpoint.send("job_result", result, tensors=arrays)
    finally:
        endpoint.close(linger_ms=1000)


def _run(request, inputs, device: torch.device, on_step: jobs.StepHook) -> tuple[JobResult, dict]:
    """The result message of one job (body, output tensors); never raises for a failing job. ``on_step`` hears
    its step reports."""
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        out = jobs.run(request.kind, inputs, request.options, device, on_step)
    except Exception as exc:  # reported to the coordinator with its type and message
        log.exception("job %d (%s) failed", request.job_id, request.kind)
        return JobResult(job_id=request.job_id, ok=False, error=f"{type(exc).__name__}: {exc}"[:1000],
                         run_s=time.perf_counter() - start), {}
    metrics = {k: float(v) for k, v in out.metrics.items()}
    if device.type == "cuda":
        metrics["peak_memory_bytes"] = float(torch.cuda.max_memory_allocated(device))
    return JobResult(job_id=request.job_id, ok=True, run_s=time.perf_counter() - start, metrics=metrics), \
        out.arrays


def run_worker(args: GpuWorkerArgs) -> int:
    """Run the worker of ``args`` until the pool's shutdown; its exit code (1 after one error line for an unreadable
    key)."""
    if args.parent_pid is not None:
        exit_with_parent(args.parent_pid)
    keys = None
    if args.server_key is None:
        warn_insecure()
    else:
        try:
            keys = ClientKeyring(args.server_key, args.key)
        except KeyFileError as exc:
            return fail(str(exc))
    setup_logging(args.verbose)
    metrics = GpuWorkerMetrics(worker_device(args.device, args.index))
    serving = args.metrics_port is not None and metrics.serve_as_aid(args.metrics_port, args.metrics_host, log)
    serve(args.connect, args.index, args.device, metrics=metrics, keys=keys)
    if serving:
        time.sleep(args.metrics_linger)  # a last scrape sees the end
        metrics.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fcl_emu.gpu_worker FLAGS``."""
    setup_process()
    return run_worker(GpuWorkerArgs.from_argv(argv))
