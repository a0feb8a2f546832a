"""The edge's resources and records, bounded (docs/hierarchy.md): a real edge aggregator (threads of this process)
between a coordinator's socket and a hostile node's, both played by the test over real sockets. A flood of
malformed messages writes a bounded log without raw peer bytes and reaches the run's summary as the edge's
refusals; what the aggregator holds is bounded per client and in total; `fcl-emu deploy` writes the aggregators'
services."""

from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from fcl_emu.aggregation.update import DELTA
from fcl_emu.coordinator.edge_tier import EdgeTier
from fcl_emu.wire.framing import wire_tensors
from fcl_emu.wire.messages import Heartbeat, TrainRequest, Update
from tests.relay_tier import AGGREGATOR, Tier
from tests.test_coordinator_parts import make_state
from tests.test_deploy import deploy, load

MODEL = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}  # 36 bytes
FLOOD = 20_000


def test_a_flood_of_malformed_messages_writes_a_bounded_log_and_reaches_the_summary(caplog):
    """20,000 malformed messages, each under a new identity of raw bytes (a line break, a terminal escape): the
    aggregator logs at most 100 of them and one line saying the rest are only counted, each line short and free
    of the peer's raw bytes; its heartbeats report the 20,000 up, and the coordinator's summary counts them as the
    edge's, under their reason."""
    tier = Tier()
    hostile = tier.ctx.socket(zmq.DEALER)
    hostile.connect(tier.aggregator.address)
    try:
        with caplog.at_level(logging.WARNING, logger="fcl_emu.edge_aggregator"):
            for i in range(FLOOD):
                hostile.send_multipart([b"\x1b[2J\nclient-%d\r" % i + b"\xff" * 40, b"\xc1not msgpack" * 10])
            deadline = time.monotonic() + 60
            while tier.aggregator.rejected["bad_header"] < FLOOD and time.monotonic() < deadline:
                time.sleep(0.1)
            assert tier.aggregator.rejected == {"bad_header": FLOOD}
            beat = tier.up_next({"heartbeat"}, sender=AGGREGATOR)
            while beat[1].body.rejected != {"bad_header": FLOOD} and time.monotonic() < deadline + 2:
                beat = tier.up_next({"heartbeat"}, sender=AGGREGATOR)
    finally:
        hostile.close(linger=0)
        tier.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "fcl_emu.edge_aggregator"]
    assert 100 <= len(lines) <= 101 and "further ones are only counted" in lines[-1], lines[-3:]
    assert "summary.json" in lines[-1]  # where the rest are counted
    assert all(len(line) < 400 and line.isprintable() and line.isascii() for line in lines), lines[0]
    assert "\\x1b[2J\\nclient-0\\r" in lines[0]  # escaped, so still readable
    edges = EdgeTier(make_state(), 1, 5.0)
    edges.on_message(AGGREGATOR, beat[1])
    assert edges.refusals() == {"edge/bad_header": FLOOD}  # what summary.json's rejected_messages adds


def update(samples: int, **extra) -> tuple[Update, dict]:
    """An update's body and tensors: the model's deltas (0.5 each) and any ``extra`` tensors."""
    return (Update(num_samples=samples, train_time_s=1.0, loss=0.5),
            {**{DELTA + k: np.full(v.shape, 0.5, np.float32) for k, v in MODEL.items()}, **extra})


def test_held_updates_are_bounded_per_client_and_in_total():
    """An update without samples is held without its tensors (4 MB sent, none kept); a client may hold one update
    a round and only in a round whose train request was relayed to it; no update larger than the model is held,
    and beyond the aggregator's byte budget (here 1.5 models) an update is refused. Each refusal goes up as the
    client's error under its reason."""
    tier = Tier(max_held_bytes=54)
    clients = [tier.node.channel(f"client-{i:04d}") for i in range(5)]
    try:
        for channel in clients:
            channel.send("heartbeat", Heartbeat())
        for channel in clients[:4]:
            tier.up_next({"heartbeat"}, sender=channel.identity)
        model = wire_tensors(MODEL)
        for channel in clients[:4]:  # client 4 gets no train request
            tier.coordinator.send(channel.identity, "train_request", TrainRequest(local_epochs=1, lr=0.1), round=1,
                                  tensors=model)
        requests = []
        while len(requests) < 4 and tier.node.sock.poll(5000):
            if (received := tier.node.recv()) is not None:  # None: the model's tensors, held for the requests
                requests.append(received)
        sent = [(0, update(0, junk=np.ones(1 << 20, np.float32))),  # no samples, 4 MB of tensors
                (2, update(10, junk=np.ones(4, np.float32))),  # more than the model (though within the budget)
                (1, update(10)), (1, update(10)),  # its second
                (3, update(10)),  # past the budget: 36 held, 36 more > 54
                (4, update(10))]  # its round's train request never came through here
        answers = []
        for n, (body, tensors) in sent:
            clients[n].send("update", body, round=1, tensors=tensors)
            peer, msg = tier.up_next({"update_held", "error"}, sender=clients[n].identity)
            answers.append((n, msg.type, msg.body.code if msg.type == "error" else None))
        assert answers == [(0, "update_held", None), (2, "error", "too_large"), (1, "update_held", None),
                           (1, "error", "unexpected"), (3, "error", "too_large"), (4, "error", "unexpected")]
        held = tier.aggregator.held.updates[1]
        assert set(held) == {"client-0000", "client-0001"} and held["client-0000"].tensors == {}
        assert sum(v.nbytes for u in held.values() for v in u.tensors.values()) == 36
        assert tier.aggregator.rejected == {"unexpected": 2, "too_large": 2}
    finally:
        tier.close()


def test_deploy_writes_the_edge_aggregators_services(tmp_path):
    """`fcl-emu deploy --edge-aggregators 2`: a service per aggregator under its relay key, dialling the
    coordinator's service; node n dials aggregator n mod 2's service with that aggregator's public key; every key
    file a service names is one of the stack's secrets."""
    out = tmp_path / "out"
    deploy(out, tmp_path, "--edge-aggregators", "2", "--secagg")
    stack, compose = load(out / "stack.yml"), load(out / "compose.yml")
    assert set(compose["services"]) == set(stack["services"])
    services = stack["services"]
    for a in range(2):
        service = services[f"edge-aggregator-{a}"]
        command = service["command"]
        assert service["entrypoint"] == ["python", "-m", "fcl_emu.edge_aggregator"]
        assert command[command.index("--connect") + 1] == "tcp://coordinator:5555"
        assert command[command.index("--key") + 1] == f"/run/secrets/edge-aggregator-{a}.key_secret"
        assert set(service["secrets"]) == {"coordinator.key", "roster.json", f"edge-aggregator-{a}.key_secret"}
    for n in range(2):
        command = services[f"node-{n}"]["command"]
        assert command[command.index("--connect") + 1] == f"tcp://edge-aggregator-{n % 2}:5600"
        assert command[command.index("--server-key") + 1] == f"/run/secrets/edge-aggregator-{n % 2}.key"
        assert "--secagg" in command  # the node knows the run is secure from its own arguments
    named = {s for service in services.values() for s in service.get("secrets", [])}
    assert named <= set(stack["secrets"]) and all((out / "keys" / name).is_file() for name in named)
    assert load(out / "config.yaml")["topology"]["edge_aggregators"] == 2
