"""Report of one run directory: PNG plots and a short Markdown summary.

``load_run`` reads and validates a run directory (``summary.json``,
``events.jsonl`` and, when readable, ``config.yaml``); ``write_report`` draws
five plots from it and writes ``report.md`` linking them. The metrics are
defined in docs/metrics.md.

An interrupted run (status not ``completed``, a partial accuracy matrix, no
rounds at all) still gets a full set of files: plots without data say so.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so making a
report neither needs a display nor changes the caller's matplotlib backend.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from monitoring.results import RoundRecord

SUMMARY = "summary.json"
EVENTS = "events.jsonl"
CONFIG = "config.yaml"

PLOTS = {
    "accuracy_matrix": "accuracy_matrix.png",
    "accuracy_seen": "accuracy_seen.png",
    "bytes_per_round": "bytes_per_round.png",
    "round_phases": "round_phases.png",
    "online_clients": "online_clients.png",
}
REPORT = "report.md"
DPI = 110


class RunDirError(ValueError):
    """A directory that is not a readable run directory; the message names the file and the run dir."""

    def __init__(self, message: str, run_dir: Path, file: Optional[str] = None, line: Optional[int] = None):
        super().__init__(message)
        self.run_dir = run_dir
        self.file = file
        self.line = line


# ------------------------------------------------------------------ loading
class _Summary(BaseModel):
    """The keys of summary.json the reports read; every other key is kept as is."""

    model_config = ConfigDict(extra="allow")

    status: str
    method: str
    dataset: str
    seed: Optional[int] = None
    scenario: dict[str, Any] = {}
    accuracy_matrix: list[list[Optional[float]]]
    accuracy_seen: list[float] = []
    average_accuracy: Optional[float] = None
    average_incremental_accuracy: Optional[float] = None
    average_forgetting: Optional[float] = None
    bytes_total: int
    rounds: int
    rounds_skipped: int = 0
    wall_clock_s: float
    clients: dict[str, int] = {}
    missed_deadline: int = 0
    late_updates: int = 0
    rejected_messages: dict[str, int] = {}


class _Timed(BaseModel):
    time: float


class _TaskEnd(_Timed):
    task: int
    accuracy: list[float]
    accuracy_seen: Optional[float] = None


_ROUND = TypeAdapter(RoundRecord)
_TIMED = TypeAdapter(_Timed)
_TASK_END = TypeAdapter(_TaskEnd)


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())


@dataclass
class Run:
    """A loaded run directory. ``rounds`` and ``task_ends`` are the validated event records, in file order."""

    summary: dict[str, Any]
    rounds: list[dict[str, Any]]
    task_ends: list[dict[str, Any]]
    run_dir: Path
    config: Optional[dict[str, Any]] = None  # config.yaml, when present and readable
    start: Optional[dict[str, Any]] = None  # the `start` event, when there is one

    @property
    def status(self) -> str:
        return self.summary["status"]

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def num_tasks(self) -> int:
        """Tasks in the scenario (falls back to the width of the accuracy matrix)."""
        n = self.summary.get("scenario", {}).get("num_tasks")
        widths = [len(row) for row in self.summary["accuracy_matrix"]]
        return int(n) if isinstance(n, int) and n > 0 else max(widths + [len(self.summary["accuracy_matrix"]), 0])

    @property
    def label(self) -> str:
        seed = self.summary.get("seed")
        return f"{self.summary['method']}/{self.summary['dataset']}/s{seed if seed is not None else '?'}"


def load_run(run_dir: Path | str) -> Run:
    """Read and validate a run directory; raise ``RunDirError`` naming the file (and line) at fault."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"not a run directory: {run_dir} does not exist or is not a directory", run_dir)
    summary_path, events_path = run_dir / SUMMARY, run_dir / EVENTS
    if not summary_path.exists() and not events_path.exists():
        raise RunDirError(f"not a run directory: {run_dir} has neither {SUMMARY} nor {EVENTS}", run_dir)
    summary = _load_summary(run_dir, summary_path)
    rounds, task_ends, start = _load_events(run_dir, events_path)
    return Run(summary=summary, rounds=rounds, task_ends=task_ends, run_dir=run_dir,
               config=_load_config(run_dir / CONFIG), start=start)


