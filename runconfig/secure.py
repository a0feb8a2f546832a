"""Which runs SecAgg+ can take (:func:`check_secagg`), and distributed differential privacy under it
(:func:`check_distributed_privacy`)."""

from __future__ import annotations

import importlib.util


def check_secagg(config, refusals: dict[str, str]) -> None:
    """Raise ValueError (one line) for a run that SecAgg+ cannot serve: ``config`` a
    :class:`~fcl_emu.runconfig.RunConfig`, ``refusals`` its method's (:func:`fcl_emu.methods.requirements.refusals`).
    A threshold that no round can reach is refused here, with the numbers, rather than skipping every round."""
    from fcl_emu.methods.requirements import SECAGG

    if SECAGG in refusals:
        raise ValueError(f"--secagg: {refusals[SECAGG]}")
    if config.security.max_update_norm is not None or config.security.clip_norm is not None:
        raise ValueError("--secagg hides each client's delta from the server, so the server cannot bound or "
                         "clip its norm: --max-update-norm and --clip-norm need plain aggregation")
    if config.rounds.late_updates == "next_round":
        raise ValueError("--secagg cannot be combined with --late-updates next_round: a late masked input "
                         "cannot join another round's sum")
    if config.rounds.clients_per_round < 3:
        raise ValueError("--secagg needs at least 3 clients per round")
    sampled = min(config.rounds.planned_cohort, config.scenario.num_clients)
    k = config.secagg.neighbors_for(sampled)
    if config.secagg.threshold_for(k) > k:
        raise ValueError(f"--secagg-threshold {config.secagg.threshold}: a round of {sampled} sampled clients gives "
                         f"each client {k} neighbours (secagg.neighbors, capped at n - 1), fewer than the threshold, "
                         f"so every round would be skipped: use a threshold of at most {k}")


def check_distributed_privacy(config) -> None:
    """Distributed DP runs under SecAgg+ (whose checks cover the method, the aggregator and late updates) with a
    fixed clip norm, and its ring must hold the clipped sum plus the noise."""
    from fcl_emu.secagg.noise import DistributedNoise

    if importlib.util.find_spec("dp_accounting") is None:
        raise ValueError("--privacy distributed needs Google's dp-accounting library for its privacy "
                         "accountant: pip install 'fcl-emu[dp]'")
    if not config.secagg.enabled:
        raise ValueError("--privacy distributed adds the noise under SecAgg+ masks: it needs --secagg (without "
                         "it, use --privacy central)")
    if config.privacy.adaptive.enabled:
        raise ValueError("--privacy distributed clips to a fixed norm (--dp-clip): adaptive clipping needs the "
                         "count of unclipped updates, which the server cannot see under SecAgg+")
    rounds = config.rounds
    sampled = rounds.planned_cohort
    noise = DistributedNoise(config.privacy.noise_multiplier, rounds.clients_per_round)
    if not noise.fits(config.secagg.ring_bits, sampled, 1):
        raise ValueError(f"--privacy distributed: a {config.secagg.ring_bits}-bit ring cannot hold the clipped sum "
                         f"of {sampled} clients plus noise of multiplier {noise.multiplier:g} without wrapping "
                         f"around; raise secagg.ring_bits (at most 32) or lower the noise")
