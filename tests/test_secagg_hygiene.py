"""SecAgg+ mask hygiene (secagg/protocol.py, secagg/client.py), over many rounds: every mask is a ChaCha20 keystream
keyed by HKDF-SHA256 of a full-entropy secret (a fresh X25519 agreement per round and pair, or a 32-byte self-mask
seed drawn from the operating system per round), and no key serves twice: not across the pairs of a round, not
across rounds, not when a round id comes again (a resumed run's round). A pairwise key is expanded by its two ends
only, the one adding and the one subtracting it. (A 32-bit seed into a Mersenne Twister, as Flower's masks had,
flwrlabs/flower#7522, fails every assertion here.)"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from fcl_emu.secagg import client as client_module
from fcl_emu.secagg.protocol import KEY_BYTES, SECRET_BYTES, prg
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.secagg.simulation import simulate_round
from tests.test_secagg import make_inputs

ROSTER = [f"client-{i:03d}" for i in range(8)]
ROUND_IDS = [*range(30), 0, 0]  # 30 rounds, then round 0 twice more


def test_every_mask_key_is_fresh_over_many_rounds_and_from_full_entropy_secrets(monkeypatch):
    keys_by_round: list[Counter] = []
    drawn: list[bytes] = []  # what the operating system gave the clients
    publics: list[bytes] = []
    expand, urandom, keypair = client_module.prg_stream, os.urandom, client_module.keypair

    def recorded_stream(key: bytes):
        keys_by_round[-1][key] += 1
        return expand(key)

    def recorded_urandom(n: int) -> bytes:
        drawn.append(urandom(n))
        return drawn[-1]

    def recorded_keypair():
        sk, pk = keypair()
        publics.append(pk)
        return sk, pk

    monkeypatch.setattr(client_module, "prg_stream", recorded_stream)
    monkeypatch.setattr(client_module.os, "urandom", recorded_urandom)
    monkeypatch.setattr(client_module, "keypair", recorded_keypair)
    settings = SecAggSettings(neighbors=4, threshold=3, ring_bits=16, clip=1.0, max_weight=10)
    for round_id in ROUND_IDS:
        keys_by_round.append(Counter())
        *_, inputs, _ = make_inputs(ROSTER, 16, round_id, max_weight=10)
        clients = {c: client_module.SecAggClient(c) for c in ROSTER}
        result = simulate_round(ROSTER, 16, inputs, settings=settings, round_id=round_id, clients=clients)
        assert sorted(result.clients) == ROSTER
        seeds = [cl._b for cl in clients.values()]  # each client's self-mask seed: drawn from the OS, 256 bits
        assert all(len(b) == SECRET_BYTES and b in drawn for b in seeds) and len(set(seeds)) == len(ROSTER)

    for counts in keys_by_round:
        assert all(len(key) == KEY_BYTES for key in counts)
        assert sorted(counts.values()).count(1) == len(ROSTER)  # each client's self mask, expanded once
        assert set(counts.values()) == {1, 2}  # a pairwise key by its two ends, no key a third time
    every = [key for counts in keys_by_round for key in counts]
    assert len(every) == len(set(every))  # no key in two rounds, the repeated round ids included
    assert len(publics) == len(set(publics)) == 2 * len(ROSTER) * len(ROUND_IDS)  # fresh X25519 keys per round
    starts = {bytes(prg(key, 4)) for key in every}  # the keystreams themselves: no two begin alike
    assert len(starts) == len(every)


def test_a_mask_stream_looks_uniform_over_the_ring():
    """The words of one keystream: their mean, and each of the 32 bits set about half the time (1,000,000 words:
    a bit's share within 0.005 of a half is a 10-sigma bound)."""
    words = prg(os.urandom(KEY_BYTES), 1_000_000).astype(np.uint64)
    assert abs(words.mean() / 2 ** 32 - 0.5) < 0.005
    bits = (words[:, None] >> np.arange(32, dtype=np.uint64)) & 1
    assert np.all(np.abs(bits.mean(axis=0) - 0.5) < 0.005)