def _load_summary(run_dir: Path, path: Path) -> dict[str, Any]:
    if not path.exists():
        raise RunDirError(f"{SUMMARY} missing in run directory {run_dir} "
                          f"(the run may have been killed before writing it)", run_dir, SUMMARY)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{SUMMARY} in run directory {run_dir} is not valid JSON: {exc}", run_dir, SUMMARY) from exc
    if not isinstance(data, dict):
        raise RunDirError(f"{SUMMARY} in run directory {run_dir} is not a JSON object", run_dir, SUMMARY)
    try:
        return _Summary.model_validate(data).model_dump()
    except ValidationError as exc:
        raise RunDirError(f"{SUMMARY} in run directory {run_dir} is malformed: {_errors(exc)}",
                          run_dir, SUMMARY) from exc


def _load_events(run_dir: Path, path: Path) -> tuple[list[dict], list[dict], Optional[dict]]:
    if not path.exists():
        raise RunDirError(f"{EVENTS} missing in run directory {run_dir}", run_dir, EVENTS)
    rounds: list[dict] = []
    task_ends: list[dict] = []
    start = None
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as exc:
        raise RunDirError(f"{EVENTS} in run directory {run_dir} is not UTF-8 text: {exc}", run_dir, EVENTS) from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue

        def bad(why: str) -> RunDirError:
            return RunDirError(f"{EVENTS} line {number} in run directory {run_dir}: {why}", run_dir, EVENTS, number)

        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise bad(f"not valid JSON ({exc})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            raise bad('not an event record (a JSON object with an "event" string)')
        kind = record["event"]
        try:
            if kind == "round":
                _TIMED.validate_python(record)
                _ROUND.validate_python({k: v for k, v in record.items() if k not in ("event", "time")})
                rounds.append(record)
            elif kind == "task_end":
                task_ends.append(_TASK_END.validate_python(record).model_dump())
            elif kind == "start" and start is None:
                start = record
        except ValidationError as exc:
            raise bad(f"malformed {kind!r} event: {_errors(exc)}") from exc
    # a resumed run (docs/resume.md) may have logged the round in flight, or a task end, twice: keep the last
    rounds = list({r["round"]: r for r in rounds}.values())
    task_ends = list({t["task"]: t for t in task_ends}.values())
    return rounds, task_ends, start


def _load_config(path: Path) -> Optional[dict[str, Any]]:
    """config.yaml only adds detail (clients per round, rounds per task): unreadable means absent."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------ plotting helpers
def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _task_spans(rounds: list[dict]) -> list[tuple[int, int, int]]:
    """(task, first round, last round) in order of appearance."""
    spans: dict[int, list[int]] = {}
    for r in rounds:
        spans.setdefault(r["task"], []).append(r["round"])
    return [(t, min(rs), max(rs)) for t, rs in spans.items()]


def _mark_tasks(ax, rounds: list[dict]) -> None:
    """Dotted lines between tasks and a 'task k' label over each (x axis: global round index)."""
    spans = _task_spans(rounds)
    every = max(1, math.ceil(len(spans) / 30))  # keep the labels legible with many tasks
    for i, (task, first, last) in enumerate(spans):
        if i:
            ax.axvline(first - 0.5, color="0.6", linestyle=":", linewidth=1)
        if i % every == 0:
            text = f"task {task + 1}" if len(spans) <= 8 else f"{task + 1}"
            ax.text((first + last) / 2, 1.0, text, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8 if len(spans) <= 15 else 6, color="0.35")


def _round_axis(ax, rounds: list[dict]) -> None:
    """Integer ticks over all recorded rounds, and the task boundaries."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if rounds:
        xs = sorted({r["round"] for r in rounds})
        ax.set_xlim(xs[0] - 0.6, xs[-1] + 0.6)
        if len(xs) <= 20:
            ax.set_xticks(xs)
    _mark_tasks(ax, rounds)


# ------------------------------------------------------------------ the five plots
def plot_accuracy_matrix(run: Run, path: Path) -> Path:
    """Heatmap of A[t][i] (rows: after task t, columns: task i's classes); null and not-run cells blank."""
    matrix = run.summary["accuracy_matrix"]
    n = max(run.num_tasks, 1)
    values = np.full((n, n), np.nan)
    for t, row in enumerate(matrix[:n]):
        for i, a in enumerate(row[:n]):
            if a is not None:
                values[t, i] = a
    size = min(3.0 + 0.55 * n, 14.0)
    fig = new_figure(size + 2.4, size)
    ax = fig.add_subplot()
    cmap = _cmap("viridis").with_extremes(bad="white")
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0, vmax=100)
    fig.colorbar(image, ax=ax, label="accuracy (%)", shrink=0.85)
    if n <= 30:
        fontsize = 9 if n <= 8 else 7 if n <= 15 else 5
        fmt = "{:.1f}" if n <= 12 else "{:.0f}"
        for t in range(n):
            for i in range(n):
                if not np.isnan(values[t, i]):
                    v = values[t, i]
                    ax.text(i, t, fmt.format(v), ha="center", va="center", fontsize=fontsize,
                            color="black" if v > 60 else "white")
    labels = [str(k + 1) for k in range(n)]
    ax.set_xticks(range(n), labels)
    ticks = [f"{k + 1}" + ("" if k < len(matrix) else " (not run)") for k in range(n)]
    ax.set_yticks(range(n), ticks)
    ax.set_xticks(np.arange(-0.5, n), minor=True)
    ax.set_yticks(np.arange(-0.5, n), minor=True)
    ax.grid(which="minor", color="0.85", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("accuracy on the classes of task")
    ax.set_ylabel("after training task")
    ax.set_title(f"Accuracy matrix: {run.summary['method']} on {run.summary['dataset']}")
    return save_figure(fig, path)


def _cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name].copy()


