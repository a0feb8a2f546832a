"""A finished run's final model read back from its run directory (``fcl_emu.run_model``): the model of its
config holding the checkpoint's server arrays, and a run of another method refused before anything is read."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import yaml

from fcl_emu.coordinator import checkpoint
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.state import state_to_arrays
from fcl_emu.run_model import final_model, server_state
from fcl_emu.scenario.datasets import DATA_ROOT_ENV


def test_the_final_model_holds_the_checkpoint_s_server_arrays(tmp_path):
    data_root = os.environ.get(DATA_ROOT_ENV, "").split(os.pathsep)[0]
    if not data_root:
        pytest.skip(f"no data root ({DATA_ROOT_ENV})")
    torch.manual_seed(3)
    model = build_model("cnn", (1, 28, 28), 4)
    arrays = state_to_arrays(model)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"method": "fedavg", "model": "cnn",
                                                          "scenario": {"dataset": "mnist"}}))
    extra = {"server/memory/x": np.zeros((2, 3), np.float32)}
    checkpoint.save(tmp_path / "checkpoint", {}, {**{f"server/{k}": v for k, v in arrays.items()}, **extra,
                                                  "client/0/x": np.ones(1, np.float32)})
    assert set(server_state(tmp_path)) == set(arrays) | {"memory/x"}
    config, ds, read, state = final_model(tmp_path, data_root)
    assert config["method"] == "fedavg" and ds.input_shape == (1, 28, 28) and not read.training
    for k, v in state_to_arrays(read).items():
        np.testing.assert_array_equal(v, arrays[k], err_msg=k)
    assert "memory/x" in state


def test_a_run_of_another_method_is_refused_first(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"method": "fedavg"}))
    with pytest.raises(ValueError, match="is a run of fedavg, not of affcl"):
        final_model(tmp_path, "/nonexistent", "affcl")
