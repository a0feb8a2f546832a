"""A local cluster: N emulated hosts on this machine joined into one Swarm (``fcl-emu cluster up|status|down``).

Each host is a network namespace with its own address on a bridge of this machine, its own Docker engine
(``dockerd`` started inside the namespace, with its own data root, sockets and host name) and its own cgroup,
which holds the engine and every container it runs. Host 1 is the Swarm manager; the others join it as workers
over the bridge, so a service's traffic between hosts crosses Swarm's VXLAN overlay as it would between
machines. The machine itself (the root namespace, where ``fcl-emu up`` runs the coordinator and Prometheus) is
the bridge's first address: the hosts dial the coordinator there, and it scrapes them at theirs.

Why namespaces with their own ``dockerd`` rather than engines in privileged containers: no engine image to
build, the hosts' engines use the machine's storage driver directly (an engine inside a container needs a volume
for its data, overlay on overlay does not mount), a host's whole network is one veth pair that a partition cuts
and heals, and a host's whole life is one cgroup that a lost host is frozen and killed through, engine and
containers at once. The cost: it needs root (``ip netns``, cgroups, iptables), and the hosts share this
machine's kernel, CPUs and file system (the data roots are at the same path on every host, as they must be on
real machines).

Everything is named after the cluster (netns ``fcl-emu-NAME-I``, links ``fclNAME-br`` / ``fclNAME-I``, cgroups
``/fcl-emu-NAME``, an iptables rule commented ``fcl-emu-NAME``, state under ``CLUSTERS/NAME`` and
``/run/fcl-emu/NAME``), so :func:`down` finds and removes all of it from the names alone, also after ``up`` itself
crashed half-way.

:class:`HostFaults` gives the fault plans their host-level actions: lose a host, cut it off (both directions)
and heal it, slow it (a CPU quota on its cgroup) and restore it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from fcl_emu.containers.cluster import (LABEL_CLASS, LABEL_HOST, Cluster, ClusterHost, clusters_dir, distribute_image,
                                        engine, save_cluster, FILE)
from fcl_emu.containers.docker_client import EngineError

NAME = re.compile(r"^[a-z0-9]{1,8}$")
RUN_ROOT = Path("/run/fcl-emu")
CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("cpu", "cpuacct", "freezer", "pids")
SWARM_POOL = "10.213.0.0/16"  # the overlay networks' subnets (Swarm's default, 10.0.0.0/8, may clash with a LAN)
# Swarm declares a worker down after 3 missed heartbeats and then shuts its tasks down when it is back: with its
# default 5 s period a partition longer than 15 s would end the host's edge nodes, an artefact of the
# orchestrator, not of the network being emulated. At 30 s a partition of up to 90 s leaves them running.
DISPATCHER_HEARTBEAT_S = 30
TOOLS = ("ip", "nsenter", "unshare", "dockerd", "iptables")


class ClusterError(RuntimeError):
    """The local cluster cannot be made or used; the message says why in one line."""


# -- names ---------------------------------------------------------------------------------------------------------

def host_name(name: str, i: int) -> str:
    return f"{name}-{i}"


def netns(name: str, i: int) -> str:
    return f"fcl-emu-{name}-{i}"


def bridge(name: str) -> str:
    return f"fcl{name}-br"


def veth(name: str, i: int) -> str:
    return f"fcl{name}-{i}"


def run_dir(name: str, i: int) -> Path:
    return RUN_ROOT / name / str(i)


def state_dir(name: str) -> Path:
    return clusters_dir() / name


def _comment(name: str) -> str:
    return f"fcl-emu-{name}"


def _index(cluster: Cluster, host: str) -> int:
    return cluster.hosts.index(cluster.host(host)) + 1


# -- helpers -------------------------------------------------------------------------------------------------------

def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def _cgroup_v2() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def _cgroup_dirs(name: str, host: str | None = None) -> list[Path]:
    """The cluster's (or one host's) cgroup directories, one per controller hierarchy."""
    rel = Path(f"fcl-emu-{name}") / (host or "")
    if _cgroup_v2():
        return [CGROUP_ROOT / rel]
    return [CGROUP_ROOT / c / rel for c in V1_CONTROLLERS if (CGROUP_ROOT / c).is_dir()]


def _cgroup_file(name: str, host: str, v1_controller: str, filename: str) -> Path:
    if _cgroup_v2():
        return CGROUP_ROOT / f"fcl-emu-{name}" / host / filename
    return CGROUP_ROOT / v1_controller / f"fcl-emu-{name}" / host / filename


def _pids(directory: Path) -> set[int]:
    pids = set()
    for procs in directory.rglob("cgroup.procs"):
        try:
            pids.update(int(p) for p in procs.read_text().split())
        except OSError:
            continue
    return pids


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise ClusterError("a local cluster needs root (network namespaces, cgroups, iptables): run it as root")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"a local cluster needs {', '.join(missing)} (Debian: iproute2, util-linux, docker.io, "
                           f"iptables)")


# -- up ------------------------------------------------------------------------------------------------------------

def up(name: str = "local", hosts: int = 3, subnet: str = "192.168.213.0/24", image: str | None = None,
       classes: dict[str, str] | None = None, log=print) -> Cluster:
    """Make cluster ``name`` of ``hosts`` hosts on ``subnet`` and load ``image`` (None: build or reuse the
    project's) into every engine; ``classes`` labels hosts with device classes. Anything made is removed again if
    this fails."""
    if not NAME.match(name):
        raise ClusterError(f"cluster name {name!r}: 1 to 8 lower-case letters or digits")
    if not 1 <= hosts <= 50:
        raise ClusterError(f"--hosts {hosts}: 1 to 50")
    net = ipaddress.ip_network(subnet)
    if net.num_addresses < hosts + 11:
        raise ClusterError(f"subnet {subnet} has no room for {hosts} hosts")
    unknown = set(classes or {}) - {host_name(name, i) for i in range(1, hosts + 1)}
    if unknown:
        raise ClusterError(f"--device-class names no host of this cluster: {', '.join(sorted(unknown))}")
    check_prerequisites()
    if leftovers(name):
        raise ClusterError(f"cluster {name} exists (or a crashed `cluster up` left parts of it): "
                           f"`fcl-emu cluster down --name {name}` first")
    from fcl_emu.containers.image import image_ref

    ref = image_ref(image)  # before making anything: a missing engine or image fails here
    gateway = str(net.network_address + 1)
    try:
        _bridge_up(name, gateway, net.prefixlen)
        members = []
        for i in range(1, hosts + 1):
            address = str(net.network_address + 10 + i)
            _host_up(name, i, address, gateway, net.prefixlen)
            members.append(ClusterHost(name=host_name(name, i), address=address, manager=i == 1,
                                       engine=f"unix://{run_dir(name, i) / 'docker.sock'}"))
        cluster = Cluster(name=name, kind="local", advertise=gateway, hosts=members)
        clients = {h.name: _wait_for_engine(h, state_dir(name) / h.name / "dockerd.log") for h in members}
        _join_swarm(cluster, clients, classes or {})
        save_cluster(cluster, state_dir(name) / FILE)
        distribute_image(ref, clients, log=log)
    except BaseException:
        down(name)
        raise
    return cluster


def _bridge_up(name: str, gateway: str, prefix: int) -> None:
    br = bridge(name)
    _sh("ip", "link", "add", br, "type", "bridge")
    _sh("ip", "addr", "add", f"{gateway}/{prefix}", "dev", br)
    _sh("ip", "link", "set", br, "up")
    # the machine's FORWARD policy may be DROP (Docker sets it): let the hosts reach each other over the bridge
    _sh("iptables", "-I", "FORWARD", "-i", br, "-o", br, "-j", "ACCEPT", "-m", "comment", "--comment",
        _comment(name))


def _host_up(name: str, i: int, address: str, gateway: str, prefix: int) -> None:
    ns, link = netns(name, i), veth(name, i)
    _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _sh("ip", "link", "set", link, "master", bridge(name), "up")
    _sh("ip", "-n", ns, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
    _sh("ip", "-n", ns, "link", "set", "eth0", "up")
    _sh("ip", "-n", ns, "link", "set", "lo", "up")
    _sh("ip", "-n", ns, "route", "add", "default", "via", gateway)
    host = host_name(name, i)
    for directory in _cgroup_dirs(name, host):
        (directory / "engine").mkdir(parents=True, exist_ok=True)
    data, run = state_dir(name) / host, run_dir(name, i)
    data.mkdir(parents=True, exist_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    (data / "daemon.json").write_text("{}\n")  # not the machine's /etc/docker/daemon.json
    join_cgroups = "; ".join(f"echo $$ > {d / 'engine' / 'cgroup.procs'}" for d in _cgroup_dirs(name, host))
    dockerd = (f"exec env DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1 dockerd --config-file {data / 'daemon.json'} "
               f"--data-root {data / 'docker'} --exec-root {run / 'exec'} --pidfile {run / 'dockerd.pid'} "
               f"-H unix://{run / 'docker.sock'} --cgroup-parent /fcl-emu-{name}/{host}/containers --log-level warn")
    # a UTS namespace of its own (the swarm node's name), this host's network namespace, its cgroup
    script = f"{join_cgroups}; hostname {host}; {dockerd}"
    with open(data / "dockerd.log", "ab") as out:
        subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "sh", "-c", script],
                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_for_engine(host: ClusterHost, log: Path, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return engine(host.engine, timeout_s=900)  # loading an image takes minutes
        except EngineError:
            if time.monotonic() > deadline:
                raise ClusterError(f"the engine of host {host.name} did not come up in {timeout_s:.0f} s (its log: "
                                   f"{log})")
            time.sleep(0.5)


def _join_swarm(cluster: Cluster, clients: dict, classes: dict[str, str]) -> None:
    manager = cluster.manager
    lead = clients[manager.name]
    lead.swarm.init(advertise_addr=manager.address, listen_addr=f"{manager.address}:2377",
                    default_addr_pool=[SWARM_POOL], subnet_size=24,
                    dispatcher_heartbeat_period=int(DISPATCHER_HEARTBEAT_S * 1e9))
    lead.swarm.reload()
    token = lead.swarm.attrs["JoinTokens"]["Worker"]
    for host in cluster.hosts:
        if not host.manager:
            clients[host.name].swarm.join(remote_addrs=[f"{manager.address}:2377"], join_token=token,
                                          listen_addr=f"{host.address}:2377", advertise_addr=host.address)
    deadline = time.monotonic() + 60
    while True:
        nodes = {n.attrs["Description"]["Hostname"]: n for n in lead.nodes.list()}
        if all(h.name in nodes and nodes[h.name].attrs["Status"]["State"] == "ready" for h in cluster.hosts):
            break
        if time.monotonic() > deadline:
            raise ClusterError("the hosts did not all join the swarm within 60 s")
        time.sleep(0.5)
    for host in cluster.hosts:
        node = nodes[host.name]
        labels = {LABEL_HOST: host.name, **({LABEL_CLASS: classes[host.name]} if host.name in classes else {})}
        node.update({**node.attrs["Spec"], "Labels": {**node.attrs["Spec"].get("Labels", {}), **labels}})


# -- status and down -----------------------------------------------------------------------------------------------

def _links(name: str) -> list[str]:
    """The cluster's network links on this machine (its bridge and the hosts' veth ends)."""
    links = _sh("ip", "-o", "link", "show", check=False).stdout
    return sorted(set(re.findall(rf"\d+: (fcl{name}-[\w]+)[@:]", links)))


def _namespaces(name: str) -> list[str]:
    return sorted(s for s in _sh("ip", "netns", "list", check=False).stdout.split() if s.startswith(f"fcl-emu-{name}-"))


def leftovers(name: str) -> list[str]:
    """What of cluster ``name`` exists on this machine (links, namespaces, cgroups, state), by name."""
    found = _links(name) + _namespaces(name)
    found += [str(d) for d in _cgroup_dirs(name) if d.exists()]
    found += [str(d) for d in (state_dir(name), RUN_ROOT / name) if d.exists()]
    return found


def status(cluster: Cluster) -> list[dict]:
    """Each host: its address, whether its engine answers, its swarm state, link and CPU quota, containers."""
    out = []
    lead = None
    try:
        lead = engine(cluster.manager.engine, timeout_s=10)
        nodes = {n.attrs["Description"]["Hostname"]: n.attrs for n in lead.nodes.list()}
    except EngineError:
        nodes = {}
    for i, host in enumerate(cluster.hosts, start=1):
        row = {"host": host.name, "address": host.address, "manager": host.manager,
               "swarm": nodes.get(host.name, {}).get("Status", {}).get("State", "unknown")}
        try:
            row["containers"] = len(engine(host.engine, timeout_s=5).containers.list())
            row["engine"] = "up"
        except EngineError:
            row["engine"], row["containers"] = "down", None
        if cluster.kind == "local":
            state = _sh("ip", "-o", "link", "show", veth(cluster.name, i), check=False).stdout
            row["link"] = "up" if "state UP" in state or "LOWER_UP" in state else "cut"
            row["cpus"] = HostFaults(cluster).quota(host.name)
        out.append(row)
    return out


def down(name: str = "local") -> list[str]:
    """Remove everything of cluster ``name`` (see :func:`leftovers`); what it removed."""
    removed = leftovers(name)
    _kill_all(name)
    _unmount_under([RUN_ROOT / name, state_dir(name)])
    for space in _namespaces(name):
        _sh("ip", "netns", "del", space, check=False)
    for link in _links(name):
        _sh("ip", "link", "del", link, check=False)
    while _sh("iptables", "-D", "FORWARD", "-i", bridge(name), "-o", bridge(name), "-j", "ACCEPT", "-m", "comment",
              "--comment", _comment(name), check=False).returncode == 0:
        pass
    for directory in _cgroup_dirs(name):
        for sub in sorted((p for p in directory.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            sub.rmdir()
        if directory.exists():
            directory.rmdir()
    for directory in (state_dir(name), RUN_ROOT / name):
        shutil.rmtree(directory, ignore_errors=True)
    return removed


def _kill_all(name: str, host: str | None = None) -> None:
    """SIGKILL every process of the cluster (or of one host): its engines, their containerd and every container
    (frozen first on cgroup v1, so that none forks meanwhile)."""
    if _cgroup_v2():
        directory = CGROUP_ROOT / f"fcl-emu-{name}" / (host or "")
        if directory.exists():
            (directory / "cgroup.kill").write_text("1")
    else:
        directory = CGROUP_ROOT / "freezer" / f"fcl-emu-{name}" / (host or "")
        if not directory.exists():
            return
        state = directory / "freezer.state"
        if state.exists():  # the cluster's root has no state file of its own to write in some kernels
            state.write_text("FROZEN")
        for pid in _pids(directory):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if state.exists():
            state.write_text("THAWED")
    deadline = time.monotonic() + 10
    while _pids(directory) and time.monotonic() < deadline:
        time.sleep(0.1)


def _unmount_under(roots: list[Path]) -> None:
    """Lazily unmount every mount below ``roots`` (a killed engine's overlays and namespace files), deepest first."""
    prefixes = tuple(str(r) + "/" for r in roots)
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].encode().decode("unicode_escape") for line in f]
    for point in sorted((p for p in points if p.startswith(prefixes)), key=len, reverse=True):
        _sh("umount", "-l", point, check=False)


