"""Edge aggregators (``--edge-aggregators``, docs/hierarchy.md): what an aggregator holds and sends up, the SecAgg+
server's sums of masked inputs from a tier below, the configuration's refusals, the keys; then runs: in one
process (an inspected secure run) and as ``fcl-emu up`` with and without aggregators, one of them killed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import types

import numpy as np
import pytest

from fcl_emu.aggregation.combine import fedavg, group_mean
from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.edge_aggregator.held import HeldUpdates
from fcl_emu.runconfig import RunConfig
from fcl_emu.secagg.client import SecAggClient
from fcl_emu.secagg.protocol import Quantizer, SecAggError
from fcl_emu.secagg.server import SecAggServer
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.wire.framing import Message, WireError, decode, encode
from fcl_emu.wire.messages import EdgeCollect, SecAggMasked, SecAggParams, TensorSpec, Update
from tests.conftest import events, fcl_emu, run_beside, small_config
from tests.test_secagg import make_inputs

MODEL = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
TABLE = [TensorSpec(name, "float32", list(a.shape), a.nbytes) for name, a in MODEL.items()]


def update_msg(client: str, samples: int, scale: float, round: int = 1, **tensors) -> Message:
    """An ``update`` as the aggregator receives it (encoded and decoded: checked finite, square sums known)."""
    arrays = tensors or {DELTA + k: np.full(a.shape, scale, np.float32) for k, a in MODEL.items()}
    frames = encode("update", Update(num_samples=samples, train_time_s=1.0, loss=scale, cpu_s=0.5), sender=client,
                    seq=1, round=round, tensors=arrays)
    return decode([bytes(memoryview(f)) for f in frames])


def relayed(h: HeldUpdates, round: int, table: list[TensorSpec] = TABLE, clients: int = 10) -> HeldUpdates:
    """``h`` after the round's train request was relayed to clients 0 to ``clients`` - 1."""
    for i in range(clients):
        h.on_train_request(round, table, f"client-{i:04d}")
    return h


def held(*msgs: Message) -> HeldUpdates:
    h = relayed(HeldUpdates(), 1)
    for msg in msgs:
        h.hold(msg)
    return h


# --------------------------------------------------------------------------- what an aggregator sends up

def test_group_mean_of_group_means_is_the_flat_weighted_mean_by_hand():
    a, b, c = (ClientUpdate(n, s, {"delta/x": np.array([v], np.float32), "m/y": np.array([2 * v], np.float32)})
               for n, s, v in (("a", 1, 4.0), ("b", 3, 0.0), ("c", 4, 1.0)))
    left = group_mean([a, b], ("delta/", "m/"))
    assert left["delta/x"][0] == pytest.approx(1.0) and left["m/y"][0] == pytest.approx(2.0)  # (1*4 + 3*0) / 4
    groups = [ClientUpdate("edge-0", 4, left), ClientUpdate("edge-1", 4, group_mean([c], ("delta/", "m/")))]
    assert fedavg(groups)["x"][0] == pytest.approx((1 * 4 + 3 * 0 + 4 * 1) / 8) == fedavg([a, b, c])["x"][0]


def test_held_updates_are_checked_like_the_coordinators_and_combined_on_collect():
    h = held(update_msg("client-0001", 10, 1.0), update_msg("client-0002", 30, 3.0), update_msg("client-0003", 0, 0))
    with pytest.raises(WireError, match="second update"):
        h.hold(update_msg("client-0001", 10, 1.0))
    with pytest.raises(WireError, match="did not relay"):
        h.hold(update_msg("client-0004", 10, 1.0, round=7))
    with pytest.raises(WireError) as bad_shape:
        h.hold(update_msg("client-0005", 10, 1.0, **{"delta/w": np.zeros((3, 2), np.float32),
                                                     "delta/b": np.zeros(3, np.float32)}))
    assert bad_shape.value.reason == "bad_shape"
    with pytest.raises(WireError) as bad_dtype:
        h.hold(update_msg("client-0006", 10, 1.0, **{"delta/w": np.zeros((2, 3), np.float64),
                                                     "delta/b": np.zeros(3, np.float32)}))
    assert bad_dtype.value.reason == "bad_dtype"
    out = h.collect(1, EdgeCollect(clients=["client-0001", "client-0002", "client-0003", "client-0009"],
                                   prefixes=[DELTA]))
    assert out.body.clients == ["client-0001", "client-0002", "client-0003"] and out.body.missing == ["client-0009"]
    assert out.body.num_samples == 40 and out.body.loss == pytest.approx((1.0 + 3.0) / 2)
    assert np.allclose(out.tensors["delta/w"], (10 * 1.0 + 30 * 3.0) / 40)
    assert h.updates == {}  # let go once collected


