"""Saving and loading a coordinator checkpoint atomically (docs/resume.md).

A checkpoint is a directory holding two files:

- ``state.json``: everything that is not an array (JSON), and the name, size,
  SHA-256 and array names of
- ``arrays-<id>.npz``: the arrays, written with :func:`numpy.savez` as
  ``a0``, ``a1``, ... in the order ``state.json`` names them; read back with
  ``allow_pickle=False``. Nothing is ever pickled.

A save writes a new arrays file under a fresh name, fsyncs it, then writes
``state.json.tmp``, fsyncs it and renames it over ``state.json`` (``os.replace``
is atomic on POSIX and Windows); the rename is the commit. Only then are the
older arrays files removed. A crash at any point leaves either the previous
checkpoint or the new one, both complete; leftovers of an interrupted save are
removed by the next one. A save that fails (a full disk, say) removes what it
wrote before raising its :class:`OSError`, which names the file it was writing.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fcl_emu.coordinator.contracts import CheckpointError

FORMAT = 1
STATE = "state.json"
_ARRAYS_GLOB = "arrays-*.npz"


@dataclass
class Checkpoint:
    state: dict[str, Any]
    arrays: dict[str, np.ndarray]


def exists(directory: Path) -> bool:
    return (Path(directory) / STATE).is_file()


def save(directory: Path, state: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> int:
    """Replace the checkpoint in ``directory`` by ``state`` + ``arrays``; returns the bytes written.

    ``state`` must be JSON-serialisable; its key ``"arrays"`` is reserved.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = list(arrays)
    npz = directory / f"arrays-{uuid.uuid4().hex[:12]}.npz"
    tmp = directory / (STATE + ".tmp")
    writing = npz
    try:
        with open(npz, "wb") as f:
            np.savez(f, **{f"a{i}": np.asarray(arrays[name]) for i, name in enumerate(names)})
            f.flush()
            os.fsync(f.fileno())
        size, digest = _digest(npz)
        doc = dict(state, format=FORMAT, arrays={"file": npz.name, "bytes": size, "sha256": digest, "names": names})
        text = json.dumps(doc, separators=(",", ":"))
        writing = tmp
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / STATE)
    except OSError as exc:  # a full disk, say: the previous checkpoint stays, and so does the space it had
        npz.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
        exc.filename = exc.filename or str(writing)
        raise
    _fsync_dir(directory)
    for stale in directory.glob(_ARRAYS_GLOB):
        if stale != npz:
            stale.unlink(missing_ok=True)
    return size + len(text)


def load(directory: Path) -> Checkpoint:
    """The checkpoint in ``directory``; :class:`CheckpointError` says what is wrong with it."""
    directory = Path(directory)
    path = directory / STATE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint ({path} does not exist)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    try:
        state = json.loads(text)
        meta = state["arrays"]
        file, size, digest, names = meta["file"], meta["bytes"], meta["sha256"], list(meta["names"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"corrupt checkpoint: {path} is not a checkpoint state file") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {state.get('format')!r}; this version reads {FORMAT}")
    npz = directory / Path(str(file)).name
    try:
        got_size, got_digest = _digest(npz)
    except OSError as exc:
        raise CheckpointError(f"corrupt checkpoint: cannot read its arrays {npz}: {exc.strerror or exc}") from None
    if (got_size, got_digest) != (size, digest):
        raise CheckpointError(f"corrupt checkpoint: {npz} does not match {path} (size or SHA-256 differs)")
    try:
        with np.load(npz, allow_pickle=False) as data:
            arrays = {name: data[f"a{i}"] for i, name in enumerate(names)}
    except Exception as exc:  # zipfile, numpy format and key errors
        raise CheckpointError(f"corrupt checkpoint: cannot load {npz}: {exc}") from None
    return Checkpoint(state, arrays)


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