# -- host faults ---------------------------------------------------------------------------------------------------

class HostFaults:
    """The host-level faults of a local cluster (the fault plans' ``lose_host``, ``partition``, ``slow_host``)."""

    def __init__(self, cluster: Cluster):
        if cluster.kind != "local":
            raise ClusterError(f"host faults act on a local cluster (`fcl-emu cluster up`); {cluster.name} is "
                               f"{cluster.kind}")
        self.cluster = cluster

    def _check(self, host: str) -> ClusterHost:
        target = self.cluster.host(host)
        if target.manager:
            raise ClusterError(f"{host} is the swarm manager: host faults act on the other hosts")
        return target

    def cut(self, host: str) -> None:
        """Cut ``host`` off the others and the machine, both directions (its link goes down)."""
        self._check(host)
        _sh("ip", "link", "set", veth(self.cluster.name, _index(self.cluster, host)), "down")

    def heal(self, host: str) -> None:
        _sh("ip", "link", "set", veth(self.cluster.name, _index(self.cluster, host)), "up")

    def lose(self, host: str) -> None:
        """The host is gone at once: silent (cut first, so no connection is closed politely), then its engine
        and every container on it are killed together."""
        self.cut(host)
        _kill_all(self.cluster.name, host)

    def slow(self, host: str, cpus: float) -> None:
        """Everything ``host`` runs shares ``cpus`` CPUs (a CFS quota on its cgroup)."""
        self._check(host)
        self._set_quota(host, cpus)

    def restore(self, host: str) -> None:
        self._set_quota(host, None)

    def quota(self, host: str) -> float | None:
        """The host's CPU quota (None: none)."""
        if _cgroup_v2():
            text = _cgroup_file(self.cluster.name, host, "cpu", "cpu.max")
            if not text.exists():
                return None
            quota, period = text.read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        path = _cgroup_file(self.cluster.name, host, "cpu", "cpu.cfs_quota_us")
        if not path.exists():
            return None
        quota = int(path.read_text())
        period = int(path.with_name("cpu.cfs_period_us").read_text())
        return None if quota < 0 else quota / period

    def _set_quota(self, host: str, cpus: float | None) -> None:
        if _cgroup_v2():
            value = "max 100000" if cpus is None else f"{int(cpus * 100000)} 100000"
            _cgroup_file(self.cluster.name, host, "cpu", "cpu.max").write_text(value)
        else:
            path = _cgroup_file(self.cluster.name, host, "cpu", "cpu.cfs_quota_us")
            period = int(path.with_name("cpu.cfs_period_us").read_text())
            path.write_text(str(-1 if cpus is None else int(cpus * period)))
