"""GLFC: loss terms against hand-computed values, exemplars and prototypes, the prototype-gradient channel and
its proxy (what reaches it), checkpoints, bad input, and a short real-process run with clients joining at a
task boundary."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fcl_emu.edge_node.store import ArrayStore
from fcl_emu.runconfig import RunConfig
from fcl_emu.methods import jobs
from fcl_emu.aggregation.update import DELTA, ClientUpdate
from experiments import glfc_table
from fcl_emu.methods.base import ClientContext, ServerContext, TrainingSettings
from fcl_emu.methods.glfc import (CANDIDATES, MEMORY, GLFCClient, GLFCOptions, GLFCServer, GradientEncoder, herding,
                          label_from_gradients, mean_entropy, merge_memory, prototype_index, reconstruct)
from fcl_emu.methods.glfc_losses import (compensation_weights, gradient_compensation_loss, relation_distillation,
                                 true_class_gradient)
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.state import load_arrays, state_to_arrays
from fcl_emu.monitoring.results import RunSummary
from tests.conftest import fcl_emu, small_config

SHAPE = (1, 28, 28)
CPU = torch.device("cpu")
TINY = {"memory_size": 40, "perturb_steps": 2, "proxy_iterations": 4, "proxy_keep": 2, "task_detection": "oracle"}


def _softmax(row):
    e = [math.exp(v) for v in row]
    return [v / sum(e) for v in e]


def _sigmoid(v):
    return 1 / (1 + math.exp(-v))


# ------------------------------------------------------------ loss terms by hand
def test_compensation_weights_normalise_each_group_by_its_mean_gradient():
    g = torch.tensor([0.2, 0.4, 0.6, 0.3])
    w = compensation_weights(g, torch.tensor([True, True, False, False]))
    assert torch.allclose(w, torch.tensor([0.2 / 0.3, 0.4 / 0.3, 0.6 / 0.45, 0.3 / 0.45]))
    assert torch.equal(compensation_weights(g, None), torch.ones(4))
    assert torch.allclose(compensation_weights(torch.zeros(2), torch.tensor([True, False])), torch.zeros(2))


def test_true_class_gradient_softmax_in_the_paper_sigmoid_in_the_code_by_hand():
    logits = torch.tensor([[math.log(3.0), 0.0, 0.0], [0.0, 0.0, 0.0]])
    y = torch.tensor([0, 1])
    # eq. 2: softmax 3 / (3 + 1 + 1) = 0.6 and 1/3; the code's sigmoid: 3 / (3 + 1) = 0.75 and 0.5
    assert true_class_gradient(logits, y, "paper").tolist() == pytest.approx([0.4, 2 / 3])
    assert true_class_gradient(logits, y, "code").tolist() == pytest.approx([0.25, 0.5])


def test_gradient_compensation_loss_by_hand():
    logits = [[2.0, 0.0, -1.0], [0.5, 1.0, 0.0], [0.0, 0.0, 3.0]]
    y, old = [0, 1, 2], [True, False, False]
    bce = [[-math.log(_sigmoid(z)) if c == y[i] else -math.log(1 - _sigmoid(z)) for c, z in enumerate(logits[i])]
           for i in range(3)]  # eq. 1: sigmoid BCE against the one-hot, in both forms

    def weights(p):  # G = |p_y - 1|; the new group (samples 1, 2) over its mean, the old one (sample 0) alone
        g = [abs(p(i) - 1) for i in range(3)]
        return [1.0, g[1] / ((g[1] + g[2]) / 2), g[2] / ((g[1] + g[2]) / 2)]

    w = weights(lambda i: _softmax(logits[i])[y[i]])  # eq. 2: the softmax probability
    paper = sum(w[i] * b for i in range(3) for b in bce[i]) / 3  # summed over the classes
    got = gradient_compensation_loss(torch.tensor(logits), torch.tensor(y), torch.tensor(old), "paper")
    assert got.item() == pytest.approx(paper, rel=1e-6)
    w = weights(lambda i: _sigmoid(logits[i][y[i]]))  # the code: the sigmoid probability
    code = sum(w[i] * b for i in range(3) for b in bce[i]) / 3 / 3  # averaged over the 3 classes
    got = gradient_compensation_loss(torch.tensor(logits), torch.tensor(y), torch.tensor(old), "code")
    assert got.item() == pytest.approx(code, rel=1e-6)
    assert code != pytest.approx(paper / 3, rel=1e-3)  # the two forms weigh the samples differently


def test_relation_distillation_by_hand():
    logits = [[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]]
    old_logits = [[0.5, -0.5], [1.0, 1.0]]  # the old model knows classes 0 and 1
    y = [2, 1]  # a new-class sample and an old-class exemplar
    targets = [[_sigmoid(old_logits[i][0]), _sigmoid(old_logits[i][1]), 1.0 if y[i] == 2 else 0.0]
               for i in range(2)]

    def bernoulli_kl(t, q):
        return sum(v * math.log(v / w) for v, w in ((t, q), (1 - t, 1 - q)) if v > 0)

    paper = sum(bernoulli_kl(t, _sigmoid(z)) for i in range(2) for t, z in zip(targets[i], logits[i])) / 2
    got = relation_distillation(torch.tensor(logits), torch.tensor(old_logits), torch.tensor(y), "paper")
    assert got.item() == pytest.approx(paper, rel=1e-6)
    code = -sum(t * math.log(_sigmoid(z)) + (1 - t) * math.log(1 - _sigmoid(z))
                for i in range(2) for t, z in zip(targets[i], logits[i])) / 6
    got = relation_distillation(torch.tensor(logits), torch.tensor(old_logits), torch.tensor(y), "code")
    assert got.item() == pytest.approx(code, rel=1e-6)
    # the paper's divergence vanishes when the student matches its target
    matched = torch.logit(torch.tensor(targets[0][:2] + [0.999]))[None]
    assert relation_distillation(matched, torch.tensor([old_logits[0]]), torch.tensor([2])).item() < 2e-3


class _Fixed(nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits)

    def forward(self, x):  # x holds row numbers
        return self.logits[x[:, 0].long()]


def test_mean_entropy_by_hand_and_keeps_the_mode():
    logits = [[0.0, 0.0], [10.0, -10.0], [1.0, 0.0]]
    expected = sum(-sum(p * math.log(p) for p in _softmax(r)) for r in logits) / 3
    model = _Fixed(logits).train()
    assert mean_entropy(model, torch.arange(3.0)[:, None], batch=2) == pytest.approx(expected, rel=1e-5)
    assert model.training


def test_herding_prototype_and_memory_merge():
    f = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 0.2]])
    # normalised: the class mean points at 45 degrees: [1, 1] first, then the pair whose mean stays closest
    order = herding(f, 4)
    assert order[0] == 2 and sorted(order.tolist()) == [0, 1, 2, 3]
    assert herding(f, 2).tolist() == order[:2].tolist()
    assert prototype_index(f) == 2
    memory = {"x": np.arange(6, dtype=np.uint8)[:, None], "y": np.array([0, 0, 0, 1, 1, 1])}
    candidates = {"x": np.array([[10], [11], [12]], np.uint8), "y": np.array([1, 2, 2])}
    merged = merge_memory(memory, candidates, 5)  # 3 classes: 1 each; class 1 replaced by the candidates
    assert merged["y"].tolist() == [0, 1, 2] and merged["x"][:, 0].tolist() == [0, 10, 11]
    assert merge_memory(None, None, 5) is None
    assert merge_memory(None, candidates, 100)["y"].tolist() == [1, 2, 2]


@pytest.mark.slow
def test_gradient_labels_and_reconstruction_match_the_prototype():
    encoder = GradientEncoder(SHAPE, 10, seed=3)
    assert torch.equal(GradientEncoder(SHAPE, 10, seed=3).fc.weight, encoder.fc.weight)  # shared from the seed
    gen = torch.Generator().manual_seed(0)
    x = torch.rand((1, *SHAPE), generator=gen)
    names = [n for n, _ in encoder.named_parameters()]
    target = dict(zip(names, encoder.gradients(x, torch.tensor([7]))))
    assert label_from_gradients(target) == 7
    images, loss = reconstruct(encoder, target, 7, SHAPE, iterations=30, lr=0.1, keep=3, generator=gen)
    assert images.shape == (3, *SHAPE) and loss < 1e-3
    mse = float(((images[-1] - x[0]) ** 2).mean())
    assert 10 * math.log10(1 / mse) > 30  # PSNR in dB: the proxy sees the perturbed prototype, nearly exactly


# ------------------------------------------------------------- client and server
def _ctx(mnist, store, task: int, classes, global_state, assets=None, new_task=True):
    ds, labels = mnist
    idx = np.flatnonzero(np.isin(labels, classes))[:120]
    from fcl_emu.scenario.transforms import to_tensor
    return ClientContext(
        client="client-0003", task=task, task_classes=np.asarray(classes), seen_classes=np.arange(max(classes) + 1),
        x=to_tensor(ds.train_x[idx], ds.mean, ds.std), y=torch.from_numpy(labels[idx].astype(np.int64)),
        settings=TrainingSettings(local_epochs=1, lr=0.05, batch_size=32), global_state=global_state,
        assets=assets or {}, state={}, store=store,
        build_model=lambda n: build_model("cnn", SHAPE, n), mean=tuple(ds.mean), std=tuple(ds.std),
        dataset_classes=10, seed=5, new_task=new_task)


@pytest.fixture(scope="module")
def mnist(mnist_root):
    from fcl_emu.scenario.datasets import load_dataset
    ds = load_dataset("mnist", [mnist_root])
    return ds, np.asarray(ds.train_y)


def _train(part, ctx):
    model = build_model("cnn", SHAPE, int(ctx.global_state["head.weight"].shape[0]))
    load_arrays(model, ctx.global_state)
    return part.train(ctx, model)


def _server(options, recorded: list, **context):
    scenario = SimpleNamespace(num_tasks=2, num_classes=10, task_classes=lambda t: np.arange(2 * t, 2 * t + 2),
                               seen_classes=lambda t: np.arange(2 * t + 2))

    def run_job(kind, inputs, opts):
        recorded.append((kind, dict(inputs), json.loads(json.dumps(opts))))
        out = jobs.run(kind, inputs, opts, CPU)
        return SimpleNamespace(outputs=out.arrays, metrics=out.metrics)

    torch.manual_seed(0)
    return GLFCServer(ServerContext(GLFCOptions(**options), scenario, lambda n: build_model("cnn", SHAPE, n),
                                    run_job=run_job, model_name="cnn", input_shape=SHAPE, rounds_per_task=2,
                                    **context))


def test_client_memory_prototype_channel_and_the_proxy_sees_no_identity(tmp_path, mnist):
    """A client's real prototype gradients travel to the proxy without images or identities; the proxy's best
    model of task 0 becomes task 1's old model; the client keeps exemplars of its task-0 classes."""
    recorded: list = []
    server = _server(TINY, recorded)
    server.start_task(0)
    part, store = GLFCClient(GLFCOptions(**TINY)), ArrayStore(tmp_path / "c3")
    ctx = _ctx(mnist, store, 0, [0, 1], server.round_tensors(0, 1))
    uploads, metrics = _train(part, ctx)
    assert metrics["task_detected"] == 1 and metrics["prototype_gradients"] == 2
    assert store.load(MEMORY) is None and sorted(set(store.load(CANDIDATES)["y"])) == [0, 1]
    items, tensors = ctx.outbox["prototype_gradients"]
    assert items == 2 and all(k.split("/")[0] in ("0", "1") for k in tensors)
    server.on_side_channel(0, "prototype_gradients", tensors)
    server.aggregate(0, 1, [ClientUpdate("client-0003", 120, uploads)])
    kind, inputs, options = recorded[-1]
    encoder = {n for n, _ in GradientEncoder(SHAPE, 10, 0).named_parameters()}
    grads = {k for k in inputs if k.startswith("grad/")}
    assert {k.split("/", 2)[2] for k in grads} == encoder and len(grads) == 2 * len(encoder)
    assert {k.split("/")[0] for k in inputs} == {"grad", "model"}
    assert not any(v.shape[-2:] == SHAPE[-2:] for k, v in inputs.items() if k.startswith("grad/"))
    assert "client" not in json.dumps(options)
    assert sorted(server._monitor["y"].tolist()) == [0, 0, 1, 1]  # labels read from the gradients, 2 kept each
    best = server._best
    server.end_task(0)
    server.start_task(1)
    assets = server.task_assets(1)
    assert set(assets) == {"old_model"}
    assert all(np.array_equal(assets["old_model"]["glfc/old/" + k], v) for k, v in best.items())
    # task 1: the transition moves the candidates into the memory; the relation distillation starts
    ctx = _ctx(mnist, store, 1, [2, 3], server.round_tensors(1, 3), assets=assets["old_model"])
    _, metrics = _train(part, ctx)
    memory = store.load(MEMORY)
    assert sorted(set(memory["y"])) == [0, 1] and len(memory["y"]) <= TINY["memory_size"]
    assert metrics["exemplars"] == len(memory["y"]) and "relation_distillation" in metrics
    assert metrics["prototype_gradients"] == 2  # classes 2 and 3 are new to it; 0 and 1 are in its memory
    # a later job of the same task: no transition, no channel
    ctx = _ctx(mnist, store, 1, [2, 3], server.round_tensors(1, 5), assets=assets["old_model"], new_task=False)
    _, metrics = _train(part, ctx)
    assert metrics["task_detected"] == 0 and not ctx.outbox


