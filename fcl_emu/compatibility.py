"""What ``fcl-emu compatibility`` prints and docs/compatibility.md holds: the matrix of what combines with what,
every cell read from the compatibility table (:mod:`fcl_emu.runconfig.compatibility`).

Rows are the methods, then the features themselves (each under fedavg); columns are the round policies, central and
distributed privacy, SecAgg+, edge aggregators, the launcher backends and the robust rules. A cell is the row's and
the column's settings together on the default run: ``yes``, ``no (N)`` with note N the error it gets (the first
refusal of the table that holds), ``ignored (N)`` where one of them does nothing there, or ``-`` where both set the
same setting. Below the matrix: every refusal of the table with its error for its example, and every setting
ignored without another.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from fcl_emu.aggregation.rules import RULE_NAMES
from fcl_emu.methods import registry
from fcl_emu.options import FLAG_OF
from fcl_emu.runconfig import RunConfig
from fcl_emu.runconfig.compatibility import REFUSED, Refusal, example_data, refused
from fcl_emu.runconfig.ignored import DEPENDENT

DOC_PAGE = "docs/compatibility.md"
BLOCK = "compatibility"  # the page's block: <!-- table: compatibility --> ... <!-- /table: compatibility -->
COMMAND = f"fcl-emu compatibility --page {DOC_PAGE}"


@dataclass(frozen=True)
class Feature:
    """A column of the matrix: its ``label``, the ``flags`` that give it and their config ``data``."""

    label: str
    flags: str
    data: dict[str, Any]


FEATURES: tuple[Feature, ...] = (
    Feature("sync", "--aggregation sync", {"aggregation": {"policy": "sync"}}),
    Feature("fedbuff", "--aggregation fedbuff", {"aggregation": {"policy": "fedbuff"}}),
    Feature("fedasync", "--aggregation fedasync", {"aggregation": {"policy": "fedasync"}}),
    Feature("central DP", "--privacy central", {"privacy": {"mode": "central"}}),
    Feature("distributed DP", "--secagg --privacy distributed",
            {"secagg": {"enabled": True}, "privacy": {"mode": "distributed"}}),
    Feature("secagg", "--secagg", {"secagg": {"enabled": True}}),
    Feature("edge aggregators", "--edge-aggregators 2", {"topology": {"edge_aggregators": 2}}),
    # every server optimiser is refused alike (runconfig/compatibility.py): fedadam stands for them
    Feature("server optimiser", "--server-optimizer fedadam", {"aggregation": {"server_optimizer": "fedadam"}}),
    Feature("process", "--backend process", {"containers": {"backend": "process"}}),
    Feature("docker", "--backend docker", {"containers": {"backend": "docker"}}),
    Feature("swarm", "--backend swarm", {"containers": {"backend": "swarm"}}),
    *(Feature(rule, f"--aggregator {rule}", {"aggregation": {"rule": rule}}) for rule in RULE_NAMES
      if rule != "mean"),
)
DEFAULTS = ("sync", "process")  # the run's own: no row of their own (the fedavg row is theirs)


def _flat(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Nested config data as {path: value}."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in data.items():
        out.update(_flat(value, (*prefix, key)) if isinstance(value, dict) else {(*prefix, key): value})
    return out


def _nested(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _flag(path: tuple[str, ...]) -> str:
    return FLAG_OF.get(path, ".".join(path))


@dataclass
class Matrix:
    """The rendered cells: ``columns``' labels, ``rows`` (label, cells), and ``notes`` (each cell's note, by number
    from 1)."""

    columns: list[str]
    rows: list[tuple[str, list[str]]]
    notes: list[str]


def cell(data: dict[str, Any], notes: list[str]) -> str:
    """The matrix's cell for the run of config ``data``; its note (if any) is appended to ``notes`` once."""
    config = RunConfig.model_validate(data, context={"combinations": False})
    spec = registry.get(config.method)
    hits = refused(config, spec)
    given = _flat(data)
    idle = [row for row in DEPENDENT if row.path in given and not row.applies(config)]
    if not hits and not idle:
        return "yes"
    note = hits[0].reason(config, spec) if hits else f"{_flag(idle[0].path)}: {idle[0].reason}"
    if note not in notes:
        notes.append(note)
    return f"{'no' if hits else 'ignored'} ({notes.index(note) + 1})"


def cases() -> list[tuple[str, list[dict[str, Any] | None]]]:
    """The matrix's rows: each label with the config data of its cells, one per feature (None where the row and
    the feature set the same setting)."""
    rows = [(name, {"method": name}) for name in registry.names()]
    rows += [(feature.flags, feature.data) for feature in FEATURES if feature.label not in DEFAULTS]
    out = []
    for label, data in rows:
        mine, cells = _flat(data), []
        for feature in FEATURES:
            theirs = _flat(feature.data)
            clash = any(path in mine and mine[path] != value for path, value in theirs.items())
            cells.append(None if clash else _nested({**mine, **theirs}))
        out.append((label, cells))
    return out


def matrix() -> Matrix:
    """Every method and feature (rows) against every feature (columns), each cell from the table."""
    notes: list[str] = []
    rows = [(label, ["-" if data is None else cell(data, notes) for data in cells]) for label, cells in cases()]
    return Matrix([feature.label for feature in FEATURES], rows, notes)


def example_config(entry: Refusal, folder: Path) -> RunConfig:
    """The config of ``entry``'s example (its files written into ``folder``), each setting validated and the
    combinations left to the caller."""
    return RunConfig.model_validate(example_data(entry, folder), context={"combinations": False})


def _md(text: str) -> str:
    """``text`` as Markdown shows it: ``|`` kept out of the table's cells, ``<class>`` and ``*`` taken literally."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def matrix_markdown() -> str:
    """The docs page's block: the matrix, its notes, the columns' flags, every refusal and every ignored setting."""
    found = matrix()
    lines = ["| | " + " | ".join(found.columns) + " |", "| --- |" + " --- |" * len(found.columns)]
    lines += [f"| `{label}` | " + " | ".join(cells) + " |" for label, cells in found.rows]
    lines += ["", "Notes (the error each such run gets):", ""]
    lines += [f"{i}. {_md(note)}" for i, note in enumerate(found.notes, 1)]
    lines += ["", "Columns: " + "; ".join(f"{f.label} `{f.flags}`" for f in FEATURES) + ".", "",
              "### Every refusal", "", "| settings | the error (for an example run) |", "| --- | --- |"]
    for entry in REFUSED:
        with tempfile.TemporaryDirectory() as folder:
            config = example_config(entry, Path(folder))
            why = entry.reason(config, registry.get(config.method))
        lines.append(f"| {' '.join(f'`{s}`' for s in entry.settings)} | {_md(why)} |")
    lines += ["", "### Settings ignored without another", "", "| setting | needs | what for |", "| --- | --- | --- |"]
    lines += [f"| `{_flag(row.path)}` | {_md(row.needs)} | {_md(row.why)} |" for row in DEPENDENT]
    return "\n".join(lines) + "\n"


def matrix_table() -> tuple[Table, list[str]]:
    """The matrix as a rich table, and its notes numbered."""
    found = matrix()
    table = Table("", *found.columns, title="what combines with what (docs/compatibility.md)", show_lines=False)
    for label, cells in found.rows:
        table.add_row(label, *cells)
    return table, [f"{i}. {note}" for i, note in enumerate(found.notes, 1)]
