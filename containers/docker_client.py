"""The Docker engine a run talks to: one place that connects and says clearly why it cannot.

Everything container-related goes through the ``docker`` SDK for Python (the engine's own HTTP API), so a
remote engine (``DOCKER_HOST``) works the same as the local socket.
"""

from __future__ import annotations

import functools


class EngineError(RuntimeError):
    """No Docker engine answers, or it refused what was asked (the message says which, in one line)."""


@functools.lru_cache(maxsize=1)
def client():
    """A connected ``docker.DockerClient`` (from the environment: ``DOCKER_HOST`` or the local socket).

    Raises :class:`EngineError` when the SDK is missing or no engine answers.
    """
    try:
        import docker
    except ImportError:
        raise EngineError("the docker SDK for Python is not installed (pip install docker)") from None
    try:
        engine = docker.from_env(timeout=120)
        engine.ping()
    except docker.errors.DockerException as exc:
        raise EngineError(f"no Docker engine answers ({exc}); start one (`dockerd &` as root, or "
                          "`systemctl start docker`) or point DOCKER_HOST at one") from None
    return engine


def available() -> str | None:
    """``None`` when an engine answers, else the reason it does not (for tests that skip)."""
    try:
        client()
    except EngineError as exc:
        client.cache_clear()
        return str(exc)
    return None
