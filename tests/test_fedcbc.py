"""FedCBC: the VAE loss (eq. 5) and distillation by hand, the VAE classifier (eq. 6), selective knowledge fusion
(eq. 7) of public and private classes, the client's continual personalization, bad uploads, options, the secagg
refusal, checkpoints, and a short real-process run."""

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
from fcl_emu.aggregation.update import ClientUpdate
from fcl_emu.methods.base import ClientContext, ServerContext, TrainingSettings
from fcl_emu.methods.fedcbc import (EXTRACTOR, VAES, FedCBCClient, FedCBCOptions, FedCBCServer, build_vae,
                                    fit_vae, join_vaes, resolve_decoder, split_vaes)
from fcl_emu.methods.fedcbc_fusion import distillation_loss
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.state import state_to_arrays
from fcl_emu.methods.models.vae import VAE, VAEClassifier, gaussian_kl, vae_loss
from fcl_emu.monitoring.results import RunSummary
from tests.conftest import fcl_emu, keyed, small_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = (1, 28, 28)
CPU = torch.device("cpu")
D = 256  # the cnn backbone's feature width: the VAEs' input in server tests
TINY = {"features": "pretrained", "decoder_output": "linear", "pretrain_epochs": 1, "vae_hidden": 32,
        "vae_latent": 8, "pseudo_samples": 64, "fusion_epochs": 20}


def _blobs(centers: torch.Tensor, n: int, seed: int, spread: float = 0.3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [c + spread * torch.randn((n, len(c)), generator=gen) for c in centers]


def _trained(o: FedCBCOptions, data: torch.Tensor, seed: int, epochs: int = 40) -> VAE:
    vae = build_vae(o, data.shape[1], seed=seed)
    fit_vae(vae, data, [], o, epochs, 32, torch.Generator().manual_seed(seed), CPU)
    return vae


def _arrays(vae: VAE) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in state_to_arrays(vae).items()}


def _mean_loss(vae: VAE, x: torch.Tensor, beta: float) -> float:
    with torch.no_grad():
        recon, mean, log_var = vae(x, sample=False)
        return vae_loss(recon, x, mean, log_var, beta).item()


# ------------------------------------------------------------------ by hand
def _hand_vae(sigmoid_output: bool = False) -> VAE:
    """d = 2, h = 2, k = 1 with known weights."""
    vae = VAE(2, 2, 1, sigmoid_output=sigmoid_output)
    weights = {"encoder.0.weight": [[1.0, 0.0], [0.0, 1.0]], "encoder.0.bias": [0.0, 0.0],
               "mean.weight": [[1.0, 1.0]], "mean.bias": [0.0], "log_var.weight": [[0.0, 0.0]],
               "log_var.bias": [math.log(0.25)], "decoder.0.weight": [[1.0], [2.0]], "decoder.0.bias": [0.0, 0.0],
               "decoder.2.weight": [[1.0, 0.0], [0.0, 1.0]], "decoder.2.bias": [0.5, -0.5]}
    with torch.no_grad():
        for name, p in vae.named_parameters():
            p.copy_(torch.tensor(weights[name]))
    return vae


def _hand_loss(x, z, beta):
    """Eq. 5 of the hand VAE at latent ``z``."""
    mu = math.tanh(x[0]) + math.tanh(x[1])
    recon = [math.tanh(z) + 0.5, math.tanh(2 * z) - 0.5]
    kl = 0.5 * (-math.log(0.25) - 1 + 0.25 + mu ** 2)
    return sum((a - b) ** 2 for a, b in zip(x, recon)) + beta * kl, mu


