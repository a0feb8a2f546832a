"""Encoding and validating multipart messages.

Frame 0 is a msgpack :class:`~fcl_emu.wire.messages.Header`; frames 1..n are the raw,
C-contiguous bytes of the tensors listed in the header's tensor table, in
order. Sending hands numpy buffers to ZeroMQ without copying; receiving wraps
the received frame buffers with ``np.frombuffer`` without copying (the arrays
are read-only views that keep their frame alive). Nothing received is ever
unpickled or ``torch.load``-ed.

:func:`decode` validates everything before a handler sees the message and
raises :class:`WireError` with a short machine-readable ``reason`` (used as a
metric label) and a human-readable detail.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from fcl_emu.wire.messages import BODY_SCHEMAS, FINITE_CHECKED, HELD_AT_EDGE, PROTOCOL_VERSION, Body, Header, TensorSpec

ALLOWED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "uint32", "bool")
}

REASONS = (
    "bad_header",
    "bad_version",
    "unknown_type",
    "bad_body",
    "bad_dtype",
    "bad_shape",
    "size_mismatch",
    "frame_count",
    "too_many_tensors",
    "too_large",
    "non_finite",
    "unknown_sender",
    "not_authorized",  # a key that may not speak for the identity the message names (wire/auth.py)
    "unexpected",
    "secagg",
    "rate_limited",  # more control messages than a peer may send (coordinator/guard.py)
    "implausible",  # an update counting more samples than its client holds
    "norm_bound",  # an update beyond aggregation.max_update_norm
    "cohort_bound",  # a side-channel upload or a VAE beyond aggregation.adaptive_clip x its round's median norm
    "off_cohort",  # an update that agrees with nothing of its round's cohort (aggregation.direction_check)
    "late_cap",  # a late update beyond those kept for the next round
    "replayed",  # an edge aggregate whose tensors are those of one already taken
)


class WireError(Exception):
    """A received message failed validation. ``reason`` is one of :data:`REASONS`. Once its header was read,
    ``msg_type`` and ``round`` say what the refused message claimed to be (a refused update fails its client's
    round at once)."""

    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.peer: str | None = None
        self.msg_type: str | None = None
        self.round: int | None = None


@dataclass(frozen=True)
class Limits:
    """Receiver-side bounds on what one message may carry."""

    max_header_bytes: int = 1 << 20
    max_tensors: int = 4096
    max_total_bytes: int = 1 << 30
    max_ndim: int = 8
    check_finite: bool = True  # scan float tensors of FINITE_CHECKED types for NaN/inf


@dataclass
class Message:
    """A decoded, validated message (or one about to be sent)."""

    type: str
    body: Body
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    sender: str = ""
    seq: int = 0
    round: int = 0
    task: int = 0
    nbytes: int = 0  # bytes on the wire, all frames (not counting the routing id)
    square_sums: dict[str, float] = field(default_factory=dict)  # of each finite-checked float tensor (square_sum)


# msgspec raises UnicodeDecodeError (a ValueError) for invalid UTF-8 in a string, and RecursionError for
# nesting deeper than the interpreter's recursion limit (a 1 KB body of 1,000 nested arrays): the schemas are
# shallow, so the only deep values a peer can send are skipped ``Raw`` bodies and ``Any`` fields.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError)
_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)
_body_decoders = {name: msgspec.msgpack.Decoder(schema) for name, schema in BODY_SCHEMAS.items()}


def _as_wire_array(name: str, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype.name not in ALLOWED_DTYPES:
        raise ValueError(f"tensor {name!r}: dtype {array.dtype} is not allowed on the wire")
    return array.astype(ALLOWED_DTYPES[dtype.name], copy=False)


_wire_tensors_made = itertools.count(1)


@dataclass(frozen=True)
class WireTensors:
    """Tensors made ready for the wire once, to go out in many messages (a round's model, to each client).
    ``key`` tells them from every other set this process made: a shared connection carries them once under it
    (:class:`~fcl_emu.wire.sockets.ServerEndpoint`)."""

    table: list[TensorSpec]
    buffers: list[Any]
    key: int = field(default_factory=lambda: next(_wire_tensors_made))


def wire_tensors(tensors: Mapping[str, Any] | None) -> WireTensors:
    """``tensors`` as the wire carries them: little-endian, C-contiguous, of an allowed dtype (not copied where
    they are already)."""
    arrays = [(name, _as_wire_array(name, value)) for name, value in (tensors or {}).items()]
    # 0-d and empty arrays have no useful buffer export for zmq; send bytes for those.
    return WireTensors([TensorSpec(name, a.dtype.name, list(a.shape), a.nbytes) for name, a in arrays],
                       [a if a.ndim and a.size else a.tobytes() for _, a in arrays])


def encode(
    msg_type: str,
    body: Body,
    *,
    sender: str,
    seq: int,
    round: int = 0,
    task: int = 0,
    tensors: Mapping[str, Any] | WireTensors | None = None,
) -> list[Any]:
    """Frames for one message: header bytes, then one buffer per tensor (not copied)."""
    schema = BODY_SCHEMAS.get(msg_type)
    if schema is None or not isinstance(body, schema):
        raise TypeError(f"message type {msg_type!r} needs a {schema.__name__ if schema else '?'} body")
    ready = tensors if isinstance(tensors, WireTensors) else wire_tensors(tensors)
    header = Header(
        v=PROTOCOL_VERSION,
        type=msg_type,
        sender=sender,
        seq=seq,
        round=round,
        task=task,
        body=msgspec.Raw(_header_encoder.encode(body)),
        tensors=ready.table,
    )
    return [_header_encoder.encode(header), *ready.buffers]


def _buffer(frame: Any) -> memoryview:
    """The payload of a received frame (zmq.Frame, bytes or memoryview) without copying."""
    buffer = getattr(frame, "buffer", None)
    return buffer if buffer is not None else memoryview(frame)


_SQUARE_ROW = 1024


def square_sum(array: np.ndarray) -> float | None:
    """The sum of the squares of a float array's values, or None if it holds a NaN or an infinity: the finite
    check and the squared L2 norm (which :func:`fcl_emu.aggregation.clipping.delta_norm` reads) in one pass over
    memory, made while a received tensor is still in cache.

    Rows of 1,024 values are summed in the array's own precision (``np.vecdot``: one BLAS dot per row, too short
    for BLAS threads to compete with the edge nodes for the cores; twice as fast as ``np.einsum`` in cache), the
    row sums in float64: within 1e-7 of the float64 sum for float32. A
    row whose sum is not finite is looked at again: NaN or infinity in it gives None, squares that only overflowed
    its precision (float32 values past 1.8e19) are summed again in float64."""
    flat = array.reshape(-1)
    if flat.size < _SQUARE_ROW or flat.dtype.itemsize < 4:  # small, or float16 (whose squares overflow past 256)
        total = _exact_square_sum(flat)
        return total if math.isfinite(total) else None
    whole = flat.size - flat.size % _SQUARE_ROW
    rows = flat[:whole].reshape(-1, _SQUARE_ROW)
    with np.errstate(over="ignore", invalid="ignore"):  # a non-finite sum is looked at below, not warned of
        sums = np.vecdot(rows, rows)
    total = float(sums.sum(dtype=np.float64)) + (_exact_square_sum(flat[whole:]) if whole < flat.size else 0.0)
    if math.isfinite(total):
        return total
    if not np.isfinite(flat).all():
        return None
    return math.fsum(_exact_square_sum(row) if not math.isfinite(s) else float(s) for row, s in zip(rows, sums)) \
        + _exact_square_sum(flat[whole:])


def _exact_square_sum(values: np.ndarray) -> float:
    wide = values.astype(np.float64, copy=False)
    return float(np.dot(wide, wide)) if wide.size < _SQUARE_ROW else float(np.einsum("i,i->", wide, wide))


def decode(frames: Sequence[Any], limits: Limits = Limits()) -> Message:
    """Validate and decode one message's frames (routing id already removed)."""
    if not frames:
        raise WireError("frame_count", "empty message")
    head = _buffer(frames[0])
    header = _read_header(head, limits)
    try:
        return _decode_after_header(header, head, frames, limits)
    except WireError as exc:
        exc.msg_type, exc.round = header.type, header.round
        raise


