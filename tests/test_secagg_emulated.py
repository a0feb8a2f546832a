"""SecAgg+ on the emulated clock (coordinator/secure_timeline.py): each phase's dropouts are decided in emulated
time, so the same seed gives the same survivors per phase, the same recovered sum and the same accuracy on a
busy host with one edge node as on a quiet host with three."""

from __future__ import annotations

import json
import time
import types

import numpy as np
import pytest
import yaml

from fcl_emu.coordinator.emulated import ClientRound, EmulatedClock
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.coordinator.secure_round import SecureRound
from fcl_emu.coordinator.secure_timeline import SecureTimeline
from fcl_emu.aggregation.update import DELTA, DeltaLayout
from fcl_emu.scenario.availability import parse_availability
from fcl_emu.scenario.devices import DeviceProfile
from fcl_emu.scenario.network_trace import BandwidthTrace
from fcl_emu.secagg.client import SecAggClient
from fcl_emu.secagg.settings import SecAggSettings
from tests.conftest import seeded_run
from fcl_emu.wire.framing import Message
from fcl_emu.wire.messages import SecAggKeys, SecAggMasked, SecAggShares, SecAggUnmask, plain_body

SECURE = {"enabled": True}
EVERYONE = [f"client-{i:04d}" for i in range(5)]


# ------------------------------------------------------------------ one round in process
class Federation:
    """Five clients in process that answer a secure round's messages at once, as edge nodes do under the
    emulated clock (which then places each reply in time): 100 bytes per reply, 1,000 per masked input."""

    DIM = 8

    def __init__(self):
        metrics = types.SimpleNamespace(secagg_phase=lambda *a: None, secagg_round=lambda **k: None)
        self.outbox: list[tuple[str, str, object]] = []
        self.round = SecureRound(EVERYONE, DeltaLayout(("w",), ((self.DIM,),)), SecAggSettings(max_weight=10),
                                 run_id="r", number=1, seed=0, send=self._send, metrics=metrics)
        self.protocols = {c: SecAggClient(c) for c in EVERYONE}
        rng = np.random.default_rng(0)
        self.inputs = {c: (rng.uniform(-1, 1, self.DIM), 10) for c in EVERYONE}
        self.outbox += [(c, "secagg_setup", body) for c, body in self.round.setup_messages().items()]

    def _send(self, client: str, msg_type: str, body) -> int:
        self.outbox.append((client, msg_type, body))
        return 100

    def serve(self, until, deadline: float) -> None:
        while self.outbox:
            client, msg_type, body = self.outbox.pop(0)
            protocol, msg = self.protocols[client], plain_body(body)
            if msg_type == "secagg_setup":
                reply = Message("secagg_keys", SecAggKeys(**protocol.on_setup(msg)), nbytes=100)
            elif msg_type == "secagg_peer_keys":
                reply = Message("secagg_shares", SecAggShares(**protocol.on_keys(msg)), nbytes=100)
            elif msg_type == "secagg_relay":
                y = protocol.on_shares(msg, *self.inputs[client], np.random.default_rng(1))["y"]
                reply = Message("secagg_masked", SecAggMasked(train_time_s=0.0, loss=0.0), {"y": y}, nbytes=1000)
            elif msg_type == "secagg_unmask_request":
                reply = Message("secagg_unmask", SecAggUnmask(**protocol.on_unmask(msg)), nbytes=100)
            else:
                continue
            reply.round = 1
            self.round.on_message(client, reply)

    def mean(self, clients) -> np.ndarray:
        return sum(np.clip(self.inputs[c][0], -1, 1) for c in clients) / len(clients)


