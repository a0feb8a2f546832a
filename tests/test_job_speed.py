"""The batched server jobs against their sequential references, and ``fcl-emu bench jobs`` on a tiny budget.

Tolerances: FedCBC's batched fusion takes the same random draws and the same
steps, so it differs only by float summation order (batched products, the
sources' posteriors computed over all rows at once): 1e-5 on every weight.
GLFC's batched L-BFGS keeps torch's per-problem steps: in float64 it stays
within 1e-9 of ``torch.optim.LBFGS`` (in float32 rounding alone moves the
iterates by about 1e-4), and its per-image gradient matching equals the
encoder's own autograd to 1e-10. Gradient matching itself
amplifies float rounding (a 1e-7 change of the start moves an unconverged
iterate visibly), so the proxy is compared where it converges: the same
labels, and every reconstruction matches its prototype in both paths.
"""

from __future__ import annotations

import csv
import subprocess

import numpy as np
import pytest
import torch

from fcl_emu.bench.jobs import COLUMNS
from fcl_emu.methods import jobs
from fcl_emu.methods.fedcbc import FedCBCOptions, build_vae
from fcl_emu.methods.glfc_proxy import BatchedLBFGS, GradientEncoder, MatchingTargets, matching_losses
from fcl_emu.methods.models.state import state_to_arrays
from tests.conftest import fcl_emu

CPU = torch.device("cpu")
SHAPE = (1, 12, 12)


def _fusion_inputs(o: FedCBCOptions, d: int, sources: dict[int, int]) -> dict[str, np.ndarray]:
    inputs = {}
    for c, count in sources.items():
        for i in range(count):
            inputs.update({f"source/{c}/{i}/{k}": v for k, v in state_to_arrays(build_vae(o, d, seed=10 * c + i)).items()})
        inputs.update({f"start/{c}/{k}": v for k, v in state_to_arrays(build_vae(o, d, seed=10 * c + 7)).items()})
    return inputs


@pytest.mark.parametrize("noise, decoder", [("uniform", "sigmoid"), ("normal", "linear")])
def test_batched_fusion_equals_the_sequential_reference(noise, decoder):
    o = FedCBCOptions(vae_hidden=16, vae_latent=4, pseudo_samples=20, fusion_epochs=4, fusion_batch=8,
                      pseudo_noise=noise, decoder_output=decoder)
    inputs = _fusion_inputs(o, 6, {0: 2, 3: 3, 4: 2, 7: 1})  # classes of different lengths: three groups
    options = {"method_options": o.model_dump(), "feature_dim": 6, "seed": 5}
    batched = jobs.run("fedcbc.fuse", inputs, options, CPU)
    sequential = jobs.run("fedcbc.fuse", inputs, {**options, "sequential": True}, CPU)
    assert batched.arrays.keys() == sequential.arrays.keys()
    for k, v in sequential.arrays.items():
        np.testing.assert_allclose(batched.arrays[k], v, rtol=0, atol=1e-5, err_msg=k)
    for k, v in sequential.metrics.items():
        assert batched.metrics[k] == pytest.approx(v, rel=1e-5)


@pytest.mark.parametrize("history", [100, 3])  # 3: the ring of curvature pairs wraps many times
def test_batched_lbfgs_follows_torch_lbfgs_problem_by_problem(history):
    """In float64, where summation order does not show: float32 rounding alone moves iterates by ~1e-4 over
    80 quasi-Newton iterations of this problem (torch's own LBFGS against itself with another dot product)."""
    gen = torch.Generator().manual_seed(0)
    n = 30
    mix = torch.randn(n, n, generator=gen, dtype=torch.float64) / n ** 0.5

    def f(x: torch.Tensor) -> torch.Tensor:
        return ((mix @ x).tanh() ** 2).sum() + 0.1 * (x ** 4).sum()

    starts = torch.randn(3, n, generator=gen, dtype=torch.float64)
    opt = BatchedLBFGS(starts.clone(), lr=0.5, history_size=history)

    def closure(rows):
        x = opt.x[rows].clone().requires_grad_(True)
        values = torch.stack([f(r) for r in x])
        return values.detach(), torch.autograd.grad(values.sum(), x)[0]

    references = []
    for start in starts:
        x = start.clone().requires_grad_(True)
        references.append((x, torch.optim.LBFGS([x], lr=0.5, history_size=history)))
    active = torch.tensor([True, True, False])  # the third problem is stopped: it must not move
    for _ in range(4):
        losses = opt.step(closure, active)
        for b in range(2):
            x, reference = references[b]

            def ref_closure(x=x, reference=reference):
                reference.zero_grad()
                value = f(x)
                value.backward()
                return value

            assert float(reference.step(ref_closure).detach()) == pytest.approx(float(losses[b]), rel=1e-9, abs=1e-12)
            torch.testing.assert_close(opt.x[b], x.detach(), rtol=0, atol=1e-9)
            assert int(opt.n_iter[b]) == reference.state[x]["n_iter"]
    assert torch.equal(opt.x[2], starts[2]) and torch.isnan(losses[2])


