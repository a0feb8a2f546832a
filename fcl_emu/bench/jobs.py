"""``fcl-emu bench jobs``: every server-side job kind on a small budget, its floating-point work and speed
against this machine's own measured peak.

Each job kind the methods register (``methods.jobs.kinds``) runs on
the inputs its method samples for MNIST's shape (``methods.jobs.sample_inputs``: 28x28 grey
images; 10 classes, or ``classes``) for
``budget`` steps of its own unit (epochs, L-BFGS steps, generator
iterations, synthesis rounds). Its floating-point work is counted by
``torch.utils.flop_counter.FlopCounterMode`` on runs of one and two steps:
their difference is one step's work, the rest a fixed part, and the total
is ``fixed + step x budget`` (the counter sees matrix products and
convolutions, forward and backward, not elementwise work). The timed run is
a separate one at the full budget, without the counter. Jobs whose
reference path is kept (``fedcbc.fuse`` and ``glfc.proxy``: ``sequential``)
are timed both ways on the same inputs; ``repeat`` times each, in turn, the
median reported (the speed of a virtual machine drifts over minutes).

The limit is the machine's own: a dense float32 matrix product and a
float32 3x3 convolution, timed in the same run at the same thread count;
each job is set against the one its work is mostly made of. A kind that
cannot run here (an optional package missing, no CUDA) is a row with the
reason.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from torch.utils.flop_counter import FlopCounterMode

from fcl_emu.bench.report import emit
from fcl_emu.gpu_worker import no_cuda
from fcl_emu.methods import jobs, registry

SHAPE = (1, 28, 28)
CLASSES = 10  # the inputs' classes by default (MNIST's); `--classes`
MEAN, STD = [0.1307], [0.3081]
COLUMNS = ["kind", "variant", "device", "threads", "classes", "budget", "unit", "wall_s", "gflop", "gflops",
           "dominant_op", "peak_gflops", "peak_pct", "note"]


@dataclass
class Profile:
    """How to run one job kind: its options for a budget, what one step is (its inputs are the method's sample,
    ``methods.jobs.sample_inputs``)."""
    options: Callable[[int, int], dict[str, Any]]  # (steps, classes) -> options
    budget: int
    unit: str
    dominant: str  # "matmul" or "conv2d": the op its work is mostly made of
    variants: dict[str, dict[str, Any]] = field(default_factory=lambda: {"": {}})
    work: Callable[[jobs.JobOutput], float] | None = None  # steps the job reports doing, where not the budget


def _common(method_options: dict[str, Any], classes: int) -> dict[str, Any]:
    return {"method_options": method_options, "model": "cnn_bn", "input_shape": list(SHAPE), "mean": MEAN,
            "std": STD, "num_classes": classes, "seed": 0}


# the synthesis jobs' rounds cut to a few steps each (their defaults take minutes per round on a small CPU)
_SYNTHESIS = {"generator_steps": 2, "student_steps": 4, "synthesis_batch": 64, "warmup": 1}

PROFILES: dict[str, Profile] = {
    "device.matmul": Profile(lambda n, k: {"seconds": 0.25 * n, "size": 512}, 2, "x 0.25 s", "matmul",
                             work=lambda out: out.metrics["products"]),
    "fedcbc.pretrain": Profile(lambda n, k: {**_common({"pretrain_epochs": n}, k), "model": "cnn"},
                               2, "epochs", "conv2d"),
    "fedcbc.fuse": Profile(lambda n, k: {"method_options": {"fusion_epochs": n, "decoder_output": "sigmoid"},
                                         "feature_dim": int(np.prod(SHAPE)), "seed": 0},
                           3, "epochs", "matmul", {"batched": {}, "sequential": {"sequential": True}}),
    "glfc.proxy": Profile(lambda n, k: {**_common({"proxy_iterations": n, "proxy_keep": min(n, 3)}, k), "model": "cnn"},
                          3, "L-BFGS steps", "conv2d", {"batched": {}, "sequential": {"sequential": True}}),
    "mfcl.generator": Profile(lambda n, k: _common({"generator_iterations": n}, k), 4, "iterations", "conv2d"),
    "target.synthesize": Profile(lambda n, k: _common({**_SYNTHESIS, "synthesis_rounds": n + 1}, k), 2,
                                 "rounds", "conv2d"),
    "lander.synthesize": Profile(lambda n, k: _common({**_SYNTHESIS, "synthesis_rounds": n + 1}, k), 2,
                                 "rounds", "conv2d"),
    "lander.text_embeddings": Profile(lambda n, k: {"names": [str(i) for i in range(k * n)],
                                                    "prompt": "a photo of a {}"},
                                      1, "x classes' names", "matmul"),
}


# ------------------------------------------------------------------ measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def peaks(device: torch.device, seconds: float = 0.2, windows: int = 5) -> dict[str, float]:
    """GFLOP/s of a dense 1024 x 1024 float32 matrix product and of a float32 3x3 convolution (batch 64,
    64 -> 64 channels, 28x28): the best of ``windows`` windows of ``seconds`` each after a warm-up (on a
    shared or virtual machine single windows vary by a third)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 1024, generator=gen).to(device)
    x = torch.randn(64, 64, 28, 28, generator=gen).to(device)
    w = torch.randn(64, 64, 3, 3, generator=gen).to(device)
    out = {}
    for name, op in (("matmul", lambda: a @ a), ("conv2d", lambda: F.conv2d(x, w, padding=1))):
        flops = count_flops(op)
        op()
        _sync(device)
        best = 0.0
        for _ in range(windows):
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                op()
                count += 1
            _sync(device)
            best = max(best, flops * count / (time.perf_counter() - start) / 1e9)
        out[name] = best
    return out


