"""Signed SecAgg+ public keys: a relay cannot swap a client's advertised keys (docs/secagg.md, "Signed keys").

The server forwards each client's two public keys to its neighbours. A server that swapped them for its own
would sit in the middle of the share encryption and could read t shares of a client's secrets. So each client
signs what it advertises, ``(round, client id, c_pk, s_pk)``, with a long-term Ed25519 key (``cryptography``)
bound to its transport identity: the key directory that grants the client's CurveZMQ key also holds the
signing key beside it, and lists every signing public key with the identities it speaks for, for every host
(:mod:`fcl_emu.wire.auth`). A receiver checks each neighbour's signature against that list before using its keys; a
neighbour whose signature is missing or wrong is refused, and the server drops it from the round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fcl_emu.secagg.protocol import context

SIGNATURE_BYTES = 64


def keys_statement(round_id: int, client: str, c_pk: bytes, s_pk: bytes) -> bytes:
    """What a client signs: its id and its two public keys of this round, length-prefixed."""
    return context(b"advertised keys", round_id, client, bytes(c_pk), bytes(s_pk))


def model_statement(round_id: int, client: str, digest: bytes) -> bytes:
    """What a client signs with its masked input: the digest of the model it trained in this round
    (:mod:`fcl_emu.secagg.consistency`)."""
    return context(b"trained model", round_id, client, bytes(digest))


class KeySigner:
    """Signs the keys a client advertises, with the Ed25519 key of its grant (32 raw private bytes)."""

    def __init__(self, private_key: bytes):
        self._key = Ed25519PrivateKey.from_private_bytes(bytes(private_key))

    def sign(self, round_id: int, client: str, c_pk: bytes, s_pk: bytes) -> bytes:
        return self._key.sign(keys_statement(round_id, client, c_pk, s_pk))

    def sign_model(self, round_id: int, client: str, digest: bytes) -> bytes:
        return self._key.sign(model_statement(round_id, client, digest))


class KeyVerifier:
    """Checks a neighbour's advertised keys against the signing public key its identity is listed with
    (``signers``: client id -> 32 raw public bytes)."""

    def __init__(self, signers: Mapping[str, bytes]):
        self._keys = {client: Ed25519PublicKey.from_public_bytes(bytes(raw)) for client, raw in signers.items()}

    def verify(self, round_id: int, client: str, c_pk: bytes, s_pk: bytes, signature: Any) -> bool:
        """Whether ``signature`` is ``client``'s listed key's signature of these keys (False if unlisted)."""
        return self._verify(client, keys_statement(round_id, client, c_pk, s_pk), signature)

    def verify_model(self, round_id: int, client: str, digest: bytes, signature: Any) -> bool:
        """Whether ``signature`` is ``client``'s listed key's signature of having trained the model of ``digest``
        in this round (False if unlisted)."""
        return self._verify(client, model_statement(round_id, client, digest), signature)

    def _verify(self, client: str, statement: bytes, signature: Any) -> bool:
        key = self._keys.get(client)
        if key is None or not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
            return False
        try:
            key.verify(bytes(signature), statement)
        except InvalidSignature:
            return False
        return True
