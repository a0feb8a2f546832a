"""Training FedCBC's VAEs by distillation: one at a time, and the fusion (eq. 7) of every class at once.

:func:`fit_vae` trains one VAE on feature rows with eq. 5 plus ``alpha``
times the KL from its posterior to its teachers' averaged posterior
(:func:`distillation_loss`): the clients' continual personalization (one
teacher, or none) and, class after class (:func:`fuse_one`), the sequential
reference of the fusion job. :func:`draw_latents` and
:func:`pseudo_features` make the pseudo-features both decode. ``o`` is
always a ``FedCBCOptions`` (not imported: :mod:`fcl_emu.methods.fedcbc` imports
this module).

The ``fedcbc.fuse`` job trains one student VAE per class; done class after
class, each step is a handful of small matrix products and the job is bound
by per-op overhead. :func:`fit_students` trains every class's student
together: their parameters stacked (:class:`StackedVAEs`), one batched
forward and backward per step, one fused Adam over the stacked tensors
(Adam is elementwise, so each class's slice follows its own trajectory).
Classes with more sources have more pseudo-features, hence more batches an
epoch: step ``t`` is each class's own ``t``-th step, the short last batch of
an epoch is padded with rows weighted zero, and a class that has taken all
its steps leaves the stack with its slice of Adam's state (so it takes no
further momentum steps). The sources' averaged posterior of every
pseudo-feature is computed once instead of at every step (the sources are
frozen and their posterior is deterministic).

Randomness is the sequential path's, draw for draw: the job's single
generator served class after class (latents, each epoch's permutation, each
batch's reparameterisation noise), so each class gets a generator started
where the sequential path would have reached when it began that class. The
results match the sequential path up to float summation order (batched
matrix products; a posterior computed over all rows instead of per batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fcl_emu.methods import jobs
from fcl_emu.methods.models.vae import VAE, gaussian_kl, vae_loss, vae_loss_per_sample

Draw = Callable[[int, torch.Generator], torch.Tensor]  # (count, generator) -> latents (count, k)


# --------------------------------------------------- one VAE at a time (clients, the sequential reference)
def pseudo_features(vae: VAE, z: torch.Tensor) -> torch.Tensor:
    """Features the VAE's decoder makes of the latents ``z`` (no gradients)."""
    with torch.no_grad():
        return vae.to(z.device).eval().decode(z)


