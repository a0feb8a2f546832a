"""Framing: round trips, zero-copy decoding, and every rejection reason."""

import math
from typing import Literal

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from fcl_emu.wire.framing import ALLOWED_DTYPES, Limits, WireError, decode, encode, square_sum, wire_tensors
from tests.conftest import raw_header
from fcl_emu.wire.messages import BODY_SCHEMAS, Heartbeat, Join, TensorSpec, Update
from fcl_emu.wire.auth import Allowlist, ClientKeyring, KeyFileError, load_server_keys, write_keys
from fcl_emu.wire.sockets import (HELD, HELD_BYTES, HELD_SETS, ClientEndpoint, Counters, HeldSets, ServerEndpoint,
                                  SharedConnection)

UPDATE = Update(num_samples=5, train_time_s=0.5, loss=1.25)


def reason(frames, limits=Limits()) -> str:
    with pytest.raises(WireError) as info:
        decode(frames, limits)
    return info.value.reason


def test_round_trip_keeps_values_dtypes_and_shapes():
    tensors = {"delta/w": np.arange(12, dtype=np.float32).reshape(3, 4), "delta/n": np.array(7, np.int64),
               "mask": np.array([True, False]), "empty": np.zeros((0, 3), np.float16)}
    msg = decode(encode("update", UPDATE, sender="client-0001", seq=9, round=3, task=1, tensors=tensors))
    assert (msg.type, msg.sender, msg.seq, msg.round, msg.task) == ("update", "client-0001", 9, 3, 1)
    assert msg.body == UPDATE
    for name, value in tensors.items():
        assert msg.tensors[name].dtype == value.dtype and msg.tensors[name].shape == value.shape
        np.testing.assert_array_equal(msg.tensors[name], value)


def test_decoding_does_not_copy_tensor_frames():
    array = np.arange(1000, dtype=np.float32)
    frames = encode("update", UPDATE, sender="c", seq=1, tensors={"delta/w": array})
    assert frames[1] is array or np.shares_memory(frames[1], array)  # sent without a copy
    received = [frames[0], bytearray(frames[1].tobytes())]
    decoded = decode(received).tensors["delta/w"]
    received[1][0:4] = np.float32(42).tobytes()
    assert decoded[0] == 42  # a view of the frame buffer, not a copy
    assert not decoded.flags.writeable


def test_non_contiguous_and_big_endian_inputs_are_sent_correctly():
    a = np.arange(20, dtype=">f4").reshape(4, 5).T
    msg = decode(encode("update", UPDATE, sender="c", seq=1, tensors={"delta/w": a}))
    np.testing.assert_array_equal(msg.tensors["delta/w"], a)


def test_encode_refuses_disallowed_dtype_and_wrong_body():
    with pytest.raises(ValueError, match="not allowed"):
        encode("update", UPDATE, sender="c", seq=1, tensors={"x": np.array(["a"], dtype=object)})
    with pytest.raises(TypeError, match="Update"):
        encode("update", Heartbeat(), sender="c", seq=1)


@pytest.mark.parametrize("frames,expected", [
    ([], "frame_count"),
    ([b"\x00not msgpack"], "bad_header"),
    ([b"\x81\xa2\xad\xff\x01"], "bad_header"),  # a key that is not UTF-8
    ([msgspec.msgpack.encode({"v": 1})], "bad_header"),
    ([raw_header(v=99)], "bad_version"),
    ([raw_header(type="launch_missiles")], "unknown_type"),
    ([raw_header(type="join", body=msgspec.Raw(msgspec.msgpack.encode({"node": "n"})))], "bad_body"),
    ([raw_header(body=msgspec.Raw(msgspec.msgpack.encode({"extra": 1})))], "bad_body"),
    ([raw_header(type="join", body=msgspec.Raw(msgspec.msgpack.encode(
        {"node": 1, "pid": 2, "client_index": 3})))], "bad_body"),
    *[([raw_header(type="update", body=msgspec.Raw(msgspec.msgpack.encode(  # the emulated clock's input
        {"num_samples": 1, "train_time_s": 0.1, "loss": 0.1, "cpu_s": cpu_s})))], "bad_body")
      for cpu_s in (-1.0, float("nan"), float("inf"))],
    ([raw_header(tensors=[TensorSpec("x", "object", [1], 8)]), b"12345678"], "bad_dtype"),
    ([raw_header(tensors=[TensorSpec("x", "float32", [-1], 4)]), b"1234"], "bad_shape"),
    ([raw_header(tensors=[TensorSpec("x", "float32", [2], 8)]), b"1234"], "size_mismatch"),
    ([raw_header(tensors=[TensorSpec("x", "float32", [2], 4)]), b"12345678"], "size_mismatch"),
    ([raw_header(tensors=[TensorSpec("x", "float32", [1], 4)])], "frame_count"),
    ([raw_header(), b"stray"], "frame_count"),
    ([raw_header(tensors=[TensorSpec("x", "uint8", [1], 1)] * 2), b"a", b"b"], "bad_shape"),
    ([raw_header(body=msgspec.Raw(b"\x91" * 1000 + b"\xc0"))], "bad_header"),  # nesting bomb in the body
    ([b"\x91" * 100_000 + b"\xc0"], "bad_header"),  # ... and as the whole header
])
def test_malformed_messages_are_rejected_with_a_reason(frames, expected):
    assert reason(frames) == expected


