"""Real faults on the edge-node containers of a run: kill, pause, disconnect and restart, at given rounds or
times, or at random at a rate (docs/containers.md).

Beside the emulated churn (``--availability``, ``--crash-rate``: clients told by the coordinator to go away),
a fault plan acts on the containers themselves through the engine, so the run sees what a real failure does:
a killed node's sockets vanish (the coordinator records its clients as crashed), a paused one stops answering
(its clients straggle, and are declared dead if the pause outlasts the liveness timeout), a disconnected one
loses its network, a restarted one comes back with fresh processes whose clients rejoin.

A plan (``--faults PLAN.yaml``):

.. code-block:: yaml

    faults:
      - {action: kill, node: node-1, round: 3, after_s: 1.0}    # 1 s into round 3
      - {action: pause, device_class: budget, at_s: 20, duration_s: 8}
      - {action: restart, rate_per_min: 2}                      # Poisson, on a node drawn at random
      - {action: restart, per_round: 0.1, after_s: 0.5}        # each node, each round, with probability 0.1

``round: R`` fires when round R starts (the first round starts when the clients have joined); ``at_s`` counts
seconds from that moment; ``per_round: p`` draws at every round's start, for each node, whether it is hit (the
container-level counterpart of the emulated ``crash_rate``: the same per-client probability, but all the
clients of a node at once). ``node`` names an edge node, ``device_class`` picks one of that class's nodes, neither
picks any running node; random picks and Poisson times are drawn from the run's seed. ``pause`` and
``disconnect`` are undone after ``duration_s``. Each fault is recorded as a ``fault`` event in events.jsonl and
counted in ``fcl_container_faults_total{action}``. The plan's schema: :mod:`scenario.faults`.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np

from scenario.faults import UNDO, Fault, FaultPlan, load_plan

log = logging.getLogger("fcl_emu.faults")


class Target:
    """What an injector acts on: the run's containers, by node name, with their device classes."""

    def __init__(self, containers: Callable[[], dict[str, object]], classes: dict[str, str | None],
                 network: object):
        self.containers, self.classes, self.network = containers, classes, network


class FaultInjector:
    """Carries out a plan on a run's containers from a thread of its own, timed from the run's progress events
    (use :meth:`on_progress` as, or inside, the coordinator's progress hook)."""

    def __init__(self, plan: FaultPlan, target: Target, seed: int,
                 record: Callable[..., None], horizon_s: float = 24 * 3600):
        self.plan, self.target, self.record = plan, target, record
        self.rng = np.random.default_rng(zlib.crc32(f"{seed}/faults".encode()))
        self.horizon_s = horizon_s
        self._queue: list[tuple[float, int, str, Fault]] = []  # (due, order, kind, fault), kind: do | undo:<node>
        self._order = 0
        self._wake = threading.Condition()
        self._closed = False
        self._t0: float | None = None
        self._thread = threading.Thread(target=self._serve, name="faults", daemon=True)
        self._thread.start()

    # -- scheduling ------------------------------------------------------------------------------------------

    def _push(self, due: float, kind: str, fault: Fault) -> None:
        with self._wake:
            heapq.heappush(self._queue, (due, self._order, kind, fault))
            self._order += 1
            self._wake.notify()

    def on_progress(self, kind: str, info: dict) -> None:
        """The coordinator's progress events: 'ready' starts the clock and round 1; 'round' (round R closed)
        starts round R + 1."""
        now = time.monotonic()
        if kind == "ready" and self._t0 is None:
            self._t0 = now
            self._round_started(1, now)
            for fault in self.plan.faults:
                if fault.at_s is not None:
                    self._push(now + fault.at_s, "do", fault)
                elif fault.rate_per_min is not None:
                    t = 0.0
                    while True:
                        t += self.rng.exponential(60.0 / fault.rate_per_min)
                        if t > self.horizon_s:
                            break
                        self._push(now + t, "do", fault)
        elif kind == "round" and self._t0 is not None:
            self._round_started(int(info["round"]) + 1, now)

    def _round_started(self, number: int, now: float) -> None:
        for fault in self.plan.faults:
            if fault.round == number:
                self._push(now + fault.after_s, "do", fault)
            elif fault.per_round is not None:
                for name in sorted(self._matching(fault)):
                    if self.rng.random() < fault.per_round:
                        self._push(now + fault.after_s, "do", fault.model_copy(update={"node": name,
                                                                                       "device_class": None}))

    def _matching(self, fault: Fault) -> list[str]:
        """The nodes a fault may act on: the named one, the class's, or all."""
        if fault.node is not None:
            return [fault.node]
        return [name for name, cls in self.target.classes.items()
                if fault.device_class is None or cls == fault.device_class]

    # -- acting -------------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (not self._queue or self._queue[0][0] > time.monotonic()):
                    timeout = None if not self._queue else max(0.0, self._queue[0][0] - time.monotonic())
                    self._wake.wait(timeout)
                if self._closed:
                    return
                _due, _order, kind, fault = heapq.heappop(self._queue)
            try:
                self._act(kind, fault)
            except Exception as exc:  # a container gone or restarted since: recorded as not applied
                action = UNDO[fault.action] if kind.startswith("undo:") else fault.action
                log.warning("fault %s not applied: %s", action, exc)
                self.record(action, node=kind.partition(":")[2] or fault.node, applied=False, error=str(exc))

    def _pick(self, fault: Fault) -> str | None:
        running = {name for name, c in self.target.containers().items() if _status(c) in ("running", "paused")}
        names = sorted(set(self._matching(fault)) & running)
        if fault.node is not None:
            return names[0] if names else None
        return names[int(self.rng.integers(len(names)))] if names else None

    def _act(self, kind: str, fault: Fault) -> None:
        containers = self.target.containers()
        if kind.startswith("undo:"):
            name = kind.partition(":")[2]
            container = containers[name]
            if fault.action == "pause":
                container.unpause()
            else:
                self.target.network.connect(container)
            self.record(UNDO[fault.action], node=name, applied=True)
            return
        name = self._pick(fault)
        if name is None:
            self.record(fault.action, node=fault.node, applied=False, error="no running node to act on")
            return
        container = containers[name]
        if fault.action == "kill":
            container.kill()
        elif fault.action == "pause":
            container.pause()
        elif fault.action == "disconnect":
            self.target.network.disconnect(container)
        else:
            container.restart(timeout=0)
        self.record(fault.action, node=name, applied=True)
        if fault.action in ("pause", "disconnect"):
            self._push(time.monotonic() + fault.duration_s, f"undo:{name}", fault)

    def close(self) -> None:
        """Stop acting; pending undos (unpause, reconnect) are carried out first so no container stays frozen."""
        with self._wake:
            pending = [(kind, fault) for _due, _order, kind, fault in self._queue if kind.startswith("undo:")]
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5)
        for kind, fault in pending:
            try:
                self._act(kind, fault)
            except Exception as exc:
                log.warning("undoing %s on %s failed: %s", fault.action, kind, exc)


def _status(container) -> str:
    try:
        container.reload()
    except Exception:
        return "gone"
    return container.status


__all__ = ["FaultInjector", "FaultPlan", "Target", "load_plan"]
