"""Edge-node processes forked from a pre-loaded copy of ``fcl-emu up`` (a zygote), not started afresh.

An edge node started with ``python -m fcl_emu.edge_node`` spends its first seconds importing torch and the
project, and then holds about 160 MB of memory of its own for that (the relocated libraries and the modules'
objects): two thirds of an idle node. ``up`` forks one zygote process right after importing what a node
needs and before it starts any thread, socket or torch computation; the zygote forks every edge node. The
nodes start at once, and the imported pages stay shared copy-on-write between ``up``, the zygote and all the
nodes (measured: four forked processes 182 MB of proportional set size in all, one process started afresh
168 MB). A node is still a process of its own, with its own sockets, log, exit status and death signal.

Only a process that has not yet run a thread, a ZeroMQ context or a torch computation may fork the zygote
(:func:`start` checks the threads; ``fcl-emu up`` calls it first thing): a fork copies one thread only, so a
lock held by another thread, or OpenMP's thread pool, would be broken in the child. Where there is no
zygote (``run_local`` called from a program that has already done those), :class:`ProcessLauncher` starts
nodes with ``python -m fcl_emu.edge_node`` as before.

The zygote answers :meth:`Zygote.spawn` requests (a node's :class:`~fcl_emu.edge_node.args.NodeArgs`, its log and
environment) over a pipe with the new pid; the node runs :func:`fcl_emu.edge_node.args.run_node` under the title
``fcl-emu node FLAGS`` (what ``ps`` shows, the same flags as ``python -m fcl_emu.edge_node``). The zygote reaps its
children and reports their exit statuses on the same pipe; :class:`ForkedProcess` gives ``up`` the
:class:`subprocess.Popen` methods it uses (``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``).
The zygote ends when ``up`` closes it or dies (its death signal), and a node when the zygote does.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from fcl_emu.edge_node.args import NodeArgs, run_node
from fcl_emu.runtime.process import exit_with_parent, setup_process

# what an edge node imports: loaded once in ``up``, shared by every node
PRELOAD = ("torch", "zmq", "fcl_emu.edge_node.node", "fcl_emu.edge_node.args", "fcl_emu.methods",
           "fcl_emu.wire.sockets")


class ZygoteGone(RuntimeError):
    """The zygote process is no longer there (killed, or closed)."""


class Zygote:
    """The parent's handle on its zygote process (one per ``up``)."""

    def __init__(self, pid: int, conn: multiprocessing.connection.Connection):
        self.pid = pid
        self._conn = conn
        self._lock = threading.Lock()  # the coordinator's node watch and ``up``'s main thread both ask
        self._exits: dict[int, int] = {}
        self._alive = True

    def spawn(self, args: NodeArgs, log: Path, env: dict[str, str]) -> ForkedProcess:
        """Fork an edge node running with ``args``, its output appended to ``log``, ``env`` added to its
        environment."""
        with self._lock:
            if not self._alive:
                raise ZygoteGone("the zygote process is gone; cannot start an edge node")
            try:
                self._conn.send((args, str(log), dict(env)))
                while True:
                    message = self._conn.recv()
                    if message[0] == "spawned":
                        return ForkedProcess(self, message[1], node_title(args))
                    self._record(message)
            except (EOFError, OSError):
                self._alive = False
                raise ZygoteGone("the zygote process died while starting an edge node") from None

    def returncode(self, pid: int, timeout: float = 0.0) -> int | None:
        """``pid``'s exit code once the zygote reported it (negative: the signal that ended it), else None;
        waits up to ``timeout`` seconds for it. With the zygote gone its children are gone too (their death
        signal): -SIGKILL."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits and self._alive:
                try:
                    if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                        break
                    self._record(self._conn.recv())
                except (EOFError, OSError):
                    self._alive = False
            if pid not in self._exits and not self._alive:
                return -signal.SIGKILL
            return self._exits.get(pid)

    def _record(self, message: tuple) -> None:
        if message[0] == "exited":
            self._exits[message[1]] = message[2]

    def close(self) -> None:
        """End the zygote (its remaining children end with it) and reap it; a later :func:`start` forks a new
        one."""
        global _current
        if _current is self:
            _current = None
        with self._lock:
            if self._alive:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
                self._alive = False
            self._conn.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


class ForkedProcess:
    """A process forked by the zygote, with the part of :class:`subprocess.Popen` that launchers use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args

    @property
    def returncode(self) -> int | None:
        return self.zygote.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            code = self.zygote.returncode(self.pid, timeout=max(0.0, min(left, 1.0)))
            if code is not None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_current: Zygote | None = None


def current() -> Zygote | None:
    """This process's zygote, if :func:`start` forked one."""
    return _current


def start() -> Zygote | None:
    """Import what an edge node needs and fork the zygote; None (nodes will be started afresh) if this
    process already runs other threads, where a fork is unsafe."""
    global _current
    if _current is not None:
        return _current
    if threading.active_count() > 1:
        return None
    for module in PRELOAD:
        importlib.import_module(module)
    parent_pid = os.getpid()
    ours, theirs = multiprocessing.Pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # the imported objects stay out of every later collection: their pages stay shared
    pid = os.fork()
    if pid == 0:
        ours.close()
        _serve(theirs, parent_pid)  # never returns
    theirs.close()
    _current = Zygote(pid, ours)
    return _current


def _serve(conn: multiprocessing.connection.Connection, parent_pid: int) -> None:
    """The zygote's loop: fork a node per request, report each child's exit; end with ``up``."""
    code = 0
    try:
        import setproctitle

        setproctitle.setproctitle(f"fcl-emu zygote (forks the edge nodes of fcl-emu up, pid {parent_pid})")
        exit_with_parent(parent_pid)
        zygote_pid = os.getpid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is ``up``'s to handle; the nodes still get it
        children: set[int] = set()
        while True:
            if conn.poll(0.05):
                request = conn.recv()
                if request is None:
                    break
                child = os.fork()
                if child == 0:
                    _run_child(conn, zygote_pid, *request)  # never returns
                children.add(child)
                conn.send(("spawned", child))
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))
    except (EOFError, OSError):  # ``up`` is gone
        code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(code)


def node_title(args: NodeArgs) -> list[str]:
    """The command line a forked node shows (not ``up``'s, which it inherits): the command that runs it."""
    return ["fcl-emu", "node", *args.to_argv()]


def _run_child(conn: multiprocessing.connection.Connection, zygote_pid: int, args: NodeArgs, log: str,
               env: dict[str, str]) -> None:
    """In a freshly forked node: ends with the zygote, output to ``log``, default signals, then the node of
    ``args``; exits with its code."""
    code = 1
    try:
        conn.close()
        exit_with_parent(zygote_pid)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.update(env)
        import logging

        import setproctitle
        import torch

        setproctitle.setproctitle(" ".join(node_title(args)))
        setup_process()  # its stack dumps go to its own log
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        logging.root.handlers.clear()  # ``up``'s handlers: the node sets up its own
        code = run_node(args)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
