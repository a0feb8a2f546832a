"""Edge realism: availability models, traces, device profiles and links, and real runs with churn."""

from __future__ import annotations

import itertools
import json
import math
import pickle
import resource
import subprocess
import sys

import pytest
import yaml

from fcl_emu.scenario.availability import client_availability, load_trace, parse_availability, transitions
from fcl_emu.scenario.links import Link
from fcl_emu.scenario.devices import DeviceProfile, assign_profile, load_profiles
from fcl_emu.monitoring.results import RunSummary
from tests.conftest import fcl_emu, free_port, small_config


# ------------------------------------------------------------- availability
@pytest.mark.parametrize("text, why", [
    ("sometimes", "unknown availability"),
    ("bernoulli:1.5", "0 < P <= 1"),
    ("bernoulli:x", "not a number"),
    ("onoff:10", "onoff:MEAN_ON_S:MEAN_OFF_S"),
    ("onoff:0:5", "MEAN_ON_S > 0"),
    ("onoff:nan:5", "not finite"),
    ("trace:/nonexistent/trace.json", "No such file"),
])
def test_bad_availability_is_named(text, why):
    with pytest.raises(ValueError, match=why):
        parse_availability(text)


def first(stream, n):
    return list(itertools.islice(stream, n))


def test_bernoulli_slots_follow_p_and_are_reproducible():
    model = client_availability(parse_availability("bernoulli:0.3"), 7, seed=1, slot_s=2.0, trace_time_scale=1)
    changes = first(transitions(model), 2000)
    assert changes == first(transitions(model), 2000)
    assert all(t % 2.0 == 0 for t, _ in changes)
    assert all(a[1] != b[1] for a, b in zip(changes, changes[1:]))  # only changes are reported
    # fraction of on-time over the slots covered
    on = sum(b[0] - a[0] for a, b in zip(changes, changes[1:]) if a[1])
    assert on / (changes[-1][0] - changes[0][0]) == pytest.approx(0.3, abs=0.03)
    other = client_availability(parse_availability("bernoulli:0.3"), 8, seed=1, slot_s=2.0, trace_time_scale=1)
    assert first(transitions(other), 50) != changes[:50]  # clients are independent


def test_onoff_sessions_have_the_given_means():
    model = client_availability(parse_availability("onoff:30:10"), 3, seed=0, slot_s=1, trace_time_scale=1)
    changes = first(transitions(model), 4001)
    durations = {True: [], False: []}
    for (t, state), (t_next, _) in zip(changes, changes[1:]):
        durations[state].append(t_next - t)
    assert sum(durations[True]) / len(durations[True]) == pytest.approx(30, rel=0.1)
    assert sum(durations[False]) / len(durations[False]) == pytest.approx(10, rel=0.1)
    assert first(transitions({"kind": "onoff", "mean_on_s": 5, "mean_off_s": 0, "seed": 1}), 3) == [(0.0, True)]


def write_trace(path, kind="json"):
    trace = {
        1: {"active": [10, 50], "inactive": [20, 60], "finish_time": 100, "duration": 100, "model": "x"},
        2: {"active": [0], "inactive": [], "finish_time": 100},  # on until the end of each period
        3: {"active": [], "inactive": [], "finish_time": 100},  # never on
    }
    if kind == "pickle":
        path.write_bytes(pickle.dumps(trace, protocol=4))
    else:
        path.write_text(json.dumps(trace))
    return path


@pytest.mark.parametrize("kind", ["json", "pickle"])
def test_fedscale_trace_is_replayed_scaled_and_periodic(tmp_path, kind):
    path = write_trace(tmp_path / f"trace.{'json' if kind == 'json' else 'pkl'}", kind)
    spec = parse_availability(f"trace:{path}")
    models = [client_availability(spec, i, seed=0, slot_s=1, trace_time_scale=0.1) for i in range(4)]
    assert first(transitions(models[0]), 6) == [(0.0, False), (1.0, True), (2.0, False), (5.0, True), (6.0, False),
                                                 (11.0, True)]
    assert first(transitions(models[1]), 3) == [(0.0, True), (10.0, False), (10.0, True)]  # wraps: on again
    assert first(transitions(models[2]), 3) == [(0.0, False)]
    assert models[3] == models[0]  # more clients than the trace: wrap around


def test_trace_pickle_cannot_build_objects(tmp_path):
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({1: {"active": [0], "inactive": [], "finish_time": 5, "x": ValueError("boo")}}))
    with pytest.raises(ValueError, match="only dicts, lists and numbers"):
        parse_availability(f"trace:{path}")


@pytest.mark.parametrize("content, why", [
    ("[1, 2]", "non-empty mapping"),
    ('{"1": {"active": [0]}}', "active, inactive and finish_time"),
    ('{"1": {"active": [5, 1], "inactive": [6, 2], "finish_time": 10}}', "increasing"),
    ('{"1": {"active": ["a"], "inactive": [], "finish_time": 10}}', "lists of numbers"),
])
def test_malformed_trace_is_named(tmp_path, content, why):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=why):
        load_trace(path)


