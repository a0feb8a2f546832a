"""Server-side jobs (generator training, proxy inversion, VAE fusion...) run on the GPU worker pool while the
coordinator keeps serving its clients. Each finished job is a ``job`` event and counts in the summary; each call
(one or several jobs side by side) is a ``server_job`` event, and the progress display hears when it starts and
ends (``server_job_start``, ``server_job_end``) and, in between, each new step count the jobs report
(``server_job_step``: their steps done and in all, summed over the jobs side by side)."""

from __future__ import annotations

import time

import numpy as np

from fcl_emu.coordinator.clock import Serve
from fcl_emu.coordinator.contracts import JobFailed
from fcl_emu.coordinator.gpu_pool import Job, WorkerPool
from fcl_emu.coordinator.state import RunState
from fcl_emu.methods import jobs

JobSpec = tuple[str, dict[str, np.ndarray], dict | None]  # (kind, inputs, options)


class ServerJobs:
    """Submit jobs to ``pool`` and serve the socket (``serve``) until they are done."""

    def __init__(self, state: RunState, pool: WorkerPool, serve: Serve):
        self.state, self.pool, self.serve = state, pool, serve
        self.finished: list[Job] = []  # for the summary

    def run(self, specs: list[JobSpec]) -> list[Job]:
        """Run jobs side by side (as many at once as there are workers) and wait for them while serving the
        clients. Raises :class:`JobFailed` if any failed after its retries."""
        state = self.state
        kinds = list(dict.fromkeys(kind for kind, _, _ in specs))
        where = self.pool.device if state.config.gpu.workers == 0 else f"GPU workers ({self.pool.device})"
        about = {"kind": ", ".join(dict.fromkeys(jobs.label(k) for k in kinds)), "jobs": kinds, "task": state.task,
                 "round": state.global_round, "device": where}
        start = None if state.recorder is None else state.recorder.elapsed()
        t0 = time.perf_counter()
        state.progress("server_job_start", about)
        submitted = [self.pool.submit(kind, inputs, options) for kind, inputs, options in specs]
        shown: tuple[int, int] | None = None

        def over() -> bool:  # asked each time the serve loop wakes (at least 5 times a second)
            nonlocal shown
            steps = _steps(submitted)
            if steps is not None and steps != shown:
                shown = steps
                state.progress("server_job_step", {**about, "step": steps[0], "steps": steps[1]})
            return all(j.done for j in submitted)

        self.serve(over, time.monotonic() + 10**9)  # the pool's timeouts end them
        duration_s = round(time.perf_counter() - t0, 4)
        for job in submitted:
            self.finished.append(job)
            state.event("job", id=job.id, job_kind=job.kind, ok=job.ok, worker=job.worker,
                        attempts=job.attempts, queue_s=job.queue_s, run_s=job.run_s,
                        error=job.error or None, metrics=job.metrics)
        failed = [j for j in submitted if not j.ok]
        state.event("server_job", **about, start=start,
                    end=None if state.recorder is None else state.recorder.elapsed(), duration_s=duration_s,
                    ok=not failed)
        state.progress("server_job_end", {**about, "duration_s": duration_s, "ok": not failed})
        if failed:
            raise JobFailed("; ".join(f"server-side job {j.kind!r} failed: {j.error}" for j in failed))
        return submitted


def _steps(submitted: list[Job]) -> tuple[int, int] | None:
    """The steps done and in all of the jobs that reported any (a finished job's all done); None before any
    did."""
    reported = [(job.done, job.steps) for job in submitted if job.steps is not None]  # read once: a thread writes it
    if not reported:
        return None
    return sum(total if over else done for over, (done, total) in reported), sum(t for _, (_, t) in reported)