def _task_end_points(run: Run) -> list[tuple[int, float, float]]:
    """(task, x = last round of the task, accuracy on seen classes) after each finished task."""
    seen = {e["task"]: e["accuracy_seen"] for e in run.task_ends if e["accuracy_seen"] is not None}
    for t, a in enumerate(run.summary.get("accuracy_seen") or []):
        seen.setdefault(t, a)
    last_round = {task: last for task, _, last in _task_spans(run.rounds)}
    points, x = [], 0.0
    for task in sorted(seen):
        x = last_round.get(task, x + 1)
        points.append((task, float(x), float(seen[task])))
    return points


def plot_accuracy_seen(run: Run, path: Path) -> Path:
    """Accuracy on all classes seen so far: after each task (line) and at per-round evaluations (points)."""
    fig = new_figure(8, 4.2)
    ax = fig.add_subplot()
    ends = _task_end_points(run)
    per_round = [(r["round"], r["accuracy_seen"]) for r in run.rounds if r["accuracy_seen"] is not None]
    if not ends and not per_round:
        _no_data(ax, "no accuracy recorded (no task finished, no round evaluated)")
    else:
        if per_round:
            xs, ys = zip(*per_round)
            ax.scatter(xs, ys, facecolors="none", edgecolors="tab:blue", s=30, label="during a task (round evaluation)")
        if ends:
            _, xs, ys = zip(*ends)
            ax.plot(xs, ys, "o-", color="tab:red", label="after each task")
            for task, x, y in ends:
                ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy on seen classes (%)")
        _round_axis(ax, run.rounds)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left", fontsize=8)
    ax.set_title("Accuracy on the classes seen so far", pad=16)
    return save_figure(fig, path)


def plot_bytes_per_round(run: Run, path: Path) -> Path:
    """Bytes per round stacked by message type: sent (coordinator to clients) above, received below."""
    fig = new_figure(9, 6)
    axes = fig.subplots(2, 1, sharex=True)
    types = sorted({t for r in run.rounds for t in r["bytes_by_type"]})
    if not run.rounds:
        for ax in axes:
            _no_data(ax, "no rounds recorded")
    else:
        palette = _cmap("tab10" if len(types) <= 10 else "tab20")
        colors = {t: palette(k % palette.N) for k, t in enumerate(types)}
        xs = np.array([r["round"] for r in run.rounds])
        width = 0.8 if len(xs) <= 60 else 1.0
        for ax, direction in zip(axes, ("sent", "received")):
            bottom = np.zeros(len(xs))
            for t in types:
                mb = np.array([r["bytes_by_type"].get(t, {}).get(direction, 0) for r in run.rounds]) / 1e6
                if mb.any():
                    ax.bar(xs, mb, width, bottom=bottom, color=colors[t], label=t, linewidth=0)
                    bottom += mb
            ax.set_ylabel(f"MB {direction}")
            ax.grid(axis="y", alpha=0.3)
            _round_axis(ax, run.rounds)
        axes[1].set_xlabel("round")
        handles = {}
        for ax in axes:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        if handles:
            fig.legend(handles.values(), handles.keys(), loc="outside right upper", title="message type", fontsize=8)
    axes[0].set_title("Bytes per round by message type: sent by the coordinator", fontsize=10, pad=16)
    axes[1].set_title("received by the coordinator", fontsize=10, pad=16)
    return save_figure(fig, path)