def test_vae_loss_eq5_by_hand():
    vae, x = _hand_vae(), [0.5, -1.0]
    expected, mu = _hand_loss(x, math.tanh(0.5) + math.tanh(-1.0), beta=0.5)
    recon, mean, log_var = vae(torch.tensor([x]), sample=False)
    assert mean.item() == pytest.approx(mu) and log_var.item() == pytest.approx(math.log(0.25))
    assert vae_loss(recon, torch.tensor([x]), mean, log_var, 0.5).item() == pytest.approx(expected, rel=1e-6)
    # sampled latent: z = mu + sigma * eps with eps from the generator
    eps = torch.randn((1, 1), generator=torch.Generator().manual_seed(3)).item()
    recon, mean, log_var = vae(torch.tensor([x]), generator=torch.Generator().manual_seed(3))
    expected, _ = _hand_loss(x, mu + 0.5 * eps, beta=2.0)
    assert vae_loss(recon, torch.tensor([x]), mean, log_var, 2.0).item() == pytest.approx(expected, rel=1e-6)
    # the mean over a batch
    xs = torch.tensor([x, [0.0, 0.0]])
    expected = (_hand_loss(x, mu, 0.5)[0] + _hand_loss([0.0, 0.0], 0.0, 0.5)[0]) / 2
    assert _mean_loss(vae, xs, 0.5) == pytest.approx(expected, rel=1e-6)


def test_sigmoid_decoder_by_hand_and_where_it_is_the_default():
    def sigmoid(v):
        return 1 / (1 + math.exp(-v))

    x = [0.5, 0.25]  # pixels in [0, 1]
    mu = math.tanh(0.5) + math.tanh(0.25)
    recon, _, _ = _hand_vae(sigmoid_output=True)(torch.tensor([x]), sample=False)
    assert recon[0].tolist() == pytest.approx([sigmoid(math.tanh(mu) + 0.5), sigmoid(math.tanh(2 * mu) - 0.5)])
    kl = 0.5 * (-math.log(0.25) - 1 + 0.25 + mu ** 2)
    expected = (x[0] - sigmoid(math.tanh(mu) + 0.5)) ** 2 + (x[1] - sigmoid(math.tanh(2 * mu) - 0.5)) ** 2 + 0.5 * kl
    assert _mean_loss(_hand_vae(sigmoid_output=True), torch.tensor([x]), 0.5) == pytest.approx(expected, rel=1e-6)
    # the same parameters either way: the sigmoid changes no state on the wire
    assert _arrays(_hand_vae(True)).keys() == _arrays(_hand_vae(False)).keys()
    # auto: a sigmoid over pixels (grey images, as the code on MNIST), linear over an extractor's features
    assert resolve_decoder(FedCBCOptions(), (1, 28, 28)).decoder_output == "sigmoid"
    assert resolve_decoder(FedCBCOptions(), (3, 32, 32)).decoder_output == "linear"
    assert resolve_decoder(FedCBCOptions(features="pretrained"), (1, 28, 28)).decoder_output == "linear"
    assert resolve_decoder(FedCBCOptions(decoder_output="sigmoid"), (3, 32, 32)).decoder_output == "sigmoid"
    assert isinstance(build_vae(FedCBCOptions(decoder_output="sigmoid"), 4).decoder[-1], nn.Sigmoid)
    with pytest.raises(ValueError, match="resolve_decoder"):
        build_vae(FedCBCOptions(), 4)


