"""Message types and their body schemas.

Every message on the wire is a msgpack header (frame 0) followed by raw tensor
frames. The header is a :class:`Header`; its ``body`` is decoded against the
schema registered for its ``type`` in :data:`BODY_SCHEMAS`, so a message with a
missing field, a field of the wrong type or an unknown field is rejected before
any handler sees it; :data:`SENDERS` names who may send each type. Adding a
message type means adding a body struct and one line in each of the two.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

PROTOCOL_VERSION = 1

# Bounds on what a peer's strings and maps may hold, checked while decoding (a longer one fails as bad_body or
# bad_header): nothing a peer sends grows the receiver's logs, events or checkpoints without bound.
Name = Annotated[str, msgspec.Meta(max_length=128)]  # identities, types, tensor and metric names, codes
Text = Annotated[str, msgspec.Meta(max_length=1024)]  # free text: error details, reasons
MAX_METRICS = 64  # metric keys in one update
Metrics = Annotated[dict[Name, float], msgspec.Meta(max_length=MAX_METRICS)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e9)]  # a finite duration (NaN fails the bound too)
SquareSum = Annotated[float, msgspec.Meta(ge=0, le=1e300)]  # a tensor's sum of squares (NaN, infinity fail)
MAX_TENSORS = 4096  # tensors in one message (wire.framing.Limits.max_tensors)


def client_id(index: int) -> str:
    """The identity client ``index`` speaks under (its messages' sender; its key's grant, wire/auth.py)."""
    return f"client-{index:04d}"


class TensorSpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Table entry describing one tensor frame."""

    name: Name
    dtype: Name
    shape: Annotated[list[int], msgspec.Meta(max_length=32)]
    nbytes: int


class Header(msgspec.Struct, forbid_unknown_fields=True):
    """Frame 0 of every message. ``body`` stays raw until its schema is known."""

    v: int
    type: Name
    sender: Name
    seq: int
    round: int
    task: int
    body: msgspec.Raw
    tensors: list[TensorSpec]


class Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of all bodies: unknown fields are an error."""


class Join(Body):
    node: Name
    pid: int
    client_index: int
    assets_task: int = -1  # task whose per-task assets the client still holds (a rejoin after leaving)


class EdgeSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One client's emulated edge behaviour (scenario/availability.py, scenario/devices.py, scenario/links.py)."""

    availability: dict[str, Any] = msgspec.field(default_factory=lambda: {"kind": "always"})
    profile: dict[str, Any] | None = None
    crash_rate: float = 0.0
    crash_downtime_s: float = 5.0
    clock_s: float = 0.0  # the coordinator's run clock when it sent the welcome
    # "emulated": the coordinator keeps the time (availability, crashes, compute and link delays are computed
    # there, coordinator/emulated.py); the node sends at once and reports its training's CPU time
    clock: Literal["real", "emulated"] = "real"


class Welcome(Body):
    run_id: str
    scenario: dict[str, Any]
    method: str
    method_options: dict[str, Any]
    model: str
    training: dict[str, Any]
    heartbeat_interval_s: float
    join_task: int
    edge: EdgeSettings = msgspec.field(default_factory=EdgeSettings)
    # the run aggregates under SecAgg+ (--secagg): a node that was not started to (edge_node/args.py, --secagg),
    # or one started to in a plain run, exits in one line instead of following what a relay says
    secure: bool = False


MAX_REASONS = 64  # refusal reasons in one report


class Heartbeat(Body):
    """A client's carries nothing; an edge aggregator's, the client messages it refused so far by reason, which the
    coordinator's summary counts as the edge's (``rejected_messages``: ``edge/<reason>``)."""

    rejected: Annotated[dict[Name, Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_REASONS)] = {}


class Leave(Body):
    reason: Text


class TaskStart(Body):
    """Opens a task for a client; the method's per-task assets follow as their own messages."""

    classes: list[int]
    seen_classes: list[int]
    restart: bool = False  # emulated clock: the client crashed since its last task start (in-memory state lost)


class TaskAsset(Body):
    """One kind of per-task asset (its tensors ride in the frames), sent after ``task_start`` and before the
    first ``train_request`` of the task. Each kind is its own message type (:data:`ASSET_TYPES`), so its
    bytes are counted under its own name."""


# Per-task asset kinds, each a message type with a TaskAsset body (methods.base.ServerPart.task_assets):
# a frozen earlier model, a generator's weights, a synthetic data set, label-text embeddings, a frozen
# pretrained feature extractor (FedCBC).
ASSET_TYPES = ("old_model", "generator", "synthetic_data", "label_text", "feature_extractor")


