"""Secure aggregation, SecAgg+ (Bell et al., CCS 2020): the protocol's shared part.

Round parameters, phases, errors, sizes, the quantiser and the cryptographic
primitives that both ends use. The client is :mod:`fcl_emu.secagg.client`, the server
:mod:`fcl_emu.secagg.server`; the edge node (:mod:`fcl_emu.edge_node.secure_session`) and the coordinator
(:mod:`fcl_emu.coordinator.secure_round`) move their messages over the wire.

Everything is pure, synchronous Python + numpy: one round of the protocol is a
sequence of phases, and in each phase the server produces one
plain dict per client (ints, floats, strings, bytes, numpy arrays: msgpack
material for the wire layer) and each client consumes it and returns its reply
as a plain dict. The wire integration only moves those dicts.

Phases (:data:`PHASES`). Setup opens the round; each later phase is one
exchange: the server's message, the client method that consumes it, the reply.

- ``advertise_keys``: setup message (round parameters, the client's roster index, its neighbours)
  -> :meth:`SecAggClient.on_setup` -> two fresh X25519 public keys (``c`` for shares, ``s`` for masks);
- ``share_keys``: the neighbours' public keys -> :meth:`SecAggClient.on_keys` -> Shamir shares of the
  self-mask seed ``b`` and of ``s_sk``, encrypted for each neighbour (the server relays them unread),
  and a commitment to ``b``;
- ``masked_input``: the shares addressed to the client, plus its vector, weight and generator ->
  :meth:`SecAggClient.on_shares` -> ``y = Q(w, x) + PRG(b) + sum_v +-PRG(k_uv) mod 2^bits``;
- ``unmasking``: which of its neighbours survived / dropped -> :meth:`SecAggClient.on_unmask` -> the
  b-shares of survivors and the s_sk-shares of the dropped (never both for one peer); the server then
  reconstructs the secrets, removes the masks and returns the exact ring sum.

Primitives, all from maintained libraries (nothing hand-rolled):

- X25519 key agreement, HKDF-SHA256, ChaCha20 (the mask PRG: the raw keystream
  read as little-endian uint32) and ChaCha20-Poly1305 (the AEAD for shares):
  ``cryptography``;
- Shamir t-of-k secret sharing over GF(2^128): ``pycryptodome``
  (``Crypto.Protocol.SecretSharing.Shamir``), which shares 16-byte secrets, so a
  32-byte secret is shared as two independent halves. Its share indices start at
  1: the holder ranked ``r`` (0-based, by roster index) in a dealer's list of
  holders gets the share at ``x = r + 1``.

See docs/secagg-protocol.md for the protocol, the parameters, the quantisation sizing and
what is and is not protected.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fcl_emu.secagg.noise import DistributedNoise, centred_sum

PROTOCOL = b"fcl-emu/secagg/v1"
PHASES = ("setup", "advertise_keys", "share_keys", "masked_input", "unmasking")

KEY_BYTES = 32          # X25519 keys, seeds, derived symmetric keys
SECRET_BYTES = 32       # the self-mask seed b and the X25519 secret key s_sk
SHARE_BYTES = 32        # one share of a 32-byte secret: two 16-byte Shamir shares
NONCE_BYTES = 12        # ChaCha20-Poly1305
TAG_BYTES = 16
SHARE_PLAINTEXT_BYTES = 2 * SHARE_BYTES                       # b-share || s_sk-share
CIPHERTEXT_BYTES = NONCE_BYTES + SHARE_PLAINTEXT_BYTES + TAG_BYTES  # 92
COMMIT_BYTES = 32

CHUNK = 1 << 16         # values per chunk of the fused quantise-and-mask loop (256 KiB of uint32: cache-sized)
RING_DTYPE = np.dtype("<u4")   # the ring lives in uint32 (little-endian, as the ChaCha20 keystream is read)
MAX_RING_BITS = 32
MIN_RING_BITS = 8
MIN_THRESHOLD = 2       # t >= 2 shares rebuild a secret, so k >= t neighbours hold them
MAX_ROUND_ID = 2**64 - 1


class SecAggError(ValueError):
    """A malformed message or a protocol violation (bad field, unknown client, failed authentication,
    a request to reveal both shares of one client...). The wire layer treats the sender as faulty."""


class SecAggAbort(RuntimeError):
    """The round cannot complete (fewer than ``t`` participants, an unrecoverable secret...).

    ``reason`` says why in one sentence; ``phase`` names the phase where it was detected.
    The run goes on with the next round.
    """

    def __init__(self, reason: str, phase: str | None = None):
        super().__init__(reason if phase is None else f"{phase}: {reason}")
        self.reason = reason
        self.phase = phase


# --------------------------------------------------------------------------------------------
# Parameters and quantisation
# --------------------------------------------------------------------------------------------

def default_threshold(neighbors: int) -> int:
    """t = floor(k/2) + 1 (a majority of each neighbourhood), at least :data:`MIN_THRESHOLD`."""
    return max(MIN_THRESHOLD, neighbors // 2 + 1)


@dataclass(frozen=True)
class RoundParams:
    """What every participant of one round agrees on (sent in the setup message).

    ``n``: participants sampled into the round (sizes the quantisation); ``dim``:
    length of the float input vector (the masked vector has ``dim + 1`` ring
    elements, the last one the sample weight); ``neighbors``: the degree k of the
    graph; ``threshold``: t, shares needed to reconstruct a secret and the minimum
    number of participants in every phase; ``clip``: inputs are clipped to
    [-clip, clip]; ``max_weight``: sample weights above it are clipped to it; ``noise``: distributed DP, each
    client clips its vector to L2 norm ``clip`` and adds its share of the noise (:mod:`fcl_emu.secagg.noise`; weights
    are then equal: ``max_weight`` is 1). The user-facing settings they are resolved from, with their defaults:
    :class:`fcl_emu.secagg.settings.SecAggSettings`.
    """

    round_id: int
    n: int
    dim: int
    neighbors: int
    threshold: int
    ring_bits: int
    clip: float
    max_weight: int
    noise: DistributedNoise | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> SecAggError:
            return SecAggError(f"secagg parameters: {msg}")

        for name in ("round_id", "n", "dim", "neighbors", "threshold", "ring_bits", "max_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise bad(f"{name} must be an integer, got {v!r}")
        if not 0 <= self.round_id <= MAX_ROUND_ID:
            raise bad(f"round_id must fit in 64 bits, got {self.round_id}")
        if self.n < 3:
            raise bad(f"at least 3 participants are needed, got n={self.n}")
        if self.dim < 1:
            raise bad(f"dim must be >= 1, got {self.dim}")
        if not MIN_THRESHOLD <= self.neighbors <= self.n - 1:
            raise bad(f"neighbors (k) must be in [{MIN_THRESHOLD}, n-1] = [{MIN_THRESHOLD}, {self.n - 1}], "
                      f"got {self.neighbors}")
        if not MIN_THRESHOLD <= self.threshold <= self.neighbors:
            raise bad(f"threshold (t) must be in [{MIN_THRESHOLD}, k] = [{MIN_THRESHOLD}, {self.neighbors}], "
                      f"got {self.threshold}")
        if not MIN_RING_BITS <= self.ring_bits <= MAX_RING_BITS:
            raise bad(f"ring_bits must be in [{MIN_RING_BITS}, {MAX_RING_BITS}], got {self.ring_bits}")
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float, np.floating)) \
                or not math.isfinite(self.clip) or self.clip <= 0:
            raise bad(f"clip must be a finite number > 0, got {self.clip!r}")
        if self.max_weight < 1:
            raise bad(f"max_weight must be >= 1, got {self.max_weight}")
        if self.noise is not None:
            if not isinstance(self.noise, DistributedNoise):
                raise bad(f"noise must be a DistributedNoise, got {self.noise!r}")
            if self.max_weight != 1:
                raise bad(f"with distributed DP every client weighs 1, got max_weight={self.max_weight}")
            if not self.noise.fits(self.ring_bits, self.n, self.dim):
                raise bad(f"a {self.ring_bits}-bit ring cannot hold the clipped sum of {self.n} clients of "
                          f"{self.dim} values plus noise of multiplier {self.noise.multiplier:g} without wrapping "
                          f"around (raise secagg.ring_bits, at most {MAX_RING_BITS}, or lower the noise)")
        if self.levels < 1:
            raise bad(f"a {self.ring_bits}-bit ring cannot hold the sum of {self.n} clients")
        if self.max_weight > self.levels:
            raise bad(f"max_weight={self.max_weight} overflows the weight element: n * max_weight must be "
                      f"<= 2^{self.ring_bits} - 1, so max_weight <= {self.levels} for n={self.n} "
                      f"(lower max_weight or raise ring_bits)")

    @property
    def levels(self) -> int:
        """M = floor((2^bits - 1) / n): every client's ring value lies in [0, M], so n of them sum to at
        most n*M <= 2^bits - 1 and the ring sum never wraps; with distributed DP the smaller M that leaves room
        for the noise (:meth:`fcl_emu.secagg.noise.DistributedNoise.levels`)."""
        if self.noise is not None:
            return self.noise.levels(self.ring_bits, self.n, self.dim)
        return (2**self.ring_bits - 1) // self.n

    @property
    def ring_mask(self) -> int:
        return 2**self.ring_bits - 1

    @property
    def length(self) -> int:
        """Ring elements in a masked vector: the dim values and the weight."""
        return self.dim + 1

    def to_dict(self) -> dict[str, Any]:
        """The setup message's ``params``: on the wire a ``wire.messages.SecAggParams`` (same names, same
        order, so the same bytes; ``noise`` only with distributed DP); :meth:`from_dict` reads it back and
        checks it."""
        out = {"round": int(self.round_id), "n": int(self.n), "dim": int(self.dim),
               "neighbors": int(self.neighbors), "threshold": int(self.threshold),
               "ring_bits": int(self.ring_bits), "clip": float(self.clip), "max_weight": int(self.max_weight)}
        return out if self.noise is None else {**out, "noise": self.noise.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RoundParams:
        try:
            noise = None if d.get("noise") is None else DistributedNoise.from_dict(d["noise"])
        except (KeyError, TypeError, ValueError) as e:
            raise SecAggError(f"secagg parameters: bad noise {d.get('noise')!r}: {e}") from None
        try:
            return cls(round_id=d["round"], n=d["n"], dim=d["dim"], neighbors=d["neighbors"],
                       threshold=d["threshold"], ring_bits=d["ring_bits"], clip=d["clip"],
                       max_weight=d["max_weight"], noise=noise)
        except KeyError as e:
            raise SecAggError(f"secagg parameters: missing field {e.args[0]!r}") from None


class Quantizer:
    """Fixed-point encoding of a weighted float vector into the ring, and decoding of the ring sum.

    A client with vector x (length D) and sample weight w sends D + 1 ring values:

    - ``q_j = SR((min(max(x_j, -c), c) * w/W + c) * M / (2c))`` in [0, M], where ``W = max_weight``,
      ``M = levels`` and SR is stochastic rounding (floor(z + u), u ~ U[0, 1): unbiased);
    - ``q_D = min(w, W)``, the weight itself, exact (weights are integer sample counts).

    Pre-scaling by w/W (in [0, 1]) keeps the weighted value inside [-c, c], so the per-client range M,
    and with it the no-overflow guarantee, does not depend on the weight. The server recovers
    ``sum_i w_i x_i = W * (Q_j * 2c/M - m*c)`` for m summed clients and divides by ``sum_i w_i = Q_D``.
    """

    def __init__(self, params: RoundParams):
        self.params = params
        self.dim = params.dim
        self.clip = float(params.clip)
        self.levels = params.levels
        self.max_weight = params.max_weight
        self.step = 2.0 * self.clip / self.levels  # one level, in units of w/W * x

    def clip_weight(self, weight: Any) -> int:
        if isinstance(weight, bool) or not isinstance(weight, (int, np.integer)) or weight < 0:
            if isinstance(weight, (float, np.floating)) and float(weight).is_integer() and weight >= 0:
                weight = int(weight)
            else:
                raise SecAggError(f"the sample weight must be a non-negative integer, got {weight!r}")
        return min(int(weight), self.max_weight)

    def check_input(self, vector: Any, weight: Any) -> tuple[np.ndarray, int]:
        """The flat input vector (not copied) and the clipped weight, or a clear :class:`SecAggError`."""
        w = self.clip_weight(weight)
        x = np.asarray(vector)
        if x.dtype.kind not in "fiu":
            raise SecAggError(f"input must be a numeric vector, got dtype {x.dtype}")
        x = x.reshape(-1)
        if x.size != self.dim:
            raise SecAggError(f"input has {x.size} values, the round expects dim={self.dim}")
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            raise SecAggError("input has non-finite values (nan or inf)")
        return x, w

    def buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """Scratch for :meth:`encode_into` (one chunk of float64 values and of uniforms)."""
        size = min(CHUNK, self.dim)
        return np.empty(size), np.empty(size)

    def encode_into(self, x: np.ndarray, w: int, rng: np.random.Generator, out: np.ndarray, start: int,
                    stop: int, buffers: tuple[np.ndarray, np.ndarray]) -> None:
        """Ring values ``start:stop`` (at most :data:`CHUNK` of them) of the encoding of (x, w) into ``out``.

        Called on consecutive chunks from 0 to dim + 1, it draws the same uniforms as :meth:`encode`.
        """
        c, m = self.clip, self.levels
        end = min(stop, self.dim)
        if end > start:
            z, u = buffers[0][:end - start], buffers[1][:end - start]
            np.clip(x[start:end], -c, c, out=z)
            z *= (w / self.max_weight) * m / (2.0 * c)  # (x w/W + c) M / 2c, as x * scale + M/2
            z += m / 2.0
            rng.random(out=u)
            z += u
            np.minimum(z, m, out=z)  # float rounding at the top end of the range
            out[:end - start] = z  # truncation: floor, as z >= 0 (a rounding error below 0 gives 0 too)
        if stop == self.dim + 1:
            out[-1] = w

    def encode(self, vector: Any, weight: Any, rng: np.random.Generator) -> np.ndarray:
        """The D + 1 ring values (uint32) of one client; ``rng`` drives the stochastic rounding.

        Works through the vector in chunks of :data:`CHUNK` values (cache-sized scratch, no full-size float
        temporaries)."""
        x, w = self.check_input(vector, weight)
        out = np.empty(self.dim + 1, RING_DTYPE)
        buffers = self.buffers()
        for start in range(0, self.dim + 1, CHUNK):
            stop = min(self.dim + 1, start + CHUNK)
            self.encode_into(x, w, rng, out[start:stop], start, stop, buffers)
        return out

    def decode(self, ring_sum: np.ndarray, count: int) -> tuple[np.ndarray, int]:
        """(sum_i w_i x_i as float64, sum_i w_i) from the ring sum of ``count`` clients."""
        ring_sum = np.asarray(ring_sum)
        if ring_sum.shape != (self.dim + 1,):
            raise SecAggError(f"ring sum has shape {ring_sum.shape}, expected ({self.dim + 1},)")
        if self.params.noise is not None:  # centred: the noise may take the sum below 0 (mod 2^bits)
            q = centred_sum(ring_sum[:self.dim], count, self.levels, self.params.ring_bits)
            q *= self.step
            return q, int(ring_sum[self.dim])
        q = ring_sum[:self.dim].astype(np.float64)
        q *= self.step
        q -= count * self.clip
        q *= self.max_weight
        return q, int(ring_sum[self.dim])

    def mean(self, ring_sum: np.ndarray, count: int) -> np.ndarray:
        """The weighted mean sum_i w_i x_i / sum_i w_i (float64)."""
        s, total = self.decode(ring_sum, count)
        if total <= 0:
            raise SecAggError("the summed sample weight is 0: no client update carries samples")
        return s / total


# --------------------------------------------------------------------------------------------
# Primitives
# --------------------------------------------------------------------------------------------

_ZERO_NONCE = bytes(16)   # ChaCha20 in `cryptography`: 4-byte counter || 12-byte nonce, all zero
_zeros = b""


def zero_bytes(nbytes: int) -> memoryview:
    """A read-only view of ``nbytes`` zero bytes, shared (the plaintext the keystream is XORed onto)."""
    global _zeros
    zeros = _zeros
    if len(zeros) < nbytes:
        zeros = _zeros = bytes(nbytes)  # calloc'd: untouched pages stay unmapped
    return memoryview(zeros)[:nbytes]


def prg_into(key: bytes, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` (a C-contiguous uint32 array) with the ChaCha20 keystream of ``key``.

    The keystream is written straight into the array (``update_into`` over zero bytes); the words are
    read little-endian. Each key is used for one expansion only (keys are derived per round and pair),
    so the fixed zero nonce is safe.
    """
    if out.dtype != RING_DTYPE or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("prg_into needs a writeable C-contiguous little-endian uint32 array")
    prg_stream(key).update_into(zero_bytes(out.nbytes), memoryview(out).cast("B"))
    return out


