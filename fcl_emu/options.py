"""The flags of a run, each declared once: ``fcl-emu up`` and ``fcl-emu coordinator`` are generated from
:data:`RUN_OPTIONS`, and so are the mapping from flags to :class:`runconfig.RunConfig` fields and the names
that validation errors give.

A new run option is one :class:`RunOption` here (and its field in :mod:`runconfig.config`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml

UP, COORDINATOR = "up", "coordinator"
BOTH = frozenset({UP, COORDINATOR})


def _method_options(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r}: use KEY=VALUE", param_hint="--method-option")
        out[key] = yaml.safe_load(value)
    return out


def _paths(items: list[Path]) -> list[str]:
    return [str(p) for p in items]


@dataclass(frozen=True)
class RunOption:
    """One flag of a run: its parameter name, its config fields, its type and help, where it is offered."""

    name: str                                   # the parameter; the flag is --name with dashes
    fields: tuple[tuple[str, ...], ...]         # where its value goes in the config (--seed: two places)
    type: Any                                   # the value's type (bool: an on-switch)
    help: str
    commands: frozenset[str] = BOTH
    convert: Callable[[Any], Any] | None = None  # flag value -> config value
    with_resume: bool = False                   # may go with --resume: it does not change what the run does

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        return self.type is bool

    @property
    def annotation(self) -> Any:
        """The typer declaration of the parameter."""
        if self.is_switch:
            return Annotated[bool, typer.Option(self.flag, help=self.help)]
        return Annotated[Optional[self.type], typer.Option(self.flag, help=self.help)]

    @property
    def default(self) -> Any:
        return False if self.is_switch else None

    def given(self, value: Any) -> bool:
        """Whether the user set it (a switch that is on; any other flag that is not None or empty)."""
        return value is not None and value is not False and value != []

    def apply(self, overrides: dict, value: Any) -> None:
        """Put a given value into the nested config overrides."""
        if not self.given(value):
            return
        value = self.convert(value) if self.convert else value
        for path in self.fields:
            node = overrides
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value


def _option(name: str, fields: str | tuple[str, ...], type_: Any, help: str, **kw: Any) -> RunOption:
    """``fields``: a dotted config path, or several."""
    paths = (fields,) if isinstance(fields, str) else fields
    return RunOption(name, tuple(tuple(p.split(".")) for p in paths), type_, help, **kw)


RUN_OPTIONS: tuple[RunOption, ...] = (
    _option("clients", "scenario.num_clients", int, "Number of emulated clients."),
    _option("clients_per_round", "rounds.clients_per_round", int, "Clients sampled per round (K)."),
    _option("method", "method", str, "Learning method (see `fcl-emu methods`)."),
    _option("method_option", "method_options", list[str], "Method hyper-parameter KEY=VALUE (repeatable).",
            convert=_method_options),
    _option("dataset", "scenario.dataset", str, "Dataset name."),
    _option("data_root", "data_root", list[Path],
            "Where datasets are looked for (repeatable; default $FCL_EMU_DATA_ROOT or ./data).",
            convert=_paths, with_resume=True),
    _option("download", "download", bool, "Download a missing dataset with torchvision."),
    _option("tasks", "scenario.num_tasks", int, "Number of class-incremental tasks."),
    _option("rounds_per_task", "rounds.rounds_per_task", int, "Communication rounds per task."),
    _option("local_epochs", "training.local_epochs", int, "Local epochs per round."),
    _option("lr", "training.lr", float, "Local learning rate."),
    _option("partition", "scenario.partition", str,
            "iid, dirichlet, class_fraction, private_classes, task_pool, accessible_classes (other scenario "
            "options: --config YAML)."),
    _option("beta", "scenario.dirichlet_beta", float, "Dirichlet concentration for --partition dirichlet."),
    _option("model", "model", str, "Backbone: auto, cnn, cnn_bn, resnet18, resnet32."),
    _option("nodes", "nodes", int, "Edge nodes to start.", commands=frozenset({UP})),
    _option("backend", "containers.backend", str,
            "Where the edge nodes run: process (default), docker (a container each, real limits) or swarm "
            "(a Swarm service each; docs/containers.md).", commands=frozenset({UP}), with_resume=True),
    _option("image", "containers.image", str, "Edge-node image for docker/swarm (default: build or reuse "
                                              "fcl-emu:<content hash>).", commands=frozenset({UP}), with_resume=True),
    _option("node_cpus", "containers.cpus", float, "CPU limit of each edge-node container (device classes may set "
                                                   "their own).", commands=frozenset({UP})),
    _option("faults", "containers.faults", Path, "Fault plan (YAML) on the edge-node containers: kill, pause, "
                                                 "disconnect, restart (docs/containers.md).", commands=frozenset({UP})),
    _option("advertise", "containers.advertise", str, "Swarm: address the edge-node services dial the coordinator "
                                                      "at (default: this manager's swarm address).",
            commands=frozenset({UP}), with_resume=True),
    _option("node_memory", "containers.memory", str, "Memory limit of each edge-node container, e.g. 512m (device "
                                                     "classes may set their own).", commands=frozenset({UP})),
    _option("device", "device", str, "auto, cpu or cuda."),
    _option("seed", ("seed", "scenario.seed"), int, "Seed of the scenario, sampling and training."),
    _option("run_dir", "run_dir", Path, "Run directory (default runs/<time>-...)."),
    _option("bind", "network.bind", str, "ZeroMQ endpoint to bind, e.g. tcp://0.0.0.0:5555 (up: a fixed port for "
                                         "a swarm's other hosts)."),
    _option("round_deadline", "rounds.deadline_s", float, "Seconds before a round closes."),
    _option("min_participants", "rounds.min_participants", int, "Fewer updates: round skipped."),
    _option("overcommit", "rounds.overcommit", float,
            "Select ceil(K x FACTOR) clients, close the round at the first K updates."),
    _option("late_updates", "rounds.late_updates", str,
            "drop (count them) or next_round (aggregate stale deltas of the same task)."),
    _option("clock", "rounds.clock", str, "emulated (deadlines and churn in emulated time, independent of the "
                                          "host), real (host seconds) or auto (docs/edge.md)."),
    _option("availability", "edge.availability", str,
            "always | bernoulli:P | onoff:MEAN_ON_S:MEAN_OFF_S | trace:PATH (docs/edge.md)."),
    _option("crash_rate", "edge.crash_rate", float, "Probability that a client selected for a round crashes "
                                                   "during it."),
    _option("device_profiles", "edge.device_profiles", Path,
            "Device profiles file: compute factor, bandwidth, latency (docs/edge.md)."),
    _option("secagg", "secagg.enabled", bool,
            "Sum the model deltas under SecAgg+ masks: the coordinator sees only the sum (docs/secagg.md)."),
    _option("secagg_neighbors", "secagg.neighbors", int,
            "Neighbours per client k (default 2*ceil(log2 n); n-1 or more: SecAgg)."),
    _option("secagg_threshold", "secagg.threshold", int,
            "Shamir threshold t: shares to rebuild a secret (default floor(k/2)+1)."),
    _option("insecure", "security.transport", bool,
            "Plain TCP without keys: any peer that reaches the port may join and speak for any client "
            "(docs/security.md). Default: CurveZMQ with the run's keys.", convert=lambda on: "plain"),
    _option("keys", "security.keys", Path,
            "Key directory from `fcl-emu keys` (default for `up`: the run's own keys in RUN_DIR/keys)."),
    _option("max_update_norm", "security.max_update_norm", float,
            "Refuse an update whose model delta has a larger L2 norm."),
    _option("clip_norm", "security.clip_norm", float,
            "Robust aggregation: scale every model delta down to at most this L2 norm before aggregating."),
    _option("gpu_workers", "gpu.workers", int, "Worker processes for server-side jobs, one device each (default 0: "
                                               "a thread of the coordinator; docs/gpu.md)."),
    _option("gpu_device", "gpu.device", str, "Device of the GPU workers: auto (CUDA if present), cuda or cpu."),
    _option("metrics_port", "metrics.port", int,
            "Serve the coordinator's Prometheus /metrics on this port; edge node i of `up` takes PORT+1+i "
            "(default: no endpoints).", with_resume=True),
    _option("metrics_host", "metrics.host", str,
            "Address the /metrics endpoints listen on (default 127.0.0.1; 0.0.0.0 for a Prometheus on another "
            "host or in a container).", with_resume=True),
    _option("prometheus", "metrics.prometheus", bool,
            "Start a local Prometheus server (the `prometheus` binary) scraping this run.", with_resume=True),
    _option("prometheus_port", "metrics.prometheus_port", int, "Port of the local Prometheus (default 9090, on "
                                                               "127.0.0.1).", with_resume=True),
    _option("keep_prometheus", "metrics.keep_prometheus", bool, "Leave the local Prometheus running after the run "
                                                                "ends.", with_resume=True),
)
OPTIONS = {o.name: o for o in RUN_OPTIONS}

# Where each config field is set on the command line, for validation errors.
FLAG_OF: dict[tuple[str, ...], str] = {path: o.flag for o in RUN_OPTIONS for path in o.fields}


def flag_for(loc: tuple) -> str:
    """The flag that sets config location ``loc`` (or its closest enclosing field); else the dotted path."""
    for n in range(len(loc), 0, -1):
        if tuple(loc[:n]) in FLAG_OF:
            return FLAG_OF[tuple(loc[:n])]
    return ".".join(str(p) for p in loc) or "config"


def overrides(values: dict[str, Any], options: tuple[RunOption, ...] = RUN_OPTIONS) -> dict:
    """Nested config overrides from the given flags (``values``: parameter name -> value)."""
    out: dict = {}
    for option in options:
        option.apply(out, values.get(option.name))
    return out


def refused_with_resume(values: dict[str, Any]) -> list[str]:
    """The given flags that would change the run, which ``--resume`` refuses."""
    return [o.flag for o in RUN_OPTIONS if not o.with_resume and o.given(values.get(o.name))]


ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML config file; flags override it.")]
ResumeOpt = Annotated[Optional[Path], typer.Option(
    "--resume", metavar="RUN_DIR", help="Continue the interrupted run in RUN_DIR from its last checkpoint, "
    "same address and run id (docs/resume.md). Only --data-root, --metrics-*, --prometheus* and --verbose "
    "may go with it.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v")]


def run_command(command: str, *arguments: tuple[str, Any]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command body ``(config, resume, verbose, flags)`` the parameters of :data:`RUN_OPTIONS` that
    ``command`` offers, as typer reads them from the signature; ``arguments`` ((name, typer annotation) pairs)
    come first, as required positional arguments, and reach the body in ``flags``."""
    def decorate(body: Callable[..., None]) -> Callable[..., None]:
        offered = [o for o in RUN_OPTIONS if command in o.commands]
        params = [*(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation)
                    for name, annotation in arguments),
                  inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=ConfigOpt, default=None),
                  *(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=o.annotation,
                                      default=o.default) for o in offered),
                  inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, annotation=ResumeOpt, default=None),
                  inspect.Parameter("verbose", inspect.Parameter.KEYWORD_ONLY, annotation=VerboseOpt,
                                    default=False)]

        def command_function(**values: Any) -> None:
            body(values.pop("config"), values.pop("resume"), values.pop("verbose"), values)

        command_function.__name__ = body.__name__
        command_function.__doc__ = body.__doc__
        command_function.__signature__ = inspect.Signature(params)
        return command_function
    return decorate
