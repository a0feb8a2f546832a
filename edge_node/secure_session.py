"""The SecAgg+ client on the wire (docs/secagg.md): each client's session of a secure round.

:class:`SecureSessions` answers the coordinator's ``secagg_*`` messages with
the replies of the client's :class:`fcl_emu.secagg.client.SecAggClient`, and sends
its masked input once both the relayed shares and its training result are
there, in whichever order they come. A refused message or an aborted
protocol ends the client's session and is reported as an ``error`` (code
``secagg``). Where the node's keys come with signing keys, each client signs
the public keys it advertises and checks its neighbours' signatures against
the run's signers (``secagg_signers.json``, :mod:`fcl_emu.secagg.identity`); a
neighbour whose signature fails is refused and logged, and no client releases a
share unless every survivor signed the model it trained itself
(:mod:`fcl_emu.secagg.consistency`; ``check_models``, off only for research).
Each reply carries the CPU seconds the client's cryptography took for it (``cpu_s``; ``mask_cpu_s``
for the masked input), which the emulated clock places on the client's
timeline as it places training.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from fcl_emu.edge_node.client import EmulatedClient, SecAggSession, TrainResult
from fcl_emu.monitoring.metrics import EdgeNodeMetrics
from fcl_emu.secagg.client import SecAggClient
from fcl_emu.secagg.identity import KeySigner, KeyVerifier
from fcl_emu.secagg.protocol import SecAggAbort, SecAggError
from fcl_emu.wire.auth import ClientKeyring
from fcl_emu.wire.framing import Message
from fcl_emu.wire.messages import Error, SecAggKeys, SecAggMasked, SecAggShares, SecAggUnmask, plain_body

log = logging.getLogger("fcl_emu.edge_node")

SECAGG_DOWN = frozenset({"secagg_setup", "secagg_peer_keys", "secagg_relay", "secagg_unmask_request",
                         "secagg_abort"})

Send = Callable[..., None]  # (client, msg_type, body, round=, task=): a message to the coordinator
Upload = Callable[[EmulatedClient, TrainResult, str, Any, dict[str, np.ndarray]], None]  # a training result


class SecureSessions:
    """The secure-aggregation side of every client of a node (each client's session is ``client.secagg``).

    ``send`` sends a message now; ``upload`` sends a training result through the client's emulated device;
    ``seed`` is the run's seed (it seeds the stochastic rounding of each masked input); ``keys``: the node's
    keys, whose signing keys and signers' list sign and check the advertised SecAgg+ keys and the trained models
    (None: plain TCP); ``check_models``: whether a client checks that every survivor trained its model."""

    def __init__(self, *, send: Send, upload: Upload, seed: Callable[[], int], metrics: EdgeNodeMetrics,
                 keys: ClientKeyring | None = None, check_models: bool = True):
        self._send = send
        self._upload = upload
        self._seed = seed
        self._metrics = metrics
        self._keys = keys
        self._check_models = check_models
        self._verifier = None if keys is None or keys.signers is None else KeyVerifier(keys.signers)
        if keys is not None and keys.signers is None:
            log.warning("no secagg_signers.json beside the coordinator's key: the SecAgg+ keys of neighbours are "
                        "not checked against their signatures")

    def _protocol(self, client: EmulatedClient) -> SecAggClient:
        """A fresh protocol state for the client's round, signing and checking keys where the node can."""
        signing = None if self._keys is None else self._keys.for_identity(client.id).signing
        return SecAggClient(client.id, None if signing is None else KeySigner(signing), self._verifier,
                            check_models=self._check_models)

    def on_message(self, client: EmulatedClient, msg: Message) -> None:
        """One SecAgg+ message of the coordinator (a type in :data:`SECAGG_DOWN`)."""
        session = client.secagg
        if msg.type == "secagg_setup":
            session = client.secagg = SecAggSession(msg.round, self._protocol(client))
        elif session is None or session.round != msg.round:
            if msg.type != "secagg_abort":
                self._failed(client, msg.round, msg.task, f"{msg.type} for round {msg.round}, but this "
                                                          f"client has no secure-aggregation session for it")
            return
        body = plain_body(msg.body)
        protocol = session.protocol
        cpu_started = time.thread_time()
        try:
            if msg.type == "secagg_setup":
                self._reply(client, msg, "advertise_keys", "secagg_keys", SecAggKeys, protocol.on_setup(body),
                            cpu_started)
            elif msg.type == "secagg_peer_keys":
                reply = protocol.on_keys(body)
                if protocol.refused:
                    log.warning("%s: refused the SecAgg+ keys of %s in round %d: bad signature", client.id,
                                ", ".join(protocol.refused), msg.round)
                self._reply(client, msg, "share_keys", "secagg_shares", SecAggShares, reply, cpu_started)
            elif msg.type == "secagg_relay":
                session.relay = body
                self._send_masked(client)
            elif msg.type == "secagg_unmask_request":
                self._reply(client, msg, "unmasking", "secagg_unmask", SecAggUnmask, protocol.on_unmask(body),
                            cpu_started)
            else:  # secagg_abort
                client.secagg = None
        except (SecAggError, SecAggAbort) as exc:
            self._failed(client, msg.round, msg.task, str(exc))

    def cannot_mask(self, client: EmulatedClient, round: int) -> str | None:
        """Why the client could not send a masked input for ``round`` were it to train now (no session of that
        round: its ``secagg_setup`` never came), or None."""
        session = client.secagg
        if session is None or session.round != round:
            return f"to train round {round} without its secure-aggregation session (no secagg_setup came)"
        return None

    def on_result(self, client: EmulatedClient, result: TrainResult) -> None:
        """The client's training result of a secure round; without its round's session (aborted or refused,
        and the coordinator knows) it is dropped."""
        session = client.secagg
        if session is not None and session.round == result.round:
            session.result = result
            self._send_masked(client)

    def _reply(self, client: EmulatedClient, msg: Message, phase: str, msg_type: str, body_type,
               reply: dict[str, Any], cpu_started: float) -> None:
        """Send the protocol's reply with the CPU seconds its cryptography took since ``cpu_started``."""
        self._metrics.secagg_phase(phase, client.secagg.protocol.timings[phase])
        self._send(client, msg_type, body_type(**reply, cpu_s=time.thread_time() - cpu_started), round=msg.round,
                   task=msg.task)

    def _send_masked(self, client: EmulatedClient) -> None:
        """Mask and send the training result once both it and the relayed shares are there."""
        session = client.secagg
        result = session.result
        if session.relay is None or result is None:
            return
        if result.error is not None:
            client.secagg = None
            self._send(client, "error", Error(code="train_failed", detail=result.error[:500]),
                       round=result.round, task=result.task)
            return
        rng = np.random.default_rng(zlib.crc32(f"{self._seed()}/secagg/{client.index}/{result.round}".encode()))
        cpu_started = time.thread_time()
        try:
            masked = session.protocol.on_shares(session.relay, result.vector, result.num_samples, rng,
                                                result.model_digest)
        except (SecAggError, SecAggAbort) as exc:
            self._failed(client, result.round, result.task, str(exc))
            return
        session.relay = session.result = None  # the shares stay in the protocol state; the inputs can go
        self._metrics.secagg_phase("masked_input", session.protocol.timings["masked_input"])
        self._upload(client, result, "secagg_masked",
                     SecAggMasked(**result.report(), mask_cpu_s=time.thread_time() - cpu_started,
                                  model_sig=masked.get("model_sig")), {"y": masked["y"]})

    def _failed(self, client: EmulatedClient, round: int, task: int, detail: str) -> None:
        client.secagg = None
        log.warning("%s: secure aggregation: %s", client.id, detail)
        self._send(client, "error", Error(code="secagg", detail=detail[:500]), round=round, task=task)
