"""What a user sees of a run while it runs: the progress display (join bar, the round running and its answers, a
server job's steps, time left, the accuracy after the last evaluation, epsilon, server-job and warning lines), the
settings that change others, and an edge node's connection lines."""

from __future__ import annotations

import io
import json
import os
import select
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.coordinator.dispatch import Dispatcher
from fcl_emu.coordinator.advice import tell_advice
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.progress import ProgressView
from fcl_emu.monitoring.results import RunRecorder
from fcl_emu.runconfig import load_config
from fcl_emu.runconfig.adjustments import adjustments


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def view(**rounds) -> tuple[ProgressView, io.StringIO, FakeClock]:
    config = load_config(None, {"scenario": {"num_clients": 4, "num_tasks": 2},
                                "rounds": {"rounds_per_task": 3, **rounds}})
    out, clock = io.StringIO(), FakeClock()
    return ProgressView(config, Console(file=out, width=200), clock=clock), out, clock


def round_info(task: int, task_round: int, accuracy: float | None = None, privacy: dict | None = None) -> dict:
    return {"task": task, "task_round": task_round, "participants": 4, "selected": 4, "accuracy_seen": accuracy,
            "privacy": privacy}


def label(v: ProgressView) -> str:
    return v.progress.tasks[v.bar].description


def shown_left(v: ProgressView) -> str:
    """The time-left column as the display renders it."""
    return str(v.progress.columns[-1].render(v.progress.tasks[v.bar]))


def test_the_join_bar_counts_clients_out_of_the_population():
    v, _, _ = view()
    for client in ("c0", "c1", "c1", "c2"):  # a client that joins again counts once
        v("join", {"client": client})
    join = v.progress.tasks[v.join_bar]
    assert (join.completed, join.total) == (3, 4)


def test_time_left_is_the_rounds_left_times_the_mean_round_time():
    v, _, clock = view()
    v("ready", {"online": 4, "expected": 4})
    v("task_start", {"task": 0, "classes": 2})
    assert v.time_left() == "time left: estimating"
    clock.now += 10
    v("round", round_info(0, 0))
    clock.now += 20
    v("round", round_info(0, 1))  # 2 rounds in 30 s: 4 rounds left at 15 s
    assert shown_left(v) == "time left: ~0:01:00"


def test_the_label_counts_the_answers_of_the_round_running_as_they_arrive():
    v, _, _ = view()
    v("task_start", {"task": 0, "classes": 2})
    v("round_start", {"task": 0, "round": 1, "task_round": 0})
    v("dispatched", {"task": 0, "round": 1, "selected": 4})
    assert label(v) == "task 1/2 round 1/3 | 0/4 answered"
    v("answered", {"task": 0, "answered": 1, "selected": 4})
    assert label(v) == "task 1/2 round 1/3 | 1/4 answered"
    v("answered", {"task": 0, "answered": 3, "selected": 4})
    assert label(v) == "task 1/2 round 1/3 | 3/4 answered"


def test_the_dispatcher_tells_each_new_count_of_answers_of_the_open_round_once():
    heard = []
    r = OpenRound(task=1, number=7, chosen=["a", "b", "c"], selected={"a", "b", "c"}, wanted=3)
    dispatcher = SimpleNamespace(round=r, _answers_shown=None,
                                 state=SimpleNamespace(progress=lambda kind, info: heard.append((kind, info))))
    Dispatcher._show_answers(dispatcher)
    Dispatcher._show_answers(dispatcher)  # nothing new: nothing told
    r.updates.append(ClientUpdate("a", 10, {}))
    r.failed.add("b")  # an error answers too
    Dispatcher._show_answers(dispatcher)
    r.masked.add("c")  # as a masked input does under secure aggregation
    Dispatcher._show_answers(dispatcher)
    assert heard == [("answered", {"task": 1, "answered": n, "selected": 3}) for n in (0, 2, 3)]
    dispatcher.round = None  # between rounds: nothing to tell
    Dispatcher._show_answers(dispatcher)
    assert len(heard) == 3


def test_after_a_task_ends_the_label_names_the_next_task_s_first_round_even_during_a_server_job():
    v, _, _ = view()
    v("ready", {"online": 4, "expected": 4})
    v("task_start", {"task": 0, "classes": 2})
    for task_round in range(3):
        v("round_start", {"task": 0, "round": task_round + 1, "task_round": task_round})
        v("round", round_info(0, task_round))
    assert label(v) == "task 2/2 round 1/3"  # the task's last round is over: task 2 comes next
    about = {"kind": "generator", "jobs": ["mfcl.generator"], "task": 0, "round": 3, "device": "cpu"}
    v("server_job_start", about)  # MFCL's generator, at task 1's end
    assert label(v) == "task 2/2 round 1/3 | server job: generator"
    v("server_job_end", {**about, "duration_s": 5.0, "ok": True})
    v("task_end", {"task": 0, "accuracy": [90.0, None], "accuracy_seen": 90.0})
    v("task_start", {"task": 1, "classes": 2})
    assert label(v) == "task 2/2 round 1/3 | acc(seen) 90.0%"
    v("round_start", {"task": 1, "round": 4, "task_round": 0})
    v("dispatched", {"task": 1, "round": 4, "selected": 4})
    assert label(v) == "task 2/2 round 1/3 | 0/4 answered | acc(seen) 90.0%"


