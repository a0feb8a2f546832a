"""A whole run as files a user deploys and edits: a Swarm stack, a plain Compose file, their keys and Prometheus.

``fcl-emu deploy OUT_DIR ...`` (same run flags as ``up``) writes:

- ``stack.yml``: for ``docker stack deploy -c stack.yml NAME`` on a swarm manager. The coordinator, one service
  per edge node and Prometheus, all from the project's image, on an attachable overlay network, with
  ``endpoint_mode: dnsrr``, ``restart_policy: none``, each node's device-class CPU and memory limits and its
  placement on swarm nodes labelled ``fcl-emu.device-class=<class>``; the CurveZMQ keys as Swarm secrets.
- ``compose.yml``: the same services for ``docker compose up`` on one host (limits kept, no placement).
- ``config.yaml`` (the run's configuration, data under ``/data`` in the containers), ``keys/`` (the run's
  keys; keep the directory private), ``prometheus.yml`` (the run's targets: every service by name).

The coordinator writes its run directory to ``./runs/run`` beside the files (bind-mounted); the host's data root
is mounted read-only at ``/data`` (on a multi-host swarm it must be at that host path on every host).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from fcl_emu.keys import with_keys
from fcl_emu.launchers.base import node_args, node_key_name, node_specs
from fcl_emu.launchers.engine_launcher import LABEL_CLASS, node_entrypoint
from runconfig import RunConfig, node_metrics_port
from wire.auth import ROSTER_FILE, SERVER_NAME

COORDINATOR_PORT = 5555
METRICS_PORT = 9100
PROMETHEUS_PORT = 9090
DATA = "/data"
SECRETS = "/run/secrets"


@dataclass(frozen=True)
class Deployment:
    """What :func:`write_deployment` wrote."""

    stack: Path
    compose: Path
    config: Path
    keys: Path
    prometheus: Path


def _secret_names(config: RunConfig) -> list[str]:
    return [f"{SERVER_NAME}.key", f"{SERVER_NAME}.key_secret", ROSTER_FILE,
            *(f"{node_key_name(spec.number)}.key_secret" for spec in node_specs(config))]


def write_deployment(config: RunConfig, out: Path, image: str, data_root: Path) -> Deployment:
    """Write the stack, compose, config, keys and Prometheus files of ``config``'s run into ``out``."""
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)  # the coordinator's bind mount must exist
    specs = node_specs(config)
    keys = out / "keys"
    config = with_keys(config.model_copy(update={"security": config.security.model_copy(update={"keys": None})}),
                       keys, [spec.clients for spec in specs])
    inside = config.model_copy(update={
        "data_root": [Path(DATA)], "run_dir": Path("/runs/run"),
        "metrics": config.metrics.model_copy(update={"port": METRICS_PORT, "host": "0.0.0.0"}),
        "network": config.network.model_copy(update={"bind": f"tcp://0.0.0.0:{COORDINATOR_PORT}"}),
        "security": config.security.model_copy(update={"keys": Path(SECRETS)})})
    config_file = out / "config.yaml"
    config_file.write_text(yaml.safe_dump(inside.model_dump(mode="json", exclude={"containers"}), sort_keys=False))
    prometheus = out / "prometheus.yml"
    targets = [f"coordinator:{METRICS_PORT}", *(f"{s.name}:{node_metrics_port(inside, s.number)}" for s in specs)]
    prometheus.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{config.metrics.scrape_interval_s:g}s"},
        "scrape_configs": [{"job_name": "fcl-emu", "static_configs": [{"targets": targets}]}]}, sort_keys=False))

    services = {"coordinator": _coordinator(image, data_root), "prometheus": _prometheus(image)}
    for name in ("coordinator", "prometheus"):  # its ./runs and published port are on the host deploying it
        services[name]["deploy"] = {**services[name]["deploy"], "placement": {"constraints": ["node.role == manager"]}}
    for spec in specs:
        services[spec.name] = _node(spec, inside, image, data_root)
    secrets = {name: {"file": f"./keys/{name}"} for name in _secret_names(config)}
    configs = {"config.yaml": {"file": "./config.yaml"}, "prometheus.yml": {"file": "./prometheus.yml"}}
    compose = {"services": {name: _without_swarm(s) for name, s in services.items()},
               "networks": {"fcl": {"driver": "bridge"}}, "secrets": secrets, "configs": configs}
    stack = {"version": "3.8", "services": services,
             "networks": {"fcl": {"driver": "overlay", "attachable": True}}, "secrets": secrets, "configs": configs}
    compose_file, stack_file = out / "compose.yml", out / "stack.yml"
    compose_file.write_text(yaml.safe_dump(compose, sort_keys=False))
    stack_file.write_text(yaml.safe_dump(stack, sort_keys=False))
    return Deployment(stack_file, compose_file, config_file, keys, prometheus)


