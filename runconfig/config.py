"""The run configuration (:class:`RunConfig`): one validated object built from a YAML file and flags.

Precedence: command-line flags > ``--config`` YAML > defaults (the flags: :mod:`fcl_emu.options`). Everything is
validated before any process starts; an invalid value fails with a message
naming the option. The resolved config is written into the run directory.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from fcl_emu.aggregation.settings import AggregationSettings
from fcl_emu.methods.models.names import CHOICES as MODEL_CHOICES
from fcl_emu.runconfig import legacy
from fcl_emu.runconfig.dataset_defaults import dataset_training
from fcl_emu.runconfig.errors import check_method_options, method_spec
from fcl_emu.runconfig.ignored import Ignored, settle
from fcl_emu.runconfig.nodes import NODES_HELP, Nodes, unset_null_nodes
from fcl_emu.runconfig.topology import TopologyConfig
from fcl_emu.scenario.availability import parse_availability
from fcl_emu.scenario.datasets import default_data_roots
from fcl_emu.scenario.devices import load_profiles, memory_limit
from fcl_emu.scenario.network_trace import load_network_trace
from fcl_emu.scenario.faults import load_plan
from fcl_emu.scenario.spec import ScenarioSpec
from fcl_emu.secagg.settings import SecAggSettings


class TrainingConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    # Defaults suit the default scenario (MNIST, 300 clients holding ~40 samples per task): two passes over a
    # few batches are needed to learn a task in 10 rounds of 30 clients. Override for larger local datasets.
    local_epochs: int = pydantic.Field(2, ge=1, description="local epochs a round (a method may bring its own)")
    lr: float = pydantic.Field(0.05, gt=0, description=(
        "local learning rate: 0.01 on CIFAR-10, CIFAR-100 and Tiny-ImageNet (both sizes), the default on MNIST, "
        "Fashion-MNIST and EMNIST (a method may bring its own, `fcl-emu methods`)"))
    batch_size: int = pydantic.Field(16, ge=1)
    momentum: float = pydantic.Field(0.9, ge=0, lt=1, description="SGD's momentum (Adam ignores it)")
    weight_decay: float = pydantic.Field(0.0, ge=0, description="L2 penalty added to the gradient (SGD and Adam)")
    optimizer: Literal["sgd", "adam"] = pydantic.Field("sgd", description="local optimiser: sgd, or adam (betas "
                                                       "0.9/0.999, AF-FCL's protocol), its state fresh every round")


class RoundConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    clients_per_round: int = pydantic.Field(
        30, ge=1, description="clients sampled per round, K (unset: every client where there are fewer than the "
                              "default)")
    rounds_per_task: int = pydantic.Field(10, ge=1, description="communication rounds per task")
    deadline_s: float = pydantic.Field(120.0, gt=0, description="seconds before a round closes")
    min_participants: int = pydantic.Field(1, ge=1, description="fewer updates than this: the round is skipped")
    eval_every: int = pydantic.Field(5, ge=1, description="evaluate every N rounds (and always at task end)")
    overcommit: float = pydantic.Field(
        1.0, ge=1.0, le=10.0, description="select ceil(K x overcommit) clients and close the round at the first K "
                                          "updates")
    late_updates: Literal["drop", "next_round"] = pydantic.Field(
        "drop", description="an update that arrives after its round closed: dropped and counted, or (for methods "
                            "that accept stale deltas) aggregated in the next round of the same task")
    clock: Literal["auto", "emulated", "real"] = pydantic.Field(
        "auto", description="the clock of deadlines, stragglers, availability and crashes: emulated (independent "
                            "of the host's load), real (host seconds) or auto (emulated, except real for container "
                            "backends; docs/edge.md)")
    skip_late: bool = pydantic.Field(
        True, description="emulated clock: cancel the training of a selected client whose update the clock "
                          "knows cannot count (it arrives after the round closes); the results stay the same, "
                          "the host does less work (docs/edge.md)")
    host_timeout_s: float = pydantic.Field(
        900.0, gt=0, description="emulated clock: the longest a round waits in host time for its clients' work "
                                 "(a safety net, reported when it fires)")


    @property
    def planned_cohort(self) -> int:
        """The clients a synchronous round selects: ``ceil(clients_per_round x overcommit)``."""
        return math.ceil(self.clients_per_round * self.overcommit)

class NetworkConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    bind: str = pydantic.Field(
        "tcp://127.0.0.1:0", description="ZeroMQ endpoint the coordinator binds, e.g. tcp://0.0.0.0:5555 (up: a "
                                         "fixed port for a swarm's other hosts)")
    heartbeat_interval_s: float = pydantic.Field(1.0, gt=0)
    liveness_timeout_s: float = pydantic.Field(10.0, gt=0)
    join_timeout_s: float = pydantic.Field(
        120.0, gt=0, description="seconds the coordinator waits for the clients to join before the first round (and "
                                 "to come back on --resume): longer for edge nodes that start on other hosts")
    max_message_bytes: int = pydantic.Field(1 << 30, ge=1 << 16)
    client_connections: Literal["shared", "own"] = pydantic.Field(
        "shared", description="how an edge node's clients reach the coordinator: shared (one connection per node, "
                              "each client its own session on it) or own (a socket and a CurveZMQ handshake per "
                              "client; needed for keys per device, which imply it); docs/edge.md")
    heartbeat_budget_per_s: float = pydantic.Field(
        1000.0, gt=0, description="heartbeats per second the coordinator takes from all clients together: with more "
                                  "clients than budget x interval, the interval and the liveness timeout are "
                                  "stretched by the same factor (docs/edge.md)")

    @pydantic.field_validator("bind")
    @classmethod
    def _port_in_range(cls, value: str) -> str:
        """A TCP endpoint's port is 1-65535, or 0 (or ZeroMQ's *) for any free port: ZeroMQ itself would bind
        port 70000 as 4464."""
        port = value.rpartition(":")[2]
        if value.startswith("tcp://") and not (port == "*" or re.fullmatch("[0-9]+", port) and int(port) < 65536):
            raise ValueError(f"{value!r}: use tcp://HOST:PORT with a port from 1 to 65535, or 0 for any free port")
        return value

    def liveness(self, clients: int) -> tuple[float, float]:
        """(heartbeat interval, liveness timeout) for ``clients`` clients, stretched to the heartbeat budget."""
        stretch = max(1.0, clients / (self.heartbeat_budget_per_s * self.heartbeat_interval_s))
        return self.heartbeat_interval_s * stretch, self.liveness_timeout_s * stretch

    @pydantic.model_validator(mode="after")
    def _timeouts(self) -> "NetworkConfig":
        if self.liveness_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError("liveness_timeout_s must exceed twice heartbeat_interval_s")
        return self


class EdgeConfig(pydantic.BaseModel):
    """Edge realism: client availability (churn), crashes, device and link profiles (docs/edge.md)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    availability: str = pydantic.Field(
        "always", description="when each client is online: always, bernoulli:P, onoff:MEAN_ON_S:MEAN_OFF_S or "
                              "trace:PATH (docs/edge.md)")
    availability_slot_s: float = pydantic.Field(
        10.0, gt=0, description="bernoulli: length of a slot in which a client is on or off")
    trace_time_scale: float = pydantic.Field(
        1.0, gt=0, description="trace: seconds of the run per second of the trace")
    crash_rate: float = pydantic.Field(
        0.0, ge=0, le=1, description="probability that a client selected for a round crashes during it")
    crash_downtime_s: float = pydantic.Field(5.0, ge=0, description="a crashed client restarts after this long")
    device_profiles: Path | None = pydantic.Field(
        None, description="YAML/JSON file of device profiles: compute speed factor, link bandwidth, latency "
                          "(docs/edge.md)")
    network_trace: Path | None = pydantic.Field(
        None, description="emulated clock: file of each client's link bandwidth over time, replacing its "
                          "profile's (FedScale-style: client id -> time in s, communication in kbit/s; docs/edge.md)")
    compute: Literal["modelled", "measured"] = pydantic.Field(
        "modelled", description="emulated clock: a client's compute time from its device class's throughput and "
                                "the run's work per sample (modelled: the same on any host), or its measured CPU "
                                "time (measured: depends on the host)")
    min_battery: float = pydantic.Field(
        0.2, ge=0, le=1, description="emulated clock: a client whose battery is below this fraction of its "
                                     "capacity sits rounds out (0: only an empty battery does)")
    charging: Literal["never", "available", "away"] = pydantic.Field(
        "never", description="emulated clock: when batteries charge: never, while the client's availability "
                             "model has it available (plugged in and on Wi-Fi), or while it has it away")
    charge_w: float = pydantic.Field(10.0, gt=0, description="watts a charging battery gains")

    @pydantic.field_validator("availability")
    @classmethod
    def _availability(cls, value: str) -> str:
        parse_availability(value)  # raises ValueError naming what is wrong
        return value

    @pydantic.field_validator("device_profiles", "network_trace")
    @classmethod
    def _files(cls, value: Path | None, info) -> Path | None:
        if value is not None:  # read and checked now: a bad file fails before anything starts
            (load_profiles if info.field_name == "device_profiles" else load_network_trace)(value)
        return value


