"""Several runs side by side: average accuracy, average forgetting, total bytes and wall clock.

``compare_runs`` loads each run directory (``monitoring.run_dir.load_run``, so
a malformed run fails the same way, naming the file), returns a
:class:`Comparison` (one row per run, the notes and warnings to print) and
writes one PNG of four bar charts; ``format_table`` turns the rows into a rich
table for printing.

What is compared, and what is said about it:

- a folder that holds no run (neither summary.json nor events.jsonl: the keys
  a start that did not finish left, say) is skipped with a note;
- a run that did not complete (failed, interrupted, aborted, degraded, or
  partial: no summary.json yet) is left out with a note, unless
  ``include_incomplete``: then it is in the table with its status and in the
  plot hatched and starred, its metrics over the tasks it finished;
- runs whose scenarios differ (dataset, tasks, classes, partition, clients,
  ...) get one warning per differing setting; different seeds are listed in a
  note, as comparing seeds is what repeated runs are for.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rich.table import Table

from fcl_emu.monitoring.plots import new_figure, save_figure
from fcl_emu.monitoring.run_dir import NotARunError, Run, load_run

COMPARE_PNG = "compare.png"
SCENARIO_NAMES = {"dataset": "dataset", "num_tasks": "tasks", "classes_per_task": "classes per task",
                  "classes_first_task": "classes of the first task", "partition": "partition",
                  "num_clients": "clients"}  # the settings users name; any other differs under its own key


@dataclass(frozen=True)
class RunRow:
    """One run in a comparison. Accuracy values are percent; ``None`` where the run finished no task."""

    label: str  # "method/dataset/s<seed> (<run dir name>)", unique within one comparison
    run_dir: Path
    method: str
    dataset: str
    seed: Optional[int]
    status: str
    tasks_finished: int
    num_tasks: int
    average_accuracy: Optional[float]
    average_forgetting: Optional[float]
    bytes_total: int
    wall_clock_s: float
    emulated_s: Optional[float] = None  # emulated clock (None: a --clock real run, or a run before clocks)

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def megabytes(self) -> float:
        return self.bytes_total / 1e6


def _number(v: Optional[float]) -> Optional[float]:
    return None if v is None or math.isnan(v) else float(v)


def _labels(run_dirs: list[Path], bases: list[str]) -> list[str]:
    """``base (dir name)``; where that collides, more of the path, then a counter, so every label is unique."""
    labels = [f"{b} ({d.name})" for b, d in zip(bases, run_dirs)]
    dup = Counter(labels)
    labels = [f"{b} ({d.resolve()})" if dup[lab] > 1 else lab for lab, b, d in zip(labels, bases, run_dirs)]
    seen: Counter = Counter()
    total = Counter(labels)
    out = []
    for lab in labels:
        seen[lab] += 1
        out.append(f"{lab} #{seen[lab]}" if total[lab] > 1 else lab)
    return out


class NothingToCompare(ValueError):
    """No directory given held a run to compare (the notes say why each was left out)."""

    def __init__(self, message: str, notes: list[str]):
        super().__init__(message)
        self.notes = notes


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare_runs` found: the rows, the plot, and one line each of what to tell the user."""

    rows: list[RunRow]
    png: Path
    notes: list[str]  # folders skipped, incomplete runs left out, the seeds compared
    warnings: list[str]  # scenario settings that differ between the runs compared


def _load_comparable(run_dirs: Sequence[Path | str], include_incomplete: bool) -> tuple[list[Run], list[str]]:
    """The runs to compare, in the order given, and a note for each directory left out."""
    runs, notes = [], []
    for d in run_dirs:
        try:  # a path that does not exist (a typo) fails, naming it
            run = load_run(d)
        except NotARunError as exc:
            notes.append(f"skipped {d}: {exc}")
            continue
        if run.completed or include_incomplete:
            runs.append(run)
        else:
            notes.append(f"left out {d}: run not completed (status: {run.status}); --include-incomplete shows it, "
                         f"marked")
    return runs, notes


def scenario_warnings(runs: Sequence[Run]) -> list[str]:
    """One line per scenario setting (the seed aside) on which the runs differ, naming the values."""
    keys = list(dict.fromkeys(k for run in runs for k in run.summary.scenario if k != "seed"))
    warnings = []
    for key in keys:
        values: dict[str, list[str]] = {}
        for run in runs:
            if key in run.summary.scenario:
                values.setdefault(repr(run.summary.scenario[key]), []).append(run.run_dir.name)
        if len(values) > 1:
            listed = "; ".join(f"{v} ({', '.join(names)})" for v, names in values.items())
            warnings.append(f"the runs differ in scenario: {SCENARIO_NAMES.get(key, key)}: {listed}")
    return warnings


def _seed_note(runs: Sequence[Run]) -> list[str]:
    seeds = list(dict.fromkeys(run.summary.seed for run in runs))
    return [f"seeds: {', '.join('?' if s is None else str(s) for s in seeds)}"] if len(seeds) > 1 else []


