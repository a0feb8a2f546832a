"""``fcl-emu bench churn``: accuracy, forgetting, completed rounds and bytes against the churn rate.

The churn rate ``c`` is the probability that a client is unavailable in an
availability slot: a point runs with ``edge.availability = bernoulli:(1 - c)``
(``always`` for ``c = 0``) and, optionally, ``edge.crash_rate``. Every point
(method x churn rate) is a real ``fcl-emu up`` run in a subprocess
(``python -m fcl_emu up --config <generated yaml> --run-dir ...``), so the
numbers are those of real coordinator and edge-node processes; they are read
back from each run's ``summary.json``.

Outputs, under ``--out DIR``:

- ``DIR/runs/<method>-churn<c>-crash<x>-s<seed>/``: each run's directory, with
  the generated config (``bench-config.yaml``) and the ``up`` output (``up.log``)
  beside the run's own files;
- ``DIR/churn.csv``: one row per point (:data:`CSV_COLUMNS`);
- ``DIR/churn.png``: four panels (average accuracy, average forgetting,
  completed rounds, MB on the wire) against the churn rate, one line per method;
  with ``--stragglers``, a fifth: the emulated time to the target accuracy
  against the share of stragglers, one line per method and round policy
  (:mod:`fcl_emu.bench.stragglers`: synchronous against asynchronous aggregation).

The default scale (MNIST, 60 clients, 3 tasks x 4 rounds, 10 clients per
round, 1 local epoch, 2 edge nodes) runs a point in 40-120 s on 2 cores, the
default sweep of 12 points in about 15 minutes (docs/results/churn.md). Under the emulated clock the clients are
phones of one fixed cost (:data:`EMULATED_DEVICE`: a round lasts about 2 s of emulated time); the availability
slot (1.5 s) is about one round long, so a client selected for a round leaves during it with probability about
``c``. Container points run on the real clock (their faults are real). A round
needs ``min_participants`` updates (default: half of ``clients_per_round``)
or the coordinator skips it, which is what "completed rounds" counts.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from rich.console import Console
from rich.table import Table

from fcl_emu.monitoring.results import RunSummary
from fcl_emu.runconfig.config import merge_config

CSV_NAME = "churn.csv"
PNG_NAME = "churn.png"
RUNS_DIR = "runs"
CONFIG_NAME = "bench-config.yaml"
LOG_NAME = "up.log"

CSV_COLUMNS = ["method", "faults", "churn_rate", "crash_rate", "seed", "status", "average_accuracy", "average_forgetting",
               "rounds_completed", "rounds_total", "bytes_total", "wall_clock_s", "clock", "emulated_s", "left",
               "rejoined", "dropped", "missed_deadline", "run_dir", "sweep", "aggregation", "stragglers",
               "target_accuracy", "time_to_accuracy_s"]

DEFAULT_METHODS = ("fedavg", "fedlwf2t")
FAULT_MODES = ("emulated", "containers")
DEFAULT_RATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
DEFAULT_TARGET = 80.0  # percent on the seen classes: time_to_accuracy_s

# The bench's own scale; a --config YAML overrides it, and the bench's flags override both.
DEFAULT_CONFIG: dict[str, Any] = {
    "scenario": {"dataset": "mnist", "num_tasks": 3, "num_clients": 60},
    "rounds": {"clients_per_round": 10, "rounds_per_task": 4, "deadline_s": 20.0},
    "training": {"local_epochs": 1},
    "network": {"heartbeat_interval_s": 0.5, "liveness_timeout_s": 3.0, "join_timeout_s": 60.0},
    "edge": {"availability_slot_s": 1.5},
    "model": "cnn",
    "nodes": 2,
    "device": "cpu",
}


# Under the emulated clock every client of a point is a phone of one fixed cost (unless the base config names
# device profiles): about 1 s of training per round (3 ms x ~330 samples) and a 1.1 MB model each way at
# 20 Mbit/s, so an emulated round lasts about 2 s and the 1.5 s availability slot and the 5 s crash downtime
# mean what they meant in host seconds. A fixed cost makes the emulated times exact.
EMULATED_DEVICE = {"name": "phone", "ms_per_sample": 3.0, "uplink_mbps": 20, "downlink_mbps": 20, "latency_ms": 50}
DEVICES_NAME = "devices.yaml"


def emulated_base(base: dict, out: Path) -> dict:
    """``base`` with :data:`EMULATED_DEVICE` as its device profile (written to ``out``), unless it names one."""
    if base.get("edge", {}).get("device_profiles"):
        return base
    path = Path(out) / DEVICES_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"profiles": [EMULATED_DEVICE]}))
    return merge_config(base, {"edge": {"device_profiles": str(path.resolve())}})


# ------------------------------------------------------------------ configs
def availability_for(churn_rate: float) -> str:
    """``always`` for no churn, else ``bernoulli:(1 - churn_rate)``."""
    if not 0 <= churn_rate < 1:
        raise ValueError(f"churn rate {churn_rate:g} must be in [0, 1)")
    return "always" if churn_rate == 0 else f"bernoulli:{1 - churn_rate:.6g}"


def parse_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what}: give a comma-separated list")
    return items


def parse_rates(text: str) -> list[float]:
    rates = []
    for item in parse_list(text, "--rates"):
        try:
            rate = float(item.rstrip("%")) / (100 if item.endswith("%") else 1)
        except ValueError:
            raise ValueError(f"--rates: {item!r} is not a number") from None
        if not 0 <= rate < 1:
            raise ValueError(f"--rates: {item} is outside [0, 1)")
        rates.append(rate)
    return sorted(set(rates))


def base_config(config_file: Optional[Path], *, clients: Optional[int] = None, tasks: Optional[int] = None,
                rounds_per_task: Optional[int] = None, clients_per_round: Optional[int] = None,
                min_participants: Optional[int] = None, data_root: Optional[Sequence[Path]] = None) -> dict:
    """The config shared by every point: bench defaults < ``config_file`` < flags (as a plain dict)."""
    from fcl_emu.runconfig import default_data_roots

    loaded: dict[str, Any] = {}
    if config_file is not None:
        try:
            loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        except OSError as exc:
            raise ValueError(f"--config: cannot read {config_file}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"--config: {config_file} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--config: {config_file} must hold a mapping at the top level")
    config = merge_config(DEFAULT_CONFIG, loaded)
    flags: dict[str, Any] = {"scenario": {}, "rounds": {}}
    for section, key, value in (("scenario", "num_clients", clients), ("scenario", "num_tasks", tasks),
                                ("rounds", "rounds_per_task", rounds_per_task),
                                ("rounds", "clients_per_round", clients_per_round),
                                ("rounds", "min_participants", min_participants)):
        if value is not None:
            flags[section][key] = value
    config = merge_config(config, flags)
    rounds = config.setdefault("rounds", {})
    if "min_participants" not in rounds:  # a quorum: half the round's clients
        rounds["min_participants"] = max(1, math.ceil(int(rounds.get("clients_per_round", 30)) / 2))
    roots = list(data_root) if data_root else [Path(p) for p in config.get("data_root", [])] or default_data_roots()
    config["data_root"] = [str(Path(p).resolve()) for p in roots]
    for key in ("run_dir", "metrics"):  # every point has its own run dir and no fixed ports
        config.pop(key, None)
    return config


def container_plan(churn_rate: float, crash_rate: float, slot_s: float) -> dict | None:
    """The container faults at the emulated rates: at every round's start each edge node is paused for a slot
    with probability ``churn_rate`` (its clients straggle instead of leaving) and restarted with probability
    ``crash_rate`` (all its clients crash together instead of one by one)."""
    faults = []
    if churn_rate > 0:
        faults.append({"action": "pause", "per_round": churn_rate, "duration_s": slot_s})
    if crash_rate > 0:
        faults.append({"action": "restart", "per_round": crash_rate, "after_s": 0.5})
    return {"faults": faults} if faults else None


def point_config(base: dict, method: str, churn_rate: float, crash_rate: float, seed: int,
                 faults: str = "emulated", plan_path: Path | None = None) -> dict:
    """One point's config, validated (raises ValueError naming the problem). ``faults`` "containers": the edge
    nodes run in containers and the churn and crash rates become a fault plan (:func:`container_plan`),
    written to ``plan_path``."""
    import pydantic

    from fcl_emu.runconfig import RunConfig

    if faults == "emulated":
        edge = {"availability": availability_for(churn_rate), "crash_rate": crash_rate}
        containers: dict[str, Any] = {}
    else:
        availability_for(churn_rate)  # the same range check
        edge = {"availability": "always", "crash_rate": 0.0}
        containers = {"backend": "docker"}
        plan = container_plan(churn_rate, crash_rate, float(base.get("edge", {}).get("availability_slot_s", 10.0)))
        if plan is not None:
            plan_path.parent.mkdir(parents=True, exist_ok=True)
            plan_path.write_text(yaml.safe_dump(plan))
            containers["faults"] = str(plan_path)
    config = merge_config(base, {"method": method, "seed": seed, "scenario": {"seed": seed}, "edge": edge,
                           **({"containers": containers} if containers else {})})
    try:
        RunConfig.model_validate(config)
    except pydantic.ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{method} at churn {churn_rate:g}: {errors}") from None
    except KeyError as exc:  # an unknown method
        raise ValueError(str(exc).strip("'\"")) from None
    return config


def point_name(method: str, churn_rate: float, crash_rate: float, seed: int, faults: str = "emulated") -> str:
    suffix = "" if faults == "emulated" else f"-{faults}"
    return f"{method}-churn{churn_rate:.2f}-crash{crash_rate:.2f}-s{seed}{suffix}"


def run_timeout_s(config: dict) -> float:
    """A generous bound on one run: joining, every round at its deadline, evaluation and start-up."""
    from fcl_emu.runconfig import RunConfig

    cfg = RunConfig.model_validate(config)
    total = cfg.scenario.num_tasks * cfg.rounds.rounds_per_task
    return cfg.network.join_timeout_s + total * (cfg.rounds.deadline_s + 15.0) + 180.0


# ------------------------------------------------------------------ one point
def row_from_summary(method: str, churn_rate: float, crash_rate: float, seed: int, rounds_total: int,
                     run_dir: Path, summary: Optional[RunSummary], status: Optional[str] = None,
                     faults: str = "emulated") -> dict[str, Any]:
    """One CSV row; ``summary`` None (no summary.json) leaves the measurements empty."""
    row: dict[str, Any] = dict.fromkeys(CSV_COLUMNS)
    row.update(method=method, faults=faults, churn_rate=churn_rate, crash_rate=crash_rate, seed=seed,
               status=status or (summary.status if summary is not None else "failed"), rounds_total=rounds_total,
               run_dir=str(run_dir), sweep="churn", aggregation="sync", stragglers=0.0)
    if summary is None:
        return row

    def num(v: Optional[float]) -> Optional[float]:
        return None if v is None or math.isnan(v) else float(v)

    row.update(average_accuracy=num(summary.average_accuracy), average_forgetting=num(summary.average_forgetting),
               rounds_completed=summary.rounds - summary.rounds_skipped, bytes_total=summary.bytes_total,
               wall_clock_s=num(summary.wall_clock_s), clock=summary.clock, emulated_s=num(summary.emulated_s),
               missed_deadline=summary.missed_deadline)
    if summary.clients is not None:
        row.update(left=summary.clients.left, rejoined=summary.clients.rejoined, dropped=summary.clients.dropped)
    return row


def _stop(proc: subprocess.Popen) -> None:
    """End the run's process group (the ``up`` process and the edge nodes it started)."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_point(config: dict, run_dir: Path, timeout_s: float) -> tuple[Optional[RunSummary], str]:
    """Run ``fcl-emu up`` on ``config`` into ``run_dir``; (summary or None, status)."""
    if run_dir.exists():  # events.jsonl is appended to: a stale run must not mix in
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    config_path = run_dir / CONFIG_NAME
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "-m", "fcl_emu", "up", "--config", str(config_path), "--run-dir", str(run_dir)]
    with open(run_dir / LOG_NAME, "wb") as log:
        log.write((" ".join(command) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "COLUMNS": "120"})
        status: Optional[str] = None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc, status = None, f"timeout ({timeout_s:.0f} s)"
        except BaseException:  # Ctrl-C: do not leave the run's processes behind
            _stop(proc)
            raise
    summary_path = run_dir / "summary.json"
    summary = None
    if summary_path.exists():
        try:
            summary = RunSummary.load(summary_path)
        except (OSError, ValueError):  # not JSON, or not a summary (msgspec.ValidationError)
            status = status or "failed (unreadable summary.json)"
    if status is None:
        if summary is None:
            status = f"failed (exit {rc}, no summary.json)"
        else:
            status = summary.status
            if rc != 0 and status == "completed":
                status = f"completed (exit {rc})"
    return summary, status


