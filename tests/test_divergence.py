"""A run whose model diverged ends ``degraded`` and says why (coordinator/round_record.py, the status in
coordinator/run_status.py): NaN or infinite values, an exploded training loss, or an accuracy fallen to chance after
having learned, while ordinary class-incremental forgetting completes; a DP run stops at the round that diverged
unless told to continue; DP whose noise outweighs the clipped mean is warned of before the start; the library warnings and the clients' NaN-loss reports go to the run's log, not to
the console (runtime/run_log.py)."""

from __future__ import annotations

import io
import logging
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from fcl_emu.aggregation.update import DeltaLayout
from fcl_emu.coordinator.advice import noisy_privacy
from fcl_emu.coordinator.contracts import Diverged
from fcl_emu.coordinator.run_status import stop_if_diverged as _stop_if_diverged, trained_status as _trained_status
from fcl_emu.coordinator.privacy import cohort_for_noise, noise_to_update
from fcl_emu.coordinator.round_record import round_divergence
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.state import state_to_arrays
from fcl_emu.monitoring.results import RoundRecord
from fcl_emu.runconfig.config import PrivacyConfig
from fcl_emu.runtime.run_log import run_log
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.wire.messages import Error
from tests.test_coordinator_parts import dispatcher, join_all, make_state, runner

MNIST_TEST = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]  # test samples per class
# chance on the seen classes after each task of the default scenario's shape (5 tasks of 2 classes, in this order)
CHANCE = [100 * max(MNIST_TEST[:2 * t + 2]) / sum(MNIST_TEST[:2 * t + 2]) for t in range(5)]


def record(task: int, task_round: int, accuracy: float | None = None, loss: float | None = 0.5,
           diverged: str | None = None, rounds_per_task: int = 10) -> RoundRecord:
    return RoundRecord(task=task, round=task * rounds_per_task + task_round + 1, task_round=task_round, selected=8,
                       participants=8, late=0, failed=0, skipped=False, samples=800, mean_loss=loss,
                       accuracy_seen=accuracy, duration_s=1.0, coordinator_cpu_s=1.0, phases_s={}, bytes_sent=0,
                       bytes_received=0, bytes_by_type={}, online=300, diverged=diverged)


def run(mid_task: list[float], task_end: list[float]) -> tuple[list[RoundRecord], list[float]]:
    """The default scenario's shape: 5 tasks of 10 rounds, evaluated after each task's fifth round
    (``mid_task[t]``) and at its end (``task_end[t]``)."""
    rounds = [record(t, r, mid_task[t] if r == 4 else None) for t in range(len(task_end)) for r in range(10)]
    return rounds, task_end


# ------------------------------------------------------------------------------------------- one round
def test_a_round_with_nan_in_the_model_or_a_non_finite_or_exploded_median_loss_is_diverged():
    model = {"w": np.ones(5, np.float32), "steps": np.array(3)}
    assert round_divergence(model, [0.7, 0.6, 2.0], seen_classes=2) is None
    assert round_divergence(model, [], seen_classes=2) is None
    bad = {**model, "w": np.array([1.0, np.nan], np.float32)}
    assert round_divergence(bad, [0.7], 2) == "the model holds NaN or infinite values after aggregation (w)"
    assert round_divergence(model, [math.nan, math.inf, 0.5], 2) == (
        "training loss became NaN or infinite on 2 of 3 clients")
    # the limit is 1000 x ln(seen classes): 693 for 2 classes, 2303 for 10
    assert round_divergence(model, [700.0] * 3, 2) == "median training loss 700, over 693 (1000 x ln 2)"
    assert round_divergence(model, [700.0] * 3, 10) is None
    # a minority of clients (a hostile one, say) does not decide it
    assert round_divergence(model, [1e30, math.nan, 0.5, 0.4, 0.6], 2) is None


def test_the_round_runner_records_a_model_that_holds_nan():
    state = make_state()
    join_all(state)
    state.server.global_state["w"][1] = np.inf
    run_round, _ = runner(state)
    rec = run_round.run_round(task=0, task_round=0)
    assert rec.diverged == "the model holds NaN or infinite values after aggregation (w)"
    assert _trained_status([rec]).startswith(f"degraded: diverged at round {rec.round} (the model holds NaN")


def test_a_round_whose_clients_failed_on_a_nan_loss_is_diverged_though_they_reported_none():
    state = make_state()
    ids = join_all(state)
    d, endpoint = dispatcher(state)
    d.round = r = OpenRound(task=0, number=1, chosen=ids[:2], selected=set(ids[:2]), wanted=2)
    endpoint.push(ids[0], "error", Error(code="train_failed", detail=f"FloatingPointError: client {ids[0]}: loss "
                                                                     f"became nan"), task=0, round=1)
    endpoint.push(ids[1], "error", Error(code="train_failed", detail="RuntimeError: out of memory"), task=0, round=1)
    d.drain()
    assert r.failed == set(ids[:2]) and r.nonfinite_loss == {ids[0]}
    run_round, _ = runner(state, failing=ids, nonfinite=ids)
    rec = run_round.run_round(task=0, task_round=0)  # the round's 3 clients: no update, no loss reported
    assert rec.skipped and rec.diverged == "training loss became NaN or infinite on 3 of 3 clients"


