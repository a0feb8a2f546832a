"""The coordinator's parts alone, with fake collaborators: no sockets, no processes, no data set.

The round runner is driven by a fake dispatcher whose ``serve`` plays the selected clients' answers; the
dispatcher is fed decoded wire messages by a fake endpoint and answers into it."""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.coordinator.clients import ClientRegistry
from fcl_emu.coordinator.clock import EmulatedTime, RealTime, make_clock
from fcl_emu.coordinator.collection import make_collection
from fcl_emu.coordinator.dispatch import Dispatcher
from fcl_emu.coordinator.edge_tier import FlatStar
from fcl_emu.coordinator.guard import LogOnce, RateLimiter
from fcl_emu.coordinator.open_round import OpenRound, StaleUpdates
from fcl_emu.coordinator.privacy import run_privacy_part
from fcl_emu.coordinator.rounds import RoundRunner
from fcl_emu.coordinator.state import RunState
from fcl_emu.methods.base import ClientPart
from fcl_emu.monitoring.metrics import CoordinatorMetrics
from fcl_emu.runconfig import RunConfig
from fcl_emu.scenario.devices import DeviceProfile
from fcl_emu.wire.framing import WireError, decode, encode
from fcl_emu.wire.messages import Heartbeat, Join, Update, client_id

NUM_CLIENTS = 6
SAMPLES = 50  # each client's samples in every task


class FakeScenario:
    num_tasks = 2

    def task_classes(self, task):
        return [2 * task, 2 * task + 1]

    def seen_classes(self, task):
        return list(range(2 * task + 2))

    def client_indices(self, index, task):
        return list(range(SAMPLES))

    def join_task(self, index):
        return 0


class FakeServer:
    """A method's server part that records what the round runner asks of it."""

    accepts_stale_updates = True
    summable = ("delta/",)
    side_channels = frozenset()

    def __init__(self):
        self.global_state = {"w": np.zeros(3, np.float32)}
        self.aggregated: list[tuple[int, int, list[ClientUpdate]]] = []

    def task_assets(self, task):
        return {}

    def round_tensors(self, task, number):
        return {"global/w": self.global_state["w"]}

    def learning_rate(self, task, task_round, lr):
        return lr

    def aggregate(self, task, number, updates):
        self.aggregated.append((task, number, list(updates)))

    def check_update(self, task, tensors):
        pass


class FakeSpec:
    name = "fake"
    server = FakeServer
    client = ClientPart


def make_state(clock: str = "real", edge: dict | None = None, **rounds) -> RunState:
    config = RunConfig.model_validate({
        "scenario": {"dataset": "mnist", "num_tasks": 2, "num_clients": NUM_CLIENTS},
        "rounds": {"clients_per_round": 3, "rounds_per_task": 2, "min_participants": 2, "deadline_s": 30,
                   "clock": clock, **rounds},
        "edge": edge or {}, "security": {"transport": "plain"}})
    return RunState(config=config, scenario=FakeScenario(), spec=FakeSpec(), server=FakeServer(), model_name="fake",
                    evaluator=None, registry=ClientRegistry(liveness_timeout_s=10.0), metrics=CoordinatorMetrics(),
                    run_id="test", rng=np.random.default_rng(0), log_once=LogOnce(logging.getLogger("test")),
                    policy=config.aggregation.round_policy())


def join_all(state: RunState) -> list[str]:
    ids = [client_id(i) for i in range(NUM_CLIENTS)]
    for i, cid in enumerate(ids):
        state.registry.join(cid, i, "node-0", 0)
    return ids


def update(cid: str, value: float, samples: int = 10) -> ClientUpdate:
    return ClientUpdate(cid, samples, {DELTA + "w": np.full(3, value, np.float32)}, loss=value)


