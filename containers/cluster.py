"""A cluster of Docker hosts joined in one Swarm, as ``up --backend swarm --cluster NAME`` uses it (docs/containers.md).

A cluster file (JSON) names the hosts: each host's swarm node name, its address on the hosts' network, the URL of
its Docker engine (``unix://``, ``tcp://`` or ``ssh://``) and which one is the manager, plus ``advertise``: the
address at which the hosts reach the machine that runs ``fcl-emu up`` (the coordinator). ``fcl-emu cluster up``
writes one for a local cluster (:mod:`fcl_emu.containers.local_cluster`); for real machines a user writes it by hand.
With it a run reaches every host's engine, not only the manager's: the edge-node containers on every host are
sampled for the container metrics and acted on by fault plans, and the run's image is loaded into every engine
that lacks it (no registry needed).

A cluster is named by a path to its file or by a name, looked up as ``CLUSTERS/<name>/cluster.json`` where
``CLUSTERS`` is ``$FCL_EMU_CLUSTERS`` or ``/var/lib/fcl-emu/clusters``.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Literal

import pydantic

from fcl_emu.containers.docker_client import EngineError, client
from fcl_emu.scenario.files import load_model

DEFAULT_DIR = Path("/var/lib/fcl-emu/clusters")
FILE = "cluster.json"
LABEL_HOST = "fcl-emu.host"  # the swarm node label that names a cluster host
LABEL_CLASS = "fcl-emu.device-class"  # the device class a swarm node stands for (and of an edge-node container)


class ClusterHost(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str = pydantic.Field(description="the host's swarm node name")
    address: str = pydantic.Field(description="its address on the hosts' network (its swarm address)")
    engine: str = pydantic.Field(description="URL of its Docker engine: unix:///..., tcp://...:2376, ssh://user@host")
    manager: bool = False


class Cluster(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: Literal["local", "remote"] = pydantic.Field(
        "remote", description="local: made by `fcl-emu cluster up` on this machine (host faults are possible)")
    advertise: str = pydantic.Field(description="the address the hosts reach the coordinator at")
    hosts: list[ClusterHost] = pydantic.Field(min_length=1)

    @pydantic.model_validator(mode="after")
    def _one_manager(self) -> "Cluster":
        managers = [h.name for h in self.hosts if h.manager]
        if len(managers) != 1:
            raise ValueError(f"a cluster has exactly one manager host (got {managers or 'none'})")
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {names}")
        return self

    @property
    def manager(self) -> ClusterHost:
        return next(h for h in self.hosts if h.manager)

    def host(self, name: str) -> ClusterHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ValueError(f"cluster {self.name} has no host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")


def clusters_dir() -> Path:
    return Path(os.environ.get("FCL_EMU_CLUSTERS", DEFAULT_DIR))


def cluster_file(name: str) -> Path:
    return clusters_dir() / name / FILE


def load_cluster(ref: str | Path) -> Cluster:
    """The cluster named ``ref`` (a file path, or a name under :func:`clusters_dir`); ValueError saying why not."""
    path = Path(ref)
    if not path.is_file():
        path = cluster_file(str(ref))
    if not path.is_file():
        raise ValueError(f"no cluster {ref!r}: neither a file nor {path} (make a local one with `fcl-emu cluster up`, "
                         f"or write a cluster file: docs/containers.md)")
    return load_model(path, Cluster, "cluster file")


def save_cluster(cluster: Cluster, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(cluster.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)


def engine(url: str, timeout_s: float = 120):
    """A connected ``docker.DockerClient`` for the engine at ``url``; :class:`EngineError` if it does not answer."""
    import docker

    try:
        out = docker.DockerClient(base_url=url, timeout=timeout_s)
        out.ping()
    except docker.errors.DockerException as exc:
        raise EngineError(f"the Docker engine at {url} does not answer ({exc})") from None
    return out


def engines(cluster: Cluster, timeout_s: float = 900) -> dict[str, object]:
    """Every host's engine that answers, by host name (a lost host's is left out); ``timeout_s`` bounds each later
    call (loading an image takes minutes)."""
    out = {}
    for host in cluster.hosts:
        try:
            out[host.name] = engine(host.engine, timeout_s=timeout_s)
        except EngineError:
            continue
    return out


def distribute_image(ref: str, targets: dict[str, object], log=print) -> list[str]:
    """Load image ``ref`` from this machine's engine into every engine of ``targets`` (host name -> engine) that
    lacks it, all at once, from one ``docker save`` of it; the names of the hosts it was loaded into."""
    import docker

    missing = []
    for name, target in targets.items():
        try:
            target.images.get(ref)
        except docker.errors.ImageNotFound:
            missing.append(name)
    if not missing:
        return []
    log(f"loading {ref} into {', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="fcl-emu-image-", dir=os.environ.get("FCL_EMU_IMAGE_TMP")) as tmp:
        archive = Path(tmp) / "image.tar"
        with open(archive, "wb") as f:
            for chunk in client().images.get(ref).save(named=True):
                f.write(chunk)
        errors: dict[str, str] = {}

        def load(name: str) -> None:
            try:
                with open(archive, "rb") as f:
                    targets[name].images.load(f)
            except Exception as exc:  # reported below, with the host's name
                errors[name] = str(exc)

        threads = [threading.Thread(target=load, args=(name,)) for name in missing]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise EngineError("; ".join(f"loading {ref} into {name} failed: {e}" for name, e in errors.items()))
    return missing