def prg_stream(key: bytes) -> Any:
    """The ChaCha20 keystream of ``key`` as a stream: successive ``update_into`` calls over zero bytes
    continue it (chunked expansion gives the same values as :func:`prg_into`)."""
    return Cipher(algorithms.ChaCha20(key, _ZERO_NONCE), mode=None).encryptor()


def prg(key: bytes, length: int) -> np.ndarray:
    """``length`` pseudo-random uint32 values from ``key`` (ChaCha20 keystream)."""
    return prg_into(key, np.empty(length, RING_DTYPE))


def _field(v: int | str | bytes) -> bytes:
    """Unambiguous encoding of one context field (length-prefixed)."""
    if isinstance(v, str):
        v = v.encode("utf-8")
    elif isinstance(v, (int, np.integer)):
        v = struct.pack(">Q", int(v))
    return struct.pack(">I", len(v)) + v


def context(label: bytes, *fields: int | str | bytes) -> bytes:
    """HKDF info / AEAD associated data: protocol, label and the fields that bind the key or message."""
    return PROTOCOL + b"/" + label + b"".join(_field(f) for f in fields)


def hkdf(ikm: bytes, info: bytes, length: int = KEY_BYTES) -> bytes:
    """HKDF-SHA256 (RFC 5869), no salt."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(ikm)


def keypair() -> tuple[X25519PrivateKey, bytes]:
    """A fresh X25519 key pair: (private key, 32-byte public key)."""
    sk = X25519PrivateKey.generate()
    return sk, sk.public_key().public_bytes_raw()


def public_key(raw: Any, what: str) -> X25519PublicKey:
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != KEY_BYTES:
        raise SecAggError(f"{what} must be {KEY_BYTES} bytes, got {describe(raw)}")
    return X25519PublicKey.from_public_bytes(bytes(raw))


def agree(sk: X25519PrivateKey, pk: X25519PublicKey, what: str) -> bytes:
    """X25519 shared secret; a low-order public key (all-zero result) is refused."""
    try:
        return sk.exchange(pk)
    except ValueError as e:
        raise SecAggError(f"key agreement with {what} failed: {e}") from None


def pair_mask_key(shared: bytes, round_id: int, index_a: int, index_b: int) -> bytes:
    """Seed of the pairwise mask between two roster indices (symmetric in a, b)."""
    lo, hi = sorted((int(index_a), int(index_b)))
    return hkdf(shared, context(b"pair-mask", round_id, lo, hi))


def self_mask_key(seed: bytes, round_id: int, index: int) -> bytes:
    """Seed of a client's self mask from its secret b."""
    return hkdf(seed, context(b"self-mask", round_id, index))