def time_to_accuracy(run_dir: Path, target: float) -> Optional[float]:
    """Emulated seconds until the accuracy on the seen classes first reached ``target`` (percent) in the first
    task, from ``events.jsonl``: the rounds' evaluations, and the task end's for the task's last round. None if
    it never did (or the run has no such events)."""
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return None
    clock = None
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "round" and event.get("task") == 0:
            clock = event.get("emulated_clock_s")
            accuracy = event.get("accuracy_seen")
        elif event.get("event") == "task_end" and event.get("task") == 0:
            accuracy = event.get("accuracy_seen")
        else:
            continue
        if accuracy is not None and clock is not None and accuracy >= target:
            return float(clock)
    return None


def log_tail(run_dir: Path, lines: int = 8) -> str:
    try:
        text = (run_dir / LOG_NAME).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ------------------------------------------------------------------ outputs
def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k)) for k in CSV_COLUMNS})
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


PANELS = [  # (title, value of a row)
    ("average accuracy (%)", lambda r: r["average_accuracy"]),
    ("average forgetting (%)", lambda r: r["average_forgetting"]),
    ("completed rounds", lambda r: r["rounds_completed"]),
    ("bytes on the wire (MB)", lambda r: None if r["bytes_total"] is None else r["bytes_total"] / 1e6),
]


