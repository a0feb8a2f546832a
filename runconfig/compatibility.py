"""What combines with what: one table (:data:`TABLE`) of every refusal between settings and of every setting ignored
with another one, consulted in one place as a :class:`~fcl_emu.runconfig.config.RunConfig` is validated
(:func:`check`).

- **Refused** (:data:`REFUSED`): a :class:`Refusal` per combination that cannot run, named by the flags a user
  types, with a predicate on the config and its method's registry entry, the one-line reason the error gives and an
  example config that triggers it. The first that holds, in the table's order, is the error. A method's refusals are
  derived from its server part's declarations (:func:`fcl_emu.methods.requirements.refusals`); the table's
  :func:`method entries <method_refusals>` are where the config and ``fcl-emu methods NAME`` read them.
- **Ignored** (:data:`~fcl_emu.runconfig.ignored.DEPENDENT`): a setting that counts only where another enables it,
  refused as a flag and listed as ignored from a config file (:func:`~fcl_emu.runconfig.ignored.settle`).

A value check of one setting (a port's range, a positive number) stays on its field. The docs' matrix
(docs/compatibility.md) and ``fcl-emu compatibility`` are rendered from this table (:mod:`fcl_emu.compatibility`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fcl_emu.aggregation.policies import POLICIES
from fcl_emu.methods.models.classifier import NO_BATCHNORM
from fcl_emu.methods.models.names import MODELS as MODEL_NAMES, one_of
from fcl_emu.methods.registry import MethodSpec
from fcl_emu.methods.requirements import ASYNC, CENTRAL_DP, HIERARCHY, ROBUST, SECAGG, SERVER_STEP
from fcl_emu.runconfig.ignored import DEPENDENT, Dependent
from fcl_emu.scenario.faults import HOST_ACTIONS, NEEDS_CLUSTER, load_plan

Predicate = Callable[[Any, MethodSpec], bool]
Reason = Callable[[Any, MethodSpec], str]


@dataclass(frozen=True)
class Refusal:
    """A combination that cannot run: the ``settings`` it concerns (flags), ``when`` it holds (on the config and its
    method's :class:`~fcl_emu.methods.registry.MethodSpec`), its ``reason`` (the error's line) and an ``example``
    config (nested keys, with ``files``: the files it names, by name and content) that triggers it. A method's
    refusal also has the ``feature`` it rules out (a run feature, a key of ``MethodSpec.refusals``, or models) and
    ``by_method``: why a method refuses it, or None where it does not."""

    settings: tuple[str, ...]
    when: Predicate
    reason: Reason
    example: Mapping[str, Any]
    files: Mapping[str, str] = field(default_factory=dict)
    feature: str | None = None
    by_method: Callable[[MethodSpec], str | None] | None = None
    kind: ClassVar[str] = "refused"


# Accessors of the settings the predicates read where they may move: one line each to change.
def _rule(config) -> str:
    """The aggregation rule's name (``--aggregator``)."""
    return config.aggregation.rule.name


def _rule_needs(config) -> int:
    """The updates the run's aggregation rule needs a round."""
    return config.aggregation.aggregator().min_updates


def _byzantine(config) -> int:
    return config.aggregation.rule.byzantine


def _bounds_norms(config) -> bool:
    """Whether the server bounds or clips each update's norm (``--max-update-norm``, ``--clip-norm``)."""
    return config.aggregation.max_update_norm is not None or config.aggregation.clip_norm is not None


def _optimizer(config) -> str:
    return f"--server-optimizer {config.aggregation.server_optimizer.name}"


def _steps(config) -> bool:
    """Whether a server optimiser steps each round's aggregate (``--server-optimizer`` other than none)."""
    return config.aggregation.server_optimizer.name != "none"


def _m(config) -> int:
    return config.topology.edge_aggregators


def _hier(config) -> str:
    return f"--edge-aggregators {_m(config)}"


def _policy(config) -> str:
    return f"--aggregation {config.aggregation.policy.name}"