def test_limits_on_count_size_and_header():
    frames = encode("update", UPDATE, sender="c", seq=1, tensors={f"t{i}": np.zeros(4, np.uint8) for i in range(5)})
    assert reason(frames, Limits(max_tensors=4)) == "too_many_tensors"
    assert reason(frames, Limits(max_total_bytes=19)) == "too_large"
    assert reason(frames, Limits(max_header_bytes=16)) == "too_large"
    assert decode(frames, Limits(max_tensors=5, max_total_bytes=20)).type == "update"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_updates_are_rejected(bad):
    w = np.zeros(100_000, np.float32)
    w[77_777] = bad
    frames = encode("update", UPDATE, sender="c", seq=1, tensors={"delta/w": w})
    assert reason(frames) == "non_finite"
    assert decode(frames, Limits(check_finite=False)).type == "update"


@pytest.mark.filterwarnings("error")  # an overflow or a NaN is an answer, not a warning in the run's log
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_square_sum_is_the_finite_check_and_the_squared_norm(dtype):
    a = np.zeros(3 * 1024 + 5, dtype)  # whole rows and a tail
    assert square_sum(a) == 0.0 and square_sum(a[:0]) == 0.0
    a[[0, 2000, 3 * 1024 + 4]] = [3, 4, 12]
    assert square_sum(a) == pytest.approx(169.0, rel=1e-7)  # 9 + 16 + 144, by hand
    for at in (7, 3 * 1024 + 1):  # in a row, in the tail
        for bad in (np.nan, np.inf, -np.inf):
            b = a.copy()
            b[at] = bad
            assert square_sum(b) is None
    if dtype is not np.float16:  # finite values whose squares overflow the array's own precision
        big = np.finfo(dtype).max / 2
        c = np.zeros(2048, dtype)
        c[[5, 1500]] = [big, 1.0]
        if dtype is np.float64:
            assert square_sum(c) == math.inf  # finite values, an infinite norm: what a norm bound refuses
        else:
            assert square_sum(c) == pytest.approx(float(big) ** 2 + 1.0, rel=1e-12)
    rng = np.random.default_rng(0)
    r = rng.standard_normal(285_000).astype(dtype)
    assert square_sum(r) == pytest.approx(float(np.sum(r.astype(np.float64) ** 2)), rel=1e-6)


def test_a_decoded_update_carries_the_square_sums_of_its_float_tensors():
    w = np.array([[3.0, 4.0]], np.float32)
    msg = decode(encode("update", UPDATE, sender="c", seq=1, tensors={"delta/w": w, "delta/n": np.array(7)}))
    assert msg.square_sums == {"delta/w": 25.0}  # integers are not checked


def test_every_message_type_has_a_schema_and_round_trips():
    for name, schema in BODY_SCHEMAS.items():
        body = schema(**{f.name: _example(f.type) for f in msgspec.structs.fields(schema)})
        assert decode(encode(name, body, sender="s", seq=1)).body == body


def _example(annotation):
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation(**{f.name: _example(f.type) for f in msgspec.structs.fields(annotation)})
    origin = getattr(annotation, "__origin__", None)
    if origin is Literal:
        return annotation.__args__[-1]
    if origin is dict:
        return {}
    if origin is list:
        return [1, 2] if annotation.__args__[0] is int else ["a", "b"]
    if origin is not None or type(annotation).__name__ == "UnionType":  # a union: its first member
        return _example(annotation.__args__[0])
    return {int: 3, float: 0.5, str: "x", bytes: b"k" * 32, bool: True}[annotation]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_random_frames_never_crash_the_decoder(frames):
    try:
        decode(frames)
    except WireError as exc:
        assert exc.reason


