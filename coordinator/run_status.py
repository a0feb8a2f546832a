"""A run's status from its rounds: ``completed``, ``degraded`` or ``failed`` (:func:`trained_status`), the stop after
a DP round whose model diverged (:func:`stop_if_diverged`), and chance on the seen classes that an accuracy fallen to
it is judged against (:func:`chance`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fcl_emu.coordinator.contracts import Diverged
from fcl_emu.coordinator.round_record import divergence
from fcl_emu.monitoring.results import RoundRecord
from fcl_emu.runconfig.config import PrivacyConfig
from fcl_emu.scenario.scenario import Scenario


def trained_status(rounds: list[RoundRecord], task_end_accuracy: Sequence[float] = (),
                   chance: Sequence[float] = ()) -> str:
    """A finished run's status: ``completed`` only if every task trained and the model did not diverge; a model
    that diverged (:func:`~fcl_emu.coordinator.round_record.divergence`, with the accuracy on the seen classes at
    each task's end and chance on them) or a task whose every round was skipped (no client update, or fewer than
    ``min_participants``) makes it ``degraded``, and no trained round at all ``failed``."""
    if rounds and all(r.skipped for r in rounds):
        return "failed: every round was skipped (no usable client update arrived)"
    diverged = divergence(rounds, task_end_accuracy, chance)
    if diverged is not None:
        return f"degraded: diverged at round {diverged[0]} ({diverged[1]})"
    tasks = sorted({r.task for r in rounds})
    idle = [t for t in tasks if all(r.skipped for r in rounds if r.task == t)]
    if idle:
        return (f"degraded: task{'s' * (len(idle) > 1)} {', '.join(map(str, idle))} trained nothing (every round "
                f"was skipped: no usable client update arrived)")
    return "completed"


def stop_if_diverged(record: RoundRecord, privacy: PrivacyConfig) -> None:
    """Raise :class:`Diverged` after a round of a DP run whose model diverged (:attr:`RoundRecord.diverged`: NaN or
    infinite values, or an exploded training loss, from which the model does not come back), unless
    ``privacy.on_divergence`` is ``continue``. An accuracy fallen to chance is judged at the run's end
    (:func:`trained_status`): it may recover."""
    if record.diverged is not None and privacy.mode != "off" and privacy.on_divergence == "stop":
        raise Diverged(f"diverged at round {record.round} ({record.diverged})")


def chance(scenario: Scenario) -> list[float]:
    """Chance on the seen classes after each task (percent): always answering the seen class with the most test
    samples."""
    labels = scenario.test_labels
    out = []
    for task in range(scenario.num_tasks):
        counts = np.bincount(labels[scenario.test_indices(scenario.seen_classes(task))])
        out.append(100.0 * counts.max() / counts.sum() if counts.size else 0.0)
    return out
