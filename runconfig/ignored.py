"""Settings that count only where another setting enables them: one table (:data:`DEPENDENT`) of each such setting,
what it needs and why, checked in one place as a config is resolved (:func:`settle`, called by
:func:`~fcl_emu.runconfig.config.load_config`).

A dependent setting whose enabler is off does nothing. A flag that sets it is refused, a line per flag saying what it
needs. A config file that sets it to another value than its default keeps working (a base file may hold settings that
a flag turns off): the value goes back to its default, so that no record of the run (its config.yaml, the settings
of its closing table) shows it as applied, and the run tells it as ignored (:attr:`RunConfig.ignored
<fcl_emu.runconfig.config.RunConfig.ignored>`: a warning at its start, a row of its closing table). A value equal to
its default is not set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar

import pydantic_core


@dataclass(frozen=True)
class Dependent:
    """A setting (its dotted config path) that counts only where ``applies(config)`` holds; ``needs`` says what that
    takes, in flags, ``why`` what the setting is for."""

    setting: str
    needs: str
    why: str
    applies: Callable[[Any], bool]
    kind: ClassVar[str] = "ignored"  # its kind in the compatibility table (runconfig/compatibility.py)

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.setting.split("."))

    @property
    def reason(self) -> str:
        return f"needs {self.needs} ({self.why})"


def _needing(needs: str, applies: Callable[[Any], bool], why: str, *settings: str) -> tuple[Dependent, ...]:
    """A row for each of ``settings``, all enabled alike."""
    return tuple(Dependent(setting, needs, why, applies) for setting in settings)


EMULATED = "the emulated clock (--clock emulated, or auto with the process backend)"
DEPENDENT: tuple[Dependent, ...] = (
    *_needing("--privacy central or distributed", lambda c: c.privacy.mode != "off", "differential privacy is off",
              "privacy.noise_multiplier", "privacy.clip", "privacy.delta", "privacy.on_divergence"),
    *_needing("--privacy central", lambda c: c.privacy.central, "it seeds the coordinator's noise; under distributed "
              "DP the clients draw theirs", "privacy.noise_seed"),
    *_needing("--privacy central", lambda c: c.privacy.central, "it adapts the norm the coordinator clips to",
              "privacy.adaptive.enabled"),
    *_needing("--privacy central --dp-adaptive-clipping", lambda c: c.privacy.central and c.privacy.adaptive.enabled,
              "a parameter of adaptive clipping", "privacy.adaptive.target_quantile",
              "privacy.adaptive.learning_rate", "privacy.adaptive.count_stddev"),
    *_needing("--secagg", lambda c: c.secagg.enabled, "a parameter of SecAgg+ rounds", "secagg.neighbors",
              "secagg.threshold", "secagg.ring_bits", "secagg.phase_timeout_s"),
    *_needing("--secagg without --privacy distributed", lambda c: c.secagg.enabled and not c.privacy.distributed,
              "distributed DP clips to --dp-clip and weighs every client 1", "secagg.clip", "secagg.max_weight"),
    *_needing("plain aggregation (no --secagg)", lambda c: not c.secagg.enabled, "a secure round shows the server no "
              "single update", "aggregation.adaptive_clip", "aggregation.direction_check"),
    *_needing("CurveZMQ (no --insecure)", lambda c: c.security.transport == "curve", "plain TCP takes no keys",
              "security.keys"),
    *_needing("--edge-aggregators M", lambda c: c.topology.edge_aggregators > 0, "edge rounds run at edge "
              "aggregators", "topology.edge_rounds"),
    *_needing(f"--edge-aggregators M on {EMULATED}", lambda c: c.topology.edge_aggregators > 0 and c.emulated_clock,
              "the emulated links between edge aggregators and the coordinator", "topology.uplink_mbps",
              "topology.downlink_mbps", "topology.latency_ms"),
    *_needing("--availability bernoulli:P", lambda c: c.edge.availability.startswith("bernoulli"), "the slots of "
              "the Bernoulli availability model", "edge.availability_slot_s"),
    *_needing("--availability trace:PATH", lambda c: c.edge.availability.startswith("trace"), "the time scale of an "
              "availability trace", "edge.trace_time_scale"),
    *_needing("--crash-rate above 0", lambda c: c.edge.crash_rate > 0, "how long a crashed client stays down",
              "edge.crash_downtime_s"),
    *_needing(EMULATED, lambda c: c.emulated_clock, "the real clock takes host seconds as they come",
              "edge.compute", "edge.min_battery", "edge.charging", "rounds.skip_late", "rounds.host_timeout_s"),
    *_needing(f"--charging available or away on {EMULATED}", lambda c: c.emulated_clock and c.edge.charging != "never",
              "the power of a charging battery", "edge.charge_w"),
    *_needing("training.optimizer sgd", lambda c: c.training.optimizer == "sgd", "Adam takes no momentum",
              "training.momentum"),
    *_needing("--metrics-port or --prometheus", lambda c: c.metrics.enabled or c.metrics.prometheus, "without them "
              "there is no /metrics endpoint", "metrics.host"),
    *_needing("--prometheus", lambda c: c.metrics.prometheus, "a setting of the local Prometheus",
              "metrics.prometheus_port", "metrics.keep_prometheus"),
    *_needing("--backend docker or swarm", lambda c: c.containers.backend != "process", "process nodes run in no "
              "container", "containers.network", "containers.gpus"),
    *_needing("--backend swarm", lambda c: c.containers.backend == "swarm", "the address Swarm services dial",
              "containers.advertise"),
    *_needing("--gpu-workers N", lambda c: c.gpu.workers > 0, "without workers the jobs run in a thread of the "
              "coordinator", "gpu.job_timeout_s", "gpu.threads"),
)


@dataclass(frozen=True)
class Ignored:
    """A config file's value of a setting that the run ignores, and why."""

    setting: str
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.setting}={json.dumps(self.value, default=str)} ignored: {self.reason}"