def _valid_messages() -> list[list[bytes]]:
    """Valid frames of the types a peer sends, with tensors, maps and strings to mutate."""
    tensors = {"delta/w": np.arange(6, dtype=np.float32).reshape(2, 3), "delta/n": np.array(3, np.int64)}
    bodies = [("join", Join(node="node-0", pid=12, client_index=3), None),
              ("update", Update(num_samples=5, train_time_s=0.5, loss=1.25, metrics={"ce": 0.5}), tensors),
              ("error", msgspec.convert({"code": "train_failed", "detail": "boom"}, BODY_SCHEMAS["error"]), None),
              ("secagg_shares", msgspec.convert({"shares": {"client-0001": b"x" * 40}, "b_commit": b"c" * 32},
                                                BODY_SCHEMAS["secagg_shares"]), None),
              ("prototype_gradients", msgspec.convert({"items": 1}, BODY_SCHEMAS["prototype_gradients"]),
               {"0/w": np.ones(4, np.float32)})]
    return [[bytes(f) for f in encode(t, b, sender="client-0003", seq=1, tensors=x)] for t, b, x in bodies]


VALID = _valid_messages()


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(st.sampled_from(range(len(VALID))), st.data())
def test_mutated_valid_frames_never_crash_the_decoder(which, data):
    """Fuzzing: valid messages with bytes flipped, inserted or cut, frames dropped or duplicated. The decoder
    returns a message or raises WireError, never anything else (bounded: 3,000 cases, a few seconds)."""
    frames = [bytearray(f) for f in VALID[which]]
    for _ in range(data.draw(st.integers(1, 4))):
        frame = frames[data.draw(st.integers(0, len(frames) - 1))]
        op = data.draw(st.sampled_from(["flip", "insert", "cut", "drop", "duplicate"]))
        if op == "flip" and frame:
            at = data.draw(st.integers(0, len(frame) - 1))
            frame[at] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            at = data.draw(st.integers(0, len(frame)))
            frame[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "cut" and frame:
            at = data.draw(st.integers(0, len(frame) - 1))
            del frame[at:at + data.draw(st.integers(1, 16))]
        elif op == "drop" and len(frames) > 1:
            frames.remove(frame)
        elif op == "duplicate":
            frames.append(bytearray(frame))
    try:
        decode([bytes(f) for f in frames])
    except WireError as exc:
        assert exc.reason


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(ALLOWED_DTYPES)), st.lists(st.integers(0, 5), max_size=3), st.integers(-3, 3))
def test_table_and_frame_must_agree(dtype, shape, skew):
    itemsize = ALLOWED_DTYPES[dtype].itemsize
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    frame = bytes(max(0, nbytes + skew))
    skew = len(frame) - nbytes
    frames = [raw_header(type="update", body=msgspec.Raw(msgspec.msgpack.encode(UPDATE)),
                           tensors=[TensorSpec("x", dtype, shape, nbytes)]), frame]
    if skew == 0:
        assert decode(frames, Limits(check_finite=False)).tensors["x"].shape == tuple(shape)
    else:
        assert reason(frames) == "size_mismatch"


def test_endpoints_count_bytes_and_route_by_the_latest_connection():
    ctx = zmq.Context()
    counts = Counters.empty()
    server = ServerEndpoint(ctx, "tcp://127.0.0.1:0", count=counts)
    client = ClientEndpoint(ctx, server.address, "client-0007")
    again = ClientEndpoint(ctx, server.address, "client-0007")  # a restarted client: a new connection
    try:
        sent = client.send("join", Join(node="n", pid=1, client_index=7))
        peer, msg = server.recv()
        assert peer == "client-0007" and msg.nbytes == sent and not server.switched  # its first connection
        assert counts.nested() == {"join": {"received": sent}}
        server.send("client-0007", "heartbeat", Heartbeat())
        assert client.recv().type == "heartbeat"
        again.send("heartbeat", Heartbeat())
        assert server.recv()[0] == "client-0007" and server.switched
        server.send("client-0007", "heartbeat", Heartbeat())  # goes to the connection heard from last
        assert again.recv().type == "heartbeat" and not client.sock.poll(200)
        again.send("heartbeat", Heartbeat())
        assert server.recv()[0] == "client-0007" and not server.switched  # the same connection again
        with pytest.raises(zmq.ZMQError):
            server.send("nobody", "heartbeat", Heartbeat())  # never heard from: fails loudly
    finally:
        for c in (client, again):
            c.close(0)
        server.close()
        ctx.term()


