"""Why a run ends early (the command line turns each into one line and an exit code)."""


class RunAborted(RuntimeError):
    """The run cannot go on (for example: not enough clients joined)."""


class JobFailed(RunAborted):
    """A server-side job failed after its retries: the run ends cleanly with the job's errors."""


class BindError(RuntimeError):
    """The coordinator cannot bind its address (in use, or not an address of this host)."""