# ------------------------------------------------------------------------------------------- round runner
class PlayingDispatcher:
    """Stands in for the dispatcher: records sends; ``serve`` lets every selected client answer at once, except
    those in ``silent`` (which never answer) and those in ``failing`` (which report an error; those also in
    ``nonfinite``, that their loss became NaN)."""

    def __init__(self, state: RunState, silent=(), failing=(), nonfinite=()):
        self.state, self.silent, self.failing, self.nonfinite = state, set(silent), set(failing), set(nonfinite)
        self.sent: list[tuple[str, str]] = []
        self.round: OpenRound | None = None
        self.served = 0

    def drain(self):
        pass

    def send(self, client, msg_type, body, **kw):
        self.sent.append((client, msg_type))
        return 100

    def side_channel(self, client, task, msg_type, tensors):
        raise AssertionError("no side channel in these rounds")

    def reject(self, exc):
        raise AssertionError(f"nothing is refused in these rounds: {exc}")

    def cancel(self, r, clients):
        self.sent += [(c, "cancel") for c in clients]

    def serve(self, until, deadline):
        """Clients answer in client order; a cancelled one drops its training, as an edge node does."""
        self.served += 1
        r = self.round
        for cid in sorted(r.selected - r.answered() - self.silent) if r is not None else ():
            if cid in r.cancelled:
                continue
            if cid in self.failing:
                r.failed.add(cid)
                if cid in self.nonfinite:
                    r.nonfinite_loss.add(cid)
            else:
                r.updates.append(update(cid, float(int(cid[-4:]))))
            samples = SAMPLES * self.state.config.training.local_epochs if cid not in self.failing else 0
            self.clock.answered(r, cid, 200, 0.5, samples)
            self.cancel(r, self.clock.hopeless(r))
            if until():
                return


def runner(state: RunState, **dispatcher) -> tuple[RoundRunner, PlayingDispatcher]:
    fake = PlayingDispatcher(state, **dispatcher)
    fake.clock = make_clock(state, liveness_timeout_s=10.0)
    stale, privacy = StaleUpdates(state.config.rounds.planned_cohort), run_privacy_part(state.config)
    return RoundRunner(state, fake, fake.clock, make_collection(state, privacy, FlatStar()), stale, privacy), fake


@pytest.mark.parametrize("clock", ["real", "emulated"])
def test_a_round_selects_dispatches_collects_and_aggregates(clock):
    state = make_state(clock)
    join_all(state)
    run, fake = runner(state)
    record = run.run_round(task=0, task_round=0)
    chosen = [c for c, t in fake.sent if t == "train_request"]
    assert len(chosen) == 3 and [t for c, t in fake.sent if c == chosen[0]] == ["task_start", "train_request"]
    assert state.registry.records[chosen[0]].assets_task == 0
    (task, number, updates), = state.server.aggregated
    assert (task, number) == (0, 1) and sorted(u.client for u in updates) == sorted(chosen)
    assert [u.client for u in updates] == sorted(chosen)  # aggregated in client order, whoever came first
    assert (record.selected, record.participants, record.skipped, record.late, record.dropped) == \
        (3, 3, False, 0, 0)
    assert record.mean_loss == pytest.approx(np.mean([float(int(c[-4:])) for c in chosen]))
    assert fake.round is None  # closed
    if clock == "emulated":
        assert record.emulated_s is not None and record.emulated_s > 0 and record.emulated_clock_s > 0
    else:
        assert record.emulated_s is None and record.emulated_clock_s is None

    second = run.run_round(task=0, task_round=1)  # the task's assets are not sent twice
    assert second.round == 2
    again = fake.sent[len(chosen) * 2:]
    assert not [c for c, t in again if t == "task_start" and c in chosen]
    assert len([t for c, t in again if t == "train_request"]) == 3


def test_the_selection_is_seeded():
    picks = []
    for _ in range(2):
        state = make_state()
        join_all(state)
        run, fake = runner(state)
        run.run_round(0, 0)
        picks.append([c for c, t in fake.sent if t == "train_request"])
    assert picks[0] == picks[1]


def test_a_round_below_quorum_is_skipped_and_not_aggregated():
    state = make_state(rounds_per_task=2)
    ids = join_all(state)
    run, fake = runner(state, silent=set(ids[1:]))  # at most one update can come
    record = run.run_round(0, 0)
    assert record.skipped and not state.server.aggregated
    assert record.participants <= 1 and record.late + record.participants == 3


def test_failed_clients_count_and_do_not_block_the_round():
    state = make_state()
    ids = join_all(state)
    run, fake = runner(state, failing={ids[0], ids[1], ids[2]})
    record = run.run_round(0, 0)
    assert record.failed + record.participants == 3 and record.late == 0


