"""Secure aggregation, SecAgg+: one client's side of one round (:class:`SecAggClient`).

Pure and synchronous: each ``on_*`` method takes the server's message of a
phase (a plain dict) and returns the client's reply. Primitives and
parameters: :mod:`fcl_emu.secagg.protocol`; the server: :mod:`fcl_emu.secagg.server`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from fcl_emu.secagg import protocol
from fcl_emu.secagg.consistency import DIGEST_BYTES, check_survivors
from fcl_emu.secagg.identity import KeySigner, KeyVerifier
from fcl_emu.secagg.noise import add_skellam, clip_l2
from fcl_emu.secagg.protocol import (PHASES, RING_DTYPE, SECRET_BYTES, SHARE_BYTES, Quantizer, RoundParams, SecAggAbort,
                             SecAggError, X25519PrivateKey, X25519PublicKey, agree, decrypt_share, describe,
                             encrypt_share, keypair, pair_mask_key, prg_stream, public_key, seed_commitment,
                             self_mask_key, shamir_split, share_ad, share_key, zero_bytes)


def _id(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise SecAggError(f"{what}: client ids are non-empty strings, got {describe(v)}")
    return v


def _mapping(msg: Any, key: str, what: str) -> Mapping:
    if not isinstance(msg, Mapping):
        raise SecAggError(f"{what}: the message must be a dict, got {describe(msg)}")
    v = msg.get(key)
    if not isinstance(v, Mapping):
        raise SecAggError(f"{what}: field {key!r} must be a dict, got {describe(v)}")
    return v


class SecAggClient:
    """One client's side of one round (create a fresh one per round; its secrets die with it).

    Call the four ``on_*`` methods in order with the server's messages; each returns the reply.
    ``timings`` holds the seconds spent on each reply, under the name of the phase it belongs to
    (``advertise_keys``, ``share_keys``, ``masked_input``, ``unmasking``), and the ``quantize`` /
    ``mask`` split of ``masked_input``.

    With a ``signer`` the client signs the keys it advertises and the digest of the model it trained; with a
    ``verifier`` it uses a neighbour's keys only if their signature checks out, and refuses the others
    (:attr:`refused`; :mod:`fcl_emu.secagg.identity`), and, with ``check_models`` (the default), it releases no
    share unless every survivor signed the model it trained itself (:mod:`fcl_emu.secagg.consistency`).
    """

    def __init__(self, client: str, signer: KeySigner | None = None, verifier: KeyVerifier | None = None,
                 check_models: bool = True):
        self.client = _id(client, "client")
        self.signer, self.verifier = signer, verifier
        self.check_models = check_models
        self.model: bytes | None = None  # the digest of the model it masked an input of (on_shares)
        self.refused: list[str] = []  # neighbours whose advertised keys failed the signature check
        self.params: RoundParams | None = None
        self.index = 0
        self.neighbors: dict[str, int] = {}       # peer id -> roster index (1-based)
        self._phase = 0
        self._c_sk: X25519PrivateKey | None = None
        self._s_sk: X25519PrivateKey | None = None
        self._peer_keys: dict[str, tuple[X25519PublicKey, X25519PublicKey]] = {}
        self._recv_keys: dict[str, bytes] = {}   # AEAD key for shares peer -> me
        self._b: bytes | None = None
        self._held: dict[str, tuple[bytes, bytes]] = {}  # peer -> (b-share, s_sk-share) it gave me
        self._revealed_b: set[str] = set()
        self._revealed_s: set[str] = set()
        self.timings: dict[str, float] = {}

    _MESSAGES = ("setup", "keys", "shares", "unmask")

    def _expect(self, phase: int, name: str) -> None:
        if self._phase != phase:
            expected = self._MESSAGES[self._phase] if self._phase < len(self._MESSAGES) else "nothing"
            raise SecAggError(f"client {self.client}: got the {name!r} message, expected {expected!r}")

    # --- phase 0 -> 1 ----------------------------------------------------------------------
    def on_setup(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        """Setup message -> advertised public keys ``{"c_pk": bytes, "s_pk": bytes}``."""
        start = time.perf_counter()
        self._expect(0, "setup")
        what = f"client {self.client} setup"
        if not isinstance(msg, Mapping):
            raise SecAggError(f"{what}: the message must be a dict")
        params = RoundParams.from_dict(_mapping(msg, "params", what))
        index = msg.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or not 1 <= index <= params.n:
            raise SecAggError(f"{what}: index must be an integer in [1, n={params.n}], got {index!r}")
        neighbors = {}
        for peer, idx in _mapping(msg, "neighbors", what).items():
            peer = _id(peer, what)
            if isinstance(idx, bool) or not isinstance(idx, int) or not 1 <= idx <= params.n or idx == index:
                raise SecAggError(f"{what}: neighbour {peer!r} has a bad index {idx!r}")
            neighbors[peer] = idx
        if self.client in neighbors:
            raise SecAggError(f"{what}: the client is listed as its own neighbour")
        if len(set(neighbors.values())) != len(neighbors):
            raise SecAggError(f"{what}: two neighbours share an index")
        if not params.neighbors <= len(neighbors) <= params.neighbors + 1:
            raise SecAggError(f"{what}: {len(neighbors)} neighbours for a graph of degree k={params.neighbors}")
        self.params, self.index, self.neighbors = params, index, neighbors
        self._c_sk, c_pk = keypair()
        self._s_sk, s_pk = keypair()
        self._phase = 1
        reply = {"c_pk": c_pk, "s_pk": s_pk}
        if self.signer is not None:
            reply["sig"] = self.signer.sign(params.round_id, self.client, c_pk, s_pk)
        self.timings["advertise_keys"] = time.perf_counter() - start
        return reply

    # --- phase 1 -> 2 ----------------------------------------------------------------------
    def on_keys(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        """Neighbours' public keys ``{"keys": {peer: {"c_pk", "s_pk", "sig"}}}`` -> encrypted shares
        ``{"shares": {peer: ciphertext}, "b_commit": bytes}``, and ``"refused": [peer...]``: the neighbours
        whose keys failed the signature check (with a verifier), which get no share."""
        start = time.perf_counter()
        self._expect(1, "keys")
        p = self.params
        what = f"client {self.client} keys"
        keys = _mapping(msg, "keys", what)
        own = {self._c_sk.public_key().public_bytes_raw(), self._s_sk.public_key().public_bytes_raw()}
        seen = set(own)
        peer_keys = {}
        for peer, entry in keys.items():
            peer = _id(peer, what)
            if peer not in self.neighbors:
                raise SecAggError(f"{what}: {peer!r} is not a neighbour of this client")
            if not isinstance(entry, Mapping):
                raise SecAggError(f"{what}: keys of {peer!r} must be a dict")
            raw = (entry.get("c_pk"), entry.get("s_pk"))
            pks = (public_key(raw[0], f"{what}: c_pk of {peer!r}"), public_key(raw[1], f"{what}: s_pk of {peer!r}"))
            if self.verifier is not None and not self.verifier.verify(p.round_id, peer, bytes(raw[0]),
                                                                      bytes(raw[1]), entry.get("sig")):
                self.refused.append(peer)
                continue
            for r in raw:
                if bytes(r) in seen:
                    raise SecAggError(f"{what}: public key of {peer!r} repeats another key (reflected or reused)")
                seen.add(bytes(r))
            peer_keys[peer] = pks
        if len(peer_keys) < p.threshold:
            raise SecAggAbort(f"only {len(peer_keys)} neighbours advertised keys, threshold t={p.threshold}",
                              PHASES[1])
        self._peer_keys = peer_keys
        # Holders of this client's shares, ranked by roster index: the holder ranked r gets x = r + 1.
        holders = sorted(peer_keys, key=self.neighbors.__getitem__)
        self._b = os.urandom(SECRET_BYTES)
        b_shares = shamir_split(self._b, p.threshold, len(holders))
        s_shares = shamir_split(self._s_sk.private_bytes_raw(), p.threshold, len(holders))
        out = {}
        for peer, bs, ss in zip(holders, b_shares, s_shares):
            shared = agree(self._c_sk, peer_keys[peer][0], f"{peer!r}")
            send = share_key(shared, p.round_id, self.index, self.neighbors[peer])
            self._recv_keys[peer] = share_key(shared, p.round_id, self.neighbors[peer], self.index)
            out[peer] = encrypt_share(send, share_ad(p.round_id, self.client, peer), bs + ss)
        self._phase = 2
        reply = {"shares": out, "b_commit": seed_commitment(self._b, p.round_id, self.client)}
        if self.refused:
            reply["refused"] = sorted(self.refused)
        self.timings["share_keys"] = time.perf_counter() - start
        return reply

    # --- phase 2 -> 3 ----------------------------------------------------------------------
    def on_shares(self, msg: Mapping[str, Any], vector: Any, weight: Any, rng: np.random.Generator,
                  model: bytes | None = None) -> dict[str, Any]:
        """Shares addressed to this client ``{"shares": {peer: ciphertext}}``, its input vector (dim floats),
        its sample weight, the generator for stochastic rounding and the digest of the model the vector was trained
        from (:func:`fcl_emu.secagg.consistency.model_digest`; None: none to bind) -> ``{"y": uint32 array
        (dim + 1)}``, and ``"model_sig"``, the client's signature of the digest, with a signer.

        The senders are the neighbours that survived the share phase: the client masks with exactly those.
        Shares are decrypted and authenticated here, before the masked input leaves the client. With
        distributed DP (``params.noise``) the vector is clipped to L2 norm ``clip`` and each value gets the
        client's share of the noise, drawn from the OS's entropy (:mod:`fcl_emu.secagg.noise`).
        """
        start = time.perf_counter()
        self._expect(2, "shares")
        p = self.params
        what = f"client {self.client} shares"
        cts = _mapping(msg, "shares", what)
        held = {}
        for peer, blob in cts.items():
            peer = _id(peer, what)
            if peer not in self._peer_keys:
                raise SecAggError(f"{what}: {peer!r} is not a neighbour that advertised keys")
            plain = decrypt_share(self._recv_keys[peer], share_ad(p.round_id, peer, self.client), blob,
                                  f"{what}: share from {peer!r}")
            held[peer] = (plain[:SHARE_BYTES], plain[SHARE_BYTES:])
        if len(held) < p.threshold:
            raise SecAggAbort(f"only {len(held)} neighbours sent shares, threshold t={p.threshold}", PHASES[2])
        if model is not None and (not isinstance(model, bytes) or len(model) != DIGEST_BYTES):
            raise SecAggError(f"{what}: the model digest must be {DIGEST_BYTES} bytes, got {describe(model)}")
        quantizer = Quantizer(p)
        x, w = quantizer.check_input(vector, weight)
        noise_mu, noise_rng = 0.0, None
        if p.noise is not None:
            x = clip_l2(x, p.clip)
            noise_mu, noise_rng = p.noise.share_variance(p.levels, p.dim) / 2, np.random.default_rng()
        t_mask = time.perf_counter()  # the masking proper starts here (key agreement and expansion)
        pair_keys = [(pair_mask_key(agree(self._s_sk, self._peer_keys[peer][1], f"{peer!r}"), p.round_id,
                                    self.index, self.neighbors[peer]), self.index < self.neighbors[peer])
                     for peer in held]
        # One pass over the vector in cache-sized chunks: quantise the chunk, then add the self mask and add or
        # subtract each pairwise mask, each a ChaCha20 keystream continued chunk by chunk.
        streams = [(prg_stream(self_mask_key(self._b, p.round_id, self.index)), True)]
        streams += [(prg_stream(key), plus) for key, plus in pair_keys]
        y = np.empty(p.length, RING_DTYPE)
        scratch = np.empty(min(protocol.CHUNK, p.length), RING_DTYPE)
        raw = memoryview(scratch).cast("B")
        buffers = quantizer.buffers()
        t_quant = 0.0
        for lo in range(0, p.length, protocol.CHUNK):
            hi = min(p.length, lo + protocol.CHUNK)
            chunk, mask = y[lo:hi], scratch[:hi - lo]
            t0 = time.perf_counter()
            quantizer.encode_into(x, w, rng, chunk, lo, hi, buffers)
            if noise_rng is not None and lo < p.dim:
                add_skellam(chunk[:min(hi, p.dim) - lo], noise_mu, noise_rng)
            t_quant += time.perf_counter() - t0
            zeros, out = zero_bytes(mask.nbytes), raw[:mask.nbytes]
            for stream, plus in streams:
                stream.update_into(zeros, out)
                (np.add if plus else np.subtract)(chunk, mask, out=chunk)
        if p.ring_bits < 32:
            np.bitwise_and(y, np.uint32(p.ring_mask), out=y)
        end = time.perf_counter()
        self._held, self.model = held, model
        self._phase = 3
        reply: dict[str, Any] = {"y": y}
        if self.signer is not None and model is not None:
            reply["model_sig"] = self.signer.sign_model(p.round_id, self.client, model)
        self.timings.update(masked_input=time.perf_counter() - start, quantize=t_quant, mask=end - t_mask - t_quant)
        return reply

    # --- phase 3 -> 4 ----------------------------------------------------------------------
    def on_unmask(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        """``{"survivors": [peer...], "dropped": [peer...], "n_survivors": int, "model_sigs": {survivor: bytes}}`` ->
        ``{"b_shares": {survivor: bytes}, "s_shares": {dropped: bytes}}``.

        The lists must partition the neighbours this client masked with. With a verifier, ``check_models`` and a
        model digest given with the masked input, ``model_sigs`` must hold every survivor's signature over that
        digest (:func:`fcl_emu.secagg.consistency.check_survivors`), else no share is released. For any one peer the
        client reveals either the share of its self-mask seed (peer survived) or the share of its mask key (peer
        dropped), never both, also across repeated requests; a request that would break this is refused.
        """
        start = time.perf_counter()
        if self._phase not in (3, 4):
            self._expect(3, "unmask")
        p = self.params
        what = f"client {self.client} unmask"
        if not isinstance(msg, Mapping):
            raise SecAggError(f"{what}: the message must be a dict")
        lists = {}
        for key in ("survivors", "dropped"):
            v = msg.get(key)
            if not isinstance(v, (list, tuple)):
                raise SecAggError(f"{what}: field {key!r} must be a list of client ids")
            lists[key] = [_id(x, what) for x in v]
        survivors, dropped = set(lists["survivors"]), set(lists["dropped"])
        both = survivors & dropped
        if both:
            raise SecAggError(f"{what}: refused: {sorted(both)} listed both as survived and dropped "
                              f"(revealing both shares would unmask them)")
        flipped = (survivors & self._revealed_s) | (dropped & self._revealed_b)
        if flipped:
            raise SecAggError(f"{what}: refused: the other share of {sorted(flipped)} was already revealed")
        unknown = (survivors | dropped) - set(self._held)
        if unknown:
            raise SecAggError(f"{what}: {sorted(unknown)} did not share with this client")
        missing = set(self._held) - survivors - dropped
        if missing:
            raise SecAggError(f"{what}: neighbours {sorted(missing)} are neither survived nor dropped")
        n_surv = msg.get("n_survivors")
        if isinstance(n_surv, bool) or not isinstance(n_surv, int) or n_surv < len(survivors) + 1:
            raise SecAggError(f"{what}: n_survivors must be an integer >= {len(survivors) + 1}, got {n_surv!r}")
        if n_surv < p.threshold:
            raise SecAggAbort(f"only {n_surv} clients sent masked inputs, threshold t={p.threshold}", PHASES[4])
        if self.check_models and self.verifier is not None and self.model is not None:
            check_survivors(self.verifier, p.round_id, self.client, self.model, msg.get("model_sigs"), n_surv,
                            survivors, dropped)
        self._revealed_b |= survivors
        self._revealed_s |= dropped
        self._phase = 4
        reply = {"b_shares": {v: self._held[v][0] for v in sorted(survivors)},
                 "s_shares": {v: self._held[v][1] for v in sorted(dropped)}}
        self.timings["unmasking"] = time.perf_counter() - start
        return reply
