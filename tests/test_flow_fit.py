"""The flow-fit diagnostic on features narrower than the prior: the code's raw flow cannot go below the prior's
floor, the standardised one can and its samples keep their class."""

from __future__ import annotations

import pytest
import torch

from experiments import flow_fit
from fcl_emu.methods.affcl import AFFCLOptions


def _narrow(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    means = torch.tensor([[0.05, 0.0, 0.0, 0.02], [0.0, 0.05, 0.02, 0.0]])
    return means[y] + 0.01 * torch.randn(n, 4, generator=gen), y


@pytest.mark.parametrize("form", ["raw", "standardized"])
def test_fit_reports_the_floor_of_the_raw_flow_and_the_standardised_fit(one_torch_thread, form):
    options = AFFCLOptions(flow_layers=2, flow_hidden=16, flow_blocks=1, flow_input=form)
    (report,) = flow_fit.fit(_narrow(600, 0), _narrow(200, 1), 2, options, steps=[300], lr=1e-2)
    assert report["step"] == 300 and report["flow_input"] == form
    if form == "raw":  # a density no higher than the prior's: at or above its floor, samples far wider
        assert report["nll_per_dim"] > flow_fit.PRIOR_FLOOR - 0.05
        assert report["sample_norm"] > 10 * report["feature_norm"]
    else:  # spread 0.01: a log-density about -log(0.01) - 1.42 = 3.2 nats a dimension above the floor's
        assert report["nll_per_dim"] < -2.0
        assert report["sample_agreement"] > 0.9


def test_nearest_class_mean_rule_and_report_table():
    h, y = torch.tensor([[0.0, 0.0], [0.0, 0.2], [1.0, 1.0], [1.0, 1.2]]), torch.tensor([0, 0, 1, 1])
    rule = flow_fit.nearest_class_mean(h, y, 2)
    assert rule(torch.tensor([[0.1, 0.1], [0.9, 1.0]])).tolist() == [0, 1]
    text = flow_fit.markdown([{"flow_input": "raw", "step": 5, "nll": 470.4, "nll_per_dim": 0.919,
                               "sample_norm": 25.0, "feature_norm": 8.1, "sample_max": 22.1,
                               "sample_agreement": 0.1}], 0.79)
    assert "| raw | 5 | 470 | 0.919 | 25.0 / 8.1 | 22.1 | 0.10 |" in text and "0.79" in text


def test_own_flow_table_gives_one_row_per_task():
    text = flow_fit.own_flow_markdown([{"task": 1, "classes": [0, 1], "nll_per_dim": -2.271, "real_accuracy": 0.0,
                                        "sample_agreement": 0.004},
                                       {"task": 2, "classes": [2, 3], "nll_per_dim": float("inf"),
                                        "real_accuracy": 0.99, "sample_agreement": 0.57}])
    assert "| 1 | 0, 1 | -2.27 | 0.00 | 0.00 |" in text and "| 2 | 2, 3 | inf | 0.99 | 0.57 |" in text


def test_a_run_of_another_method_is_refused_before_any_data_is_read(tmp_path):
    (tmp_path / "config.yaml").write_text("method: glfc\nscenario: {dataset: mnist}\n")
    for read in (flow_fit.own_flow, flow_fit.run_features):
        with pytest.raises(ValueError, match="is a run of glfc, not of affcl"):
            read(tmp_path, str(tmp_path / "no-data"), 10)
