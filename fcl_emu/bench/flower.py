"""``fcl-emu bench flower``: fcl-emu and Flower's simulation engine side by side on the same FedAvg workload.

The workload, the same on both sides: MNIST, N clients holding the IID shards of fcl-emu's scenario (one task
with every class, the run's seed: both sides train on exactly the same samples), K clients per round, R rounds,
E local epochs of SGD (batch 32, lr 0.05, no momentum, no weight decay), the small CNN of
:mod:`fcl_emu.methods.models.classifier` (``cnn``) with a 10-way head, inputs normalised with the dataset's mean and
standard deviation, and an evaluation of the global model on the whole MNIST test set after every round.

- fcl-emu: ``python -m fcl_emu up`` with that configuration (coordinator and two edge-node processes, its
  default CurveZMQ transport);
- Flower: ``python -m fcl_emu.bench.flower`` in a subprocess: ``flwr.simulation.start_simulation`` (Ray
  backend, one CPU per client actor, two CPUs in all) with ``FedAvg`` (``fraction_fit = K / N``) and a central
  ``evaluate_fn`` on the test set.

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

from fcl_emu.bench.report import emit
from fcl_emu.launchers.process import node_env
from fcl_emu.monitoring.results import RunSummary

DEFAULT_POINTS = ((100, 10), (300, 30))
LR, BATCH, SEED = 0.05, 32, 0


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


def point(clients: int, cohort: int, rounds: int, epochs: int, data_root: list[Path], work: Path) -> dict:
    """Both sides on one (N, K) point."""
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
    theirs = measured([sys.executable, "-m", "fcl_emu.bench.flower", *flower_args], work / "flower.log", 1800)
    if theirs[2] != 0 or not result.exists():
        raise RuntimeError(f"the Flower simulation failed (exit {theirs[2]}): see {work / 'flower.log'}")
    flower = json.loads(result.read_text())
    return {
        "clients": clients, "cohort": cohort, "rounds": rounds,
        "fcl_emu_s": ours[0], "flower_s": theirs[0], "wall_ratio": ours[0] / theirs[0],
        "fcl_emu_pss_gb": ours[1] / 1e9, "flower_pss_gb": theirs[1] / 1e9, "memory_ratio": ours[1] / theirs[1],
        "fcl_emu_accuracy": summary.accuracy_seen[-1], "flower_accuracy": flower["accuracy"],
        "fcl_emu_status": summary.status,
    }


def run(points: list[tuple[int, int]], rounds: int, epochs: int, data_root: list[Path] | None,
        json_path: Path | None, console: Console) -> dict:
    from fcl_emu.runconfig import default_data_roots

    roots = [Path(p).resolve() for p in (data_root or default_data_roots())]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for clients, cohort in points:
            console.print(f"flower: N={clients} K={cohort} ...", markup=False, highlight=False)
            rows.append(point(clients, cohort, rounds, epochs, roots, Path(tmp) / f"n{clients}"))
    return emit("flower", rows, {"targets": "wall_ratio <= 0.33, memory_ratio <= 0.25",
                                 "flower": flower_version()}, json_path, console)


def flower_version() -> str | None:
    try:
        import flwr

        return flwr.__version__
    except ImportError:
        return None


# ----------------------------------------------------------------- the Flower side, in its own process
def simulate(clients: int, cohort: int, rounds: int, epochs: int, data_root: list[Path]) -> float:
    """Flower's simulation of the workload; returns the final test accuracy (percent)."""
    import numpy as np
    import torch
    from flwr.client import NumPyClient
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import start_simulation

    from fcl_emu.methods.models.classifier import build_model
    from fcl_emu.scenario.datasets import load_dataset
    from fcl_emu.scenario.scenario import build_scenario
    from fcl_emu.scenario.spec import ScenarioSpec
    from fcl_emu.scenario.transforms import to_tensor

    torch.set_num_threads(1)
    dataset = load_dataset("mnist", data_root)
    scenario = build_scenario(ScenarioSpec(dataset="mnist", num_tasks=1, num_clients=clients, seed=SEED), dataset)
    test_x = to_tensor(dataset.test_x, dataset.mean, dataset.std)
    test_y = torch.as_tensor(dataset.test_y, dtype=torch.long)

    def model_with(parameters) -> torch.nn.Module:
        model = build_model("cnn", dataset.input_shape, dataset.num_classes)
        if parameters is not None:
            state = dict(zip(model.state_dict().keys(), (torch.as_tensor(np.asarray(p)) for p in parameters)))
            model.load_state_dict(state)
        return model

    def parameters_of(model: torch.nn.Module) -> list:
        return [v.detach().cpu().numpy() for v in model.state_dict().values()]

    class Client(NumPyClient):
        def __init__(self, cid: int):
            indices = scenario.client_indices(cid, 0)
            self.x = to_tensor(dataset.train_x[indices], dataset.mean, dataset.std)
            self.y = torch.as_tensor(dataset.train_y[indices], dtype=torch.long)

        def fit(self, parameters, config):
            model = model_with(parameters)
            model.train()
            optimiser = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
            generator = torch.Generator().manual_seed(SEED)
            for _ in range(epochs):
                for batch in torch.randperm(len(self.x), generator=generator).split(BATCH):
                    optimiser.zero_grad()
                    torch.nn.functional.cross_entropy(model(self.x[batch]), self.y[batch]).backward()
                    optimiser.step()
            return parameters_of(model), len(self.x), {}

    def client_fn(cid: str):
        return Client(int(cid)).to_client()

    accuracy = {"last": 0.0}

    def evaluate(server_round, parameters, config):
        model = model_with(parameters).eval()
        with torch.no_grad():
            correct = sum(int((model(test_x[i:i + 1000]).argmax(1) == test_y[i:i + 1000]).sum())
                          for i in range(0, len(test_x), 1000))
        accuracy["last"] = 100.0 * correct / len(test_x)
        return 0.0, {"accuracy": accuracy["last"]}

    torch.manual_seed(SEED)
    strategy = FedAvg(fraction_fit=cohort / clients, min_fit_clients=cohort, min_available_clients=clients,
                      fraction_evaluate=0.0, min_evaluate_clients=0, evaluate_fn=evaluate,
                      initial_parameters=ndarrays_to_parameters(parameters_of(model_with(None))))
    start_simulation(client_fn=client_fn, num_clients=clients, config=ServerConfig(num_rounds=rounds),
                     strategy=strategy, client_resources={"num_cpus": 1},
                     ray_init_args={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False})
    return accuracy["last"]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="The Flower side of `fcl-emu bench flower`.")
    for name in ("clients", "cohort", "rounds", "epochs"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--data-root", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    accuracy = simulate(args.clients, args.cohort, args.rounds, args.epochs, args.data_root)
    args.out.write_text(json.dumps({"accuracy": accuracy}))


if __name__ == "__main__":
    main()
