"""The coordinator's guards: rate limits, log-once, the norm bound and norm clipping (hand-computed values)."""

import logging

import numpy as np
import pytest

from coordinator.guard import LogOnce, RateLimiter, clip_update, delta_norm, on_refused_handshake
from methods.base import ClientUpdate
from monitoring.metrics import CoordinatorMetrics


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