def _completed(row: dict[str, Any]) -> bool:
    return row["status"] == "completed"


def _plot_stragglers(ax, rows: Sequence[dict[str, Any]], palette) -> None:
    """Emulated time to the target accuracy against the share of stragglers, a line per method and policy; a
    cross above the highest time marks a run that never reached the target."""
    lines = list(dict.fromkeys((r["method"], r["aggregation"]) for r in rows))
    top = 1.1 * max([r["time_to_accuracy_s"] for r in rows if r["time_to_accuracy_s"] is not None] + [1.0])
    for k, (method, aggregation) in enumerate(lines):
        points = sorted((r for r in rows if (r["method"], r["aggregation"]) == (method, aggregation)),
                        key=lambda r: r["stragglers"])
        xs = [100 * r["stragglers"] for r in points if r["time_to_accuracy_s"] is not None]
        ys = [r["time_to_accuracy_s"] for r in points if r["time_to_accuracy_s"] is not None]
        ax.plot(xs, ys, "o-" if aggregation == "sync" else "s--", color=palette(k % palette.N), alpha=0.85,
                label=f"{method} {aggregation}")
        missed = [100 * r["stragglers"] for r in points if r["time_to_accuracy_s"] is None]
        ax.plot(missed, [top] * len(missed), "x", color=palette(k % palette.N), markersize=8)
    ax.set_title(f"emulated s to {rows[0]['target_accuracy']:g}% (seen classes, task 1)", fontsize=10)
    ax.set_xlabel("stragglers (%)", fontsize=9)
    ax.set_xticks(sorted({100 * r["stragglers"] for r in rows}))
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.set_ylim(0, top * 1.05)
    ax.legend(fontsize=7, title="x: not reached", title_fontsize=7)