def draw_latents(o, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` latents of the pseudo-features: ``U(-1, 1)`` (the code) or ``N(0, I)`` (``o.pseudo_noise``)."""
    if o.pseudo_noise == "uniform":
        return torch.rand((n, o.vae_latent), generator=gen) * 2 - 1
    return torch.randn((n, o.vae_latent), generator=gen)


def distillation_loss(student: VAE, x: torch.Tensor, teachers: list[VAE], o,
                      gen: torch.Generator | None = None) -> tuple[torch.Tensor, float, float]:
    """Eq. 5 on ``x`` plus ``alpha`` times the mean KL from the student's posterior to the teachers' averaged
    posterior (one teacher: continual personalization; several: eq. 7); returns the loss and both terms."""
    recon, mean, log_var = student(x, generator=gen)
    own = vae_loss(recon, x, mean, log_var, o.beta)
    if not teachers:
        return own, own.item(), 0.0
    with torch.no_grad():
        posteriors = [t.encode(x) for t in teachers]
        mean_t = torch.stack([m for m, _ in posteriors]).mean(dim=0)
        log_var_t = torch.stack([v for _, v in posteriors]).mean(dim=0)
    kd = gaussian_kl(mean, log_var, mean_t, log_var_t).mean()
    return own + o.alpha * kd, own.item(), kd.item()


def fit_vae(student: VAE, data: torch.Tensor, teachers: list[VAE], o, epochs: int, batch: int,
            gen: torch.Generator, device: torch.device) -> tuple[float, float, int]:
    """Train ``student`` on the rows of ``data`` (Adam, shuffled batches) with :func:`distillation_loss`;
    returns the mean eq.-5 and distillation terms of the last epoch, and the steps taken."""
    student.to(device).train()
    for t in teachers:
        t.to(device).eval()
    opt = torch.optim.Adam(student.parameters(), lr=o.vae_lr, weight_decay=o.vae_weight_decay)
    steps = 0
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=gen)
        sums, batches = np.zeros(2), 0
        for i in range(0, len(data), batch):
            loss, own, kd = distillation_loss(student, data[order[i:i + batch]].to(device), teachers, o, gen)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"fedcbc: the VAE loss became {loss.item()}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sums += (own, kd)
            batches += 1
        steps += batches
    student.eval()
    own, kd = sums / max(batches, 1)
    return float(own), float(kd), steps


def fuse_one(student: VAE, teachers: list[VAE], o, gen: torch.Generator,
             device: torch.device) -> tuple[float, float]:
    """One class's fusion on its own (the sequential reference of :func:`fit_students`)."""
    z = draw_latents(o, o.pseudo_samples, gen).to(device)
    data = torch.cat([pseudo_features(t, z) for t in teachers]).cpu()
    own, kd, _ = fit_vae(student, data, teachers, o, o.fusion_epochs, o.fusion_batch, gen, device)
    return own, kd


# ------------------------------------------------------------------ every class at once
class StackedVAEs:
    """The VAEs of several classes as one: each ``nn.Linear``'s weight stacked and transposed, ``(G, in, out)``
    (so every batched product and its gradient is contiguous), its bias ``(G, 1, out)``; the parameter-free
    modules (activations) between them applied as they are. Follows :class:`VAE`'s parts (``encoder``,
    ``mean``, ``log_var``, ``decoder``) module by module."""

    PARTS = ("encoder", "mean", "log_var", "decoder")

    def __init__(self, vaes: list[VAE], device: torch.device):
        self.vaes = vaes
        self.parts: dict[str, list[tuple[str, nn.Module]]] = {}
        self.params: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for part in self.PARTS:
            module = vaes[0].get_submodule(part)
            modules = list(module.named_children()) if isinstance(module, nn.Sequential) else [("", module)]
            self.parts[part] = [(f"{part}.{n}" if n else part, m) for n, m in modules]
            for path, m in self.parts[part]:
                if isinstance(m, nn.Linear):
                    layers = [v.get_submodule(path) for v in vaes]
                    weight = torch.stack([layer.weight.detach().t() for layer in layers]).to(device)
                    bias = torch.stack([layer.bias.detach()[None] for layer in layers]).to(device)
                    self.params[path] = weight.requires_grad_(), bias.requires_grad_()
                elif any(True for _ in m.parameters()):
                    raise TypeError(f"fedcbc: cannot stack the VAE's {type(m).__name__} at {path}")

    def parameters(self) -> list[torch.Tensor]:
        return [t for pair in self.params.values() for t in pair]

    def _run(self, part: str, h: torch.Tensor) -> torch.Tensor:
        for path, m in self.parts[part]:
            h = torch.baddbmm(self.params[path][1], h, self.params[path][0]) if path in self.params else m(h)
        return h

    def forward(self, x: torch.Tensor, eps: torch.Tensor):
        """``VAE.forward`` of each class on its rows ``x`` ``(G, B, d)`` with its noise ``eps`` ``(G, B, k)``."""
        h = self._run("encoder", x)
        mean, log_var = self._run("mean", h), self._run("log_var", h)
        return self._run("decoder", mean + torch.exp(0.5 * log_var) * eps), mean, log_var

    @torch.no_grad()
    def write_back(self, first: int = 0) -> None:
        """Copy the trained stacked parameters of the classes from ``first`` on into their VAEs."""
        for path, (weight, bias) in self.params.items():
            for g in range(first, len(self.vaes)):
                layer = self.vaes[g].get_submodule(path)
                layer.weight.copy_(weight[g].t())
                layer.bias.copy_(bias[g, 0])

    def keep(self, count: int, opt: torch.optim.Adam) -> torch.optim.Adam:
        """Write the classes from ``count`` on back into their VAEs and go on with the first ``count``: their
        slices of the stacked parameters and of ``opt``'s state, in a new optimiser returned (a class that
        has finished must not take Adam's momentum steps)."""
        self.write_back(count)
        self.vaes = self.vaes[:count]
        old = self.parameters()
        self.params = {path: tuple(t.detach()[:count].clone().requires_grad_() for t in pair)
                       for path, pair in self.params.items()}
        new_opt = torch.optim.Adam(self.parameters(), **opt.defaults)
        for before, after in zip(old, self.parameters()):
            new_opt.state[after] = {k: v if k == "step" else v[:count].clone() for k, v in opt.state[before].items()}
        return new_opt


def _class_generators(gen: torch.Generator, rows: list[int], pseudo: int, latent: int, epochs: int, batch: int,
                      draw: Draw) -> list[torch.Generator]:
    """One generator per class, each started where the sequential path's ``gen`` is when it begins that class
    (``rows``: each class's pseudo-feature count)."""
    out = []
    for c, n in enumerate(rows):
        g = torch.Generator()
        g.set_state(gen.get_state())
        out.append(g)
        if c + 1 < len(rows):
            draw(pseudo, gen)
            for _ in range(epochs):
                torch.randperm(n, generator=gen)
                for i in range(0, n, batch):
                    torch.randn((min(batch, n - i), latent), generator=gen)
    return out


def fit_students(students: list[VAE], teachers: list[list[VAE]], o, draw: Draw, gen: torch.Generator,
                 device: torch.device) -> list[tuple[float, float]]:
    """Fuse each class ``c``: ``students[c]`` trained in place on ``o.pseudo_samples`` latents decoded by each of
    ``teachers[c]`` (eq. 5 plus ``alpha`` times the KL to the teachers' averaged posterior) for
    ``o.fusion_epochs`` epochs of batch ``o.fusion_batch``, Adam at ``o.vae_lr``. Returns each class's mean
    eq.-5 and distillation terms over its last epoch."""
    rows = [len(t) * o.pseudo_samples for t in teachers]
    gens = _class_generators(gen, rows, o.pseudo_samples, o.vae_latent, o.fusion_epochs, o.fusion_batch, draw)
    by_length = sorted(range(len(rows)), key=lambda c: -rows[c])  # the longest first: the last to finish
    longest = rows[by_length[0]]
    data = torch.zeros((len(rows), longest + 1, students[0].input_dim), device=device)  # row `longest`: padding
    mean_t = torch.zeros((len(rows), longest + 1, o.vae_latent), device=device)
    log_var_t = torch.zeros_like(mean_t)
    with torch.no_grad():
        for slot, c in enumerate(by_length):
            z = draw(o.pseudo_samples, gens[c]).to(device)
            x = torch.cat([t.to(device).eval().decode(z) for t in teachers[c]])
            posteriors = [t.encode(x) for t in teachers[c]]
            data[slot, :rows[c]] = x
            mean_t[slot, :rows[c]] = torch.stack([m for m, _ in posteriors]).mean(dim=0)
            log_var_t[slot, :rows[c]] = torch.stack([v for _, v in posteriors]).mean(dim=0)
    terms = _fit([students[c] for c in by_length], data, mean_t, log_var_t, [rows[c] for c in by_length],
                 [gens[c] for c in by_length], o, device)
    results: list[tuple[float, float]] = [(0.0, 0.0)] * len(rows)
    for slot, c in enumerate(by_length):
        results[c] = terms[slot]
    return results


def _fit(students: list[VAE], data: torch.Tensor, mean_t: torch.Tensor, log_var_t: torch.Tensor, rows: list[int],
         gens: list[torch.Generator], o, device: torch.device) -> list[tuple[float, float]]:
    """Train ``students`` side by side, each ``g`` on the first ``rows[g]`` rows of ``data[g]`` (G, N + 1, d)
    with the teachers' posteriors (G, N + 1, k); ``rows`` in decreasing order, row N zero (the padding).

    Step ``t`` is every class's own step ``t`` (its epoch ``t // s``, batch ``t % s`` of its ``s`` batches an
    epoch); a class with fewer rows finishes first and leaves the stack (:meth:`StackedVAEs.keep`). Batches
    shorter than ``fusion_batch`` (an epoch's last) are padded with row N, weighted zero in the loss."""
    batch, epochs, count = o.fusion_batch, o.fusion_epochs, len(students)
    per_epoch = [math.ceil(n / batch) for n in rows]
    stacked = StackedVAEs(students, device)
    opt = torch.optim.Adam(stacked.parameters(), lr=o.vae_lr, weight_decay=o.vae_weight_decay, fused=True)
    pad = data.shape[1] - 1
    index = torch.full((count, batch), pad)
    weight = torch.zeros((count, batch))
    eps = torch.zeros((count, batch, o.vae_latent))
    orders: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * count
    sums = torch.zeros((2, count), dtype=torch.float64)
    active = count
    for t in range(epochs * per_epoch[0]):
        jobs.step(t, epochs * per_epoch[0])
        while epochs * per_epoch[active - 1] <= t:
            active -= 1
        if active < len(stacked.vaes):
            opt = stacked.keep(active, opt)
        for g in range(active):
            i = t % per_epoch[g]
            if i == 0:
                orders[g] = torch.randperm(rows[g], generator=gens[g])
            chosen = orders[g][i * batch:(i + 1) * batch]
            b = len(chosen)
            index[g, :b], index[g, b:] = chosen, pad
            weight[g, :b], weight[g, b:] = 1.0 / b, 0.0
            eps[g, :b].normal_(generator=gens[g])
            eps[g, b:] = 0.0
        picked = torch.arange(active, device=device)[:, None], index[:active].to(device)
        x = data[picked]
        recon, mean, log_var = stacked.forward(x, eps[:active].to(device))
        w = weight[:active].to(device)
        own = (vae_loss_per_sample(recon, x, mean, log_var, o.beta) * w).sum(dim=1)
        kd = (gaussian_kl(mean, log_var, mean_t[picked], log_var_t[picked]) * w).sum(dim=1)
        loss = own + o.alpha * kd
        if not torch.isfinite(loss).all():
            raise FloatingPointError(f"fedcbc: the VAE loss became {loss[~torch.isfinite(loss)][0].item()}")
        opt.zero_grad(set_to_none=True)
        loss.sum().backward()
        opt.step()
        last_epoch = torch.tensor([t >= (epochs - 1) * per_epoch[g] for g in range(active)])
        sums[:, :active] += torch.stack([own.detach(), kd.detach()]).cpu() * last_epoch
    stacked.write_back()
    for s in students:
        s.eval()
    means = (sums / torch.tensor(per_epoch)).tolist()
    return [(float(means[0][g]), float(means[1][g])) for g in range(count)]
