"""AF-FCL: the flow's log-likelihood by hand and its inverse, each loss term (eq. 5-9) against hand-computed
values, the replay step's parameters, the feature space of ``cnn_leaky``, bad input, the server's checkpoint
round trip, the secagg refusal, and a short real-process run."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pydantic
import pytest
import torch
import torch.nn.functional as F

from fcl_emu.runconfig import RunConfig
from experiments import flow_fit
from fcl_emu.methods import affcl
from fcl_emu.methods import registry as methods
from fcl_emu.methods.affcl import (FLOW, OLD_FLOW, OLD_MODEL, AFFCLOptions, credibility, feature_distillation, flow_dim,
                           flow_loss, generated_ce, latent_statistics, mean_density, output_distillation)
from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.methods.base import ClientContext, ServerContext, TrainingSettings
from fcl_emu.methods.models.backbones import SmallCNNLeaky, SplitBackbone
from fcl_emu.methods.models.classifier import build_model, resolve_model
from fcl_emu.methods.models.flows import ConditionalFlow
from fcl_emu.methods.optim import LocalSGD
from fcl_emu.monitoring.results import RunSummary
from tests.conftest import fcl_emu, small_config

SHAPE = (1, 28, 28)
LOG_2PI = math.log(2 * math.pi)
FRESH_SCALE = 1 / (1 + math.exp(-2.0)) + 1e-3  # sigmoid(0 + 2) + 1e-3: a fresh coupling's scale


def _gauss_logpdf(z: torch.Tensor) -> torch.Tensor:
    return -0.5 * (z.pow(2).sum(dim=1) + z.shape[1] * LOG_2PI)


def _sigmoid(v: float) -> float:
    return 1 / (1 + math.exp(-v))


def _one_layer_flow() -> ConditionalFlow:
    """One coupling over 4 dims, 2 classes, one residual block, known weights: ``initial`` is the identity on
    ``v = [x_a0, x_a1, onehot0, onehot1]``; the block gives ``v * (1 + sigmoid(onehot1))`` (``linear_0`` and
    ``linear_1`` the identity, LeakyReLU passes the non-negative inputs below, the gate ``sigmoid(onehot1)``);
    ``final`` outputs ``t = v'_1`` and ``s_raw = 0.5 v'_0 + v'_3`` for both transformed dims."""
    flow = ConditionalFlow(4, 2, layers=1, hidden=4, blocks=1)
    coupling = flow.couplings[0]
    block = coupling.blocks[0]
    with torch.no_grad():
        for p in flow.parameters():
            p.zero_()
        coupling.initial.weight.copy_(torch.eye(4))
        block.linear_0.weight.copy_(torch.eye(4))
        block.linear_1.weight.copy_(torch.eye(4))
        block.context.weight.copy_(torch.tensor([[0.0, 1.0]] * 4))
        # output: (t_0, t_1, s_raw_0, s_raw_1)
        coupling.final.weight.copy_(torch.tensor([[0, 1, 0, 0], [0, 1, 0, 0], [0.5, 0, 0, 1], [0.5, 0, 0, 1]],
                                                 dtype=torch.float32))
    return flow


def _fresh_one_layer_log_prob(flow: ConditionalFlow, x: torch.Tensor) -> torch.Tensor:
    """A fresh one-coupling flow by hand: permute, scale the second half by FRESH_SCALE, no shift."""
    xp = x[:, flow.perm0]
    d = x.shape[1] // 2
    z = torch.cat([xp[:, :d], xp[:, d:] * FRESH_SCALE], dim=1)
    return _gauss_logpdf(z) + (x.shape[1] - d) * math.log(FRESH_SCALE)


