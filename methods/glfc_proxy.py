"""GLFC's proxy server: the gradient-encoding LeNet, labels from gradients, and reconstruction by gradient
matching (DLG with the label known), one image at a time or all of a round's at once.

:func:`reconstruct_batch` runs the round's reconstructions side by side: the
gradient-matching loss of every image and its gradient in the image from one
graph (:func:`matching_losses`: each image its own copy of the parameters,
the convolutions as unfolded batched matrix products), and
:class:`BatchedLBFGS`, torch's L-BFGS (no line search) for many independent
problems, each keeping its own history (a ring of curvature pairs), step
length and stopping tests, its two-loop recursion in numpy. Each image
follows the same steps as :func:`reconstruct` on its own, from the same
random start; only float summation order differs (batched products and dot
products).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fcl_emu.methods import jobs


class GradientEncoder(nn.Module):
    """The LeNet of DLG (Zhu et al., NeurIPS 2019) that GLFC encodes prototypes with: three 5x5 convolutions
    of 12 channels (strides 2, 2, 1) with sigmoid activations and a linear classifier over the data set's
    classes; weights and biases uniform in [-0.5, 0.5) from ``seed`` (DLG's initialisation), so every client
    and the proxy hold the same network."""

    def __init__(self, input_shape, num_classes: int, seed: int):
        super().__init__()
        c, h, w = input_shape
        self.body = nn.Sequential(
            nn.Conv2d(c, 12, 5, stride=2, padding=2), nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, stride=2, padding=2), nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, stride=1, padding=2), nn.Sigmoid(), nn.Flatten())
        self.fc = nn.Linear(12 * math.ceil(h / 4) * math.ceil(w / 4), num_classes)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))

    def gradients(self, x: torch.Tensor, y: torch.Tensor, create_graph: bool = False) -> list[torch.Tensor]:
        """The gradient of ``CE(self(x), y)`` with respect to every parameter, in ``named_parameters`` order."""
        params = [p.requires_grad_(True) for p in self.parameters()]
        try:
            return list(torch.autograd.grad(F.cross_entropy(self(x), y), params, create_graph=create_graph))
        finally:
            for p in params:
                p.requires_grad_(False)


def label_from_gradients(grads: Mapping[str, torch.Tensor]) -> int:
    """The label of a one-sample gradient: with sigmoid features (positive), only the true class's row of the
    classifier weight has a negative gradient (``(p_y - 1) h``)."""
    return int(grads["fc.weight"].sum(dim=1).argmin())



def reconstruct(encoder: GradientEncoder, target: Mapping[str, torch.Tensor], label: int, input_shape,
                iterations: int, lr: float, keep: int, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """Gradient matching (DLG with the label known): L-BFGS on a random image so that the encoder's gradient
    at it matches ``target``; returns the last ``keep`` iterates ``(keep, C, H, W)`` and the final matching
    loss."""
    dummy = torch.randn((1, *input_shape), generator=generator).requires_grad_(True)
    y = torch.tensor([label])
    names = [n for n, _ in encoder.named_parameters()]
    opt = torch.optim.LBFGS([dummy], lr=lr)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        grads = encoder.gradients(dummy, y, create_graph=True)
        diff = sum(((g - target[n]) ** 2).sum() for g, n in zip(grads, names))
        diff.backward()
        return diff

    kept: list[torch.Tensor] = []
    loss = math.nan
    for i in range(iterations):
        loss = float(opt.step(closure).detach())
        if not math.isfinite(loss):
            break
        if i >= iterations - keep:
            kept.append(dummy.detach().clone())
    if not kept:  # diverged before the kept iterates: keep the last finite image
        kept.append(dummy.detach().clone().nan_to_num(0.0))
    return torch.cat(kept), loss



def gradient_groups(tensors: Mapping[str, np.ndarray], names: list[str], encoder: GradientEncoder,
                     prefix: str = "grad/") -> list[dict[str, np.ndarray]]:
    """``<prefix><k>/<param>`` tensors as one dict per ``k``, each checked against the encoder's parameters
    (ValueError: unknown names, missing or mis-shaped parameters)."""
    shapes = {n: tuple(p.shape) for n, p in encoder.named_parameters()}
    groups: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        if not key.startswith(prefix):
            continue
        k, sep, name = key[len(prefix):].partition("/")
        if not sep or name not in shapes:
            raise ValueError(f"prototype gradient {key!r} names no parameter of the gradient encoder")
        if tuple(value.shape) != shapes[name]:
            raise ValueError(f"prototype gradient {key!r} has shape {list(value.shape)}, the encoder's "
                             f"{name} has {list(shapes[name])}")
        groups.setdefault(k, {})[name] = value
    for k, group in groups.items():
        if group.keys() != shapes.keys():
            raise ValueError(f"prototype gradient {k} lacks {sorted(shapes.keys() - group.keys())}")
    return [groups[k] for k in sorted(groups)]


class BatchedLBFGS:
    """``torch.optim.LBFGS(lr=lr)`` (no line search, its default tolerances and history) on the rows of ``x``
    ``(B, n)`` as B independent problems: :meth:`step` is one ``LBFGS.step`` of every active row."""

    def __init__(self, x: torch.Tensor, lr: float, max_iter: int = 20, history_size: int = 100,
                 tolerance_grad: float = 1e-7, tolerance_change: float = 1e-9):
        b, n = x.shape
        self.x, self.lr, self.max_iter, self.max_eval = x, lr, max_iter, max_iter * 5 // 4
        self.tolerance_grad, self.tolerance_change, self.history = tolerance_grad, tolerance_change, history_size
        self.n_iter = torch.zeros(b, dtype=torch.long)
        dtype = x.dtype
        self.d, self.prev_grad = torch.zeros(b, n, dtype=dtype), torch.zeros(b, n, dtype=dtype)
        self.t, self.h_diag = torch.zeros(b, dtype=dtype), torch.ones(b, dtype=dtype)
        self.prev_loss = torch.zeros(b, dtype=torch.float64)
        # curvature pairs in a ring per row: the oldest at slot ``head``, ``count`` of them; empty slots hold
        # zeros (ro = 0), so they change nothing
        self.dirs = torch.zeros(b, history_size, n, dtype=dtype)
        self.steps = torch.zeros(b, history_size, n, dtype=dtype)
        self.ro = torch.zeros(b, history_size, dtype=dtype)
        self.count = torch.zeros(b, dtype=torch.long)
        self.head = torch.zeros(b, dtype=torch.long)

    def step(self, closure: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
             active: torch.Tensor) -> torch.Tensor:
        """``closure(rows)``: the losses ``(r,)`` and gradients ``(r, n)`` at ``self.x[rows]``. Returns each active
        row's loss at the step's start (NaN elsewhere)."""
        rows = torch.nonzero(active).flatten()
        loss = torch.full((len(self.x),), math.nan, dtype=torch.float64)
        if not len(rows):
            return loss
        grad_ = torch.zeros_like(self.x)
        values, grads = closure(rows)
        loss[rows], grad_[rows] = values.double(), grads
        orig = loss.clone()
        running = active & ~(grad_.abs().amax(dim=1) <= self.tolerance_grad)
        evals = torch.ones(len(self.x), dtype=torch.long)
        for inner in range(1, self.max_iter + 1):
            if not running.any():
                break
            self.n_iter[running] += 1
            first = running & (self.n_iter == 1)
            later = running & (self.n_iter > 1)
            if later.any():
                self._direction(grad_, later)
            self.d[first] = -grad_[first]
            self.h_diag[first] = 1.0
            self.prev_grad[running] = grad_[running]
            self.prev_loss[running] = loss[running]
            inverse = 1.0 / grad_.abs().sum(dim=1)
            self.t[first] = torch.where(inverse < 1, inverse * self.lr, torch.full_like(inverse, self.lr))[first]
            self.t[later] = self.lr
            running &= ~((grad_ * self.d).sum(dim=1) > -self.tolerance_change)
            moving = torch.nonzero(running).flatten()
            self.x[moving] += self.t[moving, None] * self.d[moving]
            if inner == self.max_iter or not len(moving):
                break
            values, grads = closure(moving)
            loss[moving], grad_[moving] = values.double(), grads
            evals[moving] += 1
            running &= ~(evals >= self.max_eval)
            running &= ~(grad_.abs().amax(dim=1) <= self.tolerance_grad)
            running &= ~((self.d * self.t[:, None]).abs().amax(dim=1) <= self.tolerance_change)
            running &= ~((loss - self.prev_loss).abs() < self.tolerance_change)
        return orig

    def _direction(self, grad_: torch.Tensor, rows: torch.Tensor) -> None:
        """The quasi-Newton direction of ``rows`` (a mask): record the latest curvature pair where
        ``y.s > 1e-10`` (over the oldest once the history is full), then the two-loop recursion over each row's
        history."""
        y = grad_ - self.prev_grad
        s = self.d * self.t[:, None]
        ys = (y * s).sum(dim=1)
        accept = torch.nonzero(rows & (ys > 1e-10)).flatten()
        if len(accept):
            count, head = self.count[accept], self.head[accept]
            slot = (head + count) % self.history  # the next free slot, or the oldest pair's once full
            self.dirs[accept, slot], self.steps[accept, slot] = y[accept], s[accept]
            self.ro[accept, slot] = 1.0 / ys[accept]
            self.h_diag[accept] = ys[accept] / (y[accept] * y[accept]).sum(dim=1)
            self.head[accept] = torch.where(count == self.history, (head + 1) % self.history, head)
            self.count[accept] = (count + 1).clamp(max=self.history)
        used = int(self.count[rows].max())
        order = (self.head[:, None] + torch.arange(used)) % self.history
        r = two_loop(grad_.numpy(), self.dirs.numpy(), self.steps.numpy(), self.ro.numpy(), self.h_diag.numpy(),
                     order.numpy())
        self.d[rows] = torch.from_numpy(r)[rows]


def two_loop(grad_: np.ndarray, dirs: np.ndarray, steps: np.ndarray, ro: np.ndarray, h_diag: np.ndarray,
             order: np.ndarray) -> np.ndarray:
    """L-BFGS's two-loop recursion ``-H grad`` of every row at once: ``order[b, i]`` is the slot of row b's
    i-th oldest pair in ``dirs`` (y), ``steps`` (s) and ``ro`` (1 / y.s). In numpy: about a hundred small
    vector operations per direction, where torch's dispatch costs several times numpy's."""
    rows = np.arange(len(grad_))
    same = bool((order == order[:1]).all())  # every row's history in step: plain slices, no gathers

    def pair(i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if same:
            j = int(order[0, i])
            return dirs[:, j], steps[:, j], ro[:, j]
        j = order[:, i]
        return dirs[rows, j], steps[rows, j], ro[rows, j]

    q = -grad_
    al = np.zeros((len(q), order.shape[1]), q.dtype)
    for i in range(order.shape[1] - 1, -1, -1):
        y, s, rho = pair(i)
        al[:, i] = np.einsum("bn,bn->b", s, q) * rho
        q -= al[:, i, None] * y
    r = q * h_diag[:, None]
    for i in range(order.shape[1]):
        y, s, rho = pair(i)
        r += (al[:, i] - np.einsum("bn,bn->b", y, r) * rho)[:, None] * s
    return r


@dataclass
class MatchingTargets:
    """Every problem's target gradients, ready for :func:`matching_losses`: ``params`` per parameter name
    ``(P, ...)``; the head weight's also in float64, ``head`` ``(P, C, F)``, with each problem's squared norm
    ``head_sq`` ``(P,)``, computed once per job (see :class:`_HeadMismatch`)."""
    params: dict[str, torch.Tensor]
    head: torch.Tensor
    head_sq: torch.Tensor

    @classmethod
    def of(cls, targets: Mapping[str, torch.Tensor], encoder: GradientEncoder) -> MatchingTargets:
        head = targets["fc.weight"].reshape(-1, *encoder.fc.weight.shape).double()
        return cls(dict(targets), head, (head * head).sum(dim=(1, 2)))


class _HeadMismatch(torch.autograd.Function):
    """``||g_b h_b^T - T_b||^2`` of each problem ``b`` (``g`` (B, C), ``h`` (B, F), ``T`` (P, C, F), ``rows`` the
    problems ``g`` and ``h`` belong to, ``None``: all), differentiable in ``g`` and ``h``: the linear head's
    weight gradient is the outer product ``g h^T`` of its output's and its input's gradients, so its matching
    term is ``||T||^2 - 2 g.(T h) + ||g||^2 ||h||^2`` and its gradients ``2 (||h||^2 g - T h)`` and
    ``2 (||g||^2 h - T^T g)``: two matrix-vector products per problem instead of writing and reading B x C x F
    residuals (the largest tensors of the job with a data set's many classes). The terms nearly cancel where
    the match is close, so they are computed in float64: the result is exact to float32's precision."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, h: torch.Tensor, target: torch.Tensor, target_sq: torch.Tensor,
                rows: torch.Tensor | None) -> torch.Tensor:
        g64, h64 = g.double(), h.double()
        th = _problem_products(target, h64[:, :, None], rows)[:, :, 0]
        gg, hh = (g64 * g64).sum(dim=1), (h64 * h64).sum(dim=1)
        ctx.save_for_backward(g64, h64, th, gg, hh, target)
        ctx.rows = rows
        sq = target_sq if rows is None else target_sq[rows]
        return (sq - 2 * (g64 * th).sum(dim=1) + gg * hh).to(g.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g64, h64, th, gg, hh, target = ctx.saved_tensors
        scale = 2 * grad.double()[:, None]
        tg = _problem_products(target, g64[:, None, :], ctx.rows, left=True)[:, 0]
        return (((hh[:, None] * g64 - th) * scale).to(grad.dtype), ((gg[:, None] * h64 - tg) * scale).to(grad.dtype),
                None, None, None)


def _problem_products(target: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None,
                      left: bool = False) -> torch.Tensor:
    """``target[b] @ v`` (or ``v @ target[b]``, ``left``) for each problem ``b`` of ``rows``; with ``rows``, ``v``
    is spread over all the problems (zeros elsewhere) rather than ``target`` copied down to ``rows``: reading
    ``target`` once costs less than copying it at every evaluation."""
    if rows is not None:
        full = v.new_zeros((len(target), *v.shape[1:]))
        full[rows] = v
        v = full
    out = torch.bmm(v, target) if left else torch.bmm(target, v)
    return out if rows is None else out[rows]


def matching_losses(encoder: GradientEncoder, x: torch.Tensor, labels: torch.Tensor, targets: MatchingTargets,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """Each image's gradient-matching loss ``sum_p ||dCE(encoder(x_b), y_b)/dp - target_b[p]||^2`` ``(B,)``,
    differentiable in ``x``, for the :class:`GradientEncoder`'s layers (convolutions each followed by a
    sigmoid, then the linear head); image ``b`` is problem ``rows[b]`` of ``targets`` (``None``: ``b``).
    Every image gets its own copy of the convolutions' parameters, so one backward pass gives the per-image
    gradients; the convolutions run as unfolded batched matrix products (``bmm`` over the images), whose
    second derivative torch computes several times faster than that of batched one-image convolutions. The
    head's gradients are written out: the bias's is ``g = softmax - onehot`` of the logits, the weight's the
    outer product of ``g`` and the head's input (:class:`_HeadMismatch`)."""
    b = len(x)
    convs = [m for m in encoder.body if isinstance(m, nn.Conv2d)]
    weights = [c.weight.detach().flatten(1).expand(b, -1, -1).clone().requires_grad_(True) for c in convs]
    biases = [c.bias.detach().expand(b, -1).clone().requires_grad_(True) for c in convs]
    h = x
    for conv, w, bias in zip(convs, weights, biases):
        size = [(n + 2 * p - k) // s + 1 for n, p, k, s in zip(h.shape[2:], conv.padding, conv.kernel_size,
                                                                 conv.stride)]
        cols = F.unfold(h, conv.kernel_size, padding=conv.padding, stride=conv.stride)
        h = torch.sigmoid(torch.baddbmm(bias[:, :, None], w, cols)).view(b, -1, *size)
    features = h.flatten(1)
    logits = F.linear(features, encoder.fc.weight.detach(), encoder.fc.bias.detach())
    params = [t for pair in zip(weights, biases) for t in pair]
    grads = torch.autograd.grad(F.cross_entropy(logits, labels, reduction="sum"), params, create_graph=True)

    def wanted(name: str) -> torch.Tensor:
        t = targets.params[name]
        return (t if rows is None else t[rows]).reshape(b, -1)

    names = [n for n, _ in encoder.body.named_parameters(prefix="body")]
    loss = sum(((g.reshape(b, -1) - wanted(n)) ** 2).sum(dim=1) for g, n in zip(grads, names))
    g = torch.softmax(logits, dim=1) - F.one_hot(labels, logits.shape[1]).to(logits.dtype)
    return (loss + _HeadMismatch.apply(g, features, targets.head, targets.head_sq, rows)
            + ((g - wanted("fc.bias")) ** 2).sum(dim=1))


def reconstruct_batch(encoder: GradientEncoder, targets: list[Mapping[str, torch.Tensor]], labels: list[int],
                      input_shape, iterations: int, lr: float, keep: int,
                      generator: torch.Generator) -> list[tuple[torch.Tensor, float]]:
    """:func:`reconstruct` of every target at once (random starts drawn in the targets' order, as successive
    calls would); returns each target's kept iterates and final matching loss."""
    starts = [torch.randn((1, *input_shape), generator=generator) for _ in targets]
    if not targets:
        return []
    names = [n for n, _ in encoder.named_parameters()]
    wanted = MatchingTargets.of({n: torch.stack([t[n] for t in targets]) for n in names}, encoder)
    y = torch.tensor(labels)
    opt = BatchedLBFGS(torch.cat(starts).flatten(1), lr)

    def closure(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        every = len(rows) == len(targets)  # every problem still running: no copies
        x = (opt.x if every else opt.x[rows]).detach().view(-1, *input_shape).requires_grad_(True)
        values = matching_losses(encoder, x, y if every else y[rows], wanted, None if every else rows)
        return values.detach(), torch.autograd.grad(values.sum(), x)[0].flatten(1)

    active = torch.ones(len(targets), dtype=torch.bool)
    losses = torch.full((len(targets),), math.nan, dtype=torch.float64)
    kept: list[list[torch.Tensor]] = [[] for _ in targets]
    for i in range(iterations):
        jobs.step(i, iterations)
        step = opt.step(closure, active)
        losses[active] = step[active]
        active &= torch.isfinite(step)
        if i >= iterations - keep:
            for b in torch.nonzero(active).flatten().tolist():
                kept[b].append(opt.x[b].view(1, *input_shape).clone())
    out = []
    for b, images in enumerate(kept):
        if not images:  # diverged before the kept iterates: keep the last finite image
            images.append(opt.x[b].view(1, *input_shape).nan_to_num(0.0))
        out.append((torch.cat(images), float(losses[b])))
    return out
