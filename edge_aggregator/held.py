"""The updates an edge aggregator holds for the coordinator's ``edge_collect``, and the aggregate it answers with.

Each client's ``update`` is checked on arrival against the round's model (the tensor table of the round's
``train_request``, which the aggregator relayed) as the coordinator checks a flat run's: the model's tensors,
shapes and dtypes. What passes is held until the round's collect, which names the clients that made the round in
the coordinator's time; then the defences of a plain round act over the clients named (``--max-update-norm``,
the direction check, ``--clip-norm``, the adaptive bound: :mod:`fcl_emu.aggregation`), and their
sample-weighted mean goes up as one message (:func:`fcl_emu.aggregation.combine.group_mean`).

Under secure aggregation the aggregator holds each client's masked input (checked for its shape and ring, as the
SecAgg+ server checks it) and answers the collect with their ring sum, still masked: the pairwise masks between
its clients cancel in it, those with clients elsewhere and the self-masks do not (docs/hierarchy.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fcl_emu.aggregation.combine import group_mean
from fcl_emu.aggregation.defences import Defences, bound
from fcl_emu.aggregation.update import DELTA, Arrays, ClientUpdate
from fcl_emu.wire.framing import Message, WireError
from fcl_emu.secagg.protocol import SecAggError
from fcl_emu.secagg.server import check_masked
from fcl_emu.wire.messages import EdgeAggregate, EdgeCollect, SecAggParams, TensorSpec

ROUNDS_HELD = 2  # rounds whose updates are held at once (the open one, and one a slow collect still asks for)


@dataclass
class Aggregate:
    """An ``edge_aggregate``'s body and tensors."""

    body: EdgeAggregate
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