def test_late_updates_kept_for_the_next_round_are_aggregated_there():
    state = make_state(late_updates="next_round")
    join_all(state)
    run, fake = runner(state)
    assert run.stale.has_room_for("client-0005", task=0)
    run.stale.keep(update("client-0005", 5.0))
    record = run.run_round(0, 0)
    assert record.stale_used == 1
    assert "client-0005" in [u.client for u in state.server.aggregated[0][2]]
    assert run.run_round(0, 1).stale_used == 0  # used once


@pytest.mark.parametrize("deadline_s", [30.0, 1000.0])
def test_late_trainings_are_cancelled_with_the_same_round_outcome(deadline_s):
    """Six selected for three wanted, each with a per-sample cost: 0-2 train 100 samples in 0.1-0.3 s, 3-5 in
    40-60 s. With a 30 s deadline the slow ones are cancelled at once (their earliest arrival is after it); with
    1000 s, once the third fast update is in. The round's outcome is that of a round that trains them all."""
    outcomes = {}
    for skip in (True, False):
        state = make_state("emulated", clients_per_round=3, overcommit=2.0, deadline_s=deadline_s, skip_late=skip)
        for i, cid in enumerate(join_all(state)):
            state.registry.records[cid].profile = DeviceProfile(ms_per_sample=[1, 2, 3, 400, 500, 600][i])
        run, fake = runner(state)
        record = run.run_round(0, 0)
        cancelled = sorted(c for c, t in fake.sent if t == "cancel")
        assert record.skipped_trainings == len(cancelled)
        outcomes[skip] = (record.participants, record.late, record.dropped, record.emulated_s,
                          record.contributors, [u.client for u in state.server.aggregated[0][2]])
        if skip:
            assert cancelled == [client_id(i) for i in (3, 4, 5)]
            assert record.host_cpu_saved_s == pytest.approx(3 * 0.5)  # 0.5 s per 100 samples measured
        else:
            assert cancelled == [] and record.host_cpu_saved_s == 0
    assert outcomes[True] == outcomes[False]
    assert outcomes[True][:3] == (3, 3, 0) and outcomes[True][3] == pytest.approx(0.3)


def test_nothing_is_cancelled_where_late_work_counts_or_leaves_state():
    for rounds, keeps_state in (({"late_updates": "next_round"}, False), ({}, True)):
        state = make_state("emulated", clients_per_round=3, overcommit=2.0, **rounds)
        state.spec.client = type("Stateful", (ClientPart,), {"keeps_state": keeps_state})
        for i, cid in enumerate(join_all(state)):
            state.registry.records[cid].profile = DeviceProfile(ms_per_sample=[1, 2, 3, 400, 500, 600][i])
        run, fake = runner(state)
        assert run.run_round(0, 0).skipped_trainings == 0 and "cancel" not in [t for _, t in fake.sent]


def test_a_network_trace_sets_the_links_of_the_emulated_round(tmp_path):
    """Every client at 8 kbit/s (1000 B/s) from the trace: 200 B down (task start, train request), 0.5 s of CPU,
    200 B up: 0.9 s instead of the ideal link's 0.5 s."""
    trace = tmp_path / "network.yaml"
    trace.write_text('"0": {time: [0], communication: [8]}\n')
    for path, expected in ((None, 0.5), (trace, 0.9)):
        state = make_state("emulated")
        state.config = state.config.model_copy(update={"edge": state.config.edge.model_copy(
            update={"network_trace": path})})
        join_all(state)
        run, fake = runner(state)
        assert run.run_round(0, 0).emulated_s == pytest.approx(expected)


# ------------------------------------------------------------------------------------------- dispatcher
class FakeSocket:
    def __init__(self, inbox):
        self.inbox = inbox

    def poll(self, timeout=0):
        return bool(self.inbox)


class FakeEndpoint:
    """The ROUTER as the dispatcher sees it: messages to receive (peer, wire frames), sends recorded."""

    address = "tcp://fake:1"

    def __init__(self):
        self.inbox: deque = deque()
        self.sock = FakeSocket(self.inbox)
        self.sent: list[tuple[str, str, object]] = []
        self.switched = False
        self.seq = 0

    def push(self, peer: str, msg_type: str, body, **kw):
        self.seq += 1
        self.inbox.append((peer, encode(msg_type, body, sender=peer, seq=self.seq, **kw)))

    def recv(self):
        """Decode as the real endpoint does: a refused message names the peer of its connection."""
        peer, frames = self.inbox.popleft()
        try:
            return peer, decode(frames)
        except WireError as exc:
            exc.peer = peer
            raise

    def send(self, client, msg_type, body, **kw):
        self.sent.append((client, msg_type, body))
        return 64


