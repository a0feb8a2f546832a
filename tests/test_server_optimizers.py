"""Server optimisers (``--server-optimizer``, aggregation/server_optimizers/): each step by hand over two rounds,
``none`` leaving the aggregate as it is, the options and combinations refused in one line, the state through a
checkpoint, and every rule with every optimiser through a real (fake-client) synchronous round."""

from __future__ import annotations

import numpy as np
import pytest

from fcl_emu.aggregation.combine import fedavg
from fcl_emu.aggregation.policies.sync import Sync
from fcl_emu.aggregation.rules import RULE_NAMES, RULES
from fcl_emu.aggregation.server_optimizers import OPTIMIZER_NAMES
from fcl_emu.aggregation.settings import AggregationSettings
from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.runconfig import RunConfig
from tests.test_coordinator_parts import FakeServer, join_all, make_state, runner

X0 = {"w": np.array([1.0, 2.0])}
DELTAS = (np.array([1.0, -1.0]), np.array([3.0, 1.0]))  # the two rounds' pseudo-gradients


def two_steps(name: str, **options) -> list[np.ndarray]:
    """The global model after each of two rounds whose aggregates move it by DELTAS."""
    optimizer = AggregationSettings(server_optimizer={"name": name, **options}).server_step()
    x, out = X0, []
    for delta in DELTAS:
        x = optimizer.step(x, {"w": x["w"] + delta}, frozenset({"w"}))
        out.append(x["w"])
    return out


def test_fedadam_by_hand():
    # eta 0.1, beta1 = beta2 = 0.5, tau 1 (v starts at tau^2 = 1):
    # round 1, Delta [1, -1]: m = 0.5 Delta = [0.5, -0.5]; v = 0.5 * 1 + 0.5 * 1 = [1, 1];
    #   step = 0.1 m / (sqrt v + 1) = [0.025, -0.025]: x = [1.025, 1.975]
    # round 2, Delta [3, 1]: m = 0.5 [0.5, -0.5] + 0.5 [3, 1] = [1.75, 0.25]; v = 0.5 + 0.5 [9, 1] = [5, 1];
    #   step = [0.175 / (sqrt 5 + 1), 0.025 / 2] = [0.0540780, 0.0125]: x = [1.0790780, 1.9875]
    first, second = two_steps("fedadam", lr=0.1, beta1=0.5, beta2=0.5, tau=1.0)
    np.testing.assert_allclose(first, [1.025, 1.975])
    np.testing.assert_allclose(second, [1.025 + 0.175 / (5 ** 0.5 + 1), 1.9875])
    np.testing.assert_allclose(second, [1.0790780, 1.9875], atol=1e-7)


def test_fedyogi_by_hand():
    # as FedAdam's, but v_t = v - (1 - beta2) Delta^2 sign(v - Delta^2):
    # round 1: Delta^2 = [1, 1] = v: sign 0, v stays [1, 1]; step [0.025, -0.025] (as FedAdam's)
    # round 2: Delta^2 = [9, 1]: v = [1 + 0.5 * 9, 1] = [5.5, 1]; step = [0.175 / (sqrt 5.5 + 1), 0.0125]
    first, second = two_steps("fedyogi", lr=0.1, beta1=0.5, beta2=0.5, tau=1.0)
    np.testing.assert_allclose(first, [1.025, 1.975])
    np.testing.assert_allclose(second, [1.025 + 0.0523136, 1.9875], atol=1e-7)


def test_fedadagrad_by_hand():
    # v_t = v + Delta^2 (no beta2), v starts at 1:
    # round 1: v = [2, 2]; step = 0.1 * [0.5, -0.5] / (sqrt 2 + 1) = [0.0207107, -0.0207107]
    # round 2: v = [11, 3]; m = [1.75, 0.25]; step = [0.175 / (sqrt 11 + 1), 0.025 / (sqrt 3 + 1)]
    #   = [0.0405409, 0.0091506]
    first, second = two_steps("fedadagrad", lr=0.1, beta1=0.5, tau=1.0)
    np.testing.assert_allclose(first, [1.0207107, 1.9792893], atol=1e-7)
    np.testing.assert_allclose(second, [1.0207107 + 0.0405409, 1.9792893 + 0.0091506], atol=1e-7)


def test_fedavgm_by_hand():
    # v_t = beta v + Delta, x += eta v; eta = beta = 0.5:
    # round 1: v = [1, -1], step [0.5, -0.5]: x = [1.5, 1.5]
    # round 2: v = 0.5 [1, -1] + [3, 1] = [3.5, 0.5], step [1.75, 0.25]: x = [3.25, 1.75]
    first, second = two_steps("fedavgm", lr=0.5, momentum=0.5)
    np.testing.assert_allclose(first, [1.5, 1.5])
    np.testing.assert_allclose(second, [3.25, 1.75])


