"""A finished run's final global model, read back from its run directory (its ``config.yaml`` and last
checkpoint): what the experiment tables' analyses of a run's model start from."""

from __future__ import annotations

from pathlib import Path

import yaml

from fcl_emu.coordinator import checkpoint
from fcl_emu.coordinator.resume import CHECKPOINT_DIR
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.state import load_arrays
from fcl_emu.monitoring.run_dir import CONFIG
from fcl_emu.scenario.datasets import load_dataset


def server_state(run_dir: Path) -> dict:
    """Every array of the server's state in a finished run's last checkpoint, by its name under ``server/``."""
    prefix = "server/"
    return {k[len(prefix):]: v for k, v in checkpoint.load(Path(run_dir) / CHECKPOINT_DIR).arrays.items()
            if k.startswith(prefix)}


def final_model(run_dir: Path, data_root: str, method: str | None = None):
    """``(config, dataset, model, state)`` of a finished run: its ``config.yaml`` as a dict, its data set (from
    ``data_root``), its final global model in eval mode and the :func:`server_state` it was read from.
    ``ValueError`` if ``method`` is given and the run is of another (before anything else is read)."""
    run_dir = Path(run_dir)
    config = yaml.safe_load((run_dir / CONFIG).read_text())
    if method is not None and config.get("method") != method:
        raise ValueError(f"{run_dir} is a run of {config.get('method')}, not of {method}")
    ds = load_dataset(config["scenario"]["dataset"], [Path(data_root)])
    state = server_state(run_dir)
    arrays = {k: v for k, v in state.items() if "/" not in k}
    model = build_model(config["model"], ds.input_shape, int(arrays["head.weight"].shape[0]))
    load_arrays(model, arrays)
    return config, ds, model.eval(), state