def _secagg_sampled(config) -> tuple[int, int]:
    """(the clients a secure round samples, the neighbours each then has)."""
    sampled = min(config.rounds.planned_cohort, config.scenario.num_clients)
    return sampled, config.secagg.neighbors_for(sampled)


def _ring_fits(config) -> bool:
    from fcl_emu.secagg.noise import DistributedNoise

    noise = DistributedNoise(config.privacy.noise_multiplier, config.rounds.clients_per_round)
    return noise.fits(config.secagg.ring_bits, config.rounds.planned_cohort, 1)


def _host_faults(config) -> bool:
    return any(f.action in HOST_ACTIONS for f in load_plan(config.containers.faults).faults)


def _method(feature: str, on: Callable[[Any], bool], flag: Callable[[Any], str], example: Mapping[str, Any],
            settings: tuple[str, ...]) -> Refusal:
    """The refusal of ``feature`` by a method whose server part rules it out (its ``MethodSpec.refusals``)."""
    return Refusal(("--method", *settings), lambda c, s: on(c) and feature in s.refusals,
                   lambda c, s: f"{flag(c)}: {s.refusals[feature]}", example, feature=feature,
                   by_method=lambda s: s.refusals.get(feature))


def _batchnorm_reason(config, spec: MethodSpec) -> str:
    return (f"method {spec.name!r} trains its generator on the model's BatchNorm statistics; model {config.model!r} "
            f"has none: use {one_of([m for m in MODEL_NAMES if m not in NO_BATCHNORM])}")


SECURE = {"secagg": {"enabled": True}}
CENTRAL = {"privacy": {"mode": "central"}}
FEDBUFF = {"aggregation": {"policy": "fedbuff"}}
TIERS = {"topology": {"edge_aggregators": 2}}
PLAN = "plan.yaml"
TRACE = "network.json"