def compare_runs(run_dirs: Sequence[Path | str], out_dir: Path | str,
                 include_incomplete: bool = False) -> Comparison:
    """One row per run (in the order given) and ``out_dir/compare.png`` with four side-by-side bar charts.
    Raises :class:`NothingToCompare` when no directory holds a run to compare."""
    if not run_dirs:
        raise ValueError("compare_runs needs at least one run directory")
    runs, notes = _load_comparable(run_dirs, include_incomplete)
    if not runs:
        raise NothingToCompare("no run to compare" + ("" if include_incomplete else
                                                      " (runs not completed are left out without "
                                                      "--include-incomplete)"), notes)
    labels = _labels([r.run_dir for r in runs], [r.label for r in runs])
    rows = [
        RunRow(
            label=label,
            run_dir=run.run_dir,
            method=run.summary.method,
            dataset=run.summary.dataset,
            seed=run.summary.seed,
            status=run.summary.status,
            tasks_finished=len(run.summary.accuracy_matrix),
            num_tasks=run.num_tasks,
            average_accuracy=_number(run.summary.average_accuracy),
            average_forgetting=_number(run.summary.average_forgetting),
            bytes_total=run.summary.bytes_total,
            wall_clock_s=run.summary.wall_clock_s,
            emulated_s=run.summary.emulated_s,
        )
        for run, label in zip(runs, labels)
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return Comparison(rows, plot_comparison(rows, out / COMPARE_PNG), notes + _seed_note(runs),
                      scenario_warnings(runs))


QUANTITIES = [  # (title, value, format, percent scale)
    ("average accuracy (%)", lambda r: r.average_accuracy, "{:.1f}", True),
    ("average forgetting (%)", lambda r: r.average_forgetting, "{:.1f}", True),
    ("total bytes (MB)", lambda r: r.megabytes, "{:.1f}", False),
    ("wall clock (s)", lambda r: r.wall_clock_s, "{:.1f}", False),
]


def plot_comparison(rows: list[RunRow], path: Path) -> Path:
    """Four horizontal bar charts sharing the run axis (one colour per run); runs not completed are
    hatched and starred."""
    from matplotlib import colormaps

    n = len(rows)
    palette = colormaps["tab10" if n <= 10 else "tab20"]
    colors = [palette(k % palette.N) for k in range(n)]
    fig = new_figure(15, 1.6 + 0.45 * n)
    axes = fig.subplots(1, len(QUANTITIES), sharey=True)
    ys = list(range(n))
    names = [r.label + ("" if r.completed else " *") for r in rows]
    for ax, (title, value, fmt, percent) in zip(axes, QUANTITIES):
        values = [value(r) for r in rows]
        bars = ax.barh(ys, [v or 0.0 for v in values], color=colors, height=0.6)
        for bar, row, v in zip(bars, rows, values):
            if not row.completed:
                bar.set_hatch("//")
                bar.set_edgecolor("white")
            right = v is None or v >= 0
            ax.annotate("n/a" if v is None else fmt.format(v), (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                        xytext=(3 if right else -3, 0), textcoords="offset points", va="center",
                        ha="left" if right else "right", fontsize=8)
        top = max([v for v in values if v is not None] + [100.0 if percent else 0.0])
        ax.set_xlim(min([v for v in values if v is not None] + [0.0]) * 1.25, top * 1.2 if top > 0 else 1.0)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys, names, fontsize=8)
    axes[0].invert_yaxis()  # first run on top
    if not all(r.completed for r in rows):
        fig.supxlabel("* run not completed (hatched): metrics over the tasks it finished", fontsize=8)
    fig.suptitle("fcl-emu runs compared")
    return save_figure(fig, path)


def format_table(rows: Sequence[RunRow]) -> Table:
    """The comparison as a rich table (one line per run)."""
    table = Table(title="fcl-emu runs compared")
    table.add_column("run", overflow="fold")
    table.add_column("status", overflow="fold")
    table.add_column("tasks", justify="right", no_wrap=True)
    table.add_column("acc. %", justify="right", no_wrap=True)
    table.add_column("forget. %", justify="right", no_wrap=True)
    table.add_column("MB", justify="right", no_wrap=True)
    table.add_column("wall s", justify="right", no_wrap=True)
    table.add_column("emulated s", justify="right", no_wrap=True)
    table.caption = ("acc.: average accuracy, forget.: average forgetting (docs/metrics.md); MB: total bytes / 1e6; "
                     "wall: the host's clock, emulated: the federation's (docs/edge.md; - under --clock real)")

    def pct(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.2f}"

    if not all(r.completed for r in rows):
        table.caption += "; * run not completed: its metrics cover the tasks it finished"
    for r in rows:
        table.add_row(r.label + ("" if r.completed else " *"), r.status, f"{r.tasks_finished}/{r.num_tasks}",
                      pct(r.average_accuracy), pct(r.average_forgetting), f"{r.megabytes:.1f}", f"{r.wall_clock_s:.1f}",
                      "-" if r.emulated_s is None else f"{r.emulated_s:.1f}")
    return table
