"""``fcl-emu bench overcommit``: the host's CPU time of an overcommitted run on the emulated clock, training every
selected client (``rounds.skip_late: false``) against cancelling the trainings that cannot count (the default).

The same seeded run twice (MNIST in two tasks, IID shards, the small CNN, two edge-node processes, FedAvg): every
client has a per-sample cost drawn from a lognormal and a link drawn from a range, so its earliest arrival is known before it trains
(docs/edge.md, "Late work is not done"). The host's CPU time is the coordinator process's plus its edge nodes'
(reaped children). Both runs must give the same accuracy matrix and the same participants in every round.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import yaml
from rich.console import Console

from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.bench.nodes import run_with_nodes
from fcl_emu.bench.report import emit
from fcl_emu.runconfig import RunConfig, default_data_roots

PROFILES = {"profiles": [{"name": "phone", "ms_per_sample": {"lognormal": {"median": 8.0, "sigma": 0.8}},
                          "uplink_mbps": {"uniform": [2, 20]}, "downlink_mbps": {"uniform": [10, 50]},
                          "latency_ms": 30}]}
OUTCOME = ("selected", "participants", "late", "dropped", "contributors", "emulated_s")


def _host_cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the edge nodes)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _one(config: RunConfig, skip_late: bool, tmp: Path) -> tuple[float, float, dict]:
    config = config.model_copy(update={"rounds": config.rounds.model_copy(update={"skip_late": skip_late})})
    name = "skip" if skip_late else "train"
    assignment = [list(range(0, config.scenario.num_clients, 2)), list(range(1, config.scenario.num_clients, 2))]
    cpu, wall = _host_cpu_s(), time.perf_counter()
    summary, records = run_with_nodes(Coordinator(config), config, assignment, tmp / name, wait_s=30)
    return _host_cpu_s() - cpu, time.perf_counter() - wall, {"summary": summary, "records": records}


def run(clients: int, clients_per_round: int, overcommit: float, rounds: int, samples: int, seed: int,
        json_path: Path | None, data_root: list[Path] | None, console: Console) -> dict:
    with TemporaryDirectory() as tmp:
        profiles = Path(tmp) / "profiles.yaml"
        profiles.write_text(yaml.safe_dump(PROFILES))
        config = RunConfig.model_validate({
            "scenario": {"dataset": "mnist", "num_tasks": 2, "num_clients": clients,
                         "samples_per_client_task": samples},
            "rounds": {"clients_per_round": clients_per_round, "overcommit": overcommit, "rounds_per_task": rounds,
                       "deadline_s": 60, "eval_every": rounds},
            "training": {"local_epochs": 1}, "model": "cnn", "nodes": 2, "device": "cpu", "seed": seed,
            "edge": {"device_profiles": str(profiles)}, "security": {"transport": "plain"},
            "data_root": [str(p) for p in (data_root or default_data_roots())],
        })
        base_cpu, base_wall, base = _one(config, False, Path(tmp))
        cpu, wall, skip = _one(config, True, Path(tmp))
    same_matrix = skip["summary"].accuracy_matrix == base["summary"].accuracy_matrix
    same_rounds = [[r[k] for k in OUTCOME] for r in skip["records"]] == \
        [[r[k] for k in OUTCOME] for r in base["records"]]
    if not (same_matrix and same_rounds):
        raise RuntimeError("cancelling late trainings changed the results: accuracy matrix "
                           f"{'same' if same_matrix else 'differs'}, rounds {'same' if same_rounds else 'differ'}")
    rows = [
        {"quantity": "host CPU (s)", "value": cpu, "baseline": base_cpu, "ratio": cpu / base_cpu},
        {"quantity": "wall clock (s)", "value": wall, "baseline": base_wall, "ratio": wall / base_wall},
    ]
    s = skip["summary"]
    return emit("overcommit", rows, {
        "clients": clients, "clients_per_round": clients_per_round, "overcommit": overcommit,
        "rounds": 2 * rounds, "samples_per_client_task": samples, "seed": seed,
        "trainings": sum(r["selected"] for r in base["records"]),
        "skipped_trainings": s.skipped_trainings, "host_cpu_saved_s_estimate": s.host_cpu_saved_s,
        "same_accuracy_matrix_and_rounds": True, "accuracy_matrix": s.accuracy_matrix,
        "baselines": "the same seeded run training every selected client (--no-skip-late)",
    }, json_path, console)
