"""Secure aggregation, SecAgg+ (Bell et al., CCS 2020): the server side.

One :class:`SecAggServer` runs one round. For every phase it hands out one plain
dict per client (``setup``, then the dict returned by each ``close_*``) and takes
the clients' replies one at a time (``receive_*``: validates, raises
:class:`SecAggError` on a malformed reply so that the wire layer can count and
drop it). ``close_*`` ends a phase: whoever has not replied has dropped out.
A phase that leaves fewer than t participants, or a secret that cannot be
recovered, raises :class:`SecAggAbort`; the server is then finished and the
run goes on with the next round.

    server = SecAggServer(roster, dim=D, settings=SecAggSettings(neighbors=k), round_id=r, seed=s)
    out = server.setup()                       # {client: setup message}
    for c, reply in replies: server.receive_keys(c, reply)
    out = server.close_keys()                  # {client: neighbours' public keys}
    for c, reply in replies: server.receive_shares(c, reply)
    out = server.close_shares()                # {client: the shares addressed to it}
    for c, reply in replies: server.receive_masked(c, reply)
    out = server.close_masked()                # {client: which neighbours survived / dropped}
    for c, reply in replies: server.receive_unmask(c, reply)
    result = server.close_unmask()             # SecAggResult: the exact ring sum and who is in it

The server never holds an unmasked individual input: masked inputs are added
into one running sum as they arrive and the masks come off the sum only.
Primitives, parameters and guarantees: :mod:`fcl_emu.secagg.protocol`, docs/secagg-protocol.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fcl_emu.secagg.identity import SIGNATURE_BYTES
from fcl_emu.secagg.noise import DistributedNoise
from fcl_emu.secagg.protocol import (CIPHERTEXT_BYTES, COMMIT_BYTES, PHASES, RING_DTYPE, SHARE_BYTES, Quantizer,
                                     RoundParams, SecAggAbort, SecAggError, X25519PrivateKey, agree, check_commitment,
                                     harary_neighbors, pair_mask_key, prg_into, public_key, self_mask_key,
                                     shamir_combine)
from fcl_emu.secagg.settings import SecAggSettings

__all__ = ["SecAggServer", "SecAggResult", "SecAggAbort", "SecAggError"]


@dataclass
class SecAggResult:
    """The outcome of a round: the exact ring sum of the ``clients`` inputs (length dim + 1, last element
    the summed weight) and why each other sampled client is not in it."""

    params: RoundParams
    ring_sum: np.ndarray
    clients: tuple[str, ...]
    dropped: dict[str, str]
    silent: tuple[str, ...] = ()  # in the sum, but did not answer the unmasking request

    def decode(self) -> tuple[np.ndarray, int]:
        """(sum_i w_i x_i as float64, sum_i w_i)."""
        return Quantizer(self.params).decode(self.ring_sum, len(self.clients))

    def mean(self) -> np.ndarray:
        """The sample-weighted mean of the summed clients' inputs (float64)."""
        return Quantizer(self.params).mean(self.ring_sum, len(self.clients))


def check_masked(params, y: Any, whose: str) -> np.ndarray:
    """``y`` if it is a masked input (or a sum of them) of the round ``params``: a uint32 array of dim + 1 values
    in the ring; SecAggError otherwise."""
    if not isinstance(y, np.ndarray) or y.dtype != RING_DTYPE or y.shape != (params.length,):
        got = f"array {y.dtype} {y.shape}" if isinstance(y, np.ndarray) else type(y).__name__
        raise SecAggError(f"{PHASES[3]}: 'y' of {whose} must be a uint32 array of shape ({params.length},), got {got}")
    if params.ring_bits < 32 and (y >> np.uint32(params.ring_bits)).any():
        raise SecAggError(f"{PHASES[3]}: 'y' of {whose} has values outside the {params.ring_bits}-bit ring")
    return y