def test_gaussian_kl_and_distillation_by_hand():
    # KL(N(1, 0.25) || N(0.5, 4)) and KL(N(0, 1) || N(0, 1)) = 0
    got = gaussian_kl(torch.tensor([[1.0]]), torch.tensor([[math.log(0.25)]]), torch.tensor([[0.5]]),
                      torch.tensor([[math.log(4.0)]]))
    assert got.item() == pytest.approx(0.5 * (math.log(4 / 0.25) - 1 + (0.25 + 0.25) / 4), rel=1e-6)
    assert gaussian_kl(torch.zeros(3, 2), torch.zeros(3, 2)).tolist() == [0.0, 0.0, 0.0]
    # distillation: eq. 5 + alpha KL(student || averaged teachers); two teachers with means 1 and 3 average to 2
    o = FedCBCOptions(alpha=0.1, beta=0.5)
    student, x = _hand_vae(), [0.5, -1.0]
    teachers = []
    for bias in (1.0 - (math.tanh(0.5) + math.tanh(-1.0)), 3.0 - (math.tanh(0.5) + math.tanh(-1.0))):
        t = _hand_vae()
        with torch.no_grad():
            t.mean.bias.fill_(bias)
            t.log_var.bias.fill_(0.0)
        teachers.append(t)
    eps = torch.randn((1, 1), generator=torch.Generator().manual_seed(7)).item()
    loss, own, kd = distillation_loss(student, torch.tensor([x]), teachers, o, torch.Generator().manual_seed(7))
    own_hand, mu = _hand_loss(x, math.tanh(0.5) + math.tanh(-1.0) + 0.5 * eps, 0.5)
    kd_hand = 0.5 * (0.0 - math.log(0.25) - 1 + (0.25 + (mu - 2.0) ** 2) / 1.0)
    assert own == pytest.approx(own_hand, rel=1e-6) and kd == pytest.approx(kd_hand, rel=1e-6)
    assert loss.item() == pytest.approx(own_hand + 0.1 * kd_hand, rel=1e-6)
    loss, own, kd = distillation_loss(student, torch.tensor([x]), [], o)
    assert kd == 0.0 and loss.item() == own


def test_vae_classifier_separates_gaussian_blobs():
    """Eq. 6: one VAE per blob; the class whose VAE reconstructs best wins; a class without a VAE is -inf."""
    o = FedCBCOptions(**TINY)
    centers = 3.0 * torch.eye(3, 6)
    train = _blobs(centers, 200, seed=0)
    vaes = {c: _trained(o, train[c], seed=c) for c in range(3)}
    clf = VAEClassifier(nn.Identity(), vaes, 4, o.beta)
    test = torch.cat(_blobs(centers, 100, seed=1))
    logits = clf(test)
    assert logits.shape == (300, 4) and torch.isinf(logits[:, 3]).all() and (logits[:, 3] < 0).all()
    accuracy = (logits.argmax(dim=1) == torch.arange(3).repeat_interleave(100)).float().mean().item()
    assert accuracy >= 0.99
    with pytest.raises(ValueError, match="do not fit"):
        VAEClassifier(nn.Identity(), vaes, 2, o.beta)


def _constant_vae(recon: list[float], mean: float) -> VAE:
    """d = 2, h = 2, k = 1: the decoder outputs ``recon`` whatever the latent, the posterior is N(mean, 1)."""
    vae = VAE(2, 2, 1)
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        vae.mean.bias.fill_(mean)
        vae.decoder[2].bias.copy_(torch.tensor(recon))
    return vae


def test_vae_classifier_prediction_reconstruction_or_loss_by_hand():
    """Eq. 6: the paper's score is the squared reconstruction error alone, the code's the eq.-5 loss. At
    x = (0.5, 0): VAE 0 reconstructs (0, 0), error 0.25, with its posterior N(3, 1), KL 0.5 (1 + 9 - 1) = 4.5;
    VAE 1 reconstructs (1, 1), error 0.25 + 1 = 1.25, posterior N(0, 1), KL 0. At beta 0.5 the losses are
    0.25 + 2.25 = 2.5 and 1.25: the paper's form predicts class 0, the code's class 1."""
    vaes = {0: _constant_vae([0.0, 0.0], 3.0), 1: _constant_vae([1.0, 1.0], 0.0)}
    x = torch.tensor([[0.5, 0.0]])
    with torch.no_grad():
        paper = VAEClassifier(nn.Identity(), vaes, 3, 0.5)(x)
        code = VAEClassifier(nn.Identity(), vaes, 3, 0.5, prediction="loss")(x)
    assert paper[0, :2].tolist() == pytest.approx([-0.25, -1.25], abs=1e-6) and paper[0, 2].item() == -math.inf
    assert code[0, :2].tolist() == pytest.approx([-2.5, -1.25], abs=1e-6) and code[0, 2].item() == -math.inf
    assert paper.argmax(dim=1).item() == 0 and code.argmax(dim=1).item() == 1
    assert FedCBCOptions().prediction == "reconstruction"
    with pytest.raises(ValueError, match="prediction"):
        VAEClassifier(nn.Identity(), vaes, 3, 0.5, prediction="kl")


