"""SecAgg+ protocol core: quantisation, primitives, exact aggregation under dropouts, aborts, and what the
server and clients refuse. Pure in-process: no sockets (the whole file runs in well under a minute)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fcl_emu.secagg.client import SecAggClient
from fcl_emu.secagg.protocol import (CIPHERTEXT_BYTES, PHASES, RING_DTYPE, Quantizer, RoundParams, SecAggAbort,
                                     SecAggError, harary_neighbors, prg, shamir_combine, shamir_split)
from fcl_emu.secagg.server import SecAggResult, SecAggServer
from fcl_emu.secagg.settings import SecAggSettings, log_neighbors
from fcl_emu.secagg.simulation import PhaseStats, measure_masking, simulate_round, wire_size


def params(**kw) -> RoundParams:
    base = dict(round_id=1, n=4, dim=4, neighbors=3, threshold=2, ring_bits=8, clip=1.0, max_weight=1)
    base.update(kw)
    return RoundParams(**base)


class FixedU:
    """A stand-in generator whose uniform draws are given (hand-checked stochastic rounding)."""

    def __init__(self, u):
        self.u = list(u)

    def random(self, out):
        out[...] = [self.u.pop(0) for _ in range(out.size)]
        return out


# --- quantisation ------------------------------------------------------------------------------

def test_quantize_round_trip_hand_checked():
    p = params()  # 8-bit ring, n = 4: M = floor(255 / 4) = 63 levels per client
    q = Quantizer(p)
    assert q.levels == 63
    # z = (x + 1) * 63 / 2 = [0, 63, 31.5, 47.25, (clipped 1.0) 63]; q = floor(z + u)
    y = q.encode([-1.0, 1.0, 0.0, 0.5], 1, FixedU([0.9, 0.9, 0.4, 0.8]))
    assert y.dtype == RING_DTYPE and y.tolist() == [0, 63, 31, 48, 1]
    y2 = q.encode([-3.0, 7.0, 0.0, 0.5], 1, FixedU([0.0, 0.0, 0.6, 0.7]))  # clipped to [-1, 1]
    assert y2.tolist() == [0, 63, 32, 47, 1]
    s, w = q.decode(y + y2, count=2)
    assert w == 2
    np.testing.assert_allclose(s, np.array([0, 126, 63, 95]) * 2 / 63 - 2, rtol=0, atol=1e-12)
    np.testing.assert_allclose(q.mean(y + y2, 2), [-1.0, 1.0, 0.0, 95 / 63 - 1], atol=1e-12)


def test_quantize_weight_goes_under_the_ring_and_prescales():
    p = params(ring_bits=16, n=4, max_weight=100)  # M = 16383
    q = Quantizer(p)
    rng = np.random.default_rng(0)
    x1, x2 = np.array([0.5, -0.25, 1.0, 0.0]), np.array([-0.5, 0.75, -1.0, 0.1])
    y = q.encode(x1, 30, rng) + q.encode(x2, 10, rng)
    s, w = q.decode(y, 2)
    assert w == 40
    ref = (30 * x1 + 10 * x2) / 40
    assert np.abs(q.mean(y, 2) - ref).max() <= 2 * q.step * 100 / 40
    assert q.encode(x1, 1000, rng)[-1] == 100  # weights above max_weight are clipped
    with pytest.raises(SecAggError, match="non-negative integer"):
        q.encode(x1, 2.5, rng)
    with pytest.raises(SecAggError, match="non-negative integer"):
        q.encode(x1, -1, rng)
    with pytest.raises(SecAggError, match="non-finite"):
        q.encode([0, np.nan, 0, 0], 1, rng)
    with pytest.raises(SecAggError, match="dim=4"):
        q.encode([0, 0, 0], 1, rng)


def test_quantize_sum_of_n_clients_at_the_extremes_cannot_overflow():
    for bits, n in ((8, 4), (16, 7), (32, 300)):
        p = params(ring_bits=bits, n=n, neighbors=2, max_weight=(2**bits - 1) // n)
        q = Quantizer(p)
        rng = np.random.default_rng(1)
        top = [q.encode([9.0, -9.0, 1.0, -1.0], p.max_weight, rng).astype(np.uint64) for _ in range(n)]
        total = np.sum(top, axis=0)
        assert total.max() <= 2**bits - 1  # no wrap even with every client at the top of its range
        assert total.tolist()[:2] == [n * p.levels, 0]
        s, w = q.decode(total.astype(RING_DTYPE), n)
        assert w == n * p.max_weight
        np.testing.assert_allclose(q.mean(total.astype(RING_DTYPE), n), [1, -1, 1, -1], atol=1e-9)


def test_stochastic_rounding_is_unbiased():
    p = params(ring_bits=8, n=4)
    q = Quantizer(p)
    rng = np.random.default_rng(2)
    x = np.array([0.01, -0.33, 0.777, 0.5])
    mean = np.mean([q.decode(q.encode(x, 1, rng), 1)[0] for _ in range(4000)], axis=0)
    assert np.abs(mean - x).max() < 0.2 * q.step  # one level is 2/63; the mean of 4000 draws is within ~0.01 level


def test_round_params_are_validated():
    with pytest.raises(SecAggError, match="max_weight"):
        params(ring_bits=8, n=4, max_weight=64)  # 4 * 64 > 255
    with pytest.raises(SecAggError, match="threshold"):
        params(threshold=4)
    with pytest.raises(SecAggError, match="threshold"):
        params(threshold=1)
    with pytest.raises(SecAggError, match="neighbors"):
        params(neighbors=4)
    with pytest.raises(SecAggError, match="ring_bits"):
        params(ring_bits=40)
    with pytest.raises(SecAggError, match="clip"):
        params(clip=float("inf"))
    assert RoundParams.from_dict(params().to_dict()) == params()
    with pytest.raises(SecAggError, match="missing field"):
        RoundParams.from_dict({"round": 1})
    assert log_neighbors(100) == 14 and log_neighbors(5) == 4 and log_neighbors(3) == 2
    with pytest.raises(SecAggAbort, match="at least 3"):
        SecAggServer(["a", "b"], dim=3)
    with pytest.raises(SecAggAbort, match="threshold t=5 exceeds the degree k=3"):
        SecAggServer(["a", "b", "c", "d"], dim=3, settings=SecAggSettings(threshold=5))


# --- primitives --------------------------------------------------------------------------------

@pytest.mark.parametrize("t,k", [(2, 3), (3, 5), (4, 7), (5, 5)])
def test_shamir_reconstructs_from_any_t_of_k(t, k):
    secret = os.urandom(32)
    shares = shamir_split(secret, t, k)
    assert len(shares) == k and all(len(s) == 32 for s in shares)
    points = [(i + 1, s) for i, s in enumerate(shares)]  # indices start at 1
    for subset in itertools.combinations(points, t):
        assert shamir_combine(list(subset), t) == secret
    assert shamir_combine(points, t) == secret  # more than t: exactly t are used
    assert shamir_combine(points[:t - 1], t - 1) != secret  # t - 1 shares say nothing useful
    with pytest.raises(ValueError, match="needed"):
        shamir_combine(points[:t - 1], t)


def test_prg_is_the_chacha20_keystream_as_little_endian_uint32():
    key = os.urandom(32)
    y = prg(key, 1001)
    ks = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(4004))
    assert y.dtype == RING_DTYPE and np.array_equal(y, np.frombuffer(ks, "<u4"))
    assert np.array_equal(prg(key, 10), y[:10]) and not np.array_equal(prg(os.urandom(32), 1001), y)


@pytest.mark.parametrize("n,k", [(10, 4), (10, 3), (9, 3), (9, 4), (7, 6), (15, 5), (3, 2)])
def test_harary_graph_is_symmetric_regular_and_seeded(n, k):
    g = harary_neighbors(n, k, np.random.default_rng(5))
    assert all(i not in g[i] for i in range(n))
    assert all(i in g[j] for i in range(n) for j in g[i])
    degrees = sorted(len(s) for s in g)
    assert degrees == ([k] * n if (n * k) % 2 == 0 else [k] * (n - 1) + [k + 1])
    assert g == harary_neighbors(n, k, np.random.default_rng(5))
    seen, todo = {0}, [0]  # connected
    while todo:
        for j in g[todo.pop()] - seen:
            seen.add(j)
            todo.append(j)
    assert len(seen) == n


# --- full rounds -------------------------------------------------------------------------------

def make_inputs(roster, dim, seed, scale=1.5, max_weight=100):
    rng = np.random.default_rng(seed)
    vectors = {c: rng.standard_normal(dim) * scale for c in roster}  # some values beyond the clip range
    weights = {c: int(rng.integers(0, 2 * max_weight)) for c in roster}  # some above max_weight

    def inputs(c):
        return vectors[c], weights[c], np.random.default_rng([seed, roster.index(c)])

    def quantized(c, p):
        return Quantizer(p).encode(vectors[c], weights[c], np.random.default_rng([seed, roster.index(c)]))

    return vectors, weights, inputs, quantized


def t_core(nodes, graph, t):
    nodes = set(nodes)
    while True:
        bad = {c for c in nodes if len(graph[c] & nodes) < t}
        if not bad:
            return nodes
        nodes -= bad


def expected_outcome(roster, graph, t, dropout):
    """An independent model of who ends up in the sum: the clients left after each phase, the t-core
    pruning, and every recoverability condition. Returns (clients in the sum, None) or (None, abort phase)."""
    gone = lambda p: {c for c in roster if dropout.get(c, 99) <= p}  # noqa: E731
    u1 = t_core(set(roster) - gone(1), graph, t)
    if len(u1) < t:
        return None, "advertise_keys"
    u2 = t_core(u1 - gone(2), graph, t)
    if len(u2) < t:
        return None, "share_keys"
    u3 = u2 - gone(3)
    if len(u3) < t or any(len(graph[c] & u3) < t for c in u2):
        return None, "masked_input"
    u4 = u3 - gone(4)
    if len(u4) < t or any(len(graph[c] & u4) < t for c in u2):
        return None, "unmasking"
    return u3, None


def arrays_in(obj, seen=None):
    """Every numpy array reachable from an object's attributes (dicts, sequences, sets, dataclasses)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from arrays_in(k, seen)
            yield from arrays_in(v, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from arrays_in(v, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from arrays_in(getattr(obj, f.name), seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from arrays_in(vars(obj), seen)


def assert_holds_no_individual_input(obj, individual):
    for a in arrays_in(obj):
        for q in individual:
            assert not (a.shape == q.shape and np.array_equal(a, q)), "the server holds an unmasked input"
    if isinstance(obj, SecAggServer):
        assert not set(obj._b_shares) & set(obj._s_shares), "both secrets of one client were collected"


def run_and_check(n, k, t, dim, bits, dropout, seed, max_weight=100):
    roster = [f"client-{i:03d}" for i in range(n)]
    settings = SecAggSettings(neighbors=k, threshold=t, ring_bits=bits, clip=1.0, max_weight=max_weight)
    server = SecAggServer(roster, dim, settings, round_id=seed, seed=seed)
    vectors, weights, inputs, quantized = make_inputs(roster, dim, seed, max_weight=max_weight)
    want, abort_phase = expected_outcome(roster, server.graph, server.params.threshold, dropout)
    if abort_phase is not None:
        with pytest.raises(SecAggAbort) as info:
            simulate_round(roster, dim, inputs, dropout=dropout, server=server)
        assert info.value.phase == abort_phase and "threshold" in info.value.reason
        return None
    result = simulate_round(roster, dim, inputs, dropout=dropout, server=server)
    p = server.params
    assert set(result.clients) == want
    assert set(result.dropped) == set(roster) - want
    expected = np.zeros(dim + 1, np.uint64)
    for c in result.clients:
        expected += quantized(c, p)
    assert expected.max() <= 2**bits - 1  # the plaintext sum fits the ring
    assert result.ring_sum.dtype == RING_DTYPE and np.array_equal(result.ring_sum, expected.astype(RING_DTYPE))
    # the decoded mean is the clipped weighted mean up to one level per client
    s, w = result.decode()
    ws = {c: min(weights[c], max_weight) for c in result.clients}
    assert w == sum(ws.values())
    ref = sum(np.clip(vectors[c], -1, 1) * ws[c] for c in result.clients)
    assert np.abs(s - ref).max() <= len(result.clients) * Quantizer(p).step * max_weight + 1e-9
    if len(result.clients) >= 2:
        assert_holds_no_individual_input(server, [quantized(c, p) for c in roster])
    return result


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_unmasked_aggregate_equals_plaintext_quantized_aggregate(data):
    n = data.draw(st.integers(3, 15), label="n")
    k = data.draw(st.one_of(st.just(n - 1), st.integers(2, n - 1)), label="k")
    t = data.draw(st.one_of(st.just(2), st.integers(2, k)), label="t")
    dim = data.draw(st.integers(1, 40), label="dim")
    bits = data.draw(st.sampled_from([16, 24, 32]), label="bits")
    # who goes silent, and from which phase on (1 keys, 2 shares, 3 masked input, 4 unmasking)
    dropout = data.draw(st.dictionaries(st.integers(0, n - 1).map(lambda i: f"client-{i:03d}"),
                                        st.integers(1, 4), max_size=n // 2), label="dropout")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    result = run_and_check(n, k, t, dim, bits, dropout, seed, max_weight=min(100, (2**bits - 1) // n))
    event("aborted" if result is None else "summed")
    if result is not None:
        for phase in sorted(set(dropout.values())):
            event(f"summed with a dropout in phase {phase}")
        if k == n - 1:
            event("summed, SecAgg (k = n - 1)")


@pytest.mark.parametrize("chunk", [16, 48, None])
def test_chunked_quantise_and_mask_matches_the_one_shot_unmasking(monkeypatch, chunk):
    """Clients expand their masks chunk by chunk, the server in one go: the keystreams must line up."""
    import fcl_emu.secagg.protocol as secagg

    if chunk is not None:
        monkeypatch.setattr(secagg, "CHUNK", chunk)
    dim = 100 if chunk is not None else 2 * secagg.CHUNK + 3
    run_and_check(5, 4, 2, dim, 32, {"client-001": 3, "client-003": 4}, seed=11)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(dim)
    q = Quantizer(params(n=5, dim=dim, ring_bits=32, max_weight=7))
    monkeypatch.setattr(secagg, "CHUNK", 1 << 30)
    whole = q.encode(x, 3, np.random.default_rng(1))
    monkeypatch.setattr(secagg, "CHUNK", 7)
    assert np.array_equal(q.encode(x, 3, np.random.default_rng(1)), whole)


@pytest.mark.parametrize("k", [None, 3])
def test_secagg_complete_graph_with_a_dropout_in_every_phase(k):
    n = 9
    dropout = {"client-001": 1, "client-002": 2, "client-004": 3, "client-006": 4}
    result = run_and_check(n, n - 1 if k is None else k, 2, 12, 32, dropout, seed=3)
    if k is None:  # SecAgg: everyone who sent a masked input is in the sum, the silent unmasker included
        assert result.clients == ("client-000", "client-003", "client-005", "client-006", "client-007",
                                  "client-008")
        assert result.dropped == {"client-001": "no reply in advertise_keys", "client-002": "no reply in share_keys",
                                  "client-004": "no masked input in masked_input"}
        assert result.silent == ("client-006",)


def test_server_never_holds_an_individual_unmasked_input():
    """After every reply it takes and every phase it closes, no array the server can reach equals a client's
    quantised input (it holds masked inputs only inside one running sum), and it never collects both secrets
    of one client."""
    roster = [f"client-{i:03d}" for i in range(7)]
    _, _, inputs, quantized = make_inputs(roster, 9, seed=4)
    server = SecAggServer(roster, 9, SecAggSettings(neighbors=4, threshold=2), round_id=4, seed=4)
    individual = [quantized(c, server.params) for c in roster]
    checks = 0
    for name in ("receive_keys", "close_keys", "receive_shares", "close_shares", "receive_masked", "close_masked",
                 "receive_unmask", "close_unmask"):
        def checked(*args, _real=getattr(server, name)):
            nonlocal checks
            out = _real(*args)
            assert_holds_no_individual_input(server, individual)
            checks += 1
            return out
        setattr(server, name, checked)
    result = simulate_round(roster, 9, inputs, dropout={"client-002": 3, "client-005": 4}, server=server)
    assert len(result.clients) == 6 and checks == (7 + 1) + (7 + 1) + (6 + 1) + (5 + 1)
    assert_holds_no_individual_input(result, individual)


@pytest.mark.parametrize("phase", [1, 2, 3, 4])
def test_fewer_than_t_survivors_aborts_with_a_clear_reason(phase):
    roster = [f"c{i}" for i in range(6)]
    _, _, inputs, _ = make_inputs(roster, 5, 0)
    dropout = {c: phase for c in roster[:3]}  # 3 left, t = 4
    server = SecAggServer(roster, 5, SecAggSettings(threshold=4), round_id=1)
    with pytest.raises(SecAggAbort) as info:
        simulate_round(roster, 5, inputs, dropout=dropout, server=server)
    assert info.value.phase == PHASES[phase]
    assert "only 3" in info.value.reason and "threshold t=4" in info.value.reason
    with pytest.raises(SecAggError, match="aborted"):
        server.close_unmask()


def test_phase_stats_and_wire_sizes():
    roster = [f"c{i}" for i in range(6)]
    _, _, inputs, _ = make_inputs(roster, 50, 0)
    stats = PhaseStats()
    result = simulate_round(roster, 50, inputs, SecAggSettings(neighbors=4), dropout={"c0": 3}, stats=stats)
    assert isinstance(result, SecAggResult) and len(result.clients) == 5
    assert stats.bytes_up["masked_input"] == 5 * (4 * 51 + wire_size({"y": None}))
    assert stats.bytes_up["share_keys"] > 6 * 4 * CIPHERTEXT_BYTES
    assert [len(stats.client_s[p]) for p in PHASES[1:]] == [6, 6, 5, 5]
    assert set(stats.server_s) == set(PHASES[1:])


# --- what the server and the clients refuse ----------------------------------------------------

def first_phases(n=5, k=4, dim=6, seed=0):
    """A server and its clients after the share exchange; returns (server, clients, masked-input messages)."""
    roster = [f"c{i}" for i in range(n)]
    server = SecAggServer(roster, dim, SecAggSettings(neighbors=k, threshold=2), round_id=9, seed=seed)
    clients = {c: SecAggClient(c) for c in roster}
    for c, m in server.setup().items():
        server.receive_keys(c, clients[c].on_setup(m))
    for c, m in server.close_keys().items():
        server.receive_shares(c, clients[c].on_keys(m))
    return server, clients, server.close_shares()


def test_client_refuses_to_reveal_both_shares_of_one_peer():
    server, clients, msgs = first_phases()
    rng = np.random.default_rng(0)
    for c, m in msgs.items():
        server.receive_masked(c, clients[c].on_shares(m, rng.standard_normal(6), 1, rng))
    unmask = server.close_masked()
    cl = clients["c0"]
    peers = unmask["c0"]["survivors"]
    with pytest.raises(SecAggError, match="both as survived and dropped"):
        cl.on_unmask({"survivors": peers, "dropped": [peers[0]], "n_survivors": 5})
    first = cl.on_unmask(unmask["c0"])
    assert set(first["b_shares"]) == set(peers) and not first["s_shares"]
    assert cl.on_unmask(unmask["c0"]) == first  # a repeated request gets the same answer
    with pytest.raises(SecAggError, match="already revealed"):
        cl.on_unmask({"survivors": peers[1:], "dropped": [peers[0]], "n_survivors": 4})
    with pytest.raises(SecAggError, match="neither survived nor dropped"):
        cl.on_unmask({"survivors": peers[1:], "dropped": [], "n_survivors": 4})
    everyone = unmask["c1"]["survivors"]
    with pytest.raises(SecAggAbort, match="threshold t=2"):
        clients["c1"].on_unmask({"survivors": [], "dropped": everyone, "n_survivors": 1})


def test_tampered_or_misdirected_shares_fail_authentication():
    server, clients, msgs = first_phases()
    m = msgs["c0"]["shares"]
    sender = next(iter(m))
    bad = bytearray(m[sender])
    bad[20] ^= 1
    for shares, match in (({**m, sender: bytes(bad)}, "failed authentication"),
                          ({**m, sender: msgs["c1"]["shares"]["c2"]}, "failed authentication"),  # not for c0
                          ({**m, sender: m[sender][:-1]}, f"{CIPHERTEXT_BYTES} bytes"),
                          ({**m, "stranger": m[sender]}, "not a neighbour")):
        cl = _copy_client(clients["c0"])  # keep the real client's state intact
        with pytest.raises(SecAggError, match=match):
            cl.on_shares({"shares": shares}, np.zeros(6), 1, np.random.default_rng(0))
    # the untouched message still works
    clients["c0"].on_shares(msgs["c0"], np.zeros(6), 1, np.random.default_rng(0))


def _copy_client(cl):
    new = SecAggClient(cl.client)
    new.__dict__.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(cl).items()})
    return new


def test_server_rejects_malformed_replies():
    roster = [f"c{i}" for i in range(5)]
    server = SecAggServer(roster, 6, SecAggSettings(neighbors=4, threshold=2, ring_bits=24), round_id=2)
    clients = {c: SecAggClient(c) for c in roster}
    setup = server.setup()
    keys = {c: clients[c].on_setup(m) for c, m in setup.items()}
    with pytest.raises(SecAggError, match="unknown client 'mallory'"):
        server.receive_keys("mallory", keys["c0"])
    with pytest.raises(SecAggError, match="32 bytes"):
        server.receive_keys("c0", {"c_pk": b"short", "s_pk": keys["c0"]["s_pk"]})
    with pytest.raises(SecAggError, match="while the round is in phase"):
        server.receive_shares("c0", {})
    server.receive_keys("c0", keys["c0"])
    with pytest.raises(SecAggError, match="duplicate"):
        server.receive_keys("c0", keys["c0"])
    with pytest.raises(SecAggError, match="repeats a key"):
        server.receive_keys("c1", {"c_pk": keys["c1"]["c_pk"], "s_pk": keys["c0"]["s_pk"]})
    for c, r in keys.items():
        if c != "c0":
            server.receive_keys(c, r)
    fresh = SecAggServer(roster, 6, round_id=2)
    fresh.setup()
    with pytest.raises(SecAggError, match="repeats a key"):
        fresh.receive_keys("c1", {"c_pk": keys["c0"]["c_pk"], "s_pk": keys["c0"]["c_pk"]})
    key_msgs = server.close_keys()
    with pytest.raises(SecAggError, match="not a neighbour"):
        keys_c0 = key_msgs["c0"]["keys"]
        _copy_client(clients["c0"]).on_keys({"keys": {**keys_c0, "mallory": keys_c0["c1"]}})
    with pytest.raises(SecAggError, match="repeats another key"):
        _copy_client(clients["c0"]).on_keys({"keys": {**key_msgs["c0"]["keys"], "c1": key_msgs["c0"]["keys"]["c2"]}})
    shares = {c: clients[c].on_keys(m) for c, m in key_msgs.items()}
    with pytest.raises(SecAggError, match="unexpected recipients"):
        server.receive_shares("c0", {**shares["c0"],
                                     "shares": {**shares["c0"]["shares"], "c9": b"x" * CIPHERTEXT_BYTES}})
    with pytest.raises(SecAggError, match="must be 92 bytes"):
        server.receive_shares("c0", {**shares["c0"], "shares": {**shares["c0"]["shares"], "c1": b"x"}})
    with pytest.raises(SecAggError, match="b_commit"):
        server.receive_shares("c0", {"shares": shares["c0"]["shares"]})
    for c, r in shares.items():
        server.receive_shares(c, r)
    masked_msgs = server.close_shares()
    rng = np.random.default_rng(0)
    ys = {c: clients[c].on_shares(m, rng.standard_normal(6), 3, rng) for c, m in masked_msgs.items()}
    assert all(int(y["y"].max()) < 2**24 for y in ys.values())
    with pytest.raises(SecAggError, match=r"shape \(7,\)"):
        server.receive_masked("c0", {"y": ys["c0"]["y"][:-1]})
    with pytest.raises(SecAggError, match="uint32"):
        server.receive_masked("c0", {"y": ys["c0"]["y"].astype(np.int64)})
    with pytest.raises(SecAggError, match="outside the 24-bit ring"):
        server.receive_masked("c0", {"y": ys["c0"]["y"] | np.uint32(1 << 30)})
    with pytest.raises(SecAggError, match="uint32"):
        server.receive_masked("c0", {"y": ys["c0"]["y"].tolist()})
    for c, r in ys.items():
        server.receive_masked(c, r)
    unmask = server.close_masked()
    answers = {c: clients[c].on_unmask(m) for c, m in unmask.items()}
    extra = dict(answers["c0"]["b_shares"])
    extra.pop(next(iter(extra)))
    with pytest.raises(SecAggError, match="asked for"):
        server.receive_unmask("c0", {**answers["c0"], "b_shares": extra})
    with pytest.raises(SecAggError, match="asked for"):
        server.receive_unmask("c0", {**answers["c0"], "s_shares": {"c1": b"y" * 32}})
    for c, r in answers.items():
        server.receive_unmask(c, r)
    result = server.close_unmask()
    assert len(result.clients) == 5 and result.decode()[1] == 15
    with pytest.raises(SecAggError, match="cannot close"):
        server.close_unmask()


def test_client_rejects_messages_out_of_order_and_malformed_setup():
    server, clients, msgs = first_phases()
    with pytest.raises(SecAggError, match="expected 'shares'"):
        clients["c0"].on_keys({"keys": {}})
    cl = SecAggClient("c0")
    good = SecAggServer([f"c{i}" for i in range(5)], 6, round_id=1).setup()["c0"]
    with pytest.raises(SecAggError, match="neighbour"):
        cl.on_setup({**good, "neighbors": {**good["neighbors"], "c0": 1}})
    with pytest.raises(SecAggError, match="index"):
        cl.on_setup({**good, "index": 0})
    with pytest.raises(SecAggError, match="missing field"):
        cl.on_setup({**good, "params": {}})


@pytest.mark.parametrize("secret", ["b", "s"])
def test_a_corrupted_share_is_detected_not_silently_summed(secret):
    roster = [f"c{i}" for i in range(6)]
    _, _, inputs, _ = make_inputs(roster, 4, 0)
    server = SecAggServer(roster, 4, SecAggSettings(threshold=2), round_id=1)
    real = server.receive_unmask

    def corrupt(client, reply):
        name = "b_shares" if secret == "b" else "s_shares"
        reply = {**reply, name: {v: bytes(32) for v in reply[name]}}
        real(client, reply)

    server.receive_unmask = corrupt
    with pytest.raises(SecAggAbort, match="commitment" if secret == "b" else "public key"):
        simulate_round(roster, 4, inputs, dropout={} if secret == "b" else {"c5": 3}, server=server)


def test_measure_masking_reports_the_lower_bound_and_the_client_time():
    out = measure_masking(dim=2000, neighbors=4, clients=8, repeats=2)
    assert out["neighbors"] == 4 and out["clients"] == 8
    for key in ("lower_bound_s", "client_masked_input_s", "client_mask_s", "client_quantize_s"):
        assert out[key] > 0
    assert out["ratio_mask"] == out["client_mask_s"] / out["lower_bound_s"]


def test_bench_secagg_command(tmp_path):
    from typer.testing import CliRunner

    from fcl_emu.cli import app

    out = tmp_path / "sa.json"
    result = CliRunner().invoke(app, ["bench", "secagg", "--clients", "8", "--dim", "1000", "--dropout", "0.2",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [r["phase"] for r in data["rows"]] == ["advertise_keys", "share_keys", "masked_input", "unmasking"]
    assert data["status"] == "ok" or data["status"].startswith("aborted:")
    assert data["rows"][2]["bytes_up"] > 1000 * 4 * data["rows"][2]["clients"] - 1
    assert data["ratio_mask_to_lower_bound"] > 0
    bad = CliRunner().invoke(app, ["bench", "secagg", "--dropout", "1.5"])
    assert bad.exit_code == 2 and "dropout" in bad.output
