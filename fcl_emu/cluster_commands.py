"""``fcl-emu cluster up|status|down``: a local multi-host Swarm on this machine (containers/local_cluster.py)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from fcl_emu.command_line import console, fail

cluster_app = typer.Typer(no_args_is_help=True, help="A local cluster of emulated hosts joined in one Swarm, for "
                                                     "`up --backend swarm --cluster NAME` (docs/containers.md).")

NameOption = Annotated[str, typer.Option("--name", help="the cluster's name (1-8 lower-case letters or digits)")]


@cluster_app.command("up")
def cluster_up(
    hosts: Annotated[int, typer.Option("--hosts", min=1, max=50, help="how many hosts (host 1 is the swarm "
                                                                      "manager)")] = 3,
    name: NameOption = "local",
    subnet: Annotated[str, typer.Option("--subnet", help="the hosts' network; the machine takes its first "
                                                         "address, host i the 10+i-th")] = "192.168.213.0/24",
    image: Annotated[Optional[str], typer.Option("--image", help="the image to load into every host (default: "
                                                                 "build or reuse the project's)")] = None,
    device_class: Annotated[Optional[list[str]], typer.Option(
        "--device-class", help="HOST=CLASS: label a host with a device class (its edge nodes run there); "
                               "repeatable")] = None,
) -> None:
    """Make N hosts on this machine (network namespaces, each with its own Docker engine, address and cgroup),
    join them into one Swarm and load the image into every engine. Needs root."""
    from fcl_emu.containers.docker_client import EngineError
    from fcl_emu.containers.image import ImageError
    from fcl_emu.containers.local_cluster import ClusterError, up

    classes = {}
    for item in device_class or []:
        host, sep, cls = item.partition("=")
        if not sep or not host or not cls:
            fail(f"--device-class {item!r}: HOST=CLASS", 1)
        classes[host] = cls
    try:
        cluster = up(name, hosts, subnet, image, classes,
                     log=lambda msg: console.print(msg, markup=False, highlight=False))
    except (ClusterError, EngineError, ImageError, ValueError) as exc:
        fail(str(exc), 1)
    console.print(f"cluster {cluster.name}: {len(cluster.hosts)} hosts "
                  f"({', '.join(f'{h.name} {h.address}' for h in cluster.hosts)}), manager {cluster.manager.name}; "
                  f"the coordinator is reached at {cluster.advertise}. Run: fcl-emu up --backend swarm --cluster "
                  f"{cluster.name}", markup=False, highlight=False)


@cluster_app.command("status")
def cluster_status(name: NameOption = "local") -> None:
    """Each host: address, engine, swarm state, link (cut during a partition), CPU quota, running containers."""
    from fcl_emu.containers.cluster import load_cluster
    from fcl_emu.containers.local_cluster import status

    try:
        cluster = load_cluster(name)
    except ValueError as exc:
        fail(str(exc), 1)
    table = Table("host", "address", "role", "engine", "swarm", "link", "cpus", "containers",
                  title=f"cluster {cluster.name} ({cluster.kind})")
    for row in status(cluster):
        table.add_row(row["host"], row["address"], "manager" if row["manager"] else "worker", row["engine"],
                      row["swarm"], row.get("link", "-"), "all" if row.get("cpus") is None else f"{row['cpus']:g}",
                      "-" if row["containers"] is None else str(row["containers"]))
    Console().print(table)


@cluster_app.command("down")
def cluster_down(name: NameOption = "local") -> None:
    """Remove everything the cluster made (engines, containers, namespaces, links, cgroups, state), also what a
    crashed `cluster up` left."""
    from fcl_emu.containers.local_cluster import ClusterError, check_prerequisites, down

    try:
        check_prerequisites()
    except ClusterError as exc:
        fail(str(exc), 1)
    removed = down(name)
    console.print(f"cluster {name}: " + (f"removed {len(removed)} parts" if removed else "nothing to remove"),
                  markup=False, highlight=False)