def dispatcher(state: RunState) -> tuple[Dispatcher, FakeEndpoint]:
    endpoint = FakeEndpoint()
    clock = make_clock(state, liveness_timeout_s=10.0)
    return Dispatcher(state, endpoint, pool=None, clock=clock, collection=make_collection(state, None, FlatStar()),
                      stale=StaleUpdates(3), rate_limiter=RateLimiter(),
                      welcome={"run_id": "test", "scenario": {}, "method": "fake", "method_options": {},
                               "model": "fake", "training": {}, "heartbeat_interval_s": 1.0}), endpoint


def join_msg(index: int) -> Join:
    return Join(client_index=index, node="node-0", pid=1)


def test_a_join_is_registered_and_welcomed_with_the_clocks_edge_settings():
    for clock, expected in (("emulated", "emulated"), ("real", "real")):
        state = make_state(clock)
        d, endpoint = dispatcher(state)
        endpoint.push(client_id(2), "join", join_msg(2))
        d.drain()
        assert state.registry.is_online(client_id(2))
        (peer, msg_type, body), = endpoint.sent
        assert (peer, msg_type) == (client_id(2), "welcome") and body.edge.clock == expected


def test_an_update_goes_into_the_open_round_and_a_late_one_is_counted():
    state = make_state()
    d, endpoint = dispatcher(state)
    ids = join_all(state)
    d.round = r = OpenRound(task=0, number=1, chosen=ids[:2], selected=set(ids[:2]), wanted=2)
    delta = {DELTA + "w": np.ones(3, np.float32)}
    endpoint.push(ids[0], "update", Update(num_samples=10, train_time_s=0.1, loss=0.5), task=0, round=1,
                  tensors=delta)
    endpoint.push(ids[3], "update", Update(num_samples=10, train_time_s=0.1, loss=0.5), task=0, round=1,
                  tensors=delta)  # not selected
    d.drain()
    assert [u.client for u in r.updates] == [ids[0]] and r.reported_s[ids[0]] == pytest.approx(0.1)
    assert state.tally.late_updates == 1 and state.registry.records[ids[0]].rounds_trained == 1


def test_a_refused_update_fails_its_client_at_once_and_is_answered_with_an_error():
    state = make_state()
    d, endpoint = dispatcher(state)
    ids = join_all(state)
    d.round = r = OpenRound(task=0, number=1, chosen=ids[:2], selected=set(ids[:2]), wanted=2)
    endpoint.push(ids[1], "update", Update(num_samples=10, train_time_s=0.1, loss=0.5), task=0, round=1,
                  tensors={DELTA + "w": np.ones(4, np.float32)})  # wrong shape
    endpoint.push(ids[0], "update", Update(num_samples=SAMPLES + 1, train_time_s=0.1, loss=0.5), task=0, round=1,
                  tensors={DELTA + "w": np.ones(3, np.float32)})  # more samples than it holds
    d.drain()
    assert r.failed == {ids[0], ids[1]} and not r.updates and r.done(state.registry.is_online)
    assert state.tally.rejected == {"bad_shape": 1, "implausible": 1}
    assert sorted((c, t, b.code) for c, t, b in endpoint.sent) == [(ids[0], "error", "implausible"),
                                                                   (ids[1], "error", "bad_shape")]


@pytest.mark.parametrize("delta, reason", [
    ({DELTA + "w": np.zeros(3, np.int32)}, "bad_dtype"),  # the model is float32: refused before any arithmetic
    ({DELTA + "w": np.array([0.0, np.nan, 1.0], np.float32)}, "non_finite"),  # refused by the wire layer
])
def test_a_refused_update_never_stalls_its_round(delta, reason):
    """Refused in the checks or already while decoding: either way the client fails its round at once, so the
    round does not wait for it until the deadline."""
    state = make_state()
    d, endpoint = dispatcher(state)
    ids = join_all(state)
    d.round = r = OpenRound(task=0, number=1, chosen=ids[:2], selected=set(ids[:2]), wanted=2)
    endpoint.push(ids[0], "update", Update(num_samples=10, train_time_s=0.1, loss=0.5), task=0, round=1,
                  tensors=delta)
    d.drain()
    assert r.failed == {ids[0]} and not r.updates and r.pending(state.registry.is_online) == {ids[1]}
    assert state.tally.rejected == {reason: 1}
    endpoint.push(ids[0], "update", Update(num_samples=10, train_time_s=0.1, loss=0.5), task=0, round=0,
                  tensors=delta)  # an older round's: refused, but fails nothing of this one
    endpoint.push(ids[2], "update", Update(num_samples=10, train_time_s=0.1, loss=0.5), task=0, round=1,
                  tensors=delta)  # not selected
    d.drain()
    assert r.failed == {ids[0]}  # (late ones are counted late, not checked; broken frames are refused)