def test_the_defaults_are_the_papers():
    adam = AggregationSettings(server_optimizer="fedadam").server_step().options
    assert (adam.lr, adam.beta1, adam.beta2, adam.tau) == (0.01, 0.9, 0.99, 1e-3)
    m = AggregationSettings(server_optimizer="fedavgm").server_step().options
    assert (m.lr, m.momentum) == (0.1, 0.9)


class SteppedServer:
    """What Sync.apply uses of a method's server part: its aggregate (here: w += the mean delta, the BatchNorm
    statistic and the counter set to the aggregate's), its parameters and the global model's setter."""

    def __init__(self):
        self.global_state = {"w": np.array([1.0, 2.0], np.float32), "bn.running_mean": np.zeros(2, np.float32),
                             "bn.num_batches_tracked": np.array(3, np.int64)}

    def aggregate(self, task, number, updates):
        delta = fedavg(updates)
        self.global_state = {"w": self.global_state["w"] + delta["w"],
                             "bn.running_mean": self.global_state["bn.running_mean"] + delta["bn.running_mean"],
                             "bn.num_batches_tracked": delta["bn.num_batches_tracked"]}

    def parameter_names(self):
        return frozenset({"w"})

    def set_global_state(self, arrays):
        self.global_state = dict(arrays)


ADAM = {"name": "fedadam", "lr": 0.1, "beta1": 0.5, "beta2": 0.5, "tau": 1.0}


def round_updates():
    return [ClientUpdate(c, 10, {DELTA + "w": np.array([1.0, -1.0], np.float32),
                                 DELTA + "bn.running_mean": np.array([0.5, 0.5], np.float32),
                                 DELTA + "bn.num_batches_tracked": np.array(7, np.int64)}) for c in ("a", "b")]


def test_none_leaves_the_aggregate_as_it_is():
    server = SteppedServer()
    policy = Sync.of(AggregationSettings())
    assert policy.optimizer.name == "none"
    server.aggregate(0, 1, round_updates())
    expected = server.global_state
    server = SteppedServer()
    policy.apply(server, 0, 1, round_updates())
    assert all(server.global_state[k] is expected[k] or np.array_equal(server.global_state[k], expected[k])
               for k in expected)
    assert policy.state_arrays() == {}


def test_an_optimiser_steps_the_parameters_only_and_keeps_their_dtype():
    server = SteppedServer()
    policy = Sync.of(AggregationSettings(server_optimizer=ADAM))
    policy.apply(server, 0, 1, round_updates())
    np.testing.assert_allclose(server.global_state["w"], [1.025, 1.975], rtol=1e-6)  # FedAdam's first step
    assert server.global_state["w"].dtype == np.float32
    np.testing.assert_array_equal(server.global_state["bn.running_mean"], [0.5, 0.5])  # the aggregate's
    assert server.global_state["bn.num_batches_tracked"] == 7


def test_the_moments_survive_a_checkpoint_and_a_grown_head_restarts_its_own():
    settings = AggregationSettings(server_optimizer=ADAM)
    policy = Sync.of(settings)
    server = SteppedServer()
    policy.apply(server, 0, 1, round_updates())
    saved = policy.state_arrays()
    assert sorted(saved) == ["m/w", "v/w"]
    restored = Sync.of(settings)
    restored.load_state_arrays(saved)
    again, twin = SteppedServer(), SteppedServer()
    policy.apply(again, 0, 2, round_updates())
    restored.apply(twin, 0, 2, round_updates())
    np.testing.assert_array_equal(again.global_state["w"], twin.global_state["w"])
    with pytest.raises(ValueError, match="has no state 'z'"):
        restored.load_state_arrays({"z/w": np.zeros(2)})
    # the head grew (w has 3 entries now): its moments start afresh, so the step is a first step again
    grown = policy.optimizer.step({"w": np.zeros(3)}, {"w": np.array([1.0, -1.0, 1.0])}, frozenset({"w"}))
    np.testing.assert_allclose(grown["w"], [0.025, -0.025, 0.025])


