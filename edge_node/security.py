"""How a node's run aggregates, chosen once at its start (``--secagg``, from its launcher, :func:`round_security`):
:class:`PlainRounds` (each result goes up as a plain update; a SecAgg+ message is refused) or :class:`SecureRounds`
(each result goes into the masked sum through the node's SecAgg+ sessions, trained only with the round's session
open). Either holds whatever a relayed train request says, and both check a welcome: a node does not join a run
that aggregates otherwise (:meth:`RoundSecurity.welcome_refusal`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SECURITY_MISMATCH = "secure_mismatch"  # a client's error code: it cannot take part as the run aggregates

KIND = {False: "plain", True: "masked"}  # the kind of update a client sends in a run that aggregates so
AGGREGATES = {False: "aggregates plainly (no --secagg)", True: "aggregates securely (--secagg)"}  # in words

Refuse = Callable[[Any, Any, str], None]  # (client, message, what) -> the client's error for the round


class RoundSecurity:
    """One node's way of aggregating: ``send_result(client, result)`` sends a finished training's result,
    ``on_secagg(client, msg)`` takes a SecAgg+ message, ``cannot_train(client, round)`` says why a client cannot
    train a round this way (None: it can)."""

    secure = False

    def __init__(self, send_result: Callable, on_secagg: Callable, cannot_train: Callable[[Any, int], str | None]):
        self.send_result, self.on_secagg, self.cannot_train = send_result, on_secagg, cannot_train

    @property
    def aggregates(self) -> str:
        """How the node's run aggregates, in words."""
        return AGGREGATES[self.secure]

    def welcome_refusal(self, node: str, welcome) -> str | None:
        """Why ``node`` cannot take part in the run of ``welcome`` (a :class:`~fcl_emu.wire.messages.Welcome`), one
        that aggregates otherwise (None: it can). A check, not a branch of behaviour: the node ends in one line."""
        if welcome.secure == self.secure:
            return None
        return (f"{node} cannot take part in run {welcome.run_id}: the run {AGGREGATES[welcome.secure]}, but this "
                f"node was started {'with' if self.secure else 'without'} --secagg")

    def relayed_otherwise(self, client: str, number: int, request) -> str | None:
        """A train request (a :class:`~fcl_emu.wire.messages.TrainRequest`) asking for another kind of update than
        the run's (a relay changed it): what to log, once per client, before the run's own way holds (None: it asks
        for the run's)."""
        if request.secure == self.secure:
            return None
        return (f"{client}: round {number}: the train request asks for a {KIND[request.secure]} update; sending a "
                f"{KIND[self.secure]} one: the run {self.aggregates}, as this node was started")

    def refusal(self, what: str) -> str:
        """The detail of a client's ``secure_mismatch`` error for ``what`` it cannot do this way."""
        return f"refused {what}: the run {self.aggregates}, as this node was started"


class PlainRounds(RoundSecurity):
    """Plain updates; a SecAgg+ message (but an abort, which needs no answer) is refused, so no masked input is ever
    sent."""

    def __init__(self, send_update: Callable, refuse: Refuse):
        def refuse_secagg(client, msg) -> None:
            if msg.type != "secagg_abort":
                refuse(client, msg, f"a {msg.type}")
        super().__init__(send_update, refuse_secagg, lambda client, number: None)


class SecureRounds(RoundSecurity):
    """Masked inputs through the node's SecAgg+ sessions
    (:class:`~fcl_emu.edge_node.secure_session.SecureSessions`)."""

    secure = True

    def __init__(self, sessions):
        super().__init__(sessions.on_result, sessions.on_message, sessions.cannot_mask)


def round_security(secure: bool, *, send_update: Callable, refuse: Refuse,
                   sessions: Callable[[], Any]) -> RoundSecurity:
    """The node's way, chosen once: ``sessions()`` makes the SecAgg+ sessions of a secure node."""
    return SecureRounds(sessions()) if secure else PlainRounds(send_update, refuse)
