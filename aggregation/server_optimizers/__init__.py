"""Server optimisers (``--server-optimizer``): ``none`` (the plain FedAvg step), ``fedavgm`` (Hsu et al. 2019),
``fedadam``, ``fedyogi`` and ``fedadagrad`` (Reddi et al., ICLR 2021, Algorithm 2). One module per optimiser, each
registered by name with :func:`~.base.register`; the synchronous round policy applies the run's
(:mod:`fcl_emu.aggregation.policies.sync`)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import pydantic

from fcl_emu.aggregation.server_optimizers.base import OPTIMIZERS, OptimizerOptions, ServerOptimizer

BUILTIN = ("none", "fedavgm", "fedadam", "fedyogi", "fedadagrad")  # modules of this package that register one
for _module in BUILTIN:
    importlib.import_module(f"{__name__}.{_module}")

OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def optimizer_options(name: str, values: Mapping[str, Any]) -> OptimizerOptions:
    """Optimiser ``name``'s options from the run config's set ``server_*`` values (ValueError, one line, for an
    option it does not take or a value out of its range)."""
    cls = OPTIMIZERS[name].Options
    unknown = sorted(set(values) - set(cls.model_fields))
    if unknown:
        takes = ", ".join(f"server_{k}" for k in cls.model_fields) or "no options"
        raise ValueError(f"--server-optimizer {name} takes no {', '.join(f'server_{k}' for k in unknown)} "
                         f"(it takes {takes})")
    try:
        return cls(**values)
    except pydantic.ValidationError as exc:  # its first error, on one line
        e = exc.errors()[0]
        raise ValueError(f"--server-optimizer {name}: server_{e['loc'][0]} {e['msg'].lower()}") from None


def make_optimizer(name: str, values: Mapping[str, Any]) -> ServerOptimizer | None:
    """The optimiser ``name`` with its options; None for ``none`` (the aggregate is the new model, bit for bit)."""
    if name == "none":
        return None
    return OPTIMIZERS[name](optimizer_options(name, values))
