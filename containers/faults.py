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
      - {action: kill, node: node-1, round: 3, round_point: dispatched}  # its clients training in round 3
      - {action: pause, device_class: budget, at_s: 20, duration_s: 8}
      - {action: restart, rate_per_min: 2}                      # Poisson, on a node drawn at random
      - {action: restart, per_round: 0.1, after_s: 0.5}        # each node, each round, with probability 0.1

On a local cluster (``--backend swarm --cluster NAME``, containers/local_cluster.py) a plan also acts on whole
hosts, everything on them at once:

.. code-block:: yaml

    faults:
      - {action: lose_host, host: local-2, round: 3, round_point: dispatched}  # killed, silently
      - {action: partition, host: local-3, at_s: 10, duration_s: 20} # cut off both ways, then healed
      - {action: slow_host, host: local-2, round: 2, cpus: 0.5, duration_s: 30}

``round: R`` fires at an event of round R, not at a time, so a fault lands at the same point of a round however
fast the host trains: at its start (``round_point: start``, the default: before any client is sent its request)
or once its train requests are sent (``round_point: dispatched``: its clients are training), ``after_s`` later. A
round's fault with no delay lands before the round goes on (the coordinator waits for it). ``at_s`` counts seconds
from the moment the clients have joined; ``per_round: p`` draws at that point of every round, for each node,
whether it is hit (the
container-level counterpart of the emulated ``crash_rate``: the same per-client probability, but all the
clients of a node at once). ``node`` names an edge node, ``device_class`` picks one of that class's nodes, neither
picks any running node; random picks and Poisson times are drawn from the run's seed. ``pause`` and
``disconnect`` are undone after ``duration_s``. Each fault is recorded as a ``fault`` event in events.jsonl and
counted in ``fcl_container_faults_total{action}``; a host fault's event names the host and the edge nodes it ran,
and is counted in ``fcl_host_faults_total{action}``. The plan's schema: :mod:`fcl_emu.scenario.faults`.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np

from fcl_emu.scenario.faults import HOST_ACTIONS, NEEDS_CLUSTER, ROUND_POINTS, UNDO, Fault, FaultPlan, load_plan

log = logging.getLogger("fcl_emu.faults")

ROUND_EVENTS = {"round_start": "start", "dispatched": "dispatched"}  # progress event -> the round point it marks


class Target:
    """What an injector acts on: the run's containers, by node name, with their device classes, the run's network,
    and on a local cluster its hosts (``host_faults``, :class:`fcl_emu.containers.local_cluster.HostFaults`) with the
    host each node runs on."""

    def __init__(self, containers: Callable[[], dict[str, object]], classes: dict[str, str | None],
                 network: object, host_faults=None, hosts: dict[str, str] | None = None):
        self.containers, self.classes, self.network = containers, classes, network
        self.host_faults, self.hosts = host_faults, hosts or {}

    def check(self, plan: FaultPlan) -> None:
        """ValueError if the plan has host faults this target cannot carry out, or names hosts it lacks."""
        wanted = [f for f in plan.faults if f.action in HOST_ACTIONS]
        if wanted and self.host_faults is None:
            raise ValueError(NEEDS_CLUSTER)
        for fault in wanted:
            if fault.host is not None:
                host = self.host_faults.cluster.host(fault.host)  # ValueError naming the cluster's hosts
                if host.manager:
                    raise ValueError(f"{fault.action} on {fault.host}: the swarm manager's host cannot be faulted")


