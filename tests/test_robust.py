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
    out = fedavg(updates, Aggregator.named("median"))
    np.testing.assert_allclose(out["w"], [2.0])
    assert out["n"] == 2 and out["n"].dtype == np.int64
    np.testing.assert_allclose(fedavg(updates)["w"], [301.0])  # the default: the mean


def test_the_configuration_refuses_what_a_rule_cannot_aggregate():
    assert RunConfig().aggregation.rule.name == "mean"
    assert RunConfig(aggregation={"rule": "krum"}).aggregation.aggregator().min_updates == 5
    for method in ("fedavg", "fedprox", "fedlwf2t", "fedewc", "glfc", "affcl"):  # a weighted mean of deltas
        RunConfig(method=method, aggregation={"rule": "median"})
    with pytest.raises(ValueError, match="fedcbc.*does not average model deltas"):
        RunConfig(method="fedcbc", aggregation={"rule": "median"})
    with pytest.raises(ValueError, match="secagg hides"):
        RunConfig(secagg={"enabled": True}, aggregation={"rule": "median"})
    with pytest.raises(ValueError, match="at least 11 updates"):
        RunConfig(scenario={"num_clients": 10}, aggregation={"rule": {"name": "bulyan", "byzantine": 2}})
    RunConfig(secagg={"enabled": True})  # the adaptive bound is on by default and simply skips secure rounds


@pytest.mark.parametrize("name, default, setting, bad, message", [
    ("adaptive_clip", 10.0, "2.5", "0.5", "greater than or equal to 1"),
    ("direction_check", 10.0, "3", "0", "greater than 0")])
def test_each_default_defence_is_on_by_default_and_off_turns_it_off(name, default, setting, bad, message):
    assert getattr(RunConfig().aggregation, name) == default
    assert getattr(load_config(None, overrides({name: "off"})).aggregation, name) is None
    assert getattr(RunConfig(aggregation={name: False}).aggregation, name) is None  # YAML's `off`
    assert getattr(load_config(None, overrides({name: setting})).aggregation, name) == float(setting)
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides({name: bad}))


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


def _cohort(*rows):
    return [ClientUpdate(f"client-{i:04d}", 1, {"delta/w": np.array(r, np.float32)}) for i, r in enumerate(rows)]


def test_the_direction_check_by_hand():
    """a = [1,1,0,0], b = [1,0,1,0], c = [1,0,0,1] agree pairwise by cos 1/2 (dot 1 over sqrt 2 x sqrt 2); x = -1
    everywhere has cos -2 / (sqrt 2 x 2) = -0.707 with each and -6 / (2 x sqrt 12) = -0.866 with their sum; a with
    the others' sum [1,-1,0,0] has cos 0: only x is refused (the threshold of 4 weights is capped at 0.05). A zero
    update is never refused, and a cohort of two refuses nothing."""
    from fcl_emu.aggregation.direction import agreements, off_cohort

    cohort = _cohort([1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1], [-1, -1, -1, -1])
    np.testing.assert_allclose(agreements(cohort), [0.5, 0.5, 0.5, -0.5 ** 0.5], rtol=1e-6)
    assert off_cohort(cohort, 10.0) == {"client-0003": pytest.approx(-0.5 ** 0.5)}
    zero = _cohort([1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0])
    assert np.isnan(agreements(zero)[2]) and off_cohort(zero, 10.0) == {}
    assert off_cohort(_cohort([1, 0, 0, 0], [-1, 0, 0, 0]), 10.0) == {}


def test_the_direction_checks_threshold_is_z_over_the_square_root_of_the_size_at_most_5_hundredths():
    """10,000 weights: a = e1, b = 0.03 e1 + s e2, c = 0.03 e1 + s e3 (s = sqrt(1 - 0.03^2)). b and c agree by
    0.03 (with a; 0.0009 with each other, and b with a + c by 0.0309 / |a + c| = 0.0215); a agrees with b + c by
    0.06 / 1.4149 = 0.0424. The threshold is z / 100: z = 1 refuses nothing, z = 4 refuses b and c, and z = 10
    asks 0.05 (the cap), which a misses too."""
    from fcl_emu.aggregation.direction import agreements, off_cohort

    rows = np.zeros((3, 10_000))
    s = (1 - 0.03 ** 2) ** 0.5
    rows[0, 0], rows[1, :2], rows[2, [0, 2]] = 1, [0.03, s], [0.03, s]
    cohort = _cohort(*rows)
    np.testing.assert_allclose(agreements(cohort), [0.06 / np.linalg.norm(rows[1] + rows[2]), 0.03, 0.03],
                               rtol=1e-5)
    assert off_cohort(cohort, 1.0) == {}
    assert set(off_cohort(cohort, 4.0)) == {"client-0001", "client-0002"}
    assert set(off_cohort(cohort, 10.0)) == {"client-0000", "client-0001", "client-0002"}


@pytest.mark.parametrize("d", [5000, 70_000])  # 70,000 weights: updates outside the sample are screened first
def test_the_direction_check_keeps_a_minority_and_refuses_noise_in_a_cohort_larger_than_its_sample(d):
    """40 updates (the sample takes 25 of them): 36 share a direction, 2 share another one the rest does not (a
    class few clients hold; one in the sample, one outside), one is noise and one the shared direction reversed.
    Each agreement is the brute-force largest cosine with the sample's mean (without the update itself) and with
    each other member, and for a member also with each update outside; the minority is kept, each through the
    other, the noise and the reversed update are refused, whether or not a screen on a sketch of the coordinates
    spares the agreeing updates the full comparison."""
    from fcl_emu.aggregation.direction import SAMPLE_SIZE, agreements, off_cohort

    rng = np.random.default_rng(0)
    common, rare = rng.standard_normal(d), rng.standard_normal(d)
    rows = [common + 1.5 * rng.standard_normal(d) for _ in range(40)]
    rows[0], rows[1] = rare + rng.standard_normal(d), rare + rng.standard_normal(d)
    rows[7], rows[9] = rng.standard_normal(d), -9 * common
    cohort = _cohort(*rows)
    picks = sorted({int(i) for i in np.linspace(0, 39, SAMPLE_SIZE).round()})
    assert 0 in picks and 7 not in picks and 9 not in picks and 1 not in picks
    x = np.array(rows, np.float32).astype(np.float64)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    expected = []
    for i in range(40):
        mean = x[[j for j in picks if j != i]].sum(axis=0)
        peers = [j for j in (range(40) if i in picks else picks) if j != i]
        expected.append(max([unit[i] @ mean / np.linalg.norm(mean), *(unit[i] @ unit[j] for j in peers)]))
    np.testing.assert_allclose(agreements(cohort), expected, rtol=1e-4, atol=1e-6)
    assert set(off_cohort(cohort, 10.0)) == {"client-0007", "client-0009"}  # threshold min(10 / sqrt(d), 0.05)