def secure_round(tmp_path, off_at: dict[int, float], uplinks: dict[int, float], deadline_s: float = 10.0,
                 crash_points: dict[int, float] | None = None, bandwidth: dict[int, BandwidthTrace] | None = None):
    """One secure round of :class:`Federation` on the emulated clock: 0.5 s latency each way, 2 ms per sample
    (100 samples); client i turns off at ``off_at[i]`` (a trace), uploads ``uplinks[i]`` bytes/s, crashes at
    ``crash_points[i]`` of the longest the round lasts (``deadline_s`` + 30 s), has the network trace
    ``bandwidth[i]``."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({str(i): {"active": [0], "inactive": [off_at.get(i, 1000)], "finish_time": 1000}
                                 for i in range(5)}))
    model = EmulatedClock(parse_availability(f"trace:{trace}"), seed=0, slot_s=10.0, trace_time_scale=1.0,
                          crash_rate=0.0, crash_downtime_s=5.0, liveness_timeout_s=2.0)
    if crash_points:
        model.crash_point = lambda index, number: crash_points.get(index)
    fed = Federation()
    r = OpenRound(0, 1, list(EVERYONE), set(EVERYONE), wanted=5)
    for i, c in enumerate(EVERYONE):
        profile = DeviceProfile(ms_per_sample=2, latency_s=0.5, uplink_bytes_s=uplinks.get(i, float("inf")))
        r.timeline[c] = ClientRound(profile, down_bytes=1000, trace=(bandwidth or {}).get(i))
    timeline = SecureTimeline(model, r, fed.round, {c: i for i, c in enumerate(EVERYONE)},
                              {c: 100 for c in EVERYONE}, deadline_s)
    outcome = timeline.run(fed.serve, time.monotonic() + 30, lambda c: True, lambda c: True, 1)
    return fed, r, timeline, outcome, model


def test_a_client_off_before_its_keys_arrive_drops_out_of_the_first_phase(tmp_path):
    fed, r, timeline, outcome, _ = secure_round(tmp_path, off_at={0: 0.7}, uplinks={})
    assert outcome.record["survivors"]["advertise_keys"] == EVERYONE[1:]
    assert outcome.record["dropouts"]["advertise_keys"] == 1 and outcome.clients == tuple(EVERYONE[1:])
    assert timeline.phase_s["advertise_keys"] == pytest.approx(1.0)  # keys out at 0.5, in at 1.0
    assert np.allclose(outcome.delta[DELTA + "w"], fed.mean(EVERYONE[1:]), atol=1e-4)


def test_a_client_off_between_masked_input_and_unmasking_stays_in_the_sum(tmp_path):
    """Phases close at 1, 2, 3, 4 s: client 0 goes off at 3.5 s, after its masked input arrived (3.0 s) and
    before its unmasking reply would (4.0 s): its self-mask is rebuilt from its neighbours' shares."""
    fed, r, timeline, outcome, _ = secure_round(tmp_path, off_at={0: 3.5}, uplinks={})
    assert outcome.record["survivors"]["masked_input"] == EVERYONE
    assert outcome.record["survivors"]["unmasking"] == EVERYONE[1:]
    assert outcome.record["dropouts"]["unmasking"] == 1 and outcome.clients == tuple(EVERYONE)
    assert timeline.phase_s == pytest.approx({p: 1.0 for p in ("advertise_keys", "share_keys", "masked_input",
                                                               "unmasking")})
    assert np.allclose(outcome.delta[DELTA + "w"], fed.mean(EVERYONE), atol=1e-4)
    assert timeline.masked == set(EVERYONE) and timeline.opened == pytest.approx(4.0)


def test_a_masked_input_past_the_deadline_is_left_out_and_its_masks_removed(tmp_path):
    """Client 1 uploads 1,000 bytes/s: its masked input arrives 1 s after the others', past the 4 s deadline."""
    fed, r, timeline, outcome, _ = secure_round(tmp_path, off_at={}, uplinks={1: 1000.0}, deadline_s=4.0)
    assert outcome.record["survivors"]["share_keys"] == EVERYONE
    assert outcome.record["survivors"]["masked_input"] == [c for c in EVERYONE if c != EVERYONE[1]]
    assert timeline.late_masked == {EVERYONE[1]} and outcome.record["recovered"] == 1
    assert np.allclose(outcome.delta[DELTA + "w"], fed.mean(set(EVERYONE) - {EVERYONE[1]}), atol=1e-4)


