"""`fcl-emu deploy`'s files, checked without Docker: written with --image and no engine, Prometheus labelling
every target as the dashboards select, Grafana provisioned with the data source and the dashboards, both kept on
the manager's loopback unless published, Grafana's admin password generated into a private file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fcl_emu.cli import app
from fcl_emu.deploy import GRAFANA_PORT, PROMETHEUS_PORT
from fcl_emu.options import NOT_DEPLOYED, OPTIONS
from fcl_emu.monitoring.stack import DASHBOARDS_DIR
from fcl_emu.runconfig import load_config

RUN_LABELS = {"run_id", "role", "process"}  # what prometheus_targets.json gives `up`'s runs


def deploy(out: Path, data: Path, *flags: str) -> str:
    """Write a two-node deployment with a GPU worker where no Docker engine answers; return what it printed."""
    result = CliRunner().invoke(app, ["deploy", str(out), "--image", "fcl-emu:somewhere-else", "--data-root",
                                      str(data), "--nodes", "2", "--clients", "8", "--gpu-workers", "1", *flags],
                                env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def deployed(tmp_path_factory) -> Path:
    """The files of the deployment :func:`deploy` writes, monitoring not published."""
    out = tmp_path_factory.mktemp("deploy") / "out"
    printed = deploy(out, tmp_path_factory.mktemp("data"))
    assert f"Grafana http://127.0.0.1:{GRAFANA_PORT}" in printed and "swarm: neither published" in printed
    return out


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, str]:
    """The files of the same deployment with --publish-monitoring, and what it printed."""
    out = tmp_path_factory.mktemp("published") / "out"
    return out, deploy(out, tmp_path_factory.mktemp("data"), "--publish-monitoring")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def dashboard_selectors() -> set[str]:
    """The labels the dashboards' queries select by a dashboard variable (``label="$var"``, ``label=~"$var"``)."""
    labels = set()
    for path in DASHBOARDS_DIR.glob("*.json"):
        labels |= set(re.findall(r'(\w+)\s*=~?\s*\\?"\$', path.read_text()))
    return labels


def test_written_without_an_engine_and_the_run_id_fixed(deployed):
    config = load_config(deployed / "config.yaml", {})
    assert re.fullmatch(r"[0-9a-f]{12}", config.metrics.run_id)
    assert {p.name for p in deployed.iterdir()} >= {"stack.yml", "compose.yml", "config.yaml", "keys",
                                                    "prometheus.yml", "grafana", "runs"}
    for file in ("stack.yml", "compose.yml"):
        assert {s["image"] for n, s in load(deployed / file)["services"].items() if n != "grafana"} == {
            "fcl-emu:somewhere-else"}


