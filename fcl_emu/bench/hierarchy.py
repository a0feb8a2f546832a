"""``fcl-emu bench hierarchy``: a star against two tiers (edge aggregators) as the population grows.

For each population N (default 1,000 and 10,000) and each tier setting (0 edge aggregators, the star and the
baseline; then each M of ``--aggregators``), one seeded run of one scenario: MNIST in one task (FedAvg, the small
CNN, IID shares), a cohort of K clients per round, R rounds, the emulated clock, edge nodes as ``up`` chooses them
(at least one per aggregator, at least two), each aggregator with each of ``--edge-rounds`` K (edge
aggregations per cloud round), and the wide-area link of ``--edge-uplink-mbps``,
``--edge-downlink-mbps`` and ``--edge-latency-ms``. The coordinator runs in this process, nodes and aggregators as
processes (plain TCP). Per run:

- ``update_mb_per_round``: the bytes carrying the round's updates into the coordinator (``update``; with
  aggregators ``update_held`` and ``edge_aggregate``), and their ratio to the star's at the same N;
- ``down_mb_per_round``: what the coordinator's links carried down (the wire's count: a round's model once per
  shared connection, a node's or an aggregator's), and its ratio;
- ``work_cpu_per_round_s``: the coordinator's own work per round (its main thread's CPU seconds in select,
  dispatch, receiving updates and aggregation, the round records' ``work_cpu_s``), and its ratio;
- ``accuracy`` (%) and ``emulated_s``, the federation's time over the run.
"""

from __future__ import annotations

from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
from rich.console import Console

from fcl_emu.bench.nodes import run_with_nodes
from fcl_emu.bench.report import emit
from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.coordinator.round_record import UPDATE_TYPES
from fcl_emu.launchers.base import node_specs
from fcl_emu.monitoring.plots import new_figure, save_figure
from fcl_emu.runconfig import RunConfig, default_data_roots

DEFAULT_POPULATIONS = (1000, 10_000)


def point_config(clients: int, aggregators: int, edge_rounds: int, cohort: int, rounds: int, seed: int, link: dict,
                 data_root: list[Path] | None) -> RunConfig:
    return RunConfig.model_validate({
        "scenario": {"dataset": "mnist", "num_tasks": 1, "num_clients": clients},
        "rounds": {"clients_per_round": cohort, "rounds_per_task": rounds, "eval_every": rounds,
                   "clock": "emulated"},
        "training": {"local_epochs": 1}, "model": "cnn", "device": "cpu", "seed": seed,
        "topology": {"edge_aggregators": aggregators, "edge_rounds": edge_rounds, **link},
        "security": {"transport": "plain"},
        "data_root": [str(p) for p in (data_root or default_data_roots())]})


def measure(config: RunConfig, run_dir: Path) -> dict:
    """One run's row (before the ratios)."""
    coordinator = Coordinator(config)
    summary, records = run_with_nodes(coordinator, config, [n.clients for n in node_specs(config)], run_dir,
                                      wait_s=60)
    if summary.status != "completed":
        raise RuntimeError(f"{config.scenario.num_clients:,} clients, {config.topology.edge_aggregators} edge "
                           f"aggregators: the run ended {summary.status}")
    rounds = len(records)
    updates = sum(summary.bytes.get(t, {}).get("received", 0) for t in UPDATE_TYPES)
    return {"clients": config.scenario.num_clients, "edge aggregators": config.topology.edge_aggregators,
            "edge rounds": config.topology.edge_rounds, "nodes": config.nodes,
            "update_mb_per_round": updates / rounds / 1e6,
            "down_mb_per_round": coordinator.endpoint.wire_sent / rounds / 1e6,
            "work_cpu_per_round_s": float(np.mean([r["work_cpu_s"] for r in records])),
            "accuracy": summary.average_accuracy, "emulated_s": summary.emulated_s}


def plot(rows: list[dict], path: Path) -> Path:
    """Against N, one line per tier setting of one edge round: the update bytes into the coordinator and its work per
    round; then the accuracy against the edge rounds K, one line per population and aggregator count."""
    fig = new_figure(10.0, 3.0)
    one_step = [r for r in rows if r["edge rounds"] == 1]
    panels = [("update_mb_per_round", "update MB into the coordinator / round"),
              ("work_cpu_per_round_s", "coordinator work / round (CPU s)")]
    for k, (key, label) in enumerate(panels, 1):
        ax = fig.add_subplot(1, 3, k)
        for m in sorted({r["edge aggregators"] for r in one_step}):
            mine = [r for r in one_step if r["edge aggregators"] == m]
            ax.plot([r["clients"] for r in mine], [r[key] for r in mine], marker="o",
                    label="star" if m == 0 else f"{m} edge aggregators")
        ax.set_xscale("log")
        ax.set_xlabel("clients")
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    ax = fig.add_subplot(1, 3, 3)
    for n, m in sorted({(r["clients"], r["edge aggregators"]) for r in rows if r["edge aggregators"]}):
        mine = sorted((r for r in rows if (r["clients"], r["edge aggregators"]) == (n, m)),
                      key=lambda r: r["edge rounds"])
        ax.plot([r["edge rounds"] for r in mine], [r["accuracy"] for r in mine], marker="o",
                label=f"{n:,} clients, {m} aggregators")
    ax.set_xlabel("edge rounds per cloud round (K)")
    ax.set_ylabel("accuracy (%)")
    ax.legend(fontsize="small")
    fig.suptitle("bench hierarchy: MNIST, FedAvg, emulated clock")
    return save_figure(fig, path)


def run(populations: list[int], aggregators: list[int], edge_rounds: list[int], cohort: int, rounds: int, seed: int,
        link: dict, json_path: Path | None, plot_path: Path | None, data_root: list[Path] | None,
        console: Console) -> dict:
    settings = [(0, 1), *[(m, k) for m in dict.fromkeys(aggregators) if m > 0 for k in dict.fromkeys(edge_rounds)]]
    configs = [point_config(n, m, k, cohort, rounds, seed, link, data_root) for n in populations for m, k in settings]
    rows = []
    with TemporaryDirectory() as tmp:
        for config in configs:  # every config checked above, before the first run
            topology = config.topology
            name = f"{config.scenario.num_clients}-{topology.edge_aggregators}-{topology.edge_rounds}"
            rows.append(measure(config, Path(tmp) / name))
    for row in rows:
        star = next(r for r in rows if r["clients"] == row["clients"] and r["edge aggregators"] == 0)
        for key, name in (("update_mb_per_round", "update ratio"), ("down_mb_per_round", "down ratio"),
                          ("work_cpu_per_round_s", "work ratio")):
            row[name] = row[key] / star[key] if star[key] else None
    if plot_path is not None:
        plot(rows, plot_path)
        console.print(f"wrote {plot_path}")
    return emit("hierarchy", rows, {
        "cohort": cohort, "rounds": rounds, "seed": seed, "wide_area_link": link or "not limited",
        "baselines": "the star (no edge aggregator) at the same population, scenario and seed"}, json_path, console)
