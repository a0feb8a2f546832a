"""Whole emulations with real processes: coordinator, edge nodes, ZeroMQ between them."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import msgspec
import numpy as np
import pytest
import zmq

from tests.conftest import device_keys, events, fcl_emu, free_port, keyed, raw_header, small_config, wait_for
from fcl_emu.wire.framing import encode
from fcl_emu.wire.messages import Heartbeat, Join, Shutdown, TensorSpec, Update
from fcl_emu.monitoring.results import RunSummary

pytestmark = pytest.mark.slow


def test_up_runs_a_complete_fcil_emulation(tmp_path, mnist_root):
    config = small_config(tmp_path / "c.yaml")
    run_dir = tmp_path / "run"
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir),
                   "--method", "fedavg", "--seed", "3")
    assert proc.wait(timeout=240) == 0
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed"
    assert (summary.method, summary.dataset, summary.seed) == ("fedavg", "mnist", 3)
    matrix = summary.accuracy_matrix
    assert len(matrix) == 2 and matrix[0][1] is None and all(0 <= a <= 100 for a in matrix[1])
    assert matrix[0][0] > 60  # two MNIST classes are easy
    assert summary.rounds == 4 and summary.rounds_skipped == 0
    assert summary.clients.joined == 100 and summary.clients.dropped == 0
    for msg_type in ("join", "welcome", "task_start", "train_request", "update", "heartbeat"):
        assert msg_type in summary.bytes, msg_type
    assert summary.bytes["train_request"]["sent"] > 4 * 100_000  # a model per request
    assert summary.average_forgetting >= 0
    assert summary.time.accounted >= 0.95, summary.time  # the wall clock, by named part of the run
    kinds = [e["event"] for e in events(run_dir)]
    assert kinds.count("round") == 4 and kinds.count("task_end") == 2
    assert (run_dir / "config.yaml").exists()
    # the same run with a connection per client: the same results and the same bytes of every message but the
    # heartbeats (their count follows the host's timing)
    own_dir = tmp_path / "own"
    own_config = small_config(tmp_path / "own.yaml", network={"client_connections": "own"})
    own = fcl_emu("up", "--config", str(own_config), "--data-root", str(mnist_root), "--run-dir", str(own_dir),
                  "--method", "fedavg", "--seed", "3")
    assert own.wait(timeout=240) == 0
    alike = RunSummary.load(own_dir / "summary.json")
    assert alike.accuracy_matrix == matrix and alike.clients == summary.clients
    # the same bytes but for heartbeats and the run's end: a node closes its clients at their first shutdown, so
    # how many of the later shutdowns still find a route depends on how fast it does
    racy = ("heartbeat", "shutdown")
    assert {k: v for k, v in alike.bytes.items() if k not in racy} == \
        {k: v for k, v in summary.bytes.items() if k not in racy}


def test_live_coordinator_survives_bad_frames(tmp_path, mnist_root):
    """Random and hand-crafted bad messages, from strangers and from a joined client, to a coordinator without
    authentication (--insecure), where strangers reach the decoder (test_hostile_peers.py: with keys)."""
    port = free_port()
    # what is checked is the coordinator's handling of bad messages, not the learning: 50 samples a client and
    # one local epoch keep each of the 4 rounds to a second or two
    config = small_config(tmp_path / "c.yaml", scenario={"num_clients": 101, "samples_per_client_task": 50},
                          rounds={"clients_per_round": 8, "rounds_per_task": 2}, training={"local_epochs": 1})
    run_dir = tmp_path / "run"
    coordinator = fcl_emu("coordinator", "--config", str(config), "--bind", f"tcp://127.0.0.1:{port}",
                          "--data-root", str(mnist_root), "--run-dir", str(run_dir), "--insecure")
    node = fcl_emu("node", "--connect", f"tcp://127.0.0.1:{port}", "--clients", "0-99",
                   "--data-root", str(mnist_root), "--insecure")
    ctx = zmq.Context()
    rng = np.random.default_rng(0)
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.IDENTITY, b"stranger")
    stranger.connect(f"tcp://127.0.0.1:{port}")
    rogue = ctx.socket(zmq.DEALER)  # a registered client (index 100) that misbehaves
    rogue.setsockopt(zmq.IDENTITY, b"client-0100")
    rogue.connect(f"tcp://127.0.0.1:{port}")
    try:
        # the coordinator has bound its socket once the run directory's event log exists
        wait_for(lambda: (run_dir / "events.jsonl").exists(), 120, "the coordinator to listen")
        for _ in range(200):  # random garbage from a stranger
            stranger.send_multipart([bytes(rng.integers(0, 256, rng.integers(0, 80), dtype=np.uint8))
                                     for _ in range(rng.integers(1, 4))])
        stranger.send_multipart(encode("heartbeat", Heartbeat(), sender="stranger", seq=1))  # not joined
        stranger.send_multipart([raw_header(v=7)])
        bomb = msgspec.Raw(b"\x91" * 1000 + b"\xc0")  # 1 KB body nested 1,000 deep: RecursionError in msgspec
        for _ in range(5):
            stranger.send_multipart([raw_header(sender="stranger", body=bomb)])
        rogue.send_multipart(encode("join", Join(node="rogue", pid=1, client_index=100), sender="client-0100", seq=1))
        rogue.send_multipart([raw_header(sender="client-0100", body=bomb)])  # the bomb from a joined client
        rogue.send_multipart([raw_header(sender="client-0100", type="update",
                                          body=msgspec.Raw(msgspec.msgpack.encode(
                                              Update(num_samples=1, train_time_s=0, loss=0))),
                                          tensors=[TensorSpec("delta/w", "float32", [1000, 1000], 4_000_000)]),
                              b"short"])  # truncated tensor frame
        nan = np.full(10, np.nan, np.float32)
        rogue.send_multipart(encode("update", Update(num_samples=1, train_time_s=0, loss=0),
                                    sender="client-0100", seq=3, tensors={"delta/w": nan}))
        rogue.send_multipart(encode("update", Update(num_samples=1, train_time_s=0, loss=0),
                                    sender="client-0100", seq=4, tensors={"delta/w": np.zeros(3, np.float32)}))
        rogue.send_multipart(encode("shutdown", Shutdown(reason="x"), sender="client-0100", seq=5))  # wrong way
        rogue.close(linger=5000)  # the rogue never trains: it is dropped as unreachable or silent
        assert coordinator.wait(timeout=240) == 0
        node.wait(timeout=60)
    finally:
        for p in (coordinator, node):
            if p.poll() is None:
                p.kill()
        stranger.close(0)
        ctx.term()
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed"
    rejected = summary.rejected_messages
    for reason in ("bad_header", "unknown_sender", "bad_version", "size_mismatch",
                   "non_finite", "unexpected"):
        assert rejected.get(reason, 0) >= 1, (reason, rejected)
    assert sum(rejected.values()) >= 200
    assert summary.rounds == 4


def test_sigkill_of_an_edge_node_does_not_hang_the_round(tmp_path, mnist_root):
    port = free_port()
    # 100 samples a client, one epoch: each round still trains 10 clients for about a second, so the kill lands
    # inside the run (rounds 2-4 and two evaluations are left when it comes), well before its end
    config = small_config(tmp_path / "c.yaml", scenario={"samples_per_client_task": 100},
                          rounds={"clients_per_round": 10, "rounds_per_task": 2, "deadline_s": 300},
                          training={"local_epochs": 1})
    run_dir = tmp_path / "run"
    address = f"tcp://127.0.0.1:{port}"
    keys, node_keys = device_keys(tmp_path / "keys", 100)
    coordinator = fcl_emu("coordinator", "--config", str(config), "--bind", address, "--keys", str(keys),
                          "--data-root", str(mnist_root), "--run-dir", str(run_dir))
    survivor = fcl_emu("node", "--connect", address, "--clients", "0-49", "--data-root", str(mnist_root), *node_keys)
    victim = fcl_emu("node", "--connect", address, "--clients", "50-99", "--data-root", str(mnist_root), *node_keys)
    try:
        wait_for(lambda: any(e["event"] == "round" for e in events(run_dir)), 180, "the first round")
        os.kill(victim.pid, signal.SIGKILL)  # mid-run, typically mid-round
        assert coordinator.wait(timeout=240) == 0
    finally:
        for p in (coordinator, survivor, victim):
            if p.poll() is None:
                p.kill()
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed"
    assert summary.clients.dropped == 50
    rounds = [e for e in events(run_dir) if e["event"] == "round"]
    assert len(rounds) == 4
    assert all(r["duration_s"] < 60 for r in rounds)  # closed by liveness, not by the 300 s deadline
    assert rounds[-1]["participants"] == rounds[-1]["selected"] == 10  # only survivors are sampled


def test_per_task_assets_and_late_joiners(tmp_path, mnist_root):
    """FedLwF-2T with the global old teacher ships the previous model once per client and task;
    clients that join at the task boundary take part from then on."""
    # message counts and sizes are checked, not accuracy: 50 samples a client, one local epoch
    config = small_config(tmp_path / "c.yaml", scenario={"new_clients_per_task": 20, "samples_per_client_task": 50},
                          method="fedlwf2t", method_options={"old_teacher": "global"},
                          rounds={"clients_per_round": 6}, training={"local_epochs": 1})
    run_dir = tmp_path / "run"
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir))
    assert proc.wait(timeout=240) == 0
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.method == "fedlwf2t"
    model_bytes = summary.bytes["train_request"]["sent"] / summary.messages["train_request/sent"]
    task_starts = summary.messages["task_start/sent"]
    # task 0 has no assets; in task 1 each first-time participant gets the old model once, as its own type
    old_models = summary.messages["old_model/sent"]
    assert 0 < old_models <= task_starts - 6
    assert summary.bytes["old_model"]["sent"] > 0.9 * model_bytes * old_models
    assert summary.bytes["task_start"]["sent"] < 1000 * task_starts
    assert task_starts <= 4 * 6  # at most once per participant and task, never per round
    assert summary.clients.joined == 100


def test_a_run_that_fails_is_not_recorded_as_completed(tmp_path, mnist_root):
    """An unexpected error inside the run ends it with status "failed: ..." in summary.json and in the clients'
    shutdown, never "completed"."""
    from fcl_emu.coordinator.lifecycle import Coordinator
    from fcl_emu.runconfig import load_config

    # 8 clients would share a task's 30,000 samples (3,750 each, half a minute of training for the round that
    # fails); 100 each are enough to reach the aggregation
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 8, "samples_per_client_task": 100}),
                         {"data_root": [str(mnist_root)]})
    config, node_keys = keyed(config, tmp_path / "keys")
    coordinator = Coordinator(config)

    def broken_aggregate(*args, **kw):
        raise RuntimeError("aggregation broke")

    coordinator.server.aggregate = broken_aggregate
    node = fcl_emu("node", "--connect", coordinator.address, "--clients", "0-7", "--data-root", str(mnist_root),
                   *node_keys)
    try:
        with pytest.raises(RuntimeError, match="aggregation broke"):
            coordinator.run(tmp_path / "run")
        assert node.wait(timeout=60) is not None
    finally:
        if node.poll() is None:
            node.kill()
        coordinator.close()
    summary = RunSummary.load(tmp_path / "run" / "summary.json")
    assert summary.status == "failed: RuntimeError: aggregation broke"
    last = events(tmp_path / "run")[-1]
    assert (last["event"], last["status"]) == ("end", "failed: RuntimeError: aggregation broke")



def test_the_first_round_waits_for_before_rounds_while_the_clients_are_served(tmp_path, mnist_root, caplog):
    """A condition that never holds delays the first round by its timeout, longer than the liveness timeout,
    and the run goes on with a warning: no client is dropped meanwhile (heartbeats are served), and the wait
    counts as join time. (`up --prometheus` waits like this for its Prometheus's first scrape.)"""
    from fcl_emu.coordinator.lifecycle import Coordinator
    from fcl_emu.runconfig import load_config

    # one task of all ten classes among 8 clients would be 7,500 samples each (45 s a round); the wait is what
    # is checked, and 100 samples each are enough for the two rounds after it
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 8, "num_tasks": 1,
                                                                     "samples_per_client_task": 100}),
                         {"data_root": [str(mnist_root)]})
    config, node_keys = keyed(config, tmp_path / "keys")
    coordinator = Coordinator(config)
    asked = []
    coordinator.before_rounds = [("a condition that never holds", lambda: False, 3.0),
                                 ("a condition that holds on its third asking",
                                  lambda: len(asked.append(1) or asked) >= 3, 60.0)]
    node = fcl_emu("node", "--connect", coordinator.address, "--clients", "0-7", "--data-root", str(mnist_root),
                   *node_keys)
    try:
        with caplog.at_level("WARNING", logger="fcl_emu.coordinator"):
            summary = coordinator.run(tmp_path / "run")
        assert node.wait(timeout=60) == 0
    finally:
        if node.poll() is None:
            node.kill()
        coordinator.close()
    assert summary.status == "completed" and summary.clients.dropped == 0
    assert config.network.liveness_timeout_s < 3.0 <= summary.time.parts_s["join"]
    assert len(asked) >= 3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "starting the rounds without a condition that never holds (waited 3 s)" in warnings
    assert not any("third asking" in w for w in warnings)


