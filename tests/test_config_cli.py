"""Configuration and command line: bad values fail early and name the option."""

import os
import socket
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fcl_emu.edge_node.args import format_client_set, parse_client_set
from fcl_emu import options
from fcl_emu.cli import app
from fcl_emu.keys import RunKeys
from fcl_emu.launchers import node_assignment
from fcl_emu.runconfig import RunConfig, load_config

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
    (["--clients", "10", "--clients-per-round", "11"], "exceeds the number of clients"),
    (["--max-update-norm", "0"], "--max-update-norm"),
    (["--clip-norm", "-1"], "--clip-norm"),
    (["--secagg", "--clip-norm", "5"], "cannot bound or clip"),
    (["--bind", "tcp://127.0.0.1:70000"], "--bind"),  # ZeroMQ would bind port 4464
    (["--bind", "tcp://*:65536"], "port from 1 to 65535"),
])
def test_up_rejects_bad_values_before_starting(args, flag):
    code, output = invoke("up", *args)
    assert code == 2, output
    assert flag in output


def test_every_flag_takes_its_help_type_and_bounds_from_its_config_field():
    for option in options.RUN_OPTIONS:
        description = option.field.description
        assert description, f"{option.flag}: its config field has no description"
        assert option.help.startswith(description[0].upper() + description[1:] + "."), option.flag
        assert all(words in option.help.lower() for words in options.bounds(option.field)), option.flag
        assert "[" not in option.help, f"{option.flag}: typer's rich help takes [...] for markup"
    assert {name: options.OPTIONS[name].type for name in ("clients", "lr", "partition", "faults", "data_root")} == \
        {"clients": int, "lr": float, "partition": str, "faults": Path, "data_root": list[Path]}
    neighbors = options.OPTIONS["secagg_neighbors"].help
    assert "capped at n - 1" in neighbors and neighbors.endswith("At least 2.")
    assert options.overrides({"insecure": True, "seed": 3}) == {"security": {"transport": "plain"}, "seed": 3,
                                                                "scenario": {"seed": 3}}


def test_a_flag_whose_field_has_no_description_fails(monkeypatch):
    clients = options.OPTIONS["clients"]
    monkeypatch.setattr(clients.field, "description", None)
    with pytest.raises(ValueError, match="--clients: config field scenario.num_clients has no description"):
        clients.help


