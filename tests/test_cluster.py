"""Many hosts for real: a local 3-host Swarm (`fcl-emu cluster up`), runs across it, and host-level faults.

Every host is a network namespace with its own Docker engine, address and cgroup (containers/local_cluster.py);
the edge nodes run as Swarm services spread over the hosts, their traffic crossing the overlay network. The tests
need root, iproute2, iptables and a Docker engine with the project's image (skipped, with the reason, where one
is missing; `.ci/run` installs them). The cluster is made once for the module and removed at its end; the tests
that lose a host, and resume on the hosts left, run last.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import yaml

from fcl_emu.containers import local_cluster
from fcl_emu.containers.cluster import Cluster, ClusterHost, engine, load_cluster
from fcl_emu.containers.faults import Target
from fcl_emu.containers.local_cluster import HostFaults
from fcl_emu.launchers.base import NodeSpec
from fcl_emu.launchers.engine_launcher import LABEL_CLASS
from fcl_emu.launchers.swarm import place
from fcl_emu.runconfig import load_config
from fcl_emu.scenario.faults import load_plan
from fcl_emu.bench.soak_checks import double_counts
from fcl_emu.monitoring import stack
from tests.conftest import free_port, up
from tests.test_monitoring import query_range

pytestmark = pytest.mark.timeout(900)

NAME = "ci"
SUBNET = "192.168.214.0/24"
HOSTS = [f"{NAME}-{i}" for i in (1, 2, 3)]
RUN = ["--clients", "60", "--clients-per-round", "10", "--nodes", "3", "--seed", "7"]
EMULATED = ["--clock", "emulated"]
# Every run here checks who took part, what was counted and where things ran, not what was learnt: 50 samples per
# client and task (MNIST's share is about 500) make a round's training a fraction of its messages' cost. The
# coordinator evaluates on one thread, as the edge nodes train beside it on this machine's cores (with torch's two
# an evaluation took 8 s there, not 1).
SMALL = {"scenario": {"samples_per_client_task": 50}, "coordinator_threads": 1}
# heartbeats and the liveness timeout of the tests that fault a host: its clients are declared dead within seconds
LIVENESS = {"network": {"heartbeat_interval_s": 1.0, "liveness_timeout_s": 4.0}}


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "a local cluster needs root (network namespaces, cgroups, iptables)"
    missing = [t for t in local_cluster.TOOLS if shutil.which(t) is None]
    return f"a local cluster needs {', '.join(missing)}" if missing else None


@pytest.fixture(scope="module")
def coming_cluster(image, tmp_path_factory) -> Iterator[Future[Cluster]]:
    """The module's cluster, made in a thread from the first test that asks for it: loading the image into the
    three hosts' engines takes minutes, in which the first test runs what needs no cluster."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(1) as pool:
        mp.setenv("FCL_EMU_CLUSTERS", str(tmp_path_factory.mktemp("clusters")))
        local_cluster.down(NAME)  # what a killed test session left
        made = pool.submit(local_cluster.up, NAME, 3, SUBNET, image, log=lambda _msg: None)
        try:
            yield made
        finally:
            wait([made])  # a failed `up` removed what it made; a finished one is removed here
            local_cluster.down(NAME)
        assert local_cluster.leftovers(NAME) == []


@pytest.fixture(scope="module")
def cluster(coming_cluster) -> Cluster:
    return coming_cluster.result()


def _config(tmp: Path, faults: list[dict] | None = None, **sections: dict) -> list[str]:
    """A config file of :data:`SMALL` and ``sections`` (and a fault plan): the flags that use them."""
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump({**SMALL, **sections}))
    flags = ["--config", str(config)]
    if faults:
        plan = tmp / "faults.yaml"
        plan.write_text(yaml.safe_dump({"faults": faults}))
        flags += ["--faults", str(plan)]
    return flags


# -- no engine needed ----------------------------------------------------------------------------------------


def _cluster_file(tmp: Path, kind: str = "local") -> Path:
    path = tmp / "cluster.json"
    path.write_text(Cluster(name="lab", kind=kind, advertise="10.9.0.1", hosts=[
        ClusterHost(name=f"lab-{i}", address=f"10.9.0.{10 + i}", engine=f"unix:///nowhere/{i}.sock", manager=i == 1)
        for i in (1, 2, 3)]).model_dump_json())
    return path