def _read_header(head: memoryview, limits: Limits) -> Header:
    if head.nbytes > limits.max_header_bytes:
        raise WireError("too_large", f"header of {head.nbytes} bytes exceeds {limits.max_header_bytes}")
    try:
        header = _header_decoder.decode(head)
    except _DECODE_ERRORS as exc:
        raise WireError("bad_header", str(exc)) from None
    if header.v != PROTOCOL_VERSION:
        raise WireError("bad_version", f"protocol version {header.v}, this side speaks {PROTOCOL_VERSION}")
    return header


def peek_header(frame: Any, limits: Limits = Limits()) -> Header:
    """The validated header of a message's first frame, its body and tensors left unread (what a relay needs to
    route a message it forwards as it came)."""
    return _read_header(_buffer(frame), limits)


def refused_unread(reason: str, detail: str, head: Any, limits: Limits = Limits()) -> WireError:
    """The error for a message refused before decoding (its header frame ``head``), saying what type and
    round the header claims if it is a valid one (a refused update fails its client's round at once)."""
    exc = WireError(reason, detail)
    try:
        header = _read_header(_buffer(head), limits)
    except WireError:
        return exc
    exc.msg_type, exc.round = header.type, header.round
    return exc


def _decode_after_header(header: Header, head: memoryview, frames: Sequence[Any], limits: Limits) -> Message:
    """The body and the tensors of a message whose header is read."""
    body_decoder = _body_decoders.get(header.type)
    if body_decoder is None:
        raise WireError("unknown_type", f"message type {header.type!r}")
    try:
        body = body_decoder.decode(header.body)
    except _DECODE_ERRORS as exc:
        raise WireError("bad_body", f"{header.type}: {exc}") from None

    table = header.tensors
    if len(table) > limits.max_tensors:
        raise WireError("too_many_tensors", f"{len(table)} tensors, limit {limits.max_tensors}")
    if len(frames) != len(table) + 1:
        raise WireError("frame_count", f"{len(frames) - 1} tensor frames for {len(table)} table entries")
    total = sum(spec.nbytes for spec in table)
    if total > limits.max_total_bytes:
        raise WireError("too_large", f"{total} tensor bytes, limit {limits.max_total_bytes}")

    tensors: dict[str, np.ndarray] = {}
    square_sums: dict[str, float] = {}
    check_finite = limits.check_finite and header.type in FINITE_CHECKED
    wire_bytes = head.nbytes
    for spec, frame in zip(table, frames[1:]):
        dtype = ALLOWED_DTYPES.get(spec.dtype)
        if dtype is None:
            raise WireError("bad_dtype", f"tensor {spec.name!r}: dtype {spec.dtype!r} not allowed")
        if len(spec.shape) > limits.max_ndim or any(d < 0 for d in spec.shape):
            raise WireError("bad_shape", f"tensor {spec.name!r}: shape {spec.shape}")
        if spec.name in tensors:
            raise WireError("bad_shape", f"tensor {spec.name!r} appears twice")
        buffer = _buffer(frame)
        expected = math.prod(spec.shape) * dtype.itemsize
        if expected != spec.nbytes or buffer.nbytes != expected:
            raise WireError(
                "size_mismatch",
                f"tensor {spec.name!r}: shape {spec.shape} x {dtype.itemsize} B = {expected} B, "
                f"table says {spec.nbytes} B, frame has {buffer.nbytes} B",
            )
        array = np.frombuffer(buffer, dtype=dtype).reshape(spec.shape)
        array.flags.writeable = False  # received tensors may be shared: never mutate them
        if check_finite and dtype.kind == "f":
            squares = square_sum(array)
            if squares is None:
                raise WireError("non_finite", f"tensor {spec.name!r} holds NaN or infinity")
            square_sums[spec.name] = squares
        tensors[spec.name] = array
        wire_bytes += buffer.nbytes
    return Message(
        type=header.type,
        body=body,
        tensors=tensors,
        sender=header.sender,
        seq=header.seq,
        round=header.round,
        task=header.task,
        nbytes=wire_bytes,
        square_sums=square_sums,
    )


def link_nbytes(msg: Message) -> int:
    """The bytes the sending client's own link carried for ``msg``: its size, or for an answer an edge aggregator
    holds (``update_held``, ``secagg_masked_held``) the size of the client's message that it stands for."""
    return msg.body.nbytes if msg.type in HELD_AT_EDGE.values() else msg.nbytes


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Bytes in a list of frames (header plus tensor buffers: bytes, arrays or received ZeroMQ frames)."""
    return sum(len(f) if isinstance(f, (bytes, zmq.Frame)) else f.nbytes for f in frames)
