"""``fcl-emu bench soak --cluster local``: the fault soak of :mod:`fcl_emu.bench.soak` on a local Swarm cluster.

The soak makes a cluster of its own (``fcl-emu cluster up`` under the name :data:`NAME`, on :data:`SUBNET`: host 1
the manager, the others workers), runs the faulted run on it with the swarm backend (its edge nodes as services
pinned round-robin to the hosts) and removes the cluster at the end, whatever happened: a lost host cannot come
back, so a soak never borrows a cluster of the user's. The baseline is the same run with the process backend on
this machine: on the emulated clock the two give the same rounds and the same accuracy matrix
(``tests/test_cluster.py``), so every difference up to the first lossy fault is the faults'.

Faults, besides the process soak's ``coordinator_kill`` (its resume places the edge nodes on the hosts left) and
``disk_full`` (the coordinator's run directory is on this machine):

- ``partition``: a worker host cut off both ways (its link to the bridge down) for up to a quarter of the
  liveness timeout, then healed: only a delay (TCP retransmits what was sent into the cut);
- ``slow_host``: a worker host's CPU quota set to 0.1-0.5 CPUs (everything it runs shares it) for up to 0.4 of
  the liveness timeout, then lifted: only a delay;
- ``container_pause``: an edge node's container frozen (``docker pause`` through its host's engine) for up to 0.4
  of the liveness timeout, then thawed: only a delay;
- ``container_kill``: an edge node's container killed through its host's engine: a ``node_exit``; lossy;
- ``lose_host``: a worker host lost at once (cut, then its engine and containers killed): its edge nodes' clients
  are declared dead within the liveness timeout and no later round aggregates one of them; lossy.

Host faults act on the workers (the manager runs the swarm); a fault finding none of its kind left (every worker
lost, the last edge node killed) is recorded as skipped. The checks at the end add to the process soak's: no
service, container or network of the run is left on any host that is still up.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional

from fcl_emu.bench.soak_run import LIVENESS_S, Fault, FaultedRun, delayed_only
from fcl_emu.containers import local_cluster
from fcl_emu.containers.cluster import Cluster, engine
from fcl_emu.containers.docker_client import EngineError
from fcl_emu.launchers.engine_launcher import LABEL_NODE, LABEL_RUN, run_label

NAME = "soak"
SUBNET = "192.168.215.0/24"
SERVICE_ID = "com.docker.swarm.service.id"  # the label Swarm gives a task's container
KINDS = ("partition", "slow_host", "container_pause", "container_kill", "lose_host", "coordinator_kill", "disk_full")


class ClusterSoak:
    """The soak's own local cluster: made, faulted and removed; the faulted run's containers on it."""

    def __init__(self, hosts: int, image: Optional[str] = None):
        if hosts < 2:
            raise ValueError(f"--hosts {hosts}: a cluster soak needs a manager and at least one worker")
        self.hosts, self.image = hosts, image
        self.cluster: Optional[Cluster] = None
        self.lost: set[str] = set()

    # -------------------------------------------------------------- life
    def up(self, log: Callable[[str], None]) -> Cluster:
        """Make the cluster (any leftover of an interrupted soak removed first)."""
        from fcl_emu.containers.image import image_ref

        local_cluster.check_prerequisites()
        local_cluster.down(NAME)
        self.image = image_ref(self.image)
        self.cluster = local_cluster.up(NAME, self.hosts, SUBNET, self.image, log=log)
        return self.cluster

    def down(self) -> None:
        local_cluster.down(NAME)

    def config(self) -> dict:
        """What the faulted run's config adds to the baseline's."""
        return {"containers": {"backend": "swarm", "cluster": NAME, "image": self.image}}

    # -------------------------------------------------------------- what is there
    def workers(self) -> list[str]:
        """The worker hosts not lost, by name."""
        return [h.name for h in self.cluster.hosts if not h.manager and h.name not in self.lost]

    def _services(self, run: FaultedRun) -> list:
        """The run's edge-node services on the manager."""
        lead = engine(self.cluster.manager.engine, timeout_s=30)
        return lead.services.list(filters={"label": f"{LABEL_RUN}={run_label(run.run_dir)}"})

    def containers(self, run: FaultedRun, every: bool = False) -> dict[str, tuple[str, object]]:
        """The containers of the run's current services on the hosts up, by node name: (host, container); running
        or paused ones. ``every``: any container of the run, in any state (what a killed coordinator left, whose
        services a resume removes, included)."""
        found: dict[str, tuple[str, object]] = {}
        label = f"{LABEL_RUN}={run_label(run.run_dir)}"
        current = set() if every else {service.id for service in self._services(run)}
        for host in self.cluster.hosts:
            if host.name in self.lost:
                continue
            try:
                listed = engine(host.engine, timeout_s=30).containers.list(all=every, filters={"label": label})
            except EngineError:
                continue
            for container in listed:
                if every or container.labels.get(SERVICE_ID) in current:
                    found[container.labels.get(LABEL_NODE, container.name)] = (host.name, container)
        return dict(sorted(found.items()))

    def leftovers(self, run: FaultedRun) -> list[str]:
        """The run's services (on the manager), containers and network (on the hosts up) still there."""
        label = f"{LABEL_RUN}={run_label(run.run_dir)}"
        left: list[str] = []
        try:
            left += [f"service {s.name}" for s in self._services(run)]
            lead = engine(self.cluster.manager.engine, timeout_s=30)
            left += [f"network {n.name}" for n in lead.networks.list(filters={"label": label})]
        except EngineError as exc:
            left.append(f"the manager's engine does not answer ({exc})")
        left += [f"container of {name} on {host}" for name, (host, _c) in self.containers(run, every=True).items()]
        return left

    # -------------------------------------------------------------- injectors
    def injectors(self) -> dict[str, Callable[[FaultedRun, Fault], None]]:
        return {"partition": self.partition, "slow_host": self.slow_host, "container_pause": self.container_pause,
                "container_kill": self.container_kill, "lose_host": self.lose_host}

    def _pick_host(self, run: FaultedRun, fault: Fault) -> Optional[tuple[str, list[str], int]]:
        """A worker that is up and runs an edge node of the run, by the fault's pick: (the host, the edge nodes
        running on it, the edge nodes running anywhere), from one look at the hosts."""
        running = self.containers(run)
        hosts = sorted({host for host, _c in running.values()} & set(self.workers()))
        if not hosts:
            fault.skipped = "no worker host up runs an edge node"
            return None
        fault.target = hosts[int(fault.pick * len(hosts))]
        return fault.target, [name for name, (on, _c) in running.items() if on == fault.target], len(running)

    def _pick_container(self, run: FaultedRun, fault: Fault,
                        running: Optional[dict[str, tuple[str, object]]] = None) -> Optional[tuple[str, object]]:
        """An edge-node container of the run (of ``running`` where given), by the fault's pick: (host, container)."""
        running = self.containers(run) if running is None else running
        if not running:
            fault.skipped = "no edge-node container running"
            return None
        fault.target = list(running)[int(fault.pick * len(running))]
        return running[fault.target]

    def _faults(self) -> local_cluster.HostFaults:
        return local_cluster.HostFaults(self.cluster)

    def _hold_host(self, run: FaultedRun, fault: Fault, start: Callable[[str], str],
                   end: Callable[[str], None]) -> None:
        """A delay on a worker host: ``start(host)`` (saying what it did), ``duration_s``, ``end(host)``; it
        must cost none of the host's edge nodes."""
        picked = self._pick_host(run, fault)
        if picked is None:
            return
        host, nodes, _running = picked
        what = start(host)
        try:
            time.sleep(fault.duration_s)
        finally:
            end(host)
        fault.detail = f"{host} ({', '.join(nodes)}) {what} for {fault.duration_s:g} s"
        delayed_only(run, fault, nodes)

    def partition(self, run: FaultedRun, fault: Fault) -> None:
        faults = self._faults()

        def cut(host: str) -> str:
            faults.cut(host)
            return "cut off"

        self._hold_host(run, fault, cut, faults.heal)

    def slow_host(self, run: FaultedRun, fault: Fault) -> None:
        faults, cpus = self._faults(), round(random.Random(fault.pick).uniform(0.1, 0.5), 2)

        def slow(host: str) -> str:
            faults.slow(host, cpus)
            return f"held to {cpus:g} CPUs"

        self._hold_host(run, fault, slow, faults.restore)

    def container_pause(self, run: FaultedRun, fault: Fault) -> None:
        picked = self._pick_container(run, fault)
        if picked is None:
            return
        host, container = picked
        container.pause()
        try:
            time.sleep(fault.duration_s)
        finally:
            container.unpause()
        fault.detail = f"container on {host} paused for {fault.duration_s:g} s"
        delayed_only(run, fault, [fault.target])

    def container_kill(self, run: FaultedRun, fault: Fault) -> None:
        running = self.containers(run)
        if len(running) < 2:
            fault.skipped = "last edge node running (killing it ends the run: every edge node exited)"
            return
        host, container = self._pick_container(run, fault, running)
        container.kill()
        fault.lost = [fault.target]
        fault.detail = f"container on {host} killed"
        if not run.wait(lambda: fault.target in run.node_exits(fault.events_before) or not run.running(), 30.0) \
                or fault.target not in run.node_exits(fault.events_before):
            fault.problems.append("no node_exit event recorded")

    def lose_host(self, run: FaultedRun, fault: Fault) -> None:
        picked = self._pick_host(run, fault)
        if picked is None:
            return
        host, nodes, running = picked
        if running <= len(nodes):
            fault.skipped = f"{host} runs every edge node left (losing it ends the run)"
            return
        self._faults().lose(host)
        lost_at = len(run.events())
        self.lost.add(host)
        fault.lost = nodes
        fault.detail = f"{host} lost with {', '.join(nodes)}"
        clients = run.clients_of(nodes)
        # its clients are declared dead within the liveness timeout (and a heartbeat): the round in flight at the
        # loss may still count their updates; the next one, and every later one, aggregates none of them
        deadline = time.monotonic() + LIVENESS_S + 30.0
        later = lambda: [e for e in run.events()[lost_at:] if e["event"] == "round"]  # noqa: E731
        if not run.wait(lambda: len(later()) >= 2 or not run.running(), deadline - time.monotonic()):
            fault.problems.append("no two rounds recorded within the liveness timeout and 30 s of the loss")
        for record in later()[1:]:
            if set(record.get("contributors") or ()) & clients:
                fault.problems.append(f"round {record['round']} aggregated a client of the lost host")
