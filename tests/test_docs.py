"""The user docs name only metrics that exist, speak to users rather than to the team, link only to what exists,
and stay pages a user can read."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from fcl_emu.containers.stats import ContainerStats
from fcl_emu.monitoring.metrics import CoordinatorMetrics, EdgeNodeMetrics, GpuWorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
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


def rel(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


def test_every_metric_the_docs_name_exists():
    names = exported_names()
    unknown = []
    for doc in DOCS:
        for token in set(METRIC.findall(doc.read_text())):
            if token.endswith(("*", "_")):  # a family written as a prefix: fcl_gpu_*
                if not any(n.startswith(token.rstrip("*")) for n in names):
                    unknown.append(f"{rel(doc)}: {token}")
            elif token not in names and token != "fcl_emu" and not STACK_SERVICE.match(token):
                unknown.append(f"{rel(doc)}: {token}")
    assert not unknown, f"the docs name metrics no process exports: {sorted(unknown)}"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_docs_speak_to_users(doc):
    lines = [f"{rel(doc)}:{i}: {line.strip()}" for i, line in enumerate(doc.read_text().splitlines(), 1)
             if TEAM_JARGON.search(line)]
    assert not lines, "\n".join(lines)


# A Markdown link or image, [text](target) or ![alt](target), outside code; a path to a page, anywhere in the text.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
PAGE_PATH = re.compile(r"\bdocs/[A-Za-z0-9_./-]*\.md\b")


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``doc``: lower case, punctuation dropped, spaces as hyphens, and
    ``-1``, ``-2`` ... after a repeated one."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", doc.read_text(), flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_link_between_pages_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(CODE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{rel(doc)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{rel(doc)}: {target} (no heading #{anchor} in {rel(dest)})")
    assert not broken, "\n".join(broken)


def test_every_page_path_the_docs_mention_exists():
    missing = [f"{rel(doc)}: {path}" for doc in DOCS for path in sorted(set(PAGE_PATH.findall(doc.read_text())))
               if not (ROOT / path).is_file()]
    assert not missing, "\n".join(missing)


def test_every_page_is_short_and_listed_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    long = [f"{rel(doc)}: {len(doc.read_text().splitlines())} lines" for doc in DOCS
            if len(doc.read_text().splitlines()) > 420]
    assert not long, f"pages of more than about 400 lines: split them by purpose: {long}"
    unlisted = [rel(doc) for doc in DOCS if doc.parent != ROOT and doc.name != "README.md"
                and f"({doc.relative_to(ROOT / 'docs').as_posix()})" not in index]
    assert not unlisted, f"pages docs/README.md does not list: {unlisted}"