def test_a_module_that_rides_with_the_model_is_checked_and_averaged_beside_it():
    """AF-FCL's flow or LANDER's projector: sent with the model under the method's name, uploaded back as a delta
    under the same name, averaged at the edge beside the model's delta."""
    h = relayed(HeldUpdates(), 1, [*TABLE, TensorSpec("affcl/flow/v", "float32", [4], 16)])

    def upload(client, samples, value, flow_shape=(4,)):
        return update_msg(client, samples, value, **{DELTA + k: np.full(a.shape, value, np.float32)
                                                     for k, a in MODEL.items()},
                          **{"affcl/flow/v": np.full(flow_shape, value, np.float32)})

    h.hold(upload("client-0001", 1, 1.0))
    h.hold(upload("client-0002", 3, 5.0))
    with pytest.raises(WireError, match="affcl/flow/v"):
        h.hold(upload("client-0003", 1, 1.0, flow_shape=(5,)))
    out = h.collect(1, EdgeCollect(clients=["client-0001", "client-0002"], prefixes=[DELTA, "affcl/flow/"]))
    assert np.allclose(out.tensors["affcl/flow/v"], 4.0) and np.allclose(out.tensors["delta/b"], 4.0)


def test_the_edge_applies_the_norm_bound_and_the_direction_check_to_its_clients():
    honest = [update_msg(f"client-{i:04d}", 10, 1.0 + i / 10) for i in range(5)]
    reversed_ = update_msg("client-0009", 10, -1.0)
    huge = update_msg("client-0008", 10, 1e3)
    h = held(*honest, reversed_, huge)
    clients = [m.sender for m in (*honest, reversed_, huge)]
    out = h.collect(1, EdgeCollect(clients=clients, prefixes=[DELTA], max_update_norm=100.0, direction_check=10.0))
    assert out.body.refused["client-0008"][0] == "norm_bound"
    assert out.body.refused["client-0009"][0] == "off_cohort"
    assert out.body.num_samples == 50 and np.all(out.tensors["delta/b"] > 0)


def test_masked_inputs_are_held_checked_and_summed_in_the_ring():
    h = relayed(HeldUpdates(), 2)
    params = SecAggParams(round=3, n=4, dim=5, neighbors=3, threshold=2, ring_bits=16, clip=1.0, max_weight=9)
    h.on_secagg_setup(2, params)

    def masked(client, y):
        frames = encode("secagg_masked", SecAggMasked(train_time_s=1.0, loss=0.5), sender=client, seq=1, round=2,
                        tensors={"y": y})
        return decode([bytes(memoryview(f)) for f in frames])

    ys = [np.full(6, 40_000 + i, np.uint32) for i in range(3)]
    for i, y in enumerate(ys):
        h.hold_masked(masked(f"client-{i:04d}", y))
    for y in (np.zeros(5, np.uint32), np.full(6, 1 << 16, np.uint32), np.zeros(6, np.float32)):
        with pytest.raises(WireError) as bad:
            h.hold_masked(masked("client-0009", y))
        assert bad.value.reason == "secagg"
    out = h.collect(2, EdgeCollect(clients=["client-0000", "client-0002"], prefixes=[]))
    assert out.body.clients == ["client-0000", "client-0002"] and out.body.num_samples == 0
    assert np.array_equal(out.tensors["y"], np.full(6, (40_000 + 40_002) % (1 << 16), np.uint32))