def test_malformed_model_from_the_wire_is_a_value_error():
    with pytest.raises(ValueError):
        transitions({"kind": "bernoulli", "p": "x"})
    with pytest.raises(ValueError):
        transitions({"kind": "teleport"})


# ------------------------------------------------------------ profiles, links
PROFILES = {
    "profiles": [
        {"name": "fast", "share": 3, "uplink_mbps": 80, "latency_ms": 10},
        {"name": "slow", "share": 1, "compute_factor": {"uniform": [2, 4]}, "uplink_mbps": 8,
         "downlink_mbps": {"lognormal": {"median": 16, "sigma": 0.1}}, "latency_ms": 100},
    ],
    "clients": {5: "slow"},
}


def test_profiles_are_drawn_by_share_and_pinned(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(PROFILES))
    profiles = load_profiles(path)
    drawn = [assign_profile(profiles, i, seed=0) for i in range(400)]
    assert drawn[5].name == "slow"
    assert sum(p.name == "fast" for p in drawn) / 400 == pytest.approx(0.75, abs=0.07)
    slow = [p for p in drawn if p.name == "slow"]
    assert all(2 <= p.compute_factor <= 4 and p.uplink_bytes_s == 1e6 and p.latency_s == 0.1 for p in slow)
    fast = drawn[[p.name for p in drawn].index("fast")]
    assert fast.downlink_bytes_s == math.inf and fast.compute_factor == 1.0
    assert DeviceProfile.from_wire(json.loads(json.dumps(fast.to_wire()))) == fast  # survives JSON
    assert assign_profile(profiles, 9, seed=0) == drawn[9]


@pytest.mark.parametrize("data, why", [
    ({"profiles": []}, "at least 1"),
    ({"profiles": [{"name": "a", "uplink_mbps": 0}]}, "must be positive"),
    ({"profiles": [{"name": "a", "latency_ms": {"uniform": [5]}}]}, "uniform"),
    ({"profiles": [{"name": "a"}, {"name": "a"}]}, "unique"),
    ({"profiles": [{"name": "a"}], "clients": {1: "b"}}, "unknown profile"),
    ({"profiles": [{"name": "a", "speed": 2}]}, "Extra inputs"),
    ({"profiles": [{"name": "x", "compute_factor": 2, "ms_per_sample": 3}]}, "not ms_per_sample and compute_factor"),
    ({1: {"computation": 10.0}}, "computation .ms per sample. and communication"),  # FedScale capacities
    ({1: {"computation": -1.0, "communication": 5.0}}, "greater than 0"),
])
def test_bad_profiles_are_named(tmp_path, data, why):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=why):
        load_profiles(path)


def test_link_delays_follow_bytes_in_fifo_order():
    link = Link(DeviceProfile(uplink_bytes_s=1000.0, downlink_bytes_s=4000.0, latency_s=0.05))
    # 500 bytes at 1000 B/s: 0.5 s on the link, then 50 ms latency
    assert link.arrival("up", 500, now=10.0) == pytest.approx(10.55)
    # handed over at 10.2 while the first is still on the link: waits until 10.5, then 0.25 s
    assert link.arrival("up", 250, now=10.2) == pytest.approx(10.8)
    assert link.arrival("down", 4000, now=10.2) == pytest.approx(11.25)  # directions are independent
    assert link.arrival("up", 10, now=20.0, control=True) == pytest.approx(20.05)


# --------------------------------------------------------------- real runs
def run_up(tmp_path, mnist_root, **overrides):
    config = small_config(tmp_path / "c.yaml", **overrides)
    run_dir = tmp_path / "run"
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir),
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    summary = RunSummary.load(run_dir / "summary.json")
    rounds = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return summary, [r for r in rounds if "task_round" in r]


@pytest.mark.slow
def test_trace_replay_follows_the_trace(tmp_path, mnist_root):
    # clients 0-3 always on, 4-5 never, 6-7 on during the second half of every 2-second period
    trace = {i: {"active": [0], "inactive": [], "finish_time": 10_000} for i in range(4)}
    trace.update({i: {"active": [], "inactive": [], "finish_time": 10_000} for i in (4, 5)})
    trace.update({i: {"active": [1], "inactive": [2], "finish_time": 2} for i in (6, 7)})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    scenario = {"num_clients": 8, "num_tasks": 1, "partition": "task_pool",
                "samples_per_client_task": 200}
    summary, rounds = run_up(tmp_path, mnist_root, scenario=scenario,
                             rounds={"clients_per_round": 8, "rounds_per_task": 6, "clock": "real"},
                             training={"local_epochs": 1}, edge={"availability": f"trace:{path}"})
    # (the real clock: the edge nodes follow the trace in host time; the emulated clock: tests/test_clock.py)
    assert summary.status == "completed"
    clients = summary.clients
    assert clients.left >= 4 and clients.rejoined >= 2  # 4-5 once; 6-7 at least once each
    assert clients.left - clients.rejoined in (2, 3, 4)  # 4-5 stay away; 6-7 end on or off
    assert 4 <= clients.online_at_end <= 6
    # the never-on clients never train (a first round may select them before their leave arrives)
    assert all(r["participants"] <= 6 for r in rounds) and all(r["selected"] <= 6 for r in rounds[1:])
    assert min(r["participants"] for r in rounds) >= 4  # the always-on ones always answer


