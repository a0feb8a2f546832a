"""The Flower comparisons, with Flower in an environment of its own (fcl_emu/bench/flower_env.py): Flower's SecAgg+
client, driven there, computes real masked vectors (its side checks in every run that they sum to the quantised
inputs once the self-masks are off), the bench reports it, and without a Flower environment the secagg report says
so while the Flower benchmark refuses in one line. The tests that run Flower skip without its environment; none
imports flwr."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fcl_emu.bench import flower_env
from fcl_emu.bench.flower_secagg import FLOWER_MOD_RANGE, FlowerRound, measure_flower_masking, sums_to_inputs
from fcl_emu.bench.secagg import flower_fields
from fcl_emu.cli import app

NO_ENVIRONMENT = "no Flower environment (fcl-emu bench flower-env)"


def test_flower_side_times_positive_and_its_masked_vectors_sum_to_the_inputs(flower_python):
    out = measure_flower_masking(dim=2000, neighbors=4, clients=10)
    assert "error" not in out, out
    assert out["sums_to_inputs"] is True and out["version"] == flower_python.flwr
    assert out["masked_input_s"] > 0 and out["share_keys_s"] > 0
    assert out["neighbors"] == 4 and out["target_range"] == (2**32 - 1) // 10 and out["mod_range"] == FLOWER_MOD_RANGE


def test_the_sum_check_fails_on_a_sum_that_is_not_the_inputs():
    n, levels = 5, (FLOWER_MOD_RANGE - 1) // 5
    x = np.random.default_rng(0).uniform(-0.9, 0.9, 100).astype(np.float32)
    values = np.round(n * (x.astype(np.float64) + 1) * levels / 2).astype(np.int64)
    result = FlowerRound(target_range=levels, masked_input_s=[1.0] * n,
                         unmasked_sum=[np.array([n * levels]), values % FLOWER_MOD_RANGE])
    assert sums_to_inputs(result, x)
    result.unmasked_sum[1][7] += levels // 100  # one value off by 1 % of the range (a mask that did not cancel)
    assert not sums_to_inputs(result, x)


def test_bench_secagg_writes_the_flower_fields(flower_python, tmp_path):
    path = tmp_path / "sa.json"
    result = CliRunner().invoke(app, ["bench", "secagg", "--clients", "6", "--dim", "2000", "--json", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["flower_version"] == flower_python.flwr and data["flower_sums_to_inputs"] is True
    assert data["flower_masked_input_ms"] > 0 and data["flower_share_keys_ms"] > 0
    assert data["speedup_vs_flower"] == pytest.approx(data["flower_masked_input_ms"] / data["client_masked_input_ms"])
    result = CliRunner().invoke(app, ["bench", "secagg", "--clients", "6", "--dim", "2000", "--no-flower",
                                      "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert not any(key.startswith("flower") for key in json.loads(path.read_text()))


def test_a_different_flower_api_is_reported_not_raised(flower_python, tmp_path, monkeypatch):
    # Flower's side starts with a Flower whose masking stage is gone (sitecustomize runs first in every Python)
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib\n"
        "del importlib.import_module('flwr.client.mod.secure_aggregation.secaggplus_mod')._collect_masked_vectors\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = measure_flower_masking(dim=100, neighbors=4)
    assert out["error"].startswith("Flower's SecAgg+ client API differs: AttributeError"), out
    assert out["version"] == flower_python.flwr


@pytest.fixture
def no_flower_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(flower_env.ENV_DIR_VAR, str(tmp_path / "no-flower-env"))
    monkeypatch.delenv(flower_env.PYTHON_VAR, raising=False)


def test_without_a_flower_environment_the_secagg_report_says_so(no_flower_environment, tmp_path):
    assert measure_flower_masking(dim=100, neighbors=4) is None
    assert flower_fields(None, 1.0) == {"flower": NO_ENVIRONMENT}
    path = tmp_path / "sa.json"
    result = CliRunner().invoke(app, ["bench", "secagg", "--clients", "4", "--dim", "100", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(path.read_text())["flower"] == NO_ENVIRONMENT


@pytest.mark.parametrize("command", [["bench", "flower"], ["bench", "secagg", "--flower-python", "/no/python"]])
def test_a_missing_flower_environment_is_one_line_where_it_is_needed(no_flower_environment, command):
    result = CliRunner().invoke(app, command)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "--flower-python" in lines[0] and "fcl-emu bench flower-env" in lines[0]


def test_an_environment_with_the_pinned_flwr_is_kept(flower_python, monkeypatch):
    directory = flower_python.path.parent.parent
    if flower_env.probe(flower_env.env_python(directory))[1] != flower_env.pinned_flwr():
        pytest.skip("the Flower environment in use is not at constraints/flower.txt's flwr")
    monkeypatch.setattr(flower_env, "step", lambda command: pytest.fail(f"ran {command}"))
    assert flower_env.create(directory).flwr == flower_env.pinned_flwr()
