"""The user docs name only metrics that exist, and speak to users rather than to the team."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from fcl_emu.containers.stats import ContainerStats
from fcl_emu.monitoring.metrics import CoordinatorMetrics, EdgeNodeMetrics, GpuWorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
METRIC = re.compile(r"\bfcl_[a-z0-9_]+\*?")
# A project's docs are read by its users: no notes from one working session to the next.
# Services of a Swarm stack deployed under the name `fcl` (fcl_coordinator, fcl_node-0): not metrics.
STACK_SERVICE = re.compile(r"fcl_(coordinator|prometheus|grafana|node)$")
TEAM_JARGON = re.compile(r"\bstop \d+\b|\bissues?\b|\bmeasured here\b", re.IGNORECASE)


def exported_names() -> set[str]:
    """Every series name an fcl-emu process or the container collector can export."""
    names: set[str] = set()
    cuda = SimpleNamespace(type="cuda")  # the CUDA-only gauge is defined, never read, here
    for metrics in (CoordinatorMetrics(), EdgeNodeMetrics(), GpuWorkerMetrics(cuda)):
        names.update(metrics.registry._names_to_collectors)
        families = [f for f in metrics.registry.collect() if f.name != "fcl_gpu_memory_allocated_bytes"]
        names.update(series_names(families))
    names.update(series_names(ContainerStats.collect(SimpleNamespace(latest={}, classes={}))))
    return names


def series_names(families) -> set[str]:
    names = set()
    for family in families:
        names.add(family.name + ("_total" if family.type == "counter" else ""))
        names.update(sample.name for sample in family.samples)
    return names


def test_every_metric_the_docs_name_exists():
    names = exported_names()
    unknown = []
    for doc in DOCS:
        for token in set(METRIC.findall(doc.read_text())):
            if token.endswith(("*", "_")):  # a family written as a prefix: fcl_gpu_*
                if not any(n.startswith(token.rstrip("*")) for n in names):
                    unknown.append(f"{doc.name}: {token}")
            elif token not in names and token != "fcl_emu" and not STACK_SERVICE.match(token):
                unknown.append(f"{doc.name}: {token}")
    assert not unknown, f"the docs name metrics no process exports: {sorted(unknown)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_speak_to_users(doc):
    lines = [f"{doc.name}:{i}: {line.strip()}" for i, line in enumerate(doc.read_text().splitlines(), 1)
             if TEAM_JARGON.search(line)]
    assert not lines, "\n".join(lines)
