"""The one image of a containerised run, built offline: coordinator, edge nodes, GPU workers and Prometheus.

No registry is needed (or reachable on many research clusters). The image is made in two steps:

1. **Base**: a Debian root file system from Debian's own packages (``mmdebstrap``: Python 3, venv,
   iproute2 for ``tc`` link caps, Prometheus), imported with ``docker import`` as
   ``fcl-emu-base:<hash of the package list>``. Made once per host.
2. **Image**: the project and its runtime dependencies as wheels fetched *on the host* (``pip download`` of the
   project's wheel, with every dependency pinned to the version this host runs, so containers and host
   processes compute the same thing), installed into a virtual environment in a build stage (``pip install
   --no-index``: the build needs no network and no certificates), and copied into the base. Tagged
   ``fcl-emu:<hash>``, the hash taken over the base, the Dockerfile and every wheel's *contents* (its zip
   directory: names, sizes and CRCs, not timestamps), so an unchanged tree reuses the image at once and any
   change to code or a dependency makes a new one. ``fcl-emu:latest`` points at the newest.

The image reaches other hosts without a registry with ``docker save fcl-emu:<hash> | ssh HOST docker load``
(docs/containers.md), or through a registry the user runs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fcl_emu.containers.docker_client import EngineError, client

REPOSITORY = "fcl-emu"
BASE_REPOSITORY = "fcl-emu-base"
SUITE = "bookworm"
#: Debian packages of the base: the interpreter (bookworm's 3.11, which the wheels are fetched for), ``tc``
#: for kernel uplink caps, ``prometheus`` for the stack's Prometheus service.
BASE_PACKAGES = ("python3", "python3-venv", "iproute2", "prometheus", "ca-certificates")
PYTHON_VERSION = "3.11"
VENV = "/opt/fcl-emu"
PROJECT = "fcl-emu"

DOCKERFILE = f"""\
FROM {{base}} AS build
LABEL fcl-emu.stage=build
COPY wheels /wheels
RUN python3 -m venv {VENV} && {VENV}/bin/pip install --quiet --no-index --no-cache-dir --find-links /wheels {PROJECT}

FROM {{base}}
COPY --from=build {VENV} {VENV}
ENV PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
LABEL org.opencontainers.image.title="fcl-emu" fcl-emu.content="{{content}}"
ENTRYPOINT ["fcl-emu"]
"""


class ImageError(RuntimeError):
    """The image cannot be built here (the message names the missing tool or the failing step)."""


@dataclass(frozen=True)
class ImageBuild:
    """The outcome of :func:`build_image`."""

    tag: str
    base: str
    size_bytes: int
    seconds: float
    reused: bool


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:12]


def _exists(tag: str) -> bool:
    import docker

    try:
        client().images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def base_image(log: Callable[[str], None] = print) -> str:
    """The tag of the Debian base image, made with mmdebstrap and imported if this engine lacks it."""
    tag = f"{BASE_REPOSITORY}:{_digest(SUITE, *BASE_PACKAGES)}"
    if _exists(tag):
        return tag
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is not installed; it makes the base image offline from Debian's packages "
                         "(apt-get install mmdebstrap)")
    with tempfile.TemporaryDirectory(prefix="fcl-emu-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        log(f"making the base file system ({SUITE}: {', '.join(BASE_PACKAGES)}) with mmdebstrap")
        command = ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                   "--aptopt=APT::Install-Recommends \"false\"",
                   "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                   "--dpkgopt=path-exclude=/usr/share/locale/*", SUITE, str(rootfs)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ImageError(f"mmdebstrap failed (exit {done.returncode}): {tail[0]}")
        repository, version = tag.split(":")
        client().api.import_image_from_file(str(rootfs), repository=repository, tag=version)
    return tag


def project_root() -> Path:
    """The source tree this fcl-emu runs from (the image is built from it)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise ImageError(f"building the image needs fcl-emu's source tree (pyproject.toml), not found at {root}")
    return root


