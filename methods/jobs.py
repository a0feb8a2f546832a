"""Server-side jobs: heavy work a method hands to the coordinator's GPU worker pool (docs/gpu.md).

A job is a plain function registered under a kind::

    @job("mfcl.generator")
    def train_generator(inputs: Arrays, options: dict, device: torch.device) -> JobOutput: ...

It takes numpy arrays (what travels in the wire's tensor frames) and JSON-like
options, runs on the worker's device, and returns arrays plus scalar metrics.
It must not keep state between calls: a job may be retried on another worker.
Bad inputs raise an exception; its type and message go back to the
coordinator as the job's error.

A job's loop says how far it is with :func:`step` (``jobs.step(done, total)``, rate-limited here): the
coordinator's progress display shows it (``server job: generator 120/200``). A server part runs a job with
``ctx.run_job(kind, inputs, options)``
(:class:`fcl_emu.methods.base.ServerContext`); the coordinator keeps serving its
clients meanwhile. The job modules are imported by kind prefix, so a worker
process knows every kind the method modules define.
"""

from __future__ import annotations

import contextvars
import importlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

Arrays = dict[str, np.ndarray]


@dataclass
class JobOutput:
    arrays: Arrays = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


JobFunction = Callable[[Mapping[str, np.ndarray], Mapping[str, Any], torch.device], JobOutput]
StepHook = Callable[[int, int], None]  # (steps done, steps in all), as a job reports them
SampleInputs = Callable[[tuple[int, int, int], int], Arrays]  # (input shape (C, H, W), classes) -> inputs

STEP_INTERVAL_S = 0.25  # a job's steps are passed on at most this often

_JOBS: dict[str, JobFunction] = {}
_LABELS: dict[str, str] = {}  # kind -> what the job makes, in a word or two (the progress display, events)
_SAMPLES: dict[str, SampleInputs] = {}  # kind -> a sample of its inputs (sample_inputs)

def _module(prefix: str) -> str | None:
    """The module that registers the jobs ``<prefix>.*`` (imported on first use, by workers too): a built-in
    method's own module, or this one for ``device.*``."""
    from fcl_emu.methods.registry import BUILTIN

    return __name__ if prefix == "device" else f"fcl_emu.methods.{prefix}" if prefix in BUILTIN else None


def job(kind: str, label: str | None = None,
        sample: SampleInputs | None = None) -> Callable[[JobFunction], JobFunction]:
    """Register a job function under ``kind``; ``label``: what the job makes, for users (default: the part of
    ``kind`` after the dot); ``sample``: builds inputs of the kind the method's server part hands the job
    (:func:`sample_inputs`; none: the job takes no arrays)."""
    def register(fn: JobFunction) -> JobFunction:
        if kind in _JOBS and _JOBS[kind] is not fn:
            raise ValueError(f"job kind {kind!r} registered twice")
        _JOBS[kind] = fn
        _LABELS[kind] = label or kind.partition(".")[2] or kind
        if sample is not None:
            _SAMPLES[kind] = sample
        return fn
    return register


def sample_inputs(kind: str, input_shape: tuple[int, int, int], classes: int) -> Arrays:
    """Inputs of the kind a run hands job ``kind``, for a model of ``classes`` classes on images of
    ``input_shape`` (C, H, W), built from fixed seeds (the same arrays every call): what ``fcl-emu bench jobs``
    profiles a job on, without knowing how the method builds them. A job that takes no arrays: ``{}``."""
    get(kind)
    sample = _SAMPLES.get(kind)
    return {} if sample is None else sample(tuple(input_shape), classes)


def kinds(prefix: str) -> dict[str, JobFunction]:
    """The job kinds ``<prefix>.*`` (a method's name: its server-side jobs), their module imported."""
    module = _module(prefix)
    if module is not None:
        importlib.import_module(module)
    return {kind: fn for kind, fn in sorted(_JOBS.items()) if kind.startswith(prefix + ".")}


