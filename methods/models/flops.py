"""Training work per sample, counted once per model and method: what turns a device's throughput into time.

:func:`training_flops_per_sample` counts the floating-point operations of one SGD step (forward, cross-entropy,
backward) of a freshly built model, with torch's ``FlopCounterMode`` (matrix products and convolutions; a
multiply-add counts 2; element-wise operations are left out, as in the usual FLOP tables), divided by the
batch. The emulated clock scales it by the method's own work per real sample trained in a task
(:meth:`fcl_emu.methods.base.ClientPart.work_per_sample`: teachers' forward passes, synthetic replay batches; each
method says what it adds). Both are exact and independent of the host.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

_BATCH = 4


@lru_cache(maxsize=16)
def training_flops_per_sample(model: str, input_shape: tuple[int, int, int], num_classes: int) -> float:
    """FLOPs of one training step of ``model`` per sample (forward and backward), for ``num_classes`` outputs."""
    from fcl_emu.methods.models.classifier import build_model

    with torch.random.fork_rng(devices=[]):
        net = build_model(model, input_shape, num_classes)
        x = torch.zeros(_BATCH, *input_shape)
        y = torch.arange(_BATCH) % max(num_classes, 1)
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(net(x), y).backward()
    return counter.get_total_flops() / _BATCH


def synthetic_replay_work(synthetic_batch: int, batch_size: int, task: int) -> float:
    """Work per real sample of a client that trains on ``synthetic_batch`` synthetic images beside each real batch
    of ``batch_size`` from task 1 on, with the old model's forward pass on them as teacher: the real step, plus
    ``synthetic_batch / batch_size`` times a step (3 forward-pass units) and a teacher forward (1 unit), over the
    step's 3 units. Drawing the synthetic images (a generator's forward pass, or an index) is left out."""
    return 1.0 + (synthetic_batch / batch_size * 4.0 / 3.0 if task > 0 else 0.0)
