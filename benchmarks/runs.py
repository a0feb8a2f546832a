"""One real ``fcl-emu up`` per table row, shared by the experiment tables of this folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml


def run_up(name: str, config: dict, data_root: str, out: Path) -> dict:
    """Run ``config`` into ``out/<name>`` (coordinator, edge-node processes and GPU workers over ZeroMQ) and
    return its summary; a directory that already holds a ``summary.json`` is read, not run again."""
    run_dir = out / name
    summary = run_dir / "summary.json"
    if not summary.exists():
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [sys.executable, "-m", "fcl_emu", "up", "--config", str(path), "--data-root", data_root,
               "--run-dir", str(run_dir)]
        print("$", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    return json.loads(summary.read_text())
