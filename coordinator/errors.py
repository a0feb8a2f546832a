"""Why a run ends early (the command line turns each into one line and an exit code)."""


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


class BindError(RuntimeError):
    """The coordinator cannot bind its address (in use, or not an address of this host)."""
