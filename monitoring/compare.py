"""Several runs side by side: average accuracy, average forgetting, bytes (per tier under edge aggregators) and
wall clock.

``compare_runs`` loads each run directory (``monitoring.run_dir.load_run``, so
a malformed run fails the same way, naming the file), returns a
:class:`Comparison` (one row per run, the notes and warnings to print) and
writes one PNG of bar charts; ``format_table`` turns the rows into what the
console prints: what every run shares once, a table of the numbers, a line per
run with what differs.

What is compared, and what is said about it:

- a folder that holds no run (neither summary.json nor events.jsonl: the keys
  a start that did not finish left, say) is skipped with a note;
- a run that did not complete (failed, interrupted, aborted, degraded, or
  partial: no summary.json yet) is left out with a note, unless
  ``include_incomplete``: then it is in the table with its status and in the
  plot hatched and starred, its metrics over the tasks it finished;
- runs whose scenarios differ (dataset, tasks, classes, partition, clients,
  ...) get one warning per differing setting; different seeds are listed in a
  note, as comparing seeds is what repeated runs are for;
- runs whose system settings differ (rounds and aggregation, churn and
  devices, security and privacy, deployment: config.yaml's, through
  :mod:`fcl_emu.monitoring.settings_diff`) get one warning per setting, as
  then the comparison is not of the method alone; methods and their options
  are what a comparison varies, and are not warned about;
- given the defaults, the settings every run changed alike are named once
  (:attr:`Comparison.shared_settings`) and each run's own line names the others
  it did not leave at their default.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from fcl_emu.monitoring.plots import emulated, new_figure, no_data, save_figure, task_end_times
from fcl_emu.monitoring.results import LinkBytes
from fcl_emu.monitoring.run_dir import NotARunError, Run, load_run
from fcl_emu.monitoring.settings_diff import (Defaults, Setting, non_default_settings, settings_text,
                                              system_differences)

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
    # the settings not at their default but those every run shares (None: no defaults given)
    settings: Optional[str] = None
    # (seconds since the start, accuracy on seen classes) at each evaluation, on the host's and the emulated clock
    host_curve: tuple[tuple[float, float], ...] = ()
    emulated_curve: tuple[tuple[float, float], ...] = ()
    links: Optional[LinkBytes] = None  # bytes per kind of link (None: not known, a partial run)

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def megabytes(self) -> float:
        return self.bytes_total / 1e6

    @property
    def tiered(self) -> bool:
        """Whether the run had edge aggregators: its coordinator's links and its clients' carried different bytes."""
        return self.links is not None and self.links.tiers > 1

    @property
    def coordinator_megabytes(self) -> Optional[float]:
        return None if self.links is None else self.links.coordinator.total / 1e6

    @property
    def client_link_megabytes(self) -> Optional[float]:
        return None if self.links is None else self.links.clients.total / 1e6


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
    warnings: list[str]  # scenario and system settings that differ between the runs compared
    shared_settings: Optional[str] = None  # the settings not at their default that every run shares (None: none)


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


def system_warnings(runs: Sequence[Run]) -> list[str]:
    """One line per system setting (config.yaml's rounds and aggregation, churn and devices, security and
    privacy, deployment) on which the runs with a config.yaml differ, naming the values."""
    found = system_differences([(run.run_dir.name, run.config) for run in runs if run.config is not None])
    warnings = []
    for setting, values in found:
        listed = "; ".join(f"{v} ({', '.join(names)})" for v, names in values.items())
        warnings.append(f"the runs differ in {setting.group}: {setting.name}: {listed}")
    return warnings


def accuracy_over_time(run: Run) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(seconds since the start, accuracy on seen classes) at each evaluation (the rounds that evaluated, the task
    ends), on the host's clock and on the emulated one (a task end at the close of its last round; none for a run
    on the real clock)."""
    def points(clock: str, ends: list[tuple[int, float]]) -> list[tuple[float, float]]:
        seen = {e["task"]: e["accuracy_seen"] for e in run.task_ends if e["accuracy_seen"] is not None}
        found = [(r[clock], r["accuracy_seen"]) for r in run.rounds if r["accuracy_seen"] is not None]
        return sorted(found + [(t, seen[task]) for task, t in ends if task in seen])

    host = points("time", task_end_times(run, "time"))
    return host, (points("emulated_clock_s", task_end_times(run, "emulated_clock_s")) if emulated(run) else [])


