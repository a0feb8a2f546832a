"""``fcl-emu bench energy``: what each method costs the clients' batteries, on the default device mix.

One seeded scenario (MNIST in two tasks, the small CNN (MFCL: its BatchNorm variant), two edge-node processes,
the emulated clock, every round evaluated), one run per case: FedAvg (the baseline), FedAvg under FedBuff
(``buffer`` and ``concurrency`` the cohort), MFCL, GLFC, and FedAvg with ``edge.min_battery: 0.6`` (about 40 %
of the clients start below it and sit out). For each: the final average accuracy, the clients' energy in all
and its compute share, the energy until the accuracy on the seen classes first reached ``--target-accuracy``,
the device class that paid most per client dispatched, and the ratios of energy against FedAvg's in the same
run. The energy model: docs/devices.md.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from tempfile import TemporaryDirectory

from rich.console import Console

from fcl_emu.bench.nodes import run_with_nodes
from fcl_emu.bench.report import emit
from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.monitoring.plots import new_figure, save_figure
from fcl_emu.runconfig import RunConfig, default_data_roots
from fcl_emu.scenario.device_classes import DEFAULT_CLASSES
from fcl_emu.scenario.devices import assign_profile

BASELINE = "fedavg"
CASES = {  # name -> (method, config overrides)
    "fedavg": ("fedavg", {}),
    "fedbuff": ("fedavg", {"aggregation": "fedbuff"}),
    "mfcl": ("mfcl", {}),
    "glfc": ("glfc", {}),
    "fedavg-low-battery": ("fedavg", {"edge": {"min_battery": 0.6}}),
}


def parse_cases(text: str) -> list[str]:
    cases = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise ValueError(f"--cases: give some of {', '.join(CASES)} (got {text!r})")
    return list(dict.fromkeys([BASELINE, *cases]))


def case_config(case: str, clients: int, clients_per_round: int, rounds: int, samples: int, seed: int,
                data_root: list[Path] | None) -> RunConfig:
    method, override = CASES[case]
    aggregation = {}
    if override.get("aggregation"):
        aggregation = {"kind": override["aggregation"], "buffer": clients_per_round,
                       "concurrency": clients_per_round}
    return RunConfig.model_validate({
        "method": method,
        "scenario": {"dataset": "mnist", "num_tasks": 2, "num_clients": clients, "samples_per_client_task": samples},
        "rounds": {"clients_per_round": clients_per_round, "rounds_per_task": rounds, "eval_every": 1,
                   "clock": "emulated"},
        "aggregation": aggregation, "edge": override.get("edge", {}),
        "training": {"local_epochs": 1}, "model": "auto", "nodes": 2, "device": "cpu", "seed": seed,
        "security": {"transport": "plain"}, "data_root": [str(p) for p in (data_root or default_data_roots())]})


def measure(summary, records: list[dict], config: RunConfig, target: float) -> dict:
    """One case's row (before the ratios)."""
    energy = summary.energy_joules
    per_class, dispatched = defaultdict(float), defaultdict(int)
    for r in records:
        for client, joules in (r.get("energy_j") or {}).items():
            name = assign_profile(DEFAULT_CLASSES, int(client.rsplit("-", 1)[1]), config.seed).name
            per_class[name] += sum(joules)
            dispatched[name] += 1
    per_dispatch = {name: per_class[name] / dispatched[name] for name in per_class}
    to_target = next((m.joules for m in energy.to_accuracy if m.accuracy >= target), None)
    top = max(per_dispatch, key=per_dispatch.get)
    return {"average accuracy (%)": summary.average_accuracy, "energy (kJ)": energy.total / 1000,
            "compute share (%)": 100 * energy.by_kind["compute"] / energy.total,
            f"kJ to {target:g} %": None if to_target is None else to_target / 1000,
            "pays most (J per job)": f"{top} {per_dispatch[top]:.1f}",
            "sat out (client-rounds)": energy.sat_out_rounds}


def plot(rows: list[dict], path: Path) -> Path:
    """Energy by case, split into compute and radio (kJ)."""
    fig = new_figure(6.4, 3.2)
    ax = fig.add_subplot()
    names = [r["case"] for r in rows]
    compute = [r["energy (kJ)"] * r["compute share (%)"] / 100 for r in rows]
    radio = [r["energy (kJ)"] - c for r, c in zip(rows, compute)]
    ax.bar(names, compute, label="compute")
    ax.bar(names, radio, bottom=compute, label="radio")
    ax.set_ylabel("clients' energy (kJ)")
    ax.set_title("bench energy: MNIST, 2 tasks, default device mix")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend()
    return save_figure(fig, path)


def run(cases: list[str], clients: int, clients_per_round: int, rounds: int, samples: int, seed: int,
        target: float, json_path: Path | None, plot_path: Path | None, data_root: list[Path] | None,
        console: Console) -> dict:
    rows = []
    configs = {case: case_config(case, clients, clients_per_round, rounds, samples, seed, data_root)
               for case in cases}  # every config checked before the first run
    with TemporaryDirectory() as tmp:
        for case, config in configs.items():
            assignment = [list(range(0, clients, 2)), list(range(1, clients, 2))]
            summary, records = run_with_nodes(Coordinator(config), config, assignment, Path(tmp) / case, wait_s=30)
            if summary.status != "completed" or summary.energy_joules is None:
                raise RuntimeError(f"case {case}: the run ended {summary.status} without energy figures")
            rows.append({"case": case, **measure(summary, records, config, target)})
    base = rows[0]
    key = f"kJ to {target:g} %"
    for row in rows:
        row["energy ratio"] = row["energy (kJ)"] / base["energy (kJ)"]
        row["to-target ratio"] = (None if row[key] is None or base[key] is None else row[key] / base[key])
    if plot_path is not None:
        plot(rows, plot_path)
        console.print(f"wrote {plot_path}")
    unreached = [f"-: the run's accuracy on the seen classes never reached {target:g} % (to-target ratio: the "
                 f"case's or FedAvg's)"] if any(row[key] is None for row in rows) else []
    return emit("energy", rows, {
        "clients": clients, "clients_per_round": clients_per_round, "rounds": 2 * rounds,
        "samples_per_client_task": samples, "seed": seed, "target_accuracy": target,
        "baselines": "FedAvg (synchronous) on the same scenario, seed and device mix"}, json_path, console,
        notes=unreached)
