"""GLFC's ablations and paper forms, and the iCaRL+FL baseline: the plain BCE (w/o CGC) and iCaRL's distillation
(w/o CRD) against hand-computed values, the old model without the proxy (w/o PRS), the paper's lr schedule round
by round, the paper's prototype perturbation (its noise scale, step count and lr), and the ``icarl`` method."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.edge_node.store import ArrayStore
from fcl_emu.methods import glfc, jobs, registry
from fcl_emu.methods.base import ClientContext, ServerContext, TrainingSettings
from fcl_emu.methods.glfc import GLFCClient, GLFCOptions, GLFCServer, paper_lr
from fcl_emu.methods.glfc_losses import icarl_distillation, plain_bce_loss, relation_distillation
from fcl_emu.methods.glfc_prototypes import feature_noise_std, perturb_prototype, perturb_prototype_paper
from fcl_emu.methods.icarl import ICaRLClient, ICaRLOptions, ICaRLServer
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.state import load_arrays
from fcl_emu.methods.requirements import SECAGG

SHAPE = (1, 28, 28)
TINY = {"memory_size": 40, "perturb_steps": 2, "proxy_iterations": 4, "proxy_keep": 2, "task_detection": "oracle"}


def _sigmoid(v):
    return 1 / (1 + math.exp(-v))


def _bce(t, z):  # binary cross-entropy of sigmoid(z) against target t
    return -(t * math.log(_sigmoid(z)) + (1 - t) * math.log(1 - _sigmoid(z)))


# ------------------------------------------------------------ loss terms by hand
def test_plain_bce_by_hand_in_both_forms():
    logits, y = [[2.0, -1.0, 0.0], [0.5, 1.0, -2.0]], [0, 1]
    rows = [sum(_bce(1.0 if c == y[i] else 0.0, z) for c, z in enumerate(logits[i])) for i in range(2)]
    assert rows[0] == pytest.approx(-math.log(_sigmoid(2.0)) - math.log(1 - _sigmoid(-1.0)) + math.log(2))
    got = plain_bce_loss(torch.tensor(logits), torch.tensor(y), "paper")
    assert got.item() == pytest.approx((rows[0] + rows[1]) / 2, rel=1e-6)  # summed over the classes
    got = plain_bce_loss(torch.tensor(logits), torch.tensor(y), "code")
    assert got.item() == pytest.approx((rows[0] + rows[1]) / 2 / 3, rel=1e-6)  # averaged over the 3 classes


def test_icarl_distillation_by_hand_in_both_forms():
    logits = [[1.0, -1.0, 0.5], [0.0, 2.0, -0.5]]  # the student knows 3 classes
    old = [[0.5, 0.0], [-1.0, 1.0]]  # the old model the first 2
    rows = [sum(_bce(_sigmoid(old[i][c]), logits[i][c]) for c in range(2)) for i in range(2)]
    got = icarl_distillation(torch.tensor(logits), torch.tensor(old), "paper")
    assert got.item() == pytest.approx((rows[0] + rows[1]) / 2, rel=1e-6)
    got = icarl_distillation(torch.tensor(logits), torch.tensor(old), "code")
    assert got.item() == pytest.approx((rows[0] + rows[1]) / 2 / 3, rel=1e-6)  # 1/K of the paper's form
    # the new class's logit plays no part: changing it changes nothing
    moved = torch.tensor([[1.0, -1.0, 9.0], [0.0, 2.0, 9.0]])
    assert icarl_distillation(moved, torch.tensor(old)).item() == pytest.approx(got.item() * 3, rel=1e-6)


class _Rows(nn.Module):
    """A frozen 'model' whose logits are fixed rows, picked by the row number in x[:, 0]."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits)

    def forward(self, x):
        return self.logits[x[:, 0].long()]


class _Broken(nn.Module):
    def forward(self, x):
        raise AssertionError("the old model must not run with distillation off")


def _job(old_classes, teacher):
    return SimpleNamespace(job={"old_classes": torch.tensor(old_classes), "teacher": teacher, "sums": np.zeros(2),
                                "steps": 0})