def test_a_node_setting_up_for_longer_than_the_liveness_timeout_keeps_its_clients(tmp_path, mnist_root, monkeypatch):
    """An edge node loads the run's data set on its first welcome, here for three liveness timeouts: its welcomed
    clients heartbeat meanwhile, so none is declared dead, and the train requests that came during the load are
    handled once it is done (the first round is not lost)."""
    import threading

    from fcl_emu.coordinator.lifecycle import Coordinator
    from fcl_emu.edge_node import node as node_module
    from fcl_emu.runconfig import load_config

    load = node_module.load_dataset
    loading_s = 6.0

    def load_slowly(*args, **kw):
        time.sleep(loading_s)
        return load(*args, **kw)

    monkeypatch.setattr(node_module, "load_dataset", load_slowly)
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 4, "num_tasks": 1,
                                                                     "samples_per_client_task": 100},
                                      rounds={"clients_per_round": 4, "rounds_per_task": 1},
                                      training={"local_epochs": 1}, security={"transport": "plain"}),
                         {"data_root": [str(mnist_root)]})
    assert config.network.liveness_timeout_s * 3 == loading_s
    coordinator = Coordinator(config)
    edge = node_module.EdgeNode(coordinator.address, list(range(4)), data_roots=[mnist_root], context=zmq.Context())
    serving = threading.Thread(target=edge.run, name="edge-node")
    serving.start()
    try:
        summary = coordinator.run(tmp_path / "run")
    finally:
        coordinator.close()
        serving.join(timeout=60)
    assert summary.status == "completed"
    assert (summary.clients.joined, summary.clients.dropped, summary.clients.rejoined) == (4, 0, 0)
    (first,) = [e for e in events(tmp_path / "run") if e["event"] == "round"]
    assert first["participants"] == 4 and first["time"] >= loading_s


