"""The plots of a run report (:mod:`fcl_emu.monitoring.report`), and the figure helpers the comparisons and benchmark
plots share.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so plotting neither needs a display nor
changes the caller's matplotlib backend. A plot without data says so.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fcl_emu.monitoring.run_dir import Run

DPI = 110


# ------------------------------------------------------------------ helpers
def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


def no_data(ax, text: str) -> None:
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


def emulated(run: Run) -> bool:
    """Whether the run's rounds ran on the emulated clock (each records the emulated time at its close)."""
    return bool(run.rounds) and all(r.get("emulated_clock_s") is not None for r in run.rounds)


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
    matrix = run.summary.accuracy_matrix
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
    ax.set_title(f"Accuracy matrix: {run.summary.method} on {run.summary.dataset}")
    return save_figure(fig, path)


def _cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name].copy()


def _task_end_points(run: Run) -> list[tuple[int, float, float]]:
    """(task, x = last round of the task, accuracy on seen classes) after each finished task."""
    seen = {e["task"]: e["accuracy_seen"] for e in run.task_ends if e["accuracy_seen"] is not None}
    for t, a in enumerate(run.summary.accuracy_seen):
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
        no_data(ax, "no accuracy recorded (no task finished, no round evaluated)")
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
            no_data(ax, "no rounds recorded")
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
        no_data(ax, "no rounds recorded")
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
        ax.set_ylabel("host seconds (the run's clock: emulated)" if emulated(run) else "wall clock (s)")
        _round_axis(ax, run.rounds)
        ax.grid(axis="y", alpha=0.3)
        fig.legend(loc="outside right upper", fontsize=8, title="phase")
    ax.set_title("Round wall-clock by phase (collect = waiting + receive_updates)", pad=16)
    return save_figure(fig, path)


def plot_online_clients(run: Run, path: Path) -> Path:
    """Online clients (at the start and each round's end) and selected / participating clients per round, over
    the run's clock: emulated seconds where its rounds ran on the emulated clock, else host seconds."""
    fig = new_figure(9, 4.2)
    ax = fig.add_subplot()
    if not run.rounds:
        no_data(ax, "no rounds recorded")
    else:
        clock = "emulated_clock_s" if emulated(run) else "time"
        rt = [r[clock] for r in run.rounds]
        times, online = list(rt), [r["online"] for r in run.rounds]
        if run.start is not None and isinstance(run.start.get("online"), int) and isinstance(
                run.start.get("time"), (int, float)):
            start = 0.0 if clock == "emulated_clock_s" else run.start["time"]
            times, online = [start, *times], [run.start["online"], *online]
        dense = len(run.rounds) > 60  # lines instead of one marker per round
        ax.step(times, online, where="post", color="tab:blue", label="online clients")
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
            ax.plot([r[clock] for r in skipped], [r["participants"] for r in skipped], "x", color="tab:red",
                    markersize=7, label="skipped round")
        ends = task_end_times(run, clock)
        every = max(1, math.ceil(len(ends) / 30))
        for k, (task, t) in enumerate(ends):
            ax.axvline(t, color="0.6", linestyle=":", linewidth=1)
            if k % every == 0:
                text = f"end of task {task + 1}" if len(ends) <= 6 else f"{task + 1}"
                ax.text(t, 1.0, text, transform=ax.get_xaxis_transform(), ha="right", va="bottom",
                        fontsize=7 if len(ends) <= 15 else 6, color="0.35")
        ax.set_ylim(bottom=0)
        what = "emulated time" if clock == "emulated_clock_s" else "host time"
        ax.set_xlabel(f"{what} since start (s); round values at the round's end; dotted: task ends")
        ax.set_ylabel("clients")
        ax.grid(alpha=0.3)
        fig.legend(loc="outside right upper", fontsize=8)
    ax.set_title("Online clients and participants over time", pad=16)
    return save_figure(fig, path)


def task_end_times(run: Run, clock: str) -> list[tuple[int, float]]:
    """(task, time) of each task end on ``clock`` (a round record's key): host seconds of the task_end event,
    or the emulated time at the close of the task's last round."""
    if clock == "time":
        return [(e["task"], e["time"]) for e in run.task_ends]
    last = {r["task"]: r[clock] for r in run.rounds}
    return [(e["task"], last[e["task"]]) for e in run.task_ends if e["task"] in last]