def host_pins() -> list[str]:
    """``name==version`` of every distribution installed here but fcl-emu: the image runs the same versions."""
    pins = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() != PROJECT:
            pins[name.lower()] = f"{name}=={dist.version}"
    return sorted(pins.values())


def _pip(*args: str, what: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["no output"]
        raise ImageError(f"{what} failed: {lines[-1].strip()}")


#: Not part of the project's wheel; a stale ``build/`` in the tree would leak deleted modules into it.
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "runs", "*.egg-info", "__pycache__",
                                     "tests", "docs", "data")


def fetch_wheels(dest: Path) -> None:
    """The project's wheel (built from a clean copy of the source) and every runtime dependency's, for the
    image's Python, into ``dest``."""
    source = dest.parent / "source"
    shutil.copytree(project_root(), source, ignore=_NOT_SOURCE)
    _pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dest), str(source),
         what="building fcl-emu's wheel")
    shutil.rmtree(source)
    project_wheel = next(dest.glob("fcl_emu-*.whl"))
    pins = dest.parent / "pins.txt"
    pins.write_text("\n".join(host_pins()) + "\n")
    _pip("download", "--quiet", "--dest", str(dest), "--only-binary=:all:", "--python-version", PYTHON_VERSION,
         "--constraint", str(pins), str(project_wheel), what="fetching the dependencies' wheels (pip download)")


def content_hash(base: str, wheels: Path) -> str:
    """Hash of what goes into the image: base tag, Dockerfile, and each wheel's member names, sizes and CRCs."""
    parts: list[str] = [base, DOCKERFILE]
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            members = sorted(f"{i.filename}:{i.file_size}:{i.CRC}" for i in z.infolist())
        parts.append(wheel.name + "\n" + "\n".join(members))
    return _digest(*parts)


def build_image(log: Callable[[str], None] = print) -> ImageBuild:
    """Build (or reuse) ``fcl-emu:<content hash>`` and point ``fcl-emu:latest`` at it."""
    started = time.monotonic()
    base = base_image(log)
    with tempfile.TemporaryDirectory(prefix="fcl-emu-image-") as tmp:
        context = Path(tmp)
        wheels = context / "wheels"
        wheels.mkdir()
        log("fetching wheels for the image (pip download, pinned to this host's versions)")
        fetch_wheels(wheels)
        content = content_hash(base, wheels)
        tag = f"{REPOSITORY}:{content}"
        reused = _exists(tag)
        if not reused:
            log(f"building {tag}")
            (context / "Dockerfile").write_text(DOCKERFILE.format(base=base, content=content))
            _docker_build(context, tag)
            client().images.prune(filters={"label": "fcl-emu.stage=build", "dangling": True})
    image = client().images.get(tag)
    image.tag(REPOSITORY, "latest")
    return ImageBuild(tag, base, int(image.attrs.get("Size", 0)), time.monotonic() - started, reused)


def _docker_build(context: Path, tag: str) -> None:
    """``docker build`` through the engine's API; raises :class:`ImageError` with the failing step's output."""
    output: list[str] = []
    for chunk in client().api.build(path=str(context), tag=tag, rm=True, forcerm=True, decode=True):
        if "stream" in chunk:
            output.append(chunk["stream"])
        if "error" in chunk:
            tail = "".join(output[-5:]).strip().replace("\n", " | ")
            raise ImageError(f"docker build failed: {chunk['error'].strip()} (last output: {tail})")


def image_ref(tag: str | None) -> str:
    """The image a containerised run uses: ``tag`` if given (it must exist), else a build or reuse."""
    if tag is None:
        return build_image(log=lambda _msg: None).tag
    if not _exists(tag):
        raise EngineError(f"image {tag} is not on this engine: build it with `fcl-emu image build`, or load it "
                          "(docker load)")
    return tag