def _signature(reply: Mapping[str, Any], name: str, client: str, phase: int) -> bytes | None:
    """The signature field ``name`` of a reply in ``phase``: absent (None) or :data:`SIGNATURE_BYTES` bytes."""
    sig = reply.get(name)
    if sig is not None and (not isinstance(sig, (bytes, bytearray)) or len(sig) != SIGNATURE_BYTES):
        raise SecAggError(f"{PHASES[phase]}: {name!r} of {client!r} must be {SIGNATURE_BYTES} bytes")
    return sig


class SecAggServer:
    """The server of one SecAgg+ round over ``roster`` (the sampled clients; roster index = position + 1)."""

    def __init__(self, roster: Sequence[str], dim: int, settings: SecAggSettings | None = None, round_id: int = 0,
                 seed: int = 0, max_weight: int | None = None, noise: DistributedNoise | None = None):
        """``max_weight``: the sample-weight clip where ``settings`` leave it unset
        (:meth:`SecAggSettings.resolve`); ``noise``: distributed DP's noise, which every client adds."""
        roster = list(roster)
        if len(set(roster)) != len(roster):
            raise SecAggError("the roster repeats a client id")
        for c in roster:
            if not isinstance(c, str) or not c:
                raise SecAggError(f"client ids are non-empty strings, got {c!r}")
        self.params = (settings or SecAggSettings()).resolve(len(roster), dim, round_id, max_weight, noise)
        self.roster = tuple(roster)
        self.index = {c: i + 1 for i, c in enumerate(roster)}
        graph = harary_neighbors(len(roster), self.params.neighbors, np.random.default_rng(seed))
        self.graph: dict[str, frozenset[str]] = {c: frozenset(roster[j] for j in graph[i])
                                                 for i, c in enumerate(roster)}
        self.phase = 0
        self.active: set[str] = set(roster)      # still in the round
        self.dropped: dict[str, str] = {}        # client -> why it is not in the sum
        self.aborted: str | None = None
        self.timings: dict[str, float] = {}      # server seconds per phase (close_* and receive_* together)
        # phase state
        self._keys: dict[str, tuple[bytes, bytes]] = {}
        self._signatures: dict[str, bytes] = {}            # client -> signature of its advertised keys
        self.refused_keys: dict[str, list[str]] = {}       # client -> the neighbours that refused its keys
        self._holders: dict[str, tuple[str, ...]] = {}    # dealer -> its share holders, rank r holds x = r+1
        self._shares: dict[str, Mapping[str, bytes]] = {}  # dealer -> {holder: ciphertext}
        self._commits: dict[str, bytes] = {}
        self._in_masking: frozenset[str] = frozenset()    # U2: the clients everyone masks with
        self._masked: set[str] = set()
        self._model_sigs: dict[str, bytes] = {}           # client -> its signature of the model it trained
        self._elsewhere: set[str] = set()  # masked inputs a relay holds, whose sum it has yet to add (add_sum)
        self._sum: np.ndarray | None = None       # running sum of masked inputs
        self._survivors: frozenset[str] = frozenset()
        self._requests: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self._b_shares: dict[str, dict[str, bytes]] = {}   # survivor -> {holder: b-share}
        self._s_shares: dict[str, dict[str, bytes]] = {}   # dropped -> {holder: s_sk-share}
        self._responded: set[str] = set()
        self.result: SecAggResult | None = None

    # --- helpers -----------------------------------------------------------------------------
    def _time(self, phase: str, start: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start

    def _check_reply(self, phase: int, client: Any, reply: Any, received: Iterable[str]) -> str:
        if self.aborted is not None:
            raise SecAggError(f"the round was aborted ({self.aborted})")
        if self.phase != phase:
            raise SecAggError(f"a {PHASES[phase]!r} reply arrived while the round is in phase {PHASES[self.phase]!r}")
        if not isinstance(client, str) or client not in self.index:
            raise SecAggError(f"{PHASES[phase]}: unknown client {client!r} (not in this round's roster)")
        if client not in self.active:
            raise SecAggError(f"{PHASES[phase]}: client {client!r} is no longer in the round ({self.dropped[client]})")
        if client in received:
            raise SecAggError(f"{PHASES[phase]}: duplicate reply from {client!r}")
        if not isinstance(reply, Mapping):
            raise SecAggError(f"{PHASES[phase]}: the reply of {client!r} must be a dict")
        return client

    def _drop(self, clients: Iterable[str], why: str) -> None:
        for c in clients:
            if c in self.active:
                self.active.discard(c)
                self.dropped[c] = why

    def _abort(self, reason: str, phase: int) -> SecAggAbort:
        self.aborted = f"{PHASES[phase]}: {reason}"
        self.phase = len(PHASES)
        self._sum = None
        return SecAggAbort(reason, PHASES[phase])

    def _prune(self, phase: int) -> None:
        """Drop, until none is left, clients with fewer than t neighbours in the round: their secrets could
        never be reconstructed."""
        t = self.params.threshold
        changed = True
        while changed:
            changed = False
            for c in sorted(self.active):
                live = len(self.graph[c] & self.active)
                if live < t:
                    self._drop([c], f"excluded after {PHASES[phase]}: {live} live neighbours, threshold t={t}")
                    changed = True

    def _require(self, count: int, what: str, phase: int) -> None:
        if count < self.params.threshold:
            raise self._abort(f"only {count} {what}, threshold t={self.params.threshold}", phase)

    # --- phase 0: setup ----------------------------------------------------------------------
    def setup(self) -> dict[str, dict[str, Any]]:
        """The setup message of every client: round parameters, its roster index, its neighbours."""
        if self.phase != 0:
            raise SecAggError("setup() was already called")
        params = self.params.to_dict()
        out = {c: {"params": params, "index": self.index[c],
                   "neighbors": {v: self.index[v] for v in sorted(self.graph[c], key=self.index.__getitem__)}}
               for c in self.roster}
        self.phase = 1
        return out

    # --- phase 1: advertise keys -------------------------------------------------------------
    def receive_keys(self, client: str, reply: Mapping[str, Any]) -> None:
        start = time.perf_counter()
        client = self._check_reply(1, client, reply, self._keys)
        raw = []
        for name in ("c_pk", "s_pk"):
            v = reply.get(name)
            public_key(v, f"{PHASES[1]}: {name} of {client!r}")
            raw.append(bytes(v))
        if raw[0] == raw[1] or any(r in pair for pair in self._keys.values() for r in raw):
            raise SecAggError(f"{PHASES[1]}: a public key of {client!r} repeats a key already advertised")
        sig = _signature(reply, "sig", client, 1)
        self._keys[client] = (raw[0], raw[1])
        if sig is not None:
            self._signatures[client] = bytes(sig)
        self._time(PHASES[1], start)

    def close_keys(self) -> dict[str, dict[str, Any]]:
        """End of key advertisement -> every remaining client's message ``{"keys": {peer: {c_pk, s_pk}}}``
        (and ``sig``, the peer's signature of them, where it sent one)."""
        start = time.perf_counter()
        self._check_close(1)
        self._drop(self.active - set(self._keys), f"no reply in {PHASES[1]}")
        self._require(len(self.active), "clients advertised keys", 1)
        self._prune(1)
        self._require(len(self.active), "clients with at least t live neighbours remain", 1)
        out = {}
        for c in sorted(self.active):
            holders = tuple(sorted(self.graph[c] & self.active, key=self.index.__getitem__))
            self._holders[c] = holders
            out[c] = {"keys": {v: self._advertised(v) for v in holders}}
        self.phase = 2
        self._time(PHASES[1], start)
        return out

    def _advertised(self, client: str) -> dict[str, bytes]:
        keys = {"c_pk": self._keys[client][0], "s_pk": self._keys[client][1]}
        return keys if client not in self._signatures else {**keys, "sig": self._signatures[client]}

    # --- phase 2: share keys -----------------------------------------------------------------
    def receive_shares(self, client: str, reply: Mapping[str, Any]) -> None:
        """Checks ``{"shares": {holder: ciphertext}, "b_commit": bytes, "refused": [peer...]}``: a share for
        every neighbour that advertised keys except those whose keys the client ``refused`` (their signature
        failed its check): those are dropped from the round when the phase closes."""
        start = time.perf_counter()
        client = self._check_reply(2, client, reply, self._shares)
        shares = reply.get("shares")
        if not isinstance(shares, Mapping):
            raise SecAggError(f"{PHASES[2]}: 'shares' of {client!r} must be a dict")
        refused = reply.get("refused", [])
        if not isinstance(refused, (list, tuple)) or not set(refused) <= set(self._holders[client]):
            raise SecAggError(f"{PHASES[2]}: 'refused' of {client!r} must list neighbours it was sent keys of")
        expected = set(self._holders[client]) - set(refused)
        got = set(shares)
        if got != expected:
            raise SecAggError(f"{PHASES[2]}: {client!r} sent shares for unexpected recipients "
                              f"{sorted(map(repr, got - expected))} and none for {sorted(expected - got)}")
        for v, ct in shares.items():
            if not isinstance(ct, (bytes, bytearray)) or len(ct) != CIPHERTEXT_BYTES:
                raise SecAggError(f"{PHASES[2]}: the share {client!r} -> {v!r} must be {CIPHERTEXT_BYTES} bytes")
        commit = reply.get("b_commit")
        if not isinstance(commit, (bytes, bytearray)) or len(commit) != COMMIT_BYTES:
            raise SecAggError(f"{PHASES[2]}: 'b_commit' of {client!r} must be {COMMIT_BYTES} bytes")
        self._shares[client] = {v: bytes(ct) for v, ct in shares.items()}
        self._commits[client] = bytes(commit)
        if refused:  # the client ranked its share holders without them
            self._holders[client] = tuple(v for v in self._holders[client] if v not in refused)
            for v in refused:
                self.refused_keys.setdefault(v, []).append(client)
        self._time(PHASES[2], start)

    def close_shares(self) -> dict[str, dict[str, Any]]:
        """End of share exchange -> every remaining client's message ``{"shares": {sender: ciphertext}}``
        (the ciphertexts addressed to it, which the server cannot read)."""
        start = time.perf_counter()
        self._check_close(2)
        self._drop(self.active - set(self._shares), f"no reply in {PHASES[2]}")
        for v, by in sorted(self.refused_keys.items()):
            self._drop([v], f"its advertised keys failed the signature check of {', '.join(sorted(by))}")
        self._require(len(self.active), "clients shared their keys", 2)
        self._prune(2)
        self._require(len(self.active), "clients with at least t live neighbours remain", 2)
        out = {c: {"shares": {u: self._shares[u][c] for u in sorted(self.graph[c] & self.active,
                                                                     key=self.index.__getitem__)}}
               for c in sorted(self.active)}
        self._in_masking = frozenset(self.active)
        self.phase = 3
        self._time(PHASES[2], start)
        return out

    # --- phase 3: masked input ---------------------------------------------------------------
    def receive_masked(self, client: str, reply: Mapping[str, Any]) -> None:
        """Checks the masked input ``{"y": uint32 array (dim + 1)}`` and adds it into the running sum; or, with
        ``{"held": True}``, notes that a relay below (an edge aggregator) holds the client's masked input and will
        add it in a sum of several (:meth:`add_sum`) before the phase closes. Either may carry ``"model_sig"``, the
        client's signature of the model it trained, which the unmasking requests relay
        (:mod:`fcl_emu.secagg.consistency`)."""
        start = time.perf_counter()
        client = self._check_reply(3, client, reply, self._masked)
        sig = _signature(reply, "model_sig", client, 3)
        if reply.get("held") is True:
            self._elsewhere.add(client)
        else:
            self._add(check_masked(self.params, reply.get("y"), repr(client)))
        self._masked.add(client)
        if sig is not None:
            self._model_sigs[client] = bytes(sig)
        self._time(PHASES[3], start)

    def add_sum(self, clients: Iterable[str], y_sum: Any) -> None:
        """Add the ring sum of the held masked inputs of ``clients`` (each noted held, none added yet)."""
        clients = set(clients)
        if not clients <= self._elsewhere:
            raise SecAggError(f"{PHASES[3]}: a sum over masked inputs not noted as held "
                              f"({sorted(clients - self._elsewhere)[:3]})")
        self._add(check_masked(self.params, y_sum, f"the sum of {len(clients)} held inputs"))
        self._elsewhere -= clients

    def lose_held(self, clients: Iterable[str]) -> None:
        """The held masked inputs of ``clients`` will never be added (their relay is gone): the phase's close
        drops these clients, as it drops those that sent nothing."""
        clients = set(clients) & self._elsewhere
        self._elsewhere -= clients
        self._masked -= clients

    def _add(self, y: np.ndarray) -> None:
        if self._sum is None:
            self._sum = np.zeros(self.params.length, RING_DTYPE)
        np.add(self._sum, y, out=self._sum)

    def close_masked(self) -> dict[str, dict[str, Any]]:
        """End of masked input -> every survivor's message ``{"survivors": [...], "dropped": [...],
        "n_survivors": int, "model_sigs": {...}}`` (its neighbours that sent / did not send a masked input, and
        every survivor's signature of the model it trained, where it sent one)."""
        start = time.perf_counter()
        self._check_close(3)
        if self._elsewhere:
            raise SecAggError(f"{PHASES[3]}: {len(self._elsewhere)} held masked inputs were neither added nor lost")
        self._drop(self.active - self._masked, f"no masked input in {PHASES[3]}")
        survivors = frozenset(self.active)
        self._require(len(survivors), "clients sent masked inputs", 3)
        t = self.params.threshold
        u2 = self._in_masking
        # Check recoverability before any client reveals a share.
        for c in sorted(u2, key=self.index.__getitem__):
            live = len(self.graph[c] & u2 & survivors)
            if live < t:
                what = "self-mask seed" if c in survivors else "pairwise mask key"
                raise self._abort(f"the {what} of client {c!r} cannot be recovered: {live} of its share "
                                  f"holders remain, threshold t={t}", 3)
        self._survivors = survivors
        model_sigs = {c: self._model_sigs[c] for c in sorted(survivors, key=self.index.__getitem__)
                      if c in self._model_sigs}
        out = {}
        for c in sorted(survivors):
            peers = self.graph[c] & u2
            surv, drop = peers & survivors, peers - survivors
            self._requests[c] = (frozenset(surv), frozenset(drop))
            out[c] = {"survivors": sorted(surv, key=self.index.__getitem__),
                      "dropped": sorted(drop, key=self.index.__getitem__), "n_survivors": len(survivors),
                      "model_sigs": model_sigs}
        self.phase = 4
        self._time(PHASES[3], start)
        return out

    # --- phase 4: unmasking ------------------------------------------------------------------
    def receive_unmask(self, client: str, reply: Mapping[str, Any]) -> None:
        """Checks ``{"b_shares": {survivor: bytes}, "s_shares": {dropped: bytes}}`` against what was asked."""
        start = time.perf_counter()
        client = self._check_reply(4, client, reply, self._responded)
        surv, drop = self._requests[client]
        for name, want in (("b_shares", surv), ("s_shares", drop)):
            got = reply.get(name)
            if not isinstance(got, Mapping):
                raise SecAggError(f"{PHASES[4]}: {name!r} of {client!r} must be a dict")
            if set(got) != want:
                raise SecAggError(f"{PHASES[4]}: {name!r} of {client!r} covers {sorted(map(repr, got))}, "
                                  f"asked for {sorted(want)}")
            for v, s in got.items():
                if not isinstance(s, (bytes, bytearray)) or len(s) != SHARE_BYTES:
                    raise SecAggError(f"{PHASES[4]}: the {name[0]}-share of {v!r} from {client!r} must be "
                                      f"{SHARE_BYTES} bytes")
        for v, s in reply["b_shares"].items():
            self._b_shares.setdefault(v, {})[client] = bytes(s)
        for v, s in reply["s_shares"].items():
            self._s_shares.setdefault(v, {})[client] = bytes(s)
        self._responded.add(client)
        self._time(PHASES[4], start)

    def close_unmask(self) -> SecAggResult:
        """Reconstructs the survivors' self-mask seeds and the dropped clients' mask keys, removes all masks
        from the running sum and returns the exact ring sum of the survivors' quantised inputs."""
        start = time.perf_counter()
        self._check_close(4)
        p = self.params
        t = p.threshold
        self._require(len(self._responded), "survivors answered the unmasking request", 4)
        survivors, u2 = self._survivors, self._in_masking
        total = self._sum
        scratch = np.empty(p.length, RING_DTYPE)
        for c in sorted(survivors, key=self.index.__getitem__):
            seed = shamir_combine(self._points(c, self._b_shares, 4), t)
            if not check_commitment(seed, p.round_id, c, self._commits[c]):
                raise self._abort(f"the self-mask seed of {c!r} reconstructed from its shares does not match "
                                  f"its commitment (a share was corrupted)", 4)
            np.subtract(total, prg_into(self_mask_key(seed, p.round_id, self.index[c]), scratch), out=total)
        for d in sorted(u2 - survivors, key=self.index.__getitem__):
            raw = shamir_combine(self._points(d, self._s_shares, 4), t)
            sk = X25519PrivateKey.from_private_bytes(raw)
            if sk.public_key().public_bytes_raw() != self._keys[d][1]:
                raise self._abort(f"the mask key of {d!r} reconstructed from its shares does not match its "
                                  f"public key (a share was corrupted)", 4)
            for w in sorted(self.graph[d] & survivors, key=self.index.__getitem__):
                shared = agree(sk, public_key(self._keys[w][1], f"s_pk of {w!r}"), repr(w))
                prg_into(pair_mask_key(shared, p.round_id, self.index[w], self.index[d]), scratch)
                # w added +m if its index is smaller than d's, else -m: take it back out.
                (np.subtract if self.index[w] < self.index[d] else np.add)(total, scratch, out=total)
        if p.ring_bits < 32:
            np.bitwise_and(total, np.uint32(p.ring_mask), out=total)
        self.result = SecAggResult(params=p, ring_sum=total, dropped=dict(self.dropped),
                                   clients=tuple(sorted(survivors, key=self.index.__getitem__)),
                                   silent=tuple(sorted(survivors - self._responded, key=self.index.__getitem__)))
        self._sum = None
        self.phase = len(PHASES)
        self._time(PHASES[4], start)
        return self.result

    def _points(self, target: str, store: Mapping[str, Mapping[str, bytes]], phase: int) -> list[tuple[int, bytes]]:
        """The (x, share) points of ``target``'s secret that responders returned."""
        got = store.get(target, {})
        holders = self._holders[target]
        if len(got) < self.params.threshold:
            what = "self-mask seed" if store is self._b_shares else "pairwise mask key"
            raise self._abort(f"the {what} of client {target!r} cannot be recovered: {len(got)} shares returned, "
                              f"threshold t={self.params.threshold}", phase)
        return [(holders.index(h) + 1, s) for h, s in got.items()]

    def _check_close(self, phase: int) -> None:
        if self.aborted is not None:
            raise SecAggError(f"the round was aborted ({self.aborted})")
        if self.phase != phase:
            raise SecAggError(f"cannot close {PHASES[phase]!r}: the round is in phase "
                              f"{PHASES[self.phase] if self.phase < len(PHASES) else 'done'!r}")