class TrainRequest(Body):
    """The global model rides in the tensor frames."""

    local_epochs: int
    lr: float
    # the update goes through secure aggregation (a secagg_setup came first); a node refuses a request whose flag is
    # not what it was started with (a relay cannot turn a secure round plain)
    secure: bool = False


class Cancel(Body):
    """Coordinator -> client: drop the training of the round named in the header; it can no longer count (the
    emulated clock knows it arrives after the round's close). The node trains no further batch of it and
    sends nothing for it; a node that ignores it sends its update, which the coordinator counts as late."""


class Update(Body):
    """The model delta (and method extras) ride in the tensor frames."""

    num_samples: int
    train_time_s: float
    loss: float
    metrics: Metrics = {}
    cpu_s: Seconds = 0.0  # CPU seconds of this client's own training (what the emulated clock scales)


class UpdateHeld(Update, kw_only=True):
    """Edge aggregator -> coordinator, under the client's identity: the client's ``update`` of the round in the
    header reached its edge aggregator (docs/hierarchy.md), which checked it and holds its tensors until the
    round's ``edge_collect``. The body is the update's, with the aggregator's name, the bytes the client sent
    (what its link carried) and the sum of the squares of each of its float tensors as the aggregator received
    them: the bound on the aggregate (a weighted mean is no longer, tensor by tensor, than the longest of its
    clients' updates)."""

    aggregator: Name
    nbytes: int
    square_sums: Annotated[dict[Name, SquareSum], msgspec.Meta(max_length=MAX_TENSORS)] = {}


MAX_TIER_CLIENTS = 1 << 17  # clients named in one edge collect or aggregate


class EdgeCollect(Body):
    """Coordinator -> edge aggregator: combine the held updates of ``clients`` (the round in the header) into one
    aggregate, after refusing as the coordinator would: the norm bound, the direction check, the clip norm and the
    adaptive bound (each None: off), over the float tensors under ``prefixes``."""

    clients: Annotated[list[Name], msgspec.Meta(max_length=MAX_TIER_CLIENTS)]
    prefixes: Annotated[list[Name], msgspec.Meta(max_length=16)]
    max_update_norm: float | None = None
    direction_check: float | None = None
    clip_norm: float | None = None
    adaptive_clip: float | None = None


class EdgeAggregate(Body):
    """Edge aggregator -> coordinator (its own identity): the sample-weighted mean of the held updates of
    ``clients`` (in the frames, named as the updates' tensors; none when they hold no samples), ``num_samples``
    their total; ``refused``: client -> (reason, detail) of those left out; ``missing``: asked for and not held;
    ``tier_bytes``: what its own clients' links carried since its last aggregate, {"sent"/"received": bytes} seen
    from the aggregator."""

    clients: Annotated[list[Name], msgspec.Meta(max_length=MAX_TIER_CLIENTS)]
    num_samples: int
    loss: float
    refused: Annotated[dict[Name, tuple[Name, Text]], msgspec.Meta(max_length=MAX_TIER_CLIENTS)] = {}
    missing: Annotated[list[Name], msgspec.Meta(max_length=MAX_TIER_CLIENTS)] = []
    tier_bytes: dict[Name, int] = {}


class SideChannel(Body):
    """Client -> coordinator: a method's own per-client payload that bypasses aggregation by design (GLFC's
    prototype gradients), ``items`` groups of tensors ``<k>/<name>`` in the frames. Sent just before the
    round's update; the coordinator hands the tensors to the method without the sender's identity."""

    items: int


# Side-channel kinds, each a message type with a SideChannel body (methods.base.ServerPart.side_channels).
SIDE_CHANNEL_TYPES = ("prototype_gradients",)


class Error(Body):
    code: Name
    detail: Text


class Shutdown(Body):
    reason: str


# --- secure aggregation (SecAgg+, docs/secagg.md): one message type per phase and direction -------------
# The bodies carry what secagg/server.py and secagg/client.py exchange; the masked input rides in a
# uint32 tensor frame named "y". Every secagg message names its round in the header.

