"""Reading a run directory: ``summary.json`` (as :class:`fcl_emu.monitoring.results.RunSummary`), ``events.jsonl`` and,
when readable, ``config.yaml``, validated, with errors that name the file (and line) at fault.

A run without ``summary.json`` (still running, or killed before it wrote one) is read from its events and
config as a *partial* run: status :data:`PARTIAL`, its finished tasks, the bytes and time of its recorded rounds.

The reports (:mod:`fcl_emu.monitoring.report`) and comparisons (:mod:`fcl_emu.monitoring.compare`) read runs through
``load_run``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import msgspec
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from fcl_emu.monitoring.results import (RoundRecord, RunSummary, average_accuracy, average_forgetting,
                                        average_incremental_accuracy, learned_accuracy)

SUMMARY = "summary.json"
EVENTS = "events.jsonl"
CONFIG = "config.yaml"
PARTIAL = "partial: no summary.json (still running, or ended without writing it)"


class RunDirError(ValueError):
    """A directory that is not a readable run directory; the message names the file and the run dir."""

    def __init__(self, message: str, run_dir: Path, file: Optional[str] = None, line: Optional[int] = None):
        super().__init__(message)
        self.run_dir = run_dir
        self.file = file
        self.line = line


class NotARunError(RunDirError):
    """A directory that holds no run at all (neither summary.json nor events.jsonl): the keys a start that did
    not finish left behind, say, or any other folder beside the runs."""


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

    summary: RunSummary
    rounds: list[dict[str, Any]]
    task_ends: list[dict[str, Any]]
    run_dir: Path
    config: Optional[dict[str, Any]] = None  # config.yaml, when present and readable
    start: Optional[dict[str, Any]] = None  # the `start` event, when there is one

    @property
    def status(self) -> str:
        return self.summary.status

    @property
    def completed(self) -> bool:
        return self.summary.completed

    @property
    def partial(self) -> bool:
        """No summary.json: the run is still going, or ended without writing one."""
        return self.summary.status == PARTIAL

    @property
    def num_tasks(self) -> int:
        """Tasks in the scenario (falls back to the width of the accuracy matrix)."""
        n = self.summary.scenario.get("num_tasks")
        matrix = self.summary.accuracy_matrix
        return int(n) if isinstance(n, int) and n > 0 else max([len(row) for row in matrix] + [len(matrix), 0])

    @property
    def label(self) -> str:
        seed = self.summary.seed
        return f"{self.summary.method}/{self.summary.dataset}/s{seed if seed is not None else '?'}"


def load_run(run_dir: Path | str) -> Run:
    """Read and validate a run directory; raise ``RunDirError`` naming the file (and line) at fault."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise RunDirError(f"not a run directory: {run_dir} does not exist", run_dir)
    if not run_dir.is_dir():
        raise NotARunError(f"not a run directory: {run_dir} is not a directory", run_dir)
    summary_path, events_path = run_dir / SUMMARY, run_dir / EVENTS
    if not summary_path.exists() and not events_path.exists():
        names = sorted(p.name for p in run_dir.iterdir())
        what = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "") or "nothing"
        raise NotARunError(f"not a run directory: {run_dir} has neither {SUMMARY} nor {EVENTS} (it holds {what})",
                           run_dir)
    rounds, task_ends, start = _load_events(run_dir, events_path)
    config = _load_config(run_dir / CONFIG)
    summary = (_load_summary(run_dir, summary_path) if summary_path.exists()
               else _partial_summary(config, rounds, task_ends, start, events_path))
    return Run(summary=summary, rounds=rounds, task_ends=task_ends, run_dir=run_dir, config=config, start=start)


def _partial_summary(config: Optional[dict[str, Any]], rounds: list[dict], task_ends: list[dict],
                     start: Optional[dict], events_path: Path) -> RunSummary:
    """What a run without summary.json has recorded so far, as a summary with status :data:`PARTIAL`."""
    config = config or {}
    scenario = config.get("scenario") if isinstance(config.get("scenario"), dict) else {}
    num_tasks = scenario.get("num_tasks") if isinstance(scenario.get("num_tasks"), int) else 0
    width = max([num_tasks] + [len(t["accuracy"]) for t in task_ends])
    matrix = [t["accuracy"] + [None] * (width - len(t["accuracy"])) for t in task_ends]
    times = [r["time"] for r in rounds] + [t["time"] for t in task_ends] + [0.0]
    return RunSummary(
        status=PARTIAL, run_id=(start or {}).get("run_id"), run_dir=str(events_path.parent),
        method=str(config.get("method", "?")), dataset=str(scenario.get("dataset", "?")), scenario=scenario,
        seed=config.get("seed") if isinstance(config.get("seed"), int) else None, accuracy_matrix=matrix,
        average_accuracy=average_accuracy(matrix) if matrix else None,
        average_incremental_accuracy=average_incremental_accuracy(matrix) if matrix else None,
        average_forgetting=average_forgetting(matrix) if matrix else None, learned_accuracy=learned_accuracy(matrix),
        bytes_total=sum(r["bytes_sent"] + r["bytes_received"] for r in rounds), rounds=len(rounds),
        rounds_skipped=sum(1 for r in rounds if r.get("skipped")), wall_clock_s=max(times))


def _load_summary(run_dir: Path, path: Path) -> RunSummary:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{SUMMARY} in run directory {run_dir} is not valid JSON: {exc}", run_dir, SUMMARY) from exc
    if not isinstance(data, dict):
        raise RunDirError(f"{SUMMARY} in run directory {run_dir} is not a JSON object", run_dir, SUMMARY)
    try:
        return RunSummary.from_dict(data)
    except msgspec.ValidationError as exc:
        raise RunDirError(f"{SUMMARY} in run directory {run_dir} is malformed: {exc}", run_dir, SUMMARY) from exc


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
