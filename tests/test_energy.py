"""Device classes, energy and batteries on the emulated clock (docs/edge.md, "Devices, energy and batteries")."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pydantic
import pytest
from prometheus_client import generate_latest

from fcl_emu.coordinator.emulated import ClientRound
from fcl_emu.coordinator.energy import Battery, EnergyLedger, _Windows
from fcl_emu.methods import registry
from fcl_emu.methods.models.flops import synthetic_replay_work, training_flops_per_sample
from fcl_emu.monitoring.metrics import CoordinatorMetrics
from fcl_emu.runconfig import RunConfig
from fcl_emu.scenario.device_classes import DEFAULT_CLASSES
from fcl_emu.scenario.devices import DeviceProfile, DeviceSet, ProfilesFile
from fcl_emu.scenario.energy import RADIOS, round_energy
from tests.conftest import events, fcl_emu, seeded_run


def test_radio_energy_is_huangs_linear_power_model_plus_the_lte_tail():
    lte = RADIOS["lte"]
    # 1.5 MB up at 6 Mbit/s: 2 s at 438.39 x 6 + 1288.04 = 3918.38 mW, then 11.576 s of tail at 1060 mW
    assert lte.transfer_j("up", 1_500_000, 750_000) == pytest.approx(7.83676 + 12.27056)
    # 1.3 MB down at 13 Mbit/s: 0.8 s at 51.97 x 13 + 1288.04 = 1963.65 mW
    assert lte.transfer_j("down", 1_300_000, 1_625_000) == pytest.approx(1.57092 + 12.27056)
    # Wi-Fi: no tail; 2 MB up at 20 Mbit/s: 0.8 s at 283.17 x 20 + 132.86 = 5796.26 mW
    assert RADIOS["wifi"].transfer_j("up", 2_000_000, 2_500_000) == pytest.approx(4.637008)
    assert lte.transfer_j("up", 0, 750_000) == 0.0  # nothing sent: the radio stays asleep


def test_a_rounds_energy_is_compute_power_times_compute_time_plus_both_transfers():
    phone = DeviceProfile(name="p", uplink_bytes_s=750_000, downlink_bytes_s=1_625_000, compute_w=3.0,
                          radio=RADIOS["lte"])
    energy = round_energy(phone, 1_300_000, 1_500_000, compute_s=2.5)
    assert energy.compute == pytest.approx(7.5)
    assert energy.radio == pytest.approx(1.57092 + 7.83676 + 2 * 12.27056)
    assert round_energy(phone, 1_300_000, 0, compute_s=None).compute == 0.0  # crashed before it trained


def test_training_work_is_counted_once_per_model_and_scaled_by_the_method():
    cnn = training_flops_per_sample("cnn", (1, 28, 28), 10)
    # the CNN's convolutions and linear layers, forward (a multiply-add is 2) and backward (twice that)
    assert cnn == pytest.approx(24_167_424)
    assert training_flops_per_sample("resnet18", (3, 32, 32), 100) > 100 * cnn
    fedavg, mfcl = registry.get("fedavg"), registry.get("mfcl")
    assert fedavg.client.work_per_sample(fedavg.options(), 16, 3) == 1.0
    options = mfcl.options(synthetic_batch=128)
    assert mfcl.client.work_per_sample(options, 32, 0) == 1.0  # no old model in the first task
    assert mfcl.client.work_per_sample(options, 32, 1) == pytest.approx(1 + 4 * 4 / 3)
    assert synthetic_replay_work(128, 32, 1) == pytest.approx(1 + 4 * 4 / 3)


def test_the_default_mix_turns_throughput_into_a_per_sample_cost_for_each_task():
    devices = DeviceSet(DEFAULT_CLASSES, work=lambda task: 30e6 * (1 + task))
    drawn = [devices.assign(i, seed=0) for i in range(200)]
    assert {p.name for p in drawn} == {"phone-high", "phone-mid", "phone-low"}
    for p in drawn:
        gflops = {"phone-high": 30, "phone-mid": 15, "phone-low": 5}[p.name]
        assert p.ms_per_sample == pytest.approx(30e6 / (gflops * 1e9) * 1000)
        assert devices.in_task(p, 2).ms_per_sample == pytest.approx(3 * p.ms_per_sample)
        assert 0.3 <= p.initial_charge <= 1.0 and p.battery_j > 50_000
        assert "compute_w" not in p.to_wire()  # the energy part stays with the coordinator
    assert drawn == [devices.assign(i, seed=0) for i in range(200)]  # seeded
    measured = DeviceSet(DEFAULT_CLASSES, work=lambda task: 30e6, measured=True).assign(0, seed=0)
    assert measured.ms_per_sample is None and measured.gflops is None


@pytest.mark.parametrize("profile, message", [
    ({"name": "x", "gflops": 10, "ms_per_sample": 2}, "one of compute_factor, ms_per_sample and gflops"),
    ({"name": "x", "compute": "measured", "gflops": 10}, "compute: measured takes compute_factor"),
    ({"name": "x", "compute": "modelled"}, "compute: modelled needs ms_per_sample or gflops"),
    ({"name": "x", "radio": "5g"}, "radio '5g': one of wifi, lte"),
    ({"name": "x", "initial_charge": {"uniform": [0.5, 1.5]}}, "initial_charge is a fraction"),
    ({"name": "x", "compute_w": -1}, "compute_w must be positive or zero"),
    ({"name": "x", "radio": {"up_mw_per_mbps": 1, "down_mw_per_mbps": 1}}, "base_mw"),
])
def test_bad_device_profiles_are_refused_naming_the_problem(profile, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        ProfilesFile.model_validate({"profiles": [profile]})


def test_a_battery_drains_idle_and_charges_in_its_availability_windows():
    profile = DeviceProfile(battery_j=1000.0, initial_charge=0.5, idle_w=1.0)
    # available until 10 s, away until 20 s, available after
    windows = _Windows(iter([(10.0, False), (20.0, True)]))
    charging = Battery(profile, windows, "available", charge_w=3.0)
    assert charging.at(30.0) == pytest.approx((500 - 30 + 3 * 20) / 1000)
    away = Battery(profile, _Windows(iter([(10.0, False), (20.0, True)])), "away", charge_w=3.0)
    assert away.at(30.0) == pytest.approx((500 - 30 + 3 * 10) / 1000)
    never = Battery(profile, None, "never", charge_w=3.0)
    never.spend(200.0, 10.0)
    assert never.at(10.0) == pytest.approx((500 - 10 - 200) / 1000)
    never.spend(10_000.0, 20.0)
    assert never.at(1e6) == 0.0  # empty, not negative


def test_energy_is_exported_by_device_class_and_kind():
    phone = DeviceProfile(name="phone-mid", uplink_bytes_s=750_000, downlink_bytes_s=1_625_000, compute_w=3.0,
                          radio=RADIOS["lte"], battery_j=50_000.0)
    State = SimpleNamespace(metrics=CoordinatorMetrics(), config=RunConfig(),
                            registry=SimpleNamespace(records={"client-0001": SimpleNamespace(profile=phone, index=1)}))
    ledger = EnergyLedger(State, availability=None)
    spent = ledger.spend({"client-0001": ClientRound(phone, down_bytes=1_300_000, up_bytes=1_500_000,
                                                     compute_s=2.5)}, now=5.0)
    assert spent["client-0001"][0] == pytest.approx(7.5)
    text = generate_latest(State.metrics.registry).decode()
    assert 'fcl_energy_joules_total{device_class="phone-mid",kind="compute"} 7.5' in text
    assert 'fcl_energy_joules_total{device_class="phone-mid",kind="radio"}' in text
    assert ledger.summary(5.0)["by_device_class"]["phone-mid"]["compute"] == pytest.approx(7.5)
    assert "fcl_battery_level_ratio_bucket" in text and ledger.batteries["client-0001"].joules < 50_000


@pytest.mark.parametrize("charging", ["never", "available"])
def test_the_ledger_looks_only_at_due_batteries_and_finds_who_sits_out_as_a_look_at_every_one_would(
        charging, monkeypatch):
    """The ledger's check looks at a battery only when it may have crossed the threshold; at every round start
    the clients sitting out are those a look at every battery finds, while some spend energy in rounds."""
    import random

    from fcl_emu.coordinator.clients import ClientRegistry
    from fcl_emu.scenario.availability import parse_availability

    config = RunConfig.model_validate({"edge": {"min_battery": 0.2, "charging": charging, "charge_w": 0.04}})
    registry = ClientRegistry(liveness_timeout_s=10.0)
    state = SimpleNamespace(config=config, registry=registry, metrics=CoordinatorMetrics(),
                            event=lambda kind, **fields: None)
    rng = random.Random(1)
    for i in range(60):
        registry.join(f"c{i}", i, "n", 0)  # batteries about the threshold, draining at 0.001-0.02 W
        registry.records[f"c{i}"].profile = DeviceProfile(battery_j=100.0, initial_charge=rng.uniform(0.15, 0.3),
                                                          idle_w=rng.uniform(0.001, 0.02), compute_w=1.0)
    ledger = EnergyLedger(state, availability=parse_availability("onoff:30:30"))
    full = EnergyLedger(state, availability=parse_availability("onoff:30:30"))  # every battery looked at below
    for client in registry.records:
        ledger.joined(client)
    looks, counting = [], [False]
    at = Battery.at
    monkeypatch.setattr(Battery, "at", lambda self, t: (looks.append(1) if counting[0] else None, at(self, t))[1])
    checks = 0
    for now in range(0, 400, 7):
        if now == 203:  # ten more join late: looked at from their join on
            for i in range(60, 70):
                registry.join(f"c{i}", i, "n", 0)
                registry.records[f"c{i}"].profile = DeviceProfile(
                    battery_j=100.0, initial_charge=0.1 if i == 60 else 0.3, idle_w=0.01, compute_w=1.0)
                ledger.joined(f"c{i}")
        counting[0] = True
        ledger.check(float(now))
        counting[0], checks = False, checks + 1
        expected = {c for c in registry.records if full.battery(c).at(now) < 0.2}
        assert ledger.sitting_out == expected, now
        assert {r.client_id for r in registry.eligible(0)} == set(registry.records) - expected
        working = sorted(set(registry.records) - expected)
        timeline = {c: ClientRound(registry.records[c].profile, compute_s=2.0)
                    for c in rng.sample(working, min(1, len(working)))}
        ledger.spend(timeline, float(now))
        full.spend(timeline, float(now))
    assert 0 < len(ledger.sitting_out) < 70 and "c60" in ledger.sitting_out  # low from its join
    assert len(looks) < checks * 60 / 4  # far fewer looks than one per battery per round


@pytest.mark.slow
def test_clients_with_a_low_battery_sit_rounds_out_and_a_run_reports_its_energy(tmp_path, mnist_root):
    """The default device mix draws initial charges of 30-100 %: with ``min_battery`` 0.6 about 40 % of the
    clients start below it. They are never selected, each is recorded (a ``battery`` event, the rounds'
    ``low_battery``), and summary.json gives the energy spent by class and kind."""
    summary, rounds = seeded_run(tmp_path, mnist_root, "battery", scenario={"num_clients": 10, "num_tasks": 1,
                                                                           "samples_per_client_task": 50},
                                 rounds={"clients_per_round": 4, "rounds_per_task": 3, "eval_every": 3},
                                 training={"local_epochs": 1}, edge={"min_battery": 0.6}, seed=3)
    low = {e["client"] for e in events(tmp_path / "battery") if e.get("event") == "battery" and e["sitting_out"]}
    assert 0 < len(low) < 10
    assert all(r["low_battery"] >= len(low) for r in rounds)
    assert not any(set(r["energy_j"]) & low for r in rounds)  # none of them worked
    assert all(set(r["energy_j"]) >= set(r["contributors"]) for r in rounds)
    energy = summary.energy_joules
    assert energy.total == pytest.approx(sum(sum(sum(v) for v in r["energy_j"].values()) for r in rounds))
    assert energy.total == pytest.approx(sum(energy.by_kind.values())) and energy.by_kind["radio"] > 0
    assert energy.sat_out_rounds >= 3 * len(low) and energy.sitting_out_at_end >= len(low)
    assert energy.to_accuracy and energy.to_accuracy[0].accuracy == 10


@pytest.mark.slow
def test_bench_energy_measures_its_baseline_and_plots_it(tmp_path, mnist_root):
    """One case, the baseline alone (each case is one run; the low-battery run has its own test above)."""
    out, plot = tmp_path / "energy.json", tmp_path / "energy.png"
    proc = fcl_emu("bench", "energy", "--cases", "fedavg", "--clients", "6", "--clients-per-round", "3",
                   "--rounds", "1", "--samples", "50", "--target-accuracy", "10", "--json", str(out), "--plot",
                   str(plot), "--data-root", str(mnist_root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                   text=True)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    result = json.loads(out.read_text())
    base, = result["rows"]
    assert base["case"] == "fedavg" and base["energy ratio"] == base["to-target ratio"] == 1.0
    assert base["energy (kJ)"] > 0 and 0 < base["compute share (%)"] < 100 and base["kJ to 10 %"] is not None
    assert base["sat out (client-rounds)"] == 0 and base["pays most (J per job)"].startswith("phone-")
    assert plot.stat().st_size > 0


def test_a_run_warns_of_device_classes_that_cannot_make_the_deadline(tmp_path, mnist_root):
    """The MNIST CNN's round takes every class a few seconds; a 2 s deadline is too short for the LTE phones
    (a 1.1 MB update at 2 or 6 Mbit/s), not for Wi-Fi's."""
    from fcl_emu.coordinator.advice import slow_classes
    from fcl_emu.coordinator.lifecycle import Coordinator

    def slow(deadline_s: float, **rounds) -> list:
        config = RunConfig.model_validate({
            "scenario": {"num_clients": 20, "samples_per_client_task": 50}, "model": "cnn", "device": "cpu",
            "rounds": {"deadline_s": deadline_s, **rounds}, "security": {"transport": "plain"},
            "network": {"bind": "tcp://127.0.0.1:0"}, "data_root": [str(mnist_root)]})
        coordinator = Coordinator(config)
        try:
            return slow_classes(coordinator.config, coordinator.state)
        finally:
            coordinator.close()

    warning, = slow(2.0)
    assert warning.setting == "rounds.deadline_s" and "(phone-low, phone-mid)" in warning.message
    assert "--round-deadline" in warning.message
    assert slow(120.0) == []