def test_an_edge_node_that_dies_at_start_up_is_reported_at_once(tmp_path, mnist_root, monkeypatch):
    """`up` with two nodes, one of which cannot start (its key file is unreadable): the coordinator reports it
    with the node's own error line and goes on with the other node's clients, without waiting out its 60 s
    join timeout."""
    import io

    from rich.console import Console

    from fcl_emu import run as run_module
    from fcl_emu.launchers import process
    from fcl_emu.runconfig import load_config

    original = process.node_args

    def node_args(address, indices, config, name, n=0, parent_pid=None, **kw):
        args = original(address, indices, config, name, n, parent_pid=parent_pid, **kw)
        return dataclasses.replace(args, key=tmp_path / "stolen.key_secret") if n == 1 else args

    monkeypatch.setattr(process, "node_args", node_args)
    # 100 samples a client (not 3,750): the whole run then takes seconds, far from the 60 s join timeout that
    # the time bound below tells apart
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 8, "samples_per_client_task": 100},
                                      rounds={"clients_per_round": 2, "rounds_per_task": 1}),
                         {"data_root": [str(mnist_root)], "run_dir": str(tmp_path / "run")})
    out = io.StringIO()
    started = time.monotonic()
    summary = run_module.run_local(config, Console(file=out, width=200))
    assert time.monotonic() - started < 50
    assert summary.status == "completed" and summary.clients.joined == 4
    exits = [e for e in events(tmp_path / "run") if e["event"] == "node_exit"]
    assert len(exits) == 1 and exits[0]["node"] == "node-1" and exits[0]["code"] == 1
    assert "cannot read key file" in exits[0]["error"]
    start = next(e for e in events(tmp_path / "run") if e["event"] == "start")
    assert start["online"] == 4
    assert "edge node node-1 exited (code 1): error: cannot read key file" in out.getvalue()


