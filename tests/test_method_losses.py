"""Method losses checked against hand-computed numbers, and one short real training job per method."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fcl_emu.methods import registry
from fcl_emu.aggregation.combine import fedavg
from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.methods.base import ClientContext, ClientPart, ServerContext, TrainingSettings
from fcl_emu.methods.fedewc import (CONSOLIDATED, FISHER, PENDING, THETA, FedEWCClient, FedEWCOptions, cap_fisher,
                            empirical_fisher, ewc_penalty, merge_fisher)
from fcl_emu.methods.fedlwf2t import (LAST, OLD, OLD_ASSET, FedLwF2TClient, FedLwF2TOptions, FedLwF2TServer, kd_loss)
from fcl_emu.methods.fedprox import proximal_term
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.state import load_arrays, state_to_arrays


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- hand-computed loss terms ----------------------------------------------------

def test_kd_loss_three_classes_by_hand():
    student = torch.tensor([[1.0, 2.0, 0.0]])
    teacher = torch.tensor([[2.0, 0.0, 1.0]])
    T = 2.0
    # Softened teacher: softmax([2, 0, 1] / 2) = exp([1, 0, 0.5]) / Z_t
    z_t = math.exp(1.0) + math.exp(0.0) + math.exp(0.5)
    p_t = [math.exp(1.0) / z_t, math.exp(0.0) / z_t, math.exp(0.5) / z_t]
    # Softened student: softmax([1, 2, 0] / 2) = exp([0.5, 1, 0]) / Z_s
    z_s = math.exp(0.5) + math.exp(1.0) + math.exp(0.0)
    p_s = [math.exp(0.5) / z_s, math.exp(1.0) / z_s, math.exp(0.0) / z_s]
    # KL(p_t || p_s) = sum_c p_t[c] * (log p_t[c] - log p_s[c]), times T^2 = 4 (Hinton et al.)
    kl = sum(pt * (math.log(pt) - math.log(ps)) for pt, ps in zip(p_t, p_s))
    expected = 4.0 * kl
    assert expected == pytest.approx(0.8821, abs=1e-4)  # the same number, rounded, for the reader
    assert float(kd_loss(student, teacher, T)) == pytest.approx(expected, rel=1e-6)


def test_kd_loss_two_classes_batch_mean_and_zero_at_match():
    # Row 1: student [0, 0] -> (1/2, 1/2); teacher [2, 0] at T = 1 -> (e^2, 1) / (e^2 + 1).
    p1 = math.exp(2.0) / (math.exp(2.0) + 1.0)
    row1 = p1 * math.log(p1 / 0.5) + (1 - p1) * math.log((1 - p1) / 0.5)
    # Row 2: student equals teacher, KL = 0. The batch mean halves row 1.
    student = torch.tensor([[0.0, 0.0], [3.0, -1.0]])
    teacher = torch.tensor([[2.0, 0.0], [3.0, -1.0]])
    assert float(kd_loss(student, teacher, 1.0)) == pytest.approx(row1 / 2, rel=1e-6)
    assert float(kd_loss(teacher, teacher, 2.0)) == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError):
        kd_loss(student[:, :1], teacher, 2.0)


def _linear(weight, bias) -> nn.Linear:
    lin = nn.Linear(len(weight[0]), len(weight))
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(weight))
        lin.bias.copy_(torch.tensor(bias))
    return lin


def test_ewc_penalty_by_hand():
    module = _linear([[1.0, 2.0]], [0.5])
    fisher = {"weight": torch.tensor([[0.1, 0.2]]), "bias": torch.tensor([0.3])}
    anchor = {"weight": torch.tensor([[0.0, 1.0]]), "bias": torch.tensor([1.0])}
    # lam/2 * [0.1 * (1-0)^2 + 0.2 * (2-1)^2 + 0.3 * (0.5-1)^2] = 1 * (0.1 + 0.2 + 0.075)
    assert float(ewc_penalty(module, fisher, anchor, lam=2.0).detach()) == pytest.approx(0.375, rel=1e-6)


def test_ewc_penalty_ignores_new_head_rows():
    # The head grew from 1 to 2 rows since the Fisher was taken: row 2 has no Fisher.
    module = _linear([[1.0, 2.0], [100.0, -100.0]], [0.5, 50.0])
    fisher = {"weight": torch.tensor([[0.1, 0.2]]), "bias": torch.tensor([0.3])}
    anchor = {"weight": torch.tensor([[0.0, 1.0]]), "bias": torch.tensor([1.0])}
    assert float(ewc_penalty(module, fisher, anchor, lam=2.0).detach()) == pytest.approx(0.375, rel=1e-6)


def test_empirical_fisher_is_mean_of_squared_per_sample_gradients():
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    fisher = empirical_fisher(module, x, y)
    expected = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    for i in range(5):  # one sample at a time, plain autograd
        module.zero_grad()
        F.cross_entropy(module(x[i:i + 1]), y[i:i + 1]).backward()
        for n, p in module.named_parameters():
            expected[n] += p.grad.pow(2) / 5
    for n in expected:
        torch.testing.assert_close(fisher[n], expected[n])


def test_merge_fisher_running_average_and_new_rows():
    old = np.array([[1.0, 2.0]], np.float32)
    new = np.array([[3.0, 4.0], [5.0, 6.0]], np.float32)
    merged = merge_fisher(old, new, alpha=0.5)
    np.testing.assert_allclose(merged, [[2.0, 3.0], [5.0, 6.0]])  # row 2: the new estimate alone
    np.testing.assert_allclose(merge_fisher(None, new, 0.5), new)


def test_cap_fisher_keeps_sgd_stable():
    fisher = {"w": torch.tensor([0.001, 0.1])}
    # lr * lam * F_i <= 1 means F_i <= 1 / (0.5 * 100) = 0.02: the second entry is capped.
    capped, fraction = cap_fisher(fisher, lam=100.0, lr=0.5, cap=1.0)
    torch.testing.assert_close(capped["w"], torch.tensor([0.001, 0.02]))
    assert fraction == 0.5
    plain, none = cap_fisher(fisher, lam=100.0, lr=0.5, cap=None)
    assert plain["w"] is fisher["w"] and none == 0.0


def test_proximal_term_by_hand():
    module = _linear([[1.0, 2.0]], [3.0])
    anchor = {"weight": torch.tensor([[0.0, 0.0]]), "bias": torch.tensor([1.0])}
    # mu/2 * (1^2 + 2^2 + (3-1)^2) = 0.05 * 9
    assert float(proximal_term(module, anchor, mu=0.1).detach()) == pytest.approx(0.45, rel=1e-6)


def test_fedavg_weights_by_samples():
    a = ClientUpdate("a", 1, {DELTA + "w": np.array([1.0, 2.0], np.float32),
                              DELTA + "steps": np.array(3, np.int64), "x/extra": np.zeros(1, np.float32)})
    b = ClientUpdate("b", 3, {DELTA + "w": np.array([5.0, 6.0], np.float32),
                              DELTA + "steps": np.array(7, np.int64)})
    empty = ClientUpdate("c", 0, {DELTA + "w": np.array([100.0, 100.0], np.float32)})
    out = fedavg([a, b, empty])
    # w: (1 * [1, 2] + 3 * [5, 6]) / 4 = [16/4, 20/4]; integer buffers take the largest value.
    np.testing.assert_array_equal(out["w"], np.array([4.0, 5.0], np.float32))
    assert out["w"].dtype == np.float32
    assert int(out["steps"]) == 7
    assert set(out) == {"w", "steps"}
    with pytest.raises(ValueError):
        fedavg([empty])


# --- one real training job per method ---------------------------------------------

class MemoryStore:
    """In-memory stand-in for the node's disk-backed ArrayStore (save copies, as a file would)."""

    def __init__(self):
        self.groups: dict[str, dict[str, np.ndarray]] = {}

    def save(self, name, arrays):
        self.groups[name] = {k: np.array(v, copy=True) for k, v in arrays.items()}

    def load(self, name):
        g = self.groups.get(name)
        return None if g is None else {k: np.array(v, copy=True) for k, v in g.items()}

    def has(self, name):
        return name in self.groups