def test_edge_rounds_train_from_the_edge_model_and_send_its_delta_from_the_cloud():
    from fcl_emu.edge_aggregator.edge_rounds import EdgeRounds, Work
    from fcl_emu.wire.messages import TrainRequest

    rounds, request = EdgeRounds(3, timeout_s=60.0), TrainRequest(local_epochs=1, lr=0.1)
    cloud = {"w": np.zeros(2, np.float32), "n": np.array(4, np.int64)}
    for client in ("a", "b", "c"):
        rounds.requested(7, 0, client, request, cloud)

    def answer(client, samples, value, n=5):
        return rounds.answered(7, ClientUpdate(client, samples, {"delta/w": np.full(2, value, np.float32),
                                                                 "delta/n": np.array(n, np.int64)}), Work(1.0, 2.0, 10))

    rounds.cancelled(7, "c")  # the coordinator dropped it: no edge round waits for it
    assert answer("a", 1, 4.0) == (False, None)
    last, again = answer("b", 3, 0.0)
    assert not last and (again.round, again.clients) == (7, ["a", "b"])
    assert np.allclose(again.model["w"], 1.0) and again.model["n"] == 5  # (1*4 + 3*0) / 4; integers: the largest
    assert answer("a", 1, 1.0)[0] is False
    assert rounds.due(time.monotonic() + 61.0)[0].clients == ["a"]  # b's time is up: the third edge round without it
    assert answer("a", 1, 2.0) == (True, None)  # its last: held for the collect
    assert np.allclose(rounds.offset(7)["w"], 2.0) and "n" not in rounds.offset(7)
    assert rounds.work(7, "a") == Work(3.0, 6.0, 30) and rounds.work(7, "b") == Work(1.0, 2.0, 10)


def test_a_collect_after_edge_rounds_adds_what_they_moved():
    h = held(update_msg("client-0001", 10, 1.0), update_msg("client-0002", 30, 3.0))
    out = h.collect(1, EdgeCollect(clients=["client-0001", "client-0002"], prefixes=[DELTA]),
                    offset={"w": np.full((2, 3), 0.5, np.float32), "b": np.zeros(3, np.float32)})
    assert np.allclose(out.tensors["delta/w"], 2.5 + 0.5) and np.allclose(out.tensors["delta/b"], 2.5)


# --------------------------------------------------------------------------- SecAgg+ with sums from below

def test_secagg_server_takes_ring_sums_of_held_inputs_and_drops_a_lost_group():
    """Two groups' masked inputs reach the server as two ring sums, a third group's never: the result is the
    plaintext sum of the first two groups' inputs (the third's clients recovered as dropouts)."""
    roster = [f"client-{i:03d}" for i in range(9)]
    dim = 11
    server = SecAggServer(roster, dim, SecAggSettings(neighbors=8, threshold=3, clip=1.0, max_weight=100),
                          round_id=5, seed=5)
    _, _, inputs, quantized = make_inputs(roster, dim, seed=5)
    clients = {c: SecAggClient(c) for c in roster}
    for c, m in server.setup().items():
        server.receive_keys(c, clients[c].on_setup(m))
    for c, m in server.close_keys().items():
        server.receive_shares(c, clients[c].on_keys(m))
    ys = {c: clients[c].on_shares(m, *inputs(c))["y"] for c, m in server.close_shares().items()}
    groups = [roster[0:3], roster[3:6], roster[6:9]]
    for c in roster:
        server.receive_masked(c, {"held": True})
    with pytest.raises(SecAggError, match="not noted as held"):
        server.add_sum(["client-000", "client-099"], ys["client-000"])
    with pytest.raises(SecAggError, match="neither added nor lost"):
        server.close_masked()
    for group in groups[:2]:
        server.add_sum(group, np.sum([ys[c] for c in group], axis=0, dtype=np.uint32))
    server.lose_held(groups[2])
    for c, m in server.close_masked().items():
        server.receive_unmask(c, clients[c].on_unmask(m))
    result = server.close_unmask()
    assert set(result.clients) == set(roster[:6])
    expected = np.sum([quantized(c, server.params) for c in roster[:6]], axis=0, dtype=np.uint64)
    assert np.array_equal(result.ring_sum, expected.astype(np.uint32))


