"""``fcl-emu bench scale``: what a growing client population costs, on this machine.

A sweep over populations N (default 100, 300, 1,000, 3,000, 10,000, 30,000, 100,000) with a fixed cohort K per
round (``largest_cohort`` at the largest N) and a fixed data share per client (MNIST, the small CNN, one task,
``samples_per_client_task`` samples each, IID, drawn with replacement where N x share exceeds MNIST), each point a
real emulation: the coordinator in this process under its default transport (CurveZMQ, each node's clients over
one shared connection), edge nodes as processes (``ceil(N / clients_per_node)`` of them, at least two, as ``up``
chooses them, plus a one-client reference node). Per point:

- ``join_s``: from the nodes' start until the coordinator holds a join from every client;
- ``idle_cpu_per_s``: the coordinator process's CPU seconds per second (all its threads) while every client is
  connected and no round runs (``idle_s`` seconds of serving, at least two heartbeat intervals, between the
  join and the first round);
- ``overhead_per_round_s``: the coordinator's own work in a round (select, dispatch, receiving and decoding
  updates, aggregation) in host seconds, and ``work_cpu_per_round_s`` in its main thread's CPU seconds (what it
  costs with the nodes' training beside it on the same cores left out), beside ``round_s``, the round's wall
  clock (client training included);
- ``peak_rss_mb``: the peak resident memory of every process (coordinator, each node), sampled each second;
- ``mb_per_idle_client``: the nodes' memory beyond the reference node's, per client;
- ``bytes_per_round``: bytes on the wire per round; ``wall_s``: the point's whole wall clock.

The sweep stops at the first point that does not fit: one whose memory, estimated from the previous point's
memory per client, exceeds 80 % of the available memory, or one that fails; the message says which and why.
Outputs under ``--out``: ``scale.csv``, ``scale.png`` (four panels against N) and, with ``--json``, the rows.
"""

from __future__ import annotations

import csv
import math
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import psutil
from rich.console import Console

from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.bench.nodes import run_with_nodes
from fcl_emu.bench.report import emit
from fcl_emu.keys import with_keys
from fcl_emu.runconfig import RunConfig, default_data_roots
from fcl_emu.runconfig.nodes import MIN_NODES

DEFAULT_POPULATIONS = (100, 300, 1000, 3000, 10_000, 30_000, 100_000)
CSV_NAME, PNG_NAME = "scale.csv", "scale.png"
COLUMNS = ["clients", "cohort", "nodes", "status", "join_s", "idle_cpu_per_s", "overhead_per_round_s",
           "work_cpu_per_round_s", "round_s", "coordinator_peak_rss_mb", "nodes_peak_rss_mb", "mb_per_idle_client",
           "bytes_per_round", "wall_s"]
MEMORY_HEADROOM = 0.8  # a point may use this fraction of the available memory