REFUSED: tuple[Refusal, ...] = (
    # the method and its model
    Refusal(("--method", "--model"), lambda c, s: s.server.needs_batchnorm and c.model in NO_BATCHNORM,
            _batchnorm_reason, {"method": "mfcl", "model": "cnn"},
            feature=f"--model {' or '.join(sorted(NO_BATCHNORM))}",
            by_method=lambda s: "it trains its generator on the model's BatchNorm statistics, which that model has "
                                "none of" if s.server.needs_batchnorm else None),
    # secure aggregation
    _method(SECAGG, lambda c: c.secagg.enabled, lambda c: "--secagg", {"method": "fedcbc", **SECURE}, ("--secagg",)),
    Refusal(("--secagg", "--max-update-norm", "--clip-norm"), lambda c, s: c.secagg.enabled and _bounds_norms(c),
            lambda c, s: "--secagg hides each client's delta from the server, so the server cannot bound or clip its "
                         "norm: --max-update-norm and --clip-norm need plain aggregation",
            {**SECURE, "aggregation": {"max_update_norm": 5.0}}),
    Refusal(("--secagg", "--late-updates"), lambda c, s: c.secagg.enabled and c.rounds.late_updates == "next_round",
            lambda c, s: "--secagg cannot be combined with --late-updates next_round: a late masked input cannot "
                         "join another round's sum",
            {**SECURE, "rounds": {"late_updates": "next_round"}}),
    Refusal(("--secagg", "--clients-per-round"), lambda c, s: c.secagg.enabled and c.rounds.clients_per_round < 3,
            lambda c, s: "--secagg needs at least 3 clients per round", {**SECURE, "rounds": {"clients_per_round": 2}}),
    Refusal(("--secagg-threshold", "--secagg-neighbors", "--clients-per-round", "--overcommit"),
            lambda c, s: c.secagg.enabled and c.secagg.threshold_for(_secagg_sampled(c)[1]) > _secagg_sampled(c)[1],
            lambda c, s: (f"--secagg-threshold {c.secagg.threshold}: a round of {_secagg_sampled(c)[0]} sampled "
                          f"clients gives each client {_secagg_sampled(c)[1]} neighbours (secagg.neighbors, capped at "
                          f"n - 1), fewer than the threshold, so every round would be skipped: use a threshold of at "
                          f"most {_secagg_sampled(c)[1]}"),
            {"scenario": {"num_clients": 10}, "rounds": {"clients_per_round": 5},
             "secagg": {"enabled": True, "threshold": 6}}),
    # central differential privacy
    Refusal(("--privacy central", "--secagg"), lambda c, s: c.privacy.central and c.secagg.enabled,
            lambda c, s: "--privacy central cannot be combined with --secagg: the coordinator must see each delta to "
                         "clip it (under secure aggregation use --privacy distributed)", {**CENTRAL, **SECURE}),
    _method(CENTRAL_DP, lambda c: c.privacy.central, lambda c: "--privacy central", {"method": "glfc", **CENTRAL},
            ("--privacy central",)),
    Refusal(("--privacy central", "--aggregator"), lambda c, s: c.privacy.central and _rule(c) != "mean",
            lambda c, s: f"--privacy central averages the clipped deltas itself, with equal weights: it cannot be "
                         f"combined with --aggregator {_rule(c)}", {**CENTRAL, "aggregation": {"rule": "median"}}),
    Refusal(("--privacy central", "--late-updates"),
            lambda c, s: c.privacy.central and c.rounds.late_updates == "next_round",
            lambda c, s: "--privacy central cannot be combined with --late-updates next_round: a late update would "
                         "join a second round's aggregate outside the privacy accounting",
            {**CENTRAL, "rounds": {"late_updates": "next_round"}}),
    Refusal(("--dp-adaptive-clipping", "--dp-noise-multiplier", "--clients-per-round"),
            lambda c, s: (c.privacy.central and c.privacy.adaptive.enabled and c.privacy.noise_multiplier > 0
                          and c.privacy.noise_multiplier >= 2 * c.privacy.adaptive.count_noise(
                              c.rounds.clients_per_round)),
            lambda c, s: (f"--dp-adaptive-clipping: the noise multiplier {c.privacy.noise_multiplier:g} must be less "
                          f"than twice the count noise sigma_b = "
                          f"{c.privacy.adaptive.count_noise(c.rounds.clients_per_round):g} (privacy.adaptive."
                          f"count_stddev, default clients_per_round / 20), which it includes"),
            {"privacy": {"mode": "central", "noise_multiplier": 3.0, "adaptive": {"enabled": True}}}),
    # distributed differential privacy
    Refusal(("--privacy distributed", "--secagg"), lambda c, s: c.privacy.distributed and not c.secagg.enabled,
            lambda c, s: "--privacy distributed adds the noise under SecAgg+ masks: it needs --secagg (without it, "
                         "use --privacy central)", {"privacy": {"mode": "distributed"}}),
    Refusal(("--privacy distributed", "--dp-adaptive-clipping"),
            lambda c, s: c.privacy.distributed and c.privacy.adaptive.enabled,
            lambda c, s: "--privacy distributed clips to a fixed norm (--dp-clip): adaptive clipping needs the count "
                         "of unclipped updates, which the server cannot see under SecAgg+",
            {**SECURE, "privacy": {"mode": "distributed", "adaptive": {"enabled": True}}}),
    Refusal(("--privacy distributed", "--dp-noise-multiplier", "--clients-per-round"),
            lambda c, s: c.privacy.distributed and not _ring_fits(c),
            lambda c, s: (f"--privacy distributed: a {c.secagg.ring_bits}-bit ring cannot hold the clipped sum of "
                          f"{c.rounds.planned_cohort} clients plus noise of multiplier {c.privacy.noise_multiplier:g} "
                          f"without wrapping around; raise secagg.ring_bits (at most 32) or lower the noise"),
            {"privacy": {"mode": "distributed"}, "secagg": {"enabled": True, "ring_bits": 8}}),
    # robust aggregation rules
    _method(ROBUST, lambda c: _rule(c) != "mean", lambda c: f"--aggregator {_rule(c)}",
            {"method": "fedcbc", "aggregation": {"rule": "median"}}, ("--aggregator",)),
    Refusal(("--aggregator", "--secagg"), lambda c, s: _rule(c) != "mean" and c.secagg.enabled,
            lambda c, s: f"--aggregator {_rule(c)} needs each client's delta, which --secagg hides from the server "
                         f"(it sees only their sum)", {**SECURE, "aggregation": {"rule": "median"}}),
    Refusal(("--aggregator", "--byzantine", "--clients-per-round"),
            lambda c, s: _rule(c) != "mean" and _rule_needs(c) > c.rounds.clients_per_round,
            lambda c, s: f"--aggregator {_rule(c)} with --byzantine {_byzantine(c)} needs at least {_rule_needs(c)} "
                         f"updates a round; rounds.clients_per_round is {c.rounds.clients_per_round}",
            {"scenario": {"num_clients": 10}, "aggregation": {"rule": {"name": "bulyan", "byzantine": 2}}}),
    # asynchronous round policies
    _method(ASYNC, lambda c: c.aggregation.asynchronous, _policy, {"method": "glfc", **FEDBUFF}, ("--aggregation",)),
    Refusal(("--aggregation", "--secagg"), lambda c, s: c.aggregation.asynchronous and c.secagg.enabled,
            lambda c, s: f"{_policy(c)} cannot be combined with --secagg: a masked sum needs one cohort that answers "
                         f"together, and asynchronous aggregation applies updates one by one as they arrive",
            {**FEDBUFF, **SECURE}),
    Refusal(("--aggregation", "--clock", "--backend"), lambda c, s: c.aggregation.asynchronous and not c.emulated_clock,
            lambda c, s: f"{_policy(c)} runs on the emulated clock (arrivals are ordered in emulated time): use "
                         f"--clock emulated or auto with the process backend",
            {**FEDBUFF, "rounds": {"clock": "real"}}),
    Refusal(("--aggregation", "--privacy"),
            lambda c, s: c.aggregation.asynchronous and (c.privacy.central or c.privacy.distributed),
            lambda c, s: f"{_policy(c)} cannot be combined with --privacy: its accountant counts synchronous rounds",
            {**FEDBUFF, **CENTRAL}),
    Refusal(("--aggregation", "--aggregator"), lambda c, s: c.aggregation.asynchronous and _rule(c) != "mean",
            lambda c, s: f"{_policy(c)} cannot be combined with --aggregator {_rule(c)}: the staleness weights "
                         f"replace the mean", {"aggregation": {"policy": "fedbuff", "rule": "median"}}),
    Refusal(("--aggregation", "--crash-rate"), lambda c, s: c.aggregation.asynchronous and c.edge.crash_rate > 0,
            lambda c, s: f"{_policy(c)} does not draw crashes during training: use --crash-rate 0 (availability is "
                         f"followed when a client is picked)", {**FEDBUFF, "edge": {"crash_rate": 0.1}}),
    Refusal(("--aggregation", "--late-updates", "--overcommit"),
            lambda c, s: c.aggregation.asynchronous and (c.rounds.late_updates != "drop"
                                                          or c.rounds.overcommit != 1.0),
            lambda c, s: f"{_policy(c)} keeps clients busy and applies every update that is fresh enough by itself: "
                         f"--late-updates and --overcommit are for synchronous rounds",
            {**FEDBUFF, "rounds": {"overcommit": 1.5}}),
    Refusal(("--concurrency", "--clients"),
            lambda c, s: (c.aggregation.asynchronous and c.aggregation.policy.resolved_concurrency(
                c.rounds.clients_per_round) > c.scenario.num_clients),
            lambda c, s: (f"--concurrency {c.aggregation.policy.resolved_concurrency(c.rounds.clients_per_round)} exceeds "
                          f"the number of clients ({c.scenario.num_clients})"),
            {"aggregation": {"policy": {"name": "fedbuff", "concurrency": 400}}}),
    # edge aggregators (hierarchical FL)
    _method(HIERARCHY, lambda c: _m(c) > 0, _hier, {"method": "fedcbc", **TIERS}, ("--edge-aggregators",)),
    Refusal(("--edge-aggregators", "--backend"), lambda c, s: _m(c) > 0 and c.containers.backend != "process",
            lambda c, s: f"{_hier(c)} starts the aggregators as processes of this host: use --backend process",
            {**TIERS, "containers": {"backend": "docker"}}),
    Refusal(("--edge-aggregators", "--nodes"), lambda c, s: _m(c) > 0 and c.nodes < _m(c),
            lambda c, s: f"--nodes {c.nodes} is fewer than {_hier(c)}: each aggregator serves at least one node",
            {**TIERS, "nodes": 1}),
    Refusal(("--edge-aggregators", "network.client_connections"),
            lambda c, s: _m(c) > 0 and c.network.client_connections != "shared",
            lambda c, s: f"{_hier(c)} relays each edge node's shared connection: use network.client_connections: "
                         f"shared (keys per device are not taken either)",
            {**TIERS, "network": {"client_connections": "own"}}),
    Refusal(("--edge-aggregators", "--aggregation"), lambda c, s: _m(c) > 0 and c.aggregation.asynchronous,
            lambda c, s: f"{_hier(c)} aggregates a synchronous round's cohort at the edge: use --aggregation sync",
            {**TIERS, **FEDBUFF}),
    Refusal(("--edge-aggregators", "--aggregator", "--byzantine"), lambda c, s: _m(c) > 0 and _rule_needs(c) > _m(c),
            lambda c, s: f"--aggregator {_rule(c)} combines the edge aggregates (each edge averages its clients' "
                         f"updates): it needs {_rule_needs(c)} of them a round, more than {_hier(c)}",
            {**TIERS, "aggregation": {"rule": "krum"}}),
    Refusal(("--edge-aggregators", "--privacy central"), lambda c, s: _m(c) > 0 and c.privacy.central,
            lambda c, s: f"{_hier(c)}: --privacy central clips each update at the coordinator, which sees only edge "
                         f"aggregates (use --secagg --privacy distributed)", {**TIERS, **CENTRAL}),
    Refusal(("--edge-rounds", "--secagg"),
            lambda c, s: _m(c) > 0 and c.topology.edge_rounds > 1 and c.secagg.enabled,
            lambda c, s: f"--edge-rounds {c.topology.edge_rounds} averages each edge round's updates at the edge, "
                         f"which --secagg hides from it: use --edge-rounds 1 with --secagg",
            {"topology": {"edge_aggregators": 2, "edge_rounds": 2}, **SECURE}),
    Refusal(("--edge-aggregators", "--late-updates"), lambda c, s: _m(c) > 0 and c.rounds.late_updates != "drop",
            lambda c, s: f"{_hier(c)}: a late update stays at its edge aggregator; use --late-updates drop",
            {**TIERS, "rounds": {"late_updates": "next_round"}}),
    # server optimisers
    _method(SERVER_STEP, _steps, _optimizer, {"method": "glfc", "aggregation": {"server_optimizer": "fedadam"}},
            ("--server-optimizer",)),
    Refusal(("--server-optimizer", "--aggregation"),
            lambda c, s: _steps(c) and not POLICIES[c.aggregation.policy.name].takes_server_step,
            lambda c, s: f"{_optimizer(c)} steps along what an aggregation moved the model: {_policy(c)} mixes "
                         f"each update in on arrival by its own weight (use --aggregation sync or fedbuff)",
            {"aggregation": {"policy": "fedasync", "server_optimizer": "fedadam"}}),
    # the population and the cohort
    Refusal(("--clients-per-round", "--clients"), lambda c, s: c.rounds.clients_per_round > c.scenario.num_clients,
            lambda c, s: f"rounds.clients_per_round ({c.rounds.clients_per_round}) exceeds the number of clients "
                         f"({c.scenario.num_clients})",
            {"scenario": {"num_clients": 10}, "rounds": {"clients_per_round": 20}}),
    # backends, clusters and fault plans
    Refusal(("--cluster", "--backend"),
            lambda c, s: c.containers.cluster is not None and c.containers.backend != "swarm",
            lambda c, s: "--cluster names the hosts of a swarm: use it with --backend swarm",
            {"containers": {"cluster": "lab"}}),
    Refusal(("--faults", "--backend"),
            lambda c, s: c.containers.faults is not None and c.containers.backend == "process",
            lambda c, s: "a fault plan acts on containers: use it with --backend docker or swarm (emulated churn for "
                         "host processes: --availability, --crash-rate)",
            {"containers": {"faults": PLAN}}, files={PLAN: "faults:\n  - {action: kill, round: 2}\n"}),
    Refusal(("--faults", "--cluster"),
            lambda c, s: c.containers.faults is not None and c.containers.cluster is None and _host_faults(c),
            lambda c, s: NEEDS_CLUSTER, {"containers": {"faults": PLAN, "backend": "docker"}},
            files={PLAN: "faults:\n  - {action: lose_host, host: lab-1, round: 2}\n"}),
    Refusal(("--min-participants", "--clients-per-round"),
            lambda c, s: c.rounds.min_participants > c.rounds.clients_per_round,
            lambda c, s: "rounds.min_participants exceeds rounds.clients_per_round",
            {"rounds": {"min_participants": 40}}),
    Refusal(("--network-trace", "--clock", "--backend"),
            lambda c, s: c.edge.network_trace is not None and not c.emulated_clock,
            lambda c, s: "--network-trace follows the emulated clock: use --clock emulated or auto (host processes, "
                         "no --secagg)", {"edge": {"network_trace": TRACE}, "rounds": {"clock": "real"}},
            files={TRACE: '{"0": {"time": [0], "communication": [800]}}'}),
    Refusal(("--metrics-port", "--nodes", "--gpu-workers"),
            lambda c, s: c.metrics.port is not None and c.metrics.port + c.nodes + c.gpu.workers > 65535,
            lambda c, s: f"metrics.port {c.metrics.port} leaves no room for {c.nodes} edge-node and {c.gpu.workers} "
                         f"GPU-worker ports after it (port + nodes + gpu.workers must be at most 65535)",
            {"metrics": {"port": 65535}}),
)

