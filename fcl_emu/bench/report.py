"""Shared output of the benchmarks: a rich table on the console and an optional JSON file."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import os

from rich.console import Console
from rich.table import Table


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}


def cell(value: Any) -> str:
    """A value as the tables print it: floats to 3 places, ``-`` for no value."""
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _width(text: str, values: Sequence[str]) -> int:
    """The narrowest a column can be with ``text`` as its header, broken only between words, and ``values`` whole."""
    return max([len(word) for word in text.split()] + [len(v) for v in values])


def _fits(widths: Sequence[int], width: int) -> bool:
    return sum(widths) + 3 * len(widths) + 1 <= width  # each column's padding and border, the closing border


def tables(title: str, rows: list[dict[str, Any]], width: int) -> list[Table]:
    """``rows`` as one table, a column per key, where that fits ``width`` with whole words in the headers and whole
    cells; else turned over (a line per key, a column per row, headed by the row's first value), as many rows a
    table as fit."""
    keys = list(rows[0])
    cells = [[cell(row[k]) for k in keys] for row in rows]
    widths = [_width(k, [c[i] for c in cells]) for i, k in enumerate(keys)]
    if _fits(widths, width):
        table = Table(title=title)
        for key, w in zip(keys, widths):
            table.add_column(key, justify="right", min_width=w)
        for c in cells:
            table.add_row(*c)
        return [table]
    key_width = _width(" ".join(keys), [])
    groups: list[list[list[str]]] = [[]]
    for c in cells:
        if groups[-1] and not _fits([key_width, *(_width(g[0], g[1:]) for g in groups[-1] + [c])], width):
            groups.append([])
        groups[-1].append(c)
    out = []
    for n, group in enumerate(groups):
        part = f" ({n + 1} of {len(groups)})" if len(groups) > 1 else ""
        table = Table(title=title + part)
        table.add_column(keys[0], min_width=key_width)
        for c in group:
            table.add_column(c[0], justify="right", min_width=_width(c[0], c[1:]), no_wrap=True)
        for i, key in enumerate(keys[1:], start=1):
            table.add_row(key, *(c[i] for c in group))
        out.append(table)
    return out


def emit(name: str, rows: list[dict[str, Any]], extra: dict[str, Any], json_path: Path | None,
         console: Console, notes: Sequence[str] = ()) -> dict[str, Any]:
    """Print the rows (:func:`tables`), ``notes`` under them (what a ``-`` means, say), then ``extra``; write all
    but the notes to ``json_path`` if given."""
    for table in tables(f"bench {name}", rows, console.width):
        console.print(table)
    for note in notes:
        console.print(note, markup=False, highlight=False)
    for key, value in extra.items():
        console.print(f"{key}: {value}")
    result = {"benchmark": name, "machine": machine(), "rows": rows, **extra}
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {json_path}")
    return result