# --------------------------------------------------------------------------- configuration and keys

def base(**topology) -> dict:
    return {"scenario": {"num_clients": 20}, "rounds": {"clients_per_round": 8},
            "topology": {"edge_aggregators": 2, **topology}}


@pytest.mark.parametrize("extra, words", [
    ({"method": "fedcbc"}, "pre-combine"),
    ({"containers": {"backend": "docker"}}, "--backend process"),
    ({"nodes": 1}, "fewer than --edge-aggregators 2"),
    ({"aggregation": {"policy": "fedbuff"}}, "--aggregation sync"),
    ({"aggregation": {"rule": "krum"}}, "needs 5 of them"),
    ({"rounds": {"clients_per_round": 8, "late_updates": "next_round"}}, "--late-updates drop"),
    ({"topology": {"edge_aggregators": 2, "edge_rounds": 2}, "secagg": {"enabled": True}}, "--edge-rounds 1"),
    ({"network": {"client_connections": "own"}}, "client_connections: shared"),
])
def test_runs_an_edge_aggregator_cannot_serve_are_refused_in_one_line(extra, words):
    with pytest.raises(ValueError, match="--edge-") as info:
        RunConfig.model_validate({**base(), **extra})
    assert words in str(info.value)


def test_unset_nodes_become_one_per_aggregator_and_the_link_is_checked():
    config = RunConfig.model_validate(base(edge_aggregators=5))
    assert config.nodes == 5
    assert config.topology.wide_area_s(1_000_000, 250_000) == 0.0
    slow = config.topology.model_copy(update={"uplink_mbps": 2.0, "downlink_mbps": 8.0, "latency_ms": 50})
    assert slow.wide_area_s(1_000_000, 250_000) == pytest.approx(1.0 + 1.0 + 0.1)  # 8 Mbit / 8 + 2 Mbit / 2
    with pytest.raises(ValueError):
        RunConfig.model_validate(base(uplink_mbps=0))


def test_relay_keys_speak_for_their_nodes_clients_and_sign_nothing(tmp_path):
    from fcl_emu.keys import write_run_keys

    path = write_run_keys(tmp_path / "k", [[0, 2], [1, 3], [4]], edge_aggregators=2)
    roster = {e["name"]: set(e["identities"]) for e in json.loads((path / "roster.json").read_text()).values()}
    assert roster["edge-aggregator-0"] == {"edge-aggregator-0", "client-0000", "client-0002", "client-0004"}
    assert roster["edge-aggregator-1"] == {"edge-aggregator-1", "client-0001", "client-0003"}
    signers = json.loads((path / "secagg_signers.json").read_text())
    assert not any(name.startswith("edge-aggregator") for name in signers)
    assert (path / "edge-aggregator-1.key").is_file() and not (path / "node-1.key").exists()


# --------------------------------------------------------------------------- an inspected secure run, in process