# ------------------------------------------------------------------------------------------ a whole run
def test_the_first_diverged_round_makes_the_run_degraded_with_its_reason():
    rounds = [record(0, r) for r in range(3)] + [
        record(0, 3, loss=1e31, diverged="median training loss 1.36e+31, over 693 (1000 x ln 2)"),
        record(0, 4, diverged="training loss became NaN or infinite on 7 of 8 clients")]
    assert _trained_status(rounds) == ("degraded: diverged at round 4 (median training loss 1.36e+31, over 693 "
                                       "(1000 x ln 2))")


def test_ordinary_forgetting_is_not_divergence():
    """FedAvg on the default scenario: each new task learnt, the old ones forgotten, so the accuracy on the seen
    classes falls to about 1 / (tasks seen), twice chance: completed."""
    rounds, task_end = run(mid_task=[96.0, 47.0, 31.0, 23.5, 18.6], task_end=[99.4, 48.9, 32.5, 24.4, 19.2])
    assert _trained_status(rounds, task_end, CHANCE) == "completed"


def test_an_accuracy_fallen_to_chance_after_learning_and_staying_there_is_divergence():
    rounds, task_end = run(mid_task=[96.0, 47.0, 17.0, 12.5, 10.2], task_end=[99.4, 48.9, 18.0, 13.0, 11.3])
    status = _trained_status(rounds, task_end, CHANCE)
    assert status == ("degraded: diverged at round 25 (accuracy on the seen classes fell to 17.0 % after reaching "
                      "99.4 %, and stayed at chance (11.3 %) to the end)")


def test_a_dip_to_chance_that_recovers_or_one_that_never_learned_is_not_divergence():
    recovered, task_end = run(mid_task=[96.0, 20.0, 31.0, 23.5, 18.6], task_end=[99.4, 27.0, 32.5, 24.4, 19.2])
    assert _trained_status(recovered, task_end, CHANCE) == "completed"
    last_only, task_end = run(mid_task=[96.0, 47.0, 31.0, 23.5, 18.6], task_end=[99.4, 48.9, 32.5, 24.4, 11.0])
    assert _trained_status(last_only, task_end, CHANCE) == "completed"  # one evaluation at chance: not "stayed"
    never, task_end = run(mid_task=[50.0, 26.0, 18.0, 14.0, 11.0], task_end=[52.0, 27.0, 18.5, 14.5, 11.3])
    assert _trained_status(never, task_end, CHANCE) == "completed"


def test_a_dp_round_that_diverged_stops_the_run_unless_it_is_to_continue():
    diverged = record(0, 3, diverged="median training loss 1.36e+31, over 693 (1000 x ln 2)")
    for mode in ("central", "distributed"):
        with pytest.raises(Diverged) as stopped:
            _stop_if_diverged(diverged, PrivacyConfig(mode=mode))
        assert f"failed: {stopped.value}" == ("failed: diverged at round 4 (median training loss 1.36e+31, over 693 "
                                              "(1000 x ln 2))")  # the run's status
    _stop_if_diverged(diverged, PrivacyConfig(mode="central", on_divergence="continue"))  # to its end: degraded
    _stop_if_diverged(diverged, PrivacyConfig())  # without DP the run goes on, as before
    _stop_if_diverged(record(0, 3), PrivacyConfig(mode="central"))


# ------------------------------------------------------------------------------------------ DP's noise
def test_the_noise_to_update_ratio_and_the_cohort_that_brings_it_under_one_by_hand():
    dim = 281_730  # the MNIST CNN's float values (2 classes)
    z1 = PrivacyConfig(mode="central", noise_multiplier=1.0, clip=1.0)
    # sigma = z C / K on each value, its norm sigma sqrt(d), over C: sqrt(281730) / 8 = 530.78 / 8
    assert noise_to_update(z1, 8, dim) == pytest.approx(66.348, abs=1e-3)
    assert noise_to_update(z1, 30, dim) == pytest.approx(17.693, abs=1e-3)
    assert cohort_for_noise(z1, dim) == 531  # 530.78 rounded up
    assert noise_to_update(z1.model_copy(update={"mode": "distributed"}), 8, dim) == pytest.approx(66.348, abs=1e-3)
    # adaptive clipping: z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2), with sigma_b = K / 20 = 5 at K = 100: 1.00504
    adaptive = PrivacyConfig.model_validate({"mode": "central", "noise_multiplier": 1.0, "adaptive": {"enabled": True}})
    assert noise_to_update(adaptive, 100, dim) == pytest.approx(530.78 * 1.00504 / 100, rel=1e-4)
    # with sigma_b = 1 whatever K: z_D = (1 - 1/4)^(-1/2) = 1.1547, so K >= 530.78 x 1.1547 = 612.9
    fixed = adaptive.model_copy(update={"adaptive": adaptive.adaptive.model_copy(update={"count_stddev": 1.0})})
    assert cohort_for_noise(fixed, dim) == 613