def _given(data: Mapping[str, Any], path: tuple[str, ...]) -> bool:
    """Whether the nested mapping ``data`` holds a key at ``path``."""
    for key in path:
        if not isinstance(data, Mapping) or key not in data:
            return False
        data = data[key]
    return True


def _without(data: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """``data`` less its key at ``path`` (which it holds)."""
    head, *rest = path
    return {key: (_without(value, tuple(rest)) if key == head and rest else value)
            for key, value in data.items() if key != head or rest}


def _default(config: Any, path: tuple[str, ...]) -> Any:
    """The declared default of the setting at ``path`` (a method or data set may bring its own: see :func:`settle`)."""
    model = type(attrgetter(".".join(path[:-1]))(config)) if len(path) > 1 else type(config)
    return model.model_fields[path[-1]].get_default(call_default_factory=True)


def settle(config: Any, data: Mapping[str, Any], overrides: Mapping[str, Any],
           build: Callable[[Mapping[str, Any]], Any]) -> Any:
    """``config``, built by ``build(data)`` from a config file's ``data`` and the flags' ``overrides``, with what it
    ignores settled (the module docstring). Raises a ``ValidationError`` with one error per refused flag, at its
    setting's location. Returns ``config``, or the config built again without the file's ignored values (those that
    differ from the run's default), which its :attr:`ignored` lists."""
    idle = [row for row in DEPENDENT if not row.applies(config)]
    refused = [row for row in idle if _given(overrides, row.path)]
    if refused:
        raise pydantic_core.ValidationError.from_exception_data(type(config).__name__, [
            {"type": pydantic_core.PydanticCustomError("ignored_setting", row.reason), "loc": row.path,
             "input": attrgetter(row.setting)(config)} for row in refused])
    value = {row.setting: attrgetter(row.setting)(config) for row in idle}
    set_in_file = [row for row in idle if _given(data, row.path) and value[row.setting] != _default(config, row.path)]
    if not set_in_file:
        return config
    for row in set_in_file:
        data = _without(data, row.path)
    settled = build(data)
    ignored = tuple(Ignored(row.setting, value[row.setting], row.reason) for row in set_in_file
                    if attrgetter(row.setting)(settled) != value[row.setting])
    if not ignored:  # each at the default a method or data set brings
        return config
    settled._ignored = ignored
    return settled
