"""One model for every survivor (secagg/consistency.py): a coordinator that sends different clients different models
(Pasquini et al., CCS 2022) gets no share from a client whose model another survivor did not sign; a round of one
model completes with the exact sum; the digest covers every tensor and the request's settings."""

from __future__ import annotations

import numpy as np
import pytest

from fcl_emu.secagg.client import SecAggClient
from fcl_emu.secagg.consistency import INCONSISTENT, model_digest
from fcl_emu.secagg.identity import KeySigner, KeyVerifier
from fcl_emu.secagg.protocol import SecAggAbort
from fcl_emu.secagg.server import SecAggServer
from fcl_emu.secagg.settings import SecAggSettings
from fcl_emu.secagg.simulation import simulate_round
from fcl_emu.wire.auth import ClientKeyring
from tests.test_secagg_signing import DIM, ROSTER, inputs, keyring  # noqa: F401 (keyring: the fixture)

SETTINGS = SecAggSettings(neighbors=4, max_weight=10)
MODEL = {"body.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "head.bias": np.zeros(3, np.float32)}
REQUEST = {"local_epochs": 2, "lr": 0.05, "secure": True}


def clients(keyring: ClientKeyring, check: bool = True) -> dict[str, SecAggClient]:
    verifier = KeyVerifier(keyring.signers)
    return {c: SecAggClient(c, KeySigner(keyring.for_identity(c).signing), verifier, check_models=check)
            for c in ROSTER}


def test_the_digest_covers_each_tensor_and_setting():
    base = model_digest(3, 1, REQUEST, MODEL)
    assert len(base) == 32 and base == model_digest(3, 1, dict(reversed(list(REQUEST.items()))), dict(MODEL))
    zeroed = {k: np.zeros_like(v) for k, v in MODEL.items()}
    reshaped = {**MODEL, "body.weight": MODEL["body.weight"].reshape(4, 3)}
    renamed = {"body.w": MODEL["body.weight"], "head.bias": MODEL["head.bias"]}
    others = [model_digest(4, 1, REQUEST, MODEL), model_digest(3, 2, REQUEST, MODEL),
              model_digest(3, 1, {**REQUEST, "lr": 0.0}, MODEL), model_digest(3, 1, REQUEST, zeroed),
              model_digest(3, 1, REQUEST, reshaped), model_digest(3, 1, REQUEST, renamed)]
    assert len({base, *others}) == len(others) + 1


def test_one_model_completes_with_the_exact_sum(keyring):
    digest = model_digest(1, 0, REQUEST, MODEL)
    plain = simulate_round(ROSTER, DIM, inputs, SETTINGS, round_id=7, seed=2)
    checked = simulate_round(ROSTER, DIM, inputs, SETTINGS, round_id=7, seed=2, clients=clients(keyring),
                             models={c: digest for c in ROSTER})
    assert checked.clients == tuple(ROSTER)
    np.testing.assert_array_equal(checked.ring_sum, plain.ring_sum)


def test_a_client_sent_another_model_aborts_the_round_before_any_share(keyring):
    real, crafted = model_digest(1, 0, REQUEST, MODEL), model_digest(1, 0, REQUEST, {
        k: np.zeros_like(v) for k, v in MODEL.items()})
    models = {c: real if c == ROSTER[0] else crafted for c in ROSTER}
    protocol = clients(keyring)
    with pytest.raises(SecAggAbort, match=INCONSISTENT) as caught:
        simulate_round(ROSTER, DIM, inputs, SETTINGS, round_id=7, seed=2, clients=protocol, models=models)
    assert caught.value.phase == "unmasking"
    first = min(ROSTER[1:])  # the first client asked for its shares refused: nothing revealed
    assert not protocol[first]._revealed_b and not protocol[first]._revealed_s


def test_without_the_check_the_round_completes(keyring):
    real, crafted = model_digest(1, 0, REQUEST, MODEL), bytes(32)
    models = {c: real if c == ROSTER[0] else crafted for c in ROSTER}
    result = simulate_round(ROSTER, DIM, inputs, SETTINGS, round_id=7, seed=2, clients=clients(keyring, False),
                            models=models)
    assert result.clients == tuple(ROSTER)


def test_a_forged_or_missing_signature_is_refused(keyring):
    """A coordinator relaying another survivor's signature in place of one, or leaving one out, gets no share."""
    digest = model_digest(1, 0, REQUEST, MODEL)
    for tamper in (lambda sigs: {**sigs, ROSTER[3]: sigs[ROSTER[4]]}, lambda sigs: {
            c: s for c, s in sigs.items() if c != ROSTER[3]}):
        server = SecAggServer(ROSTER, DIM, SETTINGS, 7, 2)
        close_masked = server.close_masked

        def tampered(close_masked=close_masked, tamper=tamper):
            return {c: {**m, "model_sigs": tamper(m["model_sigs"])} for c, m in close_masked().items()}

        server.close_masked = tampered
        with pytest.raises(SecAggAbort, match=INCONSISTENT):
            simulate_round(ROSTER, DIM, inputs, server=server, clients=clients(keyring),
                           models={c: digest for c in ROSTER})
