"""The aggregation rules of methods/robust.py against small examples computed by hand, and what the run
configuration lets them aggregate."""

import numpy as np
import pytest

from fcl_emu.aggregation.combine import fedavg
from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.aggregation.rules import Aggregator
from fcl_emu.aggregation.rules.bulyan import bulyan
from fcl_emu.aggregation.rules.krum import krum, krum_scores, multikrum
from fcl_emu.aggregation.rules.mean import weighted_mean
from fcl_emu.aggregation.rules.median import coordinate_median
from fcl_emu.aggregation.rules.trimmed_mean import trimmed_mean
from fcl_emu.options import overrides
from fcl_emu.runconfig.config import RunConfig, load_config


def _updates(*rows, weights=None):
    """One update per row: its values as tensor ``w`` (float32), weight 1 unless given."""
    weights = weights or [1] * len(rows)
    return [(w, {"w": np.array(r, np.float32)}) for w, r in zip(weights, rows)]


def test_weighted_mean_by_hand():
    out = weighted_mean(_updates([1.0, 0.0], [4.0, 3.0], weights=[1, 2]))
    np.testing.assert_allclose(out["w"], [3.0, 2.0])  # (1 + 8) / 3, (0 + 6) / 3
    assert out["w"].dtype == np.float32


def test_the_weighted_mean_of_many_updates_is_the_exact_mean_within_float32_rounding():
    """Past :data:`PARTIAL_TERMS` updates the float32 runs add up in float64: the mean of 1,000 updates (values
    spanning six orders of magnitude, terms that cancel) stays within one float32 rounding of the terms' scale of
    the exact mean (all of it summed in float32: up to twice that)."""
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((1000, 64)) * 10.0 ** rng.integers(-3, 3, (1000, 1))).astype(np.float32)
    weights = [int(n) for n in rng.integers(1, 500, 1000)]
    exact = (rows.astype(np.float64) * np.array(weights)[:, None]).sum(axis=0) / sum(weights)
    out = weighted_mean(_updates(*rows, weights=weights))["w"]
    scale = (np.abs(rows.astype(np.float64)) * np.array(weights)[:, None]).sum(axis=0) / sum(weights)
    assert np.all(np.abs(out - exact) <= np.finfo(np.float32).eps * scale)
    assert out.dtype == np.float32


def test_coordinate_median_by_hand():
    out = coordinate_median(_updates([1.0, 9.0], [2.0, -5.0], [100.0, 0.0], weights=[1, 1, 50]))
    np.testing.assert_allclose(out["w"], [2.0, 0.0])  # each coordinate on its own; weights ignored
    even = coordinate_median(_updates([1.0], [2.0], [4.0], [100.0]))
    np.testing.assert_allclose(even["w"], [3.0])  # the two middle values' mean


def test_trimmed_mean_by_hand():
    rows = [[1.0], [2.0], [3.0], [4.0], [1000.0]]
    np.testing.assert_allclose(trimmed_mean(_updates(*rows), 0.2)["w"], [3.0])  # cut 1 each end: (2+3+4)/3
    np.testing.assert_allclose(trimmed_mean(_updates(*rows), 0.1)["w"], [202.0])  # floor(0.5) = 0 cut: the mean
    with pytest.raises(ValueError):
        trimmed_mean(_updates(*rows), 0.5)