def test_host_faults_are_checked_against_the_plan_the_config_and_the_cluster(tmp_path):
    plan = tmp_path / "plan.yaml"
    for text, problem in [("{action: lose_host, node: node-1, round: 2}", "name it with host"),
                          ("{action: slow_host, host: lab-2, round: 2}", "slow_host needs cpus"),
                          ("{action: partition, host: lab-2, round: 2, cpus: 1}", "only slow_host takes it"),
                          ("{action: partition, host: lab-2, round: 2, duration_s: null}", "heals after"),
                          ("{action: kill, host: lab-2, round: 2}", "acts on an edge node")]:
        plan.write_text(f"faults:\n  - {text}\n")
        with pytest.raises(ValueError, match=problem):
            load_plan(plan)
    plan.write_text("faults:\n  - {action: partition, host: lab-1, round: 2, duration_s: 20}\n")
    with pytest.raises(ValueError, match="--backend swarm --cluster NAME"):
        load_config(None, {"containers": {"faults": str(plan), "backend": "docker"}})
    with pytest.raises(ValueError, match="use it with --backend swarm"):
        load_config(None, {"containers": {"cluster": "lab", "backend": "docker"}})
    cluster = load_cluster(_cluster_file(tmp_path))
    target = Target(dict, {}, None, HostFaults(cluster), {"node-0": "lab-1"})
    with pytest.raises(ValueError, match="swarm manager's host cannot be faulted"):
        target.check(load_plan(plan))
    plan.write_text("faults:\n  - {action: lose_host, host: lab-9, round: 2}\n")
    with pytest.raises(ValueError, match="has no host 'lab-9'"):
        target.check(load_plan(plan))
    with pytest.raises(ValueError, match="--cluster NAME"):
        Target(dict, {}, None).check(load_plan(plan))
    with pytest.raises(local_cluster.ClusterError, match="act on a local cluster"):
        HostFaults(load_cluster(_cluster_file(tmp_path, kind="remote")))


def test_edge_nodes_go_round_robin_over_their_class_s_hosts_or_over_all():
    hosts = [{"id": f"id-{h}", "hostname": h, "labels": labels} for h, labels in
             [("c", {LABEL_CLASS: "budget"}), ("a", {}), ("b", {LABEL_CLASS: "budget"})]]
    specs = [NodeSpec(n, f"node-{n}", [n], device_class=cls) for n, cls in
             enumerate(["budget", None, "budget", "budget", None, "flagship", None])]
    placed = {name: host["hostname"] for name, host in place(specs, hosts).items()}
    # budget: b, c, b; the others (a class no host is labelled for included): a, b, c, a
    assert placed == {"node-0": "b", "node-2": "c", "node-3": "b",
                      "node-1": "a", "node-4": "b", "node-5": "c", "node-6": "a"}


def test_cluster_files_say_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("FCL_EMU_CLUSTERS", str(tmp_path / "none"))
    with pytest.raises(ValueError, match="no cluster 'local'.*fcl-emu cluster up"):
        load_cluster("local")
    path = tmp_path / "bad.json"
    path.write_text('{"name": "x", "advertise": "a", "hosts": [{"name": "h", "address": "a", "engine": "e"}]}')
    with pytest.raises(ValueError, match="exactly one manager"):
        load_cluster(path)
    assert load_cluster(_cluster_file(tmp_path)).manager.name == "lab-1"
    with pytest.raises(local_cluster.ClusterError, match="1 to 8 lower-case"):
        local_cluster.up("Bad_Name")


# -- a real cluster ------------------------------------------------------------------------------------------


