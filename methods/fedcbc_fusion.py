"""FedCBC's selective knowledge fusion (eq. 7) of every class at once.

The ``fedcbc.fuse`` job trains one student VAE per class; done class after
class, each step is a handful of small matrix products and the job is bound
by per-op overhead. :func:`fit_students` trains all students of the same
data length together: their parameters stacked
(:class:`StackedVAEs`), one batched forward and backward per step, one fused
Adam over the stacked tensors (Adam is elementwise, so each class's slice
follows its own trajectory). The sources' averaged posterior of every
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

from collections.abc import Callable

import torch
from torch import nn

from methods.models.vae import VAE, gaussian_kl, vae_loss_per_sample

Draw = Callable[[int, torch.Generator], torch.Tensor]  # (count, generator) -> latents (count, k)


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
    def write_back(self) -> None:
        """Copy the trained stacked parameters into each class's VAE."""
        for path, (weight, bias) in self.params.items():
            for g, vae in enumerate(self.vaes):
                layer = vae.get_submodule(path)
                layer.weight.copy_(weight[g].t())
                layer.bias.copy_(bias[g, 0])


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
    data, mean_t, log_var_t = [], [], []
    with torch.no_grad():
        for c, sources in enumerate(teachers):
            z = draw(o.pseudo_samples, gens[c]).to(device)
            x = torch.cat([t.to(device).eval().decode(z) for t in sources])
            posteriors = [t.encode(x) for t in sources]
            data.append(x)
            mean_t.append(torch.stack([m for m, _ in posteriors]).mean(dim=0))
            log_var_t.append(torch.stack([v for _, v in posteriors]).mean(dim=0))
    results: list[tuple[float, float] | None] = [None] * len(students)
    for n in sorted(set(rows)):
        group = [c for c, r in enumerate(rows) if r == n]
        stacked = [torch.stack([part[c] for c in group]) for part in (data, mean_t, log_var_t)]
        terms = _fit_group([students[c] for c in group], *stacked, [gens[c] for c in group], o, device)
        for c, t in zip(group, terms):
            results[c] = t
    return results


def _fit_group(students: list[VAE], data: torch.Tensor, mean_t: torch.Tensor, log_var_t: torch.Tensor,
               gens: list[torch.Generator], o, device: torch.device) -> list[tuple[float, float]]:
    """Train ``students`` (G of them) side by side on ``data`` ``(G, N, d)`` with the teachers' posteriors
    ``(G, N, k)``."""
    stacked = StackedVAEs(students, device)
    opt = torch.optim.Adam(stacked.parameters(), lr=o.vae_lr, weight_decay=o.vae_weight_decay, fused=True)
    g_count, n = data.shape[:2]
    rows = torch.arange(g_count, device=device)[:, None]
    sums = torch.zeros(2, g_count, dtype=torch.float64)
    batches = 0
    for _ in range(o.fusion_epochs):
        order = torch.stack([torch.randperm(n, generator=g) for g in gens]).to(device)
        sums.zero_()
        batches = 0
        for i in range(0, n, o.fusion_batch):
            idx = order[:, i:i + o.fusion_batch]
            x = data[rows, idx]
            eps = torch.stack([torch.randn((idx.shape[1], o.vae_latent), generator=g) for g in gens]).to(device)
            recon, mean, log_var = stacked.forward(x, eps)
            own = vae_loss_per_sample(recon, x, mean, log_var, o.beta).mean(dim=1)
            kd = gaussian_kl(mean, log_var, mean_t[rows, idx], log_var_t[rows, idx]).mean(dim=1)
            loss = own + o.alpha * kd
            if not torch.isfinite(loss).all():
                raise FloatingPointError(f"fedcbc: the VAE loss became {loss[~torch.isfinite(loss)][0].item()}")
            opt.zero_grad(set_to_none=True)
            loss.sum().backward()
            opt.step()
            sums += torch.stack([own.detach(), kd.detach()]).cpu()
            batches += 1
    stacked.write_back()
    for s in students:
        s.eval()
    means = (sums / max(batches, 1)).tolist()
    return [(float(means[0][g]), float(means[1][g])) for g in range(g_count)]