def test_a_network_trace_carries_the_secure_phases_too(tmp_path):
    """Client 2's trace gives it 10 bytes/s both ways: the 1,000 bytes of its train request alone take 100 s,
    so its keys miss the first phase, which waits for them until the round's 10 s deadline; nothing is left
    of the round for the next phase."""
    _, _, timeline, outcome, _ = secure_round(tmp_path, off_at={}, uplinks={},
                                              bandwidth={2: BandwidthTrace([0.0], [10.0])})
    assert outcome.record["survivors"]["advertise_keys"] == [c for c in EVERYONE if c != EVERYONE[2]]
    assert timeline.phase_s["advertise_keys"] == pytest.approx(10.0)
    assert outcome.record["outcome"] == "aborted"


def test_a_crash_between_masked_input_and_unmasking_is_noticed_after_the_liveness_delay(tmp_path):
    """Client 2 crashes at 0.09 x 40 s = 3.6 s: its masked input is in (3.0 s), its unmasking reply would
    come at 4.0 s. The coordinator notices the crash 2 s later (the liveness timeout), so the unmasking
    closes at 5.6 s; the client is away for its 5 s downtime."""
    fed, r, timeline, outcome, model = secure_round(tmp_path, off_at={}, uplinks={}, crash_points={2: 0.09})
    assert outcome.record["survivors"]["unmasking"] == [c for c in EVERYONE if c != EVERYONE[2]]
    assert outcome.clients == tuple(EVERYONE) and timeline.opened == pytest.approx(5.6)
    assert timeline.crashed() == {EVERYONE[2]}
    assert model.availability_at(8.5, [(EVERYONE[2], 2)]) == {EVERYONE[2]: False}
    assert model.availability_at(8.7, [(EVERYONE[2], 2)]) == {EVERYONE[2]: True}
    assert np.allclose(outcome.delta[DELTA + "w"], fed.mean(EVERYONE), atol=1e-4)


# ------------------------------------------------------------------ real runs


def profiles(tmp_path, clients: dict[int, str], **classes: dict) -> str:
    """A device profiles file: ``classes`` by name, each client pinned to one."""
    path = tmp_path / "profiles.yaml"
    path.write_text(yaml.safe_dump({"profiles": [{"name": name, **values} for name, values in classes.items()],
                                    "clients": clients}))
    return str(path)


def busy_and_quiet(tmp_path, mnist_root, **common):
    """The same seeded secure run on one edge node beside two busy-loop processes, and on three edge nodes on a
    quiet host (a 10 s liveness timeout: a starved node's heartbeats are the host's, not the federation's);
    their summaries and round records."""
    common["network"] = {"liveness_timeout_s": 10}
    loaded = seeded_run(tmp_path, mnist_root, "loaded", hogs=2, nodes=1, secagg=SECURE, **common)
    quiet = seeded_run(tmp_path, mnist_root, "quiet", nodes=3, secagg=SECURE, **common)
    return loaded, quiet


def same_phases(a: list[dict], b: list[dict]) -> bool:
    """Whether two runs' secure rounds decided alike: outcome, survivors and dropouts per phase, and each
    phase's emulated seconds (to the microseconds a message header's varying length moves them on a slow
    link)."""
    keys = ("outcome", "survivors", "dropouts")
    return ([[r["secagg"][k] for k in keys] for r in a] == [[r["secagg"][k] for k in keys] for r in b]
            and all(x["secagg"]["emulated_phase_s"] == pytest.approx(y["secagg"]["emulated_phase_s"], abs=1e-3)
                    for x, y in zip(a, b)))


