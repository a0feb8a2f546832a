"""Shared output of the benchmarks: a rich table on the console and an optional JSON file."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import os

from rich.console import Console
from rich.table import Table


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}


def emit(name: str, rows: list[dict[str, Any]], extra: dict[str, Any], json_path: Path | None,
         console: Console) -> dict[str, Any]:
    table = Table(title=f"bench {name}")
    for key in rows[0]:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()])
    console.print(table)
    for key, value in extra.items():
        console.print(f"{key}: {value}")
    result = {"benchmark": name, "machine": machine(), "rows": rows, **extra}
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {json_path}")
    return result
