"""Cost of the Prometheus metrics: time per update on the hot paths, and scrape time and size.

The registries are filled by :func:`simulate`, which drives the metrics API
the way a whole run of ``clients`` clients does (every message type in both
directions, every rejection reason, joins, rejoins, leaves, drops, every
round and task end, every training outcome on every node), so the scrape is
measured at its full size. ``--url`` also times scrapes of live endpoints
(for example a running ``fcl-emu up --metrics-port 9100``).
"""

from __future__ import annotations

import time
import timeit
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from fcl_emu.bench.report import emit
from fcl_emu.monitoring.metrics import (CLIENT_EVENTS, DROP_REASONS, MESSAGE_TYPES, REJECT_REASONS, ROUND_PHASES,
                                SECAGG_OUTCOMES, SECAGG_PHASES, CoordinatorMetrics,
                                EdgeNodeMetrics)


@dataclass
class _FakeClient:
    status: str = "active"


PROFILES = ("flagship", "midrange", "budget")


def simulate(clients: int = 300, nodes: int = 2, tasks: int = 5, rounds_per_task: int = 10,
             per_round: int = 30) -> tuple[CoordinatorMetrics, list[EdgeNodeMetrics]]:
    """Registries as a run of ``clients`` clients leaves them (each with its own CollectorRegistry)."""
    coordinator = CoordinatorMetrics()
    edge = [EdgeNodeMetrics() for _ in range(nodes)]
    hosted = [[_FakeClient() for _ in range(n, clients, nodes)] for n in range(nodes)]
    for node, its_clients in zip(edge, hosted):
        node.watch(its_clients, lambda: 0)
    online = {"n": 0}
    coordinator.watch_online(lambda: online["n"])
    coordinator.run_started(run_id="bench", method="fedavg", dataset="mnist", model="cnn", seed=0,
                            num_clients=clients, num_tasks=tasks, rounds_per_task=rounds_per_task,
                            clients_per_round=per_round)
    for c in range(clients):
        node = edge[c % nodes]
        node.count_message("join", "sent", 60)
        coordinator.count_message("join", "received", 60)
        coordinator.handled("join", 1e-4)
        coordinator.client_joined()
        online["n"] += 1
        coordinator.count_message("welcome", "sent", 900)
        node.count_message("welcome", "received", 900)
        for _ in range(3):
            node.count_message("heartbeat", "sent", 40)
            coordinator.count_message("heartbeat", "received", 40)
            coordinator.handled("heartbeat", 2e-5)
    matrix: list[list[float | None]] = []
    number = 0
    for task in range(tasks):
        for task_round in range(rounds_per_task):
            number += 1
            coordinator.round_started(task, task_round, number)
            for k in range(per_round):
                node = edge[k % nodes]
                for msg_type, nbytes in (("task_start", 1_100_000), ("train_request", 1_100_000)):
                    coordinator.count_message(msg_type, "sent", nbytes)
                    node.count_message(msg_type, "received", nbytes)
                node.trained(1.5, "ok", 40)
                profile = PROFILES[k % len(PROFILES)]  # a run with three device profiles
                node.link_delay("down", profile, 0.2)
                node.link_delay("up", profile, 0.4)
                node.count_message("update", "sent", 1_100_000)
                coordinator.count_message("update", "received", 1_100_000)
                coordinator.handled("update", 3e-3)
                for kind, joules in (("compute", 3.0), ("radio", 18.0)):  # the default device mix's classes
                    coordinator.energy(("phone-high", "phone-mid", "phone-low")[k % 3], kind, joules)
                coordinator.battery_level(0.6)
            coordinator.round_closed(duration_s=3.0, phases_s={p: 0.1 for p in ROUND_PHASES}, selected=per_round,
                                     participants=per_round - 1, missed_deadline=1, failed=0, skipped=False,
                                     mean_loss=0.5, accuracy_seen_percent=90.0)
        matrix.append([90.0] * (task + 1) + [None] * (tasks - task - 1))
        coordinator.task_ended(task=task, matrix=matrix, accuracy_seen_percent=90.0, average_accuracy=90.0,
                               average_incremental_accuracy=90.0, average_forgetting=1.0,
                               phases_s={"end_task": 0.1, "evaluate": 1.0})
    for process in [coordinator, *edge]:  # every reason, every remaining message type
        for reason in REJECT_REASONS:
            process.rejected(reason)
        for phase in SECAGG_PHASES:  # a run with --secagg
            process.secagg_phase(phase, 0.01)
        for msg_type in MESSAGE_TYPES:
            for direction in ("sent", "received"):
                process.count_message(msg_type, direction, 10)
    for node in edge:
        node.trained(0.01, "no_data")
        node.trained(0.01, "failed")
        node.trained(0.0, "cancelled")
        for event in CLIENT_EVENTS:
            node.client_event(event)
    coordinator.handled("rejected", 1e-5)
    for outcome in SECAGG_OUTCOMES:
        coordinator.secagg_round(outcome=outcome, dropouts={p: 1 for p in SECAGG_PHASES}, recovered=1)
    coordinator.watch_gpu_pool(lambda: 0, lambda: {"idle": 1})
    for ok in (True, False):  # the pool's device check (each method's job kinds add as many series)
        coordinator.gpu_job("device.matmul", ok=ok, run_s=0.2, queue_s=0.01, peak_memory_bytes=1e6)
    coordinator.client_left()
    for reason in DROP_REASONS:
        coordinator.client_dropped(reason)
    coordinator.client_joined(rejoin=True)
    coordinator.late_update()
    return coordinator, edge


