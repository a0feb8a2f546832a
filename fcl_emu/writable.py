"""Where a command writes, checked before it does any work: a directory it cannot write is one line, not a
traceback halfway through the work."""

from __future__ import annotations

import os
from pathlib import Path


class NotWritableError(Exception):
    """A directory a command would write into cannot be written (the message says which and why, in one line)."""


def check_writable(directory: Path) -> Path:
    """``directory`` if it is a writable directory or can be made (its nearest existing ancestor is a writable
    directory); else :class:`NotWritableError`. Nothing is made or written here."""
    directory = Path(directory)
    absolute = directory.absolute()
    existing = next(p for p in (absolute, *absolute.parents) if os.path.exists(p))
    if not existing.is_dir():
        reason = f"{existing} is not a directory"
    elif os.statvfs(existing).f_flag & os.ST_RDONLY:
        reason = f"{existing} is on a read-only file system"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = f"no permission to write in {existing}"
    else:
        return directory
    raise NotWritableError(f"cannot write to {directory}: {reason}")