def plot_churn(rows: Sequence[dict[str, Any]], path: Path, title: Optional[str] = None) -> Path:
    """Four panels against the churn rate (%), one line per method; points of runs not completed are hollow."""
    from matplotlib import colormaps

    from fcl_emu.monitoring.plots import new_figure, save_figure

    stragglers = [r for r in rows if r.get("sweep") == "stragglers"]
    rows = [r for r in rows if r.get("sweep", "churn") == "churn"]
    lines = list(dict.fromkeys((r["method"], r.get("faults", "emulated")) for r in rows))
    palette = colormaps["tab10"]
    panels = len(PANELS) * bool(rows) + bool(stragglers)
    fig = new_figure(max(13 * panels / len(PANELS), 6.0), 3.6)
    axes = list(fig.subplots(1, panels)) if panels > 1 else [fig.subplots(1, 1)]
    if stragglers:
        _plot_stragglers(axes.pop(), stragglers, palette)
    rates = sorted({r["churn_rate"] for r in rows})
    for ax, (label, value) in zip(axes, PANELS if rows else ()):
        for k, (method, faults) in enumerate(lines):
            points = sorted((r for r in rows if r["method"] == method and r.get("faults", "emulated") == faults),
                            key=lambda r: r["churn_rate"])
            xs = [100 * r["churn_rate"] for r in points if value(r) is not None]
            ys = [value(r) for r in points if value(r) is not None]
            color = palette(k % palette.N)
            ax.plot(xs, ys, "-" if faults == "emulated" else "--", color=color, alpha=0.85,
                    label=method if len({f for _, f in lines}) == 1 else f"{method} ({faults})")
            for r in points:
                if value(r) is None:
                    continue
                ax.plot(100 * r["churn_rate"], value(r), "o", color=color, markersize=5,
                        markerfacecolor=color if _completed(r) else "white")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("churn rate (%)", fontsize=9)
        ax.set_xticks([100 * c for c in rates])
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if label == "completed rounds":
            totals = {r["rounds_total"] for r in rows}
            if len(totals) == 1:
                total = totals.pop()
                ax.axhline(total, color="0.5", linestyle=":", linewidth=1)
                ax.set_ylim(0, total * 1.08)
        elif "%" in label:
            low = min([value(r) for r in rows if value(r) is not None] + [0.0])
            ax.set_ylim(low - 5 if low < 0 else 0, 100)
        else:
            ax.set_ylim(bottom=0)
    if rows:
        axes[0].legend(fontsize=8)
    if not all(_completed(r) for r in rows + stragglers):
        fig.supxlabel("hollow markers: runs not completed (metrics over the tasks they finished)", fontsize=8)
    fig.suptitle(title or "fcl-emu: churn sweep", fontsize=11)
    return save_figure(fig, Path(path))