@pytest.fixture(scope="module")
def secure_tiers(tmp_path_factory, mnist_root, one_torch_thread):
    """A SecAgg+ run over two edge aggregators (threads of this process, real sockets, plain TCP), two edge nodes
    under each; records every client's plaintext input, every array an aggregator can reach after each masked
    input it holds, and each round's unmasked outcome."""
    from fcl_emu.coordinator.lifecycle import Coordinator
    from fcl_emu.coordinator.secure_round import SecureRound
    from fcl_emu.edge_aggregator.relay import EdgeAggregator
    from fcl_emu.edge_node.node import EdgeNode
    from fcl_emu.runconfig import load_config
    from tests.test_secagg_wire import _arrays_reachable_from

    tmp_path = tmp_path_factory.mktemp("tiers")
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 40, "num_tasks": 2},
                                      rounds={"clients_per_round": 8, "rounds_per_task": 2, "eval_every": 10},
                                      training={"local_epochs": 1}, security={"transport": "plain"},
                                      secagg={"enabled": True, "neighbors": 5, "threshold": 3},
                                      topology={"edge_aggregators": 2}, nodes=4),
                         {"data_root": [str(mnist_root)]})
    coordinator = Coordinator(config)
    aggregators = [EdgeAggregator(f"edge-aggregator-{a}", coordinator.address, "tcp://127.0.0.1:0",
                                  heartbeat_interval_s=0.3) for a in range(2)]
    plaintext, seen, outcomes, plain_holds = {}, [], {}, []
    original_on_shares, original_hold_masked = SecAggClient.on_shares, HeldUpdates.hold_masked
    original_unmask = SecureRound.unmask

    def on_shares(self, msg, vector, weight, rng, model=None):
        plaintext[(self.params.round_id, self.client)] = (np.array(vector, copy=True), int(weight), self.params)
        return original_on_shares(self, msg, vector, weight, rng, model)

    def hold_masked(self, msg):
        original_hold_masked(self, msg)
        seen.extend(a for agg in aggregators for a in _arrays_reachable_from(agg))

    def unmask(self, wait):
        outcomes[self.server.params.round_id] = outcome = original_unmask(self, wait)
        return outcome

    nodes = [EdgeNode(aggregators[n % 2].address, list(range(n, 40, 4)), name=f"node-{n}", data_roots=[mnist_root],
                      state_dir=tmp_path / f"state-{n}", secure=True) for n in range(4)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SecAggClient, "on_shares", on_shares)
        patch.setattr(HeldUpdates, "hold_masked", hold_masked)
        patch.setattr(HeldUpdates, "hold", lambda self, msg: plain_holds.append(msg))
        patch.setattr(SecureRound, "unmask", unmask)
        try:
            summary = run_beside(coordinator, [*aggregators, *nodes], tmp_path / "run")
        finally:
            for agg in aggregators:
                agg.close()
    return types.SimpleNamespace(summary=summary, plaintext=plaintext, seen=seen, outcomes=outcomes,
                                 plain_holds=plain_holds, run_dir=tmp_path / "run")


@pytest.mark.slow
def test_secure_rounds_through_edge_aggregators_unmask_the_weighted_mean(secure_tiers):
    from fcl_emu.aggregation.update import DeltaLayout

    run = secure_tiers
    assert run.summary.status == "completed" and run.summary.secagg.completed == 4
    assert {"secagg_masked_held", "edge_aggregate", "edge_collect"} <= set(run.summary.bytes)
    assert not {"update", "update_held", "secagg_masked"} & set(run.summary.bytes)  # nothing unmasked, no y whole
    assert set(run.summary.tier_bytes) == {"edge_cloud", "client_edge"}
    assert len(run.outcomes) == 4
    for round_id, outcome in run.outcomes.items():
        inputs = [run.plaintext[(round_id, c)] for c in outcome.clients]
        assert len(inputs) == 8  # both aggregators' clients are in every sum
        weights = np.array([w for _, w, _ in inputs], np.float64)
        expected = sum(w * np.clip(x.astype(np.float64), -1, 1) for x, w, _ in inputs) / weights.sum()
        layout = DeltaLayout(*zip(*[(k[len(DELTA):], v.shape) for k, v in sorted(outcome.delta.items())]))
        assert np.abs(layout.flatten(outcome.delta) - expected).max() < 1e-4


@pytest.mark.slow
def test_no_edge_aggregator_ever_holds_an_individual_unmasked_input(secure_tiers):
    run = secure_tiers
    assert run.plain_holds == []  # no plain update reached an aggregator
    masked = [a for a in run.seen if a.dtype == np.uint32]
    assert masked, "no masked input among the arrays found: the inspection would prove nothing"
    for (_, client), (x, w, params) in run.plaintext.items():
        for a in run.seen:
            if a.dtype.kind == "f" and a.size >= x.size:
                assert not np.allclose(a.ravel()[:x.size], x, atol=1e-3), f"{client}'s delta is held at an edge"
            elif a.dtype == np.uint32 and a.size == x.size + 1 and w > 0:
                total, _ = Quantizer(params).decode(a, 1)
                assert np.abs(total / w - x).mean() > 0.1, f"{client}'s quantised input is held at an edge"


# --------------------------------------------------------------------------- fcl-emu up, with and without

