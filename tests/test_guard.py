"""The coordinator's guards: rate limits, log-once, the norm bound, norm clipping and the adaptive bound
(hand-computed values), and that the default defences contain an insider sending +-100 per weight."""

import logging

import numpy as np
import pytest

from fcl_emu.aggregation.clipping import clip_to_cohort, clip_update, delta_norm
from fcl_emu.coordinator.guard import LogOnce, on_refused_handshake, RateLimiter
from fcl_emu.aggregation.combine import fedavg
from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.monitoring.metrics import CoordinatorMetrics
from fcl_emu.runconfig.config import RunConfig


def test_the_rate_limiter_allows_a_burst_then_the_rate():
    limiter = RateLimiter(rate_per_s=2.0, burst=3, max_tracked=2)
    assert [limiter.allow("a", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("a", now=0.4) is False  # 0.8 tokens
    assert limiter.allow("a", now=0.5) is True  # 1.0 token
    assert limiter.allow("b", now=0.5) and limiter.allow("c", now=0.5)  # "a" is forgotten (2 tracked)
    assert limiter.allow("a", now=0.5) is True  # a fresh bucket


def test_refusals_are_logged_once_per_peer_and_reason_within_a_budget_per_reason(caplog):
    log_once = LogOnce(logging.getLogger("test.guard"), limit=3, max_budgets=3)
    with caplog.at_level(logging.WARNING, logger="test.guard"):
        for _ in range(5):
            log_once("p", "bad_body", "one")
        log_once("p", "too_large", "two")
        log_once("q", "bad_body", "three")
        log_once("r", "bad_body", "four")
        log_once("s", "bad_body", "five")  # bad_body's budget is spent: one line says the rest are only counted
        log_once("t", "bad_body", "six")
        log_once("q", "too_large", "seven")  # another reason keeps its own budget
        for code in range(100):  # codes a peer makes up share one budget
            log_once("p", f"reported {code}", f"code {code}", budget="reported")
        log_once("u", "non_finite", "eight")  # a reason seen only now is still logged
    messages = [r.getMessage().split(";")[0] for r in caplog.records]
    assert messages == ["one", "two", "three", "four", "3 refusals logged for bad_body", "seven",
                        "code 0", "code 1", "code 2", "3 refusals logged for reported", "eight"]


def test_reasons_beyond_the_budgets_share_one(caplog):
    log_once = LogOnce(logging.getLogger("test.guard"), limit=1, max_budgets=2)
    with caplog.at_level(logging.WARNING, logger="test.guard"):
        for i in range(10):
            log_once("p", f"reason {i}", f"line {i}")
    messages = [r.getMessage().split(";")[0] for r in caplog.records]
    assert messages == ["line 0", "line 1", "line 2", "1 refusals logged for other reasons"]


def test_refused_handshakes_are_counted_and_logged_once_per_address(caplog):
    metrics = CoordinatorMetrics()
    refused = on_refused_handshake(metrics, LogOnce(logging.getLogger("test.guard"), limit=2))
    with caplog.at_level(logging.WARNING, logger="test.guard"):
        for address in ["10.0.0.1"] * 5 + ["10.0.0.2", "10.0.0.3", "10.0.0.4"]:
            refused(address, "unknown_key")
    assert metrics.registry.get_sample_value("fcl_refused_handshakes_total", {"reason": "unknown_key"}) == 8
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "10.0.0.1" in messages[0] and "10.0.0.2" in messages[1]
    assert "2 refusals logged for refused handshake" in messages[2]


def test_norm_and_clipping_by_hand():
    update = ClientUpdate("c", 5, {"delta/w": np.array([3.0, 0.0], np.float32), "delta/b": np.array([4.0], np.float32),
                                   "delta/steps": np.array(7, np.int64), "extra/x": np.array([100.0], np.float32)})
    assert delta_norm(update) == pytest.approx(5.0)  # sqrt(3^2 + 4^2); ints and non-delta tensors left out
    clipped = clip_update(update, 1.0)
    np.testing.assert_allclose(clipped.tensors["delta/w"], [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(clipped.tensors["delta/b"], [0.8], rtol=1e-6)
    assert clipped.tensors["delta/steps"] == 7 and clipped.tensors["extra/x"][0] == 100.0
    assert clipped.tensors["delta/w"].dtype == np.float32 and clipped.num_samples == 5
    assert clip_update(update, 10.0) is update  # within the bound: untouched


def test_the_adaptive_bound_clips_to_a_multiple_of_the_cohorts_median_norm_under_each_prefix():
    def update(i, delta, projector):
        return ClientUpdate(f"c{i}", 3, {"delta/w": np.array([delta, 0.0], np.float32),
                                         "m/p/x": np.array([projector], np.float32)})

    updates = [update(0, 1.0, 1.0), update(1, 2.0, 10.0), update(2, 3.0, 1.0), update(3, -100.0, 1.0)]
    clipped = clip_to_cohort(updates, 2.0, ("delta/", "m/p/"))
    # delta/: norms 1, 2, 3, 100 -> median 2.5, bound 5: only the last is scaled (to -5); m/p/: norms 1, 10, 1,
    # 1 -> median 1, bound 2: only the second is scaled (to 2)
    assert [u.tensors["delta/w"][0] for u in clipped] == pytest.approx([1.0, 2.0, 3.0, -5.0])
    assert [u.tensors["m/p/x"][0] for u in clipped] == pytest.approx([1.0, 2.0, 1.0, 1.0])
    assert clipped[0] is updates[0] and clipped[2] is updates[2]  # within both bounds: untouched
    assert clip_to_cohort([], 3.0) == []


def test_the_adaptive_bound_also_clips_each_tensor_to_the_multiple_of_its_cohorts_median():
    """By hand, multiplier 2: whole norms 1.005, 2.002, 1.418, 3.041 (median 1.71, bound 3.42) clip nothing; the
    bias tensors' norms 0.1, 0.1, 0.1, 3 (median 0.1, bound 0.2) clip the last bias to 0.2; the weights' norms 1, 2,
    1.414, 0.5 (median 1.21, bound 2.41) nothing. A push on one small tensor keeps only 2 x its cohort's median."""
    rows = [([1.0, 0.0], 0.1), ([0.0, 2.0], 0.1), ([1.0, 1.0], 0.1), ([0.5, 0.0], 3.0)]
    updates = [ClientUpdate(f"c{i}", 10, {"delta/w": np.array(w, np.float32), "delta/b": np.array([b], np.float32)})
               for i, (w, b) in enumerate(rows)]
    clipped = clip_to_cohort(updates, 2.0)
    assert clipped[:3] == updates[:3] and all(a is b for a, b in zip(clipped[:3], updates[:3]))
    assert clipped[3].tensors["delta/b"][0] == pytest.approx(0.2)
    np.testing.assert_array_equal(clipped[3].tensors["delta/w"], [0.5, 0.0])


def test_the_default_defences_contain_an_insider_sending_100_per_weight():
    """29 honest deltas near a common direction and one of +-100 per weight with the same sample count: through
    the default adaptive bound and aggregation rule the insider moves the result by at most its weight share of
    the bound (multiplier x the median norm), instead of 300 times the honest mean's length."""
    settings = RunConfig().aggregation
    rng = np.random.default_rng(0)
    direction = rng.standard_normal(10_000).astype(np.float32) * 0.01
    honest = [ClientUpdate(f"c{i:02d}", 40, {"delta/w": direction + 0.005 * rng.standard_normal(10_000)
                                             .astype(np.float32)}) for i in range(29)]
    insider = ClientUpdate("c99", 40, {"delta/w": np.where(rng.random(10_000) < 0.5, -100.0, 100.0)
                                       .astype(np.float32)})
    cohort = [*honest, insider]
    honest_mean = fedavg(honest)["w"]
    scale = np.linalg.norm(honest_mean)
    assert np.linalg.norm(fedavg(cohort)["w"] - honest_mean) > 100 * scale  # what the insider does undefended
    defended = fedavg(clip_to_cohort(cohort, settings.adaptive_clip), settings.aggregator())["w"]
    median_norm = np.median([delta_norm(u) for u in cohort])
    shift = np.linalg.norm(defended - honest_mean)
    assert shift <= settings.adaptive_clip * median_norm / 30 + 0.01 * scale and shift < 0.5 * scale
    median = fedavg(clip_to_cohort(cohort, settings.adaptive_clip), RunConfig(
        aggregation={"rule": "median"}).aggregation.aggregator())["w"]
    assert np.linalg.norm(median - honest_mean) < 0.1 * scale  # a robust rule as well: hardly moved


def test_a_backlog_holds_the_tokens_of_the_time_nobody_listened_then_the_burst_applies_again():
    limiter = RateLimiter(rate_per_s=2.0, burst=3)
    assert limiter.allow("a", now=0.0)
    with limiter.backlog(10.0):  # 10 s unheard: up to 3 + 20 tokens
        assert sum(limiter.allow("a", now=10.0) for _ in range(30)) == 22
    assert limiter.allow("a", now=10.0) is False
    assert sum(limiter.allow("a", now=20.0) for _ in range(30)) == 3
