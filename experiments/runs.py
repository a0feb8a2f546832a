"""One real ``fcl-emu up`` per table row, and the seed handling, shared by the experiment tables of this package."""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from fcl_emu.monitoring.results import RunSummary

#: The file in a run's directory where :func:`run_up` keeps the CPU time the run took (:func:`host_cpu_s`).
HOST_CPU = "host_cpu.json"


def run_up(name: str, config: dict, data_root: str, out: Path, report_only: bool = False) -> RunSummary | None:
    """Run ``config`` into ``out/<name>`` (coordinator, edge-node processes and GPU workers over ZeroMQ) and
    return its summary; a directory that already holds a ``summary.json`` is read, not run again. None, and the
    run left out of the table: ``report_only`` and no summary yet, or another process is running it now (an
    exclusive lock on ``out/.<name>.lock``: several table commands may share ``out``, one run each at a time).
    A run it starts leaves the CPU time it took in its directory (:func:`host_cpu_s`)."""
    summary = out / name / "summary.json"
    if summary.exists():
        return RunSummary.load(summary)
    if report_only:
        return None
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f".{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{name}: being run by another process; left out of this table", file=sys.stderr, flush=True)
            return None
        if not summary.exists():  # not finished by that other process meanwhile
            path = out / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            cmd = [sys.executable, "-m", "fcl_emu", "up", "--config", str(path), "--data-root", data_root,
                   "--run-dir", str(out / name)]
            print("$", " ".join(cmd), file=sys.stderr, flush=True)
            cpu = run_timed(cmd)
            if (out / name).is_dir():
                (out / name / HOST_CPU).write_text(json.dumps(cpu))
    return RunSummary.load(summary)


def run_timed(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd`` (its stdout discarded) and return the CPU time it took, its waited-for descendants included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"user_s": after.ru_utime - before.ru_utime, "system_s": after.ru_stime - before.ru_stime}


def host_cpu_s(out: Path, name: str) -> float | None:
    """The CPU seconds (user + system) that run ``out/<name>`` took on this host, every process of it (the
    coordinator, its edge nodes and GPU workers, start-up included) as :func:`run_up` measured them; None for a
    run that :func:`run_up` did not start."""
    path = out / name / HOST_CPU
    if not path.exists():
        return None
    cpu = json.loads(path.read_text())
    return cpu["user_s"] + cpu["system_s"]


def add_report_only(parser) -> None:
    """The tables' ``--report-only`` flag (see :func:`run_up`)."""
    parser.add_argument("--report-only", action="store_true",
                        help="build the table from the runs already in --out; start none")


def events(out: Path, name: str) -> list[dict]:
    """The events of run ``out/<name>``."""
    return [json.loads(line) for line in (out / name / "events.jsonl").read_text().splitlines()]


def seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` as a list (the run's seed: class order, partition, sampling and training)."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds takes comma-separated integers, got {text!r}") from None
    if not values or len(set(values)) != len(values):
        raise SystemExit(f"--seeds needs distinct integers, got {text!r}")
    return values


def fraction(text: str) -> float:
    """``--budget 0.125``: a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise SystemExit(f"--budget is a fraction in (0, 1], got {text!r}")
    return value


def method_option(text: str) -> tuple[str, str, object]:
    """``--option mfcl:generator_iterations=200``: a method's option set for every run of that method in a table
    (the value read as YAML: numbers, booleans and strings)."""
    method, sep, rest = text.partition(":")
    key, eq, value = rest.partition("=")
    if not (sep and eq and method and key):
        raise argparse.ArgumentTypeError(f"--option takes METHOD:KEY=VALUE, got {text!r}")
    return method, key, yaml.safe_load(value)


def add_method_options(parser) -> None:
    """The tables' ``--option METHOD:KEY=VALUE`` (repeatable; see :func:`method_option`)."""
    parser.add_argument("--option", type=method_option, action="append", default=[], metavar="METHOD:KEY=VALUE",
                        help="set a method's option in every run of it (after the budget's), e.g. "
                             "mfcl:generator_iterations=200")


def with_options(config: dict, options: list[tuple[str, str, object]]) -> dict:
    """``config`` with the ``--option`` values of its method."""
    mine = {key: value for method, key, value in options if method == config["method"]}
    return {**config, "method_options": {**config.get("method_options", {}), **mine}} if mine else config


def seeded(config: dict, seed: int) -> dict:
    """``config`` with ``seed`` as the run's and the scenario's seed."""
    return {**config, "seed": seed, "scenario": {**config.get("scenario", {}), "seed": seed}}


def spread(values: list[float | None]) -> tuple[float, float] | None:
    """Mean and sample standard deviation (0 for one value) of the values a metric took over the seeds;
    None if any run lacks it."""
    if not values or any(v is None or not math.isfinite(v) for v in values):
        return None
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def pm(values: list[float | None], digits: int = 1) -> str:
    """``mean ± std`` of :func:`spread` for a table cell (``-`` where a run lacks the metric)."""
    s = spread(values)
    return "-" if s is None else f"{s[0]:.{digits}f} ± {s[1]:.{digits}f}"


def grouped(rows: list[dict], key: str = "row") -> list[tuple[str, list[dict], list[dict]]]:
    """Per-seed rows grouped by ``key`` in first-seen order: ``(name, completed runs, other runs)``."""
    names = list(dict.fromkeys(r[key] for r in rows))
    return [(n, [r for r in rows if r[key] == n and r["status"] == "completed"],
             [r for r in rows if r[key] == n and r["status"] != "completed"]) for n in names]


def mean_of(runs: list[dict], field: str, digits: int = 1) -> str:
    """The mean of a field over the runs of one row (costs: bytes, seconds), or ``-``."""
    values = [r[field] for r in runs if r.get(field) is not None]
    return f"{np.mean(values):.{digits}f}" if values else "-"