PHASES = [  # (label, colour); collect is split into waiting + receive_updates
    ("select", "tab:cyan"),
    ("dispatch", "tab:blue"),
    ("waiting (collect - receive_updates)", "tab:gray"),
    ("receive_updates", "tab:orange"),
    ("aggregate", "tab:green"),
    ("evaluate", "tab:purple"),
    ("other (rest of the round)", "tab:olive"),
]


def round_phase_parts(record: dict) -> dict[str, float]:
    """A round's wall-clock split without double counting: ``receive_updates`` is a part of ``collect``,
    so collect contributes ``waiting = collect - receive_updates``; ``other`` is what no phase covers."""
    p = record["phases_s"]
    collect, receive = p.get("collect", 0.0), p.get("receive_updates", 0.0)
    parts = {
        "select": p.get("select", 0.0),
        "dispatch": p.get("dispatch", 0.0),
        "waiting (collect - receive_updates)": max(collect - receive, 0.0),
        "receive_updates": receive,
        "aggregate": p.get("aggregate", 0.0),
        "evaluate": p.get("evaluate", 0.0),
    }
    parts["other (rest of the round)"] = max(record["duration_s"] - sum(parts.values()), 0.0)
    return parts


def plot_round_phases(run: Run, path: Path) -> Path:
    """Stacked wall-clock per round by phase; bar height = the round's duration."""
    fig = new_figure(9, 4.5)
    ax = fig.add_subplot()
    if not run.rounds:
        _no_data(ax, "no rounds recorded")
    else:
        xs = np.array([r["round"] for r in run.rounds])
        parts = [round_phase_parts(r) for r in run.rounds]
        width = 0.8 if len(xs) <= 60 else 1.0
        bottom = np.zeros(len(xs))
        for name, color in PHASES:
            ys = np.array([p[name] for p in parts])
            if ys.any():
                ax.bar(xs, ys, width, bottom=bottom, color=color, label=name, linewidth=0)
                bottom += ys
        ax.set_xlabel("round")
        ax.set_ylabel("wall clock (s)")
        _round_axis(ax, run.rounds)
        ax.grid(axis="y", alpha=0.3)
        fig.legend(loc="outside right upper", fontsize=8, title="phase")
    ax.set_title("Round wall-clock by phase (collect = waiting + receive_updates)", pad=16)
    return save_figure(fig, path)


def plot_online_clients(run: Run, path: Path) -> Path:
    """Online clients (at the start and each round's end) and selected / participating clients per round."""
    fig = new_figure(9, 4.2)
    ax = fig.add_subplot()
    if not run.rounds:
        _no_data(ax, "no rounds recorded")
    else:
        times = [r["time"] for r in run.rounds]
        online = [r["online"] for r in run.rounds]
        if run.start is not None and isinstance(run.start.get("online"), int) and isinstance(
                run.start.get("time"), (int, float)):
            times, online = [run.start["time"], *times], [run.start["online"], *online]
        dense = len(run.rounds) > 60  # lines instead of one marker per round
        ax.step(times, online, where="post", color="tab:blue", label="online clients")
        rt = [r["time"] for r in run.rounds]
        selected = [r["selected"] for r in run.rounds]
        participants = [r["participants"] for r in run.rounds]
        if dense:
            ax.plot(rt, selected, "-", color="0.45", linewidth=1, label="selected in round")
            ax.plot(rt, participants, "-", color="tab:green", linewidth=1, label="participants (usable updates)")
        else:
            ax.plot(times, online, "o", color="tab:blue", markersize=3)
            ax.plot(rt, selected, "s", markerfacecolor="none", markeredgecolor="0.4", markersize=8,
                    label="selected in round")
            ax.plot(rt, participants, "^", color="tab:green", markersize=5, label="participants (usable updates)")
        skipped = [r for r in run.rounds if r["skipped"]]
        if skipped:
            ax.plot([r["time"] for r in skipped], [r["participants"] for r in skipped], "x", color="tab:red",
                    markersize=7, label="skipped round")
        every = max(1, math.ceil(len(run.task_ends) / 30))
        for k, e in enumerate(run.task_ends):
            ax.axvline(e["time"], color="0.6", linestyle=":", linewidth=1)
            if k % every == 0:
                text = f"end of task {e['task'] + 1}" if len(run.task_ends) <= 6 else f"{e['task'] + 1}"
                ax.text(e["time"], 1.0, text, transform=ax.get_xaxis_transform(), ha="right", va="bottom",
                        fontsize=7 if len(run.task_ends) <= 15 else 6, color="0.35")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("time since start (s); round values at the round's end; dotted: task ends")
        ax.set_ylabel("clients")
        ax.grid(alpha=0.3)
        fig.legend(loc="outside right upper", fontsize=8)
    ax.set_title("Online clients and participants over time", pad=16)
    return save_figure(fig, path)