class HeldUpdates:
    """The clients' updates of the latest rounds, by round and client.

    What they take is bounded: a client's answer is held only in a round its train request was relayed for, once,
    no larger than the round's model (a masked input: of the round's shape), and an update without samples without
    its tensors (a zero weight needs none); all held together stay within ``max_bytes`` (None: every client relayed
    one answer of the model's size, which those bounds already imply), beyond which an answer is refused
    (``too_large``)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.models: dict[int, dict[str, TensorSpec]] = {}  # round -> the model's tensors (its train_request's)
        self.asked: dict[int, set[str]] = {}  # round -> the clients its train request was relayed to
        self.updates: dict[int, dict[str, ClientUpdate]] = {}
        self.rings: dict[int, MaskedShape] = {}  # secure rounds: round -> its masked inputs' shape
        self.masked: dict[int, dict[str, np.ndarray]] = {}
        self._bytes: dict[int, int] = {}  # round -> bytes of the answers held for it

    def on_train_request(self, round: int, table: list[TensorSpec], client: str) -> None:
        """``client``'s train request of ``round`` was relayed, with the round's model as its tensor table names it
        (every client's is the same): the model's parameters (plain names) and a method's modules that ride with it
        (``<method>/...``)."""
        if round not in self.models:
            self.models[round] = {spec.name: spec for spec in table}
            for old in sorted(self.models)[:-ROUNDS_HELD]:
                del self.models[old]
                self.updates.pop(old, None)
                self.asked.pop(old, None)
                self._bytes.pop(old, None)
        self.asked.setdefault(round, set()).add(client)

    def on_secagg_setup(self, round: int, params: SecAggParams) -> None:
        """A secure round's parameters, as its ``secagg_setup`` gives them (every client's are the same)."""
        if round not in self.rings:
            self.rings[round] = MaskedShape(params.dim + 1, params.ring_bits)
            for old in sorted(self.rings)[:-ROUNDS_HELD]:
                del self.rings[old]
                self.masked.pop(old, None)

    def hold_masked(self, msg: Message) -> None:
        """Check a client's masked input (its shape and ring) and hold it; WireError (``secagg``) otherwise."""
        ring = self.rings.get(msg.round)
        if ring is None:
            raise WireError("unexpected", f"a masked input for round {msg.round}, which this aggregator did not set up")
        self._check_asked(msg.sender, msg.round)
        held = self.masked.setdefault(msg.round, {})
        if msg.sender in held:
            raise WireError("secagg", f"second masked input from {msg.sender} in round {msg.round}")
        try:
            y = check_masked(ring, msg.tensors.get("y"), repr(msg.sender))
        except SecAggError as exc:
            raise WireError("secagg", str(exc)) from None
        self._take(msg.round, y.nbytes)
        held[msg.sender] = y

    def hold(self, msg: Message) -> ClientUpdate:
        """Check the update ``msg`` (:meth:`check`) and hold it for the round's collect."""
        return self.keep(msg.round, self.check(msg))

    def keep(self, round: int, update: ClientUpdate) -> ClientUpdate:
        """Hold the checked ``update`` for ``round``'s collect (WireError for its client's second)."""
        held = self.updates.setdefault(round, {})
        if update.client in held:
            raise WireError("unexpected", f"second update from {update.client} in round {round}")
        self._take(round, _nbytes(update.tensors))
        held[update.client] = update
        return update

    def budget(self) -> int:
        """The bytes all held answers may take: ``max_bytes``, or one answer of its round's model (or masked
        input) for every client a train request was relayed to in the rounds held."""
        if self.max_bytes is not None:
            return self.max_bytes
        return sum(len(clients) * max(self._model_bytes(r), 4 * self.rings[r].length if r in self.rings else 0)
                   for r, clients in self.asked.items())

    def _take(self, round: int, nbytes: int) -> None:
        """Count ``nbytes`` more held for ``round``, or refuse them (``too_large``) beyond :meth:`budget`."""
        held = sum(n for r, n in self._bytes.items() if r in self.updates or r in self.masked)
        if held + nbytes > (budget := self.budget()):
            raise WireError("too_large", f"{nbytes:,} bytes more would take the updates held here past their "
                                         f"budget of {budget:,} bytes ({held:,} held)")
        self._bytes[round] = self._bytes.get(round, 0) + nbytes

    def _model_bytes(self, round: int) -> int:
        return sum(spec.nbytes for spec in self.models.get(round, {}).values())

    def _check_asked(self, client: str, round: int) -> None:
        """Refuse (``unexpected``) an answer from a client no train request of ``round`` was relayed to."""
        if client not in self.asked.get(round, ()):
            raise WireError("unexpected", f"an answer from {client} for round {round}, whose train request this "
                                          f"aggregator did not relay to it")

    def check(self, msg: Message) -> ClientUpdate:
        """The update ``msg`` (decoded, finite) checked against its round's model; WireError for one the
        coordinator would refuse (``bad_shape``, ``bad_dtype``, ``bad_body``, ``unexpected``), from a client the
        round's train request was not relayed to (``unexpected``) or larger than the model (``too_large``). One
        without samples keeps no tensors."""
        model = self.models.get(msg.round)
        if model is None:
            raise WireError("unexpected", f"an update for round {msg.round}, which this aggregator did not relay")
        self._check_asked(msg.sender, msg.round)
        body = msg.body
        if body.num_samples < 0:
            raise WireError("bad_body", "negative num_samples")
        if body.num_samples == 0:  # weighs nothing in the mean: nothing of it to hold but its loss and metrics
            return ClientUpdate(msg.sender, 0, {}, body.loss, body.metrics, {})
        update = ClientUpdate(msg.sender, body.num_samples, msg.tensors, body.loss, body.metrics, msg.square_sums)
        _check_layout(update, model)
        if (nbytes := _nbytes(msg.tensors)) > (most := self._model_bytes(msg.round)):  # tensors beside the model's
            raise WireError("too_large", f"an update of {nbytes:,} tensor bytes; the round's model has {most:,}")
        return update

    def collect(self, round: int, ask: EdgeCollect, offset: Arrays | None = None) -> Aggregate:
        """The aggregate of the held updates of ``ask.clients`` in ``round``, after the plain round's defences,
        plus ``offset`` (what earlier edge rounds moved the model by: :mod:`~fcl_emu.edge_aggregator.edge_rounds`);
        a secure round's: the ring sum of their masked inputs. The round's updates are let go."""
        if round in self.rings:
            return self._masked_sum(round, ask.clients)
        held = self.updates.pop(round, {})
        missing = [c for c in ask.clients if c not in held]
        chosen = sorted((held[c] for c in ask.clients if c in held), key=lambda u: u.client)
        useful = [u for u in chosen if u.num_samples > 0]
        prefixes = tuple(ask.prefixes) or (DELTA,)
        useful, refused = bound(useful, Defences.of(ask), prefixes, cohort="its edge group")
        losses = [u.loss for u in useful if np.isfinite(u.loss)]
        body = EdgeAggregate(clients=[u.client for u in chosen if u.client not in refused],
                             num_samples=sum(u.num_samples for u in useful),
                             loss=float(np.mean(losses)) if losses else float("nan"), refused=refused,
                             missing=missing)
        mean = group_mean(useful, prefixes) if useful else {}
        for name, moved in (offset or {}).items():
            if DELTA + name in mean:
                mean[DELTA + name] = (mean[DELTA + name] + moved).astype(np.float32)
        return Aggregate(body, mean)


    def _masked_sum(self, round: int, clients: list[str]) -> Aggregate:
        """The ring sum of the held masked inputs of ``clients`` (masked still: the aggregator never sees an
        input unmasked, the coordinator only this sum)."""
        held, ring = self.masked.pop(round, {}), self.rings[round]
        summed = [c for c in clients if c in held]
        total = np.zeros(ring.length, np.uint32)
        for client in summed:
            np.add(total, held[client], out=total)
        if ring.ring_bits < 32:
            np.bitwise_and(total, np.uint32((1 << ring.ring_bits) - 1), out=total)
        body = EdgeAggregate(clients=summed, num_samples=0, loss=float("nan"),
                             missing=[c for c in clients if c not in held])
        return Aggregate(body, {"y": total} if summed else {})


@dataclass(frozen=True)
class MaskedShape:
    """What a round's masked inputs look like: ``length`` ring elements of ``ring_bits`` bits."""

    length: int
    ring_bits: int


def _nbytes(tensors: Arrays) -> int:
    return sum(value.nbytes for value in tensors.values())


def _check_layout(update: ClientUpdate, sent: dict[str, TensorSpec]) -> None:
    """The delta names exactly the model's parameters (the tensors sent under plain names), each with its shape and
    dtype, as the coordinator checks; an upload named as a method's module that was sent (a projector's, a flow's
    delta) has that module's shape and dtype too."""
    model = {name: spec for name, spec in sent.items() if "/" not in name}
    got = {k[len(DELTA):]: v for k, v in update.tensors.items() if k.startswith(DELTA)}
    if got.keys() != model.keys():
        missing, extra = sorted(model.keys() - got.keys())[:3], sorted(got.keys() - model.keys())[:3]
        raise WireError("bad_shape", f"delta keys differ from the model (missing {missing}, unknown {extra})")
    modules = {name: value for name, value in update.tensors.items() if name in sent}
    for name, value in [*got.items(), *modules.items()]:
        spec = sent[name]
        if list(value.shape) != list(spec.shape):
            raise WireError("bad_shape", f"delta {name!r} has shape {list(value.shape)}, model has {spec.shape}")
        if value.dtype.name != spec.dtype:
            raise WireError("bad_dtype", f"delta {name!r} is {value.dtype}, model has {spec.dtype}")
