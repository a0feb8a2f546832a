"""Central differential privacy (coordinator/privacy.py): clipping and noise of one aggregation, adaptive
clipping's step and noise split, the accountant's epsilon against an independent computation, the round record,
summary and gauge, resuming, and what the configuration refuses."""

from __future__ import annotations

import importlib.util
import math

import msgspec
import numpy as np
import pytest

from fcl_emu.coordinator.privacy import (CentralPrivacy, PrivacyAccountant, adaptive_clip, delta_noise_multiplier,
                                 run_privacy)
from fcl_emu import options
from fcl_emu.aggregation.update import DELTA, ClientUpdate, DeltaLayout
from fcl_emu.monitoring.results import RoundRecord, RunSummary, epsilon_text
from fcl_emu.runconfig import RunConfig
from fcl_emu.runconfig.config import PrivacyConfig
from tests.test_coordinator_parts import join_all, make_state, runner

needs_accountant = pytest.mark.skipif(importlib.util.find_spec("dp_accounting") is None,
                                      reason="dp-accounting is not installed (pip install 'fcl-emu[dp]')")

LAYOUT = DeltaLayout.of({"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32), "steps": np.array(0)})


def upload(client: str, w: list[float], b: float, samples: int = 10) -> ClientUpdate:
    return ClientUpdate(client, samples, {DELTA + "w": np.array(w, np.float32), DELTA + "b": np.array([b], np.float32),
                                          DELTA + "steps": np.array(7, np.int64)})


def central(cohort: int, **settings) -> CentralPrivacy:
    return CentralPrivacy(PrivacyConfig(mode="central", **settings), cohort, sampling_rate=0.1)


# ---------------------------------------------------------------------------------------- one aggregation
@needs_accountant
def test_one_aggregation_clips_averages_equally_over_the_cohort_and_adds_the_noise_by_hand():
    dp = central(cohort=4, noise_multiplier=2.0, clip=1.0, noise_seed=7)
    updates = [upload("a", [3.0, 0.0], 4.0, samples=1),  # norm 5: scaled to [0.6, 0], [0.8]
               upload("b", [0.3, 0.0], 0.4, samples=1000)]  # norm 0.5: kept; its sample count weighs nothing
    released = dp.noised_mean(updates, LAYOUT, round_number=3)
    # layout order is by name: b, w; the mean divides by the cohort K = 4, not by the 2 that arrived
    clipped_mean = np.array([0.8 + 0.4, 0.6 + 0.3, 0.0]) / 4
    noise = np.random.default_rng([7, 3]).normal(0.0, 2.0 * 1.0 / 4, 3)  # N(0, (z C / K)^2)
    assert released.num_samples == 1 and set(released.tensors) == {DELTA + "b", DELTA + "w"}  # no integer buffer
    np.testing.assert_allclose(LAYOUT.flatten(released.tensors), clipped_mean + noise, rtol=1e-6)
    assert dp.report()["noise_std"] == pytest.approx(0.5) and dp.report()["steps"] == 1


@needs_accountant
def test_the_noise_has_the_standard_deviation_z_c_over_k():
    big = DeltaLayout.of({"w": np.zeros(200_000, np.float32)})
    dp = central(cohort=10, noise_multiplier=1.5, clip=0.2, noise_seed=1)
    released = dp.noised_mean([], big, round_number=1).tensors[DELTA + "w"]
    assert float(np.std(released)) == pytest.approx(1.5 * 0.2 / 10, rel=0.01)
    assert abs(float(np.mean(released))) < 1e-4


@needs_accountant
def test_without_a_noise_seed_the_noise_is_not_repeatable():
    dp = central(cohort=2, noise_multiplier=1.0, clip=1.0)
    first, second = (LAYOUT.flatten(dp.noised_mean([upload("a", [0, 0], 0)], LAYOUT, 1).tensors) for _ in range(2))
    assert not np.array_equal(first, second)


# ------------------------------------------------------------------------------------- adaptive clipping
def test_adaptive_clipping_steps_by_hand():
    # C <- C exp(-eta (b - gamma)), b = noised unclipped count / K (Andrew et al. 2021)
    assert adaptive_clip(1.0, 2.0, 4, 0.5, 0.2) == pytest.approx(1.0)  # at the target quantile: unchanged
    assert adaptive_clip(1.0, 4.0, 4, 0.5, 0.2) == pytest.approx(math.exp(-0.1))  # all unclipped: shrink
    assert adaptive_clip(2.0, 0.0, 4, 0.5, 0.2) == pytest.approx(2.0 * math.exp(0.1))  # all clipped: grow
    # z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2): z = 1, sigma_b = 2 -> (1 - 1/16)^(-1/2)
    assert delta_noise_multiplier(1.0, 2.0) == pytest.approx((15 / 16) ** -0.5)
    assert delta_noise_multiplier(0.0, 2.0) == 0.0


@needs_accountant
def test_an_adaptive_round_clips_with_the_old_norm_then_moves_it():
    dp = central(cohort=4, noise_multiplier=0.0, clip=1.0, adaptive={"enabled": True})  # no noise: exact
    updates = [upload("a", [0.5, 0.0], 0.0), upload("b", [0.2, 0.0], 0.0), upload("c", [0.0, 0.0], 3.0)]
    released = dp.noised_mean(updates, LAYOUT, round_number=1)
    np.testing.assert_allclose(LAYOUT.flatten(released.tensors), [1.0 / 4, 0.7 / 4, 0.0], rtol=1e-6)
    assert dp.clip == pytest.approx(math.exp(-0.2 * (2 / 4 - 0.5)))  # 2 of K=4 unclipped: the target
    assert dp.report()["clip"] == 1.0 and dp.report()["next_clip"] == pytest.approx(dp.clip)


@needs_accountant
def test_an_adaptive_round_with_noise_splits_it_between_the_mean_and_the_count():
    dp = central(cohort=4, noise_multiplier=1.0, clip=1.0, noise_seed=5,
                 adaptive={"enabled": True, "count_stddev": 2.0, "target_quantile": 0.5, "learning_rate": 0.2})
    released = dp.noised_mean([upload("a", [0.1, 0.0], 0.0)], LAYOUT, round_number=2)
    rng = np.random.default_rng([5, 2])
    z_delta = (1 - 1 / 16) ** -0.5
    mean_noise = rng.normal(0.0, z_delta * 1.0 / 4, 3)
    count = 1 + rng.normal(0.0, 2.0)
    np.testing.assert_allclose(LAYOUT.flatten(released.tensors), np.array([0.0, 0.1, 0.0]) / 4 + mean_noise,
                               rtol=1e-6)
    assert dp.clip == pytest.approx(math.exp(-0.2 * (count / 4 - 0.5)))


# -------------------------------------------------------------------------------------------- accounting
def _independent_epsilon(q: float, z: float, steps: int, delta: float, orders: range) -> float:
    """RDP of the sampled Gaussian mechanism at integer orders (Mironov, Talwar, Zhang 2019, eq. for integer
    alpha: A = sum_k C(alpha, k) (1-q)^(alpha-k) q^k exp((k^2 - k) / (2 z^2))), composed over steps, converted
    to (epsilon, delta) with eps = rdp - (log delta + log alpha) / (alpha - 1) + log((alpha - 1) / alpha)
    (Canonne, Kamath, Steinke 2020). Without sampling (q = 1): the Gaussian mechanism's alpha / (2 z^2)
    (Mironov 2017)."""
    def rdp(a: int) -> float:
        if q == 1:
            return a / (2 * z * z)
        terms = [math.lgamma(a + 1) - math.lgamma(k + 1) - math.lgamma(a - k + 1) + (a - k) * math.log1p(-q)
                 + k * math.log(q) + (k * k - k) / (2 * z * z) for k in range(a + 1)]
        top = max(terms)
        return (top + math.log(sum(math.exp(t - top) for t in terms))) / (a - 1)

    return min(steps * rdp(a) - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a) for a in orders)


@needs_accountant
@pytest.mark.parametrize("q, z, steps", [(0.1, 1.0, 50), (0.01, 1.1, 1000), (1.0, 2.0, 10)])
def test_the_accountants_epsilon_matches_an_independent_computation(q, z, steps):
    orders = range(2, 129)
    accountant = PrivacyAccountant(z, q, orders=orders)
    accountant.step(steps)
    assert accountant.epsilon(1e-5) == pytest.approx(_independent_epsilon(q, z, steps, 1e-5, orders), rel=1e-6)
    default = PrivacyAccountant(z, q)  # more orders, fractional ones too: never a larger epsilon
    default.step(steps)
    assert default.epsilon(1e-5) <= accountant.epsilon(1e-5) + 1e-9


@needs_accountant
def test_epsilon_grows_with_the_rounds_and_is_none_without_noise():
    accountant = PrivacyAccountant(1.0, 0.1)
    assert accountant.epsilon(1e-5) == 0.0
    spent = []
    for _ in range(3):
        accountant.step()
        spent.append(accountant.epsilon(1e-5))
    assert 0 < spent[0] < spent[1] < spent[2]
    none = PrivacyAccountant(0.0, 0.1)
    none.step()
    assert none.epsilon(1e-5) is None


@needs_accountant
def test_each_round_is_composed_as_it_sampled_beside_poisson_at_the_runs_rate():
    """The per-round composition equals a hand-composed sequence of the same dp-accounting events; a pool that
    shrinks under churn costs more than the whole population eligible every round, the Poisson figure is blind to
    it."""
    import dp_accounting
    from dp_accounting import rdp

    shrinking = [(10, 100), (10, 80), (10, 40), (10, 10)]  # (selected, eligible) each round: the last takes all
    accountant = PrivacyAccountant(1.0, 0.1)
    for sample in shrinking:
        accountant.step(sample=sample)
    by_hand = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    poisson = rdp.RdpAccountant()
    for selected, pool in shrinking:
        gaussian = dp_accounting.GaussianDpEvent(1.0)
        by_hand.compose(dp_accounting.SampledWithoutReplacementDpEvent(pool, selected, gaussian))
        poisson.compose(dp_accounting.PoissonSampledDpEvent(0.1, gaussian))
    assert accountant.epsilon_sampled(1e-5) == pytest.approx(by_hand.get_epsilon(1e-5), rel=1e-9)
    assert accountant.epsilon(1e-5) == pytest.approx(poisson.get_epsilon(1e-5), rel=1e-9)
    everyone = PrivacyAccountant(1.0, 0.1)
    everyone.step(4, sample=(10, 100))
    assert everyone.epsilon(1e-5) == pytest.approx(accountant.epsilon(1e-5))
    assert everyone.epsilon_sampled(1e-5) < accountant.epsilon_sampled(1e-5)
    unknown = PrivacyAccountant(1.0, 0.1)
    unknown.step()
    assert unknown.epsilon_sampled(1e-5) is None and unknown.epsilon(1e-5) > 0


# ----------------------------------------------------------------------- a round, its record, the summary
@needs_accountant
def test_a_private_round_hands_the_server_one_noised_mean_and_reports_epsilon():
    state = make_state()
    state.config = state.config.model_copy(update={"privacy": PrivacyConfig(mode="central", noise_seed=0)})
    join_all(state)
    run, _ = runner(state)
    record = run.run_round(task=0, task_round=0)
    (_, _, aggregated), = state.server.aggregated
    assert [u.client for u in aggregated] == ["central-dp"] and record.participants == 3
    assert record.privacy["steps"] == 1 and record.privacy["epsilon"] > 0
    assert state.metrics.privacy_epsilon.labels("poisson")._value.get() == pytest.approx(record.privacy["epsilon"])
    # every client eligible, 3 of 6 drawn without replacement (replace-one): not the Poisson figure
    assert record.eligible == 6 and record.privacy["epsilon_sampled"] > record.privacy["epsilon"]
    assert state.metrics.privacy_epsilon.labels("as_sampled")._value.get() == pytest.approx(
        record.privacy["epsilon_sampled"])
    second = run.run_round(task=0, task_round=1)
    assert second.privacy["epsilon"] > record.privacy["epsilon"]

    summary = run_privacy(state.config, [record, second])
    assert (summary.steps, summary.epsilon, summary.epsilon_sampled, summary.sampling_rate) == (
        2, second.privacy["epsilon"], second.privacy["epsilon_sampled"], 3 / 6)
    assert epsilon_text(summary) == (f"{summary.epsilon_sampled:.2f} as sampled; {summary.epsilon:.2f} if "
                                     f"Poisson-sampled (1e-05)")
    resumed = CentralPrivacy.of(state.config)  # a resumed run takes over the composed rounds
    resumed.restore([RoundRecord(**{**vars(record)}), RoundRecord(**{**vars(second)})])
    assert resumed.report()["epsilon"] == pytest.approx(second.privacy["epsilon"])
    assert resumed.report()["epsilon_sampled"] == pytest.approx(second.privacy["epsilon_sampled"])
    before = CentralPrivacy.of(state.config)  # records from before the rounds kept their pool: no figure as sampled
    before.restore([RoundRecord(**{**vars(record), "eligible": None})])
    assert before.report()["epsilon"] == pytest.approx(record.privacy["epsilon"])
    assert before.report()["epsilon_sampled"] is None


def test_older_records_and_summaries_without_privacy_still_load():
    old = {"status": "completed", "method": "fedavg", "dataset": "mnist", "accuracy_matrix": [[50.0]],
           "bytes_total": 1, "rounds": 1, "wall_clock_s": 1.0}
    assert msgspec.json.decode(msgspec.json.encode(old), type=RunSummary).privacy is None
    assert run_privacy(RunConfig(), []) is None


# --------------------------------------------------------------------------------------------- the config
def _config(**privacy) -> dict:
    return {"privacy": {"mode": "central", **privacy}}


def test_the_flags_set_the_privacy_section():
    flags = {"privacy": "central", "dp_noise_multiplier": 0.5, "dp_clip": 2.0, "dp_adaptive_clipping": True,
             "dp_target_quantile": 0.7, "dp_clip_learning_rate": 0.1, "dp_delta": 1e-6, "dp_noise_seed": 3,
             "dp_on_divergence": "continue"}
    assert options.overrides(flags)["privacy"] == {
        "mode": "central", "noise_multiplier": 0.5, "clip": 2.0, "delta": 1e-6, "noise_seed": 3,
        "on_divergence": "continue", "adaptive": {"enabled": True, "target_quantile": 0.7, "learning_rate": 0.1}}


def test_whether_a_diverged_run_stops_may_change_on_resume():
    """``privacy.on_divergence`` decides whether the run goes on, not its rounds: --resume takes it, and the
    checkpoints of runs from before the setting existed still match."""
    from fcl_emu.coordinator.resume import run_fingerprint

    assert options.refused_with_resume({"dp_on_divergence": "continue"}) == []
    assert run_fingerprint(RunConfig()) == run_fingerprint(RunConfig(privacy={"on_divergence": "continue"}))


@needs_accountant
@pytest.mark.parametrize("extra, refusal", [
    ({"secagg": {"enabled": True}}, "cannot be combined with --secagg"),
    ({"method": "glfc"}, "central DP needs a method"),
    ({"method": "lander"}, "central DP needs a method"),
    ({"method": "fedcbc"}, "central DP needs a method"),
    ({"method": "affcl"}, "central DP needs a method"),
    ({"rounds": {"late_updates": "next_round"}}, "cannot be combined with --late-updates next_round"),
    ({"privacy": {"mode": "central", "noise_multiplier": 3.0, "adaptive": {"enabled": True}}},
     "must be less than twice the count noise"),
])
def test_the_config_refuses_what_central_dp_cannot_cover(extra, refusal):
    with pytest.raises(ValueError, match=refusal):
        RunConfig.model_validate({**_config(), **extra})


@needs_accountant
def test_the_methods_that_only_average_deltas_are_accepted():
    for method in ("fedavg", "fedprox", "fedewc", "fedlwf2t", "mfcl", "target"):
        assert RunConfig.model_validate({**_config(), "method": method}).privacy.central


def test_central_dp_without_the_library_is_refused_in_one_line(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "dp_accounting" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"needs Google's dp-accounting library.*pip install 'fcl-emu\[dp\]'"):
        RunConfig.model_validate(_config())
    assert not RunConfig().privacy.central  # off by default: no library needed
