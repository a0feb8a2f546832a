"""The on-disk cache of decoded datasets.

The decoded arrays of every layout are cached as ``.npy`` files under
``$FCL_EMU_CACHE_DIR`` (default ``~/.cache/fcl-emu``), keyed by the source
files' paths, sizes and modification times, and memory-mapped read-only from
there: a JPEG tree is decoded once, and the coordinator, the edge nodes and the
GPU workers of one host share one copy of a dataset's pages instead of each
holding its own (MNIST: 52 MB a process; a CIFAR-10 training set 150 MB). To
clear the cache, delete its directories; never edit its files in place (a
process mapping a truncated file faults).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fcl_emu.scenario.dataset_formats import DecodedArrays

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "FCL_EMU_CACHE_DIR"
_CACHE_FORMAT = 2  # bump when the cached arrays change meaning (2: .npy files, memory-mapped)


def cache_dir() -> Path:
    """Where decoded arrays are cached: ``$FCL_EMU_CACHE_DIR`` or ``~/.cache/fcl-emu``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or "~/.cache/fcl-emu").expanduser()


def cached(name: str, layout: str, sources: Sequence[Path], build: Callable[[], DecodedArrays]) -> DecodedArrays:
    """``build()``, memoised on disk under a key of the sources' paths, sizes and mtimes, and memory-mapped
    read-only from there: the processes of one host that load the dataset share one copy of its pages (the
    page cache) instead of each holding its own. Where the cache cannot be written the arrays stay in memory."""
    stats = [(str(p.resolve()), (st := p.stat()).st_size, st.st_mtime_ns) for p in sources]
    key = hashlib.sha256(json.dumps([_CACHE_FORMAT, name, layout, stats]).encode()).hexdigest()[:24]
    path = cache_dir() / f"{name}-{layout}-{key}"
    if path.is_dir():
        try:
            return _read_cache(path)
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable dataset cache %s (%s)", path, e)
    arrays = build()
    try:
        _write_cache(path, arrays)
        return _read_cache(path)
    except (OSError, ValueError) as e:
        log.warning("could not write dataset cache %s (%s)", path, e)
        return arrays


def _read_cache(path: Path) -> DecodedArrays:
    names = json.loads((path / "class_names.json").read_text())
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("class_names.json is not a list of names")
    arrays = [np.load(path / f"{field}.npy", mmap_mode="r", allow_pickle=False)
              for field in DecodedArrays._fields[:4]]
    return DecodedArrays(*arrays, tuple(names))


def _write_cache(path: Path, arrays: DecodedArrays) -> None:
    """One ``.npy`` per array and the class names, written beside ``path`` and renamed into place: a reader
    sees no cache or a whole one. Files are never rewritten in place (a process mapping them would fault);
    an unreadable cache is unlinked and replaced, a whole one written meanwhile by another process kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        for field in DecodedArrays._fields[:4]:
            np.save(tmp / f"{field}.npy", getattr(arrays, field), allow_pickle=False)
        (tmp / "class_names.json").write_text(json.dumps(list(arrays.class_names)))
        tmp.chmod(0o755)
        try:
            os.rename(tmp, path)
        except OSError:  # the directory is there
            try:
                _read_cache(path)
            except (OSError, ValueError):
                shutil.rmtree(path, ignore_errors=True)
                os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