@pytest.mark.slow
@pytest.mark.parametrize("clock", ["real", "emulated"])
def test_stragglers_miss_the_deadline_and_late_updates_feed_the_next_round(tmp_path, mnist_root, clock):
    profiles = tmp_path / "p.yaml"  # the CNN's update is ~1.1 MB: 4.4 s on a 2 Mbit/s uplink
    profiles.write_text(yaml.safe_dump({"profiles": [
        {"name": "ok"}, {"name": "slow", "uplink_mbps": 2, "compute_factor": 4}]}))
    scenario = {"num_clients": 12, "num_tasks": 1, "partition": "task_pool",
                "samples_per_client_task": 200}
    summary, rounds = run_up(tmp_path, mnist_root, scenario=scenario,
                             rounds={"clients_per_round": 6, "rounds_per_task": 4, "deadline_s": 3,
                                     "late_updates": "next_round", "clock": clock},
                             training={"local_epochs": 1}, edge={"device_profiles": str(profiles)})
    assert summary.status == "completed"
    assert summary.missed_deadline > 0 and summary.late_updates > 0
    assert sum(r["stale_used"] for r in rounds) > 0


@pytest.mark.slow
def test_crashes_and_churn_with_overcommit(tmp_path, mnist_root):
    """The real clock: the edge nodes crash, leave and rejoin their clients in host time (the emulated clock's
    crashes and churn: tests/test_clock.py)."""
    scenario = {"num_clients": 16, "num_tasks": 1, "partition": "task_pool",
                "samples_per_client_task": 200}
    summary, rounds = run_up(tmp_path, mnist_root, scenario=scenario,
                             rounds={"clients_per_round": 4, "rounds_per_task": 4, "overcommit": 1.5,
                                     "clock": "real"},
                             training={"local_epochs": 1},
                             edge={"availability": "onoff:4:2", "crash_rate": 0.4, "crash_downtime_s": 1.0})
    assert summary.status == "completed"
    clients = summary.clients
    assert clients.left > 0 and clients.rejoined > 0
    assert all(r["selected"] <= 6 and r["overcommitted"] == r["selected"] - min(4, r["selected"])
               for r in rounds)
    assert all(r["participants"] <= r["selected"] for r in rounds)
    # crashed clients are dropped (missed heartbeats) or seen restarting, and rejoin later
    assert sum(r["dropped"] for r in rounds) > 0


EDGE_NODE_WITH_LIMIT = """
import resource, sys, tempfile
import zmq
from fcl_emu.edge_node.node import EdgeNode
from fcl_emu.wire.sockets import SocketCapacityError
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
try:
    node = EdgeNode(sys.argv[3], list(range(int(sys.argv[4]))), context=zmq.Context(), state_dir=tempfile.mkdtemp(),
                    own_connections=sys.argv[5] == "own")
except SocketCapacityError as exc:
    print("refused:", exc)
    sys.exit(3)
print("clients", len(node.clients), "nofile", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
node.close()
node.context.term()
"""


@pytest.mark.slow  # a process that imports the edge node (torch) and opens 1,200 sockets
@pytest.mark.parametrize("soft, hard, connections, expected",
                         [(1024, 20000, "own", 0), (1024, 1024, "own", 3), (1024, 1024, "shared", 0)])
def test_an_edge_node_hosts_more_clients_than_the_default_socket_limits(soft, hard, connections, expected):
    """1,200 clients with connections of their own: past ZeroMQ's default 1,023 sockets per context and a
    1,024-file soft limit. The node raises both; with a hard limit too low it refuses at once with the limit and
    what to do. Over a shared connection the same clients need no more than the defaults."""
    machine_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if machine_hard != resource.RLIM_INFINITY and machine_hard < hard:
        pytest.skip(f"this machine's hard open-file limit ({machine_hard}) is below {hard}")
    out = subprocess.run([sys.executable, "-c", EDGE_NODE_WITH_LIMIT, str(soft), str(hard),
                          f"tcp://127.0.0.1:{free_port()}", "1200", connections], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == expected, out.stdout + out.stderr
    if connections == "shared":
        assert out.stdout.split() == ["clients", "1200", "nofile", "1024"]
    elif expected == 0:
        assert out.stdout.split()[:2] == ["clients", "1200"] and int(out.stdout.split()[3]) >= 2 * 1200
    else:
        assert "open at most 1024" in out.stdout and "more edge nodes" in out.stdout
