"""Framing: round trips, zero-copy decoding, and every rejection reason."""

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.framing import ALLOWED_DTYPES, Limits, WireError, all_finite, decode, encode
from tests.conftest import raw_header
from wire.messages import BODY_SCHEMAS, Heartbeat, Join, TensorSpec, Update
from wire.sockets import ClientEndpoint, Counters, ServerEndpoint

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


def test_all_finite_scans_every_chunk():
    a = np.zeros(300_001, np.float64)
    assert all_finite(a) and all_finite(a[:0])
    a[-1] = np.nan
    assert not all_finite(a)


def test_every_message_type_has_a_schema_and_round_trips():
    for name, schema in BODY_SCHEMAS.items():
        body = schema(**{f.name: _example(f.type) for f in msgspec.structs.fields(schema)})
        assert decode(encode(name, body, sender="s", seq=1)).body == body


def _example(annotation):
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation(**{f.name: _example(f.type) for f in msgspec.structs.fields(annotation)})
    origin = getattr(annotation, "__origin__", None)
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


def test_endpoints_count_bytes_and_catch_spoofed_senders():
    ctx = zmq.Context()
    counts = Counters.empty()
    server = ServerEndpoint(ctx, "tcp://127.0.0.1:0", count=counts)
    client = ClientEndpoint(ctx, server.address, "client-0007")
    try:
        sent = client.send("join", Join(node="n", pid=1, client_index=7))
        peer, msg = server.recv()
        assert peer == "client-0007" and msg.nbytes == sent
        assert counts.nested() == {"join": {"received": sent}}
        client.sock.send_multipart(encode("heartbeat", Heartbeat(), sender="client-0008", seq=2))
        with pytest.raises(WireError) as info:
            server.recv()
        assert info.value.reason == "sender_mismatch" and info.value.peer == "client-0007"
        with pytest.raises(zmq.ZMQError):
            server.send("nobody", "heartbeat", Heartbeat())  # ROUTER_MANDATORY: unknown peer fails loudly
    finally:
        client.close(0)
        server.close()
        ctx.term()