@pytest.mark.parametrize("flags, message", [
    (["--server-optimizer", "fedadam", "--server-momentum", "0.9"],
     "--server-optimizer: server optimiser fedadam takes no option momentum (fedavgm takes it; fedadam takes lr, "
     "beta1, tau and beta2)"),
    (["--server-optimizer", "fedavgm", "--server-tau", "0.1"], "server optimiser fedavgm takes no option tau"),
    (["--server-optimizer", "fedadagrad", "--server-beta2", "0.9"], "server optimiser fedadagrad takes no option "
                                                                     "beta2 (fedadam and fedyogi take it"),
    (["--server-lr", "0.1"], "server optimiser none takes no option lr (fedavgm, fedadam, fedyogi and fedadagrad "
                             "take it; none takes none)"),
    (["--server-optimizer", "fedyogi", "--server-beta2", "1"], "--server-beta2: must be less than 1 (got 1.0)"),
    (["--server-optimizer", "fedadam", "--server-lr", "-1"], "--server-lr: must be more than 0 (got -1.0)"),
    (["--server-optimizer", "adam"], "--server-optimizer: unknown server optimiser 'adam'; choose one of none, "
                                     "fedavgm, fedadam, fedyogi, fedadagrad; did you mean fedadam?"),
])
def test_bad_options_are_refused_in_one_line(flags, message):
    from tests.test_config_cli import invoke

    code, output = invoke("up", *flags)
    assert code == 2 and message in output, output


@pytest.mark.parametrize("aggregation, method, message", [
    ({"policy": "fedasync", "server_optimizer": "fedadam"}, "fedavg",
     "--server-optimizer fedadam steps along what an aggregation moved the model: --aggregation fedasync mixes"),
    ({"server_optimizer": "fedyogi"}, "fedcbc", "method 'fedcbc' shares no global model"),
    ({"server_optimizer": "fedavgm"}, "glfc", "method 'glfc' scores each round's aggregate with its proxy"),
])
def test_a_server_optimiser_is_refused_where_it_has_nothing_to_step(aggregation, method, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate({"method": method, "aggregation": aggregation, "rounds": {"clock": "emulated"}})


# ------------------------------------------------------------------ every rule and optimiser through a round
class AggregatingServer(FakeServer):
    """The fake server part, aggregating as the default ServerPart does: w += the run's rule's delta."""

    def __init__(self, aggregator):
        super().__init__()
        self.aggregator = aggregator
        self.global_state = {"w": np.array([1.0, 2.0, 3.0], np.float32)}

    def aggregate(self, task, number, updates):
        super().aggregate(task, number, updates)
        self.global_state = {"w": self.global_state["w"] + fedavg(updates, self.aggregator)["w"]}

    def parameter_names(self):
        return frozenset({"w"})

    def set_global_state(self, arrays):
        self.global_state = dict(arrays)


def rule_with_no_byzantine(rule: str) -> dict:
    """Rule ``rule``, withstanding no hostile update where it takes ``byzantine`` (3 clients a round)."""
    return {"name": rule, **({"byzantine": 0} if "byzantine" in RULES[rule].Options.model_fields else {})}


@pytest.mark.parametrize("optimizer", OPTIMIZER_NAMES)
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_every_rule_and_server_optimiser_runs_a_round(rule, optimizer):
    state = make_state(clock="emulated")
    config = state.config.model_copy(update={
        "aggregation": AggregationSettings(server_optimizer=optimizer, rule=rule_with_no_byzantine(rule))})
    state.config, state.policy = config, config.aggregation.round_policy()
    state.server = AggregatingServer(config.aggregation.aggregator())
    join_all(state)
    run, _ = runner(state)
    before = dict(state.server.global_state)
    record = run.run_round(0, 0)
    assert not record.skipped
    (_, _, updates), = state.server.aggregated
    aggregate = {"w": before["w"] + fedavg(updates, config.aggregation.aggregator())["w"]}
    expected = config.aggregation.server_step().step(before, aggregate, frozenset({"w"}))
    np.testing.assert_array_equal(state.server.global_state["w"], expected["w"])
    assert not np.array_equal(state.server.global_state["w"], before["w"])


# ------------------------------------------------------------------ real runs: plain, SecAgg+, edge aggregators
@pytest.mark.slow
@pytest.mark.parametrize("tier", ["plain", "secagg", "edge"])
def test_fedadam_steps_each_rounds_aggregate_in_a_real_run(tier, tmp_path, mnist_root, one_torch_thread):
    """Two rounds of 6 clients with --server-optimizer fedadam, coordinator, edge nodes (and edge aggregators) in
    this process: every round's new global model is FedAdam's step from the model before the round along what the
    round aggregated (replayed here), and each float parameter of the first round moved by at most eta."""
    from fcl_emu.coordinator.lifecycle import Coordinator
    from fcl_emu.edge_aggregator.relay import EdgeAggregator
    from fcl_emu.edge_node.node import EdgeNode
    from fcl_emu.methods.base import ServerPart
    from fcl_emu.runconfig import load_config
    from tests.conftest import events, run_beside, small_config

    extra = {"secagg": {"secagg": {"enabled": True, "neighbors": 5, "threshold": 3}},
             "edge": {"topology": {"edge_aggregators": 2}}}.get(tier, {})
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 12, "num_tasks": 1,
                                                                      "samples_per_client_task": 100},
                                      rounds={"clients_per_round": 6, "rounds_per_task": 2, "eval_every": 10},
                                      training={"local_epochs": 1}, security={"transport": "plain"},
                                      aggregation={"server_optimizer": "fedadam"}, **extra),
                         {"data_root": [str(mnist_root)]})
    coordinator = Coordinator(config)
    aggregators = [EdgeAggregator(f"edge-aggregator-{a}", coordinator.address, "tcp://127.0.0.1:0",
                                  heartbeat_interval_s=0.3) for a in range(2)] if tier == "edge" else []
    above = [a.address for a in aggregators] or [coordinator.address] * 2
    nodes = [EdgeNode(above[i], list(ix), name=f"node-{i}", data_roots=[mnist_root], state_dir=tmp_path / f"s{i}",
                      secure=tier == "secagg") for i, ix in enumerate((range(0, 12, 2), range(1, 12, 2)))]
    steps: list[tuple[dict, dict, dict, frozenset]] = []  # before, the aggregate, after, the parameters
    apply, set_global_state = Sync.apply, ServerPart.set_global_state

    def recorded_apply(self, server, task, number, updates):
        steps.append((dict(server.global_state),))
        apply(self, server, task, number, updates)

    def recorded_set(self, arrays):
        steps[-1] += (dict(self.global_state), dict(arrays), self.parameter_names())
        set_global_state(self, arrays)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Sync, "apply", recorded_apply)
        patch.setattr(ServerPart, "set_global_state", recorded_set)
        try:
            summary = run_beside(coordinator, [*aggregators, *nodes], tmp_path / "run")
        finally:
            for agg in aggregators:
                agg.close()
    assert summary.status == "completed"
    rounds = [e for e in events(tmp_path / "run") if e["event"] == "round"]
    assert [r["skipped"] for r in rounds] == [False, False]
    if tier == "secagg":
        assert [r["secagg"]["outcome"] for r in rounds] == ["completed"] * 2
    if tier == "edge":
        assert all(r["edge_aggregates"] for r in rounds)
    replay = AggregationSettings(server_optimizer="fedadam").server_step()
    assert len(steps) == 2
    for i, (before, aggregate, after, parameters) in enumerate(steps):
        expected = replay.step(before, aggregate, parameters)
        assert parameters and set(after) == set(before)
        for name in after:
            np.testing.assert_array_equal(after[name], expected[name])
        moved = max(float(np.abs(after[n] - before[n]).max()) for n in parameters)
        if i == 0:  # a first step moves a coordinate by eta (1 - beta1) |D| / (sqrt(1 - beta2) |D| + ...) < eta
            assert 0.5 * replay.options.lr < moved <= replay.options.lr