def test_the_figures_of_docs_privacy_are_the_mnist_cnns_with_its_head_over_every_class():
    dim = DeltaLayout.of(state_to_arrays(build_model("cnn", (1, 28, 28), 10))).dim
    z1 = PrivacyConfig(mode="central", noise_multiplier=1.0, clip=1.0)
    assert dim == 283_786
    assert (round(noise_to_update(z1, 30, dim), 1), round(noise_to_update(z1, 8, dim), 1)) == (17.8, 66.6)
    assert cohort_for_noise(z1, dim) == 533


def test_the_coordinator_warns_before_the_start_when_the_noise_outweighs_the_clipped_mean():
    def warned(privacy: dict, clients_per_round: int) -> list:
        config = SimpleNamespace(privacy=PrivacyConfig.model_validate(privacy), scenario=SimpleNamespace(
            num_clients=300), rounds=SimpleNamespace(clients_per_round=clients_per_round))
        # a model of 9,800 values whose head of 2 classes (of 100 values each) grows to 4 in the last task: 10,000
        server = SimpleNamespace(global_state={"w": np.zeros(9_800, np.float32), "steps": np.array(3)},
                                 model=SimpleNamespace(num_classes=2, feature_dim=99))
        scenario = SimpleNamespace(num_tasks=2, seen_classes=lambda task: range(2 * task + 2))
        state = SimpleNamespace(server=server, scenario=scenario)
        return noisy_privacy(config, state, object())

    warning, = warned({"mode": "central", "noise_multiplier": 1.0, "clip": 0.5}, 8)
    assert warning.setting == "privacy.noise_multiplier" and warning.value == 1.0
    # sigma = 1 x 0.5 / 8 = 0.0625, its norm 0.0625 x 100 = 6.25, the ratio 100 / 8 = 12.5; K = 100 brings it to 1
    assert ("(0.0625 on each of the model's 10,000 values, a norm of about 6.25) is 12.5 times the clipped mean's "
            "largest norm (C = 0.5)") in warning.message
    assert "100 clients a round would bring it under C (--clients-per-round" in warning.message
    assert warned({"mode": "central", "noise_multiplier": 1.0}, 100) == []
    assert warned({"mode": "central", "noise_multiplier": 0.0}, 8) == []
    few, = warned({"mode": "central", "noise_multiplier": 4.0}, 8)
    assert "400 clients a round, more than the 300 clients, would bring it under C" in few.message
    # adaptive clipping at K = 50: z_D = (1 - (2 x 2.5)^-2)^(-1/2) = 1.0206, the ratio 100 x 1.0206 / 50
    adaptive, = warned({"mode": "central", "noise_multiplier": 1.0, "adaptive": {"enabled": True}}, 50)
    assert "is 2.0 times the clipped mean's largest norm (C, adapting from 1)" in adaptive.message


# -------------------------------------------------------------------------------------- the run's log
def test_library_warnings_and_nan_loss_reports_go_to_the_run_log_not_the_console(tmp_path):
    console = io.StringIO()
    handler = logging.StreamHandler(console)
    root = logging.getLogger()
    root.addHandler(handler)
    coordinator = logging.getLogger("fcl_emu.coordinator")
    try:
        with run_log(tmp_path / "logs" / "coordinator.log") as log, warnings.catch_warnings():
            warnings.simplefilter("always")
            logging.getLogger("absl").warning("Optimization failed to converge")
            warnings.warn("overflow encountered in multiply", RuntimeWarning)
            for client in ("client-0001", "client-0002"):
                coordinator.warning("client %s reported train_failed: FloatingPointError: client %s: loss became "
                                    "nan; further ones from this peer for this reason are only counted", client, client)
            coordinator.warning("starting the rounds without prometheus")
            logging.getLogger("absl").error("a library's error stays on the console")
            summary = log.summary()
        logging.getLogger("absl").warning("after the run: on the console again")
    finally:
        root.removeHandler(handler)
    shown = console.getvalue().splitlines()
    assert shown == ["starting the rounds without prometheus", "a library's error stays on the console",
                     "after the run: on the console again"]
    written = (tmp_path / "logs" / "coordinator.log").read_text()
    for text in ("failed to converge", "RuntimeWarning: overflow", "client-0001: loss became nan",
                 "client-0002: loss became nan", "without prometheus"):
        assert text in written
    assert summary == (f"kept off the console, in {tmp_path / 'logs' / 'coordinator.log'}: 2 library warnings and "
                       f"2 reports of a NaN or infinite training loss")
