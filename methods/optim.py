"""The clients' local SGD, without torch's ``Optimizer`` class.

:class:`LocalSGD` performs ``torch.optim.SGD``'s update through its functional form
(``torch.optim.sgd.sgd``, the same arithmetic bit for bit: momentum buffers, weight decay, no dampening, no
Nesterov), over a fixed list of parameters. Why not ``torch.optim.SGD`` itself: the first ``Optimizer``
built in a process imports torch's compiler stack (``torch._dynamo`` and about 800 modules with it, through
the ``_disable_dynamo`` wrapper of ``add_param_group``), 68 MB of private memory and about 0.9 s of CPU in
every edge-node process, for a client's local steps that never compile anything. The clients' SGD (local
training, GLFC's prototype perturbation) uses it; Adam (AF-FCL's flow and replay steps on the clients, the
generators and VAEs of the server jobs) stays ``torch.optim``'s.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.sgd import sgd


class LocalSGD:
    """SGD with momentum and weight decay over ``params`` (``torch.optim.SGD``'s update, see the module)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}")
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self._momentum: list[torch.Tensor | None] = [None] * len(self.params)  # created on a parameter's first step

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient (as ``torch.optim.SGD``: the others are left)."""
        slots = [i for i, p in enumerate(self.params) if p.grad is not None]
        buffers = [self._momentum[i] for i in slots]
        sgd([self.params[i] for i in slots], [self.params[i].grad for i in slots], buffers,
            weight_decay=self.weight_decay, momentum=self.momentum, lr=self.lr, dampening=0.0, nesterov=False,
            maximize=False)
        for i, buffer in zip(slots, buffers):
            self._momentum[i] = buffer
