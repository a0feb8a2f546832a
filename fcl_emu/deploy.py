"""A whole run as files a user deploys and edits: a Swarm stack, a plain Compose file, their keys, Prometheus and
Grafana.

``fcl-emu deploy OUT_DIR ...`` (``up``'s run flags but :data:`fcl_emu.options.NOT_DEPLOYED`) writes:

- ``stack.yml``: for ``docker stack deploy -c stack.yml NAME`` on a swarm manager. The coordinator, one service
  per edge aggregator (``--edge-aggregators M``: ``edge-aggregator-<a>``, each serving its nodes on port
  :data:`AGGREGATOR_PORT`, node n under aggregator n mod M), one service per edge node, Prometheus (from the
  project's image) and Grafana, on an attachable overlay network, with
  ``endpoint_mode: dnsrr``, ``restart_policy: none``, each node's device-class CPU and memory limits and its
  placement on swarm nodes labelled ``fcl-emu.device-class=<class>``; the CurveZMQ keys as Swarm secrets,
  the configuration files as Swarm configs.
- ``compose.yml``: the same services for ``docker compose up`` on one host (limits kept, no placement).
- ``config.yaml`` (the run's configuration, data under ``/data`` in the containers, the run's id fixed),
  ``keys/`` (the run's keys and ``grafana.env``, Grafana's generated admin password; the directory and its files
  are private to the user, 0700 and 0600), ``prometheus.yml`` (the run's targets: every service
  by name, each labelled with ``run_id``, ``role`` and ``process`` as the dashboards expect), ``grafana/`` (the
  Prometheus data source at the Prometheus service, the dashboard provider and the project's dashboards).

Prometheus and Grafana stay on the manager unless published (``publish_monitoring``): the Compose file binds
them to the host's loopback (Grafana with anonymous viewers), the stack publishes neither (Swarm binds a published
port on every interface: it takes no host address), so they are reached from the manager through a forwarder on
the stack's attachable network (docs/containers.md). Published, both listen on every interface of the manager
(the stack: ``mode: host``, the manager only) and Grafana takes no anonymous viewers.

The coordinator writes its run directory to ``./runs/run`` beside the files (bind-mounted); the host's data root
is mounted read-only at ``/data`` (on a multi-host swarm it must be at that host path on every host). Writing the
files needs no Docker engine when the image is named (``--image``); without it, the image is built or reused on
this host's engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import os
import shutil
import uuid
from secrets import token_urlsafe

import yaml

from fcl_emu.containers.image import image_ref
from fcl_emu.gpu_worker import WORKER_KEY_NAME
from fcl_emu.keys import with_keys
from fcl_emu.launchers.aggregators import aggregator_args
from fcl_emu.launchers.base import node_args, node_key_name, node_specs
from fcl_emu.launchers.engine_launcher import LABEL_CLASS, node_entrypoint
from fcl_emu.monitoring import stack
from fcl_emu.runconfig import RunConfig, gpu_worker_metrics_port, node_metrics_port
from fcl_emu.runconfig.topology import aggregator_name, aggregator_of_node
from fcl_emu.scenario.datasets import default_data_roots, roots_from_env
from fcl_emu.wire.auth import ROSTER_FILE, SERVER_NAME, SIGNERS_FILE

COORDINATOR_PORT = 5555
AGGREGATOR_PORT = 5600  # where each edge aggregator's service takes its nodes
AGGREGATOR_PROGRAM = ["python", "-m", "fcl_emu.edge_aggregator"]  # what an aggregator's container runs
METRICS_PORT = 9100
PROMETHEUS_PORT = 9090
GRAFANA_PORT = 3000
GRAFANA_ENV = "grafana.env"  # in keys/: GF_SECURITY_ADMIN_PASSWORD, Grafana's admin password
GRAFANA_IMAGE = "grafana/grafana:11.2.0"  # as monitoring/docker-compose.yml; from a registry, or `docker load`
LOOPBACK = "127.0.0.1"
DATA = "/data"
SECRETS = "/run/secrets"


class MountError(ValueError):
    """A host path the deployment's services would mount is not there."""


