"""No relay turns a secure run plain (docs/hierarchy.md, "Secure aggregation at every tier"): a real edge-node
process (``python -m fcl_emu.edge_node``) dials a hostile edge aggregator, played by this test over a real socket,
that relays the run's messages with their ``secure`` flag flipped (or drops some). The node knows how the run
aggregates from what its launcher started it with (``--secagg``), never from a relayed message: its clients send
masked inputs in a secure run and plain updates in a plain one, refuse what they cannot do that way as their
``error`` for the round (the round does not wait for them), and the node exits in one line when the welcome says
otherwise than its flag."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
import zmq

from fcl_emu.launchers.base import node_args
from fcl_emu.launchers.process import node_env
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.runconfig import load_config
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.aggregation.update import DeltaLayout
from fcl_emu.secagg.server import SecAggServer
from fcl_emu.wire.messages import (SecAggParams, SecAggPeerKeys, SecAggRelay, SecAggSetup, TaskStart, TrainRequest,
                                   Welcome, plain_body)
from fcl_emu.wire.sockets import ServerEndpoint
from tests.conftest import small_config

CLIENTS = ["client-0000", "client-0001", "client-0002"]


def welcome(config, secure: bool) -> Welcome:
    """The run's welcome as the coordinator sends it (``secure``: what it says of the run)."""
    return Welcome(run_id="edge-secure", scenario=config.scenario.model_dump(mode="json"), method=config.method,
                   method_options=config.method_options_model().model_dump(mode="json"), model=config.model,
                   training={**config.training.model_dump(), "seed": 0, "device": "cpu"}, heartbeat_interval_s=0.3,
                   join_task=0, secure=secure)


class HostileRelay:
    """The edge aggregator a node dials, played by the test: it relays what the test gives it, changed or not."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.endpoint = ServerEndpoint(self.ctx, "tcp://127.0.0.1:0")
        self.received: list = []

    def start_node(self, tmp_path, mnist_root, secure: bool, clients: list[str] = CLIENTS[:1]) -> subprocess.Popen:
        """A real edge node hosting ``clients``, started as `up` starts one (its launcher's arguments)."""
        config = load_config(small_config(tmp_path / "c.yaml", security={"transport": "plain"},
                                          secagg={"enabled": secure}), {"data_root": [str(mnist_root)]})
        self.config, self.clients = config, clients
        args = node_args(self.endpoint.address, [int(c.rsplit("-", 1)[1]) for c in clients], config, "node-0")
        assert args.secagg is secure  # what the launcher says of the run, never a relayed message
        self.log = open(tmp_path / "node.log", "w+")
        return subprocess.Popen([sys.executable, "-m", "fcl_emu.edge_node", *args.to_argv()], stdout=self.log,
                                stderr=subprocess.STDOUT, env=node_env())

    def next(self, types: set[str], timeout_s: float = 60.0):
        """The client's next message of one of ``types`` (None if none came in time); every message is kept."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.endpoint.sock.poll(100):
                got = self.endpoint.recv()
                if got is not None:
                    self.received.append(got[1])
                    if got[1].type in types:
                        return got[1]
        return None

    def send(self, msg_type: str, body, to: str, **kw) -> None:
        """Relay a message of the coordinator's to client ``to`` (task 0, round 1 unless given)."""
        self.endpoint.send(to, msg_type, body, **{"task": 0, "round": 1, **kw})

    def close(self) -> None:
        self.endpoint.close()
        self.ctx.term()
        self.log.close()


@pytest.fixture
def relay():
    relay = HostileRelay()
    yield relay
    relay.close()


def joined(relay: HostileRelay, secure: bool) -> None:
    """The node's clients join; the relay passes the coordinator's welcome on (``secure``: what it says of the run)
    and opens task 0."""
    for _ in relay.clients:
        join = relay.next({"join"})
        assert join is not None, "the node never joined"
        relay.send("welcome", welcome(relay.config, secure), to=join.sender)
        relay.send("task_start", TaskStart(classes=[0, 1, 2, 3, 4], seen_classes=[0, 1, 2, 3, 4]), to=join.sender)


def initial_model(config) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in build_model(config.model, (1, 28, 28), 5).state_dict().items()}