#: Every entry: the refusals, then the settings ignored without their enabler (runconfig/ignored.py's rows).
TABLE: tuple[Refusal | Dependent, ...] = (*REFUSED, *DEPENDENT)


def example_data(entry: Refusal, folder: Path) -> dict[str, Any]:
    """The config data of ``entry``'s example, the files it names written into ``folder`` (and named by their path
    there)."""
    def placed(data: Mapping[str, Any]) -> dict[str, Any]:
        return {key: placed(value) if isinstance(value, Mapping) else
                str(folder / value) if isinstance(value, str) and value in entry.files else value
                for key, value in data.items()}

    for name, text in entry.files.items():
        (folder / name).write_text(text)
    return placed(entry.example)


def refused(config, spec: MethodSpec) -> list[Refusal]:
    """Every refusal that holds for ``config`` (a :class:`~fcl_emu.runconfig.config.RunConfig` whose single
    settings are valid) and its method's ``spec``, in the table's order."""
    return [entry for entry in REFUSED if entry.when(config, spec)]


def check(config, spec: MethodSpec) -> None:
    """Raise ValueError with the reason of the first refusal that holds for ``config`` and ``spec``, if any."""
    for entry in REFUSED:
        if entry.when(config, spec):
            raise ValueError(entry.reason(config, spec))


def method_refusals(spec: MethodSpec) -> list[tuple[str, str]]:
    """What method ``spec`` rules out, each (the feature, why), from the table's method entries: the models it
    cannot train with and the run features its server part refuses."""
    reasons = ((entry.feature, entry.by_method(spec)) for entry in REFUSED if entry.by_method is not None)
    return [(feature, why) for feature, why in reasons if why is not None]
