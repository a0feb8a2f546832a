"""Report of one run directory: PNG plots (:mod:`fcl_emu.monitoring.plots`) and ``report.md``, a short Markdown
summary linking them. The metrics are defined in docs/metrics.md.

A run not completed (failed, interrupted, or partial: no summary.json yet; a partial accuracy matrix, no rounds
at all) still gets a full set of files, its status at the top of report.md: plots without data say so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from fcl_emu.monitoring.plots import (emulated, plot_accuracy_matrix, plot_accuracy_seen, plot_bytes_per_round,
                                      plot_online_clients, plot_round_phases)
from fcl_emu.monitoring.run_dir import Run, load_run
from fcl_emu.monitoring.results import RunSummary, energy_text, epsilon_text, link_rows, link_text
from fcl_emu.monitoring.settings_diff import Defaults, non_default_settings, settings_text

PLOTS = {
    "accuracy_matrix": "accuracy_matrix.png",
    "accuracy_seen": "accuracy_seen.png",
    "bytes_per_round": "bytes_per_round.png",
    "round_phases": "round_phases.png",
    "online_clients": "online_clients.png",
}
REPORT = "report.md"


def _pct(v: Optional[float]) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _scenario_text(run: Run) -> str:
    sc = run.summary.scenario
    parts = []
    if "num_tasks" in sc:
        parts.append(f"{sc['num_tasks']} tasks")
    if "num_clients" in sc:
        parts.append(f"{sc['num_clients']} clients")
    if sc.get("partition"):
        beta = f" (β={sc.get('dirichlet_beta')})" if sc["partition"] == "dirichlet" else ""
        parts.append(f"{sc['partition']} partition{beta}")
    rounds = (run.config or {}).get("rounds") or {}
    if isinstance(rounds, dict):
        if "clients_per_round" in rounds:
            parts.append(f"{rounds['clients_per_round']} per round")
        if "rounds_per_task" in rounds:
            parts.append(f"{rounds['rounds_per_task']} rounds per task")
    return ", ".join(parts) or "–"


def _settings_rows(run: Run, defaults: Optional[Defaults]) -> list[tuple[str, str]]:
    """The run's epsilon (DP runs) and, given the defaults, the settings it changed."""
    rows = [] if run.summary.privacy is None else [("epsilon (delta)", epsilon_text(run.summary.privacy))]
    if defaults is not None:
        changed = ("– (no config.yaml)" if run.config is None
                   else settings_text(non_default_settings(run.config, defaults(run.config))))
        rows.append(("settings (not default)", changed))
    return rows


def summary_rows(run: Run, defaults: Optional[Defaults] = None) -> list[tuple[str, str]]:
    """The report's table; ``defaults`` (a run's config.yaml -> its defaults) adds the settings not default."""
    s = run.summary
    c = s.clients
    model = f" ({s.model})" if s.model and s.model != "auto" else ""
    return [
        ("status", s.status),
        ("method", f"{s.method}{model}"),
        ("dataset", s.dataset),
        ("scenario", _scenario_text(run)),
        ("seed", "–" if s.seed is None else str(s.seed)),
        ("tasks finished", f"{len(s.accuracy_matrix)} of {run.num_tasks}"),
        ("average accuracy (%)", _pct(s.average_accuracy)),
        ("average incremental accuracy (%)", _pct(s.average_incremental_accuracy)),
        ("average forgetting (%)", _pct(s.average_forgetting)),
        *((name, link_text(link, s.bytes_total)) for name, link in link_rows(s)),
        ("rounds (skipped)", f"{s.rounds} ({s.rounds_skipped})"),
        ("wall clock (s)", f"{s.wall_clock_s:.1f}"),
        ("emulated time (s)", "– (real clock)" if s.emulated_s is None else f"{s.emulated_s:.1f}"),
        ("clients' energy (compute share)", "–" if s.energy_joules is None else energy_text(s.energy_joules)),
        ("clients joined / left / dropped",
         "– / – / –" if c is None else f"{c.joined} / {c.left} / {c.dropped}"),
        ("missed deadline / late updates", f"{s.missed_deadline} / {s.late_updates}"),
        ("rejected messages", str(sum(s.rejected_messages.values()))),
        *_settings_rows(run, defaults),
    ]


