"""The edge node's collaborators on their own, with fakes for what the node gives them: churn deciding crashes,
restarts, leaves and rejoins; a client's SecAgg+ session answering the coordinator. No sockets, no processes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from fcl_emu.edge_node.churn import Churn
from fcl_emu.edge_node.client import EmulatedClient, TrainJob, TrainResult
from fcl_emu.edge_node.secure_session import SecureSessions
from fcl_emu.edge_node.store import RoundPayloads
from fcl_emu.edge_node.training import Trainer
from fcl_emu.monitoring.metrics import EdgeNodeMetrics
from fcl_emu.scenario.availability import client_draw
from fcl_emu.secagg.client import SecAggClient
from fcl_emu.secagg.protocol import RoundParams
from fcl_emu.wire.framing import Message
from fcl_emu.wire.messages import (EdgeSettings, SecAggAbort, SecAggPeerKeys, SecAggPublicKeys, SecAggRelay,
                                   SecAggSetup, client_id, plain_body)


@dataclass
class FakeEndpoint:
    identity: str


class Recorder:
    """Stands in for the node: records what a collaborator asks of it."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, action: str):
        return lambda *args, **kw: self.calls.append((action, *args, *kw.values()))


def client(index: int = 1) -> EmulatedClient:
    return EmulatedClient(index, FakeEndpoint(client_id(index)), store=None, welcomed=True)


def events(metrics: EdgeNodeMetrics, event: str) -> float:
    return metrics.registry.get_sample_value("fcl_node_client_events_total", {"event": event})


def churn_of(**edge) -> tuple[Churn, Recorder, EdgeNodeMetrics]:
    node, metrics = Recorder(), EdgeNodeMetrics()
    churn = Churn(join=node.join, send=node.send, detach=node.detach, reconnect=node.reconnect,
                  retain_assets=node.retain_assets, metrics=metrics)
    churn.edge = EdgeSettings(**edge)
    return churn, node, metrics


def test_churn_crashes_a_selected_client_within_its_round_and_restarts_it_after_the_downtime():
    c = client()
    c.task, c.assets, c.state, c.round_s = 2, {"old": np.zeros(1)}, {"local": 1}, 4.0
    churn, node, metrics = churn_of(crash_rate=1.0, crash_downtime_s=5.0)
    churn.start(c, EdgeSettings(clock_s=10.0), now=100.0)  # the run clock read 10 s at the welcome
    assert node.calls == [] and c.active
    churn.draw_crash(c, round=7, seed=3, now=100.0)
    assert 100.0 <= c.crash_at < 104.0  # somewhere in a round as long as its last one
    crash_at = c.crash_at
    churn.tick(crash_at - 0.01)
    assert node.calls == []
    churn.tick(crash_at)
    assert node.calls == [("detach", c), ("retain_assets",)]  # no goodbye: the socket just goes
    assert c.status == "down" and c.generation == 1 and not c.welcomed and c.secagg is None
    assert (c.task, c.assets, c.state, c.crash_at) == (-1, {}, {}, None)
    assert c.down_until == crash_at + 5.0
    down_until, node.calls[:] = c.down_until, []
    churn.tick(down_until - 0.01)
    assert node.calls == []
    churn.tick(down_until)
    assert node.calls == [("reconnect", c), ("join", c)] and c.status == "joining"
    assert (events(metrics, "crash"), events(metrics, "restart")) == (1.0, 1.0)


def test_churn_draws_each_clients_crash_from_the_seed_and_round():
    clients = [client(i) for i in range(20)]
    never, _, _ = churn_of()  # no crash rate: no crash
    for c in clients:
        never.draw_crash(c, round=1, seed=0, now=0.0)
    assert all(c.crash_at is None for c in clients)
    churn, _, _ = churn_of(crash_rate=0.5)
    for c in clients:
        churn.draw_crash(c, round=1, seed=2, now=50.0)
    crashing = [c.index for c in clients if c.crash_at is not None]
    assert 0 < len(crashing) < len(clients)
    assert crashing == [c.index for c in clients if client_draw(2, "crash", c.index, 1) < 0.5]
    assert all(c.crash_at == 50.0 + client_draw(2, "crash-at", c.index, 1) for c in clients if c.crash_at)


def test_churn_follows_availability_leaving_and_joining_again_on_the_run_clock():
    c = client()
    churn, node, metrics = churn_of()
    trace = {"kind": "trace", "intervals": [[0, 10], [20, 30]], "period": 100, "scale": 1.0}
    churn.start(c, EdgeSettings(availability=trace, clock_s=5.0), now=1000.0)  # run clock 0 = 995
    assert c.active and node.calls == []
    churn.tick(1004.9)
    assert node.calls == []
    churn.tick(1005.0)  # run clock 10: off
    [(action, who, msg_type, body)] = node.calls
    assert (action, who, msg_type, body.reason) == ("send", c, "leave", "unavailable")
    assert c.status == "away" and c.generation == 1  # its work in flight is dropped
    churn.tick(1015.0)  # run clock 20: on again, local state kept
    assert node.calls[1:] == [("join", c)] and c.welcomed
    assert (events(metrics, "leave"), events(metrics, "rejoin")) == (1.0, 1.0)


