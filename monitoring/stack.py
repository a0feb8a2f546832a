"""The monitoring stack around a run: its Prometheus targets, a local Prometheus server, Grafana's provisioning.

- :func:`write_targets` writes ``<run_dir>/prometheus_targets.json`` in
  Prometheus's file-based service discovery format: one target group per
  process (the coordinator, each edge node of ``fcl-emu up``) with the labels
  ``role``, ``process`` and ``run_id`` (the dashboards filter on ``run_id``).
- :func:`static_prometheus_config` is the same configuration with the targets
  written in (``fcl-emu deploy``, where the run's processes are services).
- :func:`grafana_datasource`, :func:`grafana_dashboard_provider` and
  :func:`dashboards`: the provisioning in ``monitoring/grafana/`` for a Grafana
  that reaches Prometheus at a given URL.
- :class:`LocalPrometheus` runs the ``prometheus`` binary for ``fcl-emu up
  --prometheus`` with a run-specific copy of ``monitoring/prometheus/prometheus.yml``
  under ``<run_dir>/prometheus/`` (its TSDB too), listening on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
PROMETHEUS_CONFIG = HERE / "prometheus" / "prometheus.yml"
DASHBOARDS_DIR = HERE / "grafana" / "dashboards"
GRAFANA_PROVISIONING = HERE / "grafana" / "provisioning"
GRAFANA_DATASOURCE = GRAFANA_PROVISIONING / "datasources" / "prometheus.yml"
GRAFANA_DASHBOARD_PROVIDER = GRAFANA_PROVISIONING / "dashboards" / "fcl-emu.yml"
TARGETS_FILE = "prometheus_targets.json"

INSTALL_HINT = (
    "the `prometheus` binary is not on PATH, so no local Prometheus was started (the run goes on; its "
    "/metrics endpoints and prometheus_targets.json are there for any Prometheus). Install it with "
    "`sudo apt-get install prometheus` (Debian/Ubuntu), `brew install prometheus` (macOS), or download a "
    "release from https://prometheus.io/download/ and put `prometheus` on PATH; or start Prometheus and "
    "Grafana in Docker with monitoring/docker-compose.yml (docs/dashboards.md).")


class PortInUseError(RuntimeError):
    """A /metrics port asked for is taken."""


@dataclass(frozen=True)
class Target:
    process: str  # "coordinator", "node-0", ...
    role: str  # "coordinator" or "edge_node"
    host: str
    port: int

    @property
    def address(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):  # listening everywhere: scrape it locally
            host = "127.0.0.1"
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def run_targets(host: str, port: int, nodes: int, gpu_workers: int = 0, gpu_offset: int | None = None) -> list[Target]:
    """The coordinator on ``port``, edge node ``i`` on ``port + 1 + i``, GPU worker ``j`` on
    ``port + 1 + gpu_offset + j`` (``gpu_offset`` defaults to ``nodes``)."""
    offset = nodes if gpu_offset is None else gpu_offset
    return [Target("coordinator", "coordinator", host, port)] + [
        Target(f"node-{i}", "edge_node", host, port + 1 + i) for i in range(nodes)] + [
        Target(f"gpu-worker-{j}", "gpu_worker", host, port + 1 + offset + j) for j in range(gpu_workers)]


def targets_document(targets: list[Target], run_id: str) -> list[dict]:
    return [{"targets": [t.address], "labels": {"role": t.role, "process": t.process, "run_id": run_id}}
            for t in targets]


def write_targets(run_dir: Path, targets: list[Target], run_id: str) -> Path:
    """Write ``<run_dir>/prometheus_targets.json`` atomically (Prometheus watches the file)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / TARGETS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(targets_document(targets, run_id), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_ports(host: str, ports: list[int]) -> None:
    busy = [p for p in ports if not port_free(host, p)]
    if busy:
        raise PortInUseError(
            f"metrics port{'s' if len(busy) > 1 else ''} {', '.join(map(str, busy))} on {host} "
            f"{'are' if len(busy) > 1 else 'is'} in use; the coordinator takes --metrics-port P and edge node i "
            f"takes P+1+i: choose another --metrics-port")


def find_port_block(host: str, count: int, start: int = 9400, stop: int = 10400) -> int:
    """The first P >= start with P .. P+count-1 all free (for --prometheus without --metrics-port)."""
    port = start
    while port + count <= stop:
        busy = [p for p in range(port, port + count) if not port_free(host, p)]
        if not busy:
            return port
        port = busy[-1] + 1
    raise PortInUseError(f"no {count} consecutive free ports in {start}-{stop}: set --metrics-port")


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def prometheus_config(targets_file: Path, scrape_interval_s: float) -> dict:
    """``monitoring/prometheus/prometheus.yml`` pointed at one run's targets file, with a scrape interval."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    interval = _duration(scrape_interval_s)
    config.setdefault("global", {}).update(scrape_interval=interval, scrape_timeout=interval,
                                           evaluation_interval=interval)
    for job in config.get("scrape_configs", []):
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(Path(targets_file).resolve())]
    return config


def static_prometheus_config(targets: list[Target], run_id: str, scrape_interval_s: float) -> dict:
    """:func:`prometheus_config` with ``targets`` written in (each with its ``role``, ``process`` and ``run_id``)
    instead of read from a targets file."""
    config = prometheus_config(Path(TARGETS_FILE), scrape_interval_s)
    for job in config.get("scrape_configs", []):
        if job.pop("file_sd_configs", None) is not None:
            job["static_configs"] = targets_document(targets, run_id)
    return config


def dashboards() -> list[Path]:
    """The project's Grafana dashboards (JSON)."""
    return sorted(DASHBOARDS_DIR.glob("*.json"))


def grafana_dashboard_provider() -> dict:
    """The project's dashboard provider: the folder ``fcl-emu``, loaded from :func:`dashboard_provider_path`."""
    return yaml.safe_load(GRAFANA_DASHBOARD_PROVIDER.read_text())


def dashboard_provider_path() -> str:
    """Where Grafana's dashboard provider loads the dashboards from (in Grafana's container)."""
    return grafana_dashboard_provider()["providers"][0]["options"]["path"]


def grafana_datasource(prometheus_url: str, scrape_interval_s: float) -> dict:
    """The project's Prometheus data source (uid ``fcl-prometheus``) at ``prometheus_url``, scraping every
    ``scrape_interval_s`` (``$__rate_interval`` spans at least four scrapes)."""
    config = yaml.safe_load(GRAFANA_DATASOURCE.read_text())
    for source in config["datasources"]:
        source["url"] = prometheus_url
        source.setdefault("jsonData", {})["timeInterval"] = _duration(scrape_interval_s)
    return config


def _duration(seconds: float) -> str:
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


class LocalPrometheus:
    """A ``prometheus`` process for one run; data and logs under ``<run_dir>/prometheus/``."""

    def __init__(self, run_dir: Path, *, port: int = 9090, scrape_interval_s: float = 5.0,
                 binary: str | None = None):
        self.run_dir = Path(run_dir)
        self.port = port
        self.scrape_interval_s = scrape_interval_s
        self.binary = binary or prometheus_binary()
        self.dir = self.run_dir / "prometheus"
        self.config_file = self.dir / "prometheus.yml"
        self.data_dir = self.dir / "data"
        self.log_file = self.dir / "prometheus.log"
        self.pid_file = self.dir / "prometheus.pid"
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [self.binary, f"--config.file={self.config_file}", f"--storage.tsdb.path={self.data_dir}",
                f"--web.listen-address=127.0.0.1:{self.port}"]

    def start(self, timeout_s: float = 30.0) -> None:
        """Write the config, start the server and wait until it is ready. Raises RuntimeError on failure."""
        if self.binary is None:
            raise RuntimeError(INSTALL_HINT)
        if not port_free("127.0.0.1", self.port):
            raise RuntimeError(f"port {self.port} is in use (another Prometheus?): choose --prometheus-port")
        self.dir.mkdir(parents=True, exist_ok=True)
        config = prometheus_config(self.run_dir / TARGETS_FILE, self.scrape_interval_s)
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        with open(self.log_file, "ab") as log:
            # a session of its own: a Ctrl-C of the run reaches the run, which stops Prometheus after a last scrape
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid_file.write_text(f"{self.proc.pid}\n")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_file.read_text(errors="replace").strip().splitlines()[-3:]
                self.proc = None
                raise RuntimeError(f"prometheus exited at start-up: {' | '.join(tail)} (log {self.log_file})")
            if self.ready():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus did not become ready within {timeout_s:.0f} s (log {self.log_file})")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def scraped(self, targets: int) -> bool:
        """Whether this server knows ``targets`` targets and its last scrape of every one succeeded (health
        "up": each has been scraped at least once). False while it cannot be asked."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/targets?state=active", timeout=1) as response:
                active = json.loads(response.read())["data"]["activeTargets"]
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
            return False
        return len(active) >= targets and all(t.get("health") == "up" for t in active)

    def stop(self, timeout_s: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.pid_file.unlink(missing_ok=True)

    def detach(self) -> None:
        """Leave the server running past this process (``--keep-prometheus``)."""
        self.proc = None