def test_a_shared_connection_carries_many_clients_as_their_own_connections_would():
    """Two clients on one shared connection: each message routed to the client it is for, the same bytes counted
    as on connections of their own; an envelope naming another identity than the header is refused; a client's
    close notice makes sends to it fail until it speaks again, which counts as a new connection (a restart)."""
    ctx = zmq.Context()
    counts, own_counts = Counters.empty(), Counters.empty()
    server = ServerEndpoint(ctx, "tcp://127.0.0.1:0", count=counts)
    shared = SharedConnection(ctx, server.address)
    a, b = shared.channel("client-0001"), shared.channel("client-0002")
    own = ClientEndpoint(ctx, server.address, "client-0003", count=own_counts)
    try:
        joins = [c.send("join", Join(node="n", pid=1, client_index=i)) for i, c in enumerate((a, b, own), 1)]
        assert len(set(joins)) == 1  # the envelope is transport: not counted
        assert sorted(server.recv()[0] for _ in range(3)) == ["client-0001", "client-0002", "client-0003"]
        assert not server.switched
        for peer in ("client-0002", "client-0001", "client-0003"):
            server.send(peer, "heartbeat", Heartbeat())
        assert [shared.recv()[0] for _ in range(2)] == ["client-0002", "client-0001"]
        assert own.recv().type == "heartbeat" and not shared.sock.poll(100)
        shared.sock.send_multipart([b"client-0002", *encode("heartbeat", Heartbeat(), sender="client-0001", seq=5)])
        with pytest.raises(WireError) as info:
            server.recv()
        assert (info.value.reason, info.value.peer) == ("not_authorized", "client-0002")
        a.close()  # its session ends (a crash): the server takes the notice and returns nothing
        assert server.sock.poll(2000) and server.recv() is None
        with pytest.raises(zmq.ZMQError):
            server.send("client-0001", "heartbeat", Heartbeat())
        server.send("client-0002", "heartbeat", Heartbeat())  # the other client's session is untouched
        assert shared.recv()[0] == "client-0002"
        again = shared.channel("client-0001")  # restarted: a new session, sequence numbers from 1
        again.send("join", Join(node="n", pid=1, client_index=1))
        peer, msg = server.recv()
        assert (peer, msg.seq) == ("client-0001", 1) and server.switched
        server.send("client-0001", "heartbeat", Heartbeat())
        assert shared.recv()[0] == "client-0001"
    finally:
        own.close(0)
        shared.close(0)
        server.close()
        ctx.term()


def test_a_shared_connection_takes_tensors_made_for_many_once_and_each_client_reads_them_whole():
    """A round's model (WireTensors) to two clients on one shared connection crosses it once, as a set the
    connection holds; each client's message names it and decodes to the same values, with the same bytes counted
    as for a client on a connection of its own, which gets the tensors in every message. Both ends keep the latest
    HELD_SETS sets; a message naming a set the connection does not hold is refused."""
    ctx = zmq.Context()
    counts, node_counts = Counters.empty(), Counters.empty()
    server = ServerEndpoint(ctx, "tcp://127.0.0.1:0", count=counts)
    shared = SharedConnection(ctx, server.address, count=node_counts)
    a, b = shared.channel("client-0001"), shared.channel("client-0002")
    own = ClientEndpoint(ctx, server.address, "client-0003")
    model = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array(3, np.int64)}
    tensors = wire_tensors(model)
    request = Heartbeat()
    try:
        for i, c in enumerate((a, b, own), 1):
            c.send("join", Join(node="n", pid=1, client_index=i))
        for _ in range(3):
            server.recv()
        sent = [server.send(peer, "heartbeat", request, tensors=tensors)
                for peer in ("client-0001", "client-0002", "client-0003")]
        assert len(set(sent)) == 1 and counts.bytes[("heartbeat", "sent")] == 3 * sent[0]
        assert shared.recv() is None  # the set, once
        received = [shared.recv() for _ in range(2)]
        assert [peer for peer, _ in received] == ["client-0001", "client-0002"] and not shared.sock.poll(100)
        for msg in (*(m for _, m in received), own.recv()):
            assert msg.nbytes == sent[0]
            for name, value in model.items():
                np.testing.assert_array_equal(msg.tensors[name], value)
        assert node_counts.bytes[("heartbeat", "received")] == 2 * sent[0]
        later = [wire_tensors(model) for _ in range(HELD_SETS)]  # the least recently used is dropped at both ends
        for t in later:
            server.send("client-0001", "heartbeat", request, tensors=t)
        assert [shared.recv() is None for _ in range(2 * HELD_SETS)] == [True, False] * HELD_SETS
        server.send("client-0002", "heartbeat", request, tensors=tensors)  # sent again, then named
        assert shared.recv() is None and shared.recv()[0] == "client-0002"
        # a key the connection never held (the server end itself never names one it did not send)
        header = encode("heartbeat", request, sender="coordinator", seq=1, tensors=wire_tensors(model))[0]
        server.sock.send_multipart([server._routes["client-0001"], b"client-0001" + HELD + (999).to_bytes(8, "big"),
                                    header])
        with pytest.raises(WireError) as info:
            shared.recv()
        assert (info.value.reason, info.value.peer) == ("bad_header", "client-0001")
        assert "does not hold" in str(info.value)
    finally:
        for c in (own, shared):
            c.close(0)
        server.close()
        ctx.term()