def label(kind: str) -> str:
    """What a job of ``kind`` makes (``proxy``, ``generator``, ``fusion``...), as registered with :func:`job`."""
    try:
        get(kind)
    except KeyError:
        return kind.partition(".")[2] or kind
    return _LABELS[kind]


def get(kind: str) -> JobFunction:
    module = _module(kind.split(".", 1)[0])
    if module is not None:
        importlib.import_module(module)
    try:
        return _JOBS[kind]
    except KeyError:
        raise KeyError(f"unknown job kind {kind!r}; known: {', '.join(sorted(_JOBS)) or 'none'}") from None


@contextmanager
def torch_threads(threads: int = 1) -> Iterator[None]:
    """Torch at ``threads`` intra-op CPU threads for the block, the process's count restored after. One thread
    while a job works on many tiny tensors (one image at a time): splitting such ops across threads only adds
    synchronisation, and on a loaded host the threads' spinning makes them many times slower (GLFC's CIFAR-10
    reconstruction: 3.5 s with one thread, 260 s with two beside four busy processes on two cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Cancelled(Exception):
    """Raised by :func:`step` in a job whose runner has given up on it (the run is ending)."""


class _Steps:
    """Passes a running job's steps to its hook, at most every :data:`STEP_INTERVAL_S`."""

    def __init__(self, hook: StepHook):
        self.hook, self.last = hook, -math.inf

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= STEP_INTERVAL_S:
            self.last = now
            self.hook(done, total)


_steps: contextvars.ContextVar[_Steps | None] = contextvars.ContextVar("job_steps", default=None)


def step(done: int, total: int) -> None:
    """A job's loop has done ``done`` of its ``total`` steps: passed on (rate-limited) to whoever runs the job,
    :func:`run`'s ``on_step``; nothing happens when nobody listens. The hook may raise :class:`Cancelled` to end
    the job at this step."""
    steps = _steps.get()
    if steps is not None:
        steps(int(done), int(total))


def run(kind: str, inputs: Mapping[str, np.ndarray], options: Mapping[str, Any], device: torch.device,
        on_step: StepHook | None = None) -> JobOutput:
    """Run one job here (a worker's loop, or the coordinator itself without workers); ``on_step`` hears the
    job's :func:`step` reports, at most every :data:`STEP_INTERVAL_S`."""
    token = _steps.set(None if on_step is None else _Steps(on_step))
    try:
        out = get(kind)(inputs, options, device)
    finally:
        _steps.reset(token)
    if not isinstance(out, JobOutput):
        raise TypeError(f"job {kind!r} returned {type(out).__name__}, not a JobOutput")
    return out


@job("device.matmul", label="device check")
def matmul_burn(inputs: Mapping[str, np.ndarray], options: Mapping[str, Any], device: torch.device) -> JobOutput:
    """Square float32 matrix products on the device for ``seconds`` (default 1): the worker's health check
    and throughput probe (``size``, default 1024). Returns the achieved GFLOP/s and the product count."""
    seconds, size = float(options.get("seconds", 1.0)), int(options.get("size", 1024))
    if not 0 < seconds <= 3600 or not 1 <= size <= 16384:
        raise ValueError(f"device.matmul: seconds must be in (0, 3600] and size in [1, 16384], got "
                         f"seconds={seconds}, size={size}")
    gen = torch.Generator(device="cpu").manual_seed(int(options.get("seed", 0)))
    a = torch.randn(size, size, generator=gen).to(device)
    b = a.clone()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        step(int(100 * elapsed / seconds), 100)  # percent of its time
        b = torch.tanh(a @ b)  # tanh keeps the values bounded over many products
        count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return JobOutput({"checksum": np.asarray([float(b.float().mean())], np.float32)},
                     {"products": float(count), "gflops": 2.0 * size**3 * count / elapsed / 1e9})
