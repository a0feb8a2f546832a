"""Secure aggregation on the wire: SecAgg+ rounds between a real coordinator and real edge nodes (ZeroMQ).

The protocol's arithmetic is tested in tests/test_secagg.py; here: the rounds, the dropouts of real clients,
what the coordinator holds, the run with and without ``--secagg``, and the configuration checks.
"""

from __future__ import annotations

from pathlib import Path
import types

import msgspec
import numpy as np
import pytest
import torch

from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.coordinator.secure_round import SecureRound, round_id
from fcl_emu.edge_node.node import EdgeNode
from fcl_emu.secagg.client import SecAggClient
from fcl_emu.secagg.protocol import Quantizer, SecAggError
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.runconfig import RunConfig, load_config
from fcl_emu.methods import registry
from fcl_emu.aggregation.update import DELTA, DeltaLayout
from fcl_emu.methods.base import ServerPart
from tests.conftest import events, fcl_emu, keyed, raw_header, run_beside, small_config
from fcl_emu.wire.auth import ClientKeyring
from fcl_emu.monitoring.results import RunSummary
from fcl_emu.wire.framing import Message, WireError, decode, encode
from fcl_emu.wire.messages import SecAggKeys, SecAggMasked, plain_body

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- in-process run, inspected

def _arrays_reachable_from(root: object) -> list[np.ndarray]:
    """Every numpy array reachable from ``root`` through instance attributes and containers."""
    found, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, str, bytes,
                                                torch.Tensor, torch.nn.Module)):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return found


@pytest.fixture(scope="module")
def inspected_run(tmp_path_factory, mnist_root, one_torch_thread):
    """A 4-round SecAgg+ run on the real clock (the emulated clock's rounds: tests/test_secagg_emulated.py),
    coordinator and two edge nodes in this process (threads, real sockets).

    Records every client's plaintext input, and the arrays the coordinator holds after each masked input
    it takes. Round 2: one client fails after the share exchange (its masks are recovered). Round 3: three
    fail, fewer than t masked inputs remain and the round aborts; round 4 goes on as usual."""
    tmp_path = tmp_path_factory.mktemp("secagg")
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 100, "num_tasks": 2},
                                      rounds={"clients_per_round": 6, "rounds_per_task": 2, "eval_every": 10,
                                              "clock": "real"},
                                      training={"local_epochs": 1},
                                      secagg={"enabled": True, "neighbors": 5, "threshold": 4}),
                         {"data_root": [str(mnist_root)]})
    config, node_keys = keyed(config, tmp_path / "keys")
    coordinator = Coordinator(config)
    run_ids = {round_id(coordinator.run_id, n): n for n in (1, 2, 3, 4)}
    plaintext: dict[tuple[int, str], tuple[np.ndarray, int]] = {}  # (round, client) -> (input, weight)
    held: list[tuple[int, np.ndarray]] = []  # (round, array the coordinator holds)
    params, outcomes = {}, {}
    to_fail = {2: 1, 3: 3}  # round -> how many clients fail after sharing their keys
    original_on_shares = SecAggClient.on_shares

    def on_shares(self, msg, vector, weight, rng, model=None):
        number = run_ids[self.params.round_id]
        if to_fail.get(number, 0) > 0:
            to_fail[number] -= 1
            raise SecAggError("test: this client fails after the share exchange")
        plaintext[(number, self.client)] = (np.array(vector, copy=True), int(weight))
        return original_on_shares(self, msg, vector, weight, rng, model)

    original_receive = SecureRound.on_message

    def on_message(self, peer, msg):
        taken = original_receive(self, peer, msg)
        if msg.type == "secagg_masked":
            params[self.number] = self.server.params
            held.extend((self.number, a) for a in _arrays_reachable_from(coordinator)
                        if a.size in (self.layout.dim, self.layout.dim + 1))
        return taken

    original_unmask = SecureRound.unmask

    def unmask(self, wait):
        outcome = original_unmask(self, wait)
        outcomes[self.number] = outcome
        return outcome

    keyring = ClientKeyring(Path(node_keys[1]), Path(node_keys[3]))
    nodes = [EdgeNode(coordinator.address, list(ix), name=f"node-{i}", data_roots=[mnist_root],
                      state_dir=tmp_path / f"state-{i}", keys=keyring, secure=True)
             for i, ix in enumerate((range(0, 50), range(50, 100)))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SecAggClient, "on_shares", on_shares)
        patch.setattr(SecureRound, "on_message", on_message)
        patch.setattr(SecureRound, "unmask", unmask)
        summary = run_beside(coordinator, nodes, tmp_path / "run")
    return types.SimpleNamespace(summary=summary, plaintext=plaintext, held=held, params=params, outcomes=outcomes,
                                 run_dir=tmp_path / "run", coordinator=coordinator)


