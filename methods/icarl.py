"""iCaRL+FL: the federated iCaRL baseline of GLFC's tables.

Rebuffi, Kolesnikov, Sperl and Lampert, "iCaRL: Incremental Classifier and
Representation Learning", CVPR 2017, federated as the baseline "iCaRL + FL"
of Dong et al., "Federated Class-Incremental Learning" (CVPR 2022, Tables
1-8): FedAvg of clients that each train iCaRL's way. It is GLFC
(:mod:`fcl_emu.methods.glfc`) without its three components, each replaced as
the paper's ablations do:

- *Classification*: eq. 1's plain sigmoid BCE against the one-hot label over
  the seen classes (``compensation = "off"``; ``"gradient"`` puts GLFC's
  class-aware gradient compensation back).
- *Distillation*: iCaRL's, the BCE of the student's sigmoid outputs on the
  old classes against the old model's sigmoid outputs
  (``distillation = "icarl"``); ``L = w_gc L_BCE + w_rd L_KD`` from task 1
  (0.5 each, as GLFC's code), ``L_BCE`` alone in task 0.
- *Old model*: the previous task's final global model, sent once per task;
  no proxy server, no prototype gradients, no server-side job.
- *Exemplar memory*: GLFC's, i.e. iCaRL's herding with ``memory_size``
  exemplars per client in all (2,000, as both papers), by class.

Defaults: the options and their defaults are GLFC's
(:class:`~fcl_emu.methods.glfc.ReplayOptions`) except ``compensation``
(``"off"``), ``distillation`` (``"icarl"``) and ``task_detection``
(``"oracle"``: the emulator's task start, since GLFC's paper notes that
joining FL and class-incremental learning this way needs to know when new
classes arrive; ``"entropy"`` takes GLFC's detection). The optimiser is
GLFC's code's (no momentum, weight decay 1e-5, as iCaRL's).

Deviations, on purpose:

- The classifier is the network's own head (the argmax of its logits), not
  iCaRL's nearest-mean-of-exemplars rule; GLFC's paper does not say which
  its baseline used.
- iCaRL's single BCE takes the old model's outputs as the targets of the old
  classes and the label for the new ones; here the two terms are GLFC's
  split (the one-hot BCE over every class plus the distillation over the old
  ones, weighted ``w_gc`` and ``w_rd``), so that the baseline differs from
  GLFC's ablations only in the component swapped.
- The memory is selected with the client's own model after each job and its
  classes cut to ``memory_size // classes`` at a new task, as GLFC's clients do
  here (:mod:`fcl_emu.methods.glfc` states how that differs from GLFC's code).
- The client store and the old-model tensors keep GLFC's names
  (``glfc.memory``, ``glfc/old/...``).
"""

from __future__ import annotations

from typing import Literal

import pydantic

from fcl_emu.methods.base import ServerPart
from fcl_emu.methods.glfc import SPEC as GLFC_SPEC
from fcl_emu.methods.glfc import GLFCClient, GLFCServer, ReplayOptions
from fcl_emu.methods.registry import MethodSpec, register

NAME = "icarl"


class ICaRLOptions(ReplayOptions):
    compensation: Literal["gradient", "off"] = pydantic.Field(
        "off", description="plain BCE (iCaRL) or GLFC's class-aware gradient compensation")
    distillation: Literal["relation", "icarl", "off"] = pydantic.Field(
        "icarl", description="iCaRL's distillation, GLFC's relation distillation or none")
    task_detection: Literal["entropy", "oracle"] = pydantic.Field(
        "oracle", description="take the task start (FL + iCaRL) or detect new classes by GLFC's entropy rise")


class ICaRLServer(GLFCServer):
    """FedAvg; at a new task the previous task's final global model goes to the clients as their old model."""

    options: ICaRLOptions
    side_channels = ()
    aggregate = ServerPart.aggregate  # FedAvg alone (or the run's rule): no proxy

    def uses_proxy(self) -> bool:
        """Never: the old model is the previous task's final global model."""
        return False


class ICaRLClient(GLFCClient):
    options: ICaRLOptions

    def sends_prototypes(self) -> bool:
        """Never: there is no proxy to read them."""
        return False


SPEC = register(MethodSpec(
    name=NAME,
    description="iCaRL+FL (Rebuffi et al., CVPR 2017; GLFC's baseline): exemplars by herding, BCE, iCaRL's "
                "distillation from the previous task's final global model",
    options=ICaRLOptions, server=ICaRLServer, client=ICaRLClient,
    training=dict(GLFC_SPEC.training),  # GLFC's code's SGD: no momentum, weight decay 1e-5 (as iCaRL's)
))