SHAPE = (1, 28, 28)


def _model(num_classes: int, seed: int):
    torch.manual_seed(seed)
    return build_model("cnn", SHAPE, num_classes)


def _snapshot(model) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in state_to_arrays(model).items()}


def _ctx(task: int, seen: int, global_state, store, *, assets=None, seed=0) -> ClientContext:
    gen = torch.Generator().manual_seed(100 + task)
    lo = 0 if task == 0 else 2
    return ClientContext(
        client="client-0000", task=task, task_classes=np.arange(lo, seen), seen_classes=np.arange(seen),
        x=torch.randn(24, *SHAPE, generator=gen), y=torch.randint(lo, seen, (24,), generator=gen),
        settings=TrainingSettings(local_epochs=1, lr=0.05, batch_size=8), global_state=global_state,
        assets=assets or {}, state={}, store=store, build_model=lambda n: build_model("cnn", SHAPE, n),
        seed=seed, new_task=True,
    )


def _train(part: ClientPart, ctx: ClientContext):
    model = build_model("cnn", SHAPE, int(ctx.global_state["head.weight"].shape[0]))
    load_arrays(model, ctx.global_state)
    uploads, metrics = part.train(ctx, model)
    assert math.isfinite(metrics["loss"])
    assert {k[len(DELTA):] for k in uploads if k.startswith(DELTA)} == set(ctx.global_state)
    for k, v in uploads.items():
        assert v.shape == ctx.global_state[k[len(DELTA):]].shape and np.isfinite(v).all()
    return uploads, metrics


