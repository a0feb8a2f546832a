"""``fcl-emu bench containers``: what running the edge nodes in containers costs, against host processes.

One FedAvg workload (MNIST, N clients with IID shares, K per round, R rounds, one local epoch, the small CNN) is
run twice in this process's coordinator, once with ``--backend process`` and once with ``--backend docker``,
and then once more in containers with two device classes (1 CPU and 0.25 CPU). Per backend:

- ``startup_s``: from starting the edge nodes until every client has joined (containers: creating and starting
  them, the interpreter and torch import inside, the joins);
- ``node_pss_mb``, ``mb_per_node`` and ``mb_per_idle_client``: the proportional set size of every edge node's
  process tree (the container's init and the node; read from the host, so both backends are measured alike)
  once every client has joined and before the first round: in total, per node (container) and per client;
- ``round_s``: the mean wall clock of a round; ``overhead``: the docker backend's extra round time as a share of
  the process backend's (target under 10 %); ``memory_ratio``: docker over process idle memory per client
  (target at most 1.2);
- ``slowdown_quarter_cpu``: the mean training time of the 0.25-CPU class over the 1-CPU class's (the kernel's
  CFS quota makes it about 4).

The accuracy of the two backends is printed too: the same seed gives the same model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import psutil
import yaml
from rich.console import Console
from rich.table import Table

from fcl_emu.containers.image import image_ref
from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.keys import RunKeys
from fcl_emu.launchers import launcher
from fcl_emu.methods.jobs import torch_threads
from fcl_emu.runconfig import RunConfig


def bench_config(clients: int, cohort: int, rounds: int, nodes: int, data_root: list[Path],
                 profiles: Path | None = None, backend: str = "process", samples: int | None = None,
                 image: str | None = None) -> RunConfig:
    """The workload: MNIST in one task, IID shares (``samples`` per client, or the whole share); containers of
    ``image`` (unset: built or reused)."""
    return RunConfig.model_validate({
        "scenario": {"dataset": "mnist", "num_tasks": 1, "num_clients": clients, "samples_per_client_task": samples},
        "rounds": {"clients_per_round": min(cohort, clients), "rounds_per_task": rounds, "eval_every": 10**6,
                   "deadline_s": 600},
        "training": {"local_epochs": 1, "batch_size": 32, "momentum": 0.0},
        "network": {"join_timeout_s": 600},
        "edge": {"device_profiles": None if profiles is None else str(profiles)},
        "containers": {"backend": backend, **({"image": image} if backend != "process" else {})},
        # the coordinator evaluates beside the edge nodes on this machine's cores: with torch's thread per core
        # the closing evaluation took 3-10 s on two busy cores, with one thread about 1
        "coordinator_threads": 1,
        "model": "cnn", "device": "cpu", "nodes": nodes, "seed": 0, "data_root": [str(p) for p in data_root],
    })


def tree_pss(pid: int) -> int:
    """Proportional set size of a process and all its descendants (bytes); 0 for one that is gone."""
    try:
        root = psutil.Process(pid)
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            total += proc.memory_full_info().pss
        return total
    except psutil.Error:
        return 0


def measure(config: RunConfig, run_dir: Path) -> dict:
    """One run under ``config.containers.backend``: start-up, idle memory, round times, accuracy."""
    nodes = launcher(config.containers.backend, config.containers.cluster)
    config = RunKeys(run_dir).write(config)
    config = nodes.prepare(config, run_dir)
    idle: dict[str, float] = {}

    def on_progress(kind: str, info: dict) -> None:
        if kind == "ready":
            idle["startup_s"] = time.perf_counter() - started
            idle["node_pss"] = sum(tree_pss(pid) for pid in nodes.pids().values())

    coordinator = Coordinator(config, progress=on_progress)
    started = time.perf_counter()
    try:
        nodes.start(coordinator.address, config, run_dir / "logs")
        coordinator.watch_nodes(nodes.exited, nodes.count)
        summary = coordinator.run(run_dir)
    finally:
        nodes.stop()
        coordinator.close()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    clients = config.scenario.num_clients
    by_class = [r["train_s_by_class"] for r in rounds if r.get("train_s_by_class")]
    return {
        "backend": config.containers.backend, "status": summary.status, "clients": clients,
        "nodes": nodes.count, "startup_s": idle.get("startup_s"),
        "node_pss_mb": idle.get("node_pss", 0) / 1e6, "mb_per_node": idle.get("node_pss", 0) / 1e6 / nodes.count,
        "mb_per_idle_client": idle.get("node_pss", 0) / 1e6 / clients,
        "round_s": float(np.mean([r["duration_s"] for r in rounds])),
        "train_s_by_class": {c: float(np.mean([b[c] for b in by_class if c in b])) for c in (by_class[0] if by_class
                                                                                            else {})},
        "accuracy": summary.average_accuracy,
    }


def run(clients: int, cohort: int, rounds: int, nodes: int, data_root: list[Path], json_path: Path | None,
        console: Console, samples: int | None = None, image: str | None = None) -> dict:
    """Measure both backends (and the two CPU classes) on one workload; ``image``: the containers' (unset: built
    or reused once, before anything runs)."""
    image = image_ref(image)
    # the coordinators run in this process at one torch thread (coordinator_threads): the caller's count after
    with torch_threads(1), TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        process = measure(bench_config(clients, cohort, rounds, nodes, data_root, samples=samples),
                          tmp_path / "process")
        docker = measure(bench_config(clients, cohort, rounds, nodes, data_root, backend="docker",
                                      samples=samples, image=image), tmp_path / "docker")
        profiles = tmp_path / "classes.yaml"
        profiles.write_text(yaml.safe_dump({"profiles": [
            {"name": "one_cpu", "share": 1, "container": {"cpus": 1.0}},
            {"name": "quarter_cpu", "share": 1, "container": {"cpus": 0.25}}]}))
        classes = measure(bench_config(clients, cohort, rounds, max(2, nodes), data_root, profiles, "docker",
                                       samples, image), tmp_path / "classes")
    train = classes["train_s_by_class"]
    result = {
        "workload": {"clients": clients, "cohort": cohort, "rounds": rounds, "nodes": nodes, "samples": samples},
        "process": process, "docker": docker, "classes": classes,
        "overhead": docker["round_s"] / process["round_s"] - 1.0,
        "memory_ratio": docker["mb_per_idle_client"] / process["mb_per_idle_client"],
        "startup_ratio": docker["startup_s"] / process["startup_s"],
        "slowdown_quarter_cpu": train.get("quarter_cpu", float("nan")) / train.get("one_cpu", float("nan")),
    }
    table = Table(title=f"edge nodes in containers vs processes: {clients} clients, {cohort} per round, "
                        f"{rounds} rounds, {nodes} nodes")
    for column in ("backend", "start-up (s)", "nodes' PSS (MB)", "MB / node", "MB / idle client", "round (s)",
                   "accuracy (%)"):
        table.add_column(column, justify="right")
    for row in (process, docker):
        table.add_row(row["backend"], f"{row['startup_s']:.1f}", f"{row['node_pss_mb']:.0f}",
                      f"{row['mb_per_node']:.0f}", f"{row['mb_per_idle_client']:.2f}", f"{row['round_s']:.2f}",
                      f"{row['accuracy']:.2f}")
    console.print(table)
    console.print(f"container overhead per round: {result['overhead']:+.1%} (target < 10 %); idle memory per "
                  f"client docker/process: {result['memory_ratio']:.2f} (target <= 1.2); start-up ratio "
                  f"{result['startup_ratio']:.2f}; 0.25-CPU class trains {result['slowdown_quarter_cpu']:.2f}x "
                  f"slower than the 1-CPU class", markup=False, highlight=False)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result
