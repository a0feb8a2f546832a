"""One round's secure aggregation on the wire: the engine's side of SecAgg+ (docs/secagg.md).

The engine sends every selected client a ``secagg_setup`` (before its train
request, so the client's session exists before its training ends), then
the run's clock runs the phases (:meth:`SecureRound.run`, each served by the
clock's ``wait``; :meth:`SecureRound.collect` is the real clock's).
Each phase of :class:`fcl_emu.secagg.server.SecAggServer` becomes one exchange
over the ROUTER socket: the coordinator serves the socket (joins, heartbeats
and leaves go on being handled) until every client still in the round has
answered or went offline, or the phase's time is up; then it closes the phase
and sends the next messages.

- ``advertise_keys`` and ``share_keys`` wait at most ``phase_timeout_s`` each;
- ``masked_input`` (the training happens meanwhile) waits until the round's
  deadline, or until ``wanted`` masked inputs arrived (overcommit);
- ``unmasking`` waits at most ``phase_timeout_s``.

How long each phase waits is its clock's (:mod:`fcl_emu.coordinator.clock`): the
above is the real clock's; on the emulated clock the round holds each phase's
replies until the phase closes in emulated time and takes only those that
arrived in time (:mod:`fcl_emu.coordinator.secure_timeline`).

The coordinator only ever sees masked vectors, added into one running sum as
they arrive (``SecAggServer.receive_masked``; held until their phase closes
on the emulated clock), and the unmasked sum. Under
distributed DP (``noise``) that sum already holds the clients' noise, and the
mean divides it by the planned cohort K, as central DP's fixed-denominator
estimator does.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from fcl_emu.aggregation.update import Arrays, DeltaLayout
from fcl_emu.secagg.noise import DistributedNoise
from fcl_emu.secagg.protocol import PHASES, SecAggAbort, SecAggError
from fcl_emu.secagg.server import SecAggServer
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.wire.framing import Message, WireError
from fcl_emu.wire.messages import (SECAGG_REPLIES, SecAggAbort as AbortBody, SecAggParams, SecAggPeerKeys,
                                   SecAggPublicKeys, SecAggRelay, SecAggSetup, SecAggUnmaskRequest, plain_body)

__all__ = ["SecureRound", "SecureOutcome", "round_id"]

log = logging.getLogger("fcl_emu.coordinator")

Send = Callable[[str, str, Any], int]  # (client, message type, body) -> bytes handed to the socket (0: not sent)
Serve = Callable[[Callable[[], bool], float], None]  # the coordinator's serve(until, deadline)
Alive = Callable[[str], bool]
Wait = Callable[[int], None]  # wait(phase): serve until the phase is over, as the clock has it
Reject = Callable[[WireError], None]  # the dispatcher's: count, log and answer a refused message
# {edge aggregator: its clients whose masked inputs it holds} -> {edge aggregator: (the clients its answer names, the
# ring sum of their masked inputs)}, for each aggregator that answered
PreSum = Callable[[dict[str, list[str]]], dict[str, tuple[list[str], np.ndarray | None]]]


def round_id(run_id: str, number: int) -> int:
    """The protocol's 64-bit round id: unique per run and round, so keys and shares never serve two rounds."""
    return int.from_bytes(hashlib.blake2b(f"{run_id}/{number}".encode(), digest_size=8).digest(), "little")


@dataclass
class SecureOutcome:
    """What a secure round gives the engine: the sample-weighted mean delta of the clients in the sum
    (None if the round aborted), and the record of the round (``RoundRecord.secagg``)."""

    delta: Arrays | None
    weight: int
    clients: tuple[str, ...]
    record: dict[str, Any] = field(default_factory=dict)
    losses: tuple[float, ...] = ()  # the training losses the summed clients reported


