"""A run's log file, and the console kept free of the warnings that only repeat what the run's status says.

:func:`run_log` writes every log record of the process to ``RUN_DIR/logs/coordinator.log`` while the run runs,
Python warnings included (numpy's and torch's ``RuntimeWarning``: ``logging.captureWarnings``), and keeps off
the console (the handlers already on the root logger) the records that only count there: the warnings of the
libraries (a logger outside ``fcl_emu``, below ERROR: dp-accounting's absl "failed to converge", the captured
Python warnings) and the clients' reports that their training loss became NaN or infinite. Those are counted;
:meth:`RunLog.summary` says how many in one line.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOG_NAME = "coordinator.log"
NONFINITE_LOSS = re.compile(r"loss became (?:nan|-?inf)\b")  # in a client's report of a failed training
# what a record kept off the console is: (one, several)
KINDS = {"library": ("library warning", "library warnings"),
         "loss": ("report of a NaN or infinite training loss", "reports of a NaN or infinite training loss")}


def kept_off_console(record: logging.LogRecord) -> str | None:
    """What a record that stays off the console is (a key of :data:`KINDS`), or None."""
    if record.levelno >= logging.ERROR:
        return None
    if record.name != "fcl_emu" and not record.name.startswith("fcl_emu."):
        return "library"
    if NONFINITE_LOSS.search(record.getMessage()):
        return "loss"
    return None


class RunLog:
    """What the run's log keeps off the console: :meth:`shown` filters the console's handlers, :meth:`count`
    counts on the log file's handler (every record once) what :func:`kept_off_console` names."""

    def __init__(self, path: Path):
        self.path, self.counts = path, Counter()

    @staticmethod
    def shown(record: logging.LogRecord) -> bool:
        return kept_off_console(record) is None

    def count(self, record: logging.LogRecord) -> bool:
        kind = kept_off_console(record)
        if kind is not None:
            self.counts[kind] += 1
        return True

    def summary(self) -> str | None:
        """One line on what was kept off the console, or None if nothing was."""
        if not self.counts:
            return None
        parts = [f"{n} {KINDS[kind][n > 1]}" for kind, n in sorted(self.counts.items())]
        return f"kept off the console, in {self.path}: {' and '.join(parts)}"


@contextmanager
def run_log(path: Path) -> Iterator[RunLog]:
    """Log to ``path`` and keep the console to the run's own lines (the module docstring) inside the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    console = list(root.handlers)
    log = RunLog(path)
    file = logging.FileHandler(path, encoding="utf-8")
    file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    file.addFilter(log.count)
    for handler in console:
        handler.addFilter(log.shown)
    root.addHandler(file)
    logging.captureWarnings(True)
    try:
        yield log
    finally:
        logging.captureWarnings(False)
        root.removeHandler(file)
        file.close()
        for handler in console:
            handler.removeFilter(log.shown)
