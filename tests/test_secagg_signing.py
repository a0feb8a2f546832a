"""Signed SecAgg+ public keys (secagg/identity.py): the key directory's signing keys and signers' list, an honest
signed round recovering the sum of an unsigned one, and a relay that swaps a public key in transit: the receiver
refuses it and the server drops the neighbour, as a dropout, and still recovers the others' exact sum."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from fcl_emu.secagg.client import SecAggClient
from fcl_emu.secagg.identity import KeySigner, KeyVerifier
from fcl_emu.secagg.protocol import keypair
from fcl_emu.secagg.server import SecAggServer
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.secagg.simulation import simulate_round
from fcl_emu.wire.auth import SIGNERS_FILE, ClientKeyring, write_keys
from fcl_emu.wire.framing import decode, encode
from fcl_emu.wire.messages import SecAggKeys, SecAggPeerKeys, SecAggPublicKeys, SecAggShares, plain_body

ROSTER = [f"client-{i:04d}" for i in range(8)]
DIM = 40
SETTINGS = SecAggSettings(neighbors=6, max_weight=10)
INPUTS = {c: np.random.default_rng(i).normal(0, 0.1, DIM) for i, c in enumerate(ROSTER)}


def inputs(client: str):
    return INPUTS[client], 10, np.random.default_rng(0)


@pytest.fixture(scope="module")
def keyring(tmp_path_factory) -> ClientKeyring:
    """Per-device keys of the roster: one grant, one signing key per client."""
    directory = tmp_path_factory.mktemp("keys") / "k"
    write_keys(directory, {c: [c] for c in ROSTER})
    return ClientKeyring(directory / "coordinator.key", directory)


def signed_clients(keyring: ClientKeyring) -> dict[str, SecAggClient]:
    verifier = KeyVerifier(keyring.signers)
    return {c: SecAggClient(c, KeySigner(keyring.for_identity(c).signing), verifier) for c in ROSTER}


def test_the_key_directory_binds_a_signing_key_to_each_grant(tmp_path, keyring):
    assert set(keyring.signers) == set(ROSTER)
    for c in ROSTER:
        signing = keyring.for_identity(c).signing
        assert len(signing) == 32
        statement = KeySigner(signing).sign(1, c, b"a" * 32, b"b" * 32)
        assert KeyVerifier(keyring.signers).verify(1, c, b"a" * 32, b"b" * 32, statement)
        other = ROSTER[(ROSTER.index(c) + 1) % len(ROSTER)]
        assert not KeyVerifier(keyring.signers).verify(1, other, b"a" * 32, b"b" * 32, statement)  # not its key
    node_dir = tmp_path / "nodes"
    write_keys(node_dir, {"node-0": ROSTER[:4], "node-1": ROSTER[4:]})
    ring = ClientKeyring(node_dir / "coordinator.key", node_dir / "node-1.key_secret")
    assert ring.signers[ROSTER[0]] == ring.signers[ROSTER[3]] != ring.signers[ROSTER[4]]  # one key per grant
    assert (node_dir / SIGNERS_FILE).stat().st_mode & 0o777 == 0o600


def test_a_signed_round_recovers_the_sum_of_an_unsigned_one(keyring):
    plain = simulate_round(ROSTER, DIM, inputs, SETTINGS, round_id=5, seed=1)
    signed = simulate_round(ROSTER, DIM, inputs, SETTINGS, round_id=5, seed=1, clients=signed_clients(keyring))
    assert signed.clients == tuple(ROSTER) and not signed.dropped
    np.testing.assert_array_equal(signed.ring_sum, plain.ring_sum)


def _swapping(server: SecAggServer, victim: str, field: str) -> list[str]:
    """Make ``server`` swap ``victim``'s ``field`` public key for a key of its own on the way to one neighbour
    (the first that receives it); returns [that neighbour]."""
    close_keys, receivers = server.close_keys, []

    def tampered():
        out = close_keys()
        receiver = next(c for c in sorted(out) if victim in out[c]["keys"])
        out[receiver]["keys"][victim] = {**out[receiver]["keys"][victim], field: keypair()[1]}
        receivers.append(receiver)
        return out

    server.close_keys = tampered
    return receivers


@pytest.mark.parametrize("field", ["c_pk", "s_pk"])
def test_a_key_swapped_in_transit_is_refused_and_its_owner_dropped(keyring, field):
    victim = ROSTER[2]
    server = SecAggServer(ROSTER, DIM, SETTINGS, round_id=5, seed=1)
    receivers = _swapping(server, victim, field)
    clients = signed_clients(keyring)
    result = simulate_round(ROSTER, DIM, inputs, SETTINGS, round_id=5, seed=1, server=server, clients=clients)
    assert clients[receivers[0]].refused == [victim]
    assert server.refused_keys == {victim: receivers}
    assert result.clients == tuple(c for c in ROSTER if c != victim)
    assert "failed the signature check" in result.dropped[victim]
    expected = sum(INPUTS[c] for c in result.clients) / len(result.clients)
    assert np.abs(result.mean() - expected).max() < 1e-6  # the others' exact sum, up to the quantisation


def test_without_a_verifier_the_swap_goes_unnoticed_and_unsigned_keys_are_refused(keyring):
    server = SecAggServer(ROSTER, DIM, SETTINGS, round_id=5, seed=1)
    _swapping(server, ROSTER[2], "s_pk")
    unchecked = simulate_round(ROSTER, DIM, inputs, SETTINGS, round_id=5, seed=1, server=server)
    expected = sum(INPUTS[c] for c in ROSTER) / len(ROSTER)
    assert np.abs(unchecked.mean() - expected).max() > 1e-2  # the swapped mask key went into the sum unnoticed
    clients = signed_clients(keyring)
    clients[ROSTER[3]] = SecAggClient(ROSTER[3])  # this one signs nothing: its neighbours refuse it
    result = simulate_round(ROSTER, DIM, inputs, SETTINGS, round_id=5, seed=1, clients=clients)
    assert ROSTER[3] not in result.clients and len(result.clients) == len(ROSTER) - 1


def test_signatures_and_refusals_are_typed_on_the_wire_and_absent_when_unused(keyring):
    client = signed_clients(keyring)[ROSTER[0]]
    server = SecAggServer(ROSTER, DIM, SETTINGS, round_id=5, seed=1)
    reply = client.on_setup(server.setup()[ROSTER[0]])
    body = decode(encode("secagg_keys", SecAggKeys(**reply), sender=ROSTER[0], seq=1, round=1)).body
    assert plain_body(body)["sig"] == reply["sig"] and len(reply["sig"]) == 64
    relayed = SecAggPeerKeys(keys={"x": SecAggPublicKeys(**reply)})
    assert decode(encode("secagg_peer_keys", relayed, sender="coordinator", seq=1, round=1)).body == relayed
    shares = SecAggShares(shares={}, b_commit=b"c" * 32, refused=["client-0002"])
    assert decode(encode("secagg_shares", shares, sender=ROSTER[0], seq=1, round=1)).body.refused == ["client-0002"]
    unsigned = {"c_pk": reply["c_pk"], "s_pk": reply["s_pk"]}  # the bytes an unsigned client sent before
    assert msgspec.msgpack.encode(SecAggKeys(**unsigned)) == msgspec.msgpack.encode(unsigned)
    assert msgspec.msgpack.encode(SecAggShares(shares={}, b_commit=b"c")) == \
        msgspec.msgpack.encode({"shares": {}, "b_commit": b"c"})


def test_a_key_directory_without_signers_leaves_keys_unchecked(tmp_path, keyring):
    directory = tmp_path / "k"
    write_keys(directory, {"node-0": ROSTER})
    (directory / SIGNERS_FILE).unlink()
    ring = ClientKeyring(directory / "coordinator.key", Path(directory / "node-0.key_secret"))
    assert ring.signers is None and ring.for_identity(ROSTER[0]).signing is not None
