"""The live progress display of a run: the clients joining, then the rounds, with the round running, its answers,
a server job's steps, the accuracy, epsilon and the time left (docs/read-results.md)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

from fcl_emu.runconfig import RunConfig


class ProgressView:
    """Progress hook for the coordinator: a bar of the clients joining, then one bar over all rounds. Its label
    names the task and round running (or next to run, while a task ends and between rounds), the clients that
    have answered of those asked, the step of a server job running, the accuracy after the last evaluation and,
    under differential privacy, the epsilon spent; then the time left (:meth:`time_left`, worked out at each
    refresh). A line for each warning, server job start and end, edge-node exit, fault and task end."""

    def __init__(self, config: RunConfig, console: Console, clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config, clock
        self.progress = Progress(  # a narrow terminal cuts the label short, never the time left
            TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis")),
            BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(), _TimeLeftColumn(self),
            console=console, transient=False)
        self.join_bar = self.progress.add_task("clients joined", total=config.scenario.num_clients)
        self.tasks, self.rounds_per_task = config.scenario.num_tasks, config.rounds.rounds_per_task
        self.total = self.tasks * self.rounds_per_task
        self.bar = self.progress.add_task("rounds", total=self.total, start=False, visible=False)
        self.joined: set[str] = set()
        self.ready = False  # the clients have joined (a server job before then is the pool's device check)
        self.rounds_started: float | None = None  # this session's first task start
        self.rounds_done = 0  # in this session
        self.completed = 0  # rounds of the run done (a resumed run's earlier sessions included)
        self.last_round_end: float | None = None
        self.running: tuple[int, int] | None = None  # (task, task round) running, or next to run
        self.round_began: float | None = None  # while a round runs
        self.answers: tuple[int, int] | None = None  # (answered, selected) of the round running
        self.job: _ServerJob | None = None  # replaced, never changed: the display's thread reads it
        self.accuracy: float | None = None
        self.epsilon: float | None = None
        self.finished = False

    def __call__(self, kind: str, info: dict) -> None:
        if kind == "join" and self.rounds_started is None:
            self.joined.add(info["client"])
            self.progress.update(self.join_bar, completed=len(self.joined))
        elif kind in ("ready", "resume"):
            self.ready = True
            self.progress.stop_task(self.join_bar)
            if kind == "resume":
                self.running = (info["task"], info["task_round"])
                self.completed = info["rounds"]
                self.progress.update(self.bar, completed=self.completed)
        elif kind == "task_start":
            self.running = self.running if self.running and self.running[0] == info["task"] else (info["task"], 0)
            if self.rounds_started is None:
                self.rounds_started = self.clock()
                self._show_bar()
        elif kind == "round_start":
            self.running, self.round_began, self.answers = (info["task"], info["task_round"]), self.clock(), None
        elif kind in ("dispatched", "answered"):
            self.answers = (info.get("answered", 0), info["selected"])
        elif kind == "round":
            self._round_over(info)
        elif kind == "task_end":
            self._task_over(info)
        else:
            if kind == "server_job_start" and self.ready:
                self.job = _ServerJob(info["kind"], began=self.clock())
                self.running = self.running or (info["task"], 0)
                self._show_bar()
            elif kind == "server_job_step" and self.job is not None:
                self.job = dataclasses.replace(self.job, steps=(info["step"], info["steps"]), reported=self.clock())
            elif kind == "server_job_end":
                self.job = None
            self._line(kind, info)
        self._describe()

    def _show_bar(self) -> None:
        self.progress.stop_task(self.join_bar)
        self.progress.start_task(self.bar)
        self.progress.update(self.bar, visible=True)

    def _round_over(self, info: dict) -> None:
        """A round's record: the bar advances, the label names the next round."""
        self.rounds_done += 1
        self.completed += 1
        self.last_round_end, self.round_began, self.answers = self.clock(), None, None
        if info["accuracy_seen"] is not None:
            self.accuracy = info["accuracy_seen"]
        privacy = info.get("privacy") or {}
        spent = privacy.get("epsilon_sampled", privacy.get("epsilon"))  # as the rounds sampled: the figure that holds
        if spent is not None:
            self.epsilon = spent
        task, task_round = info["task"], info["task_round"] + 1
        self.running = (task, task_round) if task_round < self.rounds_per_task else (task + 1, 0)
        self.progress.update(self.bar, completed=self.completed)

    def _task_over(self, info: dict) -> None:
        row = " ".join("-" if a is None else f"{a:.1f}" for a in info["accuracy"])
        self.progress.console.print(f"task {info['task'] + 1} done: accuracy per task [{row}]")
        self.accuracy = info["accuracy_seen"]
        self.running = (info["task"] + 1, 0)
        self.finished = info["task"] + 1 == self.tasks

    def _describe(self) -> None:
        """The rounds bar's label from what the view knows now."""
        if self.finished:
            parts = [f"task {self.tasks}/{self.tasks} done"]
        elif self.running is None:
            return
        elif self.running[0] >= self.tasks:
            parts = [f"task {self.tasks}/{self.tasks} ending"]
        else:
            task, task_round = self.running
            parts = [f"task {task + 1}/{self.tasks} round {task_round + 1}/{self.rounds_per_task}"]
        if self.job is not None:
            steps = self.job.steps
            parts.append(f"server job: {self.job.label}" + ("" if steps is None else f" {steps[0]}/{steps[1]}"))
        elif self.answers is not None:
            parts.append(f"{self.answers[0]}/{self.answers[1]} answered")
        if self.accuracy is not None:
            parts.append(f"acc(seen) {self.accuracy:.1f}%")
        if self.epsilon is not None:
            parts.append(f"epsilon {self.epsilon:.2f}")
        self.progress.update(self.bar, description=" | ".join(parts))

    def time_left(self) -> str:
        """The rounds left times the mean wall time of this session's rounds (task ends and server jobs
        included), the round running counted by its share of answers: of the mean round time, what is left of
        it, or once the round has run past half of it, as long again as it has run (a slow round stays slow).
        A server job running counts its steps left at its pace so far, counted down from its last report; before
        its first step the text says it waits for it. ``estimating`` until a round has finished."""
        if self.finished:
            return "done"
        job = self.job
        if self.rounds_done == 0 or self.rounds_started is None or self.last_round_end is None:
            return "time left: waiting for the server job" if job is not None else "time left: estimating"
        if self.completed >= self.total:
            return "time left: final evaluation"
        now, mean = self.clock(), (self.last_round_end - self.rounds_started) / self.rounds_done
        rounds_left = self.total - self.completed
        if job is not None:
            steps = job.steps
            if steps is None or steps[0] <= 0:
                return f"time left: waiting for the server job ({job.label})"
            pace = (job.reported - job.began) / steps[0]
            job_left = max(pace * (steps[1] - steps[0]) - (now - job.reported), 0.0)
            return f"time left: ~{_hours(job_left + rounds_left * mean)}"
        if self.round_began is None:
            return f"time left: ~{_hours(rounds_left * mean)}"
        ran = now - self.round_began
        answered, asked = self.answers or (0, 0)
        share_left = 1 - min(answered / asked, 1) if asked else 1
        return f"time left: ~{_hours(share_left * max(mean - ran, ran) + (rounds_left - 1) * mean)}"

    def _line(self, kind: str, info: dict) -> None:
        """The events that print a line of their own."""
        text, style = None, None
        if kind == "warning":
            text, style = f"warning: {info['message']}", "yellow"
        elif kind == "server_job_start":
            where = f"round {info['round']}/{self.total}" if info["round"] else "before the first round"
            text = (f"server job started: {info['kind']} ({', '.join(info['jobs'])}) on {info['device']}, "
                    f"task {info['task'] + 1}, {where}")
        elif kind == "server_job_end":
            outcome = "done" if info["ok"] else "failed"
            text, style = f"server job {outcome}: {info['kind']} in {info['duration_s']:.1f} s", (
                None if info["ok"] else "red")
        elif kind == "node_exit":
            text, style = f"edge node {info['node']} exited (code {info['code']}): {info['error']}", "red"
        elif kind == "fault":
            applied = "" if info.get("applied", True) else f" (not applied: {info.get('error')})"
            text, style = f"fault: {info['action']} {info.get('node') or ''}{applied}", "yellow"
        if text is not None:
            self.progress.console.print(text, style=style, markup=False, highlight=False)


@dataclasses.dataclass(frozen=True)
class _ServerJob:
    """A server job running, as the progress view knows it."""

    label: str  # what it makes
    began: float
    steps: tuple[int, int] | None = None  # (done, total) as last reported
    reported: float = 0.0  # when


class _TimeLeftColumn(ProgressColumn):
    """The rounds bar's time left, worked out at each refresh of the display, so it moves between events."""

    def __init__(self, view: ProgressView):
        super().__init__(table_column=Column(no_wrap=True, min_width=len("time left: ~0:00:00")))
        self.view = view

    def render(self, task) -> Text:
        return Text(self.view.time_left() if task.id == self.view.bar and task.visible else "")


def _hours(seconds: float) -> str:
    """``H:MM:SS``."""
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