def test_a_relay_that_turns_a_secure_round_plain_gets_only_masked_inputs_or_refusals(relay, tmp_path, mnist_root):
    """A secure run's node under a relay that flips the train requests to plain. Round 1 (a real SecAgg+ server
    behind the relay): the clients train and send their masked inputs as the run requires, no plain update ever
    reaches the relay, and the node logs the changed request once per client. Round 2, whose SecAgg+ setup the
    relay dropped: a client cannot send a masked input, so it answers at once, before any training, with its
    error for the round instead of the round waiting for it."""
    node = relay.start_node(tmp_path, mnist_root, secure=True, clients=CLIENTS)
    try:
        joined(relay, secure=True)
        model = initial_model(relay.config)
        server = SecAggServer(CLIENTS, DeltaLayout.of(model).dim, SecAggSettings(neighbors=2, threshold=2),
                              round_id=7, max_weight=10_000)
        for client, setup in server.setup().items():
            relay.send("secagg_setup", SecAggSetup(**setup), to=client)
        for _ in CLIENTS:
            keys = relay.next({"secagg_keys"})
            server.receive_keys(keys.sender, plain_body(keys.body))
        for client, keys in server.close_keys().items():
            relay.send("secagg_peer_keys", SecAggPeerKeys(**keys), to=client)
            relay.send("train_request", TrainRequest(local_epochs=1, lr=0.05, secure=False), to=client,
                       tensors=model)  # the coordinator said secure=True
        for _ in CLIENTS:
            shares = relay.next({"secagg_shares"})
            server.receive_shares(shares.sender, plain_body(shares.body))
        for client, relayed in server.close_shares().items():
            relay.send("secagg_relay", SecAggRelay(**relayed), to=client)
        masked = [relay.next({"secagg_masked", "update", "error"}) for _ in CLIENTS]
        assert [m.type for m in masked] == ["secagg_masked"] * 3, [(m.type, m.body) for m in masked]
        for m in masked:
            server.receive_masked(m.sender, {"y": m.tensors["y"]})

        asked = time.monotonic()
        relay.send("train_request", TrainRequest(local_epochs=1, lr=0.05, secure=False), to=CLIENTS[0], round=2,
                   tensors=model)
        answer = relay.next({"update", "secagg_masked", "error"})
        assert time.monotonic() - asked < 5, "the refusal waited for a training"
        assert (answer.type, answer.body.code, answer.round) == ("error", "secure_mismatch", 2), answer
        assert "without its secure-aggregation session" in answer.body.detail
        assert relay.next({"update", "secagg_masked"}, timeout_s=2) is None
        assert "update" not in {m.type for m in relay.received}  # nothing the relay could read
        assert node.poll() is None
    finally:
        node.terminate()
        node.wait(timeout=30)
    relay.log.seek(0)
    assert relay.log.read().count("the train request asks for a plain update; sending a masked one") == len(CLIENTS)


def test_a_plain_runs_node_refuses_secure_aggregation_and_exits_on_a_secure_welcome(relay, tmp_path, mnist_root):
    """A plain run's node: a relayed SecAgg+ setup is refused as the client's error (no masked input can be asked
    for); a train request flipped to secure is trained as the run aggregates, into a plain update. Then a welcome
    into a run that aggregates securely (a relay changed it, or the node was started by hand without --secagg): the
    node says so in one line and exits 1, its client leaving at once instead of stalling the coordinator's rounds."""
    node = relay.start_node(tmp_path, mnist_root, secure=False)
    try:
        joined(relay, secure=False)
        params = SecAggParams(round=2, n=3, dim=4, neighbors=2, threshold=2, ring_bits=16, clip=1.0, max_weight=9)
        relay.send("secagg_setup", SecAggSetup(params=params, index=1, neighbors={}), to=CLIENTS[0])
        answer = relay.next({"secagg_keys", "error"})
        assert (answer.type, answer.body.code) == ("error", "secure_mismatch") and "secagg_setup" in answer.body.detail
        relay.send("train_request", TrainRequest(local_epochs=1, lr=0.05, secure=True), to=CLIENTS[0],
                   tensors=initial_model(relay.config))
        assert relay.next({"update", "secagg_masked", "error"}).type == "update"

        relay.send("welcome", msgspec.structs.replace(welcome(relay.config, True), run_id="edge-secure-2"),
                   to=CLIENTS[0])
        leave = relay.next({"leave"}, timeout_s=30)
        assert node.wait(timeout=30) == 1
    finally:
        if node.poll() is None:
            node.kill()
    assert leave is not None and "aggregates securely (--secagg)" in leave.body.reason
    relay.log.seek(0)
    errors = [line for line in relay.log.read().splitlines() if "cannot take part" in line]
    assert errors and errors[-1] == ("error: node-0 cannot take part in run edge-secure-2: the run aggregates "
                                     "securely (--secagg), but this node was started without --secagg")
