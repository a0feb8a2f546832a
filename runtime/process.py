"""A process's start: :func:`setup_process` before anything else, :func:`setup_logging`, :func:`exit_with_parent`
for a process that must not outlive the one that started it, :class:`ArgsError` for a bad value of one of its flags,
and :func:`fail` for the one error line it ends with."""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from fcl_emu.runtime.allocator import fix_malloc_thresholds

T = TypeVar("T")


def setup_process() -> None:
    """Before a process does anything: glibc's malloc thresholds fixed for torch's batch-sized temporaries, and
    ``kill -USR1 PID`` prints the stack of every thread of the process to its stderr (a run that seems stuck says
    where it waits, and goes on)."""
    fix_malloc_thresholds()
    if sys.__stderr__ is not None:  # the process's own stderr (a test runner may have replaced sys.stderr)
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def setup_logging(verbose: bool) -> None:
    """Log records to stderr: INFO and up with ``verbose``, else WARNING and up."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent(parent_pid: int) -> None:
    """End this process as soon as ``parent_pid`` is no longer its parent, even if the parent was SIGKILLed.

    So the edge nodes of a killed ``fcl-emu up`` do not live on beside the nodes that ``up --resume`` starts
    under the same client identities. On Linux the kernel sends SIGKILL when the parent dies
    (``prctl(PR_SET_PDEATHSIG)``, set here in the child, not in a ``preexec_fn``, which is unsafe in a parent
    with threads). SIGKILL, not SIGTERM: with its coordinator gone a node can be blocked in a send that a
    signal handler cannot end, and it has nothing to save (client stores are written atomically). Elsewhere
    a daemon thread polls ``os.getppid()`` twice a second. A parent already gone is caught at once.
    """
    watched = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            watched = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            watched = False
    if os.getppid() != parent_pid:
        os._exit(1)
    if not watched:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ArgsError(ValueError):
    """A bad value of the flag ``flag`` (the message says what is wrong and what would do)."""

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


def check(ok: bool, flag: str, message: str) -> None:
    """ArgsError for ``flag`` unless ``ok``."""
    if not ok:
        raise ArgsError(flag, message)


def check_metrics(port: int | None, linger: float) -> None:
    """The /metrics flags every process has: a TCP port, a linger of no less than 0 s."""
    check(port is None or 0 < port < 65536, "--metrics-port", f"{port} is not a TCP port (1-65535)")
    check(linger >= 0, "--metrics-linger", f"{linger:g} s: give 0 or more seconds")


def check_keys(server_key: Path | None, key: Path | None, insecure: bool) -> None:
    """The key flags of a process that connects to the coordinator: both, or neither with ``insecure``."""
    if insecure:
        check(server_key is None and key is None, "--insecure",
              "--insecure connects without keys: drop --server-key / --key")
    else:
        check(server_key is not None and key is not None, "--key",
              "the coordinator admits only known keys: give --server-key and --key (written by `fcl-emu keys`), "
              "or --insecure for a coordinator started with --insecure")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a mistake as the fcl-emu commands do: one line, ``error: PROG: what (see: PROG
    --help)``, exit 2 (argparse prints its whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see: {self.prog} --help)\n")


def parse_with(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               build: Callable[[argparse.Namespace], T]) -> T:
    """``build`` of ``argv`` parsed by ``parser``; a bad value, there or in ``build`` (ArgsError), is reported as
    ``parser`` reports one (:class:`OneLineParser`: one line naming the flag, exit 2)."""
    namespace = parser.parse_args(argv)
    try:
        return build(namespace)
    except ArgsError as exc:
        parser.error(f"argument {exc.flag}: {exc}")


def warn_insecure() -> None:
    """The warning of a process that connects without keys."""
    print("warning: --insecure: plain TCP, no authentication (docs/security.md)", file=sys.stderr, flush=True)


def fail(message: str) -> int:
    """Print ``error: message`` as the process's one last line (its launcher reports it) and return exit code 1."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1