# ------------------------------------------------------------------ report.md
def _pct(v: Optional[float]) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _scenario_text(run: Run) -> str:
    sc = run.summary.get("scenario") or {}
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


def summary_rows(run: Run) -> list[tuple[str, str]]:
    s = run.summary
    c = s.get("clients") or {}
    model = f" ({s['model']})" if s.get("model") and s.get("model") != "auto" else ""
    return [
        ("status", s["status"]),
        ("method", f"{s['method']}{model}"),
        ("dataset", s["dataset"]),
        ("scenario", _scenario_text(run)),
        ("seed", str(s.get("seed", "–"))),
        ("tasks finished", f"{len(s['accuracy_matrix'])} of {run.num_tasks}"),
        ("average accuracy (%)", _pct(s["average_accuracy"])),
        ("average incremental accuracy (%)", _pct(s["average_incremental_accuracy"])),
        ("average forgetting (%)", _pct(s["average_forgetting"])),
        ("total bytes (MB)", f"{s['bytes_total'] / 1e6:.1f}"),
        ("rounds (skipped)", f"{s['rounds']} ({s['rounds_skipped']})"),
        ("wall clock (s)", f"{s['wall_clock_s']:.1f}"),
        ("emulated time (s)", "– (real clock)" if s.get("emulated_s") is None else f"{s['emulated_s']:.1f}"),
        ("clients joined / left / dropped",
         f"{c.get('joined', '–')} / {c.get('left', '–')} / {c.get('dropped', '–')}"),
        ("missed deadline / late updates", f"{s['missed_deadline']} / {s['late_updates']}"),
        ("rejected messages", str(sum(s["rejected_messages"].values()))),
    ]


def write_report(run_dir: Path | str, out_dir: Path | str | None = None) -> Path:
    """Write the five PNG plots and ``report.md`` into ``out_dir`` (default ``<run_dir>/report/``);
    return the path of ``report.md``. Raises ``RunDirError`` for a directory that is not a readable run."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plot_accuracy_matrix(run, out / PLOTS["accuracy_matrix"])
    plot_accuracy_seen(run, out / PLOTS["accuracy_seen"])
    plot_bytes_per_round(run, out / PLOTS["bytes_per_round"])
    plot_round_phases(run, out / PLOTS["round_phases"])
    plot_online_clients(run, out / PLOTS["online_clients"])
    path = out / REPORT
    path.write_text(_markdown(run))
    return path


def _markdown(run: Run) -> str:
    s = run.summary
    lines = [f"# fcl-emu run: {s['method']} on {s['dataset']}", "", f"Run directory: `{run.run_dir}`", ""]
    if not run.completed:
        lines += [f"> **Run not completed** (status: {s['status']}): {len(s['accuracy_matrix'])} of "
                  f"{run.num_tasks} tasks finished, {len(run.rounds)} rounds recorded. The metrics below "
                  f"cover the finished tasks only.", ""]
    lines += ["| metric | value |", "| --- | --- |"]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in summary_rows(run)]
    per_round = sum(r["bytes_sent"] + r["bytes_received"] for r in run.rounds)
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
        f"Bytes on the wire in each round by message type, sent and received by the coordinator. "
        f"The rounds account for {per_round / 1e6:.1f} of the run's {s['bytes_total'] / 1e6:.1f} MB; the rest "
        f"is traffic outside rounds (joins, heartbeats between rounds, shutdown).",
        "",
        "## Round wall-clock by phase",
        "",
        f"![round wall-clock by phase]({PLOTS['round_phases']})",
        "",
        "Each bar is one round's duration split by phase. `receive_updates` (receiving, validating and "
        "decoding updates) happens inside `collect`, so collect is drawn as *waiting* = collect − "
        "receive_updates plus receive_updates, not counted twice; *other* is what no phase covers.",
        "",
        "## Online clients",
        "",
        f"![online clients]({PLOTS['online_clients']})",
        "",
        "Online clients over time, with the clients selected for each round and those whose update was used.",
        "",
    ]
    return "\n".join(lines)