def test_the_client_loss_composes_the_ablations_by_hand():
    logits, y = [[2.0, -1.0, 0.0], [0.5, 1.0, -2.0]], [0, 2]
    old = [[0.5, 0.0], [-1.0, 1.0]]
    x = torch.arange(2.0)[:, None]
    plain = sum(_bce(1.0 if c == y[i] else 0.0, z) for i in range(2) for c, z in enumerate(logits[i])) / 2
    kd = sum(_bce(_sigmoid(old[i][c]), logits[i][c]) for i in range(2) for c in range(2)) / 2
    # iCaRL+FL: the plain BCE whatever the old classes (class 0 is old here) plus iCaRL's distillation
    part = GLFCClient(GLFCOptions(compensation="off", distillation="icarl", w_gc=0.3, w_rd=0.7))
    ctx = _job([0], _Rows(old))
    got = part.loss(ctx, None, x, torch.tensor(y), torch.tensor(logits))
    assert got.item() == pytest.approx(0.3 * plain + 0.7 * kd, rel=1e-6)
    assert ctx.job["sums"].tolist() == pytest.approx([plain, kd], rel=1e-6)
    # no old model (task 0): the classification term alone, unweighted
    got = part.loss(_job([], None), None, x, torch.tensor(y), torch.tensor(logits))
    assert got.item() == pytest.approx(plain, rel=1e-6)
    # distillation off is w_rd = 0, without running the old model
    ref = GLFCClient(GLFCOptions(w_rd=0.0)).loss(_job([0], _Rows(old)), None, x, torch.tensor(y),
                                                  torch.tensor(logits))
    off = GLFCClient(GLFCOptions(distillation="off")).loss(_job([0], _Broken()), None, x, torch.tensor(y),
                                                           torch.tensor(logits))
    assert off.item() == pytest.approx(ref.item(), rel=1e-6)
    rd = relation_distillation(torch.tensor(logits), torch.tensor(old), torch.tensor(y)).item()
    full = GLFCClient(GLFCOptions()).loss(_job([0], _Rows(old)), None, x, torch.tensor(y), torch.tensor(logits))
    assert full.item() == pytest.approx(ref.item() + 0.5 * rd, rel=1e-6)


def test_work_per_sample_leaves_out_the_old_model_without_distillation():
    assert GLFCClient.work_per_sample(GLFCOptions(), 32, 1) == pytest.approx(4 / 3)
    assert GLFCClient.work_per_sample(GLFCOptions(distillation="off"), 32, 1) == 1.0
    assert GLFCClient.work_per_sample(GLFCOptions(), 32, 0) == 1.0


# --------------------------------------------------------------- lr schedule
def test_paper_lr_by_hand():
    # 10 rounds of 20 epochs: /5 from epoch 100 (round 5), /25 from 150 (round 8: round 7 starts at 140), /125
    # from 180 (round 9)
    assert [paper_lr(2.0, r, 10) for r in range(10)] == pytest.approx(
        [2.0] * 5 + [0.4, 0.4, 0.4, 0.08, 0.016])
    assert [paper_lr(1.0, r, 4) for r in range(4)] == pytest.approx([1.0, 1.0, 0.2, 0.04])  # 3/4 exactly: /25
    assert [paper_lr(1.0, r, 20) for r in (9, 10, 14, 15, 17, 18, 19)] == pytest.approx(
        [1.0, 0.2, 0.2, 0.04, 0.04, 0.008, 0.008])
    assert paper_lr(0.1, 0, 1) == 0.1


def _server(cls, options, rounds=2, run_job=None):
    scenario = SimpleNamespace(num_tasks=2, num_classes=10, task_classes=lambda t: np.arange(2 * t, 2 * t + 2),
                               seen_classes=lambda t: np.arange(2 * t + 2))
    torch.manual_seed(0)
    return cls(ServerContext(options, scenario, lambda n: build_model("cnn", SHAPE, n), run_job=run_job,
                             model_name="cnn", input_shape=SHAPE, rounds_per_task=rounds))


def test_the_server_sends_the_paper_lr_per_round_or_a_constant_one():
    paper = _server(GLFCServer, GLFCOptions(lr_schedule="paper"), rounds=4)
    assert [paper.learning_rate(1, r, 0.5) for r in range(4)] == pytest.approx([0.5, 0.5, 0.1, 0.02])
    constant = _server(GLFCServer, GLFCOptions(), rounds=4)
    assert [constant.learning_rate(1, r, 0.5) for r in range(4)] == [0.5] * 4
    assert _server(ICaRLServer, ICaRLOptions(lr_schedule="paper"), rounds=2).learning_rate(0, 1, 1.0) == 0.2