class PeakMemory(threading.Thread):
    """Samples the resident memory of some processes every ``interval_s``; keeps each one's peak."""

    def __init__(self, interval_s: float = 1.0):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.latest: dict[str, int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        for name, pid in list(self.pids.items()):
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue
            self.latest[name] = rss
            self.peak[name] = max(rss, self.peak.get(name, 0))

    def stop(self) -> None:
        self._halt.set()
        self.sample()


def point_config(clients: int, cohort: int, rounds: int, share: int, data_root: list[Path]) -> RunConfig:
    return RunConfig.model_validate({
        "scenario": {"dataset": "mnist", "num_tasks": 1, "num_clients": clients, "samples_per_client_task": share},
        "rounds": {"clients_per_round": min(cohort, clients), "rounds_per_task": rounds, "eval_every": 10**6,
                   "deadline_s": 600},
        "training": {"local_epochs": 1, "batch_size": 32, "momentum": 0.0},
        "network": {"join_timeout_s": 600},
        "model": "cnn", "device": "cpu", "data_root": [str(p) for p in data_root],
    })


def measure_point(clients: int, cohort: int, rounds: int, share: int, clients_per_node: int, idle_s: float,
                  data_root: list[Path]) -> dict:
    """One population: a real emulation, measured as the module docstring says."""
    config = point_config(clients, cohort, rounds, share, data_root)
    rest = list(range(1, clients))
    nodes = min(len(rest), max(MIN_NODES, math.ceil(len(rest) / clients_per_node)))
    assignment = [[0]] + [rest[i::nodes] for i in range(nodes)]
    memory = PeakMemory()
    memory.pids["coordinator"] = psutil.Process().pid
    idle: dict[str, float] = {}
    started = time.perf_counter()
    with TemporaryDirectory() as tmp:
        config = with_keys(config, Path(tmp) / "keys", assignment)

        def on_progress(kind: str, info: dict) -> None:
            if kind == "ready":  # every client joined, no round yet: the idle cost
                idle["join_s"] = time.perf_counter() - nodes_started
                memory.sample()
                cpu0, t0 = _cpu_s(), time.perf_counter()  # at least two heartbeat intervals (stretched at scale)
                coordinator.serve(lambda: False, time.monotonic() + max(idle_s, 2 * coordinator.heartbeat_interval_s))
                idle["cpu_per_s"] = (_cpu_s() - cpu0) / (time.perf_counter() - t0)
                memory.sample()
                idle["node_rss"] = dict(memory.latest)

        coordinator = Coordinator(config, progress=on_progress)
        memory.start()
        nodes_started = time.perf_counter()
        try:
            summary, records = run_with_nodes(
                coordinator, config, assignment, Path(tmp) / "run",
                started=lambda n, pid: memory.pids.__setitem__(f"node-{n}", pid))
        finally:
            memory.stop()
    node_names = [f"node-{n}" for n in range(1, len(assignment))]
    reference = idle["node_rss"].get("node-0", 0)
    per_client = sum(idle["node_rss"].get(n, 0) - reference for n in node_names) / max(1, len(rest))
    work = [sum(r["phases_s"].get(k, 0.0) for k in ("select", "dispatch", "receive_updates", "aggregate"))
            for r in records]
    return {
        "clients": clients, "cohort": min(cohort, clients), "nodes": len(assignment), "status": summary.status,
        "join_s": idle["join_s"], "idle_cpu_per_s": idle["cpu_per_s"],
        "overhead_per_round_s": float(np.mean(work)),
        "work_cpu_per_round_s": float(np.mean([r["work_cpu_s"] for r in records])),
        "round_s": float(np.mean([r["duration_s"] for r in records])),
        "coordinator_peak_rss_mb": memory.peak.get("coordinator", 0) / 1e6,
        "nodes_peak_rss_mb": sum(memory.peak.get(n, 0) for n in ["node-0", *node_names]) / 1e6,
        "mb_per_idle_client": per_client / 1e6,
        "bytes_per_round": float(np.mean([r["bytes_sent"] + r["bytes_received"] for r in records])),
        "wall_s": time.perf_counter() - started,
    }


def _cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def fits(clients: int, previous: dict | None) -> str | None:
    """Why a point would not fit this machine's memory (estimated from the previous point), or None."""
    if previous is None:
        return None
    base = previous["coordinator_peak_rss_mb"] + previous["nodes_peak_rss_mb"] \
        - previous["mb_per_idle_client"] * previous["clients"]
    need_mb = base + previous["mb_per_idle_client"] * clients
    available_mb = psutil.virtual_memory().available / 1e6
    if need_mb > MEMORY_HEADROOM * available_mb:
        return (f"{clients} clients would need about {need_mb:.0f} MB ({previous['mb_per_idle_client']:.2f} MB per "
                f"client measured at {previous['clients']}), more than {MEMORY_HEADROOM:.0%} of the "
                f"{available_mb:.0f} MB available")
    return None


def run(populations: list[int], cohort: int, largest_cohort: int, rounds: int, share: int, clients_per_node: int,
        idle_s: float, out: Path, json_path: Path | None, data_root: list[Path] | None, console: Console) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    roots = list(data_root or default_data_roots())
    rows: list[dict] = []
    stopped = None
    for clients in populations:
        stopped = fits(clients, rows[-1] if rows else None)
        if stopped is None:
            console.print(f"scale: {clients} clients ...", markup=False, highlight=False)
            try:
                k = largest_cohort if clients == max(populations) else cohort
                rows.append(measure_point(clients, k, rounds, share, clients_per_node, idle_s, roots))
            except Exception as exc:  # a point that cannot run here ends the sweep, saying why
                stopped = f"{clients} clients failed: {type(exc).__name__}: {exc}"
        if stopped is not None:
            console.print(f"scale: the sweep stops: {stopped}", style="yellow", markup=False, highlight=False)
            break
    if not rows:
        raise RuntimeError(f"no point of the sweep ran: {stopped}")
    with open(out / CSV_NAME, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    png = plot(rows, out / PNG_NAME)
    return emit("scale", rows, {"csv": str(out / CSV_NAME), "plot": str(png), "stopped": stopped,
                                "samples_per_client": share, "rounds": rounds,
                                "targets": "100,000 clients, 1,000 a round: join < 60 s, coordinator work per "
                                           "round < 1 s, <= 0.5 MB per idle client, idle coordinator CPU < 0.1"},
                json_path, console)


def plot(rows: list[dict], path: Path) -> Path:
    from fcl_emu.monitoring.plots import new_figure, save_figure

    fig = new_figure(11, 7)
    xs = [r["clients"] for r in rows]
    panels = [("join_s", "time to join everyone (s)"),
              ("work_cpu_per_round_s", "coordinator work per round (CPU s)"),
              ("idle_cpu_per_s", "idle coordinator CPU (s per s)"), ("mb_per_idle_client", "MB per idle client")]
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(2, 2, i + 1)
        ax.plot(xs, [r[key] for r in rows], marker="o")
        ax.set_xscale("log")
        ax.set_xlabel("clients")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    return save_figure(fig, path)