class CheckpointedServer(AggregatingServer):
    def state_arrays(self):
        return dict(self.global_state)

    def state_meta(self):
        return {}

    def load_state_arrays(self, arrays):
        self.global_state = dict(arrays)

    def load_state_meta(self, meta):
        pass


def test_the_optimisers_moments_go_through_the_coordinators_checkpoint(tmp_path):
    from fcl_emu.coordinator import checkpoint
    from fcl_emu.coordinator.clock import make_clock
    from fcl_emu.coordinator.resume import CHECKPOINT_DIR, Checkpointer

    def fedadam_state():
        state = make_state()
        state.config = state.config.model_copy(update={"aggregation": AggregationSettings(server_optimizer="fedadam")})
        state.server = CheckpointedServer(state.config.aggregation.aggregator())
        state.policy = state.config.aggregation.round_policy()
        return state

    saved = fedadam_state()
    join_all(saved)
    run, _ = runner(saved)
    run.run_round(0, 0)
    moments = saved.policy.state_arrays()
    assert sorted(moments) == ["m/w", "v/w"]
    Checkpointer(saved, make_clock(saved, liveness_timeout_s=10.0), "tcp://127.0.0.1:1").save(
        tmp_path, 0, 1, [], [], 0.0)
    ckpt = checkpoint.load(tmp_path / CHECKPOINT_DIR)
    assert sorted(k for k in ckpt.arrays if k.startswith("policy/")) == ["policy/m/w", "policy/v/w"]
    restored = fedadam_state()
    Checkpointer(restored, make_clock(restored, liveness_timeout_s=10.0), "tcp://127.0.0.1:1").restore(ckpt)
    for name, value in moments.items():
        np.testing.assert_array_equal(restored.policy.state_arrays()[name], value)