# ------------------------------------------------------------------ the flow
def test_one_coupling_log_likelihood_by_hand():
    flow = _one_layer_flow()
    x = torch.tensor([[1.0, 2.0, 0.4, 0.2], [0.5, 1.0, 1.5, 3.0]])
    y = torch.tensor([0, 1])
    log_p, z = flow.log_prob(x, y)
    # the layer permutes the dims first (its fixed permutation); x'_a = x'[:2] conditions x'_b = x'[2:]
    perm = flow.perm0.tolist()
    assert sorted(perm) == [0, 1, 2, 3]
    expected_z, expected_lp = [], []
    for xi, yi in zip(x.tolist(), y.tolist()):
        xp = [xi[j] for j in perm]
        a, b = xp[:2], xp[2:]
        gain = 1 + _sigmoid(yi)  # the residual block, gated by the class
        s = _sigmoid(gain * (0.5 * a[0] + yi) + 2) + 1e-3
        zb = [bj * s + gain * a[1] for bj in b]
        zi = a + zb
        expected_z.append(zi)
        expected_lp.append(-0.5 * (sum(v * v for v in zi) + 4 * LOG_2PI) + 2 * math.log(s))
    assert torch.allclose(z, torch.tensor(expected_z), atol=1e-6)
    assert torch.allclose(log_p, torch.tensor(expected_lp), atol=1e-5)
    assert torch.allclose(flow.inverse(z, y), x, atol=1e-5)


@pytest.mark.parametrize("standardize", [False, True])
def test_flow_is_invertible_and_its_log_det_matches_autograd(standardize):
    torch.manual_seed(0)
    flow = ConditionalFlow(6, 3, layers=4, hidden=8, standardize=standardize)
    for p in flow.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    flow.observe(x * 0.1 + 2.0)  # narrow features far from 0: the standardisation's statistics move
    z, logdet = flow(x, y)
    assert torch.allclose(flow.inverse(z, y), x, atol=1e-5)
    for i in range(len(x)):
        jac = torch.autograd.functional.jacobian(lambda v: flow(v.unsqueeze(0), y[i:i + 1])[0][0], x[i])
        assert torch.allclose(torch.linalg.slogdet(jac)[1], logdet[i], atol=1e-4)
    sample, latent = flow.sample(y, torch.Generator().manual_seed(1))
    assert torch.allclose(flow(sample, y)[0], latent, atol=1e-5)


def test_flow_scale_is_bounded_like_the_code():
    """sigmoid(s_raw + 2) + 1e-3 lies in (1e-3, 1.001): a huge conditioner output neither stretches nor
    collapses a dimension beyond that, so the log-likelihood stays finite."""
    flow = ConditionalFlow(2, 1, layers=1, hidden=2, blocks=0)
    x, y = torch.tensor([[0.0, 1.0]]), torch.tensor([0])
    for bias, scale in ((1e4, 1.001), (-1e4, 1e-3)):
        with torch.no_grad():
            flow.couplings[0].final.bias.copy_(torch.tensor([0.0, bias]))  # (t, s_raw)
        log_p, z = flow.log_prob(x, y)
        xp = x[:, flow.perm0]
        assert torch.allclose(z, torch.cat([xp[:, :1], xp[:, 1:] * scale], dim=1))
        assert log_p.item() == pytest.approx(_gauss_logpdf(z).item() + math.log(scale), rel=1e-6)