def test_secure_rounds_recover_dropouts_and_abort_below_threshold(inspected_run):
    run = inspected_run
    assert run.summary.status == "completed"
    rounds = [e for e in events(run.run_dir) if e["event"] == "round"]
    outcomes = [r["secagg"]["outcome"] for r in rounds]
    assert outcomes == ["completed", "completed", "aborted", "completed"]
    assert [r["skipped"] for r in rounds] == [False, False, True, False]
    assert rounds[1]["secagg"]["recovered"] == 1 and rounds[1]["secagg"]["dropouts"]["masked_input"] == 1
    assert rounds[1]["failed"] == 1 and rounds[1]["participants"] == 5
    assert "3 clients sent masked inputs, threshold t=4" in rounds[2]["secagg"]["reason"]
    assert run.summary.secagg.completed == 3 and run.summary.secagg.aborted == 1
    for name in ("secagg_setup", "secagg_keys", "secagg_peer_keys", "secagg_shares", "secagg_relay",
                 "secagg_masked", "secagg_unmask_request", "secagg_unmask", "secagg_abort"):
        assert name in run.summary.bytes, name
    assert "update" not in run.summary.bytes  # no plain update ever travels


def test_the_unmasked_sum_is_the_weighted_mean_of_the_survivors(inspected_run):
    run = inspected_run
    for number in (1, 2, 4):
        outcome = run.outcomes[number]
        inputs = [run.plaintext[(number, c)] for c in outcome.clients]
        assert len(inputs) == (5 if number == 2 else 6)
        weights = np.array([w for _, w in inputs], np.float64)
        expected = sum(w * np.clip(x.astype(np.float64), -1, 1) for x, w in inputs) / weights.sum()
        got = DeltaLayout(*zip(*[(k[len(DELTA):], v.shape) for k, v in sorted(outcome.delta.items())])) \
            .flatten(outcome.delta)
        assert outcome.weight == int(weights.sum())
        # stochastic rounding: each client's error is below one level, W / (w * M) per unit of x
        assert np.abs(got - expected).max() < 1e-4


def test_the_coordinator_never_holds_an_individual_update(inspected_run):
    run = inspected_run
    assert any(a.dtype == np.uint32 for _, a in run.held), \
        "the running masked sum was not among the arrays found: the inspection would prove nothing"
    for (number, client), (x, w) in run.plaintext.items():
        for held_in, a in run.held:
            if held_in != number:
                continue
            if a.dtype.kind == "f":
                assert not np.allclose(a[:x.size], x, atol=1e-3), f"{client}'s delta (round {number}) is held"
            elif w > 0 and a.size == x.size + 1:  # a quantised but unmasked input would decode back to x
                total, _ = Quantizer(run.params[number]).decode(a, 1)
                assert np.abs(total / w - x).mean() > 0.1, f"{client}'s quantised input (round {number}) is held"


# --------------------------------------------------------------------------- real processes, with and without

