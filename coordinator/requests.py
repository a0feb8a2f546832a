"""Sending a round's requests (:class:`RoundRequests`): what both the synchronous round and each wave of an
asynchronous policy send their selected clients."""

from __future__ import annotations

from fcl_emu.coordinator.clock import RunClock
from fcl_emu.coordinator.collection import Collection
from fcl_emu.coordinator.dispatch import Dispatcher
from fcl_emu.coordinator.open_round import OpenRound
from fcl_emu.coordinator.state import RunState
from fcl_emu.wire.framing import WireTensors, wire_tensors
from fcl_emu.wire.messages import ASSET_TYPES, TaskAsset, TaskStart, TrainRequest


class RoundRequests:
    """Each selected client of a round gets the task's start and the method's assets (once per task), the message
    its collection needs first (a ``secagg_setup``), then its ``train_request`` with the round's tensors; the clock
    notes what each was sent. Then the clients whose update can no longer count are cancelled, and the progress
    hook hears ``dispatched``."""

    def __init__(self, state: RunState, dispatcher: Dispatcher, clock: RunClock, collection: Collection):
        self.state, self.registry = state, state.registry
        self.dispatcher, self.clock, self.collection = dispatcher, clock, collection

    def send(self, r: OpenRound, task_round: int, progress_round: int | None = None) -> None:
        """Send round ``r``'s requests to ``r.selected`` in selection order. ``progress_round``: the round number
        the progress event names (an asynchronous wave's own number is not the aggregation's)."""
        state, task = self.state, r.task
        chosen = [c for c in r.chosen if c in r.selected]
        assets = state.server.task_assets(task) if any(
            self.registry.records[c].assets_task != task for c in chosen) else {}
        unknown = set(assets) - set(ASSET_TYPES)
        if unknown:
            raise ValueError(f"method {state.spec.name!r} returned task assets of unknown kinds "
                             f"{sorted(unknown)}; the wire knows {', '.join(ASSET_TYPES)}")
        assets = {kind: wire_tensors(tensors) for kind, tensors in assets.items()}  # made ready once, sent to many
        payload = wire_tensors(state.server.round_tensors(task, r.number))
        seen = [int(c) for c in state.scenario.seen_classes(task)]
        classes = [int(c) for c in state.scenario.task_classes(task)]
        lr = state.server.learning_rate(task, task_round, state.config.training.lr)
        request = TrainRequest(local_epochs=state.config.training.local_epochs, lr=lr,
                               secure=self.collection.masked)
        for client_id in chosen:
            record = self.registry.records[client_id]
            sent = 0
            if record.assets_task != task:
                sent = self._send_task_start(client_id, task, r.number, classes, seen, assets, record.restarted)
                if not sent:
                    continue
                record.assets_task, record.restarted = task, False
            setup = self.collection.setup(client_id)
            setup_bytes = 0 if setup is None else self.dispatcher.send(client_id, *setup, task=task, round=r.number)
            if setup is not None and not setup_bytes:
                continue
            sent_request = self.dispatcher.send(client_id, "train_request", request, task=task, round=r.number,
                                                tensors=payload)
            if sent_request:
                self.clock.dispatched(r, client_id, record.profile, sent + setup_bytes + sent_request)
        self.dispatcher.cancel(r, self.clock.hopeless(r))
        state.progress("dispatched", {"task": task, "round": progress_round or r.number, "selected": len(chosen)})

    def _send_task_start(self, client_id: str, task: int, number: int, classes: list[int], seen: list[int],
                         assets: dict[str, WireTensors], restart: bool) -> int:
        """``task_start``, then one message per kind of the method's per-task assets (wire.ASSET_TYPES). Returns
        the bytes sent, 0 if the client is gone."""
        sent = self.dispatcher.send(client_id, "task_start",
                                    TaskStart(classes=classes, seen_classes=seen, restart=restart),
                                    task=task, round=number)
        for kind, tensors in assets.items() if sent else ():
            n = self.dispatcher.send(client_id, kind, TaskAsset(), task=task, round=number, tensors=tensors)
            if not n:
                return 0
            sent += n
        return sent