def test_running_standardization_by_hand():
    """observe() moves mean and var 0.1 of the way to the batch's; log p is the raw flow's density of the
    standardised features plus -sum log sqrt(var + 1e-6); inverse undoes both."""
    flow = ConditionalFlow(2, 1, layers=1, hidden=2, blocks=0, standardize=True)
    raw = ConditionalFlow(2, 1, layers=1, hidden=2, blocks=0)
    raw.load_state_dict({k: v for k, v in flow.state_dict().items() if k.startswith("couplings.")})
    batch = torch.tensor([[1.0, 2.0], [3.0, 6.0]])  # mean (2, 4), biased var (1, 4)
    flow.observe(batch)
    mean, var = torch.tensor([0.2, 0.4]), torch.tensor([1.0, 1.3])
    assert torch.allclose(flow.standardization.mean, mean) and torch.allclose(flow.standardization.var, var)
    x, y = torch.tensor([[0.5, -1.0], [2.0, 3.0]]), torch.tensor([0, 0])
    log_det = -0.5 * (math.log(1.0 + 1e-6) + math.log(1.3 + 1e-6))
    assert flow.input_log_det().item() == pytest.approx(log_det, rel=1e-6)
    log_p, z = flow.log_prob(x, y)
    raw_log_p, raw_z = raw.log_prob((x - mean) / torch.sqrt(var + 1e-6), y)
    assert torch.allclose(z, raw_z, atol=1e-6) and torch.allclose(log_p, raw_log_p + log_det, atol=1e-6)
    assert torch.allclose(flow.inverse(z, y), x, atol=1e-6)
    assert raw.input_log_det().item() == 0.0
    raw.observe(batch)  # no standardisation: nothing to move
    assert set(raw.state_dict()) == {k for k in flow.state_dict() if k.startswith("couplings.")}
    assert {"standardization.mean", "standardization.var"} <= set(flow.state_dict())  # they travel
    with pytest.raises(ValueError, match="cannot observe"):
        flow.observe(torch.tensor([[float("nan"), 0.0]]))


def test_fresh_flow_permutes_and_scales_and_state_names_are_stable():
    flow = ConditionalFlow(8, 10, layers=2, hidden=16)
    x, y = torch.randn(3, 8), torch.tensor([1, 5, 9])
    log_p, z = flow.log_prob(x, y)
    expected = x
    for i in range(2):  # each layer: its permutation, then the second half times FRESH_SCALE
        expected = expected[:, getattr(flow, f"perm{i}")]
        expected = torch.cat([expected[:, :4], expected[:, 4:] * FRESH_SCALE], dim=1)
    assert torch.allclose(z, expected, atol=1e-6)
    assert torch.allclose(log_p, _gauss_logpdf(expected) + 2 * 4 * math.log(FRESH_SCALE), atol=1e-5)
    assert all(k.startswith("couplings.") for k in flow.state_dict())  # permutations are not state
    assert {k.split(".", 2)[2] for k in flow.state_dict()} >= {
        "initial.weight", "blocks.0.linear_0.weight", "blocks.1.linear_1.bias", "blocks.0.context.weight",
        "final.weight"}