def check_mounts(config: RunConfig, given: bool) -> None:
    """Raise :class:`MountError`, in one line naming the flag that sets it, unless the host path the services
    mount exists: the data root (read-only at ``/data``; ``given``: by ``--data-root``). The run folder that the
    coordinator mounts, ``runs/`` beside the files, is made with them."""
    root = config.data_root[0]
    if root.is_dir():
        return
    origin = ("" if given else " (from $FCL_EMU_DATA_ROOT)" if config.data_root == roots_from_env()
              else " (the default)" if config.data_root == default_data_roots() else " (from --config's data_root)")
    what = "is not a folder" if root.exists() else "does not exist"
    raise MountError(f"--data-root: {root.absolute()}{origin} {what}; the coordinator and the edge nodes mount it "
                     f"read-only at {DATA}: give the folder of the datasets")


@dataclass(frozen=True)
class Deployment:
    """What :func:`write_deployment` wrote."""

    stack: Path
    compose: Path
    config: Path
    keys: Path
    prometheus: Path
    grafana: Path  # the folder of Grafana's provisioning and dashboards
    grafana_env: Path  # Grafana's admin password (GF_SECURITY_ADMIN_PASSWORD=...), mode 0600
    run_id: str  # the run_id label the dashboards select
    published: bool  # Prometheus and Grafana on every interface of the manager, not on its loopback

    def monitoring(self) -> str:
        """Where Prometheus and Grafana are, in one line: published, exactly what is exposed."""
        login = f"user admin, password in {self.grafana_env}"
        if self.published:
            return (f"published on every interface of the manager (compose: of this host): Grafana on port "
                    f"{GRAFANA_PORT} ({login}; no anonymous viewers) and Prometheus on port {PROMETHEUS_PORT} "
                    f"(no login: whoever reaches the port reads every metric)")
        return (f"compose: Grafana http://{LOOPBACK}:{GRAFANA_PORT} (anonymous viewers; to edit, {login}), "
                f"Prometheus http://{LOOPBACK}:{PROMETHEUS_PORT}; swarm: neither published, "
                f"reach them from the manager (docs/containers.md) or write the files with --publish-monitoring")


def deployment_image(tag: str | None) -> str:
    """The image the files name: ``tag`` as given, asking no engine (the hosts that run the stack need it:
    ``docker load`` it there, docs/containers.md); unset, the image built or reused on this host's engine."""
    return image_ref(None) if tag is None else tag


COORDINATOR_SECRETS = [f"{SERVER_NAME}.key", f"{SERVER_NAME}.key_secret", ROSTER_FILE,
                       f"{WORKER_KEY_NAME}.key_secret"]  # the last for the GPU workers it starts


def _secret_names(config: RunConfig) -> list[str]:
    return [*COORDINATOR_SECRETS, SIGNERS_FILE,
            *(f"{aggregator_name(a)}{suffix}" for a in range(config.topology.edge_aggregators)
              for suffix in (".key", ".key_secret")),
            *(f"{node_key_name(spec.number)}.key_secret" for spec in node_specs(config))]


