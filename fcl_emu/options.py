"""The flags of a run, each declared once: ``fcl-emu up`` and ``fcl-emu coordinator`` are generated from
:data:`RUN_OPTIONS`, and so are the mapping from flags to :class:`fcl_emu.runconfig.RunConfig` fields and the names
that validation errors give. A flag's help, type, default and bounds are its config field's (the pydantic
``Field``): here only the field it sets and what the command line alone knows.

A new run option is its field in :mod:`fcl_emu.runconfig.config`, with a description, and one :class:`RunOption` here,
in the help panel (:data:`PANELS`) it belongs to. A switch (a bool field, or ``sets``) is ``--x/--no-x``: either
side overrides the YAML, neither leaves it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import typer
import yaml
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from fcl_emu.aggregation.choice import members
from fcl_emu.runconfig import RunConfig

UP, COORDINATOR, DEPLOY = "up", "coordinator", "deploy"
BOTH = frozenset({UP, COORDINATOR})

# The help panels of a run's flags, in the order `--help` shows them.
RUN, SCENARIO, TRAINING, ROUNDS, EDGE, BACKENDS, SECURITY, PRIVACY, MONITORING = PANELS = (
    "Run", "Scenario", "Method and training", "Rounds and clock", "Edge nodes and churn",
    "Backends: containers and GPU workers", "Security", "Central differential privacy", "Monitoring")


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


def config_field(path: tuple[str, ...]) -> FieldInfo:
    """The :class:`fcl_emu.runconfig.RunConfig` field at ``path`` (through the nested models). Under a part chosen
    with its options (:mod:`fcl_emu.aggregation.choice`), ``name`` is the choice (its description, the parts'
    names, the default part) and an option the first part's that takes it, its description led by the parts that
    take it, its default each part's where they differ."""
    field = RunConfig.model_fields[path[0]]
    for key in path[1:]:
        parts = members(field.annotation)
        if not parts:
            field = field.annotation.model_fields[key]
        elif key == "name":
            names = tuple(p.model_fields["name"].default for p in parts)
            field = FieldInfo(annotation=Literal[names], default=field.default.name, description=field.description)
        else:
            taking = [p for p in parts if key in p.model_fields]
            field, by_default = copy.copy(taking[0].model_fields[key]), {}
            for part in taking:
                by_default.setdefault(part.model_fields[key].default, []).append(part.model_fields["name"].default)
            if len(taking) < len(parts):  # the parts that take it
                field.description = f"for {', '.join(p.model_fields['name'].default for p in taking)}: {field.description}"
            if len(by_default) > 1:
                field.description += " (default " + "; ".join(
                    f"{_number(value)} for {', '.join(names)}" for value, names in by_default.items()) + ")"
                field.default = None
    return field


def value_type(annotation: Any) -> Any:
    """A field's type as a flag takes it: ``X | None`` is ``X``, a ``Literal`` of strings is ``str``."""
    if get_origin(annotation) in (Union, UnionType):
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
    return type(get_args(annotation)[0]) if get_origin(annotation) is Literal else annotation


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_BOUNDS = {"ge": "at least", "gt": "more than", "le": "at most", "lt": "less than"}


def bounds(field: FieldInfo) -> list[str]:
    """The field's numeric bounds (its constraints ``ge``, ``gt``, ``le``, ``lt``) in words: ``at least 1``."""
    return [f"{words} {_number(getattr(m, bound))}" for m in field.metadata for bound, words in _BOUNDS.items()
            if getattr(m, bound, None) is not None]