class SecAggNoise(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Distributed DP (``secagg.noise.DistributedNoise``): every client adds its share of noise of multiplier
    ``multiplier`` for a planned cohort of ``cohort`` clients."""

    multiplier: float
    cohort: int


class SecAggParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One round's SecAgg+ parameters, the map ``secagg.protocol.RoundParams.to_dict()`` writes (in its order,
    so the bytes are those of that map; ``noise`` only under distributed DP); the protocol checks their ranges
    (``RoundParams``)."""

    round: int  # the protocol's 64-bit round id
    n: int
    dim: int
    neighbors: int
    threshold: int
    ring_bits: int
    clip: float
    max_weight: int
    noise: SecAggNoise | None = None


class SecAggSetup(Body):
    """Coordinator -> client: opens the protocol for this round (round parameters, roster index, neighbours)."""

    params: SecAggParams
    index: int
    neighbors: dict[str, int]


class SecAggPublicKeys(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    c_pk: bytes  # X25519 key for share encryption
    s_pk: bytes  # X25519 key for pairwise masks
    sig: bytes | None = None  # Ed25519 signature of (round, client, c_pk, s_pk) by the client's grant (secagg.identity)


class SecAggKeys(SecAggPublicKeys, Body):
    """Client -> coordinator (advertise_keys): its two fresh public keys."""

    cpu_s: Seconds = 0.0  # CPU seconds of the client's cryptography for this reply (what the emulated clock scales)


class SecAggPeerKeys(Body):
    """Coordinator -> client: its live neighbours' public keys."""

    keys: dict[str, SecAggPublicKeys]


class SecAggShares(Body, omit_defaults=True):
    """Client -> coordinator (share_keys): its encrypted shares, one per neighbour, and a commitment; the
    neighbours whose advertised keys failed its signature check get no share and are listed in ``refused``."""

    shares: dict[str, bytes]
    b_commit: bytes
    refused: list[Name] = []
    cpu_s: Seconds = 0.0


class SecAggRelay(Body):
    """Coordinator -> client: the encrypted shares addressed to it (relayed unread)."""

    shares: dict[str, bytes]


class SecAggMasked(Body):
    """Client -> coordinator (masked_input): replaces ``update``. The masked vector (weight included) is the
    tensor "y"; the sample count travels only under the mask. Loss and training time are monitoring
    metadata, sent in the clear."""

    train_time_s: float
    loss: float
    metrics: Metrics = {}
    cpu_s: Seconds = 0.0  # of its training
    mask_cpu_s: Seconds = 0.0  # of its masking
    model_sig: bytes | None = None  # its signature of the model it trained (secagg.consistency), with signing keys


class SecAggMaskedHeld(SecAggMasked, kw_only=True):
    """Edge aggregator -> coordinator, under the client's identity: the client's ``secagg_masked`` reached its
    edge aggregator, which holds the masked vector until the phase's ``edge_collect`` asks for the ring sum of
    its clients' (docs/hierarchy.md). The body is the masked input's, with the aggregator's name and the bytes
    the client sent."""

    aggregator: Name
    nbytes: int


class SecAggUnmaskRequest(Body):
    """Coordinator -> survivor: which of its neighbours sent a masked input and which dropped."""

    survivors: list[str]
    dropped: list[str]
    n_survivors: int
    model_sigs: dict[str, bytes] = {}  # every survivor's signature of the model it trained (secagg.consistency)


class SecAggUnmask(Body):
    """Client -> coordinator (unmasking): self-mask shares of survivors, mask-key shares of the dropped."""

    b_shares: dict[str, bytes]
    s_shares: dict[str, bytes]
    cpu_s: Seconds = 0.0


class SecAggAbort(Body):
    """Coordinator -> clients: the round's secure aggregation ended early; forget its secrets."""

    reason: str


# --- the coordinator's GPU worker pool (docs/gpu.md) --------------------------------------------------

class WorkerHello(Body):
    """Worker -> coordinator, once after it connected: which device it owns."""

    index: int
    device: str
    pid: int


class JobRequest(Body):
    """Coordinator -> worker: run one job. Its input arrays ride in the tensor frames."""

    job_id: int
    kind: str
    options: dict[str, Any] = {}


class JobProgress(Body):
    """Worker -> coordinator, while a job runs (a few times a second at most): how many of its steps are done."""

    job_id: int
    done: int
    total: int


class JobResult(Body):
    """Worker -> coordinator: a job's outcome. Output arrays ride in the tensor frames (none on failure)."""

    job_id: int
    ok: bool
    error: Text = ""
    run_s: float = 0.0
    metrics: Metrics = {}


BODY_SCHEMAS: dict[str, type[Body]] = {
    "join": Join,
    "welcome": Welcome,
    "heartbeat": Heartbeat,
    "leave": Leave,
    "task_start": TaskStart,
    **{asset: TaskAsset for asset in ASSET_TYPES},
    "train_request": TrainRequest,
    "cancel": Cancel,
    "update": Update,
    "update_held": UpdateHeld,
    "edge_collect": EdgeCollect,
    "edge_aggregate": EdgeAggregate,
    **{kind: SideChannel for kind in SIDE_CHANNEL_TYPES},
    "error": Error,
    "shutdown": Shutdown,
    "secagg_setup": SecAggSetup,
    "secagg_keys": SecAggKeys,
    "secagg_peer_keys": SecAggPeerKeys,
    "secagg_shares": SecAggShares,
    "secagg_relay": SecAggRelay,
    "secagg_masked": SecAggMasked,
    "secagg_masked_held": SecAggMaskedHeld,
    "secagg_unmask_request": SecAggUnmaskRequest,
    "secagg_unmask": SecAggUnmask,
    "secagg_abort": SecAggAbort,
    "worker_hello": WorkerHello,
    "job": JobRequest,
    "job_progress": JobProgress,
    "job_result": JobResult,
}

# --- who sends what: each message type's rightful sender class --------------------------------------------------
# Checked where a message enters another party: an edge aggregator's relay forwards up only what a client may send
# (edge_aggregator/relay.py); the coordinator takes under a client's name only a client's messages, and an edge
# aggregator's notices (``update_held``, ``secagg_masked_held``) only over that aggregator's own connection
# (coordinator/dispatch.py). An edge node sends only in its clients' names. A few types are more than one class's
# own: heartbeats (a client's, an aggregator's), errors (any party's refusal or failure), and train requests (an
# aggregator trains its clients again from its edge model under --edge-rounds).
CLIENT, AGGREGATOR, COORDINATOR, WORKER = "client", "aggregator", "coordinator", "worker"
SENDERS: dict[str, frozenset[str]] = {msg_type: frozenset(senders) for msg_type, senders in {
    "join": {CLIENT},
    "welcome": {COORDINATOR},
    "heartbeat": {CLIENT, AGGREGATOR},
    "leave": {CLIENT},
    "task_start": {COORDINATOR},
    **{asset: {COORDINATOR} for asset in ASSET_TYPES},
    "train_request": {COORDINATOR, AGGREGATOR},
    "cancel": {COORDINATOR},
    "update": {CLIENT},
    "update_held": {AGGREGATOR},
    "edge_collect": {COORDINATOR},
    "edge_aggregate": {AGGREGATOR},
    **{kind: {CLIENT} for kind in SIDE_CHANNEL_TYPES},
    "error": {CLIENT, AGGREGATOR, COORDINATOR, WORKER},
    "shutdown": {COORDINATOR},
    "secagg_setup": {COORDINATOR},
    "secagg_keys": {CLIENT},
    "secagg_peer_keys": {COORDINATOR},
    "secagg_shares": {CLIENT},
    "secagg_relay": {COORDINATOR},
    "secagg_masked": {CLIENT},
    "secagg_masked_held": {AGGREGATOR},
    "secagg_unmask_request": {COORDINATOR},
    "secagg_unmask": {CLIENT},
    "secagg_abort": {COORDINATOR},
    "worker_hello": {WORKER},
    "job": {COORDINATOR},
    "job_progress": {WORKER},
    "job_result": {WORKER},
}.items()}


def sent_by(msg_type: str, sender: str) -> bool:
    """Whether ``sender`` (a class: :data:`CLIENT`, :data:`AGGREGATOR`, ...) may send messages of ``msg_type``."""
    return sender in SENDERS.get(msg_type, ())


def plain_body(body: msgspec.Struct) -> dict[str, Any]:
    """A decoded body as plain dicts and lists (bytes kept as bytes): what the secure-aggregation protocol
    code on both sides takes."""
    return msgspec.to_builtins(body, builtin_types=(bytes,))


# Secure-aggregation messages a client sends, by the protocol phase (secagg.protocol.PHASES) they answer.
SECAGG_REPLIES = {"secagg_keys": "advertise_keys", "secagg_shares": "share_keys",
                  "secagg_masked": "masked_input", "secagg_masked_held": "masked_input", "secagg_unmask": "unmasking"}

# What an edge aggregator sends up in place of a client's answer it holds (docs/hierarchy.md), by the answer's type.
HELD_AT_EDGE = {"update": "update_held", "secagg_masked": "secagg_masked_held"}

# What a selected client sends for its round (or an edge aggregator in its name): a refused one fails the client for
# the round at once, at the coordinator (coordinator/dispatch.py) or reported up by its aggregator as the client's
# error (edge_aggregator/relay.py), so that no round waits for an answer that was refused.
ROUND_MESSAGES = frozenset({"update", "update_held", *SECAGG_REPLIES, *SIDE_CHANNEL_TYPES})

# Message types whose float tensors must be finite (model content a receiver
# will compute with). Others are checked for shape and size only.
FINITE_CHECKED = frozenset({"update", "edge_aggregate", "train_request", "task_start", *ASSET_TYPES,
                            *SIDE_CHANNEL_TYPES, "job", "job_result"})