def test_strangers_are_told_to_join_and_cannot_join_as_someone_else():
    state = make_state()
    d, endpoint = dispatcher(state)
    endpoint.push(client_id(1), "heartbeat", Heartbeat())
    endpoint.push(client_id(1), "join", join_msg(4))  # client-0001 may not join as client 4
    d.drain()
    assert not state.registry.records
    assert [(c, b.code) for c, t, b in endpoint.sent] == [(client_id(1), "not_joined")]
    assert state.tally.rejected == {"unknown_sender": 1, "not_authorized": 1}


def test_catching_up_before_the_rounds_leaves_the_first_selection_nothing_to_look_at():
    """Once the population is in, ``catch_up`` follows every joined client's availability and sorts the eligible;
    the first round's selection then finds no client due and the same eligible list, and sees who is online as
    it would have without the catch-up."""
    def joined_clock():
        state = make_state("emulated", edge={"availability": "onoff:30:30"})
        d, endpoint = dispatcher(state)
        for i in range(NUM_CLIENTS):
            endpoint.push(client_id(i), "join", join_msg(i))
        d.drain()
        return state, d.clock

    state, clock = joined_clock()
    eligible = clock.catch_up(0)
    assert clock.model.due(clock.model.now) == [] and eligible is state.registry.eligible(0)
    clock.before_selection(0, serve=None)
    assert state.registry.eligible(0) is eligible
    plain_state, plain = joined_clock()
    plain.before_selection(0, serve=None)  # without a catch-up: the selection does it
    assert [r.client_id for r in plain_state.registry.eligible(0)] == [r.client_id for r in eligible]


def test_the_clock_is_chosen_once_from_the_config():
    assert isinstance(make_clock(make_state("real"), 10.0), RealTime)
    emulated = make_clock(make_state("emulated"), 10.0)
    assert isinstance(emulated, EmulatedTime) and emulated.emulated_now == 0.0
    fields = emulated.checkpoint_fields()
    emulated.model.now = 99.0
    emulated.restore(fields)
    assert emulated.emulated_now == 0.0


def _asking(folder: str, skip: tuple[str, ...], asks) -> list[str]:
    """``file:line`` of every comparison or call in ``folder``'s files (but ``skip``) that ``asks(node, names)``
    flags, ``names`` being the attribute and variable names the node mentions."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted((Path(__file__).resolve().parents[1] / folder).glob("*.py")):
        if path.name in skip:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Compare, ast.Call, ast.If, ast.IfExp)):
                test = node.test if isinstance(node, (ast.If, ast.IfExp)) else node  # an if: its condition only
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None) for n in ast.walk(test)}
                if asks(node, names):
                    found.append(f"{path.name}:{node.lineno}")
    return found


def _is_none(node) -> bool:
    import ast

    return isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value is None
                                                 for c in node.comparators)


def _kind_check(node, names, kinds: set[str]) -> bool:
    import ast

    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and bool(names & kinds)


def test_the_coordinator_is_composed_and_its_rounds_never_ask_which_clock_they_have():
    """``Coordinator`` has no mixin bases, and no file of the coordinator outside clock.py compares a clock (or an
    emulated timeline) with None or asks which kind it is."""
    from fcl_emu.coordinator.lifecycle import Coordinator

    assert Coordinator.__bases__ == (object,)
    asking = _asking("coordinator", ("clock.py", "emulated.py"), lambda node, names: (
        (_is_none(node) and names & {"clock", "timeline"}) or _kind_check(node, names, {"RealTime", "EmulatedTime"})))
    assert not asking, f"branches on the clock's kind: {asking}"


def test_no_part_asks_whether_there_is_an_edge_tier():
    """The tier is chosen once (edge_tier.py, ``make_tier``: a flat star or edge aggregators): no other file of the
    coordinator compares a tier (or the edge aggregators) with None or asks which kind it is."""
    asking = _asking("coordinator", ("edge_tier.py",), lambda node, names: (
        (_is_none(node) and names & {"tier", "edges"}) or _kind_check(node, names, {"FlatStar", "EdgeTier"})))
    assert not asking, f"branches on the tier's kind: {asking}"


def test_no_part_of_the_edge_node_branches_on_secure():
    """How a node's run aggregates is chosen once (edge_node/security.py: ``RoundSecurity``, plain or secure): no
    other file of the edge node branches on ``secure``."""
    import ast

    asking = _asking("edge_node", ("security.py",), lambda node, names: (
        isinstance(node, (ast.If, ast.IfExp, ast.Compare)) and "secure" in names))
    assert not asking, f"branches on secure: {asking}"


def test_the_coordinator_and_its_composition_root_stay_small():
    """``Coordinator``'s file and the composition root are under 250 lines each."""
    from pathlib import Path

    coordinator = Path(__file__).resolve().parents[1] / "coordinator"
    lines = {name: len((coordinator / name).read_text().splitlines()) for name in ("lifecycle.py", "compose.py")}
    assert all(n < 250 for n in lines.values()), lines