def test_prometheus_labels_every_target_as_the_dashboards_select(deployed):
    assert dashboard_selectors() == {"run_id"}  # the run variable; role and process are grouped by
    run_id = load(deployed / "config.yaml")["metrics"]["run_id"]
    job, = load(deployed / "prometheus.yml")["scrape_configs"]
    assert job["honor_labels"] is True  # the wire metrics' own role label is kept as is
    groups = job["static_configs"]
    assert {(g["targets"][0], g["labels"]["process"], g["labels"]["role"]) for g in groups} == {
        ("coordinator:9100", "coordinator", "coordinator"), ("node-0:9101", "node-0", "edge_node"),
        ("node-1:9102", "node-1", "edge_node"), ("coordinator:9103", "gpu-worker-0", "gpu_worker")}
    for group in groups:
        assert set(group["labels"]) == RUN_LABELS and group["labels"]["run_id"] == run_id


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) is not installed")
def test_promtool_accepts_the_prometheus_configuration(deployed):
    checked = subprocess.run(["promtool", "check", "config", str(deployed / "prometheus.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("file", ["stack.yml", "compose.yml"])
def test_grafana_is_provisioned_with_prometheus_and_every_dashboard(deployed, file):
    spec = load(deployed / file)
    grafana, prometheus = spec["services"]["grafana"], spec["services"]["prometheus"]
    assert f"--web.listen-address=:{PROMETHEUS_PORT}" in prometheus["command"]
    mounted = {c["target"]: deployed / spec["configs"][c["source"]]["file"] for c in grafana["configs"]}

    sources = [load(path) for target, path in mounted.items()
               if target.startswith("/etc/grafana/provisioning/datasources/")]
    source, = [s for doc in sources for s in doc["datasources"]]
    assert (source["url"], source["uid"], source["isDefault"]) == (
        f"http://prometheus:{PROMETHEUS_PORT}", "fcl-prometheus", True)
    assert source["jsonData"]["timeInterval"] == "5s"

    providers = [load(path) for target, path in mounted.items()
                 if target.startswith("/etc/grafana/provisioning/dashboards/")]
    provider, = [p for doc in providers for p in doc["providers"]]
    folder = provider["options"]["path"]
    provisioned = {Path(t).name: path for t, path in mounted.items() if Path(t).parent == Path(folder)}
    assert set(provisioned) == {p.name for p in DASHBOARDS_DIR.glob("*.json")}
    for name, path in provisioned.items():
        assert json.loads(path.read_text()) == json.loads((DASHBOARDS_DIR / name).read_text())
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{folder}/overview.json"
    assert grafana["networks"] == prometheus["networks"]
    if file == "stack.yml":
        assert grafana["deploy"]["placement"] == {"constraints": ["node.role == manager"]}


def test_monitoring_stays_on_the_managers_loopback_by_default(deployed):
    """Compose binds Prometheus and Grafana to 127.0.0.1; the stack, whose ports take no host address, publishes
    neither; Grafana keeps its anonymous viewers there, and nothing else publishes a port."""
    compose, stack = load(deployed / "compose.yml"), load(deployed / "stack.yml")
    assert {n: s["ports"] for n, s in compose["services"].items() if "ports" in s} == {
        "prometheus": [f"127.0.0.1:{PROMETHEUS_PORT}:{PROMETHEUS_PORT}"],
        "grafana": [f"127.0.0.1:{GRAFANA_PORT}:{GRAFANA_PORT}"]}
    assert not [n for n, s in stack["services"].items() if "ports" in s]
    for spec in (compose, stack):
        assert spec["services"]["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"


def test_grafanas_admin_password_is_generated_into_a_private_file(deployed, published):
    """Each deployment draws its own password, kept in keys/grafana.env (0600) that both files hand to Grafana."""
    passwords = set()
    for out in (deployed, published[0]):
        env = out / "keys" / "grafana.env"
        assert env.stat().st_mode & 0o777 == 0o600
        key, password = env.read_text().strip().split("=", 1)
        assert key == "GF_SECURITY_ADMIN_PASSWORD" and len(password) >= 24 and password != "admin"
        passwords.add(password)
        for file in ("stack.yml", "compose.yml"):
            grafana = load(out / file)["services"]["grafana"]
            assert grafana["env_file"] == ["./keys/grafana.env"]
            assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana["environment"]
    assert len(passwords) == 2


def test_publish_monitoring_binds_every_interface_and_says_what_it_exposes(published):
    out, printed = published
    compose, stack = load(out / "compose.yml"), load(out / "stack.yml")
    for name, port in (("prometheus", PROMETHEUS_PORT), ("grafana", GRAFANA_PORT)):
        assert compose["services"][name]["ports"] == [f"{port}:{port}"]
        assert stack["services"][name]["ports"] == [{"target": port, "published": port, "mode": "host"}]
        assert stack["services"][name]["deploy"]["placement"] == {"constraints": ["node.role == manager"]}
    for spec in (compose, stack):
        assert spec["services"]["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    line, = [line for line in printed.splitlines() if "published on every interface" in line]
    assert f"Grafana on port {GRAFANA_PORT}" in line and f"Prometheus on port {PROMETHEUS_PORT}" in line
    assert "no anonymous viewers" in line and f"password in {out / 'keys' / 'grafana.env'}" in line


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI")
@pytest.mark.parametrize("which", ["deployed", "published"])
def test_the_docker_cli_accepts_the_stack(which, request):
    """`docker stack config` (the CLI alone, no engine) checks stack.yml against the stack format's schema."""
    out = request.getfixturevalue(which)
    out = out[0] if which == "published" else out
    checked = subprocess.run(["docker", "stack", "config", "-c", "stack.yml"], cwd=out, capture_output=True,
                             text=True, timeout=60)
    if "unknown command" in checked.stderr:
        pytest.skip(f"this docker CLI has no `stack config`: {checked.stderr.strip()}")
    assert checked.returncode == 0, checked.stderr
    assert "GF_SECURITY_ADMIN_PASSWORD" in checked.stdout  # read from keys/grafana.env


def test_deploy_help_shows_only_what_deploy_takes():
    """No --resume or --verbose (it starts no run), none of `up`'s flags it sets itself or has no use for."""
    result = CliRunner().invoke(app, ["deploy", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "{out}" not in result.output and "OUT_DIR" in result.output.splitlines()[1]
    shown = set(re.findall(r"^│ (--[a-z-]+)", result.output, re.MULTILINE))  # each row's flag, not the help texts
    assert {"--publish-monitoring", "--image", "--nodes", "--data-root", "--node-cpus"} <= shown
    assert not shown & {"--resume", "--verbose", *(OPTIONS[name].flag for name in NOT_DEPLOYED)}


@pytest.mark.parametrize("data_root,env,expected", [
    (None, None, "(the default) does not exist"),
    (None, "{tmp}/env-data", "env-data (from $FCL_EMU_DATA_ROOT) does not exist"),
    ("{tmp}/missing", None, "missing does not exist"),
    ("{tmp}/file", None, "file is not a folder"),
])
def test_a_data_root_that_is_not_there_is_refused_in_one_line_before_any_file_is_written(
        tmp_path, monkeypatch, data_root, env, expected):
    monkeypatch.chdir(tmp_path)  # the default ./data is not there
    (tmp_path / "file").write_text("")
    if env:
        monkeypatch.setenv("FCL_EMU_DATA_ROOT", env.format(tmp=tmp_path))
    else:
        monkeypatch.delenv("FCL_EMU_DATA_ROOT", raising=False)
    flags = ["--data-root", data_root.format(tmp=tmp_path)] if data_root else []
    result = CliRunner().invoke(app, ["deploy", str(tmp_path / "out"), "--image", "fcl-emu:x", *flags])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: --data-root: "), result.output
    assert expected in lines[0] and "mount it read-only at /data" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_coordinator_takes_the_run_id_it_is_given(tmp_path, mnist_root):
    """The run_id label Prometheus puts on every target is the coordinator's own (fcl_run_info, summary.json)."""
    from fcl_emu.coordinator.lifecycle import Coordinator
    from tests.conftest import keyed, small_config

    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 4}),
                         {"data_root": [str(mnist_root)], "metrics": {"run_id": "deployed-0"}})
    config, _ = keyed(config, tmp_path / "keys")
    coordinator = Coordinator(config)
    try:
        assert coordinator.run_id == "deployed-0"
    finally:
        coordinator.close()
    with pytest.raises(ValueError, match="run_id"):
        load_config(None, {"metrics": {"run_id": "a run"}})


def test_the_coordinator_service_gets_its_gpu_workers_key(deployed):
    """The coordinator starts its GPU workers with the key under its secrets (coordinator/gpu_pool.py)."""
    stack = load(deployed / "stack.yml")
    assert "gpu-workers.key_secret" in stack["services"]["coordinator"]["secrets"]
    assert stack["secrets"]["gpu-workers.key_secret"] == {"file": "./keys/gpu-workers.key_secret"}
    assert (deployed / "keys" / "gpu-workers.key_secret").is_file()
    assert "gpu-workers.key_secret" not in stack["services"]["node-0"]["secrets"]