# ------------------------------------------------------------------- fusion
def test_fusion_of_two_owners_explains_both_better_than_either():
    """Two clients hold the same class with divergent features; the fused VAE (eq. 7) explains both."""
    o = FedCBCOptions(**{**TINY, "fusion_epochs": 60})
    a, b = _blobs(torch.tensor([[2.0, 0, 0, 0, 0, 0], [0, 0, 0, 2.0, 0, 0]]), 300, seed=2)
    local_a, local_b = _trained(o, a, seed=1), _trained(o, b, seed=2)
    inputs = {f"start/5/{k}": v for k, v in _arrays(local_a).items()}
    for i, vae in enumerate((local_a, local_b)):
        inputs.update({f"source/5/{i}/{k}": v for k, v in _arrays(vae).items()})
    out = jobs.run("fedcbc.fuse", inputs, {"method_options": o.model_dump(), "feature_dim": 6, "seed": 0}, CPU)
    assert out.metrics["classes"] == 1
    fused = build_vae(o, 6, split_vaes(out.arrays, "")[5])
    both = torch.cat(_blobs(torch.tensor([[2.0, 0, 0, 0, 0, 0], [0, 0, 0, 2.0, 0, 0]]), 100, seed=3))
    fused_loss = _mean_loss(fused, both, o.beta)
    assert fused_loss < _mean_loss(local_a, both, o.beta) and fused_loss < _mean_loss(local_b, both, o.beta)
    with pytest.raises(ValueError, match="start and at least one source"):
        jobs.run("fedcbc.fuse", {k: v for k, v in inputs.items() if k.startswith("start/")},
                 {"method_options": o.model_dump(), "feature_dim": 6}, CPU)


def _scenario(num_classes: int = 4):
    """Two tasks of two classes; a tiny labelled training set for the server's pretraining."""
    gen = np.random.default_rng(0)
    labels = np.repeat(np.arange(num_classes), 5)
    dataset = SimpleNamespace(train_x=gen.integers(0, 256, (len(labels), 28, 28, 1), dtype=np.uint8),
                              mean=(0.5,), std=(0.25,))
    return SimpleNamespace(num_tasks=2, num_classes=num_classes, dataset=dataset, train_labels=labels,
                           task_classes=lambda t: np.arange(2 * t, 2 * t + 2),
                           seen_classes=lambda t: np.arange(2 * t + 2),
                           active_clients=lambda t: np.arange(2),
                           client_classes=lambda i, t: np.arange(2 * t, 2 * t + 2))


def _server(options: dict, recorded: list | None = None, **context) -> FedCBCServer:
    def run_job(kind, inputs, opts):
        if recorded is not None:
            recorded.append(kind)
        out = jobs.run(kind, inputs, json.loads(json.dumps(opts)), CPU)
        return SimpleNamespace(outputs=out.arrays, metrics=out.metrics)

    torch.manual_seed(0)
    return FedCBCServer(ServerContext(FedCBCOptions(**options), _scenario(), lambda n: build_model("cnn", SHAPE, n),
                                      run_job=run_job, model_name="cnn", input_shape=SHAPE, rounds_per_task=2,
                                      **context))


def _upload(vaes: dict[int, VAE]) -> dict[str, np.ndarray]:
    return join_vaes({c: _arrays(v) for c, v in vaes.items()}, VAES)


@pytest.fixture(scope="module")
def feature_vaes():
    """Local VAEs over 256-d blobs: class 0 held by two clients (public), class 1 by one (private)."""
    o = FedCBCOptions(**TINY)
    centers = 2.0 * torch.eye(2, D)
    data = _blobs(centers, 200, seed=4)
    return o, centers, {"c0-a": _trained(o, data[0][:100], 10), "c0-b": _trained(o, data[0][100:], 11),
                        "c1": _trained(o, data[1], 12)}