def test_a_server_job_step_shows_in_the_label_and_sets_the_time_left_by_its_pace():
    v, out, clock = view()
    v("ready", {"online": 4, "expected": 4})
    v("task_start", {"task": 0, "classes": 2})
    clock.now += 10
    v("round", round_info(0, 0))  # 10 s a round: 5 rounds left
    about = {"kind": "generator", "jobs": ["mfcl.generator"], "task": 0, "round": 1, "device": "cpu"}
    v("server_job_start", about)
    assert shown_left(v) == "time left: waiting for the server job (generator)"
    clock.now += 60
    v("server_job_step", {**about, "step": 120, "steps": 200})
    assert label(v) == "task 1/2 round 2/3 | server job: generator 120/200"
    assert shown_left(v) == "time left: ~0:01:30"  # 80 steps at 2 a second, then 5 rounds of 10 s
    clock.now += 10
    assert shown_left(v) == "time left: ~0:01:20"  # counted down between two reports
    v("server_job_end", {**about, "duration_s": 100.0, "ok": True})
    assert "server job" not in label(v)
    assert shown_left(v) == "time left: ~0:00:50"


def test_the_time_left_moves_within_a_round_with_its_answers_and_its_time():
    v, _, clock = view()
    v("task_start", {"task": 0, "classes": 2})
    clock.now += 20
    v("round", round_info(0, 0))  # 20 s a round; 5 rounds left
    v("round_start", {"task": 0, "round": 2, "task_round": 1})
    v("dispatched", {"task": 0, "round": 2, "selected": 4})
    assert shown_left(v) == "time left: ~0:01:40"
    clock.now += 5
    assert shown_left(v) == "time left: ~0:01:35"  # no answer yet: the clock alone moves it
    v("answered", {"task": 0, "answered": 2, "selected": 4})
    assert shown_left(v) == "time left: ~0:01:28"  # half of the 15 s left of a mean round, then 4 rounds
    clock.now += 55  # a round 3 times slower than the mean: as long again as it ran, for the half left
    assert shown_left(v) == "time left: ~0:01:50"
    v("answered", {"task": 0, "answered": 4, "selected": 4})
    assert shown_left(v) == "time left: ~0:01:20"


def test_under_differential_privacy_the_label_shows_the_epsilon_spent():
    v, _, _ = view()
    v("task_start", {"task": 0, "classes": 2})
    v("round", round_info(0, 0))
    assert "epsilon" not in label(v)
    v("round", round_info(0, 1, privacy={"epsilon": 1.234, "delta": 1e-5, "steps": 2}))
    assert label(v).endswith("| epsilon 1.23")  # a record from before the rounds kept their pool: Poisson's
    v("round", round_info(0, 2, privacy={"epsilon": 1.5, "epsilon_sampled": 2.25, "delta": 1e-5, "steps": 3}))
    assert label(v).endswith("| epsilon 2.25")  # as the rounds sampled: the figure that holds


def test_the_bar_shows_the_accuracy_of_the_last_evaluation_not_a_stale_one():
    v, out, _ = view()
    v("task_start", {"task": 0, "classes": 2})
    v("round", round_info(0, 0, accuracy=11.3))
    v("round", round_info(0, 1))
    v("round", round_info(0, 2))
    v("task_end", {"task": 0, "accuracy": [20.2, None], "accuracy_seen": 20.2})
    description = label(v)
    assert "acc(seen) 20.2%" in description and "11.3" not in description
    assert "task 1 done: accuracy per task [20.2 -]" in out.getvalue()
    for task_round in range(3):
        v("round", round_info(1, task_round))
    assert shown_left(v) == "time left: final evaluation"
    v("task_end", {"task": 1, "accuracy": [15.0, 25.0], "accuracy_seen": 20.0})
    assert shown_left(v) == "done"
    assert label(v) == "task 2/2 done | acc(seen) 20.0%"


def test_server_jobs_and_warnings_print_one_line_each():
    v, out, _ = view()
    v("warning", {"setting": "rounds.clients_per_round", "message": "clients per round is 4"})
    about = {"kind": "proxy", "jobs": ["glfc.proxy"], "task": 0, "round": 2, "device": "cpu (in the coordinator)"}
    v("server_job_start", about)
    v("server_job_end", {**about, "duration_s": 100.04, "ok": True})
    lines = out.getvalue().splitlines()
    assert lines == ["warning: clients per round is 4",
                     "server job started: proxy (glfc.proxy) on cpu (in the coordinator), task 1, round 2/6",
                     "server job done: proxy in 100.0 s"]