class FaultInjector:
    """Carries out a plan on a run's containers, timed from the run's progress events (use :meth:`on_progress` as,
    or inside, the coordinator's progress hook). A round's fault due at once (``after_s: 0``) is carried out within
    the progress call, so the round goes on only once it has landed; every other fault, and every undo, from a
    thread of its own."""

    def __init__(self, plan: FaultPlan, target: Target, seed: int,
                 record: Callable[..., None], horizon_s: float = 24 * 3600):
        target.check(plan)
        self.plan, self.target, self.record = plan, target, record
        self.rng = np.random.default_rng(zlib.crc32(f"{seed}/faults".encode()))
        self.horizon_s = horizon_s
        self._queue: list[tuple[float, int, str, Fault]] = []  # (due, order, kind, fault), kind: do | undo:<node>
        self._order = 0
        self._wake = threading.Condition()
        self._acting = threading.Lock()  # the progress hook's thread and the injector's act one at a time
        self._closed = False
        self._started = False
        self._last_round = {point: 0 for point in ROUND_POINTS}  # per point, the last round that triggered
        self._thread = threading.Thread(target=self._serve, name="faults", daemon=True)
        self._thread.start()

    # -- scheduling ------------------------------------------------------------------------------------------

    def _push(self, due: float, kind: str, fault: Fault) -> None:
        with self._wake:
            heapq.heappush(self._queue, (due, self._order, kind, fault))
            self._order += 1
            self._wake.notify()

    def on_progress(self, kind: str, info: dict) -> None:
        """The coordinator's progress events: 'ready' starts the clock of ``at_s`` and ``rate_per_min``;
        'round_start' (round R opened, no request sent yet) and 'dispatched' (round R's train requests sent)
        trigger round R's faults at that point, once per round (a resumed run goes on from its next round)."""
        now = time.monotonic()
        point = ROUND_EVENTS.get(kind)
        if point is not None and int(info["round"]) > self._last_round[point]:
            self._last_round[point] = int(info["round"])
            self._round_reached(self._last_round[point], point, now)
        elif kind == "ready" and not self._started:
            self._started = True
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

    def _round_reached(self, number: int, point: str, now: float) -> None:
        for fault in self.plan.faults:
            if fault.round_point != point:
                continue
            if fault.round == number:
                self._schedule(now, fault)
            elif fault.per_round is not None:
                for name in sorted(self._matching(fault)):
                    if self.rng.random() < fault.per_round:
                        self._schedule(now, fault.model_copy(update={"node": name, "device_class": None}))

    def _schedule(self, now: float, fault: Fault) -> None:
        if fault.after_s == 0:
            self._carry_out("do", fault)
        else:
            self._push(now + fault.after_s, "do", fault)

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
            self._carry_out(kind, fault)

    def _carry_out(self, kind: str, fault: Fault) -> None:
        with self._acting:
            try:
                self._act(kind, fault)
            except Exception as exc:  # a container gone or restarted since: recorded as not applied
                action = UNDO[fault.action] if kind.startswith("undo:") else fault.action
                log.warning("fault %s not applied: %s", action, exc)
                where = ({"host": kind.partition(":")[2] or fault.host} if fault.action in HOST_ACTIONS
                         else {"node": kind.partition(":")[2] or fault.node})
                self.record(action, **where, applied=False, error=str(exc))

    def _pick(self, fault: Fault) -> str | None:
        running = {name for name, c in self.target.containers().items() if _status(c) in ("running", "paused")}
        names = sorted(set(self._matching(fault)) & running)
        if fault.node is not None:
            return names[0] if names else None
        return names[int(self.rng.integers(len(names)))] if names else None

    def _act(self, kind: str, fault: Fault) -> None:
        if fault.action in HOST_ACTIONS:
            self._act_on_host(kind, fault)
            return
        containers = self.target.containers()
        if kind.startswith("undo:"):
            name = kind.partition(":")[2]
            container = containers[name]
            if fault.action == "pause":
                container.unpause()
            else:
                _network(container, self.target.network).connect(container)
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
            _network(container, self.target.network).disconnect(container)
        else:
            container.restart(timeout=0)
        self.record(fault.action, node=name, applied=True)
        if fault.action in ("pause", "disconnect"):
            self._push(time.monotonic() + fault.duration_s, f"undo:{name}", fault)

    def _act_on_host(self, kind: str, fault: Fault) -> None:
        hosts = self.target.host_faults
        if kind.startswith("undo:"):
            host = kind.partition(":")[2]
            (hosts.heal if fault.action == "partition" else hosts.restore)(host)
            self.record(UNDO[fault.action], host=host, nodes=self._nodes_on(host), applied=True)
            return
        host = fault.host or self._pick_host()
        if host is None:
            self.record(fault.action, host=None, applied=False, error="no host runs an edge node to act on")
            return
        if fault.action == "lose_host":
            hosts.lose(host)
        elif fault.action == "partition":
            hosts.cut(host)
        else:
            hosts.slow(host, fault.cpus)
        self.record(fault.action, host=host, nodes=self._nodes_on(host), applied=True)
        if fault.action != "lose_host" and fault.duration_s is not None:
            self._push(time.monotonic() + fault.duration_s, f"undo:{host}", fault)

    def _nodes_on(self, host: str) -> list[str]:
        return sorted(name for name, on in self.target.hosts.items() if on == host)

    def _pick_host(self) -> str | None:
        """A host that runs edge nodes, other than the manager's, drawn from the run's seed."""
        manager = self.target.host_faults.cluster.manager.name
        names = sorted(set(self.target.hosts.values()) - {manager})
        return names[int(self.rng.integers(len(names)))] if names else None

    def close(self) -> None:
        """Stop acting; pending undos (unpause, reconnect) are carried out first so no container stays frozen."""
        with self._wake:
            pending = [(kind, fault) for _due, _order, kind, fault in self._queue if kind.startswith("undo:")]
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5)
        for kind, fault in pending:
            try:
                with self._acting:
                    self._act(kind, fault)
            except Exception as exc:
                log.warning("undoing %s on %s failed: %s", fault.action, kind, exc)


def _network(container, network):
    """``network`` as seen by the engine of ``container``'s host (a swarm's overlay network spans hosts)."""
    return container.client.networks.get(network.id)


def _status(container) -> str:
    try:
        container.reload()
    except Exception:
        return "gone"
    return container.status


__all__ = ["FaultInjector", "FaultPlan", "Target", "load_plan"]