def test_server_fuses_public_classes_and_keeps_private_ones(feature_vaes):
    o, centers, v = feature_vaes
    recorded: list = []
    server = _server(TINY, recorded)
    server.start_task(0)
    assert recorded == ["fedcbc.pretrain"] and server.global_state == {}
    assets = server.task_assets(0)
    assert set(assets) == {"feature_extractor"} and all(k.startswith(EXTRACTOR) for k in assets["feature_extractor"])
    assert server.round_tensors(0, 1) == {}  # no global VAE yet
    server.aggregate(0, 1, [ClientUpdate("a", 100, _upload({0: v["c0-a"], 1: v["c1"]})),
                            ClientUpdate("b", 100, _upload({0: v["c0-b"]}))])
    assert recorded == ["fedcbc.pretrain", "fedcbc.fuse"]
    assert sorted(server._vaes) == [0, 1]
    assert all(np.array_equal(server._vaes[1][k], a) for k, a in _arrays(v["c1"]).items())  # one source: kept
    payload = server.round_tensors(0, 2)
    assert set(split_vaes(payload, VAES)) == {0, 1} and all(not a.flags.writeable for a in payload.values())
    assert server.round_tensors(0, 2) is payload  # the same arrays until the VAEs change
    # the private class goes through fusion too once it has a global VAE, and survives it
    server.aggregate(0, 2, [ClientUpdate("a", 100, _upload({1: v["c1"]}))])
    assert recorded[-1] == "fedcbc.fuse"
    clf = server.eval_model()
    assert isinstance(clf, VAEClassifier) and clf.prediction == "reconstruction"  # eq. 6, the paper's
    assert _server({**TINY, "prediction": "loss"}).eval_model().prediction == "loss"  # the code's
    test = torch.cat(_blobs(centers, 50, seed=5))
    with torch.no_grad():
        predicted = clf.scores(test).argmax(dim=1)
    assert (predicted == torch.arange(2).repeat_interleave(50)).float().mean() >= 0.95
    with torch.no_grad():
        assert clf(torch.zeros((2, *SHAPE))).shape == (2, 2)  # images -> frozen extractor -> logits


def test_a_scaled_vae_beyond_the_cohort_bound_is_left_out_of_the_fusion(feature_vaes):
    """An insider's VAE scaled by 50, measured by its norm against the median of the round's and the global
    VAEs' norms: its upload is left out whole and counted, and the honest sources make the global VAEs as
    without it; in a later round the same holds for a scaled copy of its class's global VAE."""
    o, _, v = feature_vaes
    refused: list = []
    server, clean = _server(TINY, cohort_bound=10.0, refused=refused.append), _server(TINY)
    honest = [ClientUpdate("a", 100, _upload({0: v["c0-a"], 1: v["c1"]})),
              ClientUpdate("b", 100, _upload({0: v["c0-b"]}))]
    for s in (server, clean):
        s.start_task(0)
    scaled = join_vaes({1: {k: 50 * a for k, a in _arrays(v["c1"]).items()}}, VAES)
    server.aggregate(0, 1, [*honest, ClientUpdate("evil", 100, scaled)])
    clean.aggregate(0, 1, honest)
    assert len(refused) == 1 and "evil's VAE of class 1" in refused[0] and "beyond 10 x" in refused[0]
    for c in (0, 1):
        assert all(np.array_equal(server._vaes[c][k], clean._vaes[c][k]) for k in clean._vaes[c])
    scaled_global = join_vaes({0: {k: 50 * a for k, a in server._vaes[0].items()}}, VAES)
    server.aggregate(0, 2, [honest[1], ClientUpdate("evil", 100, scaled_global)])  # a cohort of two, and the globals
    clean.aggregate(0, 2, [honest[1]])
    assert len(refused) == 2 and "evil's VAE of class 0" in refused[1]
    for c in (0, 1):
        assert all(np.array_equal(server._vaes[c][k], clean._vaes[c][k]) for k in clean._vaes[c])


