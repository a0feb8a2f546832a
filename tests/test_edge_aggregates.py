"""An edge aggregator's aggregate is checked as an update is, and more (coordinator/edge_tier.py, docs/hierarchy.md):
the real edge tier and dispatcher over real sockets, with a hostile aggregator in a thread answering the round's
collect with each bad aggregate. Each is refused with its reason, fails that aggregator's share of the round at once
(never the coordinator), and the coordinator takes the next round's honest aggregate. Then a real run
(``fcl-emu up --edge-aggregators 2``) with one aggregator adding +100 to one class's output bias in its aggregates,
against the clean run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq

from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.coordinator.clock import make_clock
from fcl_emu.coordinator.collection import make_collection
from fcl_emu.coordinator.dispatch import Dispatcher, try_send
from fcl_emu.coordinator.edge_tier import EdgeTier
from fcl_emu.coordinator.guard import RateLimiter
from fcl_emu.coordinator.open_round import OpenRound, StaleUpdates
from fcl_emu.launchers.process import node_env
from fcl_emu.wire.framing import Message
from fcl_emu.wire.messages import EdgeAggregate, Heartbeat
from fcl_emu.wire.sockets import ClientEndpoint, ServerEndpoint
from tests.conftest import events, small_config
from tests.test_coordinator_parts import make_state
from tests.test_hostile_peers import WELCOME, NoPool

AGGREGATOR = "edge-aggregator-0"
CLIENTS = {"client-0001": (10, [0.1, 0.2, 0.3]), "client-0002": (30, [0.3, 0.2, 0.1])}  # samples, delta of "w"
HONEST = np.array([0.25, 0.2, 0.15], np.float32)  # their sample-weighted mean
TIMEOUT_S = 20.0  # the tier's answer timeout: a refused aggregate must end the wait long before

Answer = Callable[[Message, list], list[tuple[str, EdgeAggregate, dict, dict]]]  # the collect, earlier answers


def honest(msg: Message, sent: list) -> list:
    """The aggregate an honest aggregator sends: the weighted mean of the clients asked for."""
    return [(EdgeAggregate(clients=list(msg.body.clients), num_samples=40, loss=0.5,
                           tier_bytes={"sent": 100, "received": 200}), {DELTA + "w": HONEST}, {})]


def tensors_of(tensors: dict) -> Answer:
    return lambda msg, sent: [(honest(msg, sent)[0][0], tensors, {})]


def body_of(**fields) -> Answer:
    return lambda msg, sent: [(EdgeAggregate(**{"clients": list(msg.body.clients), "num_samples": 40, "loss": 0.5,
                                                **fields}), {DELTA + "w": HONEST * np.float32(0.9)}, {})]


def replayed(msg: Message, sent: list) -> list:
    """The first aggregate this aggregator sent, again (its first answer is honest)."""
    return sent[0] if sent else honest(msg, sent)


def twice(msg: Message, sent: list) -> list:
    return honest(msg, sent) * 2


def of_another_round(msg: Message, sent: list) -> list:
    """An aggregate naming the round before, then the one asked for."""
    return [(*honest(msg, sent)[0][:2], {"round": msg.round - 1}), *honest(msg, sent)]


class HostileAggregator(threading.Thread):
    """``edge-aggregator-0`` on its own connection: heartbeats, and every ``edge_collect`` answered by ``answer``
    (round 1's by :func:`honest` where ``first_honest``)."""

    def __init__(self, ctx: zmq.Context, address: str, answer: Answer, first_honest: bool = False):
        super().__init__(daemon=True)
        self.endpoint = ClientEndpoint(ctx, address, AGGREGATOR)
        self.answer, self.first_honest, self.stop, self.sent = answer, first_honest, threading.Event(), []

    def run(self) -> None:
        while not self.stop.is_set():
            self.endpoint.send("heartbeat", Heartbeat())
            if not self.endpoint.sock.poll(100):
                continue
            msg = self.endpoint.recv()
            if msg.type != "edge_collect":
                continue
            answers = (honest if self.first_honest and msg.round == 1 else self.answer)(msg, self.sent)
            for body, tensors, header in answers:
                self.endpoint.send("edge_aggregate", body, **{"round": msg.round, "task": msg.task, **header},
                                   tensors=tensors)
            self.sent.append(answers)


class Tier:
    """The coordinator's edge tier and dispatcher on a real socket, one aggregator; :meth:`gather` one round."""

    def __init__(self, answer: Answer, first_honest: bool = False):
        self.state = make_state(rounds_per_task=10)
        self.events: list[tuple[str, dict]] = []
        self.state.event = lambda kind, **fields: self.events.append((kind, fields))
        self.ctx = zmq.Context()
        self.endpoint = ServerEndpoint(self.ctx, "tcp://127.0.0.1:0")
        self.tier = EdgeTier(self.state, 1, liveness_timeout_s=TIMEOUT_S,
                             send=lambda *a, **kw: try_send(self.endpoint, *a, **kw))
        dispatch = self.dispatch = Dispatcher(self.state, self.endpoint, NoPool(), make_clock(self.state, TIMEOUT_S),
                                              make_collection(self.state, None, self.tier), StaleUpdates(2),
                                              RateLimiter(), welcome=WELCOME, tier=self.tier)
        self.aggregator = HostileAggregator(self.ctx, self.endpoint.address, answer, first_honest)
        self.aggregator.start()
        dispatch.serve(lambda: AGGREGATOR in self.tier.seen, time.monotonic() + 10)

    def gather(self, number: int, task: int = 0):
        """Round ``number``'s gather of the two clients' aggregate, as their notices announced them; its groups and
        seconds."""
        r = OpenRound(task=task, number=number, chosen=list(CLIENTS), selected=set(CLIENTS), wanted=2)
        r.counted = [ClientUpdate(c, n, {}, square_sums={DELTA + "w": float(np.square(np.float32(w)).sum())})
                     for c, (n, w) in CLIENTS.items()]
        r.held_at = dict.fromkeys(CLIENTS, AGGREGATOR)
        started = time.monotonic()
        return self.tier.gather(r, self.dispatch.serve), time.monotonic() - started

    def close(self) -> None:
        self.aggregator.stop.set()
        self.aggregator.join(5)
        self.aggregator.endpoint.close(0)
        self.endpoint.close()
        self.ctx.term()


def mean_of(groups) -> np.ndarray:
    (update,) = groups.updates
    return np.asarray(update.tensors[DELTA + "w"])


BAD = [
    pytest.param(tensors_of({DELTA + "w": np.zeros(4, np.float32)}), "bad_shape", id="wrong-shape"),
    pytest.param(tensors_of({DELTA + "w": HONEST, DELTA + "v": HONEST}), "bad_shape", id="extra-tensor"),
    pytest.param(tensors_of({"glfc/w": HONEST}), "bad_shape", id="missing-tensor"),
    pytest.param(tensors_of({DELTA + "w": np.zeros(3, np.int32)}), "bad_dtype", id="int32"),
    pytest.param(tensors_of({DELTA + "w": HONEST.astype(np.float64)}), "bad_dtype", id="float64"),
    pytest.param(tensors_of({DELTA + "w": np.array([0.1, np.nan, 0.1], np.float32)}), "non_finite", id="nan"),
    pytest.param(body_of(tier_bytes={"sent": -5}), "bad_body", id="negative-tier-bytes"),
    pytest.param(body_of(num_samples=-40), "bad_body", id="negative-samples"),
    pytest.param(body_of(num_samples=4000), "implausible", id="inflated-weight"),
    pytest.param(body_of(clients=["client-0001", "client-0001"]), "unexpected", id="a-client-twice"),
    pytest.param(tensors_of({DELTA + "w": HONEST + np.array([100, 0, 0], np.float32)}), "norm_bound", id="bias+100"),
    pytest.param(tensors_of({DELTA + "w": 3 * HONEST}), "norm_bound", id="inflated-norm"),
    pytest.param(replayed, "replayed", id="replay-next-round"),
]


@pytest.mark.parametrize("answer, reason", BAD)
def test_a_bad_aggregate_fails_its_share_at_once_and_the_coordinator_serves_on(answer, reason):
    """Round 1: honest. Round 2: the bad aggregate, refused under its reason, its clients counted out, the wait over
    at once. Round 3: the same aggregator's honest aggregate is taken again (the bad ones only repeat)."""
    tier = Tier(answer, first_honest=True)
    try:
        first, _ = tier.gather(1)
        np.testing.assert_allclose(mean_of(first), HONEST)
        groups, seconds = tier.gather(2)
        assert tier.state.tally.rejected == {reason: 1}
        assert groups.updates == [] and groups.clients == {}
        assert tier.tier.round_aggregates[AGGREGATOR] == {"asked": 2, "taken": 0, "outcome": reason}
        assert seconds < TIMEOUT_S / 4
        assert tier.events == [("edge_aggregate_refused", {"aggregator": AGGREGATOR, "round": 2, "clients": 2,
                                                           "reason": reason})]
        tier.aggregator.answer = lambda msg, sent: [(honest(msg, sent)[0][0],
                                                     {DELTA + "w": HONEST * np.float32(0.5)}, {})]
        again, _ = tier.gather(3)
        np.testing.assert_allclose(mean_of(again), HONEST * 0.5)
    finally:
        tier.close()


def test_a_replay_across_a_task_boundary_is_refused_not_a_crash():
    """The model's head grows at a task's start; an aggregator replaying its task-0 aggregate in task 1 is refused
    (a replay; its shape is wrong too) and the round goes on without it."""
    tier = Tier(replayed, first_honest=True)
    try:
        tier.gather(1)
        tier.state.server.global_state = {"w": np.zeros(4, np.float32)}  # task 1: one more class
        groups, _ = tier.gather(2, task=1)
        assert tier.state.tally.rejected == {"replayed": 1} and groups.clients == {}
    finally:
        tier.close()


@pytest.mark.parametrize("answer, reason", [(twice, "unexpected"), (of_another_round, "unexpected")])
def test_a_second_aggregate_or_one_of_another_round_is_refused_and_the_one_asked_for_taken(answer, reason):
    tier = Tier(answer)
    try:
        groups, _ = tier.gather(1)
        np.testing.assert_allclose(mean_of(groups), HONEST)
        deadline = time.monotonic() + 5
        while not tier.state.tally.rejected and time.monotonic() < deadline:  # the second may come after the first
            tier.dispatch.serve(lambda: bool(tier.state.tally.rejected), deadline)
        assert tier.state.tally.rejected == {reason: 1}
        assert tier.tier.round_aggregates[AGGREGATOR] == {"asked": 2, "taken": 2, "refused": 0, "missing": 0}
    finally:
        tier.close()


def test_an_aggregator_that_drops_all_its_clients_leaves_a_warning_an_event_and_a_record(caplog):
    tier = Tier(body_of(clients=[], missing=[], num_samples=0))
    try:
        with caplog.at_level("WARNING"):
            groups, seconds = tier.gather(1)
        assert groups.updates == [] and groups.clients == {AGGREGATOR: []} and seconds < TIMEOUT_S / 4
        assert tier.tier.round_aggregates[AGGREGATOR] == {"asked": 2, "taken": 0, "refused": 0, "missing": 2}
        assert tier.events == [("edge_clients_missing", {"aggregator": AGGREGATOR, "round": 1, "missing": 2,
                                                      "asked": 2, "unsaid": 2})]
        assert "left out every one of the 2 clients" in caplog.text
    finally:
        tier.close()


# --------------------------------------------------------------------------- a real run
# `up`, with edge-aggregator-1 started as a hostile aggregator (a subclass of the real one) that adds +100 to the
# bias of the model's last layer for class 0 in every aggregate it sends.
HOSTILE_AGGREGATOR = """
import sys
import numpy as np
from fcl_emu.edge_aggregator import args, relay

class Hostile(relay.EdgeAggregator):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        collect = self.held.collect
        def poisoned(*c, **k):
            aggregate = collect(*c, **k)
            biases = sorted(n for n, v in aggregate.tensors.items() if n.endswith('.bias') and v.ndim == 1)
            if biases:
                bias = np.array(aggregate.tensors[biases[-1]])
                bias[0] += 100
                aggregate.tensors[biases[-1]] = bias
            return aggregate
        self.held.collect = poisoned

relay.EdgeAggregator = Hostile
sys.argv[0] = 'hostile-aggregator'
raise SystemExit(args.main())
"""

UP_WITH_HOSTILE = """
import subprocess, sys, types
from fcl_emu.launchers import aggregators
from fcl_emu.cli import app

def popen(cmd, **kw):
    if 'edge-aggregator-1' in cmd:
        cmd = [cmd[0], '-c', HOSTILE, *cmd[3:]]
    return subprocess.Popen(cmd, **kw)

aggregators.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})
sys.argv = ['fcl-emu', *sys.argv[1:]]
app()
"""


def up(tmp_path, mnist_root, name: str, hostile: bool) -> dict:
    """A small MNIST run through 2 edge aggregators (the defaults' defences), the second hostile if ``hostile``: its
    summary."""
    run_dir = tmp_path / name
    code = (UP_WITH_HOSTILE.replace("HOSTILE", repr(HOSTILE_AGGREGATOR)) if hostile
            else "from fcl_emu.cli import app; app()")
    config = small_config(tmp_path / "c.yaml", scenario={"num_clients": 6, "samples_per_client_task": 300},
                          rounds={"clients_per_round": 6, "rounds_per_task": 2, "eval_every": 2},
                          training={"local_epochs": 1}, topology={"edge_aggregators": 2}, seed=0)
    flags = ["up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir)]
    done = subprocess.run([sys.executable, "-c", code, *flags], env=node_env(), capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_hostile_aggregate_is_refused_in_a_real_run_and_the_run_stays_near_the_clean_one(tmp_path, mnist_root):
    clean, attacked = up(tmp_path, mnist_root, "clean", False), up(tmp_path, mnist_root, "hostile", True)
    assert attacked["status"] == "completed"
    assert attacked["rejected_messages"].get("norm_bound", 0) == 4  # every round's aggregate of edge-aggregator-1
    # +100 on class 0's bias would make every image class 0: the second task's classes (2, 3) at 0 %, where both runs
    # learn it (62 and 74 % here). With 6 clients of 300 samples, half the updates fewer moves the accuracies by
    # many points either way, so the 10-client figures of docs/results/security.md (within 2 points) are not
    # asserted here.
    assert clean["accuracy_matrix"][-1][-1] >= 50 and attacked["accuracy_matrix"][-1][-1] >= 50
    recorded = events(tmp_path / "hostile")
    refused = [e for e in recorded if e["event"] == "edge_aggregate_refused"]
    assert {e["aggregator"] for e in refused} == {"edge-aggregator-1"} and len(refused) == 4
    assert all(e["edge_aggregates"]["edge-aggregator-1"]["outcome"] == "norm_bound"
               for e in recorded if e["event"] == "round")