def test_flow_refuses_bad_input():
    flow = ConditionalFlow(4, 2, layers=1, hidden=4)
    with pytest.raises(ValueError, match=r"expected \(batch, 4\)"):
        flow.log_prob(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels of shape"):
        flow.log_prob(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must lie in 0..1"):
        flow.log_prob(torch.zeros(1, 4), torch.tensor([2]))
    with pytest.raises(ValueError, match="NaN"):
        flow.log_prob(torch.tensor([[0.0, float("nan"), 0.0, 0.0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="dim >= 2"):
        ConditionalFlow(1, 2)


# ----------------------------------------------------------- loss terms by hand
def test_flow_loss_eq5_by_hand():
    flow = ConditionalFlow(2, 2, layers=1, hidden=4)  # fresh: a permutation and a fixed scale (by hand below)
    h, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    h_old, y_old = torch.tensor([[3.0, 4.0]]), torch.tensor([1])
    total, nll, nll_old = flow_loss(flow, h, y, h_old, y_old, k_flow_last=0.4)
    xp = h[:, flow.perm0].tolist()  # (first, second) after the permutation; the second is scaled
    real = sum(0.5 * (a * a + (b * FRESH_SCALE) ** 2 + 2 * LOG_2PI) - math.log(FRESH_SCALE) for a, b in xp) / 2
    a, b = h_old[0, flow.perm0].tolist()
    old = 0.5 * (a * a + (b * FRESH_SCALE) ** 2 + 2 * LOG_2PI) - math.log(FRESH_SCALE)
    assert nll.item() == pytest.approx(real, rel=1e-6) and nll_old.item() == pytest.approx(old, rel=1e-6)
    assert total.item() == pytest.approx(real + 0.4 * old, rel=1e-6)
    assert flow_loss(flow, h, y, None, None, 0.4)[0].item() == pytest.approx(real, rel=1e-6)
    assert nll.item() == pytest.approx(-_fresh_one_layer_log_prob(flow, h).mean().item(), rel=1e-6)


def test_feature_distillation_eq6_by_hand():
    h, h_old = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[0.0, 2.0], [1.0, 4.0]])
    assert feature_distillation(h, h_old).item() == pytest.approx((1 + 0 + 4 + 0) / 4)
    with pytest.raises(ValueError, match="differ"):
        feature_distillation(h, h_old[:, :1])


def test_latent_statistics_and_credibility_eq7_eq8_by_hand():
    u = torch.tensor([[0.0, 1.0], [2.0, 3.0], [5.0, 5.0]])
    y = torch.tensor([0, 0, 2])
    mean, var, present = latent_statistics(u, y, 3)
    assert torch.allclose(mean, torch.tensor([[1.0, 2.0], [0, 0], [5.0, 5.0]]))
    assert torch.allclose(var, torch.tensor([[1.0, 1.0], [0, 0], [0, 0]]))
    assert present.tolist() == [True, False, True]
    u_gen, y_gen = torch.tensor([[1.0, 4.0], [9.0, 9.0], [5.0, 5.0]]), torch.tensor([0, 1, 2])
    w = credibility(u_gen, y_gen, mean, var, present, fallback=0.3)
    v = 1.0 + 1e-6
    n = lambda d: math.exp(-0.5 * d * d / v) / math.sqrt(2 * math.pi * v)  # noqa: E731
    assert w[0].item() == pytest.approx((n(0.0) + n(2.0)) / 2, rel=1e-5)
    assert w[1].item() == pytest.approx(0.3)  # class 1 absent locally: the fallback
    assert w[2].item() == pytest.approx(1 / math.sqrt(2 * math.pi * 1e-6), rel=1e-4)  # at the mean, var floor


def test_mean_density_and_generated_ce_eq9_by_hand():
    log_p = torch.tensor([-2.0, -4.0])
    p_bar = mean_density(log_p, 2)
    assert p_bar.item() == pytest.approx((math.exp(-1) + math.exp(-2)) / 2)
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    y, w = torch.tensor([0, 0]), torch.tensor([0.5, 2.0])
    ce0 = -math.log(math.exp(2) / (math.exp(2) + 1))
    ce1 = -math.log(1 / (1 + math.e))
    expected = ((1 - 0.2) * 0.25 + 0.2) * (0.5 * ce0 + 2.0 * ce1) / 2
    assert generated_ce(logits, y, w, 0.25, theta=0.2).item() == pytest.approx(expected, rel=1e-6)


def test_output_distillation_over_all_or_old_classes_by_hand():
    student, teacher = torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[0.5, -0.5]])
    q = [math.exp(0.25) / (math.exp(0.25) + math.exp(-0.25)), math.exp(-0.25) / (math.exp(0.25) + math.exp(-0.25))]
    # all: softmax over the three student logits at T = 2; the teacher gives the third class no mass
    z_all = math.exp(0.5) + math.exp(0.0) + math.exp(1.0)
    all_expected = -(q[0] * math.log(math.exp(0.5) / z_all) + q[1] * math.log(1 / z_all))
    # old: softmax over the first two student logits only
    z_old = math.exp(0.5) + math.exp(0.0)
    old_expected = -(q[0] * math.log(math.exp(0.5) / z_old) + q[1] * math.log(1 / z_old))
    assert output_distillation(student, teacher, 2.0, all_classes=True).item() == pytest.approx(all_expected, rel=1e-6)
    assert output_distillation(student, teacher, 2.0, all_classes=False).item() == pytest.approx(old_expected,
                                                                                                   rel=1e-6)
    # with no new class the two agree
    assert output_distillation(student[:, :2], teacher, 2.0, True).item() == pytest.approx(old_expected, rel=1e-6)
    with pytest.raises(ValueError, match="do not cover"):
        output_distillation(student[:, :1], teacher, 2.0, True)


# ------------------------------------------------------------------- options
def test_options_validation():
    o = AFFCLOptions()  # the code's README command for EMNIST-Letters, its argparse defaults for the rest
    assert (o.k_loss_flow, o.theta, o.flow_lr, o.k_flow_last, o.replay_lr) == (0.5, 0.0, 1e-4, 0.4, 1e-4)
    assert (o.k_kd_last, o.k_kd_feature, o.k_kd_output, o.temperature) == (0.2, 0.5, 0.1, 2.0)
    assert (o.flow_layers, o.flow_blocks, o.flow_hidden) == (4, 2, 256)
    assert (o.replay, o.credibility, o.kd_classes) == ("step", "latent", "all")
    with pytest.raises(pydantic.ValidationError):
        AFFCLOptions(classifier_optimizer="sgdm")
    with pytest.raises(pydantic.ValidationError):
        AFFCLOptions(replay="both")
    with pytest.raises(pydantic.ValidationError, match="extra"):
        AFFCLOptions(unknown=1)
    with pytest.raises(pydantic.ValidationError, match="finite"):
        AFFCLOptions(k_loss_flow=float("nan"))
    with pytest.raises(pydantic.ValidationError):
        AFFCLOptions(theta=1.5)
    with pytest.raises(pydantic.ValidationError):
        AFFCLOptions(flow_layers=0)


def test_secagg_is_refused_naming_the_flow():
    with pytest.raises(ValueError, match="affcl/flow/"):
        RunConfig(method="affcl", secagg={"enabled": True})


# ------------------------------------------------------- server and client parts
def _scenario():
    return SimpleNamespace(num_tasks=3, num_classes=6, task_classes=lambda t: np.arange(2 * t, 2 * t + 2),
                           seen_classes=lambda t: np.arange(2 * t + 2))


TINY = {"flow_layers": 2, "flow_hidden": 8}


def _server(seed: int, model: str = "cnn", **options):
    torch.manual_seed(seed)
    spec = methods.get("affcl")
    ctx = ServerContext(spec.options(**TINY, **options), _scenario(), lambda n: build_model(model, SHAPE, n),
                        seed=0)
    return spec.server(ctx)


def _step(server, task: int, rnd: int, value: float) -> None:
    tensors = server.round_tensors(task, rnd)
    update = ClientUpdate("client-0001", 10, {
        **{DELTA + k: np.full_like(v, value) for k, v in tensors.items() if "/" not in k},
        **{k: np.full_like(v, value) for k, v in tensors.items() if k.startswith(FLOW)}})
    server.aggregate(task, rnd, [update])


def test_server_averages_the_flow_and_sends_the_old_pair_once_per_task():
    server = _server(0)
    server.start_task(0)
    before = dict(server.round_tensors(0, 0))
    assert any(k.startswith(FLOW) for k in before)
    _step(server, 0, 0, 0.5)
    after = server.round_tensors(0, 1)
    name = next(k for k in before if k.startswith(FLOW))
    assert np.allclose(after[name], before[name] + 0.5)
    assert server.task_assets(0) == {}
    server.end_task(0)
    server.start_task(1)
    assets = server.task_assets(1)
    assert set(assets) == {"old_model"}
    old = assets["old_model"]
    assert np.array_equal(old[OLD_FLOW + name[len(FLOW):]], after[name])
    assert np.array_equal(old[OLD_MODEL + "head.weight"], after["head.weight"])


def test_restored_server_behaves_identically():
    original = _server(0)
    original.start_task(0)
    _step(original, 0, 0, 0.01)
    original.end_task(0)
    original.start_task(1)
    _step(original, 1, 1, -0.02)
    restored = _server(1)
    restored.load_state_arrays({k: np.array(v) for k, v in original.state_arrays().items()})
    restored.load_state_meta(json.loads(json.dumps(original.state_meta())))
    for a, b in ((original.task_assets(1), restored.task_assets(1)),
                 ({"r": original.round_tensors(1, 2)}, {"r": restored.round_tensors(1, 2)})):
        assert a.keys() == b.keys()
        for kind in a:
            assert a[kind].keys() == b[kind].keys()
            assert all(np.array_equal(a[kind][k], b[kind][k]) for k in a[kind])
    _step(original, 1, 2, 0.03)
    _step(restored, 1, 2, 0.03)
    assert all(np.array_equal(v, restored.round_tensors(1, 3)[k]) for k, v in original.round_tensors(1, 3).items())


def _client_job(model_name: str, task: int, **options):
    """A client, its context for one job of ``task`` (16 samples, old pair from task 0 when task 1) and the
    model it trains."""
    server = _server(0, model_name, **options)
    server.start_task(0)
    if task:
        server.end_task(0)
        server.start_task(1)
    spec = methods.get("affcl")
    client = spec.client(spec.options(**TINY, **options))
    torch.manual_seed(0)
    seen = 2 * task + 2
    x, y = torch.randn(16, *SHAPE), torch.randint(0, seen, (16,))
    ctx = ClientContext(client="c", task=task, task_classes=np.arange(2 * task, seen), seen_classes=np.arange(seen),
                        x=x, y=y, settings=TrainingSettings(local_epochs=1, lr=0.05, batch_size=8),
                        global_state=server.round_tensors(task, 0),
                        assets=server.task_assets(task).get("old_model", {}), state={}, store=None,
                        build_model=lambda n: build_model(model_name, SHAPE, n), dataset_classes=6, new_task=True)
    model = ctx.frozen_model(ctx.global_state)
    model.requires_grad_(True)
    return client, ctx, model


@pytest.mark.parametrize("model_name,options", [
    ("cnn", {}),
    ("cnn_leaky", {"replay": "summed", "credibility": "feature", "kd_classes": "old"}),
    ("cnn", {"classifier_optimizer": "adam"}),
    ("cnn", {"flow_input": "raw"}),
])
def test_client_trains_model_and_flow_and_reports_its_terms(one_torch_thread, model_name, options):
    client, ctx, model = _client_job(model_name, 1, **options)
    uploads, metrics = client.train(ctx, model)
    flow_deltas = {k: v for k, v in uploads.items() if k.startswith(FLOW)}
    standardize = options.get("flow_input", "standardized") == "standardized"
    assert flow_deltas.keys() == {FLOW + k for k in ConditionalFlow(flow_dim(model), 6, 2, 8,
                                                                    standardize=standardize).state_dict()}
    assert any(np.abs(v).max() > 0 for v in flow_deltas.values())
    for term in ("flow_nll", "flow_nll_old", "kd_feature", "kd_output", "kd_generated", "credibility", "p_bar",
                 "replay", "generated_agreement", "credibility_local"):
        assert math.isfinite(metrics[term]), term
    bad = ClientContext(**{**ctx.__dict__, "dataset_classes": 7, "job": {}, "metrics": {}})
    with pytest.raises(ValueError, match="cannot load state"):  # a flow of another label space
        client.train(bad, ctx.frozen_model(ctx.global_state))


@pytest.mark.parametrize("model_name,trained", [("cnn_leaky", "backbone.neck."), ("cnn", "head.")])
def test_replay_step_is_its_own_adam_step_on_the_neck_or_head(one_torch_thread, model_name, trained):
    """replay: step (default) takes one Adam step (lr replay_lr) on the layers above the flow's features
    before the real batch's loss, which it leaves out of that loss; summed adds it and steps nothing."""
    client, ctx, model = _client_job(model_name, 0)
    x, y = ctx.x[:8], ctx.y[:8]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    client.begin_job(ctx, model)
    loss = client.step_loss(ctx, model, x, y)
    lr = client.options.replay_lr
    for name, value in model.state_dict().items():
        change = (value - before[name]).abs().max().item()
        if name.startswith(trained):  # Adam's first step moves each weight by lr * g / (|g| + eps)
            assert lr * 0.5 < change <= lr * 1.001, name
        else:
            assert change == 0, name
    with torch.no_grad():  # the real batch's loss (task 0: CE only) under the stepped model
        assert loss.item() == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-5)

    client, ctx, model = _client_job(model_name, 0, replay="summed")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    client.begin_job(ctx, model)
    loss = client.step_loss(ctx, model, x, y)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        ce = F.cross_entropy(model(x), y).item()
    assert loss.item() == pytest.approx(ce + ctx.job["sums"]["replay"], rel=1e-5)