def share_key(shared: bytes, round_id: int, sender: int, receiver: int) -> bytes:
    """AEAD key for the shares sender -> receiver (one direction; the other direction has its own key)."""
    return hkdf(shared, context(b"share-enc", round_id, sender, receiver))


def share_ad(round_id: int, sender: str, receiver: str) -> bytes:
    """Associated data of an encrypted share: binds the ciphertext to round, sender and receiver."""
    return context(b"share-ad", round_id, sender, receiver)


def seed_commitment(seed: bytes, round_id: int, client: str) -> bytes:
    """SHA-256 commitment to the self-mask seed b (b is 256 random bits: the hash hides it), checked by
    the server after reconstruction so that a corrupted share cannot go unnoticed."""
    return hashlib.sha256(context(b"seed-commit", round_id, client) + seed).digest()


def check_commitment(seed: bytes, round_id: int, client: str, commitment: bytes) -> bool:
    return hmac.compare_digest(seed_commitment(seed, round_id, client), commitment)


def encrypt_share(key: bytes, ad: bytes, plaintext: bytes) -> bytes:
    """ChaCha20-Poly1305 with a random 96-bit nonce, sent in front of the ciphertext."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, ad)


def decrypt_share(key: bytes, ad: bytes, blob: Any, what: str) -> bytes:
    if not isinstance(blob, (bytes, bytearray)) or len(blob) != CIPHERTEXT_BYTES:
        raise SecAggError(f"{what}: an encrypted share is {CIPHERTEXT_BYTES} bytes, got {describe(blob)}")
    blob = bytes(blob)
    try:
        plain = ChaCha20Poly1305(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], ad)
    except InvalidTag:
        raise SecAggError(f"{what}: the encrypted share failed authentication "
                          f"(tampered, or not addressed to this client in this round)") from None
    if len(plain) != SHARE_PLAINTEXT_BYTES:
        raise SecAggError(f"{what}: decrypted share has {len(plain)} bytes, expected {SHARE_PLAINTEXT_BYTES}")
    return plain


def shamir_split(secret: bytes, threshold: int, holders: int) -> list[bytes]:
    """t-of-``holders`` shares of a 32-byte secret; share i (0-based) is the point x = i + 1.

    pycryptodome shares 16-byte secrets in GF(2^128) (indices start at 1), so the secret is split as two
    independent 16-byte halves and a share is the concatenation of the two half-shares.
    """
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"shamir_split shares {SECRET_BYTES}-byte secrets, got {len(secret)}")
    if not 1 <= threshold <= holders:
        raise ValueError(f"threshold {threshold} must be in [1, holders={holders}]")
    lo = Shamir.split(threshold, holders, secret[:16])
    hi = Shamir.split(threshold, holders, secret[16:])
    out = []
    for i, ((xa, a), (xb, b)) in enumerate(zip(lo, hi)):
        assert xa == xb == i + 1  # pycryptodome's indices start at 1
        out.append(a + b)
    return out


def shamir_combine(shares: Sequence[tuple[int, bytes]], threshold: int) -> bytes:
    """The 32-byte secret from at least ``threshold`` (x, share) pairs (x >= 1); uses exactly t of them
    (pycryptodome's combine wants exactly as many shares as the threshold)."""
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares, {threshold} needed")
    chosen = sorted(shares, key=lambda s: s[0])[:threshold]
    for x, s in chosen:
        if not isinstance(s, (bytes, bytearray)) or len(s) != SHARE_BYTES or x < 1:
            raise ValueError("a share is (x >= 1, 32 bytes)")
    lo = Shamir.combine([(x, bytes(s[:16])) for x, s in chosen])
    hi = Shamir.combine([(x, bytes(s[16:])) for x, s in chosen])
    return lo + hi


def harary_neighbors(n: int, k: int, rng: np.random.Generator) -> list[frozenset[int]]:
    """Neighbour sets (0-based positions) of the Harary graph H(k, n) over a random permutation.

    H(k, n) puts the nodes on a ring and joins each to its floor(k/2) nearest on both sides; for odd k it
    adds the diametral chords (n even: i ~ i + n/2, degree exactly k; n odd: i ~ i + (n+1)/2 for
    i <= (n-1)/2, one node gets degree k + 1). It is k-connected: fewer than k removed nodes cannot
    disconnect it. The seeded random permutation makes who-neighbours-whom random. k >= n - 1 gives the
    complete graph (SecAgg).
    """
    if k >= n - 1:
        return [frozenset(j for j in range(n) if j != i) for i in range(n)]
    perm = rng.permutation(n)
    adj: list[set[int]] = [set() for _ in range(n)]

    def join(a: int, b: int) -> None:
        pa, pb = int(perm[a % n]), int(perm[b % n])
        if pa != pb:
            adj[pa].add(pb)
            adj[pb].add(pa)

    for i in range(n):
        for j in range(1, k // 2 + 1):
            join(i, i + j)
    if k % 2:
        if n % 2 == 0:
            for i in range(n // 2):
                join(i, i + n // 2)
        else:
            for i in range((n - 1) // 2 + 1):
                join(i, i + (n + 1) // 2)
    return [frozenset(a) for a in adj]


def describe(v: Any) -> str:
    if isinstance(v, (bytes, bytearray)):
        return f"{len(v)} bytes"
    if isinstance(v, np.ndarray):
        return f"array {v.dtype} {v.shape}"
    return type(v).__name__