def write_deployment(config: RunConfig, out: Path, image: str, data_root: Path,
                     publish_monitoring: bool = False) -> Deployment:
    """Write the stack, compose, config, keys, Prometheus and Grafana files of ``config``'s run into ``out``;
    ``publish_monitoring``: Prometheus and Grafana on every interface of the manager (else on its loopback in
    the Compose file, not published by the stack)."""
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)  # the coordinator's bind mount must exist
    specs = node_specs(config)
    keys = out / "keys"
    config = with_keys(config.model_copy(update={"security": config.security.model_copy(update={"keys": None})}),
                       keys, [spec.clients for spec in specs])
    run_id = config.metrics.run_id or uuid.uuid4().hex[:12]
    inside = config.model_copy(update={
        "data_root": [Path(DATA)], "run_dir": Path("/runs/run"),
        "metrics": config.metrics.model_copy(update={"port": METRICS_PORT, "host": "0.0.0.0", "run_id": run_id,
                                                     "prometheus": False}),  # the stack's Prometheus scrapes it
        "network": config.network.model_copy(update={"bind": f"tcp://0.0.0.0:{COORDINATOR_PORT}"}),
        "security": config.security.model_copy(update={"keys": Path(SECRETS)})})
    config_file = out / "config.yaml"
    config_file.write_text(yaml.safe_dump(inside.model_dump(mode="json", exclude={"containers"}), sort_keys=False))
    prometheus = out / "prometheus.yml"
    prometheus.write_text(yaml.safe_dump(stack.static_prometheus_config(
        _targets(inside, specs), run_id, config.metrics.scrape_interval_s), sort_keys=False))
    grafana_configs = _write_grafana(out / "grafana", config.metrics.scrape_interval_s)
    grafana_env = _write_grafana_env(keys / GRAFANA_ENV)

    services = {"coordinator": _coordinator(image, data_root), "prometheus": _prometheus(image),
                "grafana": _grafana(grafana_configs, anonymous=not publish_monitoring)}
    for name in ("coordinator", "prometheus", "grafana"):  # ./runs and the published ports: on the deploying host
        services[name]["deploy"] = {**services[name]["deploy"], "placement": {"constraints": ["node.role == manager"]}}
    for a in range(inside.topology.edge_aggregators):
        services[aggregator_name(a)] = _aggregator(a, inside, image)
    for spec in specs:
        services[spec.name] = _node(spec, inside, image, data_root)
    secrets = {name: {"file": f"./keys/{name}"} for name in _secret_names(config)}
    configs = {"config.yaml": {"file": "./config.yaml"}, "prometheus.yml": {"file": "./prometheus.yml"},
               **{name: {"file": f"./{path.relative_to(out).as_posix()}"}
                  for name, (path, _) in grafana_configs.items()}}
    plain = {name: _without_swarm(s) for name, s in services.items()}
    for name, port in (("prometheus", PROMETHEUS_PORT), ("grafana", GRAFANA_PORT)):
        plain[name]["ports"] = [f"{port}:{port}" if publish_monitoring else f"{LOOPBACK}:{port}:{port}"]
        if publish_monitoring:  # the stack's services take no host address: published, on every interface
            services[name]["ports"] = [{"target": port, "published": port, "mode": "host"}]
    compose = {"services": plain,
               "networks": {"fcl": {"driver": "bridge"}}, "secrets": secrets, "configs": configs}
    swarm = {"version": "3.8", "services": services,
             "networks": {"fcl": {"driver": "overlay", "attachable": True}}, "secrets": secrets, "configs": configs}
    compose_file, stack_file = out / "compose.yml", out / "stack.yml"
    compose_file.write_text(yaml.safe_dump(compose, sort_keys=False))
    stack_file.write_text(yaml.safe_dump(swarm, sort_keys=False))
    return Deployment(stack_file, compose_file, config_file, keys, prometheus, out / "grafana", grafana_env, run_id,
                      publish_monitoring)


def _targets(inside: RunConfig, specs) -> list[stack.Target]:
    """Every /metrics endpoint of the run, by service name: the coordinator, the edge nodes, its GPU workers."""
    return [stack.Target("coordinator", "coordinator", "coordinator", METRICS_PORT),
            *(stack.Target(s.name, "edge_node", s.name, node_metrics_port(inside, s.number)) for s in specs),
            *(stack.Target(f"gpu-worker-{j}", "gpu_worker", "coordinator", gpu_worker_metrics_port(inside, j))
              for j in range(inside.gpu.workers))]


def _write_grafana(folder: Path, scrape_interval_s: float) -> dict[str, tuple[Path, str]]:
    """Write Grafana's data source (the Prometheus service), dashboard provider and the dashboards into
    ``folder``; return each file as a config: its name, its path here and its path in Grafana's container."""
    (folder / "dashboards").mkdir(parents=True, exist_ok=True)
    datasource, provider = folder / "datasource.yml", folder / "dashboards.yml"
    datasource.write_text(yaml.safe_dump(stack.grafana_datasource(f"http://prometheus:{PROMETHEUS_PORT}",
                                                                  scrape_interval_s), sort_keys=False))
    provider.write_text(yaml.safe_dump(stack.grafana_dashboard_provider(), sort_keys=False))
    provisioning, dashboards = "/etc/grafana/provisioning", stack.dashboard_provider_path()
    files = {"grafana-datasource.yml": (datasource, f"{provisioning}/datasources/fcl-emu.yml"),
             "grafana-dashboards.yml": (provider, f"{provisioning}/dashboards/fcl-emu.yml")}
    for source in stack.dashboards():
        copy = folder / "dashboards" / source.name
        shutil.copyfile(source, copy)
        files[f"dashboard-{source.name}"] = (copy, f"{dashboards}/{source.name}")
    return files