def test_fedlwf2t_local_teacher_two_tasks():
    assert registry.get("fedlwf2t").client is FedLwF2TClient
    store = MemoryStore()
    part = FedLwF2TClient(FedLwF2TOptions())
    # Task 0: classes {0, 1}, no old model yet: the server teacher only.
    _, m0 = _train(part, _ctx(0, 2, _snapshot(_model(2, 0)), store))
    assert m0["old_teacher_classes"] == 0 and m0["kd_old"] == 0.0
    assert store.has(LAST) and not store.has(OLD)
    # Task 1: classes {2, 3}; the received global model differs from this client's own.
    ctx1 = _ctx(1, 4, _snapshot(_model(4, 1)), store)
    _, m1 = _train(part, ctx1)
    assert store.has(OLD) and int(store.load(OLD)["head.weight"].shape[0]) == 2
    assert m1["old_teacher_classes"] == 2
    assert m1["kd_old"] > 0 and m1["kd_server"] > 0
    # The same job with plain cross-entropy gives another loss.
    _, plain = _train(ClientPart(FedLwF2TOptions()), _ctx(1, 4, _snapshot(_model(4, 1)), MemoryStore()))
    assert plain["loss"] != pytest.approx(m1["loss"], rel=1e-6)
    # With both weights at 0 the job is exactly the plain cross-entropy job.
    off_store = MemoryStore()
    off_store.save(OLD, store.load(OLD))
    off_ctx = _ctx(1, 4, _snapshot(_model(4, 1)), off_store)
    _, off = _train(FedLwF2TClient(FedLwF2TOptions(alpha=0.0, beta=0.0)), off_ctx)
    assert off["loss"] == plain["loss"]
    late = FedLwF2TClient(FedLwF2TOptions())
    late_ctx = _ctx(1, 4, _snapshot(_model(4, 1)), MemoryStore())
    _, m_late = _train(late, late_ctx)  # joined in task 1: no old model, server teacher only
    assert m_late["old_teacher_classes"] == 0 and m_late["kd_server"] > 0


def test_fedlwf2t_global_teacher_from_server_assets():
    options = FedLwF2TOptions(old_teacher="global")
    scenario = SimpleNamespace(task_classes=lambda t: [2 * t, 2 * t + 1],
                               seen_classes=lambda t: list(range(2 * t + 2)))
    server = FedLwF2TServer(ServerContext(options, scenario, lambda n: _model(n, 0)))
    server.start_task(0)
    assert server.task_assets(0) == {}
    server.end_task(0)
    server.start_task(1)
    assert set(server.task_assets(1)) == {"old_model"}
    assets = server.task_assets(1)["old_model"]
    assert assets and all(k.startswith(OLD_ASSET) for k in assets)
    assert assets[OLD_ASSET + "head.weight"].shape[0] == 2
    assert server.global_state["head.weight"].shape[0] == 4

    store = MemoryStore()
    ctx = _ctx(1, 4, _snapshot(_model(4, 1)), store, assets=assets)
    _, metrics = _train(FedLwF2TClient(options), ctx)
    assert metrics["old_teacher_classes"] == 2 and metrics["kd_old"] > 0
    assert store.groups == {}  # the global teacher needs no client storage


