"""Prometheus metrics, the targets file, the Prometheus and Grafana configuration, and a real Prometheus."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from fcl_emu.bench.metrics import series_count, simulate
from fcl_emu.cli import app
from fcl_emu.launchers import node_args
from fcl_emu.runconfig import gpu_worker_metrics_port, load_config, metrics_ports
from fcl_emu.monitoring import stack
from fcl_emu.monitoring.metrics import CoordinatorMetrics, EdgeNodeMetrics, GpuWorkerMetrics
from tests.conftest import fcl_emu, free_port, small_config

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
DASHBOARDS = sorted((MONITORING / "grafana" / "dashboards").glob("*.json"))
DOC = ROOT / "docs" / "monitoring.md"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def family_names(process) -> set[str]:
    return {family.name for family in process.registry.collect()}


def sample_names(process) -> set[str]:
    return {name for name, _ in process.series()}


# ------------------------------------------------------------------ metrics API
def test_wire_counters_move_and_registries_are_separate():
    a, b = CoordinatorMetrics(), CoordinatorMetrics()
    a.count_message("heartbeat", "received", 40)
    a.count_message("heartbeat", "received", 60)
    a.rejected("bad_header")
    labels = {"role": "coordinator", "type": "heartbeat", "direction": "received"}
    assert a.registry.get_sample_value("fcl_wire_bytes_total", labels) == 100
    assert a.registry.get_sample_value("fcl_wire_messages_total", labels) == 2
    assert a.registry.get_sample_value("fcl_wire_rejected_messages_total",
                                       {"role": "coordinator", "reason": "bad_header"}) == 1
    assert b.registry.get_sample_value("fcl_wire_bytes_total", labels) is None  # its own registry
    edge = EdgeNodeMetrics()
    edge.count_message("update", "sent", 1000)
    edge.trained(1.5, "ok", 40)
    assert edge.registry.get_sample_value("fcl_wire_bytes_total",
                                          {"role": "edge_node", "type": "update", "direction": "sent"}) == 1000
    assert edge.registry.get_sample_value("fcl_client_train_duration_seconds_count") == 1
    assert edge.registry.get_sample_value("fcl_client_train_jobs_total", {"outcome": "ok"}) == 1


def test_round_and_task_metrics():
    m = CoordinatorMetrics()
    m.round_started(1, 0, 7)
    m.round_closed(duration_s=2.0, phases_s={"dispatch": 0.01, "collect": 1.5}, selected=10, participants=8,
                   missed_deadline=2, failed=0, skipped=False, mean_loss=0.4, accuracy_seen_percent=80.0)
    m.task_ended(task=1, matrix=[[90.0, None], [60.0, 95.0]], accuracy_seen_percent=77.5, average_accuracy=77.5,
                 average_incremental_accuracy=83.75, average_forgetting=30.0,
                 phases_s={"end_task": 0.1, "evaluate": 0.5})
    get = m.registry.get_sample_value
    assert (get("fcl_task"), get("fcl_round")) == (1, 7)
    assert get("fcl_round_clients", {"state": "missed_deadline"}) == 2
    assert get("fcl_client_rounds_total", {"outcome": "participated"}) == 8
    assert get("fcl_round_phase_duration_seconds_count", {"phase": "collect"}) == 1
    assert get("fcl_task_accuracy_ratio", {"task": "0"}) == pytest.approx(0.60)
    assert get("fcl_average_forgetting_ratio") == pytest.approx(0.30)
    assert get("fcl_rounds_total", {"outcome": "aggregated"}) == 1


def test_series_do_not_grow_with_clients_and_stay_under_2000_at_300():
    small = simulate(clients=30)
    large = simulate(clients=300)
    n_small, n_large = series_count(small[0], *small[1]), series_count(large[0], *large[1])
    assert n_large == n_small  # nothing per client
    assert n_large < 2000, n_large
    for process in (large[0], *large[1]):
        for _, labels in process.series():
            assert not any(re.fullmatch(r"client-\d+", v) for v in labels.values())


def test_names_follow_the_conventions_and_are_documented():
    coordinator, edge = simulate(clients=10)
    doc = DOC.read_text()
    for process in (coordinator, edge[0], GpuWorkerMetrics(torch.device("cpu"))):
        for family in process.registry.collect():
            assert family.name.startswith("fcl_"), family.name
            for sample in family.samples:
                if family.type == "counter":
                    assert sample.name.endswith("_total"), sample.name
                assert not sample.name.endswith("_created"), sample.name
            documented = family.name + ("_total" if family.type == "counter" else "")
            if family.type == "info":
                documented = family.name + "_info"
            assert f"`{documented}`" in doc, f"{documented} is not in docs/monitoring.md"


def test_metrics_endpoint_serves_the_registry():
    m = EdgeNodeMetrics()
    m.count_message("join", "sent", 60)
    port = m.serve(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        m.close()
    assert 'fcl_wire_bytes_total{direction="sent",role="edge_node",type="join"} 60.0' in text
    assert "fcl_process_resident_memory_bytes" in text


# ------------------------------------------------------------ targets and ports
def test_targets_file_shape(tmp_path):
    path = stack.write_targets(tmp_path / "run", stack.run_targets("127.0.0.1", 9100, 2), "abc123")
    assert path.name == "prometheus_targets.json"
    groups = json.loads(path.read_text())
    assert [g["targets"] for g in groups] == [["127.0.0.1:9100"], ["127.0.0.1:9101"], ["127.0.0.1:9102"]]
    assert [g["labels"] for g in groups] == [
        {"role": "coordinator", "process": "coordinator", "run_id": "abc123"},
        {"role": "edge_node", "process": "node-0", "run_id": "abc123"},
        {"role": "edge_node", "process": "node-1", "run_id": "abc123"}]
    wildcard = stack.targets_document(stack.run_targets("0.0.0.0", 9100, 0), "x")
    assert wildcard[0]["targets"] == ["127.0.0.1:9100"]  # scraped locally


def test_nodes_get_the_following_ports(tmp_path):
    plain_tcp = {"security": {"transport": "plain"}}
    config = load_config(None, {"metrics": {"port": 9300}, "nodes": 3, "data_root": [str(tmp_path)], **plain_tcp})
    for n in range(3):
        assert node_args("tcp://127.0.0.1:1", [n], config, f"node-{n}", n).metrics_port == 9301 + n
    plain = load_config(None, {"data_root": [str(tmp_path)], **plain_tcp})
    assert node_args("tcp://127.0.0.1:1", [0], plain, "node-0", 0).metrics_port is None
    workers = load_config(None, {"metrics": {"port": 9300}, "nodes": 3, "gpu": {"workers": 2},
                                 "data_root": [str(tmp_path)]})
    assert [gpu_worker_metrics_port(workers, j) for j in (0, 1)] == [9304, 9305]
    assert metrics_ports(workers, start_nodes=True) == [9300, 9301, 9302, 9303, 9304, 9305]
    assert metrics_ports(workers, start_nodes=False) == [9300, 9304, 9305]  # `fcl-emu coordinator`
    targets = stack.run_targets("127.0.0.1", 9300, 0, 2, gpu_offset=3)
    assert [(t.process, t.role, t.port) for t in targets] == [
        ("coordinator", "coordinator", 9300), ("gpu-worker-0", "gpu_worker", 9304),
        ("gpu-worker-1", "gpu_worker", 9305)]


def test_busy_metrics_port_and_bad_port_fail_before_the_run(tmp_path):
    import socket

    runner = CliRunner()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = runner.invoke(app, ["up", "--clients", "4", "--nodes", "1", "--metrics-port", str(port),
                                     "--data-root", str(tmp_path), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and "in use" in result.output and "--metrics-port" in result.output
    result = runner.invoke(app, ["up", "--metrics-port", "65535", "--nodes", "2"])
    assert result.exit_code == 2 and "metrics" in result.output


def test_missing_prometheus_binary_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    server = stack.LocalPrometheus(tmp_path, port=free_port())
    with pytest.raises(RuntimeError, match="apt-get install prometheus"):
        server.start()


# ------------------------------------------------- Prometheus and Grafana files
def test_prometheus_config_reads_the_targets_file(tmp_path):
    base = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    (job,) = base["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/etc/prometheus/run/prometheus_targets.json"]
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    mounts = compose["services"]["prometheus"]["volumes"]
    assert any(v.endswith(":/etc/prometheus/run:ro") for v in mounts)
    config = stack.prometheus_config(tmp_path / "prometheus_targets.json", 1.0)
    assert config["global"]["scrape_interval"] == "1s"
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str(tmp_path / "prometheus_targets.json")]
    if shutil.which("promtool"):
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        check = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_grafana_provisioning_matches_the_compose_mounts():
    prov = MONITORING / "grafana" / "provisioning"
    (ds,) = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus"
    (provider,) = yaml.safe_load((prov / "dashboards" / "fcl-emu.yml").read_text())["providers"]
    grafana = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expression) for every query of every dashboard."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


CONTAINERS_BOARD = "containers.json"


def container_metric_names() -> set[str]:
    """The series the coordinator serves for edge-node containers (containers/stats.py), from one sample."""
    from fcl_emu.containers.stats import ContainerStats, sample

    stats = ContainerStats(lambda: {}, {"node-0": "fast"}, interval_s=60)
    stats.latest = {"node-0": sample({})}
    stats.close()
    return {s.name for family in stats.collect() for s in family.samples}


def test_dashboards_are_well_formed():
    assert {p.stem for p in DASHBOARDS} >= {"overview", "communication", "clients", "timing", "containers"}
    uids = set()
    tiered = CoordinatorMetrics()  # a run with edge aggregators adds the tier's counter
    tiered.edge_tier_bytes("sent", 1)
    known = sample_names(simulate(clients=4)[0]) | sample_names(simulate(clients=4)[1][0]) | \
        sample_names(GpuWorkerMetrics(torch.device("cpu"))) | container_metric_names() | sample_names(tiered)
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] not in uids
        uids.add(board["uid"])
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert "run_id" in variables
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        cells = set()
        for panel in board["panels"]:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            g = panel["gridPos"]
            assert g["x"] + g["w"] <= 24
            for x in range(g["x"], g["x"] + g["w"]):  # panels do not overlap
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{path.name}: {panel['title']} overlaps"
                    cells.add((x, y))
            refs = [t["refId"] for t in panel["targets"]]
            assert panel["targets"] and len(refs) == len(set(refs))
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"]
                assert '$run_id' in target["expr"]
                for name in re.findall(r"\bfcl_[a-z_]+", target["expr"]):
                    assert name in known, f"{path.name}: {panel['title']} uses unknown {name}"


# ------------------------------------------------ a real Prometheus, a real run
def query_range(url: str, expr: str, start: float, end: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 1})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path, mnist_root):
    if stack.prometheus_binary() is None:
        pytest.skip("the `prometheus` binary is not installed (`apt-get install prometheus`; .ci/run installs it)")
    scrape_s = 1.0
    profiles = tmp_path / "profiles.yaml"  # a fast link, so the link-delay panels have data
    profiles.write_text(yaml.safe_dump({"profiles": [{"name": "lan", "uplink_mbps": 1000, "latency_ms": 1}]}))
    config = small_config(tmp_path / "c.yaml", scenario={"num_clients": 20},
                          # the real clock: edge nodes play the link delays out in host time (the link panels)
                          rounds={"clients_per_round": 4, "rounds_per_task": 2, "eval_every": 2, "clock": "real"},
                          training={"local_epochs": 1, "batch_size": 64},
                          edge={"device_profiles": str(profiles)},
                          secagg={"enabled": True},  # so that the secure-aggregation panels have data
                          topology={"edge_aggregators": 2},  # and the tier panel (one node under each)
                          metrics={"scrape_interval_s": scrape_s, "linger_s": 2 * scrape_s})
    run_dir = tmp_path / "run"
    metrics_port = stack.find_port_block("127.0.0.1", 4, start=20000 + free_port() % 20000, stop=65000)
    started = time.time()
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir),
                   "--gpu-workers", "1", "--gpu-device", "cpu",  # the device check gives the GPU panels data
                   "--metrics-port", str(metrics_port), "--prometheus", "--prometheus-port", str(free_port()),
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    ended = time.time()
    assert "prometheus: http://127.0.0.1:" in output and "prometheus stopped" in output, output
    run_id = json.loads((run_dir / "prometheus_targets.json").read_text())[0]["labels"]["run_id"]
    # the run's Prometheus stopped with the run; start it again on its data, as docs/monitoring.md says
    prometheus = stack.LocalPrometheus(run_dir, port=free_port(), scrape_interval_s=scrape_s)
    prometheus.start()
    try:
        up = query_range(prometheus.url, f'up{{run_id="{run_id}"}}', started, ended)
        assert {s["metric"]["process"] for s in up if has_data(up)} == {"coordinator", "node-0", "node-1",
                                                                         "gpu-worker-0"}
        # `up --prometheus` holds the first round until every process was scraped once (fcl_emu/run.py)
        rounds = query_range(prometheus.url, f'fcl_round{{run_id="{run_id}"}}', started, ended)
        assert rounds and float(rounds[0]["values"][0][1]) == 0, f"a round ran before the first scrape: {rounds}"
        rate_interval = f"{int(4 * scrape_s)}s"  # Grafana's $__rate_interval: max(step + scrape, 4 scrapes)
        empty = []
        # the containers board has its own test (test_containers); energy and batteries are the emulated clock's,
        # and this run is on the real clock (the link panels need it): tests/test_energy.py reads those series
        queries = [q for q in dashboard_queries() if q[0] != CONTAINERS_BOARD
                   and not any(name in q[2] for name in ("fcl_energy_", "fcl_battery_"))]
        for board, title, expr in queries:
            concrete = expr.replace("$__rate_interval", rate_interval).replace("$run_id", run_id)
            if not has_data(query_range(prometheus.url, concrete, started, ended)):
                empty.append(f"{board}: {title}: {concrete}")
        assert not empty, "queries without data:\n" + "\n".join(empty)
        assert len(queries) > 40
    finally:
        prometheus.stop()