class SecureRound:
    def __init__(self, roster: list[str], layout: DeltaLayout, settings: SecAggSettings, *, run_id: str, number: int,
                 seed: int, send: Send, metrics: Any, max_weight: int | None = None,
                 noise: DistributedNoise | None = None, reject: Reject | None = None):
        """Raises :class:`SecAggAbort` if the round cannot be run (fewer than 3 clients, t > k). ``reject``: what
        becomes of a held reply the protocol refuses when it is admitted (:meth:`admit`; default: logged)."""
        self.number = number
        self.layout = layout
        self.send = send
        self.reject = reject
        self.metrics = metrics
        self.phase_timeout_s = settings.phase_timeout_s
        self.server = SecAggServer(roster, layout.dim, settings, round_id(run_id, number), seed, max_weight, noise)
        self.replied: dict[int, set[str]] = {p: set() for p in range(1, len(PHASES))}
        self.reported: dict[str, tuple[float, float]] = {}  # client -> (train_time_s, loss) of its masked input
        self.phase_s: dict[str, float] = {}
        self.dropouts: dict[str, int] = {p: 0 for p in PHASES[1:]}
        self.survivors: dict[str, list[str]] = {}  # phase -> the clients still in the round when it closed
        self.sent: dict[str, int] = {}  # client -> bytes of the latest phase's message to it
        self.held: dict[int, dict[str, Message]] | None = None  # phase -> replies held until it closes (hold())
        self.held_at: dict[str, str] = {}  # client -> the edge aggregator holding its masked input
        self.refused: set[str] = set()  # clients a reply of which the protocol refused: out of the round's waits
        self.presum: PreSum | None = None  # asks the edge aggregators for their clients' sums (docs/hierarchy.md)
        self._requests: dict[str, SecAggUnmaskRequest] = {}
        self._started = time.monotonic()

    @classmethod
    def open(cls, roster: list[str], layout: DeltaLayout, settings: SecAggSettings, max_weight: int, *, run_id: str,
             number: int, seed: int, send: Send, metrics: Any, noise: DistributedNoise | None = None,
             reject: Reject | None = None) -> SecureRound | SecureOutcome:
        """The round over ``roster`` under the run's ``secagg`` settings (``max_weight``: the weight clip where they
        leave it unset; ``noise``: distributed DP's); an aborted outcome if it cannot even start (too few clients,
        t > k, a ring too small for the noise)."""
        try:
            return cls(roster, layout, settings, run_id=run_id, number=number, seed=seed, send=send, metrics=metrics,
                       max_weight=max_weight, noise=noise, reject=reject)
        except (SecAggAbort, SecAggError) as exc:
            log.warning("round %d: secure aggregation cannot start: %s", number, exc)
            metrics.secagg_round(outcome="aborted", dropouts={}, recovered=0)
            return SecureOutcome(None, 0, (), {"outcome": "aborted", "reason": str(exc)})

    def collect(self, serve: Serve, online: Alive, alive: Alive, wanted: int, deadline: float,
                min_participants: int) -> SecureOutcome:
        """The real clock's round: run the protocol's phases while the clients train (``alive``: online and still
        in the round), each for its time in host seconds (the module docstring); the round's outcome (aborted:
        no delta)."""
        def wait(phase: int) -> None:
            if phase == 3:
                serve(lambda: len(self.replied[3]) >= wanted or not self.waiting(3, alive), deadline)
            else:
                end = time.monotonic() + self.phase_timeout_s
                serve(lambda: not self.waiting(phase, alive), end if phase == 4 else min(deadline, end))
        return self.run(wait, online, min_participants)

    def run(self, wait: Wait, online: Alive, min_participants: int) -> SecureOutcome:
        """Run the four phases, each served by ``wait(phase)`` before it closes; the round's outcome."""
        try:
            masked = self.until_masked(wait)
            if masked < min_participants:
                raise SecAggAbort(f"only {masked} masked inputs, rounds.min_participants is {min_participants}",
                                  "masked_input")
            return self.unmask(wait)
        except SecAggAbort as exc:
            log.warning("round %d: secure aggregation aborted: %s", self.number, exc)
            return self.abort(str(exc), [c for c in self.server.roster if online(c)])

    def setup_messages(self) -> dict[str, SecAggSetup]:
        return {c: SecAggSetup(params=msgspec.convert(m["params"], SecAggParams), index=m["index"],
                               neighbors=m["neighbors"])
                for c, m in self.server.setup().items()}

    # ----------------------------------------------------------------- receiving
    def on_message(self, peer: str, msg: Message) -> bool:
        """Take one client reply of this round. False if it came too late for its phase (not an error);
        :class:`WireError` (reason ``secagg``) if the protocol refuses it."""
        phase = PHASES.index(SECAGG_REPLIES[msg.type])
        if self.server.phase != phase or self.server.aborted is not None:
            return False
        if self.held is not None:
            if peer not in self.server.active or peer in self.replied[phase]:
                raise WireError("secagg", f"{PHASES[phase]}: no reply expected from {peer!r}")
            self.held[phase][peer] = msg
        else:
            try:
                self._receive(phase, peer, msg)
            except WireError:
                self.refused.add(peer)  # no phase waits for it again; the protocol drops it as one that sent nothing
                raise
        self.replied[phase].add(peer)
        return True

    def hold(self) -> None:
        """From now on hold each phase's replies until :meth:`admit` takes those that count (the emulated
        clock's)."""
        self.held = {p: {} for p in range(1, len(PHASES))}

    def admit(self, phase: int, clients: set[str]) -> None:
        """Take the held replies of ``clients`` in ``phase`` into the protocol (in roster order); the others are
        left out, so the phase's close drops their senders. A reply the protocol refuses is left out too, and
        rejected as it would have been on arrival."""
        for peer, msg in sorted(self.held[phase].items(), key=lambda item: self.server.index[item[0]]):
            if peer in clients:
                try:
                    self._receive(phase, peer, msg)
                except WireError as exc:
                    exc.peer, exc.msg_type, exc.round = peer, msg.type, msg.round
                    if self.reject is None:
                        log.warning("round %d: refused %s's %s: %s", self.number, peer, msg.type, exc)
                    else:
                        self.reject(exc)
        self.held[phase].clear()

    def _receive(self, phase: int, peer: str, msg: Message) -> None:
        body = plain_body(msg.body)
        try:
            if phase == 1:
                self.server.receive_keys(peer, body)
            elif phase == 2:
                self.server.receive_shares(peer, body)
            elif phase == 3:
                held = msg.type == "secagg_masked_held"
                masked = {"held": True} if held else {"y": msg.tensors.get("y")}
                self.server.receive_masked(peer, {**masked, "model_sig": body.get("model_sig")})
                if held:
                    self.held_at[peer] = body["aggregator"]
                self.reported[peer] = (body["train_time_s"], body["loss"])
            else:
                self.server.receive_unmask(peer, body)
        except SecAggError as exc:
            raise WireError("secagg", str(exc)) from None

    def waiting(self, phase: int, alive: Callable[[str], bool]) -> set[str]:
        """Clients still in the round that owe a reply in ``phase`` and may still send it (none whose reply was
        refused)."""
        return {c for c in self.server.active - self.replied[phase] - self.refused if alive(c)}

    # ------------------------------------------------------------------- phases
    def _exchange(self, phase: int, wait: Wait, close: Callable[[], Any]) -> Any:
        """Serve the phase (``wait``), then close it; time it, count who dropped, note who is left."""
        wait(phase)
        before = len(self.server.dropped)
        try:
            return close()
        finally:
            name = PHASES[phase]
            self.dropouts[name] += len(self.server.dropped) - before
            self.survivors[name] = sorted(self.server.active, key=self.server.index.__getitem__)
            now = time.monotonic()
            self.phase_s[name] = now - self._started
            self.metrics.secagg_phase(name, now - self._started)
            self._started = now

    def _send_all(self, msg_type: str, messages: Mapping[str, Any]) -> None:
        self.sent = {client: self.send(client, msg_type, body) for client, body in messages.items()}

    def until_masked(self, wait: Wait) -> int:
        """Run key advertisement, share exchange and masked input; returns how many masked inputs are in the
        sum. Raises :class:`SecAggAbort` if a phase keeps fewer than t clients."""
        peer_keys = self._exchange(1, wait, self.server.close_keys)
        self._send_all("secagg_peer_keys", {
            c: SecAggPeerKeys(keys={v: SecAggPublicKeys(**k) for v, k in m["keys"].items()})
            for c, m in peer_keys.items()})
        relays = self._exchange(2, wait, self.server.close_shares)
        for peer, by in sorted(self.server.refused_keys.items()):
            log.warning("round %d: %s refused the SecAgg+ keys advertised for %s (bad signature): %s is dropped",
                        self.number, ", ".join(sorted(by)), peer, peer)
        self._send_all("secagg_relay", {c: SecAggRelay(**m) for c, m in relays.items()})
        requests = self._exchange(3, wait, self._close_masked)
        self._requests = {c: SecAggUnmaskRequest(**m) for c, m in requests.items()}
        return len(requests)

    def _close_masked(self) -> dict[str, dict[str, Any]]:
        """Close the masked-input phase, first adding the sums the edge aggregators hold (``presum``). A sum counts
        for the clients its aggregator was asked for (those noted held there) that its answer names, never for
        more: the others asked for are dropped, as are all of an aggregator that sends no sum, one that names a
        client it was not asked for or one whose sum the protocol refuses; the dropped are recovered as any client
        that sent no masked input."""
        if self.held_at:
            groups: dict[str, list[str]] = {}
            for client, aggregator in sorted(self.held_at.items()):
                groups.setdefault(aggregator, []).append(client)
            sums = self.presum(groups) if self.presum is not None else {}
            for aggregator, clients in groups.items():
                named, y = sums.get(aggregator, ([], None))
                summed = [c for c in clients if c in set(named)]
                try:
                    if y is None:
                        raise SecAggError(f"no sum from {aggregator}")
                    if strangers := set(named) - set(clients):
                        raise SecAggError(f"{aggregator}'s sum names clients not held there ({sorted(strangers)[:3]})")
                    if len(summed) < len(clients):
                        log.warning("round %d: %s's sum leaves out %d of its %d clients asked for: they are dropped",
                                    self.number, aggregator, len(clients) - len(summed), len(clients))
                        self.server.lose_held(set(clients) - set(summed))
                    if summed:
                        self.server.add_sum(summed, y)
                except SecAggError as exc:
                    log.warning("round %d: the masked inputs of %d clients held at %s are lost: %s", self.number,
                                len(clients), aggregator, exc)
                    self.server.lose_held(clients)
        return self.server.close_masked()

    def unmask(self, wait: Wait) -> SecureOutcome:
        """Ask the survivors for their shares, remove the masks, decode the mean delta."""
        self._send_all("secagg_unmask_request", self._requests)
        result = self._exchange(4, wait, self.server.close_unmask)
        self.dropouts[PHASES[4]] = len(result.silent)  # in the sum all the same: their self-masks were rebuilt
        self.survivors[PHASES[4]] = [c for c in result.clients if c not in result.silent]
        total, weight = result.decode()
        noise = self.server.params.noise
        divisor = weight if noise is None else noise.cohort  # distributed DP: the fixed denominator K
        recovered = self.dropouts["masked_input"]
        self.metrics.secagg_round(outcome="completed", dropouts=self.dropouts, recovered=recovered)
        record = self.record(outcome="completed", clients=len(result.clients), recovered=recovered)
        losses = tuple(self.reported[c][1] for c in result.clients)
        delta = None if weight == 0 else self.layout.unflatten((total / divisor).astype(np.float32))
        return SecureOutcome(delta, weight, result.clients, record, losses)

    def abort(self, reason: str, clients: list[str]) -> SecureOutcome:
        """End the round without a sum: tell ``clients`` to forget their secrets; count and record it."""
        self._send_all("secagg_abort", {c: AbortBody(reason=reason[:500]) for c in clients})
        self.metrics.secagg_round(outcome="aborted", dropouts=self.dropouts, recovered=0)
        return SecureOutcome(None, 0, (), self.record(outcome="aborted", reason=reason))

    def record(self, **extra: Any) -> dict[str, Any]:
        p = self.server.params
        return {"neighbors": p.neighbors, "threshold": p.threshold, "dim": p.dim, "clip": p.clip,
                "max_weight": p.max_weight, "phase_s": dict(self.phase_s), "dropouts": dict(self.dropouts),
                "survivors": dict(self.survivors), "refused_keys": len(self.server.refused_keys), **extra}