@dataclass(frozen=True)
class RunOption:
    """One flag of a run: its parameter name, the config fields it sets and where it is offered. Its help, type
    and bounds are the first field's (its ``description``, annotation and constraints: :mod:`fcl_emu.runconfig.config`);
    only what the command line alone knows is said here."""

    name: str                                   # the parameter; the flag is --name with dashes
    fields: tuple[tuple[str, ...], ...]         # where its value goes in the config (--seed: two places)
    panel: str = ""                             # its help panel (one of PANELS)
    commands: frozenset[str] = BOTH
    with_resume: bool = False                   # may go with --resume: it does not change what the run does
    sets: Any = None                            # a switch whose on side sets the field to this value, its off
                                                # side to the field's default (--insecure/--no-insecure)
    cli_type: Any = None                        # the flag's type where the field's differs (then ``convert``)
    convert: Callable[[Any], Any] | None = None  # flag value -> config value
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def field(self) -> FieldInfo:
        return config_field(self.fields[0])

    @property
    def type(self) -> Any:
        """The value's type (bool: a switch)."""
        if self.sets is not None:
            return bool
        return self.cli_type or value_type(self.field.annotation)

    @property
    def is_switch(self) -> bool:
        return self.type is bool

    @property
    def off_flag(self) -> str | None:
        """A switch's off side (``--no-secagg``); None for a flag that takes a value."""
        return "--no-" + self.flag[2:] if self.is_switch else None

    @property
    def help(self) -> str:
        """The field's description as a sentence, then what the field's declaration adds: the value a switch
        sets, the default, the bounds; a repeatable flag says so."""
        field, path = self.field, ".".join(self.fields[0])
        if not field.description:
            raise ValueError(f"{self.flag}: config field {path} has no description (its help)")
        notes = []
        if self.sets is not None:
            notes.append(f"sets {self.sets}")
        if get_origin(self.type) is list:
            notes.append("repeatable")
        if isinstance(field.default, bool):
            notes.append("default on" if field.default else "default off")
        elif field.default not in (None, PydanticUndefined) and field.default != {}:
            notes.append(f"default {_number(field.default)}")
        notes += bounds(field)
        return " ".join(_sentence(text) for text in (field.description, "; ".join(notes)) if text)

    @property
    def annotation(self) -> Any:
        """The typer declaration of the parameter (a switch: ``--x/--no-x``; unset: None)."""
        names = f"{self.flag}/{self.off_flag}" if self.is_switch else self.flag
        option = typer.Option(names, help=self.help, metavar=self.metavar, rich_help_panel=self.panel or None)
        return Annotated[Optional[bool if self.is_switch else self.type], option]

    def given(self, value: Any) -> bool:
        """Whether the user set it (either side of a switch; any other flag that is not None or empty)."""
        return value is not None and value != []

    def apply(self, overrides: dict, value: Any) -> None:
        """Put a given value into the nested config overrides."""
        if not self.given(value):
            return
        if self.sets is not None:
            value = self.sets if value else self.field.default
        elif self.convert:
            value = self.convert(value)
        for path in self.fields:
            node = overrides
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value


def _option(name: str, fields: str | tuple[str, ...], **kw: Any) -> RunOption:
    """``fields``: a dotted config path, or several."""
    paths = (fields,) if isinstance(fields, str) else fields
    return RunOption(name, tuple(tuple(p.split(".")) for p in paths), **kw)


def _panel(title: str, *options: RunOption) -> tuple[RunOption, ...]:
    """``options`` in the help panel ``title``."""
    return tuple(dataclasses.replace(o, panel=title) for o in options)


