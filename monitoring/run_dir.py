"""Reading a run directory: ``summary.json`` (as :class:`monitoring.results.RunSummary`), ``events.jsonl`` and,
when readable, ``config.yaml``, validated, with errors that name the file (and line) at fault.

The reports (:mod:`monitoring.report`) and comparisons (:mod:`monitoring.compare`) read runs through
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

from monitoring.results import RoundRecord, RunSummary

SUMMARY = "summary.json"
EVENTS = "events.jsonl"
CONFIG = "config.yaml"


class RunDirError(ValueError):
    """A directory that is not a readable run directory; the message names the file and the run dir."""

    def __init__(self, message: str, run_dir: Path, file: Optional[str] = None, line: Optional[int] = None):
        super().__init__(message)
        self.run_dir = run_dir
        self.file = file
        self.line = line


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
    if not run_dir.is_dir():
        raise RunDirError(f"not a run directory: {run_dir} does not exist or is not a directory", run_dir)
    summary_path, events_path = run_dir / SUMMARY, run_dir / EVENTS
    if not summary_path.exists() and not events_path.exists():
        raise RunDirError(f"not a run directory: {run_dir} has neither {SUMMARY} nor {EVENTS}", run_dir)
    summary = _load_summary(run_dir, summary_path)
    rounds, task_ends, start = _load_events(run_dir, events_path)
    return Run(summary=summary, rounds=rounds, task_ends=task_ends, run_dir=run_dir,
               config=_load_config(run_dir / CONFIG), start=start)


def _load_summary(run_dir: Path, path: Path) -> RunSummary:
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