def test_secagg_gives_the_accuracy_of_a_plain_run(tmp_path, mnist_root):
    config = small_config(tmp_path / "c.yaml")
    summaries = {}
    for flags in ((), ("--secagg", "--secagg-neighbors", "3")):
        run_dir = tmp_path / ("secure" if flags else "plain")
        proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir),
                       "--seed", "5", *flags)
        assert proc.wait(timeout=300) == 0
        summaries[bool(flags)] = RunSummary.load(run_dir / "summary.json")
    plain, secure = summaries[False], summaries[True]
    assert secure.status == plain.status == "completed"
    assert secure.secagg.completed == 4 and plain.secagg is None
    # the same seed, the same clients, rounds and data; only quantisation noise (~1e-6 per value) differs
    assert abs(secure.average_accuracy - plain.average_accuracy) < 2.0
    for a, b in zip(secure.accuracy_matrix[-1], plain.accuracy_matrix[-1]):
        assert abs(a - b) < 3.0
    record = next(e for e in events(tmp_path / "secure") if e["event"] == "round")["secagg"]
    assert (record["neighbors"], record["threshold"]) == (3, 2)


# --------------------------------------------------------------------------- units: config, messages, layout

@pytest.mark.parametrize("overrides, why", [
    ({"rounds": {"late_updates": "next_round"}}, "cannot be combined with --late-updates next_round"),
    ({"rounds": {"clients_per_round": 2, "min_participants": 1}}, "at least 3 clients per round"),
    ({"secagg": {"enabled": True, "neighbors": 3, "threshold": 4}}, "exceeds secagg.neighbors"),
])
def test_bad_secagg_settings_are_named(overrides, why):
    data = {"secagg": {"enabled": True}, **overrides}
    with pytest.raises(ValueError, match=why):
        RunConfig.model_validate(data)


def test_a_method_with_individual_uploads_cannot_use_secagg(monkeypatch):
    class PrototypeServer(ServerPart):
        individual_payload = "glfc/prototype_gradients"

    base = registry.get("fedavg")
    spec = registry.MethodSpec("prototypes", "test method", base.options, PrototypeServer, base.client)
    monkeypatch.setitem(registry._REGISTRY, spec.name, spec)
    with pytest.raises(ValueError, match="uploads glfc/prototype_gradients per client"):
        RunConfig.model_validate({"method": "prototypes", "secagg": {"enabled": True}})
    RunConfig.model_validate({"method": "prototypes"})  # fine without secure aggregation


def _secure_round(n: int = 4) -> tuple[SecureRound, dict]:
    """A round over n clients, opened: its setup messages sent (returned)."""
    layout = DeltaLayout(("w",), ((3,),))
    metrics = types.SimpleNamespace(secagg_phase=lambda *a: None, secagg_round=lambda **k: None)
    sent = []
    sr = SecureRound([f"c{i}" for i in range(n)], layout, SecAggSettings(neighbors=3, phase_timeout_s=1.0),
                     run_id="r", number=1, seed=0, send=lambda *a: sent.append(a) or True, metrics=metrics)
    return sr, sr.setup_messages()


def test_a_malformed_secagg_reply_is_rejected_and_a_late_one_ignored():
    sr, _ = _secure_round()
    bad = Message("secagg_keys", SecAggKeys(c_pk=b"short", s_pk=b"x" * 32), round=1)
    with pytest.raises(WireError) as info:
        sr.on_message("c0", bad)
    assert info.value.reason == "secagg" and "c_pk" in info.value.detail
    stranger = Message("secagg_keys", SecAggKeys(c_pk=b"a" * 32, s_pk=b"b" * 32), round=1)
    with pytest.raises(WireError, match="unknown client"):
        sr.on_message("intruder", stranger)
    late = Message("secagg_masked", SecAggMasked(train_time_s=0.0, loss=0.0), {"y": np.zeros(4, np.uint32)}, round=1)
    assert sr.on_message("c0", late) is False  # the round is still in key advertisement: not its phase


