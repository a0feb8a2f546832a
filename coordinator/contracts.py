"""What the command line, the launchers and the benches take from the coordinator without reaching into its parts:
why a run ends early (the command line turns each into one line and an exit code), a checkpoint that cannot be
used, and an edge node's exit as a launcher reports it (:class:`NodeExit`, which the coordinator's node watch
handles)."""

from __future__ import annotations

from dataclasses import dataclass


class RunAborted(RuntimeError):
    """The run cannot go on (for example: not enough clients joined)."""


class JobFailed(RunAborted):
    """A server-side job failed after its retries: the run ends cleanly with the job's errors."""


class Diverged(RuntimeError):
    """A DP run's model diverged and ``privacy.on_divergence`` is ``stop``: the run ends ``failed: diverged ...``
    after that round, without its checkpoint."""


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (SIGINT: Ctrl-C; SIGTERM: ``timeout``, Slurm, systemd, ``docker stop``).
    ``exit_code`` is the shell's convention, 128 + the signal's number."""

    def __init__(self, signal_name: str, exit_code: int):
        super().__init__(signal_name)
        self.signal_name, self.exit_code = signal_name, exit_code


class CheckpointError(Exception):
    """No usable checkpoint: missing, unreadable, corrupt, or of another format (coordinator/checkpoint.py)."""


class BindError(RuntimeError):
    """The coordinator cannot bind its address (in use, or not an address of this host)."""


@dataclass(frozen=True)
class NodeExit:
    """An edge node that has ended: its name, exit code, how many clients it hosted, its last error line; ``seq``
    counts the node's exits (a restarted container can end again) and ``back`` says it has started again since."""

    name: str
    code: int
    clients: int
    last_error: str
    seq: int = 0
    back: bool = False
    cut_off: tuple[str, ...] = ()  # an edge aggregator's: the edge nodes whose clients reached the run through it

    def describe(self) -> str:
        if self.cut_off:
            return (f"{self.name} exited with code {self.code}: {self.last_error or '(its log is empty)'}; the "
                    f"clients of {', '.join(self.cut_off)} are cut off")
        return f"edge node {self.name} exited with code {self.code}: {self.last_error or '(its log is empty)'}"
