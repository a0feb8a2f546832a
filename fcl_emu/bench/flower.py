"""``fcl-emu bench flower``: fcl-emu and Flower's simulation engine side by side on the same FedAvg workload.

The workload, the same on both sides: MNIST, N clients holding the IID shards of fcl-emu's scenario (one task
with every class, the run's seed: both sides train on exactly the same samples), K clients per round, R rounds,
E local epochs of SGD (batch 32, lr 0.05, no momentum, no weight decay), the small CNN of
:mod:`fcl_emu.methods.models.classifier` (``cnn``) with a 10-way head, inputs normalised with the dataset's mean and
standard deviation, and an evaluation of the global model on the whole MNIST test set after every round.

- fcl-emu: ``python -m fcl_emu up`` with that configuration (coordinator and two edge-node processes, its
  default CurveZMQ transport);
- Flower: :mod:`fcl_emu.bench.flower_simulation` in a subprocess in Flower's environment
  (:mod:`fcl_emu.bench.flower_env`): ``flwr.simulation.start_simulation`` (Ray backend, one CPU per client actor,
  two CPUs in all) with ``FedAvg`` (``fraction_fit = K / N``) and a central ``evaluate_fn`` on the test set.

Each side is timed from its process start to its exit, and its memory is the peak over time of the
proportional set size (PSS: shared pages split between the processes that map them) summed over the process
and all its descendants (edge nodes; Ray's GCS, raylet and workers), sampled every half second. Reported per
point: both wall clocks and peak memories, the ratios fcl-emu / Flower, and both final accuracies (the
workloads are seen to match when they agree).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml
from rich.console import Console

from fcl_emu.bench.flower_env import FlowerPython, module_command
from fcl_emu.bench.flower_simulation import BATCH, LR, SEED
from fcl_emu.bench.report import emit
from fcl_emu.launchers.process import node_env
from fcl_emu.monitoring.results import RunSummary

DEFAULT_POINTS = ((100, 10), (300, 30))


class TreeMemory(threading.Thread):
    """Peak of the PSS summed over a process and its descendants, sampled every ``interval_s``."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        super().__init__(daemon=True)
        self.root, self.interval_s, self.peak = pid, interval_s, 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                root = psutil.Process(self.root)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_full_info().pss
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def measured(command: list[str], log: Path, timeout_s: float) -> tuple[float, int, int]:
    """Run ``command``; (wall seconds, peak PSS bytes of its process tree, exit code)."""
    with open(log, "wb") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=node_env())
        memory = TreeMemory(proc.pid)
        memory.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        wall = time.perf_counter() - started
        memory.stop()
    return wall, memory.peak, code


def fcl_emu_config(clients: int, cohort: int, rounds: int, epochs: int, data_root: list[Path]) -> dict:
    return {
        "scenario": {"dataset": "mnist", "num_tasks": 1, "num_clients": clients, "partition": "iid", "seed": SEED},
        "rounds": {"clients_per_round": cohort, "rounds_per_task": rounds, "eval_every": 1},
        "training": {"local_epochs": epochs, "batch_size": BATCH, "lr": LR, "momentum": 0.0, "weight_decay": 0.0},
        # one torch thread in every process, as on Flower's side (its driver evaluates with one thread)
        "model": "cnn", "device": "cpu", "nodes": 2, "seed": SEED, "coordinator_threads": 1,
        "data_root": [str(p) for p in data_root],
    }


def point(clients: int, cohort: int, rounds: int, epochs: int, data_root: list[Path], work: Path,
          flower: FlowerPython) -> dict:
    """Both sides on one (N, K) point, Flower's with the interpreter of its environment."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / "fcl-emu.yaml"
    config.write_text(yaml.safe_dump(fcl_emu_config(clients, cohort, rounds, epochs, data_root)))
    run_dir = work / "fcl-emu-run"
    ours = measured([sys.executable, "-m", "fcl_emu", "up", "--config", str(config), "--run-dir", str(run_dir)],
                    work / "fcl-emu.log", 1800)
    summary = RunSummary.load(run_dir / "summary.json")
    result = work / "flower.json"
    flower_args = ["--clients", str(clients), "--cohort", str(cohort), "--rounds", str(rounds), "--epochs",
                   str(epochs), "--out", str(result), *[a for root in data_root for a in ("--data-root", str(root))]]
    theirs = measured(module_command(flower, "fcl_emu.bench.flower_simulation", flower_args), work / "flower.log",
                      1800)
    if theirs[2] != 0 or not result.exists():
        raise RuntimeError(f"the Flower simulation failed (exit {theirs[2]}): see {work / 'flower.log'}")
    accuracy = json.loads(result.read_text())["accuracy"]
    return {
        "clients": clients, "cohort": cohort, "rounds": rounds,
        "fcl_emu_s": ours[0], "flower_s": theirs[0], "wall_ratio": ours[0] / theirs[0],
        "fcl_emu_pss_gb": ours[1] / 1e9, "flower_pss_gb": theirs[1] / 1e9, "memory_ratio": ours[1] / theirs[1],
        "fcl_emu_accuracy": summary.accuracy_seen[-1], "flower_accuracy": accuracy,
        "fcl_emu_status": summary.status,
    }


def run(points: list[tuple[int, int]], rounds: int, epochs: int, data_root: list[Path] | None,
        json_path: Path | None, console: Console, flower: FlowerPython) -> dict:
    from fcl_emu.runconfig import default_data_roots

    roots = [Path(p).resolve() for p in (data_root or default_data_roots())]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for clients, cohort in points:
            console.print(f"flower: N={clients} K={cohort} ...", markup=False, highlight=False)
            rows.append(point(clients, cohort, rounds, epochs, roots, Path(tmp) / f"n{clients}", flower))
    return emit("flower", rows, {"targets": "wall_ratio <= 0.33, memory_ratio <= 0.25", "flower": flower.flwr},
                json_path, console)
