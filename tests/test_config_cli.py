"""Configuration and command line: bad values fail early and name the option."""

import pytest
import yaml
from typer.testing import CliRunner

from fcl_emu.cli import app
from runconfig import RunConfig, load_config
from fcl_emu.launchers import format_client_set, node_assignment, parse_client_set

runner = CliRunner()


def invoke(*args: str):
    """Run the CLI; returns (exit code, output with rich's box drawing and wrapping undone)."""
    result = runner.invoke(app, list(args))
    text = " ".join(result.output.replace("│", " ").split())
    if result.exception and not isinstance(result.exception, SystemExit):
        text += " " + str(result.exception)
    return result.exit_code, text


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
    code, output = invoke("up", *args)
    assert code == 2, output
    assert flag in output


def test_bad_config_files_are_reported(tmp_path):
    code, output = invoke("up", "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read" in output
    (tmp_path / "bad.yaml").write_text("rounds: [1, 2")
    assert "not valid YAML" in invoke("up", "--config", str(tmp_path / "bad.yaml"))[1]
    (tmp_path / "unknown.yaml").write_text("roundz: {}\n")
    assert "roundz" in invoke("up", "--config", str(tmp_path / "unknown.yaml"))[1]


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"scenario": {"num_clients": 50, "num_tasks": 2}, "seed": 4}))
    config = load_config(path, {"scenario": {"num_clients": 20}})
    assert config.scenario.num_clients == 20 and config.scenario.num_tasks == 2 and config.seed == 4
    assert RunConfig.model_validate(yaml.safe_load(config.to_yaml())) == config


def test_missing_dataset_is_a_clear_error(tmp_path):
    code, output = invoke("up", "--clients", "4", "--nodes", "1", "--data-root", str(tmp_path))
    assert code == 1
    assert "mnist" in output.lower() and str(tmp_path / "mnist") in output.replace(" ", "")


def test_methods_lists_the_baselines():
    code, output = invoke("methods")
    assert code == 0
    for name in ("fedavg", "fedprox", "fedlwf2t", "fedewc"):
        assert name in output


def test_client_sets_and_node_assignment():
    assert parse_client_set("0-3,7,9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert format_client_set([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    for bad in ("", "3-1", "a-b", "-2"):
        with pytest.raises(ValueError):
            parse_client_set(bad)
    nodes = node_assignment(10, 3)
    assert sorted(sum(nodes, [])) == list(range(10)) and [len(n) for n in nodes] == [4, 3, 3]
