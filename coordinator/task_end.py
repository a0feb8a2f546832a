"""A task's end: the method's task-end work (often a GPU-worker job: generator training, proxy inversion, VAE fusion),
then the evaluation of the model on the seen classes, the accuracy matrix's row, its event and metrics."""

from __future__ import annotations

import time

from fcl_emu.coordinator.state import RunState, TimeAccount
from fcl_emu.monitoring.results import average_accuracy, average_forgetting, average_incremental_accuracy


def end_task(state: RunState, time_account: TimeAccount, task: int, matrix: list[list[float | None]]):
    """The method's task-end work, then the accuracy row (appended to ``matrix``), its event and metrics.
    Returns the evaluation's (correct, samples) per seen class."""
    spent = time_account.spent
    t0 = time.perf_counter()
    with spent("task_end"):
        state.server.end_task(task)
    t_end_task = time.perf_counter() - t0
    with spent("task_evaluation"):
        class_hits = state.evaluator.class_hits(state.server.eval_model(), task)
        row = state.evaluator.accuracy_per_task(*class_hits, task)
        state.client_accuracy.append(state.evaluator.client_accuracy(*class_hits, task))
    t_evaluate = time.perf_counter() - t0 - t_end_task
    matrix.append(row + [None] * (state.scenario.num_tasks - task - 1))
    seen = state.seen_accuracy(row, task)
    state.event("task_end", task=task, accuracy=row, accuracy_seen=seen,
                accuracy_clients=state.client_accuracy[-1])
    state.metrics.task_ended(
        task=task, matrix=matrix, accuracy_seen_percent=seen,
        average_accuracy=average_accuracy(matrix), average_forgetting=average_forgetting(matrix),
        average_incremental_accuracy=average_incremental_accuracy(matrix),
        phases_s={"end_task": t_end_task, "evaluate": t_evaluate})
    state.progress("task_end", {"task": task, "accuracy": row, "accuracy_seen": seen})
    return class_hits