def test_setup_parameters_are_a_typed_body_with_the_bytes_of_the_protocols_map():
    sr, setups = _secure_round()
    params = sr.server.params
    assert list(msgspec.to_builtins(setups["c0"].params)) == list(params.to_dict())  # noise: only when set
    for client, body in setups.items():
        as_map = {"params": params.to_dict(), "index": body.index, "neighbors": body.neighbors}
        assert msgspec.msgpack.encode(body) == msgspec.msgpack.encode(as_map)  # the bytes a plain map had
        received = decode(encode("secagg_setup", body, sender="coordinator", seq=1, round=1)).body
        protocol = SecAggClient(client)
        protocol.on_setup(plain_body(received))  # what the edge node does with it
        assert protocol.params == params
    good = plain_body(setups["c0"])
    for bad in ({**good["params"], "n": "4"}, {**good["params"], "clip": None}, {**good["params"], "extra": 1},
                {k: v for k, v in good["params"].items() if k != "dim"}):
        raw = msgspec.msgpack.encode({**good, "params": bad})
        with pytest.raises(WireError) as info:
            decode([raw_header(type="secagg_setup", body=msgspec.Raw(raw))])
        assert info.value.reason == "bad_body"


def test_delta_layout_round_trips_and_names_what_does_not_fit():
    model = {"a.weight": np.ones((2, 3), np.float32), "a.bias": np.zeros(2, np.float32),
             "bn.num_batches_tracked": np.zeros((), np.int64)}
    layout = DeltaLayout.of(model)
    assert layout.names == ("a.bias", "a.weight") and layout.dim == 8  # integer buffers stay out
    upload = {DELTA + k: np.arange(v.size, dtype=np.float32).reshape(v.shape) + 1 for k, v in model.items()
              if v.dtype.kind == "f"}
    flat = layout.flatten(upload)
    back = layout.unflatten(flat.astype(np.float64))
    assert all(np.array_equal(back[k], upload[k]) for k in upload)
    with pytest.raises(ValueError, match="lacks the deltas"):
        layout.flatten({DELTA + "a.bias": upload[DELTA + "a.bias"]})
    with pytest.raises(ValueError, match="has shape"):
        layout.flatten({**upload, DELTA + "a.weight": np.ones(6, np.float32)})
    with pytest.raises(ValueError, match="does not fit"):
        layout.unflatten(np.zeros(7))


def test_the_wire_s_secagg_params_are_the_protocol_s_round_params():
    """``wire.messages.SecAggParams`` mirrors ``secagg.protocol.RoundParams`` (``round`` is ``round_id``): the
    same fields in the same order with the same types, and the noise's likewise, so a field added to one side
    alone fails here; a setup's params encode to the same bytes through either and decode back to equal params."""
    import dataclasses
    import typing

    from fcl_emu.secagg.noise import DistributedNoise
    from fcl_emu.secagg.protocol import RoundParams
    from fcl_emu.wire.messages import SecAggNoise, SecAggParams

    def wire_fields(struct) -> list[tuple[str, object]]:
        hints = typing.get_type_hints(struct)
        return [(name, hints[name]) for name in struct.__struct_fields__]

    def protocol_fields(cls, rename=None) -> list[tuple[str, object]]:
        hints = typing.get_type_hints(cls)
        return [((rename or {}).get(f.name, f.name), hints[f.name]) for f in dataclasses.fields(cls)]

    wire, protocol = wire_fields(SecAggParams), protocol_fields(RoundParams, {"round_id": "round"})
    assert [n for n, _ in wire] == [n for n, _ in protocol]
    assert [t for n, t in wire if n != "noise"] == [t for n, t in protocol if n != "noise"]
    assert dict(wire)["noise"] == SecAggNoise | None and dict(protocol)["noise"] == DistributedNoise | None
    assert wire_fields(SecAggNoise) == protocol_fields(DistributedNoise)
    for noise in (None, DistributedNoise(1.1, 8)):
        params = RoundParams(round_id=2**63 + 5, n=8, dim=1000, neighbors=6, threshold=4, ring_bits=32, clip=2.5,
                             max_weight=1 if noise else 300, noise=noise)
        on_wire = msgspec.convert(params.to_dict(), SecAggParams)
        assert msgspec.msgpack.encode(on_wire) == msgspec.msgpack.encode(params.to_dict())
        assert RoundParams.from_dict(msgspec.to_builtins(on_wire)) == params