def format_table(rows: Sequence[dict[str, Any]], title: str = "bench churn") -> Table:
    table = Table(title=title)
    for name in ("method", "faults", "policy", "churn %", "crash %", "strag. %", "status", "acc. %", "forget. %",
                 "rounds", "MB", "wall s", "left", "rejoined", "dropped", "missed", "to acc. s"):
        table.add_column(name, justify="left" if name in ("method", "faults", "policy", "status") else "right")

    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    for r in rows:
        rounds = "-" if r["rounds_completed"] is None else f"{r['rounds_completed']}/{r['rounds_total']}"
        table.add_row(r["method"], r.get("faults", "emulated"), r.get("aggregation", "sync"),
                      f"{100 * r['churn_rate']:.0f}", f"{100 * r['crash_rate']:.0f}",
                      f"{100 * r.get('stragglers', 0.0):.0f}", r["status"],
                      f(r["average_accuracy"]), f(r["average_forgetting"]), rounds,
                      f(None if r["bytes_total"] is None else r["bytes_total"] / 1e6, "{:.1f}"),
                      f(r["wall_clock_s"], "{:.1f}"), f(r["left"], "{}"), f(r["rejoined"], "{}"),
                      f(r["dropped"], "{}"), f(r["missed_deadline"], "{}"), f(r.get("time_to_accuracy_s"), "{:.1f}"))
    table.caption = ("churn: P(client unavailable in a slot), bernoulli:(1-churn) (containers: P(a node is paused "
                     "for a slot in a round)); crash: P(a client crashes in a round) (containers: P(a node is "
                     "restarted in a round)); acc./forget.: average accuracy and forgetting (docs/metrics.md); "
                     "rounds: completed (not skipped) / total; policy: --aggregation; strag.: share of clients "
                     "10x slower to train; to acc.: emulated s until the seen classes' accuracy first reached "
                     "the target in the first task")
    return table