def child_with(parent: int, words: str) -> int | None:
    """The pid of a child process of ``parent`` whose command line holds ``words``."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and words in cmdline:
            return int(entry)
    return None


def up_run(tmp_path, mnist_root, name: str, *flags: str, **overrides):
    overrides = {"rounds": {"clients_per_round": 8, "rounds_per_task": 2}, "training": {"local_epochs": 1},
                 **overrides}
    config = small_config(tmp_path / f"{name}.yaml", **overrides)
    run_dir = tmp_path / name
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir),
                   "--seed", "3", *flags)
    return proc, run_dir


@pytest.mark.slow
def test_up_with_edge_aggregators_and_edge_rounds(tmp_path, mnist_root):
    """`fcl-emu up` as users run it (its own keys, the aggregators' relay keys) with one and with two edge rounds a
    cloud round: the same clients contribute, the second edge round doubles what the clients' links carry but not
    what reaches the coordinator. (Accuracy against the star, and the update bytes' ratio: the bench test below.)"""
    from fcl_emu.monitoring.results import RunSummary

    summaries = {}
    for k in (1, 2):
        proc, run_dir = up_run(tmp_path, mnist_root, f"k{k}", "--edge-aggregators", "2", "--edge-rounds", str(k))
        assert proc.wait(timeout=300) == 0
        summaries[k] = RunSummary.load(run_dir / "summary.json")
        rounds = [e for e in events(run_dir) if e["event"] == "round"]
        assert [len(r["contributors"]) for r in rounds] == [8, 8, 8, 8]
    one, two = summaries[1], summaries[2]
    assert one.status == two.status == "completed" and not one.rejected_messages
    assert two.tier_bytes["client_edge"]["received"] == pytest.approx(2 * one.tier_bytes["client_edge"]["received"],
                                                                      rel=0.05)
    assert two.bytes["edge_aggregate"]["received"] == pytest.approx(one.bytes["edge_aggregate"]["received"], rel=0.05)
    assert two.emulated_s > one.emulated_s  # two trainings and uploads a client
    for summary in (one, two):  # the links as they saw them: the model down once per aggregator, to every client
        links = summary.link_bytes
        assert links.tiers == 2 and links.clients.down > 3 * links.coordinator.down
        assert links.coordinator.total < summary.bytes_total < links.clients.total  # no link carried bytes_total
    rounds = [e for e in events(tmp_path / "k1") if e["event"] == "round"]
    assert sum(r["client_edge_bytes"]["received"] for r in rounds) == one.tier_bytes["client_edge"]["received"]


@pytest.mark.slow
def test_a_killed_edge_aggregator_degrades_a_secure_run_and_never_hangs(tmp_path, mnist_root):
    from fcl_emu.monitoring.results import RunSummary

    proc, run_dir = up_run(tmp_path, mnist_root, "killed", "--edge-aggregators", "2", "--secagg",
                           rounds={"clients_per_round": 8, "rounds_per_task": 3})
    try:
        deadline = time.monotonic() + 240
        while not any(e["event"] == "round" for e in events(run_dir)) and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before its first round"
            time.sleep(0.2)
        pid = child_with(proc.pid, "--name edge-aggregator-1")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=240) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.rounds == 6
    assert summary.clients.dropped == 50  # the clients of nodes 1 and 3, cut off with their aggregator
    exits = [e for e in events(run_dir) if e["event"] == "node_exit"]
    assert [e["node"] for e in exits] == ["edge-aggregator-1"]
    assert summary.secagg.completed >= 4  # every round after the one cut short sums aggregator 0's clients


# --------------------------------------------------------------------------- the relay, on real sockets

def test_the_relay_forwards_holds_refuses_and_answers_a_collect():
    """A coordinator's ROUTER above, a node's shared connection below, the aggregator between (threads of this
    process, TCP): a heartbeat is relayed whole; a train request's model arrives at the node; an update is held and
    announced; a malformed one is reported up as the client's error; a message in another's envelope is refused;
    the collect is answered with the weighted mean."""
    import zmq

    from fcl_emu.edge_aggregator.relay import EdgeAggregator
    from fcl_emu.wire.framing import wire_tensors
    from fcl_emu.wire.messages import Heartbeat, SideChannel, TrainRequest
    from fcl_emu.wire.sockets import ServerEndpoint, SharedConnection

    ctx = zmq.Context()
    coordinator = ServerEndpoint(ctx, "tcp://127.0.0.1:0")
    aggregator = EdgeAggregator("edge-aggregator-0", coordinator.address, "tcp://127.0.0.1:0",
                                heartbeat_interval_s=0.2, context=ctx)
    stop = threading.Event()
    thread = threading.Thread(target=aggregator.run, args=(stop,), daemon=True)
    thread.start()
    node = SharedConnection(ctx, aggregator.address)
    a, b = node.channel("client-0001"), node.channel("client-0002")

    def up_next(want: str, timeout_s: float = 5.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if coordinator.sock.poll(100):
                got = coordinator.recv()
                if got is not None and got[1].type != "heartbeat" or want == "heartbeat":
                    return got
        raise AssertionError(f"no {want} reached the coordinator")

    try:
        assert up_next("heartbeat")[0] == "edge-aggregator-0"  # its own, first: the coordinator can route to it
        a.send("heartbeat", Heartbeat())
        b.send("heartbeat", Heartbeat())
        seen = set()
        while seen != {"client-0001", "client-0002"}:
            peer, msg = up_next("heartbeat")
            seen.add(peer)
        model = wire_tensors(MODEL)
        for client in ("client-0001", "client-0002"):
            coordinator.send(client, "train_request", TrainRequest(local_epochs=1, lr=0.1), round=1, tensors=model)
        got = []
        while len(got) < 2:
            if node.sock.poll(5000):
                received = node.recv()
                if received is not None:
                    got.append(received)
        assert {peer for peer, _ in got} == {"client-0001", "client-0002"}
        assert np.array_equal(got[0][1].tensors["w"], MODEL["w"])
        a.send("prototype_gradients", SideChannel(items=1), round=1, tensors={"0/g": np.ones(3, np.float32)})
        peer, msg = up_next("prototype_gradients")  # a side channel goes straight to the coordinator, whole
        assert (peer, msg.type) == ("client-0001", "prototype_gradients") and msg.tensors["0/g"].sum() == 3
        for channel, samples, scale in ((a, 10, 1.0), (b, 30, 3.0)):
            channel.send("update", Update(num_samples=samples, train_time_s=1.0, loss=scale), round=1,
                         tensors={DELTA + k: np.full(v.shape, scale, np.float32) for k, v in MODEL.items()})
        notices = {}
        while len(notices) < 2:
            peer, msg = up_next("update_held")
            assert msg.type == "update_held" and msg.tensors == {}
            notices[peer] = msg.body
        assert notices["client-0002"].num_samples == 30 and notices["client-0002"].aggregator == "edge-aggregator-0"
        b.send("update", Update(num_samples=5, train_time_s=1.0, loss=0.0), round=1,
               tensors={DELTA + "w": np.zeros((3, 2), np.float32), DELTA + "b": np.zeros(3, np.float32)})
        peer, msg = up_next("error")
        assert (peer, msg.type, msg.body.code) == ("client-0002", "error", "bad_shape")  # reported as its error
        node.sock.send_multipart([b"client-0001", encode("heartbeat", Heartbeat(), sender="client-0002", seq=9)[0]])
        assert not coordinator.sock.poll(500) or up_next("heartbeat")[0] != "client-0002"
        coordinator.send("edge-aggregator-0", "edge_collect", EdgeCollect(clients=["client-0001", "client-0002"],
                                                                          prefixes=[DELTA]), round=1)
        peer, msg = up_next("edge_aggregate")
        assert (peer, msg.type, msg.body.num_samples) == ("edge-aggregator-0", "edge_aggregate", 40)
        assert np.allclose(msg.tensors["delta/b"], (10 * 1.0 + 30 * 3.0) / 40)
        assert msg.body.tier_bytes["received"] > 0 and msg.body.tier_bytes["sent"] > 0
        assert aggregator.refused == 2
    finally:
        stop.set()
        thread.join(timeout=5)
        aggregator.close()
        node.close(linger_ms=0)
        coordinator.close()
        ctx.term()


@pytest.mark.slow
def test_bench_hierarchy_on_a_tiny_point_fills_every_column(tmp_path, mnist_root):
    from rich.console import Console

    from fcl_emu.bench import hierarchy

    result = hierarchy.run([40], [2], [1], cohort=8, rounds=2, seed=0, link={"uplink_mbps": 10.0, "latency_ms": 5.0},
                           json_path=tmp_path / "h.json", plot_path=tmp_path / "h.png", data_root=[mnist_root],
                           console=Console(width=250))
    star, tiers = result["rows"]
    assert (star["edge aggregators"], tiers["edge aggregators"]) == (0, 2)
    assert tiers["update ratio"] < 0.3 and tiers["work_cpu_per_round_s"] > 0 and tiers["down_mb_per_round"] > 0
    assert tiers["accuracy"] == pytest.approx(star["accuracy"], abs=0.5)
    assert tiers["emulated_s"] > star["emulated_s"]  # the aggregates' way up at 10 Mb/s and the latency
    assert (tmp_path / "h.png").stat().st_size > 0 and json.loads((tmp_path / "h.json").read_text())["rows"]


def test_the_coordinator_takes_only_the_aggregates_it_asked_for_and_believes_no_inflated_weight():
    from fcl_emu.coordinator.edge_tier import EdgeTier
    from fcl_emu.coordinator.open_round import OpenRound
    from fcl_emu.wire.messages import EdgeAggregate
    from tests.test_coordinator_parts import make_state

    state = make_state()
    asked = []
    tier = EdgeTier(state, 3, liveness_timeout_s=10.0,
                    send=lambda name, msg_type, body, **kw: asked.append((name, body.clients)) or 64)
    r = OpenRound(task=0, number=4, chosen=["a", "b", "c", "d"], selected={"a", "b", "c", "d"}, wanted=4)
    r.counted = [ClientUpdate(c, 10, {}, square_sums={"delta/w": 3.0}) for c in "abcd"]  # as their notices said
    r.held_at = {"a": "edge-aggregator-0", "b": "edge-aggregator-0", "c": "edge-aggregator-1",
                 "d": "edge-aggregator-2"}

    def aggregate(clients, samples, peer):
        frames = encode("edge_aggregate", EdgeAggregate(clients=clients, num_samples=samples, loss=0.1), sender=peer,
                        seq=1, round=4, tensors={"delta/w": np.full(3, samples / 1000, np.float32)})  # each its own
        return decode([bytes(memoryview(f)) for f in frames])

    def serve(until, deadline):
        tier.on_message("edge-aggregator-0", aggregate(["a", "b"], 20, "edge-aggregator-0"))
        with pytest.raises(WireError, match="announced") as refused:  # more than c announced
            tier.on_message("edge-aggregator-1", aggregate(["c"], 500, "edge-aggregator-1"))
        tier.refused("edge-aggregator-1", 4, refused.value.reason)  # as the dispatcher does: its share fails
        with pytest.raises(WireError, match="not asked for"):
            tier.on_message("edge-aggregator-0", aggregate(["a", "b"], 20, "edge-aggregator-0"))  # a second one
        with pytest.raises(WireError, match="not asked for"):
            tier.on_message("edge-aggregator-1", aggregate(["d"], 10, "edge-aggregator-1"))
        assert not until()  # edge-aggregator-2 has not answered, and spoke recently
        tier.seen["edge-aggregator-2"] = time.monotonic() - 60  # silent for the liveness timeout: not awaited
        assert until()

    tier.seen["edge-aggregator-2"] = time.monotonic()
    groups = tier.gather(r, serve)
    assert sorted(asked) == [("edge-aggregator-0", ["a", "b"]), ("edge-aggregator-1", ["c"]),
                             ("edge-aggregator-2", ["d"])]
    assert groups.clients == {"edge-aggregator-0": ["a", "b"]} and [u.num_samples for u in groups.updates] == [20]
    assert tier.round_aggregates["edge-aggregator-1"] == {"asked": 1, "taken": 0, "outcome": "implausible"}
