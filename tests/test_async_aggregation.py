"""Asynchronous aggregation (``--aggregation fedbuff|fedasync``, coordinator/async_rounds.py): the staleness
weights by hand, the refusals in one line, and whole runs that are bit-identical across edge-node counts."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import yaml
from prometheus_client import generate_latest

from fcl_emu.aggregation.policies.fedasync import fedasync_mixing, fedasync_update
from fcl_emu.aggregation.policies.fedbuff import fedbuff_update, fedbuff_weight
from fcl_emu.methods import registry
from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.methods.requirements import ASYNC
from fcl_emu.monitoring.metrics import CoordinatorMetrics
from fcl_emu.monitoring.results import RunSummary
from fcl_emu.runconfig import RunConfig
from tests.conftest import events, exit_code, fcl_emu, small_config
from tests.test_config_cli import invoke


# ------------------------------------------------------------------ the formulas
def test_fedbuff_weight_is_one_over_the_root_of_one_plus_staleness():
    assert fedbuff_weight(0) == 1.0
    assert fedbuff_weight(1) == pytest.approx(0.7071067811865476)
    assert fedbuff_weight(3) == 0.5
    assert fedbuff_weight(8) == pytest.approx(1 / 3)


def test_fedasync_mixing_is_alpha_times_the_polynomial_staleness_function():
    assert fedasync_mixing(0.6, 0.5, 0) == pytest.approx(0.6)
    assert fedasync_mixing(0.6, 0.5, 3) == pytest.approx(0.3)  # 0.6 * 4 ** -0.5
    assert fedasync_mixing(0.5, 1.0, 1) == pytest.approx(0.25)
    assert fedasync_mixing(0.8, 0.0, 7) == pytest.approx(0.8)  # a = 0: constant mixing


def test_fedbuff_update_weights_float_deltas_and_keeps_integer_buffers():
    update = ClientUpdate("c", 10, {"delta/w": np.array([2.0, -4.0], np.float32),
                                    "delta/bn.num_batches_tracked": np.array(5, np.int64)})
    out = fedbuff_update(update, staleness=3)
    np.testing.assert_array_equal(out.tensors["delta/w"], [1.0, -2.0])
    assert out.tensors["delta/w"].dtype == np.float32
    assert out.tensors["delta/bn.num_batches_tracked"] == 5 and out.num_samples == 10


def test_fedasync_update_takes_the_model_to_the_mix_of_the_current_and_the_clients_model():
    # current x = 2, the client was sent 1 and trained to 1 + 3 = 4; a = 0.6 * (1 + 3) ** -0.5 = 0.3:
    # x <- 0.7 * 2 + 0.3 * 4 = 2.6, a delta of 0.6
    update = ClientUpdate("c", 10, {"delta/w": np.array([3.0], np.float32)})
    out = fedasync_update(update, 3, 0.6, 0.5, sent={"w": np.array([1.0], np.float32)},
                          current={"w": np.array([2.0], np.float32)})
    assert 2.0 + out.tensors["delta/w"][0] == pytest.approx(2.6)


def test_staleness_is_exported_as_a_histogram():
    metrics = CoordinatorMetrics()
    metrics.updates_applied([0, 1, 1, 5])
    metrics.stale_update_discarded("too_stale")
    text = generate_latest(metrics.registry).decode()
    assert 'fcl_update_staleness_versions_bucket{le="1.0"} 3.0' in text
    assert "fcl_update_staleness_versions_count 4.0" in text and "fcl_update_staleness_versions_sum 7.0" in text
    assert 'fcl_stale_updates_discarded_total{reason="too_stale"} 1.0' in text


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("name", registry.names())
def test_the_config_refuses_asynchronous_aggregation_exactly_where_the_method_says(name):
    spec = registry.get(name)
    data = {"method": name, "aggregation": {"policy": "fedbuff"}}
    if ASYNC in spec.refusals:
        with pytest.raises(ValueError, match=re.escape(f"--aggregation fedbuff: {spec.refusals[ASYNC]}")):
            RunConfig.model_validate(data)
    else:
        assert RunConfig.model_validate(data).aggregation.asynchronous


def test_the_required_methods_take_asynchronous_aggregation():
    for name in ("fedavg", "finetune", "fedprox", "fedlwf2t", "mfcl", "target"):
        assert ASYNC not in registry.get(name).refusals, name


@pytest.mark.parametrize("args,expected", [
    (["--aggregation", "bulk"], "--aggregation"),
    (["--aggregation", "fedbuff", "--buffer", "0"], "--buffer"),
    (["--aggregation", "fedbuff", "--max-staleness", "-1"], "--max-staleness"),
    (["--aggregation", "fedbuff", "--concurrency", "0"], "--concurrency"),
    (["--aggregation", "fedasync", "--async-alpha", "0"], "--async-alpha"),
    (["--aggregation", "fedasync", "--async-alpha", "1.5"], "--async-alpha"),
    (["--aggregation", "fedasync", "--async-staleness-exponent", "-1"], "--async-staleness-exponent"),
    (["--aggregation", "fedbuff", "--clients", "10", "--concurrency", "11"], "--concurrency 11 exceeds"),
    (["--aggregation", "fedbuff", "--method", "glfc"], "--aggregation fedbuff: the server of method 'glfc'"),
    (["--aggregation", "fedasync", "--secagg"], "--aggregation fedasync cannot be combined with --secagg"),
    (["--aggregation", "fedbuff", "--clock", "real"], "--aggregation fedbuff runs on the emulated clock"),
    (["--aggregation", "fedbuff", "--crash-rate", "0.1"], "does not draw crashes"),
])
def test_bad_asynchronous_options_are_refused_in_one_line(args, expected):
    code, output = invoke("up", *args)
    assert code == 2 and expected in output, output
    assert "Traceback" not in output


# ------------------------------------------------------------------ whole runs
def _device_profiles(tmp_path, slow_share: float = 0.0):
    """Fixed-cost phones (emulated times exact), a ``slow_share`` of them ten times slower."""
    phone = {"ms_per_sample": 3.0, "uplink_mbps": 20, "downlink_mbps": 20, "latency_ms": 50}
    profiles = [{"name": "fast", **phone, "share": 1 - slow_share}]
    if slow_share:
        profiles.append({"name": "slow", **phone, "ms_per_sample": 30.0, "share": slow_share})
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump({"profiles": profiles}))
    return path


def _run(tmp_path, name: str, mnist_root, aggregation: dict, *flags: str, slow_share: float | None = 0.0):
    """``slow_share`` None: no profiles file, the default device mix."""
    edge = {} if slow_share is None else {"device_profiles": str(_device_profiles(tmp_path, slow_share))}
    config = small_config(tmp_path / f"{name}.yaml", scenario={"num_clients": 12, "samples_per_client_task": 40},
                          rounds={"clients_per_round": 4, "rounds_per_task": 2, "eval_every": 2},
                          training={"local_epochs": 1, "batch_size": 32}, aggregation=aggregation, edge=edge)
    run_dir = tmp_path / name
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir),
                   "--insecure", "--seed", "5", *flags, stdout=open(tmp_path / f"{name}.log", "w"), stderr=-2)
    assert exit_code(proc, 240, tmp_path / f"{name}.log") == 0
    return RunSummary.load(run_dir / "summary.json"), events(run_dir)


@pytest.mark.slow
def test_a_fedbuff_run_is_bit_identical_across_edge_node_counts(tmp_path, mnist_root):
    """With no profiles file (the default device mix: compute from each class's throughput), one edge node and
    three give the same aggregations, the same energy and the same accuracy matrix."""
    aggregation = {"policy": {"name": "fedbuff", "buffer": 2, "concurrency": 4}}
    runs = [_run(tmp_path, f"nodes{n}", mnist_root, aggregation, "--nodes", str(n), slow_share=None)
            for n in (1, 3)]
    (one, one_events), (three, three_events) = runs
    assert one.status == three.status == "completed"
    assert one.accuracy_matrix == three.accuracy_matrix
    assert one.energy_joules == three.energy_joules and one.energy_joules.total > 0
    assert set(one.energy_joules.by_device_class) == {"phone-high", "phone-mid", "phone-low"}

    def per_aggregation(evs):
        return ([(e["round"], e["contributors"], e["emulated_clock_s"], e["energy_j"]) for e in evs
                 if e["event"] == "round"],
                [(e["clients"], e["staleness"]) for e in evs if e["event"] == "async_aggregation"])

    assert per_aggregation(one_events) == per_aggregation(three_events)
    rounds = [e for e in one_events if e["event"] == "round"]
    applied = [e for e in one_events if e["event"] == "async_aggregation"]
    assert len(rounds) == len(applied) == 4 and all(len(e["clients"]) == 2 for e in applied)
    staleness = [s for e in applied for s in e["staleness"]]
    assert max(staleness) >= 1  # four clients training, two per aggregation: some were sent an older model
    for e in applied:
        assert e["weights"] == [pytest.approx(1 / math.sqrt(1 + s)) for s in e["staleness"]]
    # a task's last aggregation leaves updates in flight, trained on that task's classes: discarded
    assert applied[1]["discarded_task_end"] > 0 and rounds[1]["bytes_discarded"] > 0
    clocks = [r["emulated_clock_s"] for r in rounds]
    assert clocks == sorted(clocks) and clocks[0] > 0


@pytest.mark.slow
def test_fedasync_mixes_each_update_and_discards_the_too_stale(tmp_path, mnist_root):
    summary, evs = _run(tmp_path, "fedasync", mnist_root, {"policy": {"name": "fedasync", "concurrency": 4,
                                                                       "max_staleness": 0}}, "--method", "fedprox", "--nodes", "1")
    assert summary.status == "completed"
    applied = [e for e in evs if e["event"] == "async_aggregation"]
    assert [len(e["clients"]) for e in applied] == [1, 1, 1, 1]
    assert all(e["staleness"] == [0] and e["weights"] == [pytest.approx(0.6)] for e in applied)
    # equal phones: the first cohort arrives together, one update is applied, the other three are too stale
    assert applied[1]["discarded_too_stale"] == 3