def _common(image: str) -> dict:
    return {"image": image, "networks": ["fcl"], "init": True,
            "deploy": {"endpoint_mode": "dnsrr", "restart_policy": {"condition": "none"}}}


def _coordinator(image: str, data_root: Path) -> dict:
    return {**_common(image),
            "command": ["coordinator", "--config", "/etc/fcl-emu/config.yaml", "--keys", SECRETS],
            "volumes": [f"{Path(data_root).resolve()}:{DATA}:ro", "./runs:/runs"],
            "configs": [{"source": "config.yaml", "target": "/etc/fcl-emu/config.yaml"}],
            "secrets": [f"{SERVER_NAME}.key", f"{SERVER_NAME}.key_secret", ROSTER_FILE]}


def _prometheus(image: str) -> dict:
    return {**_common(image), "entrypoint": ["prometheus"],
            "command": ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/tmp/prometheus",
                        f"--web.listen-address=:{PROMETHEUS_PORT}"],
            "configs": [{"source": "prometheus.yml", "target": "/etc/prometheus/prometheus.yml"}],
            "ports": [{"target": PROMETHEUS_PORT, "published": PROMETHEUS_PORT, "mode": "host"}]}


def _node(spec, inside: RunConfig, image: str, data_root: Path) -> dict:
    key_file = f"{node_key_name(spec.number)}.key_secret"
    args = node_args(f"tcp://coordinator:{COORDINATOR_PORT}", spec.clients, inside, spec.name, spec.number)
    args = args.with_paths(server_key=f"{SECRETS}/{SERVER_NAME}.key", key=f"{SECRETS}/{key_file}")
    service = {**_common(image), "hostname": spec.name, "entrypoint": node_entrypoint(spec.limits.uplink_mbit),
               "command": args.to_argv(),
               "volumes": [f"{Path(data_root).resolve()}:{DATA}:ro"], "secrets": [f"{SERVER_NAME}.key", key_file],
               "environment": {"OMP_NUM_THREADS": "1"}}
    limits = spec.limits
    resources = {k: v for k, v in (("cpus", None if limits.cpus is None else f"{limits.cpus:g}"),
                                   ("memory", None if limits.memory is None else limits.memory.upper()))
                 if v is not None}
    if resources:
        service["deploy"] = {**service["deploy"], "resources": {"limits": resources}}
    if spec.device_class:  # label the hosts of a class: docker node update --label-add fcl-emu.device-class=C
        service["deploy"] = {**service["deploy"],
                             "placement": {"constraints": [f"node.labels.{LABEL_CLASS} == {spec.device_class}"]}}
    if limits.uplink_mbit is not None:
        service["cap_add"] = ["NET_ADMIN"]
    return service


def _without_swarm(service: dict) -> dict:
    """A stack service as a plain Compose service: no swarm placement or endpoint mode, no restarts."""
    deploy = {k: v for k, v in service["deploy"].items() if k == "resources"}
    plain = {k: v for k, v in service.items() if k != "deploy"}
    plain["restart"] = "no"
    if deploy:
        plain["deploy"] = deploy
    if "ports" in plain:
        plain["ports"] = [f"{p['published']}:{p['target']}" for p in plain["ports"]]
    return plain
