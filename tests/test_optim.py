"""LocalSGD: torch.optim.SGD's update without torch's Optimizer class (methods/optim.py)."""

import subprocess
import sys

import pytest
import torch

from fcl_emu.methods.optim import LocalSGD


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    model[3].requires_grad_(False)  # a frozen layer: no gradient, never updated
    return model


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 5e-4), (0.5, 1e-5)])
def test_updates_are_torch_sgds_bit_for_bit(momentum, weight_decay):
    ours, theirs = _model(), _model()
    opt_ours = LocalSGD(ours.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 2, (8,), generator=gen)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=True)
            if step == 2:  # a step where the first layer has no gradient: it keeps its weights and momentum
                model[0].requires_grad_(False)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            model[0].requires_grad_(True)
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()):
        assert torch.equal(a, b)


def test_one_step_by_hand():
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = LocalSGD([w], lr=0.1, momentum=0.9, weight_decay=0.5)
    (w * torch.tensor([3.0, 4.0])).sum().backward()  # gradient (3, 4)
    opt.step()  # d = g + 0.5 w = (3.5, 3); first step: buffer = d
    assert torch.allclose(w.detach(), torch.tensor([1.0 - 0.35, -2.0 - 0.3]))
    opt.zero_grad(set_to_none=False)
    assert torch.equal(w.grad, torch.zeros(2))
    (w * torch.tensor([3.0, 4.0])).sum().backward()
    opt.step()  # d = (3, 4) + 0.5 (0.65, -2.3) = (3.325, 2.85); buffer = 0.9 (3.5, 3) + d
    assert torch.allclose(w.detach(), torch.tensor([0.65 - 0.1 * (3.15 + 3.325), -2.3 - 0.1 * (2.7 + 2.85)]))


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        LocalSGD([torch.zeros(1, requires_grad=True)], lr=-0.1)


def test_training_with_it_does_not_import_torchs_compiler_stack():
    """The reason it exists: an edge node that trains never loads torch._dynamo (68 MB, about 0.9 s)."""
    code = ("import sys, torch; from fcl_emu.methods.optim import LocalSGD; m = torch.nn.Linear(4, 2); "
            "o = LocalSGD(m.parameters(), lr=0.1, momentum=0.9); m(torch.ones(3, 4)).sum().backward(); o.step(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
