"""FedAvg / Finetune: the lower bound of federated class-incremental learning.

McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017 (Algorithm 1: clients run E local epochs of
SGD from the global model, the server sets w <- sum_k n_k/n w_k, written here
as the sample-weighted mean of deltas). Applied to a class-incremental stream
with no measure against forgetting ("Finetune" in the FCIL literature): the
head grows with each task and the loss is cross-entropy over all classes seen
so far, on the current task's data only. No options.
"""

from fcl_emu.methods.base import ClientPart, Options, ServerPart
from fcl_emu.methods.registry import MethodSpec, register


class FedAvgOptions(Options):
    pass


SPEC = register(MethodSpec(
    name="fedavg",
    description="FedAvg / Finetune: sample-weighted averaging, no protection against forgetting",
    options=FedAvgOptions,
    server=ServerPart,
    client=ClientPart,
    aliases=("finetune",),
))
