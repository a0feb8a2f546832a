"""Server optimisers (``--server-optimizer``): ``none`` (the plain FedAvg step), ``fedavgm`` (Hsu et al. 2019),
``fedadam``, ``fedyogi`` and ``fedadagrad`` (Reddi et al., ICLR 2021, Algorithm 2). One module per optimiser, each
registered by name with :func:`~.base.register`; the synchronous round policy applies the run's
(:mod:`fcl_emu.aggregation.policies.sync`)."""

from __future__ import annotations

import importlib

from fcl_emu.aggregation.choice import PartOptions, choice
from fcl_emu.aggregation.server_optimizers.base import OPTIMIZERS, ServerOptimizer

BUILTIN = ("none", "fedavgm", "fedadam", "fedyogi", "fedadagrad")  # modules of this package that register one
for _module in BUILTIN:
    importlib.import_module(f"{__name__}.{_module}")

OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)
OptimizerChoice, DEFAULT_OPTIMIZER = choice(OPTIMIZERS, "server optimiser", "none")


def make_optimizer(options: PartOptions) -> ServerOptimizer:
    """The optimiser an :data:`OptimizerChoice` value names, with its options."""
    return OPTIMIZERS[options.name](options)