# ------------------------------------------------------- paper perturbation
def test_feature_noise_std_by_hand():
    f = torch.tensor([[0.0, 2.0], [2.0, 2.0], [4.0, 8.0]])
    # population variances: (4 + 0 + 4) / 3 and (4 + 4 + 16) / 3
    assert feature_noise_std(f, 0.5).tolist() == pytest.approx([0.5 * math.sqrt(8 / 3), 0.5 * math.sqrt(8)])
    assert feature_noise_std(f[:1], 1.0).tolist() == [0.0, 0.0]  # one sample: no spread, no noise


class _Spy(nn.Module):
    """features: a fixed linear map; head: a fixed linear map that records what it is given."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(3, 2)
        self.head = nn.Linear(2, 4)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.clean, self.given = [], []

    def features(self, x):
        h = self.backbone(x)
        self.clean.append(h.detach().clone())
        return h

    def forward(self, x):
        return self.head(self.features(x))


def test_paper_perturbation_noise_scale_and_step_count():
    model = _Spy()
    model.head.register_forward_pre_hook(lambda m, args: model.given.append(args[0].detach().clone()))
    class_features = torch.tensor([[0.0, 1.0], [2.0, 1.0], [4.0, 7.0]])
    x, y = torch.tensor([[0.2, -0.1, 0.4]]), torch.tensor([3])
    out = perturb_prototype_paper(model, x, y, class_features, steps=7, lr=0.1, gamma=0.5, noise=0.0, form="paper",
                                  generator=torch.Generator().manual_seed(4))
    assert len(model.clean) == len(model.given) == 7  # one forward pass per SGD step
    replica = torch.Generator().manual_seed(4)  # a fresh draw per step, of std gamma * the class's feature std
    std = torch.tensor([0.5 * math.sqrt(8 / 3), 0.5 * math.sqrt(8)])
    for clean, given in zip(model.clean, model.given):
        assert torch.allclose(given - clean, std * torch.randn((1, 2), generator=replica), atol=1e-6)
    assert not torch.equal(out, x)
    # gamma 0: the code's perturbation at the same (absolute) lr, step for step
    spy = _Spy()
    a = perturb_prototype_paper(spy, x, y, class_features, 5, 0.1, 0.0, 0.0, "paper", torch.Generator())
    b = perturb_prototype(_Spy(), x, y, 5, 0.1, 0.0, "paper", torch.Generator())
    assert torch.allclose(a, b, atol=1e-6)


def test_paper_perturbation_options_default_to_the_paper():
    o = GLFCOptions(perturbation="paper")
    assert (o.perturb_steps, o.perturb_lr) == (100, 0.1)
    o = GLFCOptions(perturbation="paper", perturb_steps=3, perturb_lr=0.2)
    assert (o.perturb_steps, o.perturb_lr) == (3, 0.2)
    assert GLFCOptions(**GLFCOptions(perturbation="paper").model_dump()).perturb_steps == 100  # as sent to edges
    o = GLFCOptions()
    assert (o.perturb_steps, o.perturb_lr, o.perturbation) == (50, None, "code")
    with pytest.raises(ValueError):
        GLFCOptions(perturbation="papers")


# ------------------------------------------------------------ client and server jobs
def _ctx(store, task, classes, global_state, assets=None, lr=0.05):
    gen = torch.Generator().manual_seed(task)
    y = torch.tensor(classes).repeat_interleave(12)
    return ClientContext(
        client="client-0001", task=task, task_classes=np.asarray(classes), seen_classes=np.arange(max(classes) + 1),
        x=torch.randn((len(y), *SHAPE), generator=gen) + y[:, None, None, None].float(), y=y,
        settings=TrainingSettings(local_epochs=1, lr=lr, batch_size=8), global_state=global_state,
        assets=assets or {}, state={}, store=store, build_model=lambda n: build_model("cnn", SHAPE, n),
        dataset_classes=10, seed=3, new_task=True)


def _train(part, ctx):
    model = build_model("cnn", SHAPE, int(ctx.global_state["head.weight"].shape[0]))
    load_arrays(model, ctx.global_state)
    return part.train(ctx, model)


def test_the_client_perturbs_in_the_paper_form_at_its_absolute_lr(tmp_path, monkeypatch):
    calls = []

    def record(model, x, y, class_features, steps, lr, gamma, noise, form, generator):
        calls.append((int(y), len(class_features), steps, lr, gamma))
        return x

    monkeypatch.setattr(glfc, "perturb_prototype_paper", record)
    part = GLFCClient(GLFCOptions(**{**TINY, "perturbation": "paper", "perturb_steps": 4}))
    server = _server(GLFCServer, GLFCOptions(**TINY))
    server.start_task(0)
    _, metrics = _train(part, _ctx(ArrayStore(tmp_path / "c"), 0, [0, 1], server.round_tensors(0, 1), lr=0.7))
    assert calls == [(0, 12, 4, 0.1, 0.1), (1, 12, 4, 0.1, 0.1)] and metrics["prototype_gradients"] == 2


def _no_change(server):
    return ClientUpdate("client-0001", 10, {DELTA + k: np.full_like(v, 0.01) if v.dtype.kind == "f" else v
                                            for k, v in server.global_state.items()})


def test_without_the_proxy_the_old_model_is_the_last_global_model(tmp_path):
    """w/o PRS: no prototype gradients leave the client, none are taken, no proxy job runs, and task 1's old
    model is task 0's final global model (its head of task 0's classes)."""
    def no_jobs(kind, inputs, options):
        raise AssertionError(f"no server job expected, got {kind}")

    options = GLFCOptions(**TINY, old_model="last")
    server = _server(GLFCServer, options, run_job=no_jobs)
    server.start_task(0)
    part, store = GLFCClient(options), ArrayStore(tmp_path / "c")
    ctx = _ctx(store, 0, [0, 1], server.round_tensors(0, 1))
    _, metrics = _train(part, ctx)
    assert metrics["task_detected"] == 1 and metrics["prototype_gradients"] == 0 and not ctx.outbox
    with pytest.raises(ValueError, match="no proxy"):
        server.on_side_channel(0, "prototype_gradients", {})
    for r in (1, 2):
        server.aggregate(0, r, [_no_change(server)])
    final = server.global_state
    server.end_task(0)
    server.start_task(1)
    old = server.task_assets(1)["old_model"]
    assert old.keys() == {"glfc/old/" + k for k in final} and all(
        np.array_equal(old["glfc/old/" + k], v) for k, v in final.items())
    assert old["glfc/old/head.weight"].shape[0] == 2
    ctx = _ctx(store, 1, [2, 3], server.round_tensors(1, 3), assets=old)
    _, metrics = _train(part, ctx)
    assert "relation_distillation" in metrics and not ctx.outbox and metrics["exemplars"] > 0


# ---------------------------------------------------------------------- icarl
def test_icarl_is_glfc_with_the_three_components_replaced(tmp_path):
    spec = registry.get("icarl")
    assert spec.name in registry.names() and spec.server is ICaRLServer and spec.client is ICaRLClient
    o = ICaRLOptions()
    assert (o.compensation, o.distillation, o.task_detection, o.memory_size) == ("off", "icarl", "oracle", 2000)
    assert not hasattr(o, "old_model") and not hasattr(o, "proxy_iterations")
    assert spec.training == registry.get("glfc").training
    assert jobs.kinds("icarl") == {} and ICaRLServer.side_channels == ()
    assert SECAGG not in spec.refusals and SECAGG in registry.get("glfc").refusals  # nothing travels beside deltas
    server = _server(ICaRLServer, ICaRLOptions(memory_size=40))  # no run_job: it would fail if a job ran
    server.start_task(0)
    part, store = ICaRLClient(ICaRLOptions(memory_size=40)), ArrayStore(tmp_path / "i")
    ctx = _ctx(store, 0, [0, 1], server.round_tensors(0, 1))
    uploads, metrics = _train(part, ctx)
    assert not ctx.outbox and "plain_bce" in metrics and "gradient_compensation" not in metrics
    server.aggregate(0, 1, [ClientUpdate("client-0001", 24, uploads)])
    server.end_task(0)
    server.start_task(1)
    old = server.task_assets(1)["old_model"]
    ctx = _ctx(store, 1, [2, 3], server.round_tensors(1, 3), assets=old)
    _, metrics = _train(part, ctx)
    assert "icarl_distillation" in metrics and "relation_distillation" not in metrics and not ctx.outbox
    assert metrics["exemplars"] == 24  # both task-0 classes, 12 samples each (fits the memory of 40)