class GpuSettings(pydantic.BaseModel):
    """The coordinator's GPU worker pool for server-side jobs (docs/gpu.md)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    workers: int = pydantic.Field(
        0, ge=0, le=64, description="worker processes for server-side jobs, one device each; 0: jobs run in a thread "
                                    "of the coordinator (docs/gpu.md)")
    device: Literal["auto", "cpu", "cuda"] = pydantic.Field(
        "auto", description="device of the GPU workers: cuda (worker j takes CUDA device j modulo the count), cpu, "
                            "or auto (cuda if CUDA is there)")
    retries: int = pydantic.Field(0, ge=0, le=10, description="attempts after a job's first failure")
    job_timeout_s: float = pydantic.Field(
        3600.0, gt=0, description="a job running longer is killed with its worker (which is started again) "
                                  "and counts as failed (not enforced without workers)")
    threads: int = pydantic.Field(1, ge=1, le=256, description="torch CPU threads of each worker process")


class SecurityConfig(pydantic.BaseModel):
    """Transport security (docs/security.md); the defences against hostile updates are aggregation's
    (:class:`~fcl_emu.aggregation.settings.AggregationSettings`)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    transport: Literal["curve", "plain"] = pydantic.Field(
        "curve", description="how peers connect: curve (CurveZMQ with the run's keys, only listed keys admitted) or "
                             "plain (TCP without keys: any peer that reaches the port may join and speak for any "
                             "client; docs/security.md)")
    keys: Path | None = pydantic.Field(
        None, description="key directory written by `fcl-emu keys` (unset: `up` writes the run's keys in "
                          "RUN_DIR/keys; `coordinator` needs one)")