def test_a_bad_availability_model_leaves_the_client_always_available_on_an_ideal_link():
    c = client()
    churn, node, _ = churn_of()
    churn.start(c, EdgeSettings(availability={"kind": "sometimes"}), now=0.0)
    churn.tick(1e6)
    assert c.active and node.calls == []


# --------------------------------------------------------------------------------------- SecAgg+ client
ROUND, TASK = 7, 1
PARAMS = RoundParams(round_id=99, n=3, dim=4, neighbors=2, threshold=2, ring_bits=16, clip=1.0, max_weight=100)


def setup_msg(index: int) -> Message:
    """Client ``index`` (1 to 3) of a round of three, each the others' neighbour."""
    neighbors = {client_id(i): i for i in (1, 2, 3) if i != index}
    return Message("secagg_setup", SecAggSetup(params=PARAMS.to_dict(), index=index, neighbors=neighbors),
                   round=ROUND, task=TASK)


def sessions() -> tuple[SecureSessions, Recorder, EdgeNodeMetrics]:
    node, metrics = Recorder(), EdgeNodeMetrics()
    return SecureSessions(send=node.send, upload=node.upload, seed=lambda: 5, metrics=metrics), node, metrics


def result_of(c: EmulatedClient, error: str | None = None) -> TrainResult:
    return TrainResult(c, ROUND, TASK, None, 12, {"loss": 0.5}, error=error, cpu_s=0.25,
                       vector=np.full(4, 0.1, np.float32))


def test_a_session_answers_a_setup_with_the_clients_keys():
    secure, node, metrics = sessions()
    c = client(1)
    secure.on_message(c, setup_msg(1))
    [(action, who, msg_type, body, round, task)] = node.calls
    assert (action, who, msg_type, round, task) == ("send", c, "secagg_keys", ROUND, TASK)
    assert len(body.c_pk) == len(body.s_pk) == 32 and body.c_pk != body.s_pk
    assert c.secagg.round == ROUND and c.secagg.protocol.client == c.id
    assert metrics.registry.get_sample_value("fcl_secagg_phase_duration_seconds_count",
                                             {"role": "edge_node", "phase": "advertise_keys"}) == 1.0


def test_a_message_of_another_round_is_refused_and_an_abort_ends_the_session():
    secure, node, _ = sessions()
    c = client(1)
    secure.on_message(c, Message("secagg_abort", SecAggAbort(reason="x"), round=ROUND, task=TASK))
    assert node.calls == []  # nothing to abort: no reply
    secure.on_message(c, setup_msg(1))
    secure.on_message(c, Message("secagg_relay", SecAggRelay(shares={}), round=ROUND + 1, task=TASK))
    [(_, _, msg_type, body, round, _)] = node.calls[1:]
    assert (msg_type, body.code, round) == ("error", "secagg", ROUND + 1)
    assert "no secure-aggregation session" in body.detail and c.secagg is None  # the refusal ends its session
    secure.on_message(c, setup_msg(1))
    secure.on_message(c, Message("secagg_abort", SecAggAbort(reason="x"), round=ROUND, task=TASK))
    assert c.secagg is None
    secure.on_result(c, result_of(c))  # its session is gone: the result is dropped
    assert len(node.calls) == 3


@pytest.mark.parametrize("result_first", [True, False])
def test_the_masked_input_goes_up_once_both_the_relayed_shares_and_the_result_are_there(result_first):
    secure, node, _ = sessions()
    c = client(1)
    peers = {i: SecAggClient(client_id(i)) for i in (2, 3)}
    keys = {client_id(i): p.on_setup(plain_body(setup_msg(i).body)) for i, p in peers.items()}
    secure.on_message(c, setup_msg(1))
    own = node.calls[0][3]
    keys[c.id] = {"c_pk": own.c_pk, "s_pk": own.s_pk}
    secure.on_message(c, Message("secagg_peer_keys", SecAggPeerKeys(
        keys={p: SecAggPublicKeys(**k) for p, k in keys.items() if p != c.id}), round=ROUND, task=TASK))
    assert node.calls[1][2] == "secagg_shares"
    relay = {}
    for p in peers.values():
        shares = p.on_keys({"keys": {q: k for q, k in keys.items() if q != p.client}})["shares"]
        relay[p.client] = shares[c.id]
    relay_msg = Message("secagg_relay", SecAggRelay(shares=relay), round=ROUND, task=TASK)
    result = result_of(c)
    first, second = ((secure.on_result, result), (secure.on_message, relay_msg))[::1 if result_first else -1]
    first[0](c, first[1])
    assert len(node.calls) == 2  # it waits for the other
    second[0](c, second[1])
    [(action, who, got, msg_type, body, tensors)] = node.calls[2:]
    assert (action, who, got, msg_type) == ("upload", c, result, "secagg_masked")
    assert (body.loss, body.cpu_s) == (0.5, 0.25) and tensors["y"].shape == (PARAMS.dim + 1,)
    assert c.secagg.relay is None and c.secagg.result is None  # the session stays for the unmasking