# ------------------------------------------------------------------------------------------- server jobs
class DonePool:
    """Stands in for the GPU worker pool: every job is done at once, failed if its kind says so."""

    device = "cpu (in the coordinator)"

    def __init__(self):
        self.ids = 0

    def submit(self, kind, inputs, options):
        from fcl_emu.coordinator.gpu_pool import Job

        self.ids += 1
        ok = not kind.endswith("fail")
        return Job(self.ids, kind, inputs, options or {}, done=True, ok=ok, worker="w0", attempts=1,
                   errors=[] if ok else ["boom"])


@pytest.mark.parametrize("kind, label, ok", [("fedcbc.fuse", "fusion", True), ("device.fail", "fail", False)])
def test_a_server_job_is_an_event_and_its_start_and_end_are_heard(tmp_path, kind, label, ok):
    import json

    from fcl_emu.coordinator.contracts import JobFailed
    from fcl_emu.coordinator.server_jobs import ServerJobs
    from fcl_emu.monitoring.results import RunRecorder

    state = make_state()
    state.recorder = RunRecorder(tmp_path, "")
    state.task, state.global_round = 1, 3
    heard = []
    state.progress = lambda what, info: heard.append((what, info))
    jobs = ServerJobs(state, DonePool(), serve=lambda until, deadline: None)
    if ok:
        jobs.run([(kind, {}, None)])
    else:
        with pytest.raises(JobFailed):
            jobs.run([(kind, {}, None)])
    state.recorder.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["job", "server_job"]
    server = events[1]
    assert {k: server[k] for k in ("kind", "jobs", "task", "round", "device", "ok")} == {
        "kind": label, "jobs": [kind], "task": 1, "round": 3, "device": "cpu (in the coordinator)", "ok": ok}
    assert 0 <= server["start"] <= server["end"] and server["duration_s"] >= 0
    assert [what for what, _ in heard] == ["server_job_start", "server_job_end"]
    assert heard[1][1]["ok"] is ok and heard[1][1]["duration_s"] == server["duration_s"]


def test_heartbeats_queued_while_the_coordinator_did_not_listen_are_not_refused_as_a_flood():
    state = make_state()
    d, endpoint = dispatcher(state)
    d.rate_limiter = RateLimiter(rate_per_s=20.0, burst=3)
    ids = join_all(state)
    endpoint.push(ids[0], "heartbeat", Heartbeat())
    d.drain()
    time.sleep(1.0)  # the coordinator busy at a task's end: the client's heartbeats (20/s here) wait in the queue
    for _ in range(15):
        endpoint.push(ids[0], "heartbeat", Heartbeat())
    d.drain()
    assert "rate_limited" not in state.tally.rejected
    for _ in range(15):  # as many again at once, with the coordinator listening: a flood
        endpoint.push(ids[0], "heartbeat", Heartbeat())
    d.drain()
    assert state.tally.rejected["rate_limited"] >= 10