class AdaptiveClipping(pydantic.BaseModel):
    """Central DP's adaptive clipping (Andrew et al. 2021, coordinator/privacy.py): the clip norm follows a
    quantile of the update norms, estimated from a noised count. Defaults: the paper's."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    enabled: bool = pydantic.Field(
        False, description="central DP: adapt the clip norm each round toward a quantile of the update norms "
                           "(privacy.clip is its first value)")
    target_quantile: float = pydantic.Field(
        0.5, gt=0, lt=1, description="adaptive clipping: the fraction of updates the clip norm should leave "
                                     "unclipped (gamma)")
    learning_rate: float = pydantic.Field(
        0.2, gt=0, le=10, description="adaptive clipping: step of the geometric clip-norm update (eta_C)")
    count_stddev: float | None = pydantic.Field(
        None, gt=0, description="adaptive clipping: standard deviation of the noise on the count of unclipped "
                                "updates (sigma_b; unset: clients_per_round / 20)")

    def count_noise(self, cohort: int) -> float:
        """sigma_b for a cohort of ``cohort`` clients (the paper's K/20 unless set)."""
        return cohort / 20 if self.count_stddev is None else self.count_stddev


class PrivacyConfig(pydantic.BaseModel):
    """Differential privacy of the aggregate (docs/privacy.md)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    mode: Literal["off", "central", "distributed"] = pydantic.Field(
        "off", description="differential privacy: off; central (the coordinator clips each model delta, averages "
                           "them with equal weights and adds Gaussian noise: DP-FedAvg); or distributed (with "
                           "--secagg: each client clips its delta and adds its share of the noise under the mask; "
                           "docs/privacy.md)")
    noise_multiplier: float = pydantic.Field(
        1.0, ge=0, le=100, description="central DP: noise standard deviation over the clip norm (z; 0: no noise "
                                       "and no privacy)")
    clip: float = pydantic.Field(1.0, gt=0, description="central DP: the L2 norm each client's model delta is "
                                                        "clipped to (C; with adaptive clipping its first value)")
    adaptive: AdaptiveClipping = AdaptiveClipping()
    delta: float = pydantic.Field(1e-5, gt=0, lt=1, description="central DP: the delta that epsilon is reported "
                                                                 "for")
    noise_seed: int | None = pydantic.Field(
        None, description="central DP: seed of the noise (unset: drawn from the OS, so that nobody who knows the "
                          "run's seed can subtract the noise; set it only to repeat a run exactly)")
    on_divergence: Literal["stop", "continue"] = pydantic.Field(
        "stop", description="what a DP run does at the first round whose model diverged (NaN or infinite values, "
                            "or an exploded training loss): stop there, the status failed: diverged ...; or "
                            "continue to the end, the status degraded: diverged ... (docs/privacy.md)")

    @property
    def central(self) -> bool:
        return self.mode == "central"

    @property
    def distributed(self) -> bool:
        return self.mode == "distributed"


class MetricsConfig(pydantic.BaseModel):
    """Prometheus metrics endpoints and the optional local Prometheus server (docs/monitoring.md)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    port: int | None = pydantic.Field(
        None, ge=1, le=65535,
        description="the coordinator's /metrics port; edge node i of `up` takes port + 1 + i; unset: no endpoints")
    host: str = pydantic.Field("127.0.0.1", min_length=1,
                               description="address the /metrics endpoints listen on (0.0.0.0 for a Prometheus on "
                                           "another host or in a container)")
    linger_s: float | None = pydantic.Field(
        None, ge=0, description="keep /metrics up this long after the run so a last scrape sees the end "
                                "(default: scrape_interval_s + 1)")
    prometheus: bool = pydantic.Field(
        False, description="start a local Prometheus server (the `prometheus` binary) scraping this run")
    prometheus_port: int = pydantic.Field(9090, ge=1, le=65535, description="port of the local Prometheus (on "
                                                                            "127.0.0.1)")
    keep_prometheus: bool = pydantic.Field(False, description="leave the local Prometheus running after the run")
    scrape_interval_s: float = pydantic.Field(5.0, gt=0, le=300, description="scrape interval of the local Prometheus")
    run_id: str | None = pydantic.Field(
        None, pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="the run's id (the run_id label in Prometheus, summary.json's run_id); unset: a fresh random "
                    "one. `fcl-emu deploy` sets it, so that its Prometheus labels every target with it")

    @property
    def enabled(self) -> bool:
        return self.port is not None

    @property
    def linger(self) -> float:
        return self.scrape_interval_s + 1.0 if self.linger_s is None else self.linger_s


class ContainersConfig(pydantic.BaseModel):
    """Where ``up`` runs its edge nodes: host processes, Docker containers, or Swarm services (docs/containers.md)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    backend: Literal["process", "docker", "swarm"] = pydantic.Field(
        "process", description="where the edge nodes run: process (child processes of `up`), docker (a container "
                               "each on a user-defined network, real limits) or swarm (a Swarm service each; "
                               "docs/containers.md)")
    image: str | None = pydantic.Field(
        None, description="image of the edge nodes for docker/swarm (unset: build or reuse fcl-emu:<content "
                          "hash>, `fcl-emu image build`)")
    network: str | None = pydantic.Field(
        None, description="network of the containers (unset: fcl-emu-<run>, made for the run and removed after it)")
    cpus: float | None = pydantic.Field(
        None, gt=0, description="CPU limit of each edge-node container whose device class sets none")
    memory: str | None = pydantic.Field(
        None, description="memory limit of each edge-node container whose device class sets none, e.g. 512m or 2g")
    advertise: str | None = pydantic.Field(
        None, description="swarm: the address the edge-node services dial the coordinator at (default: the "
                          "cluster's, else this manager's swarm address)")
    cluster: str | None = pydantic.Field(
        None, description="swarm: the cluster (a name made by `fcl-emu cluster up`, or a cluster file) whose "
                          "hosts' engines the run reaches: image, container metrics and fault plans on every host, "
                          "host faults on a local one (docs/containers.md)")
    gpus: bool = pydantic.Field(False, description="give the edge-node containers the host's GPUs (CUDA device "
                                                   "request; needs the NVIDIA container runtime)")
    faults: Path | None = pydantic.Field(
        None, description="fault plan (YAML): kill, pause, disconnect, restart edge-node containers at given "
                          "rounds, times or rates (scenario/faults.py, docs/containers.md)")

    @pydantic.field_validator("faults")
    @classmethod
    def _faults(cls, value: Path | None) -> Path | None:
        if value is not None:
            load_plan(value)
        return value

    @pydantic.field_validator("memory")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        return value if value is None else memory_limit(value)


class RunConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    method: str = pydantic.Field("fedavg", description="learning method (see `fcl-emu methods`)")
    method_options: dict[str, Any] = pydantic.Field(
        {}, description="hyper-parameters of the method by name (its Options: `fcl-emu methods`, methods/<name>.py)")
    model: str = pydantic.Field("auto", description=(
        f"backbone: {MODEL_CHOICES}; auto is cnn on MNIST, Fashion-MNIST and EMNIST, cnn_bn "
        "on CIFAR and Tiny-ImageNet and for the methods that need BatchNorm (AF-FCL on MNIST-sized images: "
        "cnn_leaky)"))
    scenario: ScenarioSpec = ScenarioSpec()
    training: TrainingConfig = TrainingConfig()
    rounds: RoundConfig = RoundConfig()
    aggregation: AggregationSettings = AggregationSettings()
    network: NetworkConfig = NetworkConfig()
    edge: EdgeConfig = EdgeConfig()
    secagg: SecAggSettings = SecAggSettings()
    security: SecurityConfig = SecurityConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    gpu: GpuSettings = GpuSettings()
    metrics: MetricsConfig = MetricsConfig()
    containers: ContainersConfig = ContainersConfig()
    topology: TopologyConfig = TopologyConfig()
    nodes: Nodes = pydantic.Field(None, ge=1, validate_default=True, description=NODES_HELP)
    device: Literal["auto", "cpu", "cuda"] = pydantic.Field(
        "auto", description="device of training and evaluation: auto (CUDA if present), cpu or cuda")
    coordinator_threads: int | None = pydantic.Field(
        None, ge=1, le=256, description="torch CPU threads of the coordinator (evaluation, aggregation); "
        "default: torch's, one per core. 1 where other processes train beside its evaluations")
    data_root: list[Path] = pydantic.Field(
        default_factory=default_data_roots,
        description="where datasets are looked for (default: $FCL_EMU_DATA_ROOT, os.pathsep-separated, or ./data)")
    download: bool = pydantic.Field(False, description="download a missing dataset with torchvision")
    seed: int = pydantic.Field(0, description="seed of the scenario, sampling and training")
    run_dir: Path | None = pydantic.Field(None, description="run directory (unset: a new runs/<time>-...); one "
                                                            "that holds a run is refused, unless --resume or "
                                                            "--overwrite (docs/resume.md)")

    # the default clients_per_round that a smaller population replaced (None: the config's own value)
    _capped_cohort: int | None = pydantic.PrivateAttr(None)
    # the config file's values that this config ignores, back at their defaults (runconfig/ignored.py)
    _ignored: tuple[Ignored, ...] = pydantic.PrivateAttr(())

    @pydantic.model_validator(mode="wrap")
    @classmethod
    def _default_cohort(cls, data: Any, handler: pydantic.ModelWrapValidatorHandler) -> "RunConfig":
        """Unset ``rounds.clients_per_round`` is the default cohort, or every client where there are fewer
        (:attr:`capped_cohort` then says so); ``nodes: null`` is unset ``nodes`` (runconfig/nodes.py); a config of
        the old layout of aggregation's settings is read as today's (runconfig/legacy.py)."""
        capped, data = None, unset_null_nodes(legacy.upgrade(data)[0])
        rounds = data.get("rounds", {}) if isinstance(data, dict) else None
        scenario = data.get("scenario", {}) if isinstance(data, dict) else None
        if isinstance(rounds, dict) and "clients_per_round" not in rounds and isinstance(scenario, dict):
            clients = scenario.get("num_clients", ScenarioSpec().num_clients)
            default = RoundConfig().clients_per_round
            if isinstance(clients, int) and 0 < clients < default:
                data, capped = {**data, "rounds": {**rounds, "clients_per_round": clients}}, default
        config = handler(data)
        if capped is not None:
            config._capped_cohort = capped
        return config

    @property
    def capped_cohort(self) -> int | None:
        """The default ``rounds.clients_per_round`` that this config's smaller population replaced, if it did."""
        return self._capped_cohort

    @property
    def ignored(self) -> tuple[Ignored, ...]:
        """The settings its config file set that this config ignores (:mod:`fcl_emu.runconfig.ignored`)."""
        return self._ignored

    def __eq__(self, other: object) -> bool:
        """The same settings, however they were given (:attr:`capped_cohort` says how, not what)."""
        if not isinstance(other, RunConfig):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    @pydantic.model_validator(mode="before")
    @classmethod
    def _method_training(cls, data: Any) -> Any:
        """``training`` keys the config leaves unset take the method's own values (its official code's local
        optimiser, ``MethodSpec.training``), then the data set's (:mod:`~fcl_emu.runconfig.dataset_defaults`),
        before the project's defaults."""
        if not isinstance(data, dict) or not isinstance(data.get("training", {}), dict):
            return data
        from fcl_emu.methods import registry

        try:
            spec = registry.get(str(data.get("method", "fedavg")))
        except KeyError:
            return data  # the method validator says why
        training = data.get("training", {})
        unset = {**dataset_training(data.get("scenario", {})), **spec.training}
        missing = {k: v for k, v in unset.items() if k not in training}
        return {**data, "training": {**missing, **training}} if missing else data

    @pydantic.field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        return method_spec(value).name

    @pydantic.field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        from fcl_emu.methods.models.classifier import MODELS

        if value not in MODELS:
            raise ValueError(f"unknown model {value!r}; choose one of {', '.join(MODELS)}")
        return value

    @pydantic.model_validator(mode="after")
    def _cross_checks(self, info: pydantic.ValidationInfo) -> "RunConfig":
        """The method's options; then the privacy accountant's library and what combines with what (the first
        refusal of the compatibility table that holds, :mod:`~fcl_emu.runconfig.compatibility`), both left to the
        caller under a context ``{"combinations": False}`` (the matrix reads every entry, on any host)."""
        from fcl_emu.methods import registry
        from fcl_emu.runconfig import compatibility

        spec = registry.get(self.method)
        check_method_options(spec, self.method_options)
        if not (info.context or {}).get("combinations", True):
            return self
        if self.privacy.mode != "off" and importlib.util.find_spec("dp_accounting") is None:
            raise ValueError(f"--privacy {self.privacy.mode} needs Google's dp-accounting library for its privacy "
                             f"accountant: pip install 'fcl-emu[dp]'")
        compatibility.check(self, spec)
        return self

    @property
    def emulated_clock(self) -> bool:
        """Whether rounds run on the emulated clock (``rounds.clock``, ``auto`` resolved)."""
        if self.rounds.clock == "auto":
            return self.containers.backend == "process"
        return self.rounds.clock == "emulated"

    def method_options_model(self):
        return method_spec(self.method).options(**self.method_options)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def merge_config(base: dict[str, Any], override: dict[str, Any], dropped: list[Ignored] | None = None,
                 at: str = "") -> dict[str, Any]:
    """``override`` over ``base`` (a config's mappings), key by key. A part chosen by name alone (``rule: krum``)
    is its mapping; where ``override`` chooses another part than ``base``, ``base``'s options of its part go, each
    put in ``dropped`` where given."""
    dropped = [] if dropped is None else dropped
    out = dict(base)
    for key, value in override.items():
        old = {"name": out[key]} if isinstance(value, dict) and isinstance(out.get(key), str) else out.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            if value.get("name", old.get("name")) != old.get("name"):
                dropped += [Ignored(f"{at}{key}.{k}", v, f"an option of {old.get('name')}, not of {value['name']}")
                            for k, v in old.items() if k != "name"]
                old = {}
            out[key] = merge_config(old, value, dropped, f"{at}{key}.")
        else:
            out[key] = value
    return out


def load_config(path: Path | None, overrides: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from an optional YAML file plus nested overrides (flags); a flag that the config ignores
    is refused, a file's value that it ignores is listed (:mod:`fcl_emu.runconfig.ignored`)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"--config: cannot read {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"--config: {path} is not valid YAML: {' '.join(str(exc).split())}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"--config: {path} must hold a mapping at the top level")
        data = loaded or {}
    data, old = legacy.upgrade(data)
    dropped: list[Ignored] = []

    def build(file_data: dict[str, Any]) -> RunConfig:
        dropped.clear()
        return RunConfig.model_validate(merge_config(file_data, overrides, dropped))
    config = settle(build(data), data, overrides, build)
    if old or dropped:  # the old layout's and the file's options of a part the flags replaced
        config._ignored = (*config.ignored, *old, *dropped)
    return config
