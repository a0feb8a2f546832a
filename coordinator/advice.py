"""Start-up advice: what the coordinator tells once, at a session's start, before the clients are waited for
(:func:`tell_advice`): each setting that another setting changes (:mod:`fcl_emu.runconfig.adjustments`), device
classes that cannot make the round deadline (:func:`slow_classes`) and differential privacy whose noise outweighs the
clipped mean (:func:`noisy_privacy`). Each is a ``config_warning`` event and a ``warning`` for the progress display;
none changes a setting or refuses a run."""

from __future__ import annotations

from fcl_emu.aggregation.update import DeltaLayout
from fcl_emu.coordinator.privacy import cohort_for_noise, noise_to_update, round_noise_multiplier
from fcl_emu.coordinator.state import RunState
from fcl_emu.runconfig import RunConfig
from fcl_emu.runconfig.adjustments import Adjustment, adjustments


def tell_advice(state: RunState, privacy) -> None:
    """Tell each piece of advice for the run of ``state`` (``privacy``: its DP part, or None)."""
    config = state.config
    for adjusted in [*adjustments(config), *slow_classes(config, state), *noisy_privacy(config, state, privacy)]:
        state.event("config_warning", setting=adjusted.setting, value=adjusted.value, message=adjusted.message)
        state.progress("warning", {"setting": adjusted.setting, "message": adjusted.message})


def noisy_privacy(config: RunConfig, state: RunState, privacy) -> list[Adjustment]:
    """Differential privacy whose noise on a round's mean is larger than the clipped mean can be
    (:func:`~fcl_emu.coordinator.privacy.noise_to_update`), with the cohort that would bring it under, for the
    run's largest model: its head over every class, in the last task. Told as an adjustment is, though it
    changes no setting."""
    settings, cohort = config.privacy, config.rounds.clients_per_round
    if privacy is None or not settings.noise_multiplier:
        return []
    server, scenario = state.server, state.scenario
    new_classes = len(scenario.seen_classes(scenario.num_tasks - 1)) - server.model.num_classes
    dim = DeltaLayout.of(server.global_state).dim + new_classes * (server.model.feature_dim + 1)  # weights, bias
    ratio = noise_to_update(settings, cohort, dim)
    if ratio <= 1:
        return []
    sigma = round_noise_multiplier(settings, cohort) * settings.clip / cohort
    needed = cohort_for_noise(settings, dim)
    clients = config.scenario.num_clients
    clip = f"C, adapting from {settings.clip:g}" if settings.adaptive.enabled else f"C = {settings.clip:g}"
    bring = (f"{needed} clients a round would bring it under C" if needed <= clients else
             f"{needed} clients a round, more than the {clients} clients, would bring it under C")
    return [Adjustment("privacy.noise_multiplier", settings.noise_multiplier, (
        f"the DP noise on each round's mean ({sigma:.3g} on each of the model's {dim:,} values, a norm of about "
        f"{sigma * dim ** 0.5:.3g}) is {ratio:.1f} times the clipped mean's largest norm ({clip}): the "
        f"model learns only what the rounds average out, and may diverge; {bring} (--clients-per-round, "
        f"docs/privacy.md)"))]


def slow_classes(config: RunConfig, state: RunState) -> list[Adjustment]:
    """Device classes whose clients cannot make the round deadline even alone on their link: the model
    each way and the training of its share, in the task with the most work per sample (synchronous rounds
    on the emulated clock, modelled compute). Told as an adjustment is, though it changes no setting."""
    if state.devices is None or not config.emulated_clock or config.aggregation.asynchronous:
        return []
    model_bytes = sum(a.nbytes for a in state.server.global_state.values())
    tasks = range(state.scenario.num_tasks)
    slow: dict[str, int] = {}
    sample = range(min(config.scenario.num_clients, 500))
    for index in sample:
        profile = state.devices.assign(index, config.seed)
        samples = len(state.scenario.client_indices(index, state.scenario.join_task(index)))
        for task in tasks:
            p = state.devices.in_task(profile, task)
            if p.ms_per_sample is None:
                break
            need = (model_bytes / p.downlink_bytes_s + model_bytes / p.uplink_bytes_s + 2 * p.latency_s
                    + p.ms_per_sample * samples * config.training.local_epochs / 1000)
            if need > config.rounds.deadline_s:
                slow[p.name] = slow.get(p.name, 0) + 1
                break
    if not slow:
        return []
    share = 100 * sum(slow.values()) / len(sample)
    return [Adjustment("rounds.deadline_s", config.rounds.deadline_s, (
        f"{share:.0f} % of the clients ({', '.join(sorted(slow))}) need more than the "
        f"{config.rounds.deadline_s:g} s round deadline for a round's work ({model_bytes / 1e6:.1f} MB model "
        f"each way and their training, docs/devices.md): they will be late; --round-deadline sets it"))]
