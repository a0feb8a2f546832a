"""The coordinator's view of its clients: who joined, who is alive, who left.

A client is *connected* from its join until it leaves, misses heartbeats for
``liveness_timeout_s``, or a send to it fails (its socket is gone). Any
message from a client counts as a sign of life. Dead and left clients can
join again under the same identity. Under the emulated clock a connected
client can also be *away* (its availability model has it off, or it crashed
in emulated time: coordinator/emulated.py) while its process stays
connected. *Online* means connected and not away: only online clients are
counted online and selected.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import Enum

from fcl_emu.scenario.devices import DeviceProfile


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
    profile: DeviceProfile = field(default_factory=DeviceProfile)  # drawn at join
    away: bool = False  # emulated clock: off or crashed in emulated time (its process stays connected)
    restarted: bool = False  # emulated clock: crashed since its last task start (the next one says so)
    low_battery: bool = False  # emulated clock: below edge.min_battery, it sits rounds out (coordinator/energy.py)

    @property
    def online(self) -> bool:
        return self.status is Status.ONLINE and not self.away


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
        self._changes = 0  # counts every change of who is eligible: the eligible list is kept until the next one
        self._eligible: tuple[int, int, list[ClientRecord]] | None = None  # (task, changes, list)

    def join(self, client_id: str, index: int, node: str, join_task: int, assets_task: int = -1) -> ClientRecord:
        """``assets_task``: the task whose assets the client says it still holds (-1: none; they are resent)."""
        record = self.records.get(client_id)
        if record is None:
            record = ClientRecord(client_id, index, node, join_task, assets_task=assets_task)
            self.records[client_id] = record
            self.counts.joined += 1
            self.online_count += 1
            self._changes += 1
            return record
        was_online = record.online
        if record.status is Status.RESUMED:  # back after a coordinator restart: not a rejoin of its own
            self.awaiting_rejoin -= 1
        elif record.status is not Status.ONLINE and not record.away:
            self.counts.rejoined += 1
        record.status = Status.ONLINE
        record.assets_task = assets_task
        record.node = node
        record.last_seen = time.monotonic()
        self.online_count += record.online - was_online
        self._changes += 1
        return record

    def is_online(self, client_id: str) -> bool:
        """Connected (joined, not left, not dead); it may be away on the emulated clock."""
        record = self.records.get(client_id)
        return record is not None and record.status is Status.ONLINE

    def touch(self, client_id: str) -> None:
        record = self.records[client_id]
        record.last_seen = time.monotonic()

    def _set_status(self, record: ClientRecord, status: Status) -> None:
        self.online_count -= record.online
        record.status = status
        self._changes += 1

    def leave(self, client_id: str) -> bool:
        """Mark a connected client as left; False if it was not connected."""
        record = self.records[client_id]
        if record.status is Status.ONLINE:
            self.counts.left += not record.away
            self._set_status(record, Status.LEFT)
            return True
        return False

    def drop(self, client_id: str) -> bool:
        """Declare a connected client dead; False if it is unknown or was not connected."""
        record = self.records.get(client_id)
        if record is not None and record.status is Status.ONLINE:
            self.counts.dropped += not record.away
            self._set_status(record, Status.DEAD)
            return True
        return False

    def set_away(self, client_id: str, away: bool, *, crashed: bool = False) -> bool:
        """Emulated clock: the client goes away (counted as left, or dropped if it crashed) or comes back
        (counted as a rejoin). False if nothing changed."""
        record = self.records[client_id]
        if record.away == away:
            return False
        was_online = record.online
        record.away = away
        self._changes += 1
        if record.status is Status.ONLINE:
            if away:
                self.counts.dropped += crashed
                self.counts.left += not crashed
            else:
                self.counts.rejoined += 1
        self.online_count += record.online - was_online
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Declare dead every online client silent for longer than the liveness timeout (its join counts as
        heard: its node heartbeats while it sets the run up)."""
        now = time.monotonic() if now is None else now
        dead = [r.client_id for r in self.records.values() if r.status is Status.ONLINE
                and now - r.last_seen > self.liveness_timeout_s]
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
        self._changes += 1

    def drop_awaited(self, client_id: str) -> bool:
        """After a resume: declare dead a client awaited to join again (one whose node exited); False if it was not
        awaited."""
        record = self.records.get(client_id)
        if record is None or record.status is not Status.RESUMED:
            return False
        record.status = Status.DEAD
        self.counts.dropped += 1
        self.awaiting_rejoin -= 1
        self._changes += 1
        return True

    def drop_resumed(self) -> list[str]:
        """Declare dead the clients that did not join the resumed coordinator."""
        gone = [r.client_id for r in self.records.values() if r.status is Status.RESUMED]
        for client_id in gone:
            self.drop_awaited(client_id)
        return gone

    def connected(self) -> list[ClientRecord]:
        return [r for r in self.records.values() if r.status is Status.ONLINE]

    def online(self) -> list[ClientRecord]:
        return [r for r in self.records.values() if r.online]

    def set_low_battery(self, client_id: str, low: bool) -> None:
        """Emulated clock: the client's battery is below ``edge.min_battery`` (it sits rounds out) or back above."""
        record = self.records[client_id]
        if record.low_battery != low:
            record.low_battery = low
            self._changes += 1

    def eligible(self, task: int) -> list[ClientRecord]:
        """Online clients whose scenario join task has come and whose battery lets them take part, in index order
        (not to be changed: the list is kept until the registry changes, as a round at 100,000 clients cannot
        afford to sort them all again)."""
        cached = self._eligible
        if cached is None or cached[:2] != (task, self._changes):
            chosen = sorted((r for r in self.online() if r.join_task <= task and not r.low_battery),
                            key=lambda r: r.index)
            cached = self._eligible = (task, self._changes, chosen)
        return cached[2]