def _settings(runs: Sequence[Run], defaults: Optional[Defaults]) -> tuple[list[Optional[str]], Optional[str]]:
    """Each run's settings not at their default, but those every run shares; and those (None: none shared, or no
    defaults given, or a run without config.yaml)."""
    if defaults is None:
        return [None] * len(runs), None
    changed: list[Optional[list[Setting]]] = [None if run.config is None else
                                              non_default_settings(run.config, defaults(run.config)) for run in runs]
    shared = ([] if len(runs) < 2 or None in changed else
              [s for s in changed[0] if all(s in others for others in changed[1:])])
    own = ["- (no config.yaml)" if settings is None else settings_text([s for s in settings if s not in shared])
           for settings in changed]
    return own, settings_text(shared) if shared else None


def _seed_note(runs: Sequence[Run]) -> list[str]:
    seeds = list(dict.fromkeys(run.summary.seed for run in runs))
    return [f"seeds: {', '.join('?' if s is None else str(s) for s in seeds)}"] if len(seeds) > 1 else []


def compare_runs(run_dirs: Sequence[Path | str], out_dir: Path | str, include_incomplete: bool = False,
                 defaults: Optional[Defaults] = None) -> Comparison:
    """One row per run (in the order given) and ``out_dir/compare.png`` (:func:`plot_comparison`). With
    ``defaults`` (a run's config.yaml -> its defaults: :func:`fcl_emu.runconfig.defaults.defaults_for`) each row
    names the settings the run did not leave at their default. Raises :class:`NothingToCompare` when no directory
    holds a run to compare."""
    if not run_dirs:
        raise ValueError("compare_runs needs at least one run directory")
    runs, notes = _load_comparable(run_dirs, include_incomplete)
    if not runs:
        raise NothingToCompare("no run to compare" + ("" if include_incomplete else
                                                      " (runs not completed are left out without "
                                                      "--include-incomplete)"), notes)
    labels = _labels([r.run_dir for r in runs], [r.label for r in runs])
    settings, shared_settings = _settings(runs, defaults)
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
            settings=own,
            host_curve=tuple(host),
            emulated_curve=tuple(emulated_curve),
            links=run.summary.link_bytes,
        )
        for run, label, own, (host, emulated_curve) in zip(runs, labels, settings, map(accuracy_over_time, runs))
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return Comparison(rows, plot_comparison(rows, out / COMPARE_PNG), notes + _seed_note(runs),
                      scenario_warnings(runs) + system_warnings(runs), shared_settings)


ACCURACIES = [  # (title, value, format, percent scale)
    ("average accuracy (%)", lambda r: r.average_accuracy, "{:.1f}", True),
    ("average forgetting (%)", lambda r: r.average_forgetting, "{:.1f}", True),
]
BYTES = [("total bytes (MB)", lambda r: r.megabytes, "{:.1f}", False)]
TIER_BYTES = [  # some run had edge aggregators: each tier's links
    ("bytes at the coordinator (MB)", lambda r: r.coordinator_megabytes, "{:.1f}", False),
    ("bytes on clients' links (MB)", lambda r: r.client_link_megabytes, "{:.1f}", False),
]
TIMES = [
    ("wall clock (s)", lambda r: r.wall_clock_s, "{:.1f}", False),
    ("emulated time (s)", lambda r: r.emulated_s, "{:.1f}", False),
]


def quantities(rows: Sequence[RunRow]) -> list:
    """The bar charts' quantities: bytes per tier where some run had edge aggregators, else in all."""
    return ACCURACIES + (TIER_BYTES if any(r.tiered for r in rows) else BYTES) + TIMES
CLOCKS = [  # (curve, x-axis label, title, what a figure without such a run says)
    ("host_curve", "host time since start (s, wall clock)", "over the host's time", "no evaluation recorded"),
    ("emulated_curve", "emulated time since start (s)", "over the federation's (emulated) time",
     "no run on the emulated clock"),
]


