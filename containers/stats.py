"""Edge-node container counters in the coordinator's Prometheus /metrics, read from the Docker API (no agent).

A thread samples every container of the run once per interval (the engine's one-shot stats: no second sample
to wait for) and the collector serves the latest sample at each scrape, labelled by edge node and device class:

- ``fcl_container_cpu_seconds_total``: CPU time the container's processes used;
- ``fcl_container_memory_bytes`` and ``fcl_container_memory_limit_bytes``: usage now (page cache excluded, as
  ``docker stats`` shows it) and the limit (the host's memory where none is set);
- ``fcl_container_network_{receive,transmit}_bytes_total``: bytes on its network interfaces;
- ``fcl_container_cpu_throttled_seconds_total``: time its CPU limit held it back (cgroup CFS throttling).

Containers on other hosts (a swarm) are not visible to this engine and are not sampled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("fcl_emu.containers")


def sample(stats: dict) -> dict[str, float]:
    """The numbers of one engine stats reply (cgroup v1 or v2)."""
    cpu = stats.get("cpu_stats", {})
    memory = stats.get("memory_stats", {})
    details = memory.get("stats", {})
    cache = details.get("inactive_file", details.get("total_inactive_file", details.get("cache", 0)))
    networks = (stats.get("networks") or {}).values()
    return {
        "cpu_s": cpu.get("cpu_usage", {}).get("total_usage", 0) / 1e9,
        "throttled_s": cpu.get("throttling_data", {}).get("throttled_time", 0) / 1e9,
        "memory": max(0, memory.get("usage", 0) - cache),
        "memory_limit": memory.get("limit", 0),
        "rx": sum(n.get("rx_bytes", 0) for n in networks),
        "tx": sum(n.get("tx_bytes", 0) for n in networks),
    }


class ContainerStats:
    """Samples ``containers()`` (node name -> container) every ``interval_s``; a Prometheus collector."""

    def __init__(self, containers: Callable[[], dict[str, object]], classes: dict[str, str | None],
                 interval_s: float):
        self.containers, self.classes, self.interval_s = containers, classes, interval_s
        self.latest: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="container-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for name, container in self.containers().items():
                try:
                    self.latest[name] = sample(container.stats(stream=False, one_shot=True))
                except Exception as exc:  # a container that is gone keeps its last sample
                    log.debug("stats of %s: %s", name, exc)
            if self._stop.wait(self.interval_s):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def collect(self):
        labels = ["node", "device_class"]
        families = {
            "cpu_s": CounterMetricFamily("fcl_container_cpu_seconds", "CPU time used by an edge-node container.",
                                         labels=labels),
            "throttled_s": CounterMetricFamily("fcl_container_cpu_throttled_seconds", "Time an edge-node "
                                               "container was held back by its CPU limit.", labels=labels),
            "memory": GaugeMetricFamily("fcl_container_memory_bytes", "Memory used by an edge-node container "
                                        "(page cache excluded).", labels=labels),
            "memory_limit": GaugeMetricFamily("fcl_container_memory_limit_bytes", "Memory limit of an edge-node "
                                              "container (the host's memory when it has none).", labels=labels),
            "rx": CounterMetricFamily("fcl_container_network_receive_bytes", "Bytes an edge-node container "
                                      "received.", labels=labels),
            "tx": CounterMetricFamily("fcl_container_network_transmit_bytes", "Bytes an edge-node container "
                                      "sent.", labels=labels),
        }
        for name, values in sorted(self.latest.items()):
            for key, family in families.items():
                family.add_metric([name, self.classes.get(name) or ""], values[key])
        yield from families.values()
