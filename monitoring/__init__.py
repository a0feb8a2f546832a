"""Prometheus metrics, Prometheus and Grafana configuration, run reports and plots.

Scope (not built yet; see the observability issue). Until then the run
directory's ``events.jsonl`` and ``summary.json`` carry the measurements.
"""