def test_a_run_whose_every_round_was_skipped_is_not_completed(tmp_path, mnist_root):
    """A norm bound no update meets: every update is refused (counted), every round skipped, and the run is
    recorded as failed, not completed; the rounds do not wait out their deadline for the refused updates."""
    import io

    from rich.console import Console

    from fcl_emu import run as run_module
    from fcl_emu.runconfig import load_config

    # 100 samples a client (not 5,000): the updates only have to exist to be refused
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 6, "samples_per_client_task": 100},
                                      rounds={"clients_per_round": 3, "rounds_per_task": 1},
                                      training={"local_epochs": 1}, aggregation={"max_update_norm": 1e-9}),
                         {"data_root": [str(mnist_root)], "run_dir": str(tmp_path / "run")})
    summary = run_module.run_local(config, Console(file=io.StringIO()))
    assert summary.status.startswith("failed: every round was skipped")
    assert summary.rounds_skipped == summary.rounds == 2
    assert summary.rejected_messages["norm_bound"] == 6
    assert all(e["duration_s"] < 30 for e in events(tmp_path / "run") if e["event"] == "round")


def test_a_node_without_the_dataset_says_so_in_one_line_and_its_clients_leave(tmp_path, mnist_root):
    import subprocess

    port = free_port()
    run_dir = tmp_path / "run"
    config = small_config(tmp_path / "c.yaml", scenario={"num_clients": 4})
    coordinator = fcl_emu("coordinator", "--config", str(config), "--bind", f"tcp://127.0.0.1:{port}",
                          "--data-root", str(mnist_root), "--run-dir", str(run_dir), "--insecure",
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    empty = tmp_path / "empty"
    empty.mkdir()
    try:
        wait_for(lambda: (run_dir / "events.jsonl").exists(), 120, "the coordinator to listen")
        node = fcl_emu("node", "--connect", f"tcp://127.0.0.1:{port}", "--clients", "0-3", "--data-root",
                       str(empty), "--insecure", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output = node.communicate(timeout=60)[0].decode()
        assert node.returncode == 1
        assert "error: node-" in output and "dataset 'mnist' is not under its data roots" in output
        assert "Traceback" not in output
        assert coordinator.wait(timeout=60) == 1  # its clients left at once: no waiting out a timeout
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
    summary = RunSummary.load(run_dir / "summary.json")
    # each client left at once; one whose welcome found the node's connection already closed (the node fails on
    # its first welcome, maybe before the coordinator has read every join) is dropped as unreachable instead,
    # before its leave, queued behind its join, is read
    clients = summary.clients
    assert summary.status.startswith(("aborted", "failed")) and clients.left >= 1
    assert clients.left + clients.dropped == clients.joined == 4 and clients.online_at_end == 0