def test_down_removes_what_a_crashed_cluster_up_left(tmp_path, monkeypatch):
    """A `cluster up` killed half-way leaves a bridge, a namespace, a veth, a cgroup and state: `down` finds them by
    their names and removes them all."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("FCL_EMU_CLUSTERS", str(tmp_path))
    name = "crashed"
    local_cluster.down(name)
    local_cluster._bridge_up(name, "192.168.215.1", 24)
    subprocess.run(["ip", "netns", "add", local_cluster.netns(name, 1)], check=True)
    subprocess.run(["ip", "link", "add", local_cluster.veth(name, 1), "type", "veth", "peer", "name", "eth0",
                    "netns", local_cluster.netns(name, 1)], check=True)
    for directory in local_cluster._cgroup_dirs(name, f"{name}-1"):
        (directory / "engine").mkdir(parents=True)
    (local_cluster.state_dir(name) / f"{name}-1").mkdir(parents=True)
    assert len(local_cluster.leftovers(name)) >= 5
    local_cluster.down(name)
    assert local_cluster.leftovers(name) == []
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
    assert f"fcl-emu-{name}" not in rules


@pytest.mark.slow
def test_the_same_run_as_processes_in_containers_and_across_three_hosts(coming_cluster, image, tmp_path,
                                                                       mnist_root, no_leftovers):
    """60 clients on 3 edge nodes as host processes, as containers on this machine's engine, and as Swarm services
    one per host over the overlay network (the same seed, the emulated clock): the same accuracy matrix, the same
    participants in every round and the same bytes of every message type that does not follow host time. The
    first two run while the cluster is being made (the emulated clock keeps them from its load)."""
    args = [*RUN, *EMULATED, "--tasks", "2", "--rounds-per-task", "2", "--local-epochs", "1", "--data-root",
            str(mnist_root), *_config(tmp_path)]
    runs = {}
    for backend, flags in [("process", []), ("docker", ["--backend", "docker", "--image", image]),
                           ("swarm", ["--backend", "swarm", "--cluster", NAME, "--image", image])]:
        if backend == "swarm":
            cluster = coming_cluster.result()
            rows = {row["host"]: row for row in local_cluster.status(cluster)}
            assert [rows[h]["swarm"] for h in HOSTS] == ["ready"] * 3
            assert [rows[h]["engine"] for h in HOSTS] == ["up"] * 3
        done, summary, events = up(tmp_path / backend, *args, *flags)
        assert done.returncode == 0, done.stderr[-2000:]
        assert summary.status == "completed"
        runs[backend] = (summary, [e["contributors"] for e in events if e["event"] == "round"])
    assert runs["swarm"][0].edge_node_hosts == {"node-0": HOSTS[0], "node-1": HOSTS[1], "node-2": HOSTS[2]}
    # heartbeats follow host time, a join carries the node's process id, and the run's end reaches the clients
    # still connected in host time: every other message is byte-equal
    host_timed = ("heartbeat", "join", "shutdown")
    process, contributors = runs.pop("process")
    for summary, their_contributors in runs.values():
        assert summary.accuracy_matrix == process.accuracy_matrix
        assert their_contributors == contributors
        assert ({t: v for t, v in summary.bytes.items() if t not in host_timed}
                == {t: v for t, v in process.bytes.items() if t not in host_timed})
    assert all(row["containers"] == 0 for row in local_cluster.status(cluster))
    no_leftovers()


@pytest.mark.slow
def test_a_partitioned_host_s_clients_leave_and_rejoin(cluster, image, tmp_path, mnist_root):
    """Host 3 is cut off both ways for 6 s from round 2: its 20 clients are declared dead after the liveness
    timeout, join again once it is healed, and no update is aggregated twice (those sent into the cut arrive
    late and are dropped)."""
    # 6 s: its clients are declared dead 3-4 s after the cut (the liveness timeout after their last heartbeat),
    # well before the heal; and the heal comes before 6.2 s, when TCP first retransmits what the nodes sent into
    # the cut (after 0.2 s, doubling), so they are back within a second or two (after a 20 s cut the next try
    # can come 6 s after the heal)
    faults = [{"action": "partition", "host": HOSTS[2], "round": 2, "duration_s": 6}]
    # The run must outlast the cut and the rejoin in host time on any host, however fast it trains: under the
    # real clock (the container backends' own) a profile of 60 ms per sample holds each update back until 3 s
    # after its training began, so every round takes 3 s or more. Round 2 waits about 4 s for the deaths; rounds
    # 3-6 then take 12 s or more, past the heal (under 2 s after round 2) and the clients' return (about 2 s
    # after it). No evaluation before the task's end.
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(yaml.safe_dump({"profiles": [{"name": "paced", "ms_per_sample": 60}]}))
    config = _config(tmp_path, faults, **LIVENESS, edge={"device_profiles": str(profiles)},
                     rounds={"eval_every": 100})
    args = [*RUN, "--clock", "real", "--tasks", "1", "--rounds-per-task", "6", "--local-epochs", "1",
            "--data-root", str(mnist_root)]
    done, summary, events = up(tmp_path, *args, *config, "--backend", "swarm", "--cluster", NAME, "--image", image)
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary.status == "completed"
    applied = [(e["action"], e["host"], e["nodes"]) for e in events if e["event"] == "fault" and e["applied"]]
    assert applied == [("partition", HOSTS[2], ["node-2"]), ("heal", HOSTS[2], ["node-2"])]
    assert summary.clients.dropped == 20 and summary.clients.rejoined == 20 and summary.clients.online_at_end == 60
    assert double_counts(events) == []
    assert not any(e["event"] == "node_exit" for e in events)  # the partition ended no edge node
    assert local_cluster.HostFaults(cluster).quota(HOSTS[2]) is None


@pytest.mark.slow
def test_a_slowed_host_shares_its_cpu_quota_among_all_it_runs(cluster, image):
    """slow_host's quota binds everything on the host: a busy container there is throttled by the host's cgroup
    (its own container has no limit) and gets at most its share; restore lifts it."""
    faults = local_cluster.HostFaults(cluster)
    faults.slow(HOSTS[1], 0.25)
    try:
        assert faults.quota(HOSTS[1]) == 0.25
        stat = local_cluster._cgroup_file(NAME, HOSTS[1], "cpu", "cpu.stat")
        throttled = int(dict(line.split() for line in stat.read_text().splitlines())["nr_throttled"])
        busy = ("import time\nt = time.time()\nwhile time.time() - t < 2: pass\nprint(time.process_time())")
        output = engine(cluster.host(HOSTS[1]).engine).containers.run(
            image, ["-c", busy], entrypoint="python", remove=True).decode()
        assert float(output) < 0.25 * 2 + 0.5  # unthrottled it would be near 2 s on an idle CPU
        assert int(dict(line.split() for line in stat.read_text().splitlines())["nr_throttled"]) > throttled
    finally:
        faults.restore(HOSTS[1])
    assert faults.quota(HOSTS[1]) is None


@pytest.mark.slow
def test_losing_a_host_drops_its_clients_and_the_run_completes(cluster, image, tmp_path, mnist_root):
    """Host 2 (engine and containers) is lost in round 2 once its clients were sent their requests (placed by
    that event of the run, not by a delay): its 20 clients are dropped within the liveness
    timeout, the run completes, the fault is an event and a metric, and Prometheus scraped every host's node and
    every host's container counters. Round 5: node-2's container on host 3 is killed through host 3's engine."""
    if stack.prometheus_binary() is None:
        pytest.skip("the `prometheus` binary is not installed (`apt-get install prometheus`; .ci/run installs it)")
    faults = [{"action": "lose_host", "host": HOSTS[1], "round": 2, "round_point": "dispatched"},
              {"action": "kill", "node": "node-2", "round": 5, "round_point": "dispatched"}]
    metrics_port = stack.find_port_block("0.0.0.0", 1, start=20000 + free_port() % 20000, stop=65000)
    args = [*RUN, *EMULATED, "--tasks", "2", "--rounds-per-task", "3", "--local-epochs", "1", "--data-root",
            str(mnist_root), "--metrics-port", str(metrics_port), "--prometheus", "--prometheus-port", str(free_port())]
    # Prometheus scrapes, and the containers' counters are sampled, every second (default 5 s): the first round
    # waits for a first scrape of every process and the run's end for a last one, and node-1's container is
    # sampled before its host is lost however quickly the rounds go
    config = _config(tmp_path, faults, **LIVENESS, metrics={"scrape_interval_s": 1.0})
    started = time.time()
    done, summary, events = up(tmp_path, *args, *config, "--backend", "swarm", "--cluster", NAME, "--image", image)
    ended = time.time()
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary.status == "completed" and summary.clients.dropped == 40
    lost, killed = [e for e in events if e["event"] == "fault"]
    assert (lost["action"], lost["host"], lost["nodes"], lost["applied"]) == ("lose_host", HOSTS[1], ["node-1"], True)
    assert (killed["action"], killed["node"], killed["applied"]) == ("kill", "node-2", True)
    assert [(e["node"], e["host"]) for e in events if e["event"] == "node_exit"] == [("node-2", HOSTS[2])]
    after = [e for e in events if e["event"] == "round" and e["time"] > lost["time"]]
    # the round it was lost in closes once its clients there are declared dead: the liveness timeout, and slack
    assert after[0]["time"] - lost["time"] < 4.0 + 3.0
    # The host's other clients die at their own liveness timeouts, each within a heartbeat (1 s) and an expiry
    # scan of the loss plus 4 s: a round that closes later than that, before node-2's kill, sees the 40 left. On a
    # fast host rounds 3 and 4 may close before it (each heartbeat is the client's own), so none is owed; none
    # sees fewer than 40, and once node-2's 20 are gone too, the 20 of node-0 are all that stay online.
    settled = lost["time"] + 4.0 + 1.0 + 1.0
    before_kill = [e for e in after if e["round"] < 5]
    assert all(e["online"] >= 40 for e in before_kill)
    assert all(e["online"] == 40 for e in before_kill if e["time"] > settled)
    assert summary.clients.online_at_end == 20
    # an update that reached the coordinator before the host was lost may count (on a fast host a client trains
    # in less time than the cut takes); nothing of the lost host counts in a later round, and nothing twice
    on_lost_host = {f"client-{i:04d}" for i in range(1, 60, 3)}  # node-1's clients (striped over 3 nodes)
    assert after[0]["round"] == 2
    # every client of the round answered in time or died with its host: none is late at the 120 s deadline
    assert after[0]["late"] == 0 and after[0]["participants"] + after[0]["dropped"] == after[0]["selected"]
    assert all(not set(e["contributors"]) & on_lost_host for e in after[1:])
    assert double_counts(events) == []
    assert local_cluster.status(cluster)[1]["engine"] == "down"

    run_id = json.loads((tmp_path / "run" / stack.TARGETS_FILE).read_text())[0]["labels"]["run_id"]
    prometheus = stack.LocalPrometheus(tmp_path / "run", port=free_port(), scrape_interval_s=1.0)
    prometheus.start()
    try:
        faults_seen = query_range(prometheus.url, f'fcl_host_faults_total{{run_id="{run_id}"}}', started, ended)
        assert faults_seen and faults_seen[0]["metric"]["action"] == "lose_host"
        assert max(float(v) for _t, v in faults_seen[0]["values"]) == 1.0
        scraped = query_range(prometheus.url, f'up{{run_id="{run_id}",role="edge_node"}} == 1', started, ended)
        assert {s["metric"]["process"] for s in scraped} == {"node-0", "node-1", "node-2"}
        assert {s["metric"]["instance"].partition(":")[0] for s in scraped} == {h.address for h in cluster.hosts}
        used = query_range(prometheus.url, f'fcl_container_cpu_seconds_total{{run_id="{run_id}"}} > 0', started, ended)
        assert {s["metric"]["node"] for s in used} == {"node-0", "node-1", "node-2"}
    finally:
        prometheus.stop()