def profile_job(kind: str, profile: Profile, budget: int, variant: dict[str, Any], inputs: dict[str, np.ndarray],
                device: torch.device, classes: int = CLASSES) -> Callable[[], tuple[float, float]]:
    """Counts the FLOPs of ``kind`` on runs of one and two steps and returns a function that times one run at
    ``budget`` steps: ``(wall seconds, FLOPs)`` (for a job that reports its steps, one counted run's FLOPs per
    reported step times the timed run's steps)."""
    def run(steps: int) -> jobs.JobOutput:
        return jobs.run(kind, inputs, {**profile.options(steps, classes), **variant}, device)

    counted: list[jobs.JobOutput] = []
    one, two = (count_flops(lambda: counted.append(run(n))) for n in (1, 2))
    step = max(two - one, 0)

    def timed() -> tuple[float, float]:
        _sync(device)
        start = time.perf_counter()
        out = run(budget)
        _sync(device)
        wall = time.perf_counter() - start
        if profile.work is not None:
            return wall, two / profile.work(counted[1]) * profile.work(out)
        return wall, float((one - step) + step * budget)
    return timed


def run(devices: list[str], scale: float, kinds: list[str] | None, threads: int, csv_path: Path,
        json_path: Path | None, console: Console, repeat: int = 1, classes: int = CLASSES) -> dict:
    known = sorted({k for prefix in ("device", *registry.BUILTIN) for k in jobs.kinds(prefix)})
    unknown = sorted(set(kinds or []) - set(known))
    if unknown:
        raise ValueError(f"unknown job kind {', '.join(unknown)}; known: {', '.join(known)}")
    rows: list[dict[str, Any]] = []
    with jobs.torch_threads(threads):
        for name in devices:
            device = torch.device(name)
            missing = no_cuda("--device", "cpu") if device.type == "cuda" else None
            if missing:
                rows += [_row(k, "", name, threads, 0, "", note=f"skipped: {missing}") for k in kinds or known]
                continue
            limit = peaks(device)
            console.print(f"{name}: peak matmul {limit['matmul']:.1f} GFLOP/s, conv2d {limit['conv2d']:.1f} GFLOP/s "
                          f"at {threads} thread(s)")
            for kind in kinds or known:
                rows += _profile_kind(kind, device, scale, threads, limit, console, repeat, classes)
    for row in rows:
        row["classes"] = classes
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return emit("jobs", rows, {"speed-up, sequential / batched": speedups(rows), "csv": str(csv_path)}, json_path,
                console)


def _profile_kind(kind: str, device: torch.device, scale: float, threads: int, limit: dict[str, float],
                  console: Console, repeat: int, classes: int) -> list[dict[str, Any]]:
    """One row per path of ``kind``; with ``repeat`` > 1 the paths are timed in turn ``repeat`` times (a
    virtual machine's speed drifts by a third over minutes) and each row is its path's median run."""
    profile = PROFILES.get(kind)
    if profile is None:
        return [_row(kind, "", device.type, threads, 0, "", note="skipped: the bench has no profile of this kind")]
    budget = max(1, round(profile.budget * scale))
    try:
        inputs = jobs.sample_inputs(kind, SHAPE, classes)
    except ImportError as exc:
        return [_row(kind, "", device.type, threads, budget, profile.unit, note=f"skipped: {exc}")]
    rows, timers = {}, {}
    for variant, extra in profile.variants.items():
        console.print(f"  {kind} {variant}".rstrip() + f": {budget} {profile.unit}", highlight=False)
        try:
            timers[variant] = profile_job(kind, profile, budget, extra, inputs, device, classes)
        except (ImportError, RuntimeError) as exc:  # an optional package the job needs
            rows[variant] = _row(kind, variant, device.type, threads, budget, profile.unit,
                                 note=f"skipped: {str(exc).splitlines()[0]}")
    runs: dict[str, list[tuple[float, float]]] = {variant: [] for variant in timers}
    for _ in range(repeat):
        for variant, timed in timers.items():
            runs[variant].append(timed())
    for variant, measured in runs.items():
        wall, flops = sorted(measured)[len(measured) // 2]
        gflops = flops / wall / 1e9
        peak = limit[profile.dominant]
        walls = [w for w, _ in measured]
        note = f"median of {repeat}: {min(walls):.3g}-{max(walls):.3g} s" if repeat > 1 else ""
        rows[variant] = _row(kind, variant, device.type, threads, budget, profile.unit, wall_s=round(wall, 3),
                             gflop=round(flops / 1e9, 3), gflops=round(gflops, 2), dominant_op=profile.dominant,
                             peak_gflops=round(peak, 1), peak_pct=round(100 * gflops / peak, 1), note=note)
    return [rows[variant] for variant in profile.variants]


def _row(kind: str, variant: str, device: str, threads: int, budget: int, unit: str, **values: Any) -> dict[str, Any]:
    row = {"kind": kind, "variant": variant, "device": device, "threads": threads, "budget": budget, "unit": unit}
    return {c: row.get(c, values.get(c, "")) for c in COLUMNS}


def speedups(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``sequential`` wall time over ``batched`` per kind and device, where both ran."""
    walls = {(r["kind"], r["device"], r["variant"]): r["wall_s"] for r in rows if r["wall_s"] != ""}
    return {f"{k} ({d})": round(walls[(k, d, "sequential")] / walls[(k, d, "batched")], 2)
            for k, d, v in walls if v == "batched" and (k, d, "sequential") in walls
            and not math.isclose(walls[(k, d, "batched")], 0)}

