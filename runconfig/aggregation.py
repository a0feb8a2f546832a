"""Which round policy (:func:`check_aggregation`) and server optimiser (:func:`check_server_optimizer`) a run can
take; the policies, optimisers and their settings are :mod:`fcl_emu.aggregation.policies`,
:mod:`fcl_emu.aggregation.server_optimizers` and :mod:`fcl_emu.aggregation.settings`."""

from __future__ import annotations


# --- server optimiser refusals (to move into the run's compatibility table) ------------------------------------
def check_server_optimizer(config, spec) -> None:
    """Raise ValueError (one line) for a server optimiser the run cannot take: ``config`` a
    :class:`~fcl_emu.runconfig.RunConfig`, ``spec`` its method's :class:`~fcl_emu.methods.registry.MethodSpec`."""
    from fcl_emu.aggregation.update import DELTA

    settings = config.aggregation
    flag = f"--server-optimizer {settings.server_optimizer}"
    if settings.asynchronous:
        raise ValueError(f"{flag} steps a synchronous round's aggregate: --aggregation {settings.kind} applies "
                         f"updates as they arrive with its own staleness weights (use --aggregation sync)")
    if DELTA not in spec.server.summable:
        raise ValueError(f"{flag}: method {spec.name!r} shares no global model for it to step (its clients "
                         f"upload no model delta)")
    if spec.server.server_step_refusal is not None:
        raise ValueError(f"{flag}: method {spec.name!r} {spec.server.server_step_refusal}")
# --- end of server optimiser refusals ---------------------------------------------------------------------------



def check_aggregation(config, refusals: dict[str, str]) -> None:
    """Raise ValueError (one line) for an asynchronous policy the run cannot take: ``config`` a
    :class:`~fcl_emu.runconfig.RunConfig`, ``refusals`` its method's (:func:`fcl_emu.methods.requirements.refusals`)."""
    from fcl_emu.methods.requirements import ASYNC

    settings = config.aggregation
    flag = f"--aggregation {settings.kind}"
    if ASYNC in refusals:
        raise ValueError(f"{flag}: {refusals[ASYNC]}")
    if config.secagg.enabled:
        raise ValueError(f"{flag} cannot be combined with --secagg: a masked sum needs one cohort that answers "
                         f"together, and asynchronous aggregation applies updates one by one as they arrive")
    if not config.emulated_clock:
        raise ValueError(f"{flag} runs on the emulated clock (arrivals are ordered in emulated time): use "
                         f"--clock emulated or auto with the process backend")
    if config.privacy.central or config.privacy.distributed:
        raise ValueError(f"{flag} cannot be combined with --privacy: its accountant counts synchronous rounds")
    if config.security.aggregator != "mean":
        raise ValueError(f"{flag} cannot be combined with --aggregator {config.security.aggregator}: the "
                         f"staleness weights replace the mean")
    if config.edge.crash_rate > 0:
        raise ValueError(f"{flag} does not draw crashes during training: use --crash-rate 0 (availability is "
                         f"followed when a client is picked)")
    if config.rounds.late_updates != "drop" or config.rounds.overcommit != 1.0:
        raise ValueError(f"{flag} keeps clients busy and applies every update that is fresh enough by itself: "
                         f"--late-updates and --overcommit are for synchronous rounds")
    concurrency = settings.resolved_concurrency(config.rounds.clients_per_round)
    if concurrency > config.scenario.num_clients:
        raise ValueError(f"--concurrency {concurrency} exceeds the number of clients ({config.scenario.num_clients})")