@pytest.mark.slow
def test_the_same_survivors_per_phase_and_accuracy_on_a_busy_host_with_one_node_and_a_quiet_one_with_three(
        tmp_path, mnist_root):
    """Two clients upload over 2 Mbit/s: their 1.1 MB masked inputs take 4.5 s, past the 3 s deadline, so
    they drop out of the masked-input phase whenever they are sampled: the unmasking recovers their masks (or,
    with both sampled, a survivor keeps fewer than t share holders and the round aborts). A fixed cost per
    sample makes the emulated times exact."""
    devices = profiles(tmp_path, {0: "slow", 1: "slow"} | {i: "ok" for i in range(2, 10)},
                       ok={"ms_per_sample": 2}, slow={"ms_per_sample": 2, "uplink_mbps": 2})
    (loaded, loaded_rounds), (quiet, quiet_rounds) = busy_and_quiet(
        tmp_path, mnist_root, seed=4, training={"local_epochs": 1},
        scenario={"num_clients": 10, "num_tasks": 1, "samples_per_client_task": 100},
        rounds={"clients_per_round": 5, "rounds_per_task": 3, "deadline_s": 3, "eval_every": 3},
        edge={"device_profiles": devices})
    assert loaded.clock == quiet.clock == "emulated"
    assert same_phases(loaded_rounds, quiet_rounds)
    recovered = [r for r in quiet_rounds if r["secagg"]["outcome"] == "completed" and r["secagg"]["recovered"]]
    assert recovered and all(r["late"] == r["secagg"]["recovered"] for r in recovered)  # the slow ones' inputs
    assert loaded.accuracy_matrix == quiet.accuracy_matrix
    assert loaded.emulated_s == pytest.approx(quiet.emulated_s, abs=1e-3)
    assert loaded.host_timeouts == quiet.host_timeouts == 0


@pytest.mark.slow
def test_a_client_gone_between_its_masked_input_and_the_unmasking_is_recovered_alike(tmp_path, mnist_root):
    """Every device has a 0.5 s one-way latency and a fixed cost per sample, so round 1's phases close at
    1, 2, 3 and 4 s of emulated time. Client 0's trace turns it off at 3.5 s: after its masked input arrived,
    before its unmasking reply would: it stays in the sum, and its self-mask is rebuilt from its neighbours'
    shares. Round 2 goes on without it."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({str(i): {"active": [0], "inactive": [3.5 if i == 0 else 1000],
                                          "finish_time": 1000} for i in range(5)}))
    devices = profiles(tmp_path, {i: "std" for i in range(5)}, std={"ms_per_sample": 2, "latency_ms": 500})
    (loaded, loaded_rounds), (quiet, quiet_rounds) = busy_and_quiet(
        tmp_path, mnist_root, seed=1, training={"local_epochs": 1},
        scenario={"num_clients": 5, "num_tasks": 1, "samples_per_client_task": 100},
        rounds={"clients_per_round": 5, "rounds_per_task": 2, "deadline_s": 10, "eval_every": 2},
        edge={"device_profiles": devices, "availability": f"trace:{trace}"})
    assert same_phases(loaded_rounds, quiet_rounds)
    assert loaded.accuracy_matrix == quiet.accuracy_matrix
    first, second = quiet_rounds
    everyone = EVERYONE
    secagg = first["secagg"]
    assert secagg["outcome"] == "completed" and secagg["clients"] == 5  # client 0's input is in the sum
    assert secagg["survivors"]["masked_input"] == everyone
    assert secagg["survivors"]["unmasking"] == everyone[1:]
    assert secagg["dropouts"] == {"advertise_keys": 0, "share_keys": 0, "masked_input": 0, "unmasking": 1}
    assert secagg["emulated_phase_s"] == pytest.approx({"advertise_keys": 1.0, "share_keys": 1.0,
                                                        "masked_input": 1.0, "unmasking": 1.0})
    assert first["participants"] == 5 and first["emulated_s"] == pytest.approx(4.0)
    assert second["selected"] == 4 and second["secagg"]["survivors"]["unmasking"] == everyone[1:]
