"""The coordinator's view of its clients: who joined, who is alive, who left.

A client is *online* from its join until it leaves, misses heartbeats for
``liveness_timeout_s``, or a send to it fails (its socket is gone). Any
message from a client counts as a sign of life. Dead and left clients can
join again under the same identity.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import Enum


class Status(str, Enum):
    ONLINE = "online"
    LEFT = "left"
    DEAD = "dead"
    RESUMED = "resumed"  # online at the checkpoint a resumed coordinator started from; not joined it yet


@dataclass
class ClientRecord:
    client_id: str
    index: int
    node: str
    join_task: int
    status: Status = Status.ONLINE
    last_seen: float = field(default_factory=time.monotonic)
    assets_task: int = -1  # task whose per-task assets this client holds
    rounds_trained: int = 0
    device_class: str | None = None  # its device profile's name (with a profiles file), drawn at join


@dataclass
class RegistryCounts:
    joined: int = 0
    rejoined: int = 0
    left: int = 0
    dropped: int = 0  # declared dead: missed heartbeats or unreachable


class ClientRegistry:
    def __init__(self, liveness_timeout_s: float):
        self.liveness_timeout_s = liveness_timeout_s
        self.records: dict[str, ClientRecord] = {}
        self.counts = RegistryCounts()
        # kept up to date on every change, so a metrics scrape (another thread) reads it without iterating
        self.online_count = 0
        self.awaiting_rejoin = 0  # records in Status.RESUMED

    def join(self, client_id: str, index: int, node: str, join_task: int, assets_task: int = -1) -> ClientRecord:
        """``assets_task``: the task whose assets the client says it still holds (-1: none; they are resent)."""
        record = self.records.get(client_id)
        if record is None:
            record = ClientRecord(client_id, index, node, join_task, assets_task=assets_task)
            self.records[client_id] = record
            self.counts.joined += 1
            self.online_count += 1
        else:
            if record.status is Status.RESUMED:  # back after a coordinator restart: not a rejoin of its own
                self.awaiting_rejoin -= 1
                self.online_count += 1
            elif record.status is not Status.ONLINE:
                self.counts.rejoined += 1
                self.online_count += 1
            record.status = Status.ONLINE
            record.assets_task = assets_task
            record.node = node
            record.last_seen = time.monotonic()
        return record

    def is_online(self, client_id: str) -> bool:
        record = self.records.get(client_id)
        return record is not None and record.status is Status.ONLINE

    def touch(self, client_id: str) -> None:
        self.records[client_id].last_seen = time.monotonic()

    def leave(self, client_id: str) -> bool:
        """Mark an online client as left; False if it was not online."""
        record = self.records[client_id]
        if record.status is Status.ONLINE:
            record.status = Status.LEFT
            self.counts.left += 1
            self.online_count -= 1
            return True
        return False

    def drop(self, client_id: str) -> bool:
        """Declare an online client dead; False if it is unknown or was not online."""
        record = self.records.get(client_id)
        if record is not None and record.status is Status.ONLINE:
            record.status = Status.DEAD
            self.counts.dropped += 1
            self.online_count -= 1
            return True
        return False

    def expire(self, now: float | None = None) -> list[str]:
        """Declare dead every online client silent for longer than the liveness timeout."""
        now = time.monotonic() if now is None else now
        dead = [r.client_id for r in self.records.values()
                if r.status is Status.ONLINE and now - r.last_seen > self.liveness_timeout_s]
        for client_id in dead:
            self.drop(client_id)
        return dead

    # --------------------------------------------------------------- checkpoints
    _FIELDS = ("client_id", "index", "node", "join_task", "status", "rounds_trained")

    def snapshot(self) -> dict:
        """JSON-able state for a checkpoint: the counts and every record (liveness times are not kept)."""
        return {"counts": asdict(self.counts), "fields": list(self._FIELDS),
                "records": [[getattr(r, f).value if f == "status" else getattr(r, f) for f in self._FIELDS]
                            for r in self.records.values()]}

    def restore(self, snapshot: dict) -> None:
        """Load :meth:`snapshot` into an empty registry: clients that were online are RESUMED until they
        join again (the next join re-sends the task's assets, as for any join)."""
        self.counts = RegistryCounts(**snapshot["counts"])
        fields = snapshot["fields"]
        for row in snapshot["records"]:
            values = dict(zip(fields, row))
            status = Status(values.pop("status"))
            record = ClientRecord(**values, status=Status.RESUMED if status is Status.ONLINE else status)
            self.records[record.client_id] = record
            self.awaiting_rejoin += record.status is Status.RESUMED

    def drop_resumed(self) -> list[str]:
        """Declare dead the clients that did not join the resumed coordinator."""
        gone = [r for r in self.records.values() if r.status is Status.RESUMED]
        for record in gone:
            record.status = Status.DEAD
            self.counts.dropped += 1
        self.awaiting_rejoin = 0
        return [r.client_id for r in gone]

    def online(self) -> list[ClientRecord]:
        return [r for r in self.records.values() if r.status is Status.ONLINE]

    def eligible(self, task: int) -> list[ClientRecord]:
        """Online clients whose scenario join task has come, in a stable order."""
        return sorted((r for r in self.online() if r.join_task <= task), key=lambda r: r.index)