# ----------------------------------------------------------------------------- settings that change others
def test_clients_per_round_capped_at_the_population_is_a_warning_only_when_unset():
    capped = load_config(None, {"scenario": {"num_clients": 20}})
    assert capped.rounds.clients_per_round == 20
    assert [(a.setting, a.value) for a in adjustments(capped)] == [("rounds.clients_per_round", 20)]
    assert "default 30 exceeds the 20 clients" in adjustments(capped)[0].message
    assert adjustments(load_config(None, {"scenario": {"num_clients": 20}, "rounds": {"clients_per_round": 20}})) == []
    assert adjustments(load_config(None, {})) == []


def test_overcommit_secagg_neighbours_and_stretched_heartbeats_are_warnings():
    over = load_config(None, {"scenario": {"num_clients": 40}, "rounds": {"overcommit": 1.5}})
    assert [a.setting for a in adjustments(over)] == ["rounds.overcommit"]
    assert "every round selects all 40" in adjustments(over)[0].message
    secure = load_config(None, {"scenario": {"num_clients": 10}, "rounds": {"clients_per_round": 10},
                                "secagg": {"enabled": True, "neighbors": 12}})
    assert [(a.setting, a.value) for a in adjustments(secure)] == [("secagg.neighbors", 9)]
    late = load_config(None, {"method": "affcl", "rounds": {"late_updates": "next_round"}})
    assert [(a.setting, a.value) for a in adjustments(late)] == [("rounds.late_updates", "drop")]
    assert adjustments(load_config(None, {"method": "fedavg", "rounds": {"late_updates": "next_round"}})) == []
    crowd = load_config(None, {"scenario": {"num_clients": 5000}})
    assert [(a.setting, a.value) for a in adjustments(crowd)] == [("network.heartbeat_interval_s", 5.0)]


def test_the_coordinator_records_and_shows_each_warning_once(tmp_path):
    recorder = RunRecorder(tmp_path, "")
    heard = []
    # no device profiles and no DP: tests/test_energy.py and tests/test_divergence.py test those warnings
    state = SimpleNamespace(config=load_config(None, {"scenario": {"num_clients": 20}}), event=recorder.event,
                            progress=lambda kind, info: heard.append((kind, info)), devices=None)
    tell_advice(state, privacy=None)
    recorder.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["setting"], e["value"]) for e in events] == [
        ("config_warning", "rounds.clients_per_round", 20)]
    assert [kind for kind, _ in heard] == ["warning"]


# ----------------------------------------------------------------------------------------------- edge node
@pytest.mark.slow  # a node process: its imports, then the warning 3 s after them
def test_an_edge_node_at_a_closed_port_says_so_within_seconds(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node = subprocess.Popen([sys.executable, "-m", "fcl_emu.edge_node", "--connect", f"tcp://127.0.0.1:{port}",
                             "--clients", "0-3", "--insecure", "--name", "edge-a", "--data-root", str(tmp_path)],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60  # the imports take seconds on a busy host; the warning 3 s after them
        while time.monotonic() < deadline and not any("no answer" in line for line in lines):
            if select.select([node.stderr], [], [], 1.0)[0]:
                lines.append(node.stderr.readline())
    finally:
        node.kill()
        node.wait()
    connecting = [line for line in lines if f"edge-a: connecting to tcp://127.0.0.1:{port} with 4 clients" in line]
    warned = [line for line in lines if f"edge-a: no answer from the coordinator at tcp://127.0.0.1:{port} after 3 s: "
              f"cannot connect" in line]
    assert connecting and warned, lines


def test_a_node_that_connects_without_an_answer_says_so_and_then_that_it_joined(caplog):
    import logging

    import zmq

    from fcl_emu.edge_node.connection import JoinWatch

    context = zmq.Context()
    with socket.socket() as listener:  # accepts TCP connections, never speaks ZeroMQ
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        sock = context.socket(zmq.DEALER)
        watch = JoinWatch("edge-b", address, clients=2, first_warning_s=0.5)
        watch.watch(sock)
        sock.connect(address)
        with caplog.at_level(logging.INFO, logger="fcl_emu.edge_node.connection"):
            watch.start(time.monotonic())
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(r.levelname == "WARNING" for r in caplog.records):
                watch.tick(time.monotonic())
                time.sleep(0.05)
            watch.welcomed("client-0000", "run-1")
            watch.welcomed("client-0001", "run-1")
            watch.tick(time.monotonic() + 1000)  # joined: no more warnings
    sock.close(linger=0)
    context.term()  # the monitor's sockets were closed once the clients joined
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == f"edge-b: connecting to {address} with 2 clients"
    assert "connected, but no answer" in messages[1]
    assert messages[2:] == [f"edge-b: joined run run-1 at {address} with 2 clients"]