def test_krum_scores_by_hand_and_krum_picks_the_honest_update_among_outliers():
    # n = 5, f = 1: each score sums the n - f - 2 = 2 smallest squared distances to the others
    rows = [[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [100.0, 100.0], [-100.0, 100.0]]
    # squared distances from 0: 1, 4, 20000, 20000 -> 5; from 1: 1, 5, 19801, 20201 -> 6; from 2: 4, 5, ... -> 9
    np.testing.assert_allclose(krum_scores(_updates(*rows), 1)[:3], [5.0, 6.0, 9.0])
    np.testing.assert_allclose(krum(_updates(*rows), 1)["w"], [0.0, 0.0])
    # honest updates near (1, 1), two attackers far off, one claiming a huge weight: Krum returns an honest one
    rng = np.random.default_rng(0)
    honest = [1.0 + 0.01 * rng.standard_normal(50) for _ in range(7)]
    attackers = [np.full(50, 100.0), np.full(50, -100.0)]
    updates = _updates(*honest, *attackers, weights=[1] * 7 + [10 ** 6, 1])
    chosen = krum(updates, 2)["w"]
    assert any(np.array_equal(chosen, np.asarray(h, np.float32)) for h in honest)
    with pytest.raises(ValueError, match="2f \\+ 3"):
        krum(updates[:6], 2)


def test_multikrum_by_hand():
    rows = [[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [100.0, 100.0], [-100.0, 100.0]]
    # scores 5, 6, 9 for the first three; the outliers score far more; m = n - f = 4 keeps one outlier
    out = multikrum(_updates(*rows, weights=[1, 1, 2, 1, 1]), 1, m=3)
    np.testing.assert_allclose(out["w"], [0.25, 1.0])  # (0 + 1 + 0) / 4, (0 + 0 + 2 * 2) / 4: by weight


def test_bulyan_by_hand():
    # n = 7, f = 1: theta = n - 2f = 5 selected by repeated Krum (the two outliers stay out), then per coordinate
    # the beta = theta - 2f = 3 values closest to the median of the five, averaged
    rows = [[0.0], [1.0], [2.0], [3.0], [10.0], [1000.0], [-1000.0]]
    out = bulyan(_updates(*rows), 1)
    # selected: 0, 1, 2, 3, 10 (median 2): the three closest to 2 are 1, 2, 3 -> 2
    np.testing.assert_allclose(out["w"], [2.0])
    with pytest.raises(ValueError, match="4f \\+ 3"):
        bulyan(_updates(*rows[:6]), 1)


def test_fedavg_takes_the_rule_for_floats_and_the_largest_step_counter():
    updates = [ClientUpdate(f"c{i}", 1, {"delta/w": np.array([v], np.float32), "delta/n": np.array(i, np.int64)})
               for i, v in enumerate([1.0, 2.0, 900.0])]
    out = fedavg(updates, Aggregator("median"))
    np.testing.assert_allclose(out["w"], [2.0])
    assert out["n"] == 2 and out["n"].dtype == np.int64
    np.testing.assert_allclose(fedavg(updates)["w"], [301.0])  # the default: the mean


def test_the_configuration_refuses_what_a_rule_cannot_aggregate():
    assert RunConfig().security.aggregator == "mean"
    assert RunConfig(security={"aggregator": "krum"}).security.robust_aggregator().min_updates == 5
    for method in ("fedavg", "fedprox", "fedlwf2t", "fedewc", "glfc", "affcl"):  # a weighted mean of deltas
        RunConfig(method=method, security={"aggregator": "median"})
    with pytest.raises(ValueError, match="fedcbc.*does not average model deltas"):
        RunConfig(method="fedcbc", security={"aggregator": "median"})
    with pytest.raises(ValueError, match="secagg hides"):
        RunConfig(secagg={"enabled": True}, security={"aggregator": "median"})
    with pytest.raises(ValueError, match="at least 11 updates"):
        RunConfig(scenario={"num_clients": 10}, security={"aggregator": "bulyan", "byzantine": 2})
    RunConfig(secagg={"enabled": True})  # the adaptive bound is on by default and simply skips secure rounds


def test_the_adaptive_bound_is_on_by_default_and_off_turns_it_off():
    assert RunConfig().security.adaptive_clip == 10.0
    assert load_config(None, overrides({"adaptive_clip": "off"})).security.adaptive_clip is None
    assert RunConfig(security={"adaptive_clip": False}).security.adaptive_clip is None  # YAML's `off`
    assert load_config(None, overrides({"adaptive_clip": "2.5"})).security.adaptive_clip == 2.5
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        load_config(None, overrides({"adaptive_clip": "0.5"}))


def test_the_cohort_bound_refuses_uploads_beyond_its_multiple_of_the_median_norm():
    """By hand: norms 1, 2, 3, 40 have median 2.5, so 10 x is 25 and only 40 is beyond; a NaN is always beyond;
    a cohort of two cannot tell an outlier, unless earlier accepted uploads join it; the L2 norm of [3, 4] and
    [12] together is 13."""
    from fcl_emu.aggregation.clipping import beyond_cohort, l2_norm

    assert beyond_cohort([1.0, 2.0, 3.0, 40.0], 10.0) == [False, False, False, True]
    assert beyond_cohort([1.0, 2.0, 3.0, 25.0], 10.0) == [False, False, False, False]
    assert beyond_cohort([1.0, float("nan"), 3.0, 2.0], 10.0) == [False, True, False, False]
    assert beyond_cohort([1.0, 1000.0], 10.0) == [False, False] and beyond_cohort([], 10.0) == []
    assert beyond_cohort([1000.0], 10.0, earlier=[1.0, 2.0, 3.0]) == [True]
    assert beyond_cohort([20.0], 10.0, earlier=[1.0, 2.0, 3.0]) == [False]  # median 2.5 of all four: bound 25
    assert l2_norm([np.array([3.0, 4.0], np.float32), np.array([12.0], np.float32)]) == 13.0