# ------------------------------------------------------------------ the sweep
@dataclass
class Sweep:
    rows: list[dict[str, Any]]
    csv: Path
    png: Path


def run(methods: Sequence[str], rates: Sequence[float], crash_rate: float, seed: int, out: Path,
        base: dict, console: Console, fault_modes: Sequence[str] = ("emulated",),
        stragglers: Sequence[tuple[str, dict, dict[str, Any]]] = (), target: float = DEFAULT_TARGET) -> Sweep:
    """Run every (method, fault mode, churn rate) point in turn, then the ``stragglers`` points ((run name,
    config, the row's own fields): :func:`fcl_emu.bench.stragglers.points`); a failed run is recorded and the
    sweep goes on."""
    out = Path(out)
    bases = {"emulated": emulated_base(base, out) if "emulated" in fault_modes else base, "containers": base}
    points = [(point_name(m, c, crash_rate, seed, f), m, f, c, crash_rate,
               point_config(bases[f], m, c, crash_rate, seed, f,
                            out / RUNS_DIR / f"{point_name(m, c, crash_rate, seed, f)}.faults.yaml"), {})
              for m in methods for f in fault_modes for c in rates]
    points += [(name, config["method"], "emulated", 0.0, 0.0, config, fields) for name, config, fields in stragglers]
    if not points:
        raise ValueError("nothing to run: give churn --rates or --stragglers")
    first = points[0][5]
    rows: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for n, (name, method, faults, rate, crash, config, fields) in enumerate(points, 1):
        run_dir = (out / RUNS_DIR / name).resolve()
        what = (f"{fields['aggregation']} stragglers {fields['stragglers']:.0%}" if fields else
                f"churn {rate:.0%} crash {crash:g} ({faults})")
        console.print(f"[{n}/{len(points)}] {method} {what} -> {run_dir}", markup=False, highlight=False)
        t0 = time.perf_counter()
        summary, status = run_point(config, run_dir, run_timeout_s(config))
        rounds_total = config["scenario"]["num_tasks"] * config["rounds"]["rounds_per_task"]
        row = row_from_summary(method, rate, crash, seed, rounds_total, run_dir, summary, status, faults)
        row.update(fields, target_accuracy=target, time_to_accuracy_s=time_to_accuracy(run_dir, target))
        rows.append(row)
        acc = "-" if row["average_accuracy"] is None else f"{row['average_accuracy']:.1f}%"
        console.print(f"    {status} in {time.perf_counter() - t0:.0f} s: accuracy {acc}, rounds "
                      f"{row['rounds_completed']}/{rounds_total}", markup=False, highlight=False)
        if status != "completed":
            console.print(log_tail(run_dir), style="yellow", markup=False, highlight=False)
        write_csv(rows, out / CSV_NAME)  # after every point: an interrupted sweep keeps what it measured
    csv_path = write_csv(rows, out / CSV_NAME)
    scale = (f"{first['scenario']['dataset']}, {first['scenario']['num_clients']} clients, "
             f"{first['scenario']['num_tasks']} tasks x {first['rounds']['rounds_per_task']} rounds, "
             f"K={first['rounds']['clients_per_round']}, min {first['rounds']['min_participants']}, "
             f"crash {crash_rate:g}, seed {seed}")
    png = plot_churn(rows, out / PNG_NAME, title=f"fcl-emu churn sweep ({scale})")
    console.print(format_table(rows))
    console.print(f"{len(rows)} runs in {time.perf_counter() - started:.0f} s; wrote {csv_path} and {png}",
                  markup=False, highlight=False)
    return Sweep(rows, csv_path, png)
