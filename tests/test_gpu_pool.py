"""The coordinator's GPU worker pool: real worker processes over ZeroMQ, jobs in the wire framing.

A long job must not stop the coordinator from serving its clients; a failing, hanging or orphaned job
ends with its error (after its retries), never in a hang. CUDA workers are exercised where CUDA exists.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import psutil
import pytest
import torch
import zmq

from fcl_emu.coordinator.gpu_pool import Job, _LocalRunner
from fcl_emu.coordinator.contracts import JobFailed
from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.runconfig import load_config
from fcl_emu.methods import jobs
from fcl_emu.monitoring.results import RunSummary
from tests.conftest import events, fcl_emu, keyed, small_config

pytestmark = pytest.mark.slow


def coordinator_with(tmp_path, mnist_root, **gpu) -> Coordinator:
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 20},
                                      gpu={"device": "cpu", **gpu}), {"data_root": [str(mnist_root)]})
    config, node_keys = keyed(config, tmp_path / "keys")
    coordinator = Coordinator(config)
    coordinator.pool.start(tmp_path / "logs")
    coordinator.node_keys = node_keys  # for the tests' edge nodes
    return coordinator


# 6 s: three times the liveness timeout, so a coordinator that stopped serving would drop every client
@pytest.mark.parametrize("workers, seconds", [(1, 6.0), (0, 6.0)])
def test_clients_stay_alive_while_a_long_job_runs(tmp_path, mnist_root, workers, seconds):
    """Heartbeats every 0.3 s, liveness timeout 2 s: a job of `seconds` would kill every client if the
    coordinator stopped serving them meanwhile."""
    coordinator = coordinator_with(tmp_path, mnist_root, workers=workers)
    node = fcl_emu("node", "--connect", coordinator.address, "--clients", "0-19", "--data-root", str(mnist_root),
                   *coordinator.node_keys)
    try:
        coordinator._wait_for_clients()
        beats = coordinator.state.counters.messages.get(("heartbeat", "received"), 0)
        job = coordinator.run_job("device.matmul", {}, {"seconds": seconds, "size": 128})
        assert job.ok and job.run_s >= seconds and job.worker == ("gpu-worker-0" if workers else "coordinator")
        assert job.metrics["products"] > 0 and job.outputs["checksum"].shape == (1,)
        assert coordinator.registry.counts.dropped == 0 and len(coordinator.registry.online()) == 20
        served = coordinator.state.counters.messages[("heartbeat", "received")] - beats
        assert served >= 20 * seconds / 0.3 * 0.7, served  # every client's heartbeats, all along
    finally:
        coordinator._shutdown("test over")
        node.wait(timeout=30)
        coordinator.close()


@pytest.mark.parametrize("workers", [1, 0])
def test_a_job_s_steps_reach_the_coordinator_s_progress_while_it_runs(tmp_path, mnist_root, workers):
    """A 1.5 s device check reports the percent of its time done (``jobs.step``): from a worker process as
    ``job_progress`` messages, or from the coordinator's thread; the coordinator shows each new count while it
    waits, as ``server_job_step``."""
    coordinator = coordinator_with(tmp_path, mnist_root, workers=workers)
    heard = []
    coordinator.progress = lambda kind, info: heard.append((kind, info))
    try:
        job = coordinator.run_job("device.matmul", {}, {"seconds": 1.5, "size": 64})
        assert job.ok and job.worker == ("gpu-worker-0" if workers else "coordinator")
    finally:
        coordinator.close()
    steps = [(info["step"], info["steps"]) for kind, info in heard if kind == "server_job_step"]
    assert [kind for kind, _ in heard][0] == "server_job_start" and [kind for kind, _ in heard][-1] == "server_job_end"
    assert len(steps) >= 3 and all(total == 100 for _, total in steps), steps  # 4 reports a second at most
    assert [done for done, _ in steps] == sorted(done for done, _ in steps) and steps[-1][0] > 50
    assert all(info["kind"] == "device check" for kind, info in heard if kind == "server_job_step")


def test_a_failing_job_reports_its_error_after_its_retries(tmp_path, mnist_root):
    coordinator = coordinator_with(tmp_path, mnist_root, workers=1, retries=1)
    try:
        with pytest.raises(JobFailed) as info:
            coordinator.run_job("device.matmul", {}, {"seconds": -1})
        message = str(info.value)
        assert "attempt 1: ValueError: device.matmul: seconds must be" in message and "attempt 2:" in message
        with pytest.raises(KeyError, match="unknown job kind 'nope.job'"):
            coordinator.run_job("nope.job", {})
        with pytest.raises(JobFailed, match="non_finite|NaN"):  # inputs are checked on the wire like updates
            coordinator.run_job("device.matmul", {"x": np.full(3, np.nan, np.float32)}, {"seconds": 0.1})
        ok = coordinator.run_job("device.matmul", {}, {"seconds": 0.2, "size": 64})  # the worker lives on
        assert ok.ok and ok.attempts == 1
        exposition = coordinator.metrics.exposition().decode()
        assert 'fcl_gpu_jobs_total{kind="device.matmul",outcome="failed"} 2.0' in exposition
        assert 'fcl_gpu_jobs_total{kind="device.matmul",outcome="ok"} 1.0' in exposition
    finally:
        coordinator.close()


def test_a_killed_worker_is_started_again_and_its_job_retried(tmp_path, mnist_root):
    coordinator = coordinator_with(tmp_path, mnist_root, workers=1, retries=1)
    try:
        coordinator.run_job("device.matmul", {}, {"seconds": 0.1, "size": 64})  # the worker is up
        pid = coordinator.pool._workers[0].proc.pid
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        job = coordinator.run_job("device.matmul", {}, {"seconds": 3, "size": 64})
        assert job.ok and job.attempts == 2
        assert "exited with code -9" in job.errors[0]
        assert coordinator.pool._workers[0].proc.pid != pid
    finally:
        coordinator.close()


def test_a_job_past_its_timeout_is_killed_and_fails(tmp_path, mnist_root):
    coordinator = coordinator_with(tmp_path, mnist_root, workers=1, job_timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(JobFailed, match="timed out after 1 s"):
            coordinator.run_job("device.matmul", {}, {"seconds": 60, "size": 64})
        assert time.monotonic() - started < 30  # not the job's 60 s
        assert coordinator.run_job("device.matmul", {}, {"seconds": 0.1, "size": 64}).ok  # a fresh worker
    finally:
        coordinator.close()


def up_with_workers(tmp_path, mnist_root, workers: int, **overrides) -> tuple[int, int, dict]:
    """Run `fcl-emu up` with CPU workers: (its pid, exit code, summary)."""
    run_dir = tmp_path / "run"
    proc = fcl_emu("up", "--config", str(small_config(tmp_path / "c.yaml", **overrides)), "--data-root",
                   str(mnist_root), "--run-dir", str(run_dir), "--gpu-workers", str(workers), "--gpu-device", "cpu")
    code = proc.wait(timeout=240)
    return proc.pid, code, RunSummary.load(run_dir / "summary.json")


def test_a_run_with_workers_records_its_jobs(tmp_path, mnist_root):
    """A whole `up` run with two workers: the summary and the events carry the pool's jobs (the device
    check of each worker; the baselines have no server-side job), and the workers end with the run."""
    pid, code, summary = up_with_workers(tmp_path, mnist_root, 2, rounds={"rounds_per_task": 1})
    run_dir = tmp_path / "run"
    assert code == 0
    gpu = summary.gpu_jobs
    assert (gpu.workers, gpu.device) == (2, "cpu")
    probe = gpu.by_kind["device.matmul"]  # each worker's device is checked before the run
    assert (probe.jobs, probe.failed) == (2, 0) and probe.run_s >= 0.4
    recorded = [e for e in events(run_dir) if e["event"] == "job"]
    assert len(recorded) == 2 and all(e["ok"] and e["metrics"]["gflops"] > 0 for e in recorded)
    assert sorted(p.name for p in (run_dir / "logs").glob("gpu-worker-*.log")) == ["gpu-worker-0.log",
                                                                                  "gpu-worker-1.log"]
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if "fcl_emu.gpu_worker" in (p.info["cmdline"] or [])
                 and str(pid) in p.info["cmdline"]]
    assert not leftovers  # the workers ended with the run


def test_a_failed_job_ends_the_run_cleanly(tmp_path, mnist_root):
    """The device check cannot finish within a 0.05 s job timeout: the run stops with the job's error in its
    summary, exit code 1, before any client trains."""
    _, code, summary = up_with_workers(tmp_path, mnist_root, 1, gpu={"job_timeout_s": 0.05})
    assert code == 1
    assert summary.status.startswith("aborted: server-side job 'device.matmul' failed: attempt 1: timed out")
    assert summary.rounds == 0 and summary.gpu_jobs.by_kind["device.matmul"].failed == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU path is tested above)")
def test_cuda_worker_runs_on_the_gpu():
    out = jobs.run("device.matmul", {}, {"seconds": 0.5}, torch.device("cuda", 0))
    assert out.metrics["gflops"] > 0


def test_closing_the_in_process_runner_cancels_its_job_at_the_next_step():
    """An interrupted run closes the pool while a job runs in the coordinator's thread: the job ends at its next
    step report and the thread is joined (torch left running in a thread at interpreter exit aborts)."""
    context = zmq.Context()
    runner = _LocalRunner(context, torch.device("cpu"))
    job = Job(id=1, kind="device.matmul", inputs={}, options={"seconds": 60, "size": 64})
    runner.start(job)
    deadline = time.monotonic() + 30
    while job.steps is None and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    runner.close()
    assert time.monotonic() - start < 5 and not runner._thread.is_alive()
    _, ok, error, _ = runner._result
    assert not ok and "cancelled" in error
    context.term()
