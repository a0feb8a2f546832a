"""Per-client persistent storage and the node's shared asset cache.

An idle emulated client must cost little memory, so anything model-sized a
client keeps between rounds (its own previous model, a Fisher matrix...) is
written to its :class:`ArrayStore`, a directory on the node's disk, like a
device's flash. Per-task assets are identical for every client of a task;
:class:`AssetCache` keeps one copy per distinct content on the node.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class ArrayStore:
    """Named groups of arrays in one directory, written atomically."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, name: str) -> Path:
        if not _NAME.match(name):
            raise ValueError(f"store name {name!r}: use letters, digits, '_', '.', '-'")
        return self.root / f"{name}.npz"

    def save(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self._path(name)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **{k.replace("/", "|"): np.asarray(v) for k, v in arrays.items()})
        os.replace(tmp, path)

    def load(self, name: str) -> dict[str, np.ndarray] | None:
        path = self._path(name)
        if not path.exists():
            return None
        with np.load(path, allow_pickle=False) as data:
            return {k.replace("|", "/"): data[k] for k in data.files}

    def has(self, name: str) -> bool:
        return self._path(name).exists()

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` hold the same values: at once for two views of one buffer (the tensors a shared
    connection holds for all its clients, docs/wire.md), else compared value by value."""
    if (a.shape == b.shape and a.dtype == b.dtype and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]):
        return True
    return np.array_equal(a, b)


class AssetCache:
    """Deduplicates received assets by content: equal arrays share one copy."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str, tuple[int, ...]], list[np.ndarray]] = {}

    def intern(self, name: str, array: np.ndarray) -> np.ndarray:
        key = (name, array.dtype.str, array.shape)
        bucket = self._by_key.setdefault(key, [])
        for known in bucket:
            if same_values(known, array):
                return known
        bucket.append(array)
        return array

    def intern_all(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: self.intern(k, v) for k, v in arrays.items()}

    def retain(self, live: list[Mapping[str, np.ndarray]]) -> None:
        """Forget cached arrays no client refers to any more."""
        keep = {id(a) for assets in live for a in assets.values()}
        for key, bucket in list(self._by_key.items()):
            bucket[:] = [a for a in bucket if id(a) in keep]
            if not bucket:
                del self._by_key[key]


class RoundPayloads:
    """One node-wide copy of the global model per round.

    Every train request of a round usually carries the same model; a node
    whose clients queue for the trainer would otherwise hold one received copy
    per queued client. Payloads equal to the round's first are replaced by it
    (the duplicate frames are freed at once); a payload that differs (a
    personalised model) is kept as it is. Thread-safe: the I/O thread
    acquires, the trainer thread releases.
    """

    def __init__(self) -> None:
        self._rounds: dict[int, list] = {}  # round -> [tensors, users]
        self._lock = threading.Lock()

    def acquire(self, round: int, tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        with self._lock:
            entry = self._rounds.get(round)
            if entry is None:
                self._rounds[round] = [tensors, 1]
                return tensors
            shared = entry[0]
        same = shared.keys() == tensors.keys() and all(same_values(shared[k], v) for k, v in tensors.items())
        with self._lock:
            entry = self._rounds.get(round)
            if same and entry is not None and entry[0] is shared:
                entry[1] += 1
                return shared
            return tensors

    def release(self, round: int, tensors: Mapping[str, np.ndarray]) -> None:
        with self._lock:
            entry = self._rounds.get(round)
            if entry is not None and entry[0] is tensors:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._rounds[round]