def test_fedewc_two_tasks():
    assert registry.get("fedewc").client is FedEWCClient
    store = MemoryStore()
    part = FedEWCClient(FedEWCOptions(fisher_samples=16))
    _, m0 = _train(part, _ctx(0, 2, _snapshot(_model(2, 0)), store))
    assert m0["ewc_active"] == 0.0 and m0["ewc_penalty"] == 0.0
    pending = store.load(PENDING)
    assert pending is not None and pending[FISHER + "head.weight"].shape == (2, 256)
    assert all((v >= 0).all() for k, v in pending.items() if k.startswith(FISHER))

    # The task-1 global model: this client's theta* with a grown head, a little moved (other clients).
    grown = build_model("cnn", SHAPE, 2)
    load_arrays(grown, {k[len(THETA):]: v for k, v in pending.items() if k.startswith(THETA)})
    grown.expand(4, generator=torch.Generator().manual_seed(1))
    noise = torch.Generator().manual_seed(2)
    global1 = {k: v + 0.01 * torch.randn(v.shape, generator=noise).numpy() for k, v in _snapshot(grown).items()}
    ctx1 = _ctx(1, 4, global1, store)
    _, m1 = _train(part, ctx1)
    assert m1["ewc_active"] == 1.0 and m1["ewc_penalty"] > 0
    consolidated = store.load(CONSOLIDATED)
    np.testing.assert_array_equal(consolidated[FISHER + "head.weight"], pending[FISHER + "head.weight"])
    # The job's own estimate (4-class head) is pending for task 2; merging is done once per task.
    assert store.load(PENDING)[FISHER + "head.weight"].shape == (4, 256)
    pending1 = store.load(PENDING)
    # A task-1 job that failed before its estimate: start_task runs again and must not merge twice.
    store.save(PENDING, pending)
    part.start_task(ctx1)
    np.testing.assert_array_equal(store.load(CONSOLIDATED)[FISHER + "head.weight"],
                                  pending[FISHER + "head.weight"])
    # At task 2 the task-1 estimate is averaged in: old rows 50/50, the new classes' rows as estimated.
    store.save(PENDING, pending1)
    part.start_task(_ctx(2, 6, global1, store))
    merged = store.load(CONSOLIDATED)
    f0, f1 = pending[FISHER + "head.weight"], pending1[FISHER + "head.weight"]
    np.testing.assert_allclose(merged[FISHER + "head.weight"][:2], 0.5 * f0 + 0.5 * f1[:2], rtol=1e-6)
    np.testing.assert_array_equal(merged[FISHER + "head.weight"][2:], f1[2:])
    np.testing.assert_array_equal(merged[THETA + "head.weight"], pending1[THETA + "head.weight"])
    _, plain = _train(ClientPart(FedEWCOptions()), _ctx(1, 4, global1, MemoryStore()))
    assert plain["loss"] != pytest.approx(m1["loss"], rel=1e-6)
    off_store = MemoryStore()
    off_store.save(PENDING, pending)
    _, off = _train(FedEWCClient(FedEWCOptions(lam=0.0, fisher_samples=16)),
                    _ctx(1, 4, global1, off_store))
    assert off["loss"] == plain["loss"] and off["ewc_active"] == 0.0


def test_a_cancelled_job_stops_between_two_batches():
    """The coordinator's cancel (edge_node.training): the base training loop checks it before every batch."""
    from fcl_emu.methods.base import TrainingCancelled

    ctx = _ctx(0, 2, _snapshot(_model(2, 0)), MemoryStore())  # 24 samples in batches of 8: three steps
    checks = []
    ctx.cancelled = lambda: checks.append(1) or len(checks) > 2
    model = build_model("cnn", SHAPE, 2)
    with pytest.raises(TrainingCancelled):
        ClientPart(None).train(ctx, model)
    assert len(checks) == 3  # two batches trained, stopped before the third


def test_methods_whose_jobs_leave_client_state_say_so():
    """The coordinator never cancels their late jobs: a later job would see another state."""
    import inspect

    for name in registry.names():
        client = registry.get(name).client
        source = "".join(inspect.getsource(k) for k in client.__mro__ if k.__module__.startswith("fcl_emu.methods.")
                         and k.__name__ != "ClientPart")
        assert client.keeps_state == ("ctx.store" in source or "ctx.state" in source), name


def test_run_optimizer_is_sgd_or_adam_by_hand():
    """training.optimizer: sgd (default) steps -lr (g + wd p); adam's first step is -lr g' / (|g'| + 1e-8) with
    g' = g + wd p (bias-corrected moments of one gradient), its state fresh in every job; other names refused."""
    from fcl_emu.methods.optim import LocalSGD
    from fcl_emu.runconfig.config import TrainingConfig

    assert TrainingConfig().optimizer == "sgd"
    with pytest.raises(ValueError, match="optimizer"):
        TrainingConfig(optimizer="rmsprop")
    part = registry.get("fedavg").client(registry.get("fedavg").options())
    for name in ("sgd", "adam"):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        settings = TrainingSettings(local_epochs=1, lr=0.01, batch_size=4, weight_decay=0.1, optimizer=name)
        opt = part.make_optimizer(SimpleNamespace(settings=settings), model)
        assert isinstance(opt, torch.optim.Adam if name == "adam" else LocalSGD)
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.ones(1, 3)).sum().backward()
        grads = [p.grad.clone() + 0.1 * b for p, b in zip(model.parameters(), before)]
        opt.step()
        for p, b, g in zip(model.parameters(), before, grads):
            step = g / (g.abs() + 1e-8) if name == "adam" else g
            assert torch.allclose(p.detach(), b - 0.01 * step, atol=1e-7), name