def series_count(*processes) -> int:
    return sum(len(p.series()) for p in processes)


def _per_call_us(stmt, number: int) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=5)) / number * 1e6


def _scrape(url: str, times: int = 20) -> tuple[float, int]:
    best, size = float("inf"), 0
    for _ in range(times):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as response:
            size = len(response.read())
        best = min(best, time.perf_counter() - started)
    return best * 1e3, size


def run(clients: int, urls: list[str], json_path: Path | None, console: Console) -> dict:
    coordinator, edge = simulate(clients)
    node = edge[0]
    rows = [
        {"operation": "count_message (wire bytes + messages, cached children)",
         "us_per_call": _per_call_us(lambda: coordinator.count_message("heartbeat", "received", 40), 100_000)},
        {"operation": "handled (coordinator handling time)",
         "us_per_call": _per_call_us(lambda: coordinator.handled("heartbeat", 2e-5), 100_000)},
        {"operation": "rejected", "us_per_call": _per_call_us(lambda: coordinator.rejected("bad_header"), 100_000)},
        {"operation": "trained (histogram + counters)",
         "us_per_call": _per_call_us(lambda: node.trained(1.5, "ok", 40), 100_000)},
        {"operation": "round_closed (once per round)", "us_per_call": _per_call_us(
            lambda: coordinator.round_closed(duration_s=3.0, phases_s={p: 0.1 for p in ROUND_PHASES}, selected=30,
                                             participants=29, missed_deadline=1, failed=0, skipped=False,
                                             mean_loss=0.5, accuracy_seen_percent=None), 10_000)},
    ]
    for name, process in (("coordinator", coordinator), ("edge node", node)):
        rows.append({"operation": f"render the {name}'s exposition (generate_latest)",
                     "us_per_call": _per_call_us(process.exposition, 200)})
        port = process.serve(0)
        try:
            ms, size = _scrape(f"http://127.0.0.1:{port}/metrics")
        finally:
            process.close()
        rows.append({"operation": f"HTTP scrape of the {name}'s /metrics ({len(process.series())} series, {size} bytes)",
                     "us_per_call": ms * 1e3})
    for url in urls:
        ms, size = _scrape(url)
        rows.append({"operation": f"scrape {url} ({size} bytes)", "us_per_call": ms * 1e3})
    extra = {"clients": clients, "series_total": series_count(coordinator, *edge),
             "series": {"coordinator": len(coordinator.series()), "edge_node": len(node.series())}}
    return emit("metrics", rows, extra, json_path, console)
