"""One model for every survivor, or no share: SecAgg+ against a coordinator that sends different models.

Secure aggregation hides each update inside a sum, but the coordinator chooses what every client trains. A
coordinator that sends its target the real model and every other client a model whose training changes nothing
(all weights zero: every gradient but the output bias's is zero) gets, from an honest run of the protocol, a sum
that is the target's update alone (Pasquini, Francati and Ateniese, "Eluding Secure Aggregation in Federated
Learning via Model Inconsistency", CCS 2022). No part of the cryptography is broken, so no check of the
protocol's own messages sees it.

The defence binds each masked input to the model it was computed from:

1. a client computes :func:`model_digest` of what it was asked to train (the round, the task, the train request's
   settings and every tensor of the model, names, dtypes and shapes included) and signs it, with the long-term
   Ed25519 key that signs its advertised keys (:mod:`fcl_emu.secagg.identity`), beside its masked input;
2. the server relays every survivor's signature in the unmasking request;
3. a client releases no share unless the signatures cover exactly the survivors (its own among them, each survivor
   neighbour in, no dropped neighbour in) and each verifies over *its own* digest (:func:`check_survivors`).

A coordinator that sent two models holds signatures over two digests; whichever it relays, the clients of the
other model refuse, so no self-mask seed of theirs is rebuilt and the round aborts. Checking every survivor, not
only the neighbours, also defeats a neighbour graph cut in two (the target's group and the rest), which the
server draws. Cost: one signature (64 bytes) up per client and a relayed signature per survivor down, and one
Ed25519 verification per survivor on each client.

What it needs and what it leaves: the check needs the run's signing keys (a client without a verifier cannot tell
a relayed signature from a forged one, so it does not check); it binds what was trained, not the survivor set a
coordinator shows each client, so a coordinator that shows two groups two survivor sets, each with its own
signatures, still splits the round in two sums (Bell et al.'s consistency check round closes that; not built).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from fcl_emu.secagg.identity import KeyVerifier
from fcl_emu.secagg.protocol import PHASES, SecAggAbort, SecAggError, context, describe

DIGEST_BYTES = 32
INCONSISTENT = "inconsistent models"  # how a refusal of this check begins (the client's error detail)


def model_digest(round: int, task: int, request: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> bytes:
    """BLAKE2b-256 of what a client is asked to train in a round: the round and task numbers, the train request's
    settings (``request``: name -> value) and each model tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(context(b"train request", round, task, *(f"{k}={request[k]!r}" for k in sorted(request))))
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        h.update(context(b"tensor", name, array.dtype.str, repr(array.shape)))
        h.update(memoryview(array).cast("B"))
    return h.digest()


def check_survivors(verifier: KeyVerifier, round_id: int, client: str, digest: bytes, signatures: Any,
                    n_survivors: int, survivors: set[str], dropped: set[str]) -> None:
    """Refuse the unmasking request of ``client`` (its neighbours ``survivors`` and ``dropped``, ``n_survivors`` in
    all) unless ``signatures`` (survivor -> signature of its trained model) cover exactly the survivors and each is
    that survivor's signature over ``digest``, the client's own model. :class:`SecAggError` for a malformed list,
    :class:`SecAggAbort` (reason beginning with :data:`INCONSISTENT`) where the survivors did not train one model."""
    what = f"client {client} unmask"
    if not isinstance(signatures, Mapping) or not all(isinstance(c, str) for c in signatures):
        raise SecAggError(f"{what}: 'model_sigs' must map survivors to signatures, got {describe(signatures)}")
    listed = set(signatures)
    if len(listed) != n_survivors or client not in listed or not survivors <= listed or dropped & listed:
        raise SecAggAbort(f"{INCONSISTENT} cannot be ruled out: the model signatures name {len(listed)} clients for "
                          f"{n_survivors} survivors (this client {'in' if client in listed else 'not in'} them, "
                          f"{len(survivors - listed)} survivor and {len(dropped & listed)} dropped neighbours amiss); "
                          f"no share is released", PHASES[4])
    unsigned = sorted(c for c, sig in signatures.items() if not verifier.verify_model(round_id, c, digest, sig))
    if unsigned:
        shown = ", ".join(unsigned[:3]) + (f" and {len(unsigned) - 3} more" if len(unsigned) > 3 else "")
        raise SecAggAbort(f"{INCONSISTENT}: {len(unsigned)} of the {n_survivors} survivors did not sign the model "
                          f"this client trained ({shown}): the coordinator sent different models, or relayed a "
                          f"forged signature; no share is released", PHASES[4])
