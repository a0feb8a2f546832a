"""An unset ``nodes`` (runconfig/nodes.py): ``up`` starts one edge node per CLIENTS_PER_NODE clients, at least 2,
says so once before the start, and the settings not default do not list it."""

from __future__ import annotations

import io

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from fcl_emu import options, run
from fcl_emu.cli import app
from fcl_emu.coordinator.resume import run_fingerprint
from fcl_emu.coordinator.contracts import BindError
from fcl_emu.monitoring.settings_diff import non_default_settings, settings_text
from fcl_emu.runconfig import RunConfig, load_config
from fcl_emu.runconfig import nodes as nodes_module
from fcl_emu.runconfig.defaults import defaults_for
from fcl_emu.runconfig.nodes import CLIENTS_PER_NODE, nodes_chosen

LARGE = 2 * CLIENTS_PER_NODE + 1  # one client more than two nodes take


def population(clients: int, **changes) -> RunConfig:
    return load_config(None, {"scenario": {"num_clients": clients}, **changes})


@pytest.mark.parametrize("clients,nodes", [(1, 1), (2, 2), (300, 2), (CLIENTS_PER_NODE, 2),
                                           (2 * CLIENTS_PER_NODE, 2), (LARGE, 3), (3 * CLIENTS_PER_NODE + 1, 4)])
def test_an_unset_nodes_is_one_per_clients_per_node_at_least_two_and_at_most_one_per_client(clients, nodes):
    config = population(clients)
    assert config.nodes == nodes and nodes_chosen(config)


def test_nodes_given_in_a_flag_or_the_yaml_win_and_a_yaml_null_is_unset(tmp_path):
    assert population(LARGE, nodes=2).nodes == 2 and not nodes_chosen(population(LARGE, nodes=3))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"scenario": {"num_clients": LARGE}, "nodes": None}))
    assert load_config(path, {}).nodes == 3 and nodes_chosen(load_config(path, {}))
    flag = load_config(path, options.overrides({"nodes": 5}))
    assert flag.nodes == 5 and not nodes_chosen(flag)


def test_a_written_config_keeps_the_nodes_chosen_when_read_again(tmp_path, monkeypatch):
    """config.yaml (what --resume and a deployment's coordinator read) holds the count, so a later change of
    CLIENTS_PER_NODE does not change a run's nodes."""
    written = population(LARGE)
    monkeypatch.setattr(nodes_module, "CLIENTS_PER_NODE", 10 * CLIENTS_PER_NODE)
    assert population(LARGE).nodes == 2
    again = RunConfig.model_validate(yaml.safe_load(written.to_yaml()))
    assert again.nodes == 3 and again == written and run_fingerprint(again) == run_fingerprint(written)


def test_deploy_writes_the_nodes_it_chose(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["deploy", str(out), "--image", "fcl-emu:somewhere-else", "--data-root",
                                      str(tmp_path), "--clients", "3"],
                                env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((out / "config.yaml").read_text())["nodes"] == 2
    assert [s for s in yaml.safe_load((out / "compose.yml").read_text())["services"] if s.startswith("node")] == [
        "node-0", "node-1"]


def test_the_checks_on_nodes_take_the_chosen_count():
    with pytest.raises(ValueError, match="leaves no room for 3 edge-node and 0 GPU-worker ports"):
        population(LARGE, metrics={"port": 65533})
    with pytest.raises(ValueError, match=r"nodes\n.*3 exceeds the number of clients \(2\)"):
        population(2, nodes=3)


def test_the_settings_not_default_leave_out_a_chosen_nodes_and_list_a_given_one():
    for config in (population(LARGE), population(1), population(LARGE, nodes=3)):
        settings = config.model_dump(mode="json")
        assert "nodes" not in settings_text(non_default_settings(settings, defaults_for(settings)))
    given = population(LARGE, nodes=4).model_dump(mode="json")
    assert settings_text(non_default_settings(given, defaults_for(given))).endswith("deployment: nodes=4")


def test_the_help_of_nodes_says_what_unset_means():
    assert f"unset: 2, or one per {CLIENTS_PER_NODE:,} clients beyond" in options.OPTIONS["nodes"].help


def _start_lines(config: RunConfig, tmp_path, monkeypatch) -> list[str]:
    """What ``up`` prints before its coordinator starts (here it cannot bind)."""
    def coordinator_that_cannot_bind(config, **kwargs):
        raise BindError("cannot bind: a test")

    monkeypatch.setattr(run, "Coordinator", coordinator_that_cannot_bind)
    out = io.StringIO()
    with pytest.raises(BindError):
        run.run_local(config, Console(file=out, width=200))
    return out.getvalue().splitlines()


def test_up_says_once_before_the_start_how_many_nodes_it_chose_and_nothing_for_a_given_count(tmp_path, monkeypatch):
    common = {"download": True, "run_dir": str(tmp_path / "run"), "network": {"bind": "tcp://127.0.0.1:0"}}
    chosen = _start_lines(population(LARGE, **common), tmp_path, monkeypatch)
    assert chosen == ["edge nodes: 3 (chosen for 100,001 clients, at most 50,000 per node; --nodes sets it)"]
    assert _start_lines(population(LARGE, nodes=3, **common), tmp_path, monkeypatch) == []
    assert run.chosen_nodes_line(population(1)) == (
        "edge nodes: 1 (chosen for 1 client, at most 50,000 per node; --nodes sets it)")