def test_held_sets_drop_the_least_recently_used_beyond_their_count_and_bytes():
    held = HeldSets()
    for i in range(HELD_SETS):
        held.keep(bytes([i]), 10, i)
    assert held.use(bytes([0])) == 0  # used: now the most recent
    held.keep(b"new", 10, "new")
    assert len(held) == HELD_SETS and held.use(bytes([1])) is None and held.use(bytes([0])) == 0
    held.keep(b"big", HELD_BYTES, "big")  # beyond the bytes: only the set kept last stays
    assert len(held) == 1 and held.use(b"big") == "big"
    held.keep(b"small", 1, "small")
    assert len(held) == 1 and held.use(b"big") is None
    held.keep(b"small", 2, "again")  # kept again: replaced, its bytes counted once
    held.keep(b"other", HELD_BYTES - 2, "other")
    assert len(held) == 2 and held.use(b"small") == "again"


@pytest.fixture
def small_server():
    """A server endpoint with small limits (4 tensors, 64 KiB) and a client of it."""
    ctx = zmq.Context()
    server = ServerEndpoint(ctx, "tcp://127.0.0.1:0", limits=Limits(max_tensors=4, max_total_bytes=1 << 16,
                                                                    max_header_bytes=1 << 16))
    client = ClientEndpoint(ctx, server.address, "client-0001")
    yield server, client
    client.close(0)
    server.close()
    ctx.term()


def test_a_message_of_too_many_frames_is_refused_without_holding_its_frames(small_server):
    """200,000 empty frames: refused after the fifth, the rest dropped one by one as they are read (what the
    receiver allocates stays small); the next message flows."""
    import tracemalloc

    server, client = small_server
    client.sock.send_multipart([encode("heartbeat", Heartbeat(), sender="client-0001", seq=1)[0]] + [b""] * 200_000)
    client.send("heartbeat", Heartbeat())
    assert server.sock.poll(10_000)
    tracemalloc.start()
    try:
        with pytest.raises(WireError) as info:
            server.recv()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # all 200,001 frames kept as zmq.Frame objects: over 20 MB
    assert info.value.reason == "frame_count" and "199995 more dropped" in info.value.detail
    assert (info.value.msg_type, info.value.round) == ("heartbeat", 0)  # what it claimed: a refused update
    # fails its client's round at once
    assert server.recv()[1].type == "heartbeat"


def test_a_message_of_too_many_bytes_is_refused_at_the_socket(small_server):
    """Frames each within the limit but more in all than a message may hold: refused before decoding."""
    server, client = small_server
    chunk = np.zeros(1 << 15, np.uint8)
    tensors = {f"t{i}": chunk for i in range(3)}  # 96 KiB: each frame fits, the message does not
    client.sock.send_multipart(encode("update", UPDATE, sender="client-0001", seq=1, round=3, tensors=tensors))
    client.send("heartbeat", Heartbeat())
    with pytest.raises(WireError) as info:
        server.recv()
    assert info.value.reason == "too_large" and "frames dropped unread" in info.value.detail
    assert (info.value.msg_type, info.value.round) == ("update", 3)
    assert server.recv()[1].type == "heartbeat"


def test_an_oversized_frame_is_refused_by_libzmq_before_it_is_received(small_server):
    """A frame over the limit never reaches the receiver (libzmq drops the connection while reading it); the
    client reconnects and its next message flows."""
    server, client = small_server
    client.sock.send_multipart(encode("update", UPDATE, sender="client-0001", seq=1,
                                      tensors={"big": np.zeros(1 << 17, np.uint8)}))
    assert not server.sock.poll(1000)
    client.send("heartbeat", Heartbeat())
    assert server.sock.poll(10_000)
    assert server.recv()[1].type == "heartbeat"