@pytest.mark.parametrize("shape", [SHAPE, (3, 9, 10)])
def test_matching_losses_are_each_image_s_gradient_matching_loss(shape):
    """The batched gradient-matching loss and its gradient in the image against the encoder's own autograd,
    one image at a time, in float64."""
    encoder = GradientEncoder(shape, 10, seed=0).double()
    names = [n for n, _ in encoder.named_parameters()]
    gen = torch.Generator().manual_seed(3)
    x = torch.rand((3, *shape), generator=gen, dtype=torch.float64)
    y = torch.tensor([2, 7, 2])
    targets = {n: torch.randn((3, *p.shape), generator=gen, dtype=torch.float64) * 0.01
               for n, p in encoder.named_parameters()}
    batch = x.clone().requires_grad_(True)
    prepared = MatchingTargets.of(targets, encoder)
    values = matching_losses(encoder, batch, y, prepared)
    grads = torch.autograd.grad(values.sum(), batch)[0]
    rows = torch.tensor([2, 0])  # some problems only (the others have stopped), in any order
    part = x[rows].clone().requires_grad_(True)
    some = matching_losses(encoder, part, y[rows], prepared, rows)
    torch.testing.assert_close(some.detach(), values.detach()[rows], rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.autograd.grad(some.sum(), part)[0], grads[rows], rtol=1e-10, atol=1e-14)
    for b in range(3):
        one = x[b:b + 1].clone().requires_grad_(True)
        g = encoder.gradients(one, y[b:b + 1], create_graph=True)
        value = sum(((gi - targets[n][b]) ** 2).sum() for gi, n in zip(g, names))
        assert float(values[b].detach()) == pytest.approx(float(value.detach()), rel=1e-12)
        torch.testing.assert_close(grads[b], torch.autograd.grad(value, one)[0][0], rtol=1e-10, atol=1e-14)


@pytest.mark.slow
def test_batched_proxy_reconstructs_what_the_sequential_reference_does():
    encoder = GradientEncoder(SHAPE, 10, seed=0)
    names = [n for n, _ in encoder.named_parameters()]
    gen = torch.Generator().manual_seed(0)
    prototypes, inputs = [], {}
    for k, label in enumerate((3, 8)):
        x = torch.rand((1, *SHAPE), generator=gen)
        prototypes.append(x[0])
        inputs.update({f"grad/{k}/{n}": g.numpy() for n, g in zip(names, encoder.gradients(x, torch.tensor([label])))})
    options = {"method_options": {"proxy_iterations": 12, "proxy_keep": 2}, "model": "cnn",
               "input_shape": list(SHAPE), "num_classes": 10, "seed": 1}
    batched = jobs.run("glfc.proxy", inputs, options, CPU)
    sequential = jobs.run("glfc.proxy", inputs, {**options, "sequential": True}, CPU)
    for out in (batched, sequential):
        assert out.arrays["recon/y"].tolist() == [3, 3, 8, 8] and out.metrics["matched"] == 2
        for i, proto in enumerate(prototypes):
            assert float(((torch.from_numpy(out.arrays["recon/x"][2 * i + 1]) - proto) ** 2).mean()) < 1e-3
    np.testing.assert_allclose(batched.arrays["recon/x"], sequential.arrays["recon/x"], rtol=0, atol=0.1)


@pytest.mark.slow
def test_bench_jobs_writes_its_csv_on_a_tiny_budget(tmp_path):
    out = tmp_path / "jobs.csv"
    proc = fcl_emu("bench", "jobs", "--kinds", "fedcbc.fuse,device.matmul,lander.synthesize", "--scale", "0.01",
                   "--repeat", "2", "--classes", "3", "--device", "cpu", "--device", "cuda", "--out", str(out),
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, printed
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == COLUMNS and {r["classes"] for r in rows} == {"3"}
    cpu = [r for r in rows if r["device"] == "cpu"]
    assert {(r["kind"], r["variant"]) for r in cpu} == {("fedcbc.fuse", "batched"), ("fedcbc.fuse", "sequential"),
                                                        ("device.matmul", ""), ("lander.synthesize", "")}
    for r in cpu:
        assert float(r["wall_s"]) > 0 and float(r["gflop"]) > 0 and float(r["peak_gflops"]) > 0
        assert r["note"].startswith("median of 2: ")
    if not torch.cuda.is_available():
        assert all(r["note"].startswith("skipped") for r in rows if r["device"] == "cuda")


def test_every_profiled_kind_samples_its_inputs_from_its_method():
    """The bench takes each kind's inputs from the method (``jobs.sample_inputs``): the same arrays every call,
    at the shape and classes asked for; a kind without arrays samples none; an unknown kind is refused."""
    from fcl_emu.bench.jobs import PROFILES

    for kind in PROFILES:
        first, again = jobs.sample_inputs(kind, SHAPE, 3), jobs.sample_inputs(kind, SHAPE, 3)
        assert first.keys() == again.keys()
        assert all(np.array_equal(first[k], again[k]) for k in first), kind
    assert jobs.sample_inputs("device.matmul", SHAPE, 3) == {}
    assert jobs.sample_inputs("lander.text_embeddings", SHAPE, 3) == {}
    pretrain = jobs.sample_inputs("fedcbc.pretrain", SHAPE, 3)
    assert pretrain["x"].shape == (200, 12, 12, 1) and pretrain["x"].dtype == np.uint8
    assert set(pretrain["y"]) == {0, 1, 2}
    assert {k.split("/")[1] for k in jobs.sample_inputs("glfc.proxy", SHAPE, 3)} == {"0", "1", "2"}
    fusion = jobs.sample_inputs("fedcbc.fuse", SHAPE, 3)
    assert {k.rsplit("/", 1)[0] for k in fusion} == {"source/0/0", "source/0/1", "source/1/0", "source/1/1",
                                                     "source/1/2", "source/2/0", "source/2/1",
                                                     "start/0", "start/1", "start/2"}  # 2 or 3 sources a class
    teacher = jobs.sample_inputs("mfcl.generator", SHAPE, 3)
    assert teacher["model/head.weight"].shape[0] == 3
    with pytest.raises(KeyError, match="unknown job kind"):
        jobs.sample_inputs("glfc.nothing", SHAPE, 3)
