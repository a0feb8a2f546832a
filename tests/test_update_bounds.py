"""Every path that sums updates is bounded as the plain round is (aggregation/defences.py): each edge round of
``--edge-rounds K``, the asynchronous policies' buffers, and FedCBC's VAEs per class. Unit tests against values
worked out by hand, the relay's edge rounds on real sockets with a hostile client, and the buffer of a real
asynchronous round runner."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fcl_emu.aggregation.defences import Defences, bound
from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.edge_aggregator.edge_rounds import EdgeRounds, Work
from fcl_emu.wire.messages import TrainRequest, Update

DEFAULTS = Defences(direction_check=10.0, adaptive_clip=10.0)  # a run's, unless it sets them
HONEST = {"a": [1.0, 1.0, 0.0, 0.0], "b": [1.0, 0.8, 0.1, 0.0], "c": [0.9, 1.0, 0.0, 0.1]}


def update(client: str, values, samples: int = 10) -> ClientUpdate:
    return ClientUpdate(client, samples, {DELTA + "w": np.asarray(values, np.float32)})


def test_bound_refuses_and_clips_as_the_plain_round_does():
    """Over 4 weights (the direction check's threshold is then its most, 0.05): a delta above --max-update-norm
    is refused as norm_bound, a reversed one as off_cohort; one of norm 6 x sqrt(2) is clipped to --clip-norm 5,
    then to 2 x the median norm of the 4 kept (--adaptive-clip 2): (1.3491 + 1.4142) / 2 x 2 = 2.7633."""
    group = [*(update(c, v) for c, v in HONEST.items()), update("big", [6.0, 6.0, 0.0, 0.0]),
             update("reversed", [-9.0, -9.0, 0.0, 0.0]), update("huge", [30.0, 30.0, 0.0, 0.0])]
    kept, refused = bound(group, Defences(max_update_norm=40.0, direction_check=10.0, clip_norm=5.0,
                                          adaptive_clip=2.0), cohort="the test's group")
    assert {c: reason for c, (reason, _) in refused.items()} == {"huge": "norm_bound", "reversed": "off_cohort"}
    assert "agrees with nothing of the test's group" in refused["reversed"][1]
    assert [u.client for u in kept] == ["a", "b", "c", "big"]
    np.testing.assert_allclose(kept[3].tensors[DELTA + "w"], np.array([1, 1, 0, 0]) * 2.7633 / np.sqrt(2), rtol=1e-4)
    for u, values in zip(kept, HONEST.values()):  # within the bounds: left exactly as they were
        assert np.array_equal(u.tensors[DELTA + "w"], np.asarray(values, np.float32))
    assert bound(group, Defences()) == (group, {})  # every defence off: nothing refused or changed


def edge_round(defences: Defences, poison) -> tuple:
    """The first of 2 edge rounds of clients a, b, c (10 samples each) and an insider sending ``poison``, from a
    zero cloud model: the next edge round's request."""
    rounds, cloud = EdgeRounds(2, 60.0, defences), {"w": np.zeros(4, np.float32)}
    for client in (*HONEST, "insider"):
        rounds.requested(3, 0, client, TrainRequest(local_epochs=1, lr=0.1), cloud)
    answers = [update(c, v) for c, v in HONEST.items()] + [update("insider", poison)]
    results = [rounds.answered(3, u, Work(1.0, 1.0, 100)) for u in answers]
    assert all(last is False for last, _ in results)
    return results[-1][1]


def test_each_edge_round_is_bounded_before_it_moves_the_edge_model():
    """A reversed update (x -9) in the first edge round is refused there, under the run's default defences: the
    edge model gains the honest mean only (0.9667, 0.9333, 0.0333, 0.0333), and the insider is not asked again;
    one of norm 10^4 in the same direction as the honest ones is scaled to 10 x their median norm. Without the
    defences (as before) the reversed update moves the edge model against them."""
    honest_mean = np.mean(list(HONEST.values()), axis=0)
    again = edge_round(DEFAULTS, [-9.0, -9.0, 0.0, 0.0])
    assert again.clients == ["a", "b", "c"] and again.refused["insider"][0] == "off_cohort"
    np.testing.assert_allclose(again.model["w"], honest_mean, rtol=1e-6)
    long = edge_round(DEFAULTS, [7071.07, 7071.07, 0.0, 0.0])
    assert long.clients == ["a", "b", "c", "insider"] and not long.refused
    median = np.median([np.linalg.norm(v) for v in [*HONEST.values(), [7071.07, 7071.07, 0, 0]]])
    clipped = np.array([1.0, 1.0, 0.0, 0.0]) * 10 * median / np.sqrt(2)
    np.testing.assert_allclose(long.model["w"], (3 * honest_mean + clipped) / 4, rtol=1e-4)
    unchecked = edge_round(Defences(), [-9.0, -9.0, 0.0, 0.0])
    assert unchecked.model["w"][0] < 0 and not unchecked.refused  # the attack, without the defences


def test_an_aggregators_flags_carry_the_runs_defences():
    """``up`` passes the run's defences to each aggregator (its edge rounds need them before any collect); an
    aggregator started by hand has the run's defaults; ``off`` goes through its flags and back."""
    from fcl_emu.edge_aggregator.args import AggregatorArgs
    from fcl_emu.launchers.aggregators import aggregator_args
    from fcl_emu.runconfig import RunConfig

    config = RunConfig.model_validate({"security": {"transport": "plain"},
                                       "aggregation": {"max_update_norm": 5.0, "adaptive_clip": "off"}})
    args = aggregator_args(0, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", config)
    assert Defences.of(AggregatorArgs.from_argv(args.to_argv())) == Defences(5.0, 10.0, None, None)
    by_hand = AggregatorArgs.from_argv(["--connect", "tcp://h:1", "--bind", "tcp://h:2", "--name", "e", "--insecure"])
    assert Defences.of(by_hand) == DEFAULTS


# ------------------------------------------------------------------ the relay's edge rounds, on real sockets

def test_the_relay_refuses_a_hostile_update_of_an_edge_round_and_reports_it_up():
    """A coordinator's ROUTER above, a node's shared connection below, a real aggregator with 2 edge rounds
    between (threads of this process, TCP): an insider's reversed update in the first edge round is refused there
    and goes up as its error of the round (the coordinator stops waiting for it); the honest clients are sent
    the edge model, which moved by their mean only."""
    from fcl_emu.wire.framing import wire_tensors
    from fcl_emu.wire.messages import Heartbeat
    from tests.relay_tier import Tier

    tier = Tier(edge_rounds=2, defences=DEFAULTS)
    coordinator, aggregator, node = tier.coordinator, tier.aggregator, tier.node
    names = {"a": "client-0001", "b": "client-0002", "c": "client-0003", "insider": "client-0009"}
    channels = {c: node.channel(name) for c, name in names.items()}

    def up_next(want: str):
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if coordinator.sock.poll(100) and (got := coordinator.recv()) is not None and got[1].type == want:
                return got
        raise AssertionError(f"no {want} reached the coordinator")

    def requests(count: int) -> dict:
        got = {}
        while len(got) < count and node.sock.poll(5000):
            if (received := node.recv()) is not None:
                got[received[0]] = received[1]
        return got

    try:
        for channel in channels.values():
            channel.send("heartbeat", Heartbeat())
        seen = set()
        while not set(names.values()) <= seen:
            seen.add(up_next("heartbeat")[0])
        cloud = {"w": np.zeros(4, np.float32)}
        for name in names.values():
            coordinator.send(name, "train_request", TrainRequest(local_epochs=1, lr=0.1), round=1,
                             tensors=wire_tensors(cloud))
        assert len(requests(4)) == 4
        for c, channel in channels.items():
            values = HONEST.get(c, [-9.0, -9.0, 0.0, 0.0])
            channel.send("update", Update(num_samples=10, train_time_s=1.0, loss=0.5), round=1,
                         tensors={DELTA + "w": np.asarray(values, np.float32)})
        peer, msg = up_next("error")
        assert (peer, msg.body.code) == ("client-0009", "off_cohort") and aggregator.refused == 1
        again = requests(3)
        assert sorted(again) == ["client-0001", "client-0002", "client-0003"]
        for msg in again.values():
            np.testing.assert_allclose(msg.tensors["w"], np.mean(list(HONEST.values()), axis=0), rtol=1e-6)
    finally:
        tier.close()


# ------------------------------------------------------------------ FedBuff's and FedAsync's buffers

def test_an_asynchronous_buffer_is_bounded_with_the_updates_applied_before_it():
    """FedAsync's buffer of one update: checked against the last updates applied in the task. A reversed one is
    refused as off_cohort (counted), one of 100 x their norm scaled to 10 x their median norm; the first two
    updates of a task (a cohort of fewer than 3) are not checked for direction."""
    from fcl_emu.aggregation.policies import make_policy
    from fcl_emu.aggregation.settings import AggregationSettings
    from fcl_emu.coordinator.async_rounds import AsyncRoundRunner, InFlight
    from tests.test_coordinator_parts import make_state

    state = make_state()
    runner = AsyncRoundRunner(state, None, None, None, make_policy(AggregationSettings(policy="fedasync")))

    def buffered(client, values):
        return runner._bounded([InFlight(client, 0, 1, 1.0, update(client, values), 100)])

    assert [f.client for f in buffered("first", [-1.0, 0.0, 0.0, 0.0])] == ["first"]  # nothing to compare with
    runner.window = []
    for c, values in HONEST.items():
        assert buffered(c, values)[0].update.tensors[DELTA + "w"].tolist() == pytest.approx(values)
    assert buffered("reversed", [-9.0, -9.0, 0.0, 0.0]) == []
    assert state.tally.rejected["off_cohort"] == 1
    (long,) = buffered("long", [141.42, 141.42, 0.0, 0.0])
    median = np.median([np.linalg.norm(v) for v in [*HONEST.values(), [141.42, 141.42, 0, 0]]])
    assert np.linalg.norm(long.update.tensors[DELTA + "w"]) == pytest.approx(10 * median, rel=1e-4)
    assert [u.client for u in runner.window] == ["a", "b", "c", "long"]  # as they arrived, the last WINDOW


# ------------------------------------------------------------------ FedCBC's VAEs, per class

def test_a_scaled_vae_within_the_norm_bound_is_refused_by_its_classs_bound():
    """A VAE of class 0 scaled by 9 lies within 10 x the median norm of the round's and the global VAEs of every
    class, but beyond 3 x its own class's median: refused (counted) by the bound per class, and only with it; in a
    class's first round too, where the honest VAEs are fresh ones of different initialisations."""
    from fcl_emu.methods.fedcbc import VAES, build_vae, join_vaes
    from tests.test_fedcbc import TINY, _arrays, _server

    rng = np.random.default_rng(0)
    refused: list[str] = []
    server = _server(TINY, cohort_bound=10.0, refused=refused.append)
    global_vae = _arrays(build_vae(server.options, server.feature_dim, seed=1))
    server._vaes[0] = global_vae
    norm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in global_vae.values()))

    spread = 0.01 * norm / np.sqrt(sum(a.size for a in global_vae.values()))  # per weight: 0.01 norms in all

    def honest(i):
        return ClientUpdate(f"client-{i}", 10, join_vaes({0: {
            k: (v + spread * rng.standard_normal(v.shape)).astype(np.float32) for k, v in global_vae.items()}}, VAES))

    updates = [honest(i) for i in range(3)] + [
        ClientUpdate("client-9", 10, join_vaes({0: {k: 9 * v for k, v in global_vae.items()}}, VAES))]
    kept = server._within_cohort(updates, 0)
    assert len(kept) == 3 and len(refused) == 1
    assert refused[0].startswith("client-9's VAE of class 0 of L2 norm") and "VAEs of that class" in refused[0]

    first = _server(TINY, cohort_bound=10.0, refused=refused.append)  # no global VAE of class 0 yet
    fresh = [_arrays(build_vae(first.options, first.feature_dim, seed=s)) for s in range(2, 6)]
    first_round = [ClientUpdate(f"client-{i}", 10, join_vaes({0: vae}, VAES)) for i, vae in enumerate(fresh[:3])] + [
        ClientUpdate("client-9", 10, join_vaes({0: {k: 9 * v for k, v in fresh[3].items()}}, VAES))]
    assert len(first._within_cohort(first_round, 0)) == 3 and refused[-1].startswith("client-9's VAE of class 0")
    unbounded = _server(TINY)
    unbounded._vaes[0] = global_vae
    assert len(unbounded._within_cohort(updates, 0)) == 4  # without the bound, taken