@pytest.fixture
def curve_pair(tmp_path):
    """A CurveZMQ server whose roster has node-a (client-0001, client-0002) and node-b (client-0003)."""
    ctx = zmq.Context()
    keys = write_keys(tmp_path, {"node-a": ["client-0001", "client-0002"], "node-b": ["client-0003"]})
    server_keys = load_server_keys(keys)
    allowlist = Allowlist(ctx, server_keys)
    server = ServerEndpoint(ctx, "tcp://127.0.0.1:0", keys=server_keys)
    ring = {name: ClientKeyring(keys / "coordinator.key", keys / f"{name}.key_secret") for name in ("node-a", "node-b")}
    yield ctx, server, ring, allowlist
    server.close()
    allowlist.stop()
    ctx.term()


def test_curve_binds_each_identity_to_its_key(curve_pair):
    ctx, server, ring, _ = curve_pair
    honest = ClientEndpoint(ctx, server.address, "client-0001", keys=ring["node-a"].for_identity("client-0001"))
    other = ClientEndpoint(ctx, server.address, "client-0003", keys=ring["node-b"].for_identity("client-0003"))
    try:
        honest.send("join", Join(node="node-a", pid=1, client_index=1))
        assert server.recv()[0] == "client-0001"
        # node-b's key speaking for node-a's client: refused, and its route stays with the honest connection
        other.sock.send_multipart(encode("leave", msgspec.convert({"reason": "x"}, BODY_SCHEMAS["leave"]),
                                         sender="client-0001", seq=1))
        with pytest.raises(WireError) as info:
            server.recv()
        assert info.value.reason == "not_authorized" and info.value.peer == "node-b"
        server.send("client-0001", "heartbeat", Heartbeat())
        assert honest.recv().type == "heartbeat" and not other.sock.poll(200)
        other.send("heartbeat", Heartbeat())  # its own client is fine
        assert server.recv()[0] == "client-0003"
    finally:
        honest.close(0)
        other.close(0)


def test_curve_admits_no_stranger(curve_pair, tmp_path):
    """A peer with a key not in the roster (or no key at all) never completes the handshake: nothing it sends
    arrives, nothing can be sent to it. A refused key is counted and reported with the peer's address."""
    ctx, server, ring, allowlist = curve_pair
    refusals = []
    allowlist.on_refused = lambda address, reason: refusals.append((address, reason))
    stranger_keys = write_keys(tmp_path / "other", {"node-x": ["client-0001"]})
    stranger = ClientEndpoint(ctx, server.address, "client-0001",
                              keys=ClientKeyring(tmp_path / "coordinator.key",
                                                 stranger_keys / "node-x.key_secret").for_identity("client-0001"))
    plain = ctx.socket(zmq.DEALER)
    plain.connect(server.address)
    try:
        stranger.send("join", Join(node="x", pid=1, client_index=1))
        plain.send_multipart(encode("join", Join(node="x", pid=1, client_index=1), sender="client-0001", seq=1))
        assert not server.sock.poll(1000)
        assert allowlist.refused["unknown_key"] >= 1  # the stranger's key, counted and passed on with its address
        assert refusals[0] == ("127.0.0.1", "unknown_key") and len(refusals) == allowlist.refused["unknown_key"]
        with pytest.raises(zmq.ZMQError):
            server.send("client-0001", "heartbeat", Heartbeat())
    finally:
        stranger.close(0)
        plain.close(0)


def test_key_files_are_checked(tmp_path):
    with pytest.raises(KeyFileError, match="does not exist"):
        load_server_keys(tmp_path / "none")
    keys = write_keys(tmp_path / "k", {"node-a": ["client-0001"]})
    with pytest.raises(KeyFileError, match="no secret key"):
        ClientKeyring(keys / "coordinator.key", keys / "coordinator.key")
    with pytest.raises(KeyFileError, match="cannot read"):
        ClientKeyring(keys / "coordinator.key", keys / "missing.key_secret")
    assert oct((keys / "node-a.key_secret").stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("curve", [False, True])
def test_bench_wire_connects_clients_plain_and_encrypted(tmp_path, curve):
    from fcl_emu.bench.wire import connect_clients

    assert connect_clients(20, curve, tmp_path) > 0