def test_bad_config_files_are_reported(tmp_path):
    code, output = invoke("up", "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "cannot read" in output
    (tmp_path / "bad.yaml").write_text("rounds: [1, 2")
    assert "not valid YAML" in invoke("up", "--config", str(tmp_path / "bad.yaml"))[1]
    (tmp_path / "unknown.yaml").write_text("roundz: {}\n")
    assert "roundz" in invoke("up", "--config", str(tmp_path / "unknown.yaml"))[1]
    (tmp_path / "threads.yaml").write_text("coordinator_threads: 0\n")
    assert "coordinator_threads" in invoke("up", "--config", str(tmp_path / "threads.yaml"))[1]


@pytest.mark.parametrize("config,expected", [
    ({"scenario": {"num_clinets": 10}}, "scenario.num_clinets: unknown key; did you mean num_clients?"),
    ({"privacy": {"adaptive": {"enabeld": True}}}, "privacy.adaptive.enabeld: unknown key; did you mean enabled?"),
    ({"num_clinets": 10}, "num_clinets: unknown key; did you mean scenario.num_clients?"),  # at the wrong level
    ({"rounds": {"zzz": 1}}, "rounds.zzz: unknown key (known: clients_per_round, rounds_per_task,"),
])
def test_a_mistyped_config_key_at_any_level_gets_the_closest_known_one(tmp_path, config, expected):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    code, output = invoke("up", "--config", str(tmp_path / "c.yaml"))
    assert code == 2 and expected in output, output


def test_a_mistyped_method_option_gets_the_closest_option_of_the_method():
    code, output = invoke("up", "--method", "glfc", "--method-option", "memory_sise=100")
    assert code == 2 and "method option memory_sise: glfc has no such option; did you mean memory_size?" in output


@pytest.mark.parametrize("args,expected", [
    (["--clients", "0"], "--clients: must be at least 1 (got 0)"),
    (["--lr", "0"], "--lr: must be more than 0 (got 0.0)"),
    (["--device", "cdua"], "--device: must be one of 'auto', 'cpu' or 'cuda' (got 'cdua'); did you mean cuda?"),
    (["--method", "fedavgg"], "--method: unknown method 'fedavgg'; registered: affcl,"),
    (["--method", "fedprox", "--method-option", "mu=-1"], "method option mu: must be at least 0 (got -1)"),
    (["--availability", "foo"], "--availability: unknown availability 'foo'"),
])
def test_validation_errors_speak_the_projects_words(args, expected):
    code, output = invoke("up", *args)
    assert code == 2 and expected in output, output
    for pydantic_words in ("Invalid value", "Extra inputs", "Input should", "Value error", "validation error"):
        assert pydantic_words not in output, output


@pytest.mark.parametrize("args,flag", [(["--device", "cuda"], "--device"),
                                       (["--gpu-workers", "1", "--gpu-device", "cuda"], "--gpu-device")])
def test_a_cuda_device_that_is_not_here_is_refused_in_one_line_before_anything_starts(tmp_path, monkeypatch, args,
                                                                                      flag):
    import torch

    monkeypatch.chdir(tmp_path)  # where the run directory would go
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(app, ["up", "--clients", "4", "--nodes", "1", *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {flag} cuda: torch {torch.__version__} sees no CUDA device (CUDA build: ")
    assert lines[0].endswith(f"use {flag} cpu or auto") and list(tmp_path.iterdir()) == []


def test_the_coordinator_and_the_gpu_workers_make_the_same_device_check(monkeypatch):
    import torch

    from fcl_emu.coordinator.compose import resolve_device
    from fcl_emu.gpu_worker import DeviceError, worker_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="^--device cuda: torch .* sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(DeviceError, match="^--gpu-device cuda: torch .* sees no CUDA device"):
        worker_device("cuda", 0)
    assert resolve_device("auto").type == worker_device("auto", 3).type == "cpu"


def test_an_interrupted_run_says_at_once_what_it_stops_and_waits_for():
    from types import SimpleNamespace

    from fcl_emu.run import _interrupted

    config = load_config(None, {"gpu": {"workers": 1}, "metrics": {"port": 9100, "linger_s": 2}})
    assert _interrupted("SIGINT", config, SimpleNamespace(count=2)) == (
        "run interrupted by SIGINT: the round in progress is dropped and the summary written; stopping 2 edge nodes "
        "and 1 GPU worker; waiting for a last metrics scrape (2 s) ...")
    assert _interrupted("SIGTERM", load_config(None, {}), None) == (
        "run interrupted by SIGTERM: the round in progress is dropped and the summary written ...")


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"scenario": {"num_clients": 50, "num_tasks": 2}, "seed": 4}))
    config = load_config(path, {"scenario": {"num_clients": 20}})
    assert config.scenario.num_clients == 20 and config.scenario.num_tasks == 2 and config.seed == 4
    assert RunConfig.model_validate(yaml.safe_load(config.to_yaml())) == config


def test_missing_dataset_is_a_clear_error_and_leaves_no_run_directory_nor_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default run directory, runs/<time>-..., would go
    (tmp_path / "data").mkdir()
    code, output = invoke("up", "--clients", "4", "--nodes", "1", "--data-root", str(tmp_path / "data"))
    assert code == 1
    assert "mnist" in output.lower() and str(tmp_path / "data" / "mnist") in output.replace(" ", "")
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_a_taken_port_is_found_before_anything_is_written(tmp_path, mnist_root):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, output = invoke("up", "--clients", "4", "--nodes", "1", "--data-root", str(mnist_root),
                              "--bind", f"tcp://127.0.0.1:{taken.getsockname()[1]}",
                              "--run-dir", str(tmp_path / "runs" / "r"))
    assert code == 1 and "cannot bind" in output and "in use" in output
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_does_not_start_takes_its_keys_away(tmp_path, mnist_root, monkeypatch):
    """Its coordinator fails after ``up`` wrote the run's keys: they go, with the directories made for them."""
    from fcl_emu.coordinator.contracts import BindError
    from fcl_emu import run

    def coordinator_that_cannot_bind(config, **kwargs):
        assert (tmp_path / "runs" / "r" / "keys" / "coordinator.key_secret").is_file()
        raise BindError("cannot bind: a test")

    monkeypatch.setattr(run, "Coordinator", coordinator_that_cannot_bind)
    code, output = invoke("up", "--clients", "4", "--nodes", "1", "--data-root", str(mnist_root),
                          "--run-dir", str(tmp_path / "runs" / "r"))
    assert code == 1 and "a test" in output
    assert list(tmp_path.iterdir()) == []


def test_run_keys_stay_once_the_run_started_and_only_what_was_made_for_them_goes(tmp_path):
    config = load_config(None, {"scenario": {"num_clients": 4}, "nodes": 2})
    keys = RunKeys(tmp_path / "a" / "run")
    assert keys.write(config).security.keys == tmp_path / "a" / "run" / "keys"
    assert (tmp_path / "a" / "run" / "keys" / "node-1.key_secret").is_file()
    keys.keep()
    keys.discard()
    assert (tmp_path / "a" / "run" / "keys" / "node-1.key_secret").is_file()
    keys = RunKeys(tmp_path / "b")
    keys.write(config)
    (tmp_path / "b" / "logs").mkdir()  # what else the run wrote before it failed to start stays
    keys.discard()
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["logs"]
    plain = load_config(None, {"security": {"transport": "plain"}})
    assert RunKeys(tmp_path / "c").write(plain) == plain and not (tmp_path / "c").exists()


def test_methods_lists_the_baselines():
    code, output = invoke("methods")
    assert code == 0
    for name in ("fedavg", "fedprox", "fedlwf2t", "fedewc"):
        assert name in output


def test_a_method_brings_its_codes_local_optimiser_where_the_config_is_silent():
    fedavg = load_config(None, {})
    assert (fedavg.training.lr, fedavg.training.momentum, fedavg.training.weight_decay) == (0.05, 0.9, 0.0)
    target = load_config(None, {"method": "target"})
    assert (target.training.lr, target.training.momentum, target.training.weight_decay) == (0.01, 0.9, 5e-4)
    mfcl = load_config(None, {"method": "mfcl", "training": {"lr": 0.2}})  # what the user sets wins
    assert (mfcl.training.lr, mfcl.training.momentum, mfcl.training.weight_decay) == (0.2, 0.0, 1e-5)
    assert mfcl.training.batch_size == fedavg.training.batch_size  # the protocol's keys stay the run's
    assert RunConfig.model_validate(yaml.safe_load(mfcl.to_yaml())) == mfcl  # a written config loads again
    code, output = invoke("methods")
    assert code == 0 and "weight_decay" in output and "the run's" in output  # per method, or the run's


def test_client_sets_and_node_assignment():
    assert parse_client_set("0-3,7,9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert format_client_set([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    for bad in ("", "3-1", "a-b", "-2"):
        with pytest.raises(ValueError):
            parse_client_set(bad)
    nodes = node_assignment(10, 3)
    assert sorted(sum(nodes, [])) == list(range(10)) and [len(n) for n in nodes] == [4, 3, 3]


def test_the_default_cohort_takes_every_client_of_a_small_run():
    assert load_config(None, {"scenario": {"num_clients": 12}}).rounds.clients_per_round == 12
    assert load_config(None, {}).rounds.clients_per_round == 30
    small = load_config(None, {"scenario": {"num_clients": 12}})
    assert RunConfig.model_validate(yaml.safe_load(small.to_yaml())) == small  # a written config loads again


@pytest.mark.parametrize("args,expected,code", [
    (["--connect", "notanendpoint", "--clients", "0-3", "--insecure"], "is not a ZeroMQ endpoint", 2),
    (["--connect", "tcp://127.0.0.1:1", "--clients", "0-3", "--insecure", "--data-root", "/no/such/dir"],
     "no data root exists", 1),
    (["--connect", "tcp://127.0.0.1:1", "--clients", "0-3"], "give --server-key and --key", 2),
    (["--connect", "tcp://127.0.0.1:1", "--clients", "0-3", "--server-key", "/nope.key", "--key", "/nope"],
     "cannot read key file", 1),
    (["--connect", "tcp://127.0.0.1:1", "--clients", "0-3", "--insecure", "--key", "k"], "drop --server-key", 2),
])
def test_node_refuses_bad_inputs_in_one_line(args, expected, code, tmp_path):
    code_, output = invoke("node", *args)
    assert code_ == code and expected in output, output
    assert "Traceback" not in output


def test_keys_writes_a_roster_per_node_or_per_device(tmp_path):
    import json

    code, output = invoke("keys", str(tmp_path / "k"), "--clients", "10", "--nodes", "3")
    assert code == 0 and "fcl-emu coordinator --keys" in output and "--clients 4-7 " in output
    roster = json.loads((tmp_path / "k" / "roster.json").read_text())
    grants = {entry["name"]: entry["identities"] for entry in roster.values()}
    assert grants["node-1"] == [f"client-{i:04d}" for i in range(4, 8)]  # contiguous blocks
    assert grants["node-2"] == ["client-0008", "client-0009"]
    assert len(grants["gpu-workers"]) == 64
    code, _ = invoke("keys", str(tmp_path / "d"), "--clients", "3", "--per-device")
    grants = {e["name"]: e["identities"] for e in json.loads((tmp_path / "d" / "roster.json").read_text()).values()}
    assert grants["client-0002"] == ["client-0002"] and (tmp_path / "d" / "client-0002.key_secret").is_file()


def test_heartbeats_are_stretched_to_the_coordinator_budget():
    network = load_config(None, {}).network
    assert network.liveness(300) == (1.0, 10.0)  # 300 heartbeats/s: within the 1,000/s budget
    assert network.liveness(10_000) == (10.0, 100.0)  # stretched x10
    tight = load_config(None, {"network": {"heartbeat_budget_per_s": 100, "heartbeat_interval_s": 0.5}}).network
    assert tight.liveness(100) == (1.0, 20.0)


def test_a_coordinator_without_keys_says_how_to_get_them(tmp_path, mnist_root):
    code, output = invoke("coordinator", "--clients", "4", "--data-root", str(mnist_root))
    assert code == 1 and "write one with `fcl-emu keys` and pass --keys" in output and "Traceback" not in output
    code, output = invoke("coordinator", "--clients", "4", "--keys", str(tmp_path / "none"), "--data-root",
                          str(mnist_root))
    assert code == 1 and "does not exist" in output


def test_bind_takes_ports_1_to_65535_or_any_free_port():
    for bind in ("tcp://127.0.0.1:0", "tcp://0.0.0.0:65535", "tcp://[::1]:1", "tcp://*:*", "ipc:///tmp/fcl-emu"):
        assert load_config(None, {"network": {"bind": bind}}).network.bind == bind
    for bind in ("tcp://127.0.0.1:65536", "tcp://host", "tcp://host:-1"):
        with pytest.raises(ValueError, match="port from 1 to 65535"):
            load_config(None, {"network": {"bind": bind}})


@pytest.mark.parametrize("clients", ["0", "-3"])
def test_keys_refuses_a_run_without_clients(tmp_path, clients):
    code, output = invoke("keys", str(tmp_path / "k"), "--clients", clients)
    assert code == 2 and f"--clients: must be at least 1 (got {clients})" in output
    assert not (tmp_path / "k").exists()


@pytest.mark.parametrize("command", [
    ["up", "--clients", "4", "--nodes", "1", "--run-dir", "{target}"],
    ["coordinator", "--clients", "4", "--insecure", "--run-dir", "{target}"],
    ["keys", "{target}", "--clients", "4"],
    ["deploy", "{target}", "--data-root", "{tmp}"],
    ["report", "{tmp}", "--out", "{target}"],
    ["compare", "{tmp}", "--out", "{target}"],
    ["bench", "secagg", "--clients", "4", "--dim", "10", "--json", "{target}/secagg.json"],
    ["bench", "scale", "--out", "{target}"],
    ["bench", "churn", "--out", "{target}"],
])
def test_a_command_refuses_a_folder_it_cannot_write_in_one_line(tmp_path, command):
    (tmp_path / "file").write_text("not a folder")
    target = tmp_path / "file" / "out"
    code, output = invoke(*(arg.format(target=target, tmp=tmp_path) for arg in command))
    assert code == 1 and f"error: cannot write to {target}" in output and "is not a directory" in output, output
    assert "Traceback" not in output and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_folder_without_write_permission_is_refused(tmp_path):
    (tmp_path / "locked").mkdir(mode=0o500)
    code, output = invoke("keys", str(tmp_path / "locked" / "k"), "--clients", "4")
    assert code == 1 and "no permission to write in" in output and "Traceback" not in output
