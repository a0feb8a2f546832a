"""The faulted run of the fault soak (:mod:`fcl_emu.bench.soak`): one fault of its schedule and what became of
it, and the ``fcl-emu up`` process under faults (started again on resume) with its events, edge nodes and
checkpoint as the injectors and the checks see them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import psutil
import yaml

from fcl_emu.bench.soak_checks import read_events
from fcl_emu.coordinator.contracts import CheckpointError
from fcl_emu.coordinator.checkpoint import load as load_checkpoint
from fcl_emu.launchers.base import node_assignment
from fcl_emu.wire.messages import client_id

LIVENESS_S = 20.0  # the soak runs' liveness timeout: every delay a fault causes stays well inside it


@dataclass
class Fault:
    """One fault of the schedule and, once injected, what happened."""

    kind: str
    at_round: int  # injected once the run has recorded this global round
    offset_s: float  # and this long after, so that it lands inside the next round (at once when it lags behind)
    duration_s: float  # a delay (node_stop, net_cut, partition, slow_host, container_pause): how long
    pick: float  # in [0, 1): which of the live nodes (sorted by name)
    target: Optional[str] = None
    injected_at_s: Optional[float] = None
    events_before: int = 0  # lines of events.jsonl when it was injected
    skipped: Optional[str] = None
    problems: list[str] = field(default_factory=list)
    detail: str = ""
    lost: list[str] = field(default_factory=list)  # the edge nodes a lossy fault took
    survived: Optional[bool] = None


class FaultedRun:
    """The ``up`` process of the faulted run (started again on resume), its events, nodes and checkpoint."""

    def __init__(self, config_path: Path, run_dir: Path, log_path: Path):
        self.config_path, self.run_dir, self.log_path = config_path, run_dir, log_path
        self.proc: Optional[subprocess.Popen] = None
        self.seen: dict[int, float] = {}  # every process of the run: pid -> create time
        self.positions: list[tuple[int, int, int]] = []  # checkpoint positions as polled
        self.orphans: list[str] = []  # what of the run was left after it ended
        self.started = time.monotonic()

    # -------------------------------------------------------------- processes
    def start(self, resume: bool = False) -> None:
        command = [sys.executable, "-m", "fcl_emu", "up"]
        command += ["--resume", str(self.run_dir)] if resume else ["--config", str(self.config_path), "--run-dir",
                                                                   str(self.run_dir)]
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(command) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, "COLUMNS": "120"})
        self.seen[self.proc.pid] = psutil.Process(self.proc.pid).create_time()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def descendants(self) -> list[psutil.Process]:
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        for child in children:
            try:
                self.seen.setdefault(child.pid, child.create_time())
            except psutil.Error:
                pass
        return children

    def nodes(self) -> dict[str, psutil.Process]:
        """The live edge nodes by name (a forked node shows ``fcl-emu node ... --name NAME``)."""
        found = {}
        for child in self.descendants():
            try:
                argv = child.cmdline()
                if child.status() != psutil.STATUS_ZOMBIE and argv[:2] == ["fcl-emu", "node"] and "--name" in argv:
                    found[argv[argv.index("--name") + 1]] = child
            except (psutil.Error, IndexError):
                continue
        return dict(sorted(found.items()))

    def alive_of_run(self) -> list[int]:
        """Processes of this run still alive: any seen one, or any whose command line names the run directory."""
        alive = []
        for pid, created in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if proc.info["pid"] not in alive and str(self.run_dir) in " ".join(proc.info["cmdline"] or ()):
                alive.append(proc.info["pid"])
        return sorted(alive)

    # -------------------------------------------------------------- files
    def events(self) -> list[dict]:
        return read_events(self.run_dir)

    def ended(self) -> bool:
        """Whether the run has recorded its end since it last started (``up`` may still be tearing down: a fault
        now would hit the tear-down, not the run)."""
        marks = [e["event"] for e in self.events() if e["event"] in ("end", "resume")]
        return bool(marks) and marks[-1] == "end"

    def node_exits(self, after: int) -> list[str]:
        """The edge nodes recorded as exited after the first ``after`` events."""
        return [e["node"] for e in self.events()[after:] if e["event"] == "node_exit"]

    def clients_of(self, nodes: list[str]) -> set[str]:
        """The client identities the named edge nodes host (striped, as ``up`` assigns them)."""
        config = yaml.safe_load(self.config_path.read_text())
        striped = node_assignment(config["scenario"]["num_clients"], config["nodes"])
        return {client_id(i) for name in nodes for i in striped[int(name.rpartition("-")[2])]}

    def last_round(self) -> int:
        return max((e["round"] for e in self.events() if e["event"] == "round"), default=0)

    def going(self) -> bool:
        """Whether the run has recorded a round since it last started: after a resume, its edge nodes are up and
        its clients back (a fault before that would find half a run)."""
        kinds = [e["event"] for e in self.events() if e["event"] in ("round", "resume")]
        return bool(kinds) and kinds[-1] == "round"

    def poll_position(self) -> None:
        try:
            state = json.loads((self.run_dir / "checkpoint" / "state.json").read_text())
            position = (state["next"]["task"], state["next"]["task_round"], state["global_round"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if not self.positions or self.positions[-1] != position:
            self.positions.append(position)

    def checkpoint_problems(self) -> list[str]:
        """With the coordinator down: the checkpoint must load and be at least as far as any seen before."""
        try:
            state = load_checkpoint(self.run_dir / "checkpoint").state
        except CheckpointError as exc:
            return [f"checkpoint lost: {exc}"]
        position = (state["next"]["task"], state["next"]["task_round"], state["global_round"])
        if self.positions and position < max(self.positions):
            return [f"checkpoint went back to {position} from {max(self.positions)}"]
        self.poll_position()
        return []

    # -------------------------------------------------------------- waiting
    def wait(self, until: Callable[[], bool], timeout_s: float) -> bool:
        """Poll (processes, checkpoint) until ``until()`` or the timeout; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.descendants()
            self.poll_position()
            if until():
                return True
            time.sleep(0.25)
        return until()

    def stop_all(self) -> None:
        """SIGKILL whatever of the run is left (after a failed check or Ctrl-C)."""
        for pid in self.alive_of_run():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.wait()


def delayed_only(run: FaultedRun, fault: Fault, nodes: list[str]) -> None:
    """A delay must not cost a node: no ``node_exit`` of the ``nodes`` it held up."""
    run.wait(lambda: False, 1.0)
    gone = sorted(set(nodes) & set(run.node_exits(fault.events_before)))
    if gone:
        fault.problems.append(f"{', '.join(gone)} declared gone (node_exit)")