@pytest.mark.parametrize("choice", ["run", "adam"])
def test_classifier_optimizer_is_the_runs_sgd_or_the_papers_adam(one_torch_thread, choice):
    """classifier_optimizer run (default): the run's optimiser, here SGD, a step of -lr g (lr 0.05, no momentum
    yet); adam (paper App. C.3, the code): Adam at lr 1e-4, betas 0.9/0.999, no weight decay, whose first step is
    -lr g / (|g| + 1e-8) per weight. replay: summed, so that only this optimiser moves the model."""
    assert AFFCLOptions().classifier_optimizer == "run" and AFFCLOptions().classifier_lr == 1e-4
    client, ctx, model = _client_job("cnn", 0, replay="summed", classifier_optimizer=choice)
    client.begin_job(ctx, model)
    opt = client.make_optimizer(ctx, model)
    if choice == "adam":
        assert isinstance(opt, torch.optim.Adam) and len(opt.param_groups) == 1
        group = opt.param_groups[0]
        assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-4, (0.9, 0.999), 0)
        assert len(group["params"]) == len(list(model.parameters()))
    else:
        assert isinstance(opt, LocalSGD) and (opt.lr, opt.momentum, opt.weight_decay) == (0.05, 0.0, 0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = client.step_loss(ctx, model, ctx.x[:8], ctx.y[:8])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    for name, p in model.named_parameters():
        g = grads[name]
        expected = -1e-4 * g / (g.abs() + 1e-8) if choice == "adam" else -0.05 * g
        assert torch.allclose(p.detach() - before[name], expected, rtol=1e-3, atol=1e-7), name  # float32 rounding
    if choice == "adam":  # a weight with a gradient moves by about lr itself
        moved = (model.head.weight.detach() - before["head.weight"]).abs()
        assert moved.max().item() == pytest.approx(1e-4, rel=1e-3)


@pytest.mark.parametrize("choice", ["latent", "feature"])
def test_credibility_scores_the_generated_latent_or_feature(one_torch_thread, monkeypatch, choice):
    client, ctx, model = _client_job("cnn", 0, credibility=choice)
    client.begin_job(ctx, model)
    flow, seen = ctx.job["flow"], {}

    def sample(y, generator=None):
        seen["h"], seen["u"] = ConditionalFlow.sample(flow, y, generator)
        return seen["h"], seen["u"]

    def spy(v, *args):
        seen["v"] = v
        return credibility(v, *args)

    monkeypatch.setattr(flow, "sample", sample)
    monkeypatch.setattr(affcl, "credibility", spy)
    client.step_loss(ctx, model, ctx.x[:8], ctx.y[:8])
    assert seen["v"] is seen["u" if choice == "latent" else "h"]


def test_cnn_leaky_is_the_codes_feature_space_and_what_auto_gives_affcl():
    model = build_model("cnn_leaky", SHAPE, 3)
    backbone = model.backbone
    assert isinstance(backbone, SmallCNNLeaky) and isinstance(backbone, SplitBackbone)
    assert flow_dim(model) == backbone.embed_dim == model.feature_dim == 512
    assert resolve_model("auto", SHAPE) == "cnn" and flow_dim(build_model("cnn", SHAPE, 3)) == 256
    small = methods.get("affcl").server.small_model
    assert resolve_model("auto", SHAPE, small=small) == "cnn_leaky"  # AF-FCL's own choice on small images
    large = methods.get("affcl").server.large_model
    assert resolve_model("auto", (3, 32, 32), small=small, large=large) == "resnet18"  # pooled features
    assert resolve_model("auto", (3, 32, 32), small=small) == "cnn_bn"  # every other method's
    torch.manual_seed(0)
    x = torch.randn(4, *SHAPE)
    with torch.no_grad():
        h = backbone.embed(x)
        assert (h < 0).any() and (h != 0).all()  # LeakyReLU: negatives, no exact zeros
        assert torch.equal(backbone(x), backbone.from_embedding(h))
        assert torch.equal(affcl.classify(model, h), model(x))
        assert torch.equal(affcl.embed(model, x), h)
    assert [p for p in affcl.replay_parameters(model)] == list(backbone.neck.parameters())
    assert sum(p.numel() for p in backbone.parameters()) == 806_272


# ------------------------------------------------------------- real processes
@pytest.mark.slow
def test_affcl_end_to_end(tmp_path, mnist_root):
    """Two tasks of MNIST's task pool with real edge-node processes: the flow rides with the model each
    round, the old pair reaches each participant once in task 1, the client terms are reported."""
    config = small_config(tmp_path / "c.yaml", method="affcl", method_options=TINY,
                          scenario={"num_clients": 6, "partition": "task_pool", "samples_per_client_task": 60},
                          rounds={"clients_per_round": 3, "rounds_per_task": 1, "eval_every": 1},
                          training={"local_epochs": 1})
    run_dir = tmp_path / "run"
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir))
    assert proc.wait(timeout=240) == 0
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.method == "affcl"
    matrix = summary.accuracy_matrix
    assert len(matrix) == 2 and all(len(row) == 2 for row in matrix)
    # AF-FCL's own measure: every client on its own tasks' test sets, one value per task
    assert len(summary.accuracy_clients) == 2 and all(0 <= a <= 100 for a in summary.accuracy_clients)
    flow_bytes = 4 * sum(v.numel() for v in ConditionalFlow(256, 10, 2, 8).state_dict().values())
    model_bytes = 4 * sum(v.numel() for v in build_model("cnn", SHAPE, 10).state_dict().values())
    sent = summary.messages
    assert 0 < sent["old_model/sent"] <= 3
    # each train request carries the model and the flow; each old_model asset the old pair
    assert summary.bytes["train_request"]["sent"] >= 6 * flow_bytes
    assert summary.bytes["old_model"]["sent"] >= sent["old_model/sent"] * (flow_bytes + model_bytes // 2)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    assert all("flow_nll" in r["client_metrics"] for r in rounds)
    assert all("kd_feature" in r["client_metrics"] for r in rounds if r["task"] == 1)
    assert all(0 <= r["client_metrics"]["credibility_local"] for r in rounds)
    # the run's own final flow and classifier, each task's held-out features (python -m ...flow_fit)
    per_task = flow_fit.own_flow(run_dir, str(mnist_root), per_task=30)
    assert [r["task"] for r in per_task] == [1, 2] and all(math.isfinite(r["nll_per_dim"]) for r in per_task)
    assert all(0 <= r[k] <= 1 for r in per_task for k in ("real_accuracy", "sample_agreement"))
