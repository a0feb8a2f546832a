"""Log lines about what peers send, bounded: every process that takes messages from peers it does not trust (the
coordinator, an edge aggregator) logs its refusals through :class:`LogOnce`, and shows a peer's own text (a name it
chose, a detail quoting what it sent) through :func:`shown`, so that however much a peer sends, the log keeps a
bounded number of lines, each short and free of raw bytes (docs/security.md)."""

from __future__ import annotations

import logging
import threading

MAX_LOGGED = 100  # log lines about refusals per reason in a run; then one line says the rest are only counted
MAX_BUDGETS = 64  # reasons with a budget of their own; refusals of any later reason share one more
MAX_SHOWN = 80  # characters of a peer's text that a log line shows


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """A peer's ``text`` as a log line may show it: quoted, every character outside printable ASCII escaped (no
    line breaks, no terminal sequences), the escaped text cut after ``limit`` characters with a mark saying how
    long the text was."""
    escaped = ascii(text)[1:-1]
    if len(escaped) <= limit:
        return f"'{escaped}'"
    return f"'{escaped[:limit].rstrip(chr(92))}'... ({len(text)} characters)"  # no backslash left to quote the quote


class LogOnce:
    """Log a refusal once per (peer, reason), at most ``limit`` lines per budget; a budget is the reason's own
    unless ``budget`` names a shared one (a reason holding text the peer chose, like a reported error code, must
    name one so that a peer cannot make budgets at will). ``counted_in`` names where the refusals not logged are
    still counted. Callable from any thread (refused handshakes are logged from the ZAP handler's)."""

    def __init__(self, log: logging.Logger, limit: int = MAX_LOGGED, max_budgets: int = MAX_BUDGETS,
                 counted_in: str = "fcl_wire_rejected_messages_total, fcl_refused_handshakes_total"):
        self.log, self.limit, self.max_budgets, self.counted_in = log, limit, max_budgets, counted_in
        self._seen: dict[str, set[tuple[str | None, str]]] = {}  # budget -> (peer, reason) logged
        self._lock = threading.Lock()

    def __call__(self, peer: str | None, reason: str, message: str, *, budget: str | None = None) -> None:
        budget = reason if budget is None else budget
        with self._lock:
            if budget not in self._seen and len(self._seen) >= self.max_budgets:
                budget = "other reasons"
            seen = self._seen.setdefault(budget, set())
            key = (peer, reason)
            if key in seen or len(seen) > self.limit:
                return
            seen.add(key)
            exhausted = len(seen) > self.limit
        if exhausted:
            self.log.warning("%d refusals logged for %s; further ones are only counted (%s)", self.limit, budget,
                             self.counted_in)
        else:
            self.log.warning("%s; further ones from this peer for this reason are only counted", message)
