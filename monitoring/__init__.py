"""Prometheus metrics, Prometheus and Grafana configuration, run reports and plots.

- ``metrics``: every Prometheus metric of the coordinator and the edge nodes;
- ``stack``: a run's ``prometheus_targets.json`` and a local Prometheus server;
- ``prometheus/``, ``grafana/``, ``docker-compose.yml``: the monitoring stack
  (docs/monitoring.md).
"""