@pytest.mark.slow
def test_after_a_lost_host_a_run_is_stopped_and_resumes_on_the_hosts_left(cluster, image, tmp_path, mnist_root):
    """Host 2 lost (by the test before, or here): a run places its edge nodes on the hosts left, is stopped by
    SIGTERM after its first round and `up --resume` finishes it there, each update aggregated once."""
    import signal

    from fcl_emu.monitoring.results import RunSummary
    from tests.conftest import events as read_events, fcl_emu, kill_left, wait_for

    if local_cluster.status(cluster)[1]["engine"] != "down":
        local_cluster.HostFaults(cluster).lose(HOSTS[1])
    run_dir = tmp_path / "run"
    args = [*RUN, *EMULATED, "--tasks", "2", "--rounds-per-task", "2", "--local-epochs", "1", "--data-root",
            str(mnist_root), *_config(tmp_path), "--backend", "swarm", "--cluster", NAME, "--image", image]
    run = fcl_emu("up", "--run-dir", str(run_dir), *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    resumed = None
    try:
        wait_for(lambda: any(e["event"] == "round" for e in read_events(run_dir)), 300, "the first round")
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 143, out[-3000:]
        assert RunSummary.load(run_dir / "summary.json").status == "interrupted: SIGTERM"
        resumed = fcl_emu("up", "--resume", str(run_dir), "--data-root", str(mnist_root), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
        out, _ = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, out[-3000:]
    finally:
        kill_left(run, resumed)
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.resumes == 1 and summary.rounds == 4
    assert set(summary.edge_node_hosts.values()) == {HOSTS[0], HOSTS[2]}
    assert double_counts(read_events(run_dir)) == []
    assert all(row["containers"] == 0 for row in local_cluster.status(cluster) if row["engine"] == "up")
