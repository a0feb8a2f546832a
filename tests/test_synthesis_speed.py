"""The data-free synthesis jobs' faster computation gives the reference's results: the generator's
upsample + 3x3 convolution pairs computed as 2x2 phase convolutions (``Generator.phase_conv``) are the same
function of the same weights (equal in float64, float32 rounding apart), and whole jobs at a tiny budget give
the reference path's outputs when run in float64 (in float32 the rounding differences, which Adam's steps and
the choice of each round's lowest-loss batch amplify, stay within 2 % of the range on average)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fcl_emu.methods import jobs
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.methods.models.generators import Generator, TextConditionedGenerator, upsample_conv
from fcl_emu.methods.models.state import state_to_arrays

SHAPE = (1, 28, 28)
CPU = torch.device("cpu")


@pytest.fixture
def reference_generator(monkeypatch):
    """Run ``Generator`` as written (upsampling, then the 3x3 convolution) while set."""
    def use(reference: bool) -> None:
        monkeypatch.setattr(Generator, "phase_conv", not reference)
    return use


@pytest.fixture
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _grads(fn, *tensors: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for t in tensors:
        t.grad = None
    out = fn()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weights).sum().backward()
    return out.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_upsample_conv_is_the_upsampling_then_the_convolution(dtype, tol):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 5, 3, padding=1).to(dtype)
    x = torch.randn(3, 8, 6, 7, dtype=dtype, requires_grad=True)
    params = (x, conv.weight, conv.bias)
    fast, fast_grads = _grads(lambda: upsample_conv(x, conv), *params)
    ref, ref_grads = _grads(lambda: conv(F.interpolate(x, scale_factor=2, mode="nearest")), *params)
    assert fast.shape == (3, 5, 12, 14)
    for a, b in zip([fast, *fast_grads], [ref, *ref_grads]):
        assert torch.allclose(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("make", [
    lambda: Generator(20, (1, 28, 28), width=16, output="tanh_bn", bn_eps=0.8),  # MFCL
    lambda: Generator(20, (3, 32, 32), width=16, output="sigmoid"),  # TARGET
    lambda: Generator(20, (3, 64, 64), width=8, output="sigmoid"),  # three upsamplings
    lambda: TextConditionedGenerator(20, (1, 28, 28), batch=6, noise_dim=12, chunk=3, width=16),  # LANDER
])
def test_generator_phase_convolutions_compute_the_same_function(make, reference_generator, float64):
    torch.manual_seed(0)
    gen = make()
    z = torch.randn(6, 20)
    params = list(gen.parameters())
    reference_generator(True)
    ref, ref_grads = _grads(lambda: gen(z), *params)
    reference_generator(False)
    fast, fast_grads = _grads(lambda: gen(z), *params)
    for a, b in zip([fast, *fast_grads], [ref, *ref_grads]):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-9 * max(b.abs().max().item(), 1.0))


def _teacher() -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = build_model("cnn_bn", SHAPE, 4).float()
    model.train()
    with torch.no_grad():  # BatchNorm statistics to match
        for _ in range(3):
            model(torch.randn(64, *SHAPE, dtype=torch.float32) * 0.8 + 0.2)
    return {"model/" + k: v for k, v in state_to_arrays(model.eval()).items()}


def _run(kind: str, method_options: dict) -> jobs.JobOutput:
    return jobs.run(kind, _teacher(), {"method_options": method_options, "model": "cnn_bn",
                                       "input_shape": list(SHAPE), "mean": [0.1307], "std": [0.3081], "seed": 3}, CPU)


JOBS = [
    ("mfcl.generator", dict(generator_iterations=2, generator_width=8, generator_batch=12)),
    ("target.synthesize", dict(synthesis_rounds=2, warmup=1, generator_steps=2, synthesis_batch=12,
                               generator_width=8, student_steps=2)),
]


@pytest.mark.parametrize("kind, options", JOBS)
def test_jobs_give_the_reference_results_in_float64(kind, options, reference_generator, float64):
    reference_generator(True)
    ref = _run(kind, options)
    reference_generator(False)
    fast = _run(kind, options)
    assert ref.arrays.keys() == fast.arrays.keys()
    for key, value in ref.arrays.items():
        if value.dtype == np.uint8:  # images: equal but for a pixel on a rounding boundary
            assert np.mean(value != fast.arrays[key]) < 1e-3
        else:
            np.testing.assert_allclose(fast.arrays[key], value, rtol=1e-7, atol=1e-9)
    for name, value in ref.metrics.items():
        assert fast.metrics[name] == pytest.approx(value, rel=1e-7, abs=1e-9), name


@pytest.mark.parametrize("kind, options", JOBS)
def test_jobs_in_float32_stay_within_rounding_of_the_reference(kind, options, reference_generator):
    reference_generator(True)
    ref = _run(kind, options)
    reference_generator(False)
    fast = _run(kind, options)
    for key, value in ref.arrays.items():
        a, b = value.astype(np.float64), fast.arrays[key].astype(np.float64)
        scale = 255 if value.dtype == np.uint8 else max(np.abs(a).max(), 1.0)
        assert np.abs(a - b).mean() / scale < 0.02, key
