"""Distributed DP under SecAgg+ (secagg/noise.py, coordinator/privacy.py): the clients' Skellam shares sum to the
central mechanism's noise (less with dropouts), the ring holds clipped sum plus noise and decodes negative sums,
the accountant charges what central DP charges for the same multiplier and sampling (more after dropouts), the
configuration's refusals, the typed setup; and a real SecAgg+ run with distributed DP and signed keys, one of
whose rounds has a public key swapped in transit."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.coordinator.privacy import CentralPrivacy, DistributedPrivacy
from fcl_emu.coordinator.secure_round import SecureRound
from fcl_emu.edge_node.node import EdgeNode
from fcl_emu.aggregation.update import DELTA, ClientUpdate, DeltaLayout
from fcl_emu.runconfig import RunConfig, load_config
from fcl_emu.runconfig.config import PrivacyConfig
from fcl_emu.secagg.noise import FAILURE_PROBABILITY, MAX_POISSON_MEAN, DistributedNoise
from fcl_emu.secagg.protocol import RoundParams, SecAggError, keypair
from fcl_emu.secagg.server import SecAggServer
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.secagg.simulation import simulate_round
from tests.conftest import events, keyed, raw_header, run_beside, small_config
from fcl_emu.wire.auth import ClientKeyring
from fcl_emu.wire.framing import WireError, decode, encode
from fcl_emu.wire.messages import plain_body

needs_accountant = pytest.mark.skipif(importlib.util.find_spec("dp_accounting") is None,
                                      reason="dp-accounting is not installed (pip install 'fcl-emu[dp]')")

ROSTER = [f"c{i}" for i in range(5)]
DDP = SecAggSettings(neighbors=4, clip=1.0, max_weight=1)


def _round(inputs: dict[str, np.ndarray], noise: DistributedNoise, dropout=None):
    dim = len(next(iter(inputs.values())))
    server = SecAggServer(list(inputs), dim, DDP, round_id=9, seed=0, noise=noise)
    result = simulate_round(list(inputs), dim, lambda c: (inputs[c], 30, np.random.default_rng(1)), DDP,
                            round_id=9, server=server, dropout=dropout)
    return result, server.params


# ------------------------------------------------------------------------------------------------ the noise
@pytest.mark.parametrize("dropped", [0, 1])
def test_the_survivors_noise_has_the_central_variance_scaled_by_m_over_k(dropped):
    dim, z = 20_000, 1.0
    noise = DistributedNoise(z, cohort=len(ROSTER))
    result, p = _round({c: np.zeros(dim) for c in ROSTER}, noise, dropout={ROSTER[-1]: 3} if dropped else None)
    total, weight = result.decode()
    m = len(ROSTER) - dropped
    assert weight == m == len(result.clients)  # every client weighs 1
    step = 2 * p.clip / p.levels
    expected = noise.effective_multiplier(m) * noise.sensitivity(p.levels, dim) * step  # about z C sqrt(m/K)
    assert expected == pytest.approx(z * p.clip * math.sqrt(m / len(ROSTER)), rel=1e-3)
    assert total.std() == pytest.approx(expected, rel=0.03)
    assert abs(total.mean()) < 4 * expected / math.sqrt(dim)


def test_clients_clip_to_the_l2_norm_and_negative_sums_decode_without_wrapping():
    dim = 64
    inputs = {c: -np.full(dim, 5.0) for c in ROSTER}  # norm 40: clipped to 1, every value -1/8
    result, p = _round(inputs, DistributedNoise(0.0, cohort=len(ROSTER)))
    total, _ = result.decode()
    step = 2 * p.clip / p.levels
    np.testing.assert_allclose(total, -len(ROSTER) / math.sqrt(dim), atol=len(ROSTER) * step)
    noised, p = _round(inputs, DistributedNoise(2.0, cohort=len(ROSTER)))
    assert abs(noised.decode()[0].mean() + len(ROSTER) / 8) < 8 * 2.0 / math.sqrt(dim)


def test_the_ring_holds_the_clipped_sum_and_the_noise_or_is_refused():
    noise = DistributedNoise(1.0, cohort=30)
    n, dim = 33, 10**6
    levels = noise.levels(32, n, dim)
    sigma = math.sqrt(n * noise.share_variance(levels, dim))
    log_term = math.log(2 * dim / FAILURE_PROBABILITY)
    assert n * levels / 2 + math.sqrt(2 * log_term) * sigma + 2 * log_term / 3 <= 2**31 - 1
    assert noise.share_variance(levels, dim) / 2 <= MAX_POISSON_MEAN  # numpy's sampler is exact enough there
    assert levels > 2**23 and math.sqrt(dim) / (levels / 2) < 2e-4  # fine: the rounding adds 0.02 % to Delta
    with pytest.raises(SecAggError, match="cannot hold the clipped sum of 33 clients.*raise secagg.ring_bits"):
        RoundParams(round_id=1, n=n, dim=dim, neighbors=8, threshold=5, ring_bits=8, clip=1.0, max_weight=1,
                    noise=noise)
    with pytest.raises(SecAggError, match="every client weighs 1"):
        RoundParams(round_id=1, n=n, dim=dim, neighbors=8, threshold=5, ring_bits=32, clip=1.0, max_weight=7,
                    noise=noise)


def test_the_setup_carries_the_noise_typed_and_without_it_the_bytes_of_before():
    layout = DeltaLayout(("w",), ((3,),))
    metrics = type("M", (), {"secagg_phase": lambda *a: None, "secagg_round": lambda *a, **k: None})()
    for noise in (None, DistributedNoise(1.5, 4)):
        sr = SecureRound([f"c{i}" for i in range(4)], layout, SecAggSettings(neighbors=3, max_weight=1),
                         run_id="r", number=1, seed=0, send=lambda *a: True, metrics=metrics, noise=noise)
        body = sr.setup_messages()["c0"]
        as_map = {"params": sr.server.params.to_dict(), "index": body.index, "neighbors": body.neighbors}
        assert msgspec.msgpack.encode(body) == msgspec.msgpack.encode(as_map)
        received = decode(encode("secagg_setup", body, sender="coordinator", seq=1, round=1)).body
        assert RoundParams.from_dict(plain_body(received)["params"]).noise == noise
    bad = {**as_map, "params": {**as_map["params"], "noise": {"multiplier": "a lot", "cohort": 4}}}
    with pytest.raises(WireError) as info:
        decode([raw_header(type="secagg_setup", body=msgspec.Raw(msgspec.msgpack.encode(bad)))])
    assert info.value.reason == "bad_body"
    with pytest.raises(SecAggError, match="bad noise"):
        RoundParams.from_dict({**as_map["params"], "noise": {"multiplier": -1.0, "cohort": 4}})


# ------------------------------------------------------------------------------------------- the accountant
@pytest.mark.slow
@needs_accountant
def test_distributed_dp_charges_what_central_dp_charges_and_more_after_dropouts():
    settings = dict(noise_multiplier=1.0, clip=1.0)
    central = CentralPrivacy(PrivacyConfig(mode="central", **settings), 6, sampling_rate=0.3)
    distributed = DistributedPrivacy(PrivacyConfig(mode="distributed", **settings), 6, sampling_rate=0.3)
    layout = DeltaLayout.of({"w": np.zeros(2, np.float32)})
    summed = ClientUpdate("secagg", 6, {DELTA + "w": np.zeros(2, np.float32)})
    drawn = (6, 20)  # each round: 6 selected of 20 eligible
    for number in (1, 2, 3):
        central.noised_mean([summed], layout, number, drawn)
        assert distributed.release([summed], layout, number, drawn) == [summed]
        for figure in ("epsilon", "epsilon_sampled"):
            assert distributed.report()[figure] == pytest.approx(central.report()[figure], rel=1e-12)
        assert distributed.report()["noise_std"] == pytest.approx(central.report()["noise_std"])
    before = distributed.report()["epsilon"]
    short = ClientUpdate("secagg", 4, summed.tensors)  # 4 of 6 in the sum: z sqrt(4/6)
    distributed.release([short], layout, 4, drawn)
    central.noised_mean([summed], layout, 4, drawn)
    report = distributed.report()
    assert report["noise_multiplier"] == pytest.approx(math.sqrt(4 / 6))
    assert report["epsilon"] > central.report()["epsilon"] > before
    resumed = DistributedPrivacy(PrivacyConfig(mode="distributed", **settings), 6, sampling_rate=0.3)
    records = [type("R", (), {"privacy": {"steps": s, "noise_multiplier": z}, "selected": 6, "eligible": 20})()
               for s, z in ((1, 1.0), (2, 1.0), (3, 1.0), (4, math.sqrt(4 / 6)))]
    resumed.restore(records)
    for figure in ("epsilon", "epsilon_sampled"):
        assert resumed.report()[figure] == pytest.approx(report[figure], rel=1e-12)


# ----------------------------------------------------------------------------------------------- the config
@needs_accountant
@pytest.mark.parametrize("privacy, secagg, refusal", [
    ({"mode": "distributed"}, {}, "needs --secagg"),
    ({"mode": "distributed", "adaptive": {"enabled": True}}, {"enabled": True}, "fixed norm"),
    ({"mode": "distributed"}, {"enabled": True, "ring_bits": 8}, "ring cannot hold .* raise secagg.ring_bits"),
    ({"mode": "central"}, {"enabled": True}, "use --privacy distributed"),
])
def test_the_config_refuses_what_distributed_dp_cannot_cover(privacy, secagg, refusal):
    with pytest.raises(ValueError, match=refusal) as info:
        RunConfig.model_validate({"privacy": privacy, "secagg": secagg})
    assert "\n" not in str(info.value).split("Value error, ", 1)[-1].split(" [type=")[0]  # one line


@needs_accountant
def test_distributed_dp_under_secagg_is_accepted():
    config = RunConfig.model_validate({"privacy": {"mode": "distributed"}, "secagg": {"enabled": True}})
    assert config.privacy.distributed and not config.privacy.central


# -------------------------------------------------------------------------------------------- a real run
@pytest.mark.slow
@needs_accountant
def test_a_secagg_run_with_distributed_dp_reports_central_epsilon_and_refuses_a_swapped_key(
        tmp_path, mnist_root, one_torch_thread):
    """Three SecAgg+ rounds of 6 clients with distributed DP, coordinator and two edge nodes in this process;
    in round 2 the coordinator swaps one client's public key on its way to one neighbour."""
    # 200 samples a client: the assertions read the protocol and the accountant, not how well the model trains
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 20, "num_tasks": 1,
                                                                      "samples_per_client_task": 200},
                                      rounds={"clients_per_round": 6, "rounds_per_task": 3, "eval_every": 10},
                                      training={"local_epochs": 1},
                                      secagg={"enabled": True, "neighbors": 5, "threshold": 3},
                                      privacy={"mode": "distributed", "noise_multiplier": 1.0, "clip": 0.01}),
                         {"data_root": [str(mnist_root)]})
    config, node_keys = keyed(config, tmp_path / "keys")
    coordinator = Coordinator(config)
    swapped: list[str] = []
    close_keys = SecAggServer.close_keys

    def tampered(self):
        out = close_keys(self)
        if self.params.round_id == coordinator_round(2) and not swapped:
            victim = sorted(out)[0]
            receiver = next(c for c in sorted(out) if victim in out[c]["keys"])
            out[receiver]["keys"][victim] = {**out[receiver]["keys"][victim], "s_pk": keypair()[1]}
            swapped.append(victim)
        return out

    def coordinator_round(number: int) -> int:
        from fcl_emu.coordinator.secure_round import round_id
        return round_id(coordinator.run_id, number)

    keyring = ClientKeyring(Path(node_keys[1]), Path(node_keys[3]))
    nodes = [EdgeNode(coordinator.address, list(ix), name=f"node-{i}", data_roots=[mnist_root],
                      state_dir=tmp_path / f"state-{i}", keys=keyring, secure=True)
             for i, ix in enumerate((range(10), range(10, 20)))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SecAggServer, "close_keys", tampered)
        summary = run_beside(coordinator, nodes, tmp_path / "run")
    assert summary.status == "completed"
    rounds = [e for e in events(tmp_path / "run") if e["event"] == "round"]
    assert [r["secagg"]["outcome"] for r in rounds] == ["completed"] * 3
    assert [r["secagg"]["refused_keys"] for r in rounds] == [0, 1, 0] and len(swapped) == 1
    assert [r["participants"] for r in rounds] == [6, 5, 6]
    central = CentralPrivacy(PrivacyConfig(mode="central", noise_multiplier=1.0, clip=0.01), 6, sampling_rate=6 / 20)
    layout = DeltaLayout.of({"w": np.zeros(1, np.float32)})
    first = central.noised_mean([], layout, 1) and central.report()["epsilon"]
    assert rounds[0]["privacy"]["epsilon"] == pytest.approx(first, rel=1e-12)  # the same as central DP's
    assert rounds[1]["privacy"]["noise_multiplier"] == pytest.approx(math.sqrt(5 / 6))
    central.noised_mean([], layout, 2)
    assert rounds[1]["privacy"]["epsilon"] > central.report()["epsilon"]  # 5 of 6 added noise: charged more
    assert summary.privacy.mode == "distributed" and summary.privacy.steps == 3
    assert summary.privacy.epsilon == rounds[2]["privacy"]["epsilon"]
