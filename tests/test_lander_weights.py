"""LANDER's eq.-7 task weights by hand, in the official code's form (the default) and in the paper's, and the
option reaching the client's loss."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fcl_emu.methods import lander
from fcl_emu.methods.lander import TEXT_DIM, LanderClient, LanderOptions, _projector, task_weights
from fcl_emu.methods.models.classifier import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = (1, 28, 28)


def test_task_weights_code_and_paper_forms_by_hand():
    """LANDER's defaults cur = 0.2, pre = 0.4. Task 5 of 5 x 10: 40 old, 10 new, 50 seen.
    code: alpha = log2(50/2 + 1) = log2 26 = 4.70044, beta = sqrt(40/50) = 0.89443:
          w_cur = 0.2 (1 + 1/4.70044) / 0.89443 = 0.27118, w_pre = 0.4 * 4.70044 * 0.89443 = 1.68168.
    paper: alpha = log2(10/2 + 1) = log2 6 = 2.58496, beta = sqrt(40/10) = 2:
          w_cur = 0.2 (1 + 1/2.58496) / 2 = 0.13869, w_pre = 0.4 * 2.58496 * 2 = 2.06797.
    Task 10 of 10 x 20 (180 old, 20 new): code (0.24248, 2.52661), paper (0.08594, 4.15132)."""
    o = LanderOptions()
    assert (o.cur, o.pre, o.task_weights) == (0.2, 0.4, "code")
    assert task_weights(40, 50, o.cur, o.pre) == pytest.approx((0.27118, 1.68168), abs=1e-5)
    assert task_weights(40, 50, o.cur, o.pre, "code") == task_weights(40, 50, o.cur, o.pre)
    assert task_weights(40, 50, o.cur, o.pre, "paper") == pytest.approx((0.13869, 2.06797), abs=1e-5)
    assert task_weights(180, 200, o.cur, o.pre, "code") == pytest.approx((0.24248, 2.52661), abs=1e-5)
    assert task_weights(180, 200, o.cur, o.pre, "paper") == pytest.approx((0.08594, 4.15132), abs=1e-5)
    # the design notes' rounded figures
    assert task_weights(40, 50, 0.2, 0.4, "paper") == pytest.approx((0.139, 2.07), abs=5e-3)
    assert task_weights(40, 50, 0.2, 0.4, "code") == pytest.approx((0.271, 1.68), abs=5e-3)
    # half old, half new: 20 of 40 (code alpha log2 21, beta sqrt 1/2; paper alpha log2 11, beta 1)
    assert task_weights(20, 40, 0.2, 0.4, "paper") == pytest.approx(
        (0.2 * (1 + 1 / math.log2(11)), 0.4 * math.log2(11)), rel=1e-12)
    # a task without new classes has no paper form; the code's still has one
    with pytest.raises(ValueError, match="new ones"):
        task_weights(40, 40, 0.2, 0.4, "paper")
    assert task_weights(40, 40, 0.2, 0.4, "code") == pytest.approx((0.2 * (1 + 1 / math.log2(21)),
                                                                    0.4 * math.log2(21)))


@pytest.mark.parametrize("form", ["code", "paper"])
def test_the_client_loss_uses_the_chosen_form(monkeypatch, form):
    """A task-1 step of 2 old and 2 new classes calls :func:`task_weights` in the options' form and weighs the
    terms with what it returns."""
    torch.manual_seed(0)
    model, old = build_model("cnn", SHAPE, 4), build_model("cnn", SHAPE, 2).eval()
    dim = model.backbone.out_dim
    seen: list = []

    def recording(known, total, cur, pre, how="code"):
        seen.append((known, total, how))
        return task_weights(known, total, cur, pre, how)

    monkeypatch.setattr(lander, "task_weights", recording)
    client = LanderClient(LanderOptions(task_weights=form, synthetic_batch=4, synthetic_augment=False))
    job = {"old": old, "projector": _projector(dim), "old_projector": _projector(dim).eval(),
           "anchors": torch.zeros(4, TEXT_DIM), "has_anchor": torch.zeros(4, dtype=torch.bool), "radius": 0.0,
           "synthetic": torch.rand(8, *SHAPE), "draw": torch.Generator().manual_seed(1), "sums": {}, "steps": 0}
    ctx = SimpleNamespace(job=job, device=torch.device("cpu"))
    loss = client.step_loss(ctx, model, torch.rand(3, *SHAPE), torch.tensor([2, 3, 2]))
    assert seen == [(2, 4, form)] and torch.isfinite(loss)
    expected = {"code": (0.2 * (1 + 1 / math.log2(3)) / math.sqrt(0.5), 0.4 * math.log2(3) * math.sqrt(0.5)),
                "paper": (0.2 * (1 + 1 / math.log2(2)), 0.4 * math.log2(2))}[form]  # paper: alpha 1, beta 1
    assert task_weights(2, 4, 0.2, 0.4, form) == pytest.approx(expected)
    sums = job["sums"]  # no anchors: the Bounding term is 0
    w_cur, w_pre = expected
    assert loss.item() == pytest.approx(w_cur * sums["ce_current"] + w_pre * (sums["kd_synthetic"]
                                                                            + sums["projection_mse"]), rel=1e-5)
