"""Configuration and command line: bad values fail early and name the option."""

import pytest
import yaml
from typer.testing import CliRunner

from fcl_emu.cli import app
from fcl_emu.config import RunConfig, load_config
from fcl_emu.launcher import format_client_set, node_assignment, parse_client_set

runner = CliRunner()


@pytest.mark.parametrize("args,flag", [
    (["--clients", "0"], "--clients"),
    (["--clients-per-round", "0"], "--clients-per-round"),
    (["--method", "nope"], "nope"),
    (["--dataset", "imagenet-22k"], "--dataset"),
    (["--tasks", "0"], "--tasks"),
    (["--rounds-per-task", "-1"], "--rounds-per-task"),
    (["--local-epochs", "0"], "--local-epochs"),
    (["--nodes", "0"], "--nodes"),
    (["--device", "tpu"], "--device"),
    (["--model", "vgg"], "--model"),
    (["--clients", "3", "--nodes", "4"], "nodes"),
    (["--method", "fedprox", "--method-option", "mu=-1"], "mu"),
    (["--method-option", "oops"], "KEY=VALUE"),
])
def test_up_rejects_bad_values_before_starting(args, flag):
    result = runner.invoke(app, ["up", *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output


def test_bad_config_files_are_reported(tmp_path):
    missing = runner.invoke(app, ["up", "--config", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "cannot read" in missing.output
    (tmp_path / "bad.yaml").write_text("rounds: [1, 2")
    assert "not valid YAML" in runner.invoke(app, ["up", "--config", str(tmp_path / "bad.yaml")]).output
    (tmp_path / "unknown.yaml").write_text("roundz: {}\n")
    assert "roundz" in runner.invoke(app, ["up", "--config", str(tmp_path / "unknown.yaml")]).output


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"scenario": {"num_clients": 50, "num_tasks": 2}, "seed": 4}))
    config = load_config(path, {"scenario": {"num_clients": 20}})
    assert config.scenario.num_clients == 20 and config.scenario.num_tasks == 2 and config.seed == 4
    assert RunConfig.model_validate(yaml.safe_load(config.to_yaml())) == config


def test_missing_dataset_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["up", "--clients", "4", "--nodes", "1", "--data-root", str(tmp_path)])
    assert result.exit_code != 0
    text = str(result.exception) + result.output
    assert "mnist" in text.lower() and str(tmp_path) in text


def test_methods_lists_the_baselines():
    result = runner.invoke(app, ["methods"])
    assert result.exit_code == 0
    for name in ("fedavg", "fedprox", "fedlwf2t", "fedewc"):
        assert name in result.output


def test_client_sets_and_node_assignment():
    assert parse_client_set("0-3,7,9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert format_client_set([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    for bad in ("", "3-1", "a-b", "-2"):
        with pytest.raises(ValueError):
            parse_client_set(bad)
    nodes = node_assignment(10, 3)
    assert sorted(sum(nodes, [])) == list(range(10)) and [len(n) for n in nodes] == [4, 3, 3]