UP_ONLY = frozenset({UP})
RUN_OPTIONS: tuple[RunOption, ...] = (
    *_panel(RUN,
            _option("seed", ("seed", "scenario.seed")),
            _option("run_dir", "run_dir")),
    *_panel(SCENARIO,
            _option("clients", "scenario.num_clients"),
            _option("dataset", "scenario.dataset"),
            _option("class_subset", "scenario.class_subset"),
            _option("data_root", "data_root", convert=_paths, with_resume=True),
            _option("download", "download"),
            _option("tasks", "scenario.num_tasks"),
            _option("partition", "scenario.partition"),
            _option("beta", "scenario.dirichlet_beta")),
    *_panel(TRAINING,
            _option("method", "method"),
            _option("method_option", "method_options", cli_type=list[str], convert=_method_options,
                    metavar="KEY=VALUE"),
            _option("model", "model"),
            _option("local_epochs", "training.local_epochs"),
            _option("lr", "training.lr"),
            _option("device", "device")),
    *_panel(ROUNDS,
            _option("clients_per_round", "rounds.clients_per_round"),
            _option("rounds_per_task", "rounds.rounds_per_task"),
            _option("round_deadline", "rounds.deadline_s"),
            _option("min_participants", "rounds.min_participants"),
            _option("overcommit", "rounds.overcommit"),
            _option("late_updates", "rounds.late_updates"),
            _option("skip_late", "rounds.skip_late", with_resume=True),
            _option("clock", "rounds.clock"),
            _option("aggregation", "aggregation.policy.name"),
            _option("buffer", "aggregation.policy.buffer"),
            _option("max_staleness", "aggregation.policy.max_staleness"),
            _option("concurrency", "aggregation.policy.concurrency"),
            _option("async_alpha", "aggregation.policy.alpha"),
            _option("async_staleness_exponent", "aggregation.policy.staleness_exponent"),
            _option("server_optimizer", "aggregation.server_optimizer.name"),
            _option("server_lr", "aggregation.server_optimizer.lr"),
            _option("server_momentum", "aggregation.server_optimizer.momentum"),
            _option("server_beta1", "aggregation.server_optimizer.beta1"),
            _option("server_beta2", "aggregation.server_optimizer.beta2"),
            _option("server_tau", "aggregation.server_optimizer.tau")),
    *_panel(EDGE,
            _option("nodes", "nodes", commands=UP_ONLY),
            _option("edge_aggregators", "topology.edge_aggregators"),
            _option("edge_rounds", "topology.edge_rounds"),
            _option("edge_uplink_mbps", "topology.uplink_mbps"),
            _option("edge_downlink_mbps", "topology.downlink_mbps"),
            _option("edge_latency_ms", "topology.latency_ms"),
            _option("bind", "network.bind"),
            _option("join_timeout", "network.join_timeout_s"),
            _option("availability", "edge.availability"),
            _option("crash_rate", "edge.crash_rate"),
            _option("device_profiles", "edge.device_profiles"),
            _option("compute", "edge.compute"),
            _option("min_battery", "edge.min_battery"),
            _option("charging", "edge.charging"),
            _option("network_trace", "edge.network_trace")),
    *_panel(BACKENDS,
            _option("backend", "containers.backend", commands=UP_ONLY, with_resume=True),
            _option("image", "containers.image", commands=UP_ONLY, with_resume=True),
            _option("node_cpus", "containers.cpus", commands=UP_ONLY),
            _option("node_memory", "containers.memory", commands=UP_ONLY),
            _option("faults", "containers.faults", commands=UP_ONLY),
            _option("advertise", "containers.advertise", commands=UP_ONLY, with_resume=True),
            _option("cluster", "containers.cluster", commands=UP_ONLY, with_resume=True),
            _option("gpu_workers", "gpu.workers"),
            _option("gpu_device", "gpu.device")),
    *_panel(SECURITY,
            _option("insecure", "security.transport", sets="plain"),
            _option("keys", "security.keys"),
            _option("secagg", "secagg.enabled"),
            _option("secagg_neighbors", "secagg.neighbors"),
            _option("secagg_threshold", "secagg.threshold"),
            _option("max_update_norm", "aggregation.max_update_norm"),
            _option("clip_norm", "aggregation.clip_norm"),
            _option("adaptive_clip", "aggregation.adaptive_clip", cli_type=str, metavar="MULTIPLE|off"),
            _option("direction_check", "aggregation.direction_check", cli_type=str, metavar="Z|off"),
            _option("aggregator", "aggregation.rule.name"),
            _option("trim_fraction", "aggregation.rule.trim_fraction"),
            _option("byzantine", "aggregation.rule.byzantine"),
            _option("multikrum_keep", "aggregation.rule.keep")),
    *_panel(PRIVACY,
            _option("privacy", "privacy.mode"),
            _option("dp_noise_multiplier", "privacy.noise_multiplier"),
            _option("dp_clip", "privacy.clip"),
            _option("dp_adaptive_clipping", "privacy.adaptive.enabled"),
            _option("dp_target_quantile", "privacy.adaptive.target_quantile"),
            _option("dp_clip_learning_rate", "privacy.adaptive.learning_rate"),
            _option("dp_delta", "privacy.delta"),
            _option("dp_noise_seed", "privacy.noise_seed"),
            _option("dp_on_divergence", "privacy.on_divergence", with_resume=True)),
    *_panel(MONITORING,
            _option("metrics_port", "metrics.port", with_resume=True),
            _option("metrics_host", "metrics.host", with_resume=True),
            _option("prometheus", "metrics.prometheus", with_resume=True),
            _option("prometheus_port", "metrics.prometheus_port", with_resume=True),
            _option("keep_prometheus", "metrics.keep_prometheus", with_resume=True)),
)
OPTIONS = {o.name: o for o in RUN_OPTIONS}