def test_a_failed_training_under_secure_aggregation_is_reported_once_the_shares_are_there():
    secure, node, _ = sessions()
    c = client(1)
    secure.on_message(c, setup_msg(1))
    c.secagg.relay = {"shares": {}}
    secure.on_result(c, result_of(c, error="RuntimeError: boom"))
    [(_, _, msg_type, body, round, task)] = node.calls[1:]
    assert (msg_type, body.code, body.detail, round, task) == ("error", "train_failed", "RuntimeError: boom",
                                                              ROUND, TASK)
    assert c.secagg is None


def test_a_job_whose_client_moved_on_to_a_newer_task_is_not_trained():
    """Under the real clock a late job can wait in the trainer's queue while its client's next task starts: it
    would train the new task's labels into the old task's smaller head (an IndexError) for a round that is over.
    It is skipped, and nothing is sent for it."""
    import zmq

    from fcl_emu.wire.messages import TrainRequest

    payloads = RoundPayloads()
    trainer = Trainer(zmq.Context.instance(), threads=1, payloads=payloads, metrics=EdgeNodeMetrics(),
                      setup=lambda: None)
    c = client()
    c.task = 1  # task 1 started after round 3 (of task 0) was queued
    job = TrainJob(c, round=3, task=0, model=payloads.acquire(3, {"head.weight": np.zeros((5, 4), np.float32)}),
                   generation=c.generation, received_at=0.0, request=TrainRequest(local_epochs=1, lr=0.1))
    result = trainer._train(job, {})
    assert result.stale and result.uploads is None and result.error is None
    trainer.wake.close()


def test_a_job_the_coordinator_cancelled_is_dropped_and_nothing_is_sent():
    import zmq

    from fcl_emu.wire.messages import TrainRequest

    payloads, metrics = RoundPayloads(), EdgeNodeMetrics()
    trainer = Trainer(zmq.Context.instance(), threads=1, payloads=payloads, metrics=metrics, setup=lambda: None)
    c = client()
    job = TrainJob(c, round=3, task=0, model=payloads.acquire(3, {"head.weight": np.zeros((5, 4), np.float32)}),
                   generation=c.generation, received_at=0.0, request=TrainRequest(local_epochs=1, lr=0.1))
    trainer.submit(job)
    trainer.cancel(c.id, 3)  # it came right behind the train request: the job has not started
    trainer.start()
    trainer.stop()
    assert list(trainer.finished()) == []
    assert metrics.registry.get_sample_value("fcl_client_train_jobs_total", {"outcome": "cancelled"}) == 1
    assert trainer._cancelled == set()  # spent
    trainer.close()


def test_a_node_that_ends_drops_the_jobs_still_queued_instead_of_training_them():
    """Their results would go nowhere: before, an interrupted `up` waited for every node to train its queue."""
    import threading
    import time

    import zmq

    from fcl_emu.wire.messages import TrainRequest

    payloads, metrics = RoundPayloads(), EdgeNodeMetrics()
    trainer = Trainer(zmq.Context.instance(), threads=1, payloads=payloads, metrics=metrics, setup=lambda: None)
    training, trained = threading.Event(), []

    def train(job, cache):
        training.set()
        time.sleep(0.2)
        trained.append(job.client.index)
        return TrainResult(job.client, job.round, job.task, {}, 0)

    trainer._warm_up, trainer._train = lambda: None, train
    for index in range(1, 6):
        c = client(index)
        trainer.submit(TrainJob(c, 3, 0, payloads.acquire(3, {}), c.generation, 0.0, TrainRequest(local_epochs=1,
                                                                                                   lr=0.1)))
    trainer.start()
    assert training.wait(5)
    trainer.stop()
    assert trained == [1]
    assert metrics.registry.get_sample_value("fcl_client_train_jobs_total", {"outcome": "cancelled"}) == 4
    trainer.close()


def test_jobs_train_round_by_round_in_the_nodes_order_then_first_come_first_served():
    import zmq

    from fcl_emu.wire.messages import TrainRequest

    payloads = RoundPayloads()
    trainer = Trainer(zmq.Context.instance(), threads=1, payloads=payloads, metrics=EdgeNodeMetrics(),
                      setup=lambda: None)
    request = TrainRequest(local_epochs=1, lr=0.1)
    for index, round, order in ((1, 5, 3.0), (2, 5, 1.0), (3, 4, 9.0), (4, 5, 1.0), (5, 5, 0.5)):
        c = client(index)
        trainer.submit(TrainJob(c, round, 0, {}, c.generation, 0.0, request), order)
    assert [trainer._jobs.get()[1].client.index for _ in range(5)] == [3, 5, 2, 4, 1]
    trainer.close()