# ------------------------------------------------------------------------------------------- one writer per field
def _open_round_writers() -> dict[str, set[str]]:
    """For each field of :class:`OpenRound`, the coordinator's files that write it after the round opens: an
    assignment to ``r.<field>`` (or to an item of it), or a call that changes it in place (``r.failed.add``)."""
    import ast
    import dataclasses

    fields = {f.name for f in dataclasses.fields(OpenRound)}
    changing = {"add", "append", "extend", "update", "discard", "remove", "clear", "pop", "setdefault"}
    writers: dict[str, set[str]] = {name: set() for name in fields}
    folder = Path(__file__).resolve().parents[1] / "coordinator"

    def field_of(node) -> str | None:
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in fields and isinstance(node.value, ast.Name) \
                and node.value.id == "r":
            return node.attr
        return None

    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [t for target in targets
                           for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in changing:
                targets = [node.func.value]
            for target in targets:
                name = field_of(target)
                if name is not None:
                    writers[name].add(path.name)
    return writers


def test_every_field_of_the_open_round_has_one_writer():
    """The round runner fills an open round's first fields when it makes it; after that the dispatcher writes
    what the clients answered and the clock its timeline and the close, each field from one file."""
    writers = _open_round_writers()
    assert {name: files for name, files in writers.items() if len(files) > 1} == {}
    assert {name for name, files in writers.items() if files == {"dispatch.py"}} == {
        "updates", "failed", "nonfinite_loss", "lost", "masked", "reported_s", "held_at"}
    assert {name for name, files in writers.items() if files == {"clock.py"}} == {
        "started_at", "timeline", "side", "cancelled", "counted", "masked_in_time", "late", "dropped", "train_s",
        "emulated_s", "host_timeout", "kept_late", "bytes_discarded", "host_cpu_saved_s", "energy", "low_battery",
        "hopeless_checked"}


def test_a_client_silent_for_the_liveness_timeout_from_its_join_or_its_last_message_is_dead():
    """A join counts as hearing from the client (its node heartbeats while it loads the run's data set): a
    client lost before its first heartbeat is declared dead after the timeout, like one lost later."""
    registry = ClientRegistry(liveness_timeout_s=10.0)
    registry.join("client-0000", 0, "node-0", 0)
    joined = registry.records["client-0000"].last_seen
    assert registry.expire(joined + 9.0) == [] and registry.expire(joined + 11.0) == ["client-0000"]
    registry.join("client-0000", 0, "node-0", 0)  # back
    registry.touch("client-0000")
    heard = registry.records["client-0000"].last_seen
    assert registry.expire(heard + 9.0) == [] and registry.expire(heard + 11.0) == ["client-0000"]


def test_a_rounds_answers_grow_with_its_updates_masked_inputs_and_errors():
    r = OpenRound(task=0, number=1, chosen=["a", "b", "c", "d"], selected={"a", "b", "c", "d"}, wanted=4)
    assert r.answered() == set()
    r.updates.append(ClientUpdate("b", 1, {}))
    assert r.answered() == {"b"}
    r.failed.add("d")
    r.updates.append(ClientUpdate("a", 1, {}))
    assert r.answered() == {"a", "b", "d"}
    r.masked.add("c")
    assert r.answered() == {"a", "b", "c", "d"} and not r.awaiting(lambda c: True)


def test_the_eligible_clients_are_kept_until_the_registry_changes():
    registry = ClientRegistry(liveness_timeout_s=10.0)
    for i in (2, 0, 1):
        registry.join(f"c{i}", i, "n", 0 if i < 2 else 1)
    first = registry.eligible(0)
    assert [r.client_id for r in first] == ["c0", "c1"] and registry.eligible(0) is first
    assert [r.client_id for r in registry.eligible(1)] == ["c0", "c1", "c2"]  # another task: its own list
    for change, expected in ((lambda: registry.set_low_battery("c0", True), ["c1", "c2"]),
                             (lambda: registry.set_away("c1", True), ["c2"]),
                             (lambda: registry.set_low_battery("c0", False), ["c0", "c2"]),
                             (lambda: registry.leave("c2"), ["c0"]),
                             (lambda: registry.join("c2", 2, "n", 1), ["c0", "c2"]),
                             (lambda: registry.drop("c0"), ["c2"])):
        change()
        assert [r.client_id for r in registry.eligible(1)] == expected