# `up`'s flags that `deploy` does not take: what its files set themselves (the run directory, the coordinator's
# address, the metrics ports, the keys and the Prometheus of the containers), what acts on `up`'s own containers
# and --download (the data root is mounted read-only).
NOT_DEPLOYED = frozenset({
    "run_dir", "download", "bind", "keys", "backend", "faults", "advertise", "cluster", "metrics_port",
    "metrics_host", "prometheus", "prometheus_port", "keep_prometheus"})


def offered(command: str) -> list[RunOption]:
    """The run options ``command`` takes: ``deploy`` takes ``up``'s but :data:`NOT_DEPLOYED`."""
    if command == DEPLOY:
        return [o for o in offered(UP) if o.name not in NOT_DEPLOYED]
    return [o for o in RUN_OPTIONS if command in o.commands]


# Where each config field is set on the command line, for validation errors (a part chosen with its options: the
# flag of its name).
FLAG_OF: dict[tuple[str, ...], str] = {
    **{path[:-1]: o.flag for o in RUN_OPTIONS for path in o.fields if path[-1] == "name"},
    **{path: o.flag for o in RUN_OPTIONS for path in o.fields}}


def elsewhere(name: str) -> Any:
    """The typer declaration of run flag ``name`` for a command that is not a run (``keys``, the benchmarks),
    in that command's own options panel."""
    return dataclasses.replace(OPTIONS[name], panel="").annotation


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


ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML config file; flags override it.",
                                                   rich_help_panel=RUN)]
ResumeOpt = Annotated[Optional[Path], typer.Option(
    "--resume", metavar="RUN_DIR", rich_help_panel=RUN,
    help=f"Continue the interrupted run in RUN_DIR from its last checkpoint, same address and run id "
         f"(docs/resume.md). Only {', '.join(o.flag for o in RUN_OPTIONS if o.with_resume)} and --verbose may go "
         f"with it.")]
OVERWRITE = ("overwrite", Annotated[bool, typer.Option(
    "--overwrite/--no-overwrite", show_default=False, rich_help_panel=RUN,
    help="Delete the run that the run directory holds, its files only, and start this one there; without it a run "
         "directory that holds a run is refused (docs/resume.md). Default off.")], False)
VerboseOpt = Annotated[bool, typer.Option("--verbose/--no-verbose", "-v", help="Log debug messages too. Default off.",
                                          show_default=False, rich_help_panel=RUN)]


def run_command(command: str, *arguments: tuple) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command body ``(config, resume, verbose, flags)`` the parameters of :data:`RUN_OPTIONS` that
    ``command`` offers (:func:`offered`), as typer reads them from the signature; ``deploy``, which writes files
    and starts no run, takes neither --resume nor --verbose: its body is ``(config, flags)``. ``arguments``
    ((name, typer annotation) pairs: required; (name, annotation, default) triples: the command's own options)
    come first and reach the body in ``flags``."""
    def decorate(body: Callable[..., None]) -> Callable[..., None]:
        controls = [] if command == DEPLOY else [
            inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, annotation=ResumeOpt, default=None),
            inspect.Parameter("verbose", inspect.Parameter.KEYWORD_ONLY, annotation=VerboseOpt, default=False)]
        params = [*(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                      default=default[0] if default else inspect.Parameter.empty)
                    for name, annotation, *default in arguments),
                  inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=ConfigOpt, default=None),
                  *(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=o.annotation,
                                      default=None) for o in offered(command)),
                  *controls]

        def command_function(**values: Any) -> None:
            body(values.pop("config"), *(values.pop(p.name) for p in controls), values)

        command_function.__name__ = body.__name__
        command_function.__doc__ = body.__doc__
        command_function.__signature__ = inspect.Signature(params)
        return command_function
    return decorate
