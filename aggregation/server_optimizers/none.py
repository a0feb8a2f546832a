"""``none``: the plain FedAvg step, ``x <- x_after``. Registered for its name alone: the synchronous policy takes
no step with it (:func:`~fcl_emu.aggregation.server_optimizers.make_optimizer` gives None), so the method's
aggregate is the new model, bit for bit."""

from __future__ import annotations

from fcl_emu.aggregation.server_optimizers.base import ServerOptimizer, register


@register
class NoServerOptimizer(ServerOptimizer):
    name = "none"