# ------------------------------------------------------------------- client
def _ctx(store, global_state, assets, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return ClientContext(
        client="client-0001", task=0, task_classes=np.arange(2), seen_classes=np.arange(2),
        x=torch.randn((40, *SHAPE), generator=gen), y=torch.arange(2).repeat_interleave(20),
        settings=TrainingSettings(local_epochs=1, lr=0.05, batch_size=16), global_state=global_state,
        assets=assets, state={}, store=store, build_model=lambda n: build_model("cnn", SHAPE, n), seed=seed,
        new_task=True)


def test_client_trains_one_vae_per_class_and_distils_the_global_ones(tmp_path):
    o = FedCBCOptions(**TINY)
    part = FedCBCClient(o)
    backbone = build_model("cnn", SHAPE, 0).backbone
    assets = {EXTRACTOR + k: np.array(v) for k, v in state_to_arrays(backbone).items()}
    store = ArrayStore(tmp_path / "c1")
    with pytest.raises(ValueError, match="feature_extractor"):
        part.train(_ctx(store, {}, {}), None)
    uploads, metrics = part.train(_ctx(store, {}, assets), None)
    vaes = split_vaes(uploads, VAES)
    assert set(vaes) == {0, 1} and set(uploads) == {k for k in uploads if k.startswith(VAES)}
    assert metrics["classes"] == 2 and metrics["teachers"] == 0 and metrics["distillation"] == 0
    assert all(np.array_equal(store.load(f"fedcbc.vae.{c}")[k], vaes[c][k]) for c in (0, 1) for k in vaes[c])
    # the next job: its stored VAEs go on training, the global VAE of class 1 is the teacher and replay source
    global_vae = join_vaes({1: _arrays(build_vae(o, D, seed=99))}, VAES)
    uploads, metrics = part.train(_ctx(store, global_vae, assets, seed=6), None)
    assert metrics["teachers"] == 1 and metrics["distillation"] > 0
    assert not np.array_equal(split_vaes(uploads, VAES)[0]["mean.weight"], vaes[0]["mean.weight"])


def test_grey_images_are_modelled_as_pixels_without_an_extractor(tmp_path):
    """MNIST as the paper and code have it: the VAEs model the 784 pixels in [0, 1]; no pretraining job, no
    extractor asset; the client and the evaluator see the same features."""
    recorded: list = []
    options = {**TINY, "features": "auto", "decoder_output": "auto"}
    server = _server(options, recorded)
    server.start_task(0)
    assert recorded == [] and server.task_assets(0) == {} and server.feature_dim == 28 * 28
    part = FedCBCClient(FedCBCOptions(**options))
    ctx = _ctx(ArrayStore(tmp_path / "c1"), {}, {})
    x01 = ctx.x * 0.25 + 0.5  # what the pixels were before the scenario's normalisation (mean 0.5, std 0.25)
    ctx.mean, ctx.std = (0.5,), (0.25,)
    assert torch.allclose(part.extractor(ctx)(ctx.x), x01.flatten(1), atol=1e-6)
    uploads, metrics = part.train(ctx, None)
    assert metrics["classes"] == 2 and uploads["fedcbc/vae/0/encoder.0.weight"].shape == (32, 28 * 28)
    server.aggregate(0, 1, [ClientUpdate("a", 40, uploads)])
    clf = server.eval_model()
    with torch.no_grad():  # the evaluator's features are the client's: each class's own VAE explains it best
        assert torch.allclose(clf.extractor(ctx.x), x01.flatten(1), atol=1e-6)
        assert clf(ctx.x).shape == (40, 2)
    assert server.options.decoder_output == "sigmoid" and isinstance(clf.vaes["0"].decoder[-1], nn.Sigmoid)
    colour = FedCBCServer(ServerContext(FedCBCOptions(**options), _scenario(),
                                        lambda n: build_model("cnn", (3, 32, 32), n),
                                        run_job=None, model_name="cnn", input_shape=(3, 32, 32)))
    assert not colour.pixels and colour.options.decoder_output == "linear"  # colour images: the extractor


# ------------------------------------------------------------------ bad input
def test_bad_uploads_are_refused(feature_vaes):
    o, _, v = feature_vaes
    server = _server(TINY)
    server.start_task(0)
    good = _upload({0: v["c0-a"]})
    server.check_update(0, good)
    some = next(iter(good))
    cases = {
        "uploads only": {**good, "delta/head.weight": np.zeros(2, np.float32)},
        "not fedcbc/vae/<class>/<param>": {VAES + "x/mean.bias": np.zeros(8, np.float32)},
        "has not introduced": join_vaes({2: _arrays(v["c0-a"])}, VAES),
        "missing": {k: a for k, a in good.items() if k != some},
        "unknown": {**good, VAES + "0/extra.weight": np.zeros(2, np.float32)},
        "expected float32": {**good, VAES + "0/mean.bias": np.zeros(3, np.float32)},
        "NaN": {**good, VAES + "0/mean.bias": np.full(8, np.nan, np.float32)},
    }
    for message, tensors in cases.items():
        with pytest.raises(ValueError, match=message):
            server.check_update(0, tensors)


def test_the_coordinator_rejects_a_bad_upload_at_receipt(tmp_path, mnist_root):
    """ServerPart.check_update runs when an update arrives: a misfit VAE is a bad_shape rejection."""
    from fcl_emu.coordinator.lifecycle import Coordinator
    from fcl_emu.runconfig import load_config
    from fcl_emu.wire.framing import WireError, decode, encode
    from fcl_emu.wire.messages import Update

    config = load_config(small_config(tmp_path / "c.yaml", method="fedcbc", method_options=TINY,
                                      scenario={"num_clients": 3, "partition": "accessible_classes"},
                                      rounds={"clients_per_round": 3}),
                         {"data_root": [str(mnist_root)]})
    config, _ = keyed(config, tmp_path / "keys")
    coordinator = Coordinator(config)
    coordinator.registry.join("client-0000", 0, "node-0", 0)
    try:
        bad = {VAES + "0/mean.bias": np.zeros(3, np.float32)}
        msg = decode(encode("update", Update(num_samples=5, train_time_s=0.1, loss=0.0), sender="client-0000",
                            seq=1, tensors=bad))
        with pytest.raises(WireError, match="VAE of class 0") as info:
            coordinator.dispatcher._check_update("client-0000", msg, 0)
        assert info.value.reason == "bad_shape"
    finally:
        coordinator.close()


def test_non_finite_vaes_are_refused_on_the_wire():
    from fcl_emu.wire.framing import WireError, decode, encode
    from fcl_emu.wire.messages import Update

    frames = encode("update", Update(num_samples=1, train_time_s=0.1, loss=0.0), sender="client-0001", seq=1,
                    tensors={VAES + "0/mean.bias": np.array([0.1, np.inf], np.float32)})
    with pytest.raises(WireError) as info:
        decode(frames)
    assert info.value.reason == "non_finite"


def test_options_and_secagg_refusal():
    for bad in ({"pretrain_fraction": 0}, {"pretrain_fraction": 1.5}, {"vae_latent": 0},
                {"pseudo_noise": "laplace"}, {"alpha": -1}, {"unknown": 1}):
        with pytest.raises(ValueError):
            FedCBCOptions(**bad)
    with pytest.raises(ValueError, match=r"uploads per-class VAEs \(fedcbc/vae/<class>/\*\) per client"):
        RunConfig.model_validate({"method": "fedcbc", "secagg": {"enabled": True}, "scenario": {"num_clients": 10}})


# ----------------------------------------------------------------- checkpoints
def test_restored_server_behaves_identically(feature_vaes):
    o, centers, v = feature_vaes
    server = _server(TINY)
    server.start_task(0)
    server.aggregate(0, 1, [ClientUpdate("a", 1, _upload({0: v["c0-a"], 1: v["c1"]})),
                            ClientUpdate("b", 1, _upload({0: v["c0-b"]}))])
    restored = _server(TINY)
    restored.load_state_arrays({k: np.array(a) for k, a in server.state_arrays().items()})
    restored.load_state_meta(json.loads(json.dumps(server.state_meta())))
    for task, rnd in ((0, 2), (1, 3)):
        a, b = server.round_tensors(task, rnd), restored.round_tensors(task, rnd)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    a, b = server.task_assets(0)["feature_extractor"], restored.task_assets(0)["feature_extractor"]
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    x = torch.randn((4, *SHAPE), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(server.eval_model()(x), restored.eval_model()(x))
    update = [ClientUpdate("a", 1, _upload({0: v["c0-b"], 1: v["c1"]}))]
    for s in (server, restored):  # the next fusion is seeded: the same global VAEs
        s.aggregate(0, 2, update)
    for c in (0, 1):
        assert all(np.array_equal(server._vaes[c][k], restored._vaes[c][k]) for k in server._vaes[c])


# ------------------------------------------------------------- real processes
@pytest.mark.slow
@pytest.mark.parametrize("features", ["pretrained"])
def test_fedcbc_end_to_end(tmp_path, mnist_root, features):
    """Two tasks on MNIST with private classes: real edge nodes train VAEs without a classifier on an extractor
    pretrained on a GPU-worker process that travels once per task and client, the fusion runs on the worker.
    ``features: pixels`` passes here too (no pretraining job, no extractor sent); it is left out of the suite
    for time, its client and server paths tested above without processes."""
    options = {"features": features, "pretrain_epochs": 3, "fusion_epochs": 2, "pseudo_samples": 50}
    config = small_config(tmp_path / "c.yaml", method="fedcbc", method_options=options,
                          scenario={"num_clients": 4, "partition": "private_classes"},
                          rounds={"clients_per_round": 4, "rounds_per_task": 2},
                          training={"local_epochs": 1}, gpu={"workers": 1})
    run_dir = tmp_path / "run"
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir))
    assert proc.wait(timeout=400) == 0
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.rounds_skipped == 0
    matrix = summary.accuracy_matrix
    assert len(matrix) == 2 and matrix[0][1] is None and all(a is not None for a in matrix[1])
    assert matrix[0][0] > 50  # 5 classes: chance is 20 %
    # GA as the paper measures it: over the whole test set, the 5 classes not seen at task 0 counting as wrong
    seen = summary.accuracy_seen
    assert summary.accuracy_all[1] == pytest.approx(seen[1])  # every class seen
    assert 0.4 * seen[0] < summary.accuracy_all[0] < 0.6 * seen[0]  # about half of MNIST's test set
    jobs_by_kind = summary.gpu_jobs.by_kind
    assert jobs_by_kind["fedcbc.fuse"].failed == 0
    # bytes: the VAEs travel in updates and train requests, the extractor once per task and client
    o = resolve_decoder(FedCBCOptions(**options), SHAPE)
    vae_bytes = sum(a.nbytes for a in state_to_arrays(build_vae(o, D if features == "pretrained" else 784)).values())
    extractor_bytes = sum(a.nbytes for a in state_to_arrays(build_model("cnn", SHAPE, 0).backbone).values())
    sent, nbytes = summary.messages, summary.bytes
    if features == "pretrained":
        assert jobs_by_kind["fedcbc.pretrain"].failed == 0
        assert sent["feature_extractor/sent"] == 4 * 2
        assert nbytes["feature_extractor"]["sent"] > 8 * extractor_bytes
    else:
        assert "fedcbc.pretrain" not in jobs_by_kind and "feature_extractor/sent" not in sent
    assert nbytes["update"]["received"] > sent["update/received"] * vae_bytes  # at least one class each
    assert nbytes["train_request"]["sent"] > 3 * 4 * vae_bytes  # every round but the first carries VAEs
