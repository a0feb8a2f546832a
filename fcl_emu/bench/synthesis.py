"""The data-free synthesis jobs (``mfcl.generator``, ``target.synthesize``, ``lander.synthesize``) timed on an
MNIST ``cnn_bn`` teacher, each run with the generator as written (``Generator.phase_conv = False``) and as
computed (phase convolutions) in turn, in one process: wall and CPU seconds and their ratios.

The limit: a third run of the fast path under ``torch.utils.flop_counter``
gives its floating-point work (convolutions and matrix products), and the
same process's 3x3-convolution peak at the same thread count
(:func:`fcl_emu.bench.jobs.peaks`) the least time that work could take here.
``bound`` is the reference's wall time over that least time: no faster path
computing the same work on this machine can beat the reference by more.

    python -m fcl_emu.bench.synthesis --data-root ../shared/data --budget 0.125 --threads 2

The budget is the generative tables' (:func:`fcl_emu.bench.synthesis_budget.synthesis_budget`, half-width
generators); ``--set '{"target.synthesize": {"student_steps": 40}}'`` overrides a job's method options.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fcl_emu.bench.jobs import count_flops, peaks
from fcl_emu.bench.synthesis_budget import CPU, synthesis_budget
from fcl_emu.methods import jobs
from fcl_emu.methods.lander import TEXT_DIM, bounding_radius
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.generators import Generator
from fcl_emu.methods.models.state import state_to_arrays
from fcl_emu.scenario.datasets import load_dataset
from fcl_emu.scenario.transforms import to_tensor

KINDS = {"mfcl.generator": "mfcl", "target.synthesize": "target", "lander.synthesize": "lander"}


def teacher(data_root: Path, classes: int, steps: int = 60, seed: int = 0):
    """A ``cnn_bn`` trained for ``steps`` SGD steps on MNIST's first ``classes`` classes (real BatchNorm
    statistics to invert), as job inputs, and the data set."""
    ds = load_dataset("mnist", [data_root])
    torch.manual_seed(seed)
    idx = np.flatnonzero(ds.train_y < classes)[:4096]
    x, y = to_tensor(ds.train_x[idx], ds.mean, ds.std), torch.from_numpy(ds.train_y[idx]).long()
    model = build_model("cnn_bn", (1, 28, 28), classes).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        b = torch.randint(0, len(x), (64,))
        loss = F.cross_entropy(model(x[b]), y[b])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model/" + k: v for k, v in state_to_arrays(model.eval()).items()}, ds


def job_inputs(kind: str, arrays: dict, classes: int) -> dict:
    if kind != "lander.synthesize":
        return arrays
    rng = np.random.default_rng(0)
    text = (rng.standard_normal((classes, TEXT_DIM)) * 0.429).astype(np.float32)
    return {**arrays, "text": text, "radius": np.float32(bounding_radius(text, 1.0)),
            "projector/weight": (rng.standard_normal((TEXT_DIM, 256)) * 0.05).astype(np.float32),
            "projector/bias": np.zeros(TEXT_DIM, np.float32)}


def timed(kind: str, inputs: dict, options: dict, reference: bool) -> tuple[float, float]:
    Generator.phase_conv = not reference
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        jobs.run(kind, inputs, options, torch.device("cpu"))
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        Generator.phase_conv = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", type=Path, required=True)
    p.add_argument("--budget", type=float, default=0.125, help="fraction of the official synthesis budgets")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--classes", type=int, default=4, help="classes the teacher knows")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--set", default="{}", help="JSON: job kind -> method options to override")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    conv_peak = peaks(torch.device("cpu"))["conv2d"]
    print(f"3x3 convolution peak, {a.threads} thread(s): {conv_peak:.1f} GFLOP/s", flush=True)
    arrays, ds = teacher(a.data_root, a.classes)
    overrides = json.loads(a.set)
    for kind in a.kinds.split(","):
        method = KINDS[kind]
        options = {"method_options": {**CPU, **synthesis_budget(method, a.budget), **overrides.get(kind, {})},
                   "model": "cnn_bn", "input_shape": [1, 28, 28], "mean": list(ds.mean), "std": list(ds.std),
                   "seed": 7}
        inputs = job_inputs(kind, arrays, a.classes)
        (rw, rc), (fw, fc) = timed(kind, inputs, options, True), timed(kind, inputs, options, False)
        gflop = count_flops(lambda: jobs.run(kind, inputs, options, torch.device("cpu"))) / 1e9
        least = gflop / conv_peak
        print(f"{kind}: reference {rw:.1f} s wall / {rc:.1f} s CPU, fast {fw:.1f} s / {fc:.1f} s: "
              f"{rw / fw:.2f}x wall, {rc / fc:.2f}x CPU; fast {gflop:.1f} GFLOP at {gflop / fw:.1f} GFLOP/s, "
              f"{100 * least / fw:.0f} % of the peak; bound {rw / least:.2f}x", flush=True)


if __name__ == "__main__":
    main()
