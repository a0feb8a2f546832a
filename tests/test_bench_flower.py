"""The Flower comparison of ``fcl-emu bench secagg``: Flower's SecAgg+ client driven in process computes real
masked vectors (they sum to the quantised inputs once the self-masks are off), the bench reports it, and it is
skipped cleanly without flwr."""

from __future__ import annotations

import importlib
import json
import sys

import numpy as np
import pytest

from fcl_emu.bench.flower_secagg import FLOWER_MOD_RANGE, flower_round, measure_flower_masking

pytest.importorskip("flwr", reason="the Flower comparison needs flwr (the `flower` or `test` extra)")


def test_flower_masked_vectors_sum_to_the_quantised_inputs():
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    dim, k = 2000, 4
    x = np.random.default_rng(0).uniform(-0.9, 0.9, dim).astype(np.float32)
    result = flower_round(x, k)  # all k + 1 clients mask: the pairwise masks cancel in the sum
    assert sorted(result.masked) == sorted(result.states) and len(result.masked) == k + 1
    total = [np.zeros(1, np.int64), np.zeros(dim, np.int64)]
    for nid, arrays in result.masked.items():
        masked = [bytes_to_ndarray(a) for a in arrays]
        self_mask = pseudo_rand_gen(result.states[nid].rd_seed, FLOWER_MOD_RANGE, [a.shape for a in masked])
        for acc, m, s in zip(total, masked, self_mask, strict=True):
            acc += m - s
    total = [a % FLOWER_MOD_RANGE for a in total]
    m = result.target_range
    assert total[0][0] == (k + 1) * m  # the weight element: q_ratio = target range for weight 1 of 1
    decoded = total[1] / (k + 1) * 2.0 / m - 1.0  # clip 1: levels back to [-1, 1]
    np.testing.assert_allclose(decoded, x, atol=1e-6)
    assert len(result.share_keys_s) == k + 1 and min(result.share_keys_s) > 0


def test_measure_flower_masking_reports_positive_times():
    out = measure_flower_masking(dim=2000, neighbors=4, repeats=2, clients=10)
    assert "error" not in out, out
    assert {"version", "share_keys_s", "masked_input_s", "target_range", "mod_range"} <= set(out)
    assert out["masked_input_s"] > 0 and out["share_keys_s"] > 0
    assert out["neighbors"] == 4 and out["target_range"] == (2**32 - 1) // 10


def test_bench_secagg_writes_the_flower_fields(tmp_path):
    from typer.testing import CliRunner

    from fcl_emu.cli import app

    path = tmp_path / "sa.json"
    result = CliRunner().invoke(app, ["bench", "secagg", "--clients", "6", "--dim", "2000", "--json", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["flower_version"] and data["flower_masked_input_ms"] > 0 and data["flower_share_keys_ms"] > 0
    assert data["speedup_vs_flower"] == pytest.approx(data["flower_masked_input_ms"] / data["client_masked_input_ms"])
    result = CliRunner().invoke(app, ["bench", "secagg", "--clients", "6", "--dim", "2000", "--no-flower",
                                      "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert not any(key.startswith("flower") for key in json.loads(path.read_text()))


def test_without_flwr_there_is_no_comparison(monkeypatch):
    from fcl_emu.bench.secagg import flower_fields

    monkeypatch.setitem(sys.modules, "flwr", None)  # `import flwr` now raises ImportError
    assert measure_flower_masking(dim=100, neighbors=4) is None
    assert flower_fields(None, 1.0) == {"flower": "not installed"}


def test_a_different_flower_api_is_reported_not_raised(monkeypatch):
    # the package re-exports a function of the same name, so take the module from sys.modules
    mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
    monkeypatch.delattr(mod, "_collect_masked_vectors")
    out = measure_flower_masking(dim=100, neighbors=4)
    assert out["error"].startswith("Flower's SecAgg+ client API differs: AttributeError")