def write_report(run: Run | Path | str, out_dir: Path | str | None = None,
                 defaults: Optional[Defaults] = None) -> Path:
    """Write the five PNG plots and ``report.md`` of a run (loaded, or its directory) into ``out_dir`` (default
    ``<run_dir>/report/``); return the path of ``report.md``. With ``defaults`` (a run's config.yaml -> its
    defaults: :func:`fcl_emu.runconfig.defaults.defaults_for`) the table lists the settings not at their default.
    Raises ``RunDirError`` for a directory that is not a readable run."""
    run = run if isinstance(run, Run) else load_run(run)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plot_accuracy_matrix(run, out / PLOTS["accuracy_matrix"])
    plot_accuracy_seen(run, out / PLOTS["accuracy_seen"])
    plot_bytes_per_round(run, out / PLOTS["bytes_per_round"])
    plot_round_phases(run, out / PLOTS["round_phases"])
    plot_online_clients(run, out / PLOTS["online_clients"])
    path = out / REPORT
    path.write_text(_markdown(run, defaults))
    return path


def _tiers_note(s: RunSummary) -> str:
    """Under edge aggregators: what the per-type bytes count, against what the coordinator's links carried."""
    if s.link_bytes is None or s.link_bytes.tiers == 1:
        return ""
    links = s.link_bytes
    return (f" With edge aggregators a message to a client is counted as its own link carried it, so these "
            f"{s.bytes_total / 1e6:.1f} MB add the clients' downloads to the aggregators' uploads, which no link "
            f"carried: the coordinator's links carried {links.coordinator.total / 1e6:.1f} MB (a round's model "
            f"once per aggregator), the clients' links {links.clients.total / 1e6:.1f} MB.")


def _markdown(run: Run, defaults: Optional[Defaults]) -> str:
    s = run.summary
    lines = [f"# fcl-emu run: {s.method} on {s.dataset}", "", f"Run directory: `{run.run_dir}`", ""]
    if not run.completed:
        lines += [f"> **Run not completed** (status: {s.status}): {len(s.accuracy_matrix)} of "
                  f"{run.num_tasks} tasks finished, {len(run.rounds)} rounds recorded. The metrics below "
                  f"cover the finished tasks only.", ""]
    lines += ["| metric | value |", "| --- | --- |"]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in summary_rows(run, defaults)]
    per_round = sum(r["bytes_sent"] + r["bytes_received"] for r in run.rounds)
    on_emulated = emulated(run)
    lines += [
        "",
        "Metric definitions: `docs/metrics.md` in the fcl-emu repository.",
        "",
        "## Accuracy matrix",
        "",
        f"![accuracy matrix]({PLOTS['accuracy_matrix']})",
        "",
        "Accuracy (%) of the global model after each task (rows) on each task's test classes (columns), "
        "predicting over all classes seen so far; blank cells are tasks not yet seen or not run.",
        "",
        "## Accuracy on seen classes",
        "",
        f"![accuracy on seen classes]({PLOTS['accuracy_seen']})",
        "",
        "Accuracy on all test samples of the classes seen so far, after each task (line) and at the rounds "
        "where the run evaluated during a task (hollow points).",
        "",
        "## Bytes per round",
        "",
        f"![bytes per round]({PLOTS['bytes_per_round']})",
        "",
        f"Bytes in each round by message type, sent and received by the coordinator, each message counted "
        f"whole. The rounds account for {per_round / 1e6:.1f} of the run's {s.bytes_total / 1e6:.1f} MB so "
        f"counted; the rest is traffic outside rounds (joins, heartbeats between rounds, shutdown)."
        + _tiers_note(s),
        "",
        "## Round wall-clock by phase",
        "",
        f"![round wall-clock by phase]({PLOTS['round_phases']})",
        "",
        "Each bar is one round's duration split by phase. `receive_updates` (receiving, validating and "
        "decoding updates) happens inside `collect`, so collect is drawn as *waiting* = collect − "
        "receive_updates plus receive_updates, not counted twice; *other* is what no phase covers. "
        + ("The run's clock is emulated: these are the host's seconds, the work it did, not the federation's "
           "time (the emulated time above)." if on_emulated else "Host seconds, the run's clock."),
        "",
        "## Online clients",
        "",
        f"![online clients]({PLOTS['online_clients']})",
        "",
        f"Online clients over {'emulated' if on_emulated else 'host'} time (the run's clock), with the clients "
        f"selected for each round and those whose update was used.",
        "",
    ]
    return "\n".join(lines)