def test_entropy_detection_follows_the_rise(tmp_path, mnist):
    part = GLFCClient(GLFCOptions(**{**TINY, "task_detection": "entropy", "entropy_threshold": 0.5}))
    model = build_model("cnn", SHAPE, 4)
    store = ArrayStore(tmp_path / "e")
    ctx = _ctx(mnist, store, 0, [0, 1], state_to_arrays(model))
    part.begin_job(ctx, model)
    h = ctx.metrics["entropy"]
    assert ctx.metrics["task_detected"] == float(h > 0.5) and ctx.metrics["transition"] == 1
    store.save("glfc.detector", {**store.load("glfc.detector"), "entropy": np.float64(h - 0.6)})  # 0.6 lower before
    ctx = _ctx(mnist, store, 0, [0, 1], state_to_arrays(model))  # a fresh context: as after a crash
    part.begin_job(ctx, model)
    assert ctx.metrics["task_detected"] == 1 and ctx.metrics["transition"] == 0  # a false alarm is reported
    assert ctx.metrics["detection_false_alarm"] == 1 and ctx.metrics["detection_missed"] == 0


def test_bad_prototype_gradients_are_refused():
    server = _server(TINY, [])
    encoder = GradientEncoder(SHAPE, 10, 0)
    good = {f"0/{n}": np.zeros(tuple(p.shape), np.float32) for n, p in encoder.named_parameters()}
    server.on_side_channel(0, "prototype_gradients", good)
    with pytest.raises(ValueError, match="names no parameter"):
        server.on_side_channel(0, "prototype_gradients", {**good, "0/evil": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="has shape"):
        server.on_side_channel(0, "prototype_gradients", {**good, "0/fc.bias": np.zeros(11, np.float32)})
    with pytest.raises(ValueError, match="lacks"):
        server.on_side_channel(0, "prototype_gradients", {k: v for k, v in good.items() if k != "0/fc.bias"})
    with pytest.raises(ValueError, match="takes no"):
        server.on_side_channel(0, "synthetic_gradients", good)
    assert len(server._pool) == 1  # the refused messages left nothing behind
    with pytest.raises(ValueError, match="proxy_keep"):
        GLFCOptions(proxy_iterations=5, proxy_keep=6)


def test_a_prototype_gradient_beyond_the_cohort_bound_is_left_out_of_the_proxy():
    """Five prototype gradients of a round, one of them another's scaled by 100: the proxy inverts the four
    within 10 x the round's median norm, and the fifth is counted as refused (its sender unknown). In a later
    round of the task the same gradient comes alone and is judged against the task's earlier ones."""
    recorded, refused = [], []
    server = _server(TINY, recorded, cohort_bound=10.0, refused=refused.append)
    server.start_task(0)
    encoder = GradientEncoder(SHAPE, 10, 0)
    rng = np.random.default_rng(0)
    honest = [{f"{i}/{n}": rng.normal(0, 0.01, tuple(p.shape)).astype(np.float32)
               for n, p in encoder.named_parameters()} for i in range(4)]
    scaled = {k.replace("0/", "4/", 1): 100 * v for k, v in honest[0].items()}
    for tensors in (*honest, scaled):
        server.on_side_channel(0, "prototype_gradients", tensors)
    no_change = ClientUpdate("client-0001", 10, {"delta/" + k: np.zeros_like(v)
                                                 for k, v in server.global_state.items()})
    server.aggregate(0, 1, [no_change])
    _, inputs, _ = recorded[-1]
    assert {k.split("/")[1] for k in inputs if k.startswith("grad/")} == {"0", "1", "2", "3"}
    inverted = [v for k, v in inputs.items() if k.startswith("grad/") and k.endswith("/fc.bias")]
    assert sorted(float(np.abs(v).max()) for v in inverted) == sorted(
        float(np.abs(g[f"{i}/fc.bias"]).max()) for i, g in enumerate(honest))
    assert len(refused) == 1 and "prototype gradient" in refused[0] and "beyond 10 x" in refused[0]
    server.on_side_channel(0, "prototype_gradients", scaled)
    server.aggregate(0, 2, [no_change])
    assert len(refused) == 2 and not any(k.startswith("grad/") for k in recorded[-1][1])


def test_non_finite_prototype_gradients_are_refused_on_the_wire():
    from fcl_emu.wire.framing import WireError, decode, encode
    from fcl_emu.wire.messages import SideChannel

    frames = encode("prototype_gradients", SideChannel(items=1), sender="client-0001", seq=1,
                    tensors={"0/fc.bias": np.array([0.1, np.nan], np.float32)})
    with pytest.raises(WireError) as info:
        decode(frames)
    assert info.value.reason == "non_finite"


def test_restored_server_sends_the_same_old_model(tmp_path, mnist):
    server = _server(TINY, [])
    server.start_task(0)
    encoder = GradientEncoder(SHAPE, 10, 0)
    x = torch.rand((1, *SHAPE), generator=torch.Generator().manual_seed(1))
    grads = {f"0/{n}": g.numpy() for (n, _), g in zip(encoder.named_parameters(), encoder.gradients(x, torch.tensor([1])))}
    server.on_side_channel(0, "prototype_gradients", grads)
    delta = {DELTA + k: np.full_like(v, 0.01) if v.dtype.kind == "f" else v for k, v in server.global_state.items()}
    server.aggregate(0, 1, [ClientUpdate("c", 10, delta)])
    restored = _server(TINY, [])
    restored.load_state_arrays({k: np.array(v) for k, v in server.state_arrays().items()})
    restored.load_state_meta(json.loads(json.dumps(server.state_meta())))
    assert restored._best_score == server._best_score
    assert np.array_equal(restored._monitor["x"], server._monitor["x"])
    for s in (server, restored):
        s.end_task(0)
        s.start_task(1)
    a, b = server.task_assets(1)["old_model"], restored.task_assets(1)["old_model"]
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_config_refuses_glfc_under_secure_aggregation(tmp_path):
    with pytest.raises(ValueError, match="prototype_gradients on a channel of its own"):
        RunConfig.model_validate({"method": "glfc", "secagg": {"enabled": True},
                                  "scenario": {"num_clients": 10}})


# ------------------------------------------------------------- real processes
@pytest.mark.slow
def test_glfc_end_to_end_with_clients_joining_at_the_boundary(tmp_path, mnist_root):
    """Two tasks on MNIST with real edge-node processes and the proxy on a GPU-worker process: clients that
    join at task 1, clients that keep only old classes, the prototype-gradient channel, the old model."""
    config = small_config(tmp_path / "c.yaml", method="glfc", method_options=TINY,
                          # 200 samples a client and task: the assertions read what travels, not how well it trains
                          scenario={"num_clients": 8, "new_clients_per_task": 2, "old_only_fraction": 0.2,
                                    "samples_per_client_task": 200},
                          rounds={"clients_per_round": 4, "rounds_per_task": 2},
                          training={"local_epochs": 1}, gpu={"workers": 1})
    run_dir = tmp_path / "run"
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir))
    assert proc.wait(timeout=300) == 0
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.rounds_skipped == 0
    assert summary.clients.joined == 8
    sent = summary.messages
    assert sent["prototype_gradients/received"] > 0 and summary.bytes["prototype_gradients"]["received"] > 0
    assert summary.gpu_jobs.by_kind["glfc.proxy"].failed == 0
    assert 0 < sent["old_model/sent"] <= 4 * 2  # task 1 only, once per participant
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    assert all("relation_distillation" in r["client_metrics"] for r in rounds if r["task"] == 1)
    assert all("relation_distillation" not in r["client_metrics"] for r in rounds if r["task"] == 0)
    proxy = [e for e in events if e["event"] == "job" and e["job_kind"] == "glfc.proxy"]
    assert proxy and all(e["worker"] != "coordinator" for e in proxy)
    assert sum(e["metrics"]["gradients"] for e in proxy) >= sent["prototype_gradients/received"]  # >= 1 each
    # the proxy's check read back from the finished run: one prototype per class, each label recovered from its
    # gradient alone (a one-sample gradient gives it away), every figure finite
    quality = glfc_table.reconstruction_quality(run_dir, str(mnist_root))
    assert sorted(r["class"] for r in quality["per_class"]) == list(range(10))
    assert quality["labels_recovered"] == 1.0
    assert all(math.isfinite(r["psnr_perturbed_vs_prototype"]) and math.isfinite(r["match_loss"])
               for r in quality["per_class"])