def _write_grafana_env(path: Path) -> Path:
    """Write a new random admin password for Grafana to ``path`` as an env file, readable by the user alone (the
    docker CLI reads it, so neither the file nor its mode needs to suit Grafana's user in the container)."""
    path.touch(mode=0o600)
    os.chmod(path, 0o600)
    path.write_text(f"GF_SECURITY_ADMIN_PASSWORD={token_urlsafe(24)}\n")
    return path


def _common(image: str) -> dict:
    return {"image": image, "networks": ["fcl"], "init": True,
            "deploy": {"endpoint_mode": "dnsrr", "restart_policy": {"condition": "none"}}}


def _coordinator(image: str, data_root: Path) -> dict:
    return {**_common(image),
            "command": ["coordinator", "--config", "/etc/fcl-emu/config.yaml", "--keys", SECRETS],
            "volumes": [f"{Path(data_root).resolve()}:{DATA}:ro", "./runs:/runs"],
            "configs": [{"source": "config.yaml", "target": "/etc/fcl-emu/config.yaml"}],
            "secrets": COORDINATOR_SECRETS}


def _prometheus(image: str) -> dict:
    return {**_common(image), "entrypoint": ["prometheus"],
            "command": ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/tmp/prometheus",
                        f"--web.listen-address=:{PROMETHEUS_PORT}"],
            "configs": [{"source": "prometheus.yml", "target": "/etc/prometheus/prometheus.yml"}]}


def _grafana(configs: dict[str, tuple[Path, str]], anonymous: bool) -> dict:
    """Grafana provisioned with ``configs``, the overview as home, its admin password from ``keys/grafana.env``;
    ``anonymous``: anyone who reaches it views the dashboards without logging in."""
    home = next(target for _, target in configs.values() if target.endswith("/overview.json"))
    anonymous_access = {"GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer"} if anonymous \
        else {"GF_AUTH_ANONYMOUS_ENABLED": "false"}
    return {**_common(GRAFANA_IMAGE), "env_file": [f"./keys/{GRAFANA_ENV}"],
            "environment": {**anonymous_access, "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": home},
            "configs": [{"source": name, "target": target} for name, (_, target) in configs.items()]}


def _aggregator(index: int, inside: RunConfig, image: str) -> dict:
    """Edge aggregator ``index``'s service: it dials the coordinator and serves its nodes on
    :data:`AGGREGATOR_PORT`, under its relay key (the roster beside it says which keys its nodes may use)."""
    name = aggregator_name(index)
    args = aggregator_args(index, f"tcp://coordinator:{COORDINATOR_PORT}", f"tcp://0.0.0.0:{AGGREGATOR_PORT}", inside)
    return {**_common(image), "hostname": name, "entrypoint": AGGREGATOR_PROGRAM, "command": args.to_argv(),
            "secrets": [f"{SERVER_NAME}.key", ROSTER_FILE, f"{name}.key_secret"]}


def _node(spec, inside: RunConfig, image: str, data_root: Path) -> dict:
    """Edge node ``spec``'s service, dialling its edge aggregator's service (or the coordinator's in a star) and
    checking the SecAgg+ keys of its neighbours against the run's signers."""
    key_file = f"{node_key_name(spec.number)}.key_secret"
    m = inside.topology.edge_aggregators
    server, port = (aggregator_name(aggregator_of_node(spec.number, m)), AGGREGATOR_PORT) if m \
        else (SERVER_NAME, COORDINATOR_PORT)  # the service's name is its key's
    args = node_args(f"tcp://{server}:{port}", spec.clients, inside, spec.name, spec.number, server=server)
    args = args.with_paths(server_key=f"{SECRETS}/{server}.key", key=f"{SECRETS}/{key_file}")
    service = {**_common(image), "hostname": spec.name, "entrypoint": node_entrypoint(spec.limits.uplink_mbit),
               "command": args.to_argv(),
               "volumes": [f"{Path(data_root).resolve()}:{DATA}:ro"],
               "secrets": [f"{server}.key", SIGNERS_FILE, key_file],
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
    return plain