def plot_comparison(rows: list[RunRow], path: Path) -> Path:
    """Five horizontal bar charts (six: bytes per tier) sharing the run axis (one colour per run; runs not completed
    hatched and starred) over two line charts of the accuracy on seen classes against the host's clock and the
    emulated one."""
    from matplotlib import colormaps

    n = len(rows)
    palette = colormaps["tab10" if n <= 10 else "tab20"]
    colors = [palette(k % palette.N) for k in range(n)]
    bars_height = 1.6 + 0.45 * n
    fig = new_figure(15, bars_height + 3.6)
    top, bottom = fig.subfigures(2, 1, height_ratios=[bars_height, 3.6])
    shown = quantities(rows)
    axes = top.subplots(1, len(shown), sharey=True)
    ys = list(range(n))
    names = [r.label + ("" if r.completed else " *") for r in rows]
    for ax, (title, value, fmt, percent) in zip(axes, shown):
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
        top_value = max([v for v in values if v is not None] + [100.0 if percent else 0.0])
        ax.set_xlim(min([v for v in values if v is not None] + [0.0]) * 1.25,
                    top_value * 1.2 if top_value > 0 else 1.0)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys, names, fontsize=8)
    axes[0].invert_yaxis()  # first run on top
    if not all(r.completed for r in rows):
        top.supxlabel("* run not completed (hatched): metrics over the tasks it finished", fontsize=8)
    for ax, (curve, xlabel, title, empty) in zip(bottom.subplots(1, len(CLOCKS)), CLOCKS):
        drawn = [(row, color) for row, color in zip(rows, colors) if getattr(row, curve)]
        if not drawn:
            no_data(ax, empty)
        for row, color in drawn:
            xs, accuracies = zip(*getattr(row, curve))
            ax.plot(xs, accuracies, marker="o", color=color, markersize=3, linestyle="-" if row.completed else "--")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy on seen classes (%)")
        ax.set_title(f"accuracy {title} (colours: the runs above)", fontsize=10)
        if drawn:
            ax.set_ylim(0, 105)
            ax.grid(alpha=0.3)
    fig.suptitle("fcl-emu runs compared")
    return save_figure(fig, path)


def format_table(rows: Sequence[RunRow], shared_settings: Optional[str] = None) -> RenderableType:
    """The comparison for the console, narrow enough for 80 columns: what every run shares said once (a status all
    have; ``shared_settings``, the settings not at their default that every run changed alike), a table of the
    numbers with one line a run (bytes one column, or one a tier where some run had edge aggregators), then a key
    of the runs by their number with what differs per run (the status, the other settings not at their
    default)."""
    statuses = {r.status for r in rows}
    tiered = any(r.tiered for r in rows)
    emulated_clock = any(r.emulated_s is not None for r in rows)
    table = Table(title="fcl-emu runs compared")
    table.add_column("#", justify="right", no_wrap=True)
    for name in ("tasks", "acc %", "forget %", *(("MB coord", "MB clients") if tiered else ("MB",)), "wall s",
                 *(("emul. s",) if emulated_clock else ())):
        table.add_column(name, justify="right", no_wrap=True)

    def number(v: Optional[float], fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    for k, r in enumerate(rows, start=1):
        megabytes = [r.coordinator_megabytes, r.client_link_megabytes] if tiered else [r.megabytes]
        table.add_row(str(k), f"{r.tasks_finished}/{r.num_tasks}", number(r.average_accuracy, "{:.2f}"),
                      number(r.average_forgetting, "{:.2f}"), *map(number, megabytes), number(r.wall_clock_s),
                      *([number(r.emulated_s)] if emulated_clock else []))
    lines = [f"status of every run: {next(iter(statuses))}"] if len(statuses) == 1 else []
    if shared_settings:
        lines.append(f"settings (not default) of every run: {shared_settings}")
    key = []
    for k, r in enumerate(rows, start=1):
        line = f"{k}  {r.label}" + ("" if r.completed else " *") + (f": {r.status}" if len(statuses) > 1 else "")
        if r.settings is not None:
            line += f"; {'other settings' if shared_settings else 'settings (not default)'}: {r.settings}"
        key.append(line)
    notes = ["acc: average accuracy, forget: average forgetting (docs/metrics.md)",
             "MB coord: bytes at the coordinator, MB clients: on the clients' links, both ways / 1e6 "
             "(docs/hierarchy.md; in a star they are the same links)" if tiered else "MB: total bytes / 1e6",
             "wall: the host's clock" + (", emul.: the federation's, emulated (docs/edge.md; - under --clock real)"
                                         if emulated_clock else "")]
    if not all(r.completed for r in rows):
        notes.append("* run not completed: its metrics cover the tasks it finished")
    return Group(*map(Text, lines), table, *map(Text, key), Text("; ".join(notes), style="dim"))
