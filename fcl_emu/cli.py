"""The ``fcl-emu`` command line (typer).

``up`` runs a whole emulation on this machine; ``coordinator`` and ``node``
run the two halves separately (other hosts); ``methods`` lists the learning
methods; ``compatibility`` prints what combines with what; ``report`` and ``compare`` plot finished runs; ``bench`` holds the
benchmarks; ``cluster`` makes a local multi-host Swarm; ``image`` builds the
container image; ``trace`` writes and measures population behaviour traces.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any, Optional

import pydantic
import typer
from rich.console import Console

from fcl_emu import options
from fcl_emu.bench.commands import bench_app
from fcl_emu.cluster_commands import cluster_app
from fcl_emu.command_line import OneLineErrors, console, fail, unwrap_help, writable
from fcl_emu.runconfig import RunConfig, load_config
from fcl_emu.runconfig.errors import error_lines
from fcl_emu.trace_commands import trace_app

app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True,
                  help="Emulate federated class-incremental learning at the edge.")
app.add_typer(bench_app, name="bench")
image_app = typer.Typer(no_args_is_help=True, help="The container image of edge nodes, coordinator, GPU workers and "
                                                   "Prometheus (docs/containers.md).")
app.add_typer(image_app, name="image")
app.add_typer(cluster_app, name="cluster")
app.add_typer(trace_app, name="trace")


@app.callback()
def _process_setup() -> None:
    """Before every command: what every fcl-emu process sets up (malloc thresholds, stack dumps on SIGUSR1)."""
    from fcl_emu.runtime.process import setup_process

    setup_process()


def build_config(config_file: Optional[Path], **flags: Any) -> RunConfig:
    """Resolve file + flags; a validation error exits 2, a line per error naming the flag or config key."""
    try:
        return load_config(config_file, options.overrides(flags))
    except pydantic.ValidationError as exc:
        fail("\n".join(error_lines(exc, RunConfig, options.flag_for)))
    except (ValueError, KeyError) as exc:
        fail(str(exc).strip("'\""))


def _finish(runner, cfg: RunConfig, fork_nodes: bool = False) -> None:
    """Run, turning a missing dataset into a one-paragraph error; exit 0 only if the run completed.
    ``fork_nodes`` (``up`` with process nodes): fork the zygote that forks the edge nodes first, while this
    process has no other thread (fcl_emu/launchers/zygote.py)."""
    from fcl_emu.containers.docker_client import EngineError
    from fcl_emu.containers.image import ImageError
    from fcl_emu.coordinator.contracts import BindError, CheckpointError
    from fcl_emu.monitoring.stack import PortInUseError
    from fcl_emu.scenario.datasets import DatasetNotFoundError
    from fcl_emu.wire.auth import KeyFileError

    from fcl_emu.launchers import zygote
    from fcl_emu.run import RunNotRecorded
    from fcl_emu.writable import NotWritableError

    _check_extras(cfg)
    _check_devices(cfg)
    forks = zygote.start() if fork_nodes and cfg.containers.backend == "process" else None
    try:
        summary = runner(cfg, console)
    except (DatasetNotFoundError, BindError, CheckpointError, KeyFileError, EngineError, ImageError,
            NotWritableError, RunNotRecorded) as exc:
        fail(str(exc), 1)
    except PortInUseError as exc:
        fail(str(exc), 2)
    finally:
        if forks is not None:
            forks.close()
    raise typer.Exit(summary.exit_code)


def _check_extras(cfg: RunConfig) -> None:
    """Exit 2 with one line naming the pip command unless the run's method finds the extras it needs: before
    the run starts anything (its folder, keys, processes)."""
    from fcl_emu.methods import registry
    from fcl_emu.methods.requirements import missing_extras, pip_install

    spec = registry.get(cfg.method)
    missing = missing_extras(spec.requires_extras)
    if missing:
        console.print(f"error: method {spec.name} needs the {', '.join(missing)} extra, which is not installed: "
                      f"{pip_install(missing)}", style="red", markup=False, highlight=False)
        raise typer.Exit(2)


def _check_devices(cfg: RunConfig) -> None:
    """Exit 2 with one line naming what torch found where the run asks for a CUDA device that is not here: for
    training and evaluation (--device) or the GPU workers (--gpu-device); before the run starts anything."""
    from fcl_emu.gpu_worker import no_cuda

    for flag, choice in (("--device", cfg.device), ("--gpu-device", cfg.gpu.device)):
        reason = no_cuda(flag) if choice == "cuda" else None
        if reason:
            console.print(f"error: {reason}", style="red", markup=False, highlight=False)
            raise typer.Exit(2)


def _check_run_dir(cfg: RunConfig, overwrite: bool) -> None:
    """Exit 2 with one line where the run directory holds another run and may not be emptied for it (``overwrite``):
    before the run starts anything. A run directory left to its default is a new one."""
    from fcl_emu.run_directory import RunDirInUse, check_new_run_dir

    if cfg.run_dir is not None:
        try:
            check_new_run_dir(Path(cfg.run_dir), overwrite, cfg.security.keys)
        except RunDirInUse as exc:
            fail(str(exc))


def _resume(runner_name: str, run_dir: Path, config_file: Optional[Path], flags: dict[str, Any],
            fork_nodes: bool = False) -> None:
    """``up --resume`` / ``coordinator --resume``: refuse flags that would change the run, load and check
    RUN_DIR's config and checkpoint (exit 1 with one line if unusable), then continue the run."""
    from fcl_emu import run

    if flags.pop("overwrite"):
        raise typer.BadParameter("--resume continues the run in RUN_DIR, --overwrite would delete it: give one of "
                                 "them", param_hint="--overwrite")
    refused = ["--config"] * (config_file is not None) + sorted(options.refused_with_resume(flags))
    if refused:
        raise typer.BadParameter(f"{', '.join(refused)} cannot be combined with --resume: a resumed run keeps "
                                 f"the configuration in RUN_DIR/config.yaml", param_hint="--resume")
    try:
        cfg, ckpt = run.open_resume(run_dir, options.overrides(flags))
    except run.ResumeError as exc:
        console.print(f"error: cannot resume {run_dir}: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    _finish(functools.partial(getattr(run, runner_name), resume=ckpt), cfg, fork_nodes)


def _logging(verbose: bool) -> None:
    from fcl_emu.runtime.process import setup_logging

    setup_logging(verbose)


ClientsOpt = options.elsewhere("clients")


@app.command()
@options.run_command(options.UP, options.OVERWRITE)
def up(config: Optional[Path], resume: Optional[Path], verbose: bool, flags: dict[str, Any]) -> None:
    """Run a whole emulation here: the coordinator plus --nodes edge-node processes."""
    if resume is not None:
        _logging(verbose)
        return _resume("run_local", resume, config, flags, fork_nodes=True)
    overwrite = flags.pop("overwrite")
    cfg = build_config(config, **flags)
    _check_run_dir(cfg, overwrite)
    _logging(verbose)
    from fcl_emu.run import run_local

    _finish(functools.partial(run_local, overwrite=overwrite), cfg, fork_nodes=True)


@app.command()
@options.run_command(options.COORDINATOR, options.OVERWRITE)
def coordinator(config: Optional[Path], resume: Optional[Path], verbose: bool, flags: dict[str, Any]) -> None:
    """Run only the coordinator; edge nodes connect with `fcl-emu node --connect`."""
    if resume is not None:
        _logging(verbose)
        return _resume("run_coordinator", resume, config, flags)
    overwrite = flags.pop("overwrite")
    cfg = build_config(config, nodes=1, **flags)
    _check_run_dir(cfg, overwrite)
    _logging(verbose)
    from fcl_emu.run import run_coordinator

    _finish(functools.partial(run_coordinator, overwrite=overwrite), cfg)


PublishMonitoringOpt = Annotated[bool, typer.Option(
    "--publish-monitoring/--no-publish-monitoring", show_default=False, rich_help_panel=options.MONITORING,
    help="Publish Prometheus (no login) and Grafana (a login, no anonymous viewers) on every interface of the "
         "manager. Without it the Compose file binds both to the host's loopback and the stack publishes neither "
         "(docs/containers.md). Default off.")]


@app.command()
@options.run_command(options.DEPLOY,
                     ("out", Annotated[Path, typer.Argument(metavar="OUT_DIR", help="Where the files go.")]),
                     ("publish_monitoring", PublishMonitoringOpt, False))
def deploy(config: Optional[Path], flags: dict[str, Any]) -> None:
    """Write the run as a Swarm stack and a Compose file (coordinator, edge nodes, Prometheus, Grafana) to deploy and
    edit yourself (docs/containers.md). With --image no Docker engine is needed here."""
    from fcl_emu.containers.docker_client import EngineError
    from fcl_emu.containers.image import ImageError
    from fcl_emu.deploy import MountError, check_mounts, deployment_image, write_deployment

    out, publish_monitoring = flags.pop("out"), flags.pop("publish_monitoring")
    cfg = build_config(config, **flags)
    if not cfg.data_root:
        raise typer.BadParameter("give the data root to mount", param_hint="--data-root")
    try:
        check_mounts(cfg, given=bool(flags.get("data_root")))
    except MountError as exc:
        fail(str(exc), 2)
    writable(out)
    try:
        image = deployment_image(cfg.containers.image)
    except (EngineError, ImageError) as exc:
        fail(str(exc), 1)
    files = write_deployment(cfg, out, image, cfg.data_root[0], publish_monitoring)
    Console(width=1000).print(
        f"{files.stack} and {files.compose} (image {image}; keys in {files.keys}, keep them private)\n"
        f"  swarm:   cd {out} && docker stack deploy -c stack.yml fcl-emu\n"
        f"  compose: cd {out} && docker compose -f compose.yml up\n"
        f"  results: {Path(out) / 'runs' / 'run'} (run {files.run_id})\n"
        f"  monitoring: {files.monitoring()}", markup=False, highlight=False)


# `node` and `gpu-worker` take no options of their own: their arguments go to the argparse parser of the object
# they build (its fields are the flags), --help included
PASS_ON = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command("gpu-worker", hidden=True, context_settings=PASS_ON)
def gpu_worker(ctx: typer.Context) -> None:
    """One GPU worker of the coordinator's pool (started by the coordinator, docs/gpu.md)."""
    from fcl_emu.gpu_worker import GpuWorkerArgs, run_worker

    raise typer.Exit(run_worker(GpuWorkerArgs.from_argv(ctx.args, prog="fcl-emu gpu-worker")))


@app.command(context_settings=PASS_ON)
def node(ctx: typer.Context) -> None:
    """Run one edge node hosting many emulated clients."""
    from fcl_emu.edge_node.args import NodeArgs, run_node

    raise typer.Exit(run_node(NodeArgs.from_argv(ctx.args, prog="fcl-emu node")))


@app.command()
def keys(
    directory: Annotated[Path, typer.Argument(help="Where to write the keys (created, mode 0700).")],
    clients: ClientsOpt = None,
    nodes: Annotated[int, typer.Option(
        min=1, help="Edge nodes; node n hosts the n-th contiguous block of clients.")] = 2,
    per_device: Annotated[bool, typer.Option(
        "--per-device/--per-node", help="One key per client instead of one per edge node.")] = False,
    bind: Annotated[str, typer.Option(
        help="The endpoint the coordinator binds, with a fixed port (in the coordinator's command).")]
        = "tcp://0.0.0.0:5555",
    coordinator_host: Annotated[str, typer.Option(
        "--coordinator-host", help="The coordinator's address as the edge nodes' hosts reach it (in their "
                                   "commands; default: this host's name).")] = "",
) -> None:
    """Write a run's CurveZMQ keys for a coordinator and edge nodes on several hosts (docs/security.md), and
    print each host's command."""
    import socket

    from fcl_emu.keys import host_commands, node_blocks, write_run_keys

    cfg = build_config(None, clients=clients, nodes=1, bind=bind)  # a run's bounds (its nodes: below)
    count = cfg.scenario.num_clients
    if nodes > count:
        raise typer.BadParameter(f"{nodes} nodes for {count} clients", param_hint="--nodes")
    if not bind.startswith("tcp://") or bind.rpartition(":")[2] in ("0", "*"):
        raise typer.BadParameter(f"{bind!r}: give a TCP endpoint with a fixed port for the edge nodes to dial, "
                                 f"e.g. tcp://0.0.0.0:5555", param_hint="--bind")
    writable(directory)
    blocks = node_blocks(count, nodes)
    path = write_run_keys(directory, blocks, per_device=per_device)
    commands = host_commands(path, blocks, bind, coordinator_host or socket.gethostname(), per_device=per_device)
    lines = [f"keys for {count} clients on {len(blocks)} nodes in {path} (keep coordinator.key_secret and "
             f"roster.json on the coordinator's host only; copy coordinator.key, secagg_signers.json and each node's "
             f"key to its host)",
             *(f"  {command}" for command in commands),
             "  (the run's flags go to the coordinator's command alone: --method, --dataset, ..., and --join-timeout "
             "SECONDS where the nodes start later; the nodes take the run's settings from the coordinator)"]
    Console(width=1000).print("\n".join(lines), markup=False, highlight=False)


@image_app.command("build")
def image_build() -> None:
    """Build the image offline (Debian packages + this host's wheels), or reuse it when nothing changed."""
    from fcl_emu.containers.docker_client import EngineError
    from fcl_emu.containers.image import ImageError, build_image

    try:
        built = build_image(log=lambda msg: console.print(msg, markup=False, highlight=False))
    except (EngineError, ImageError) as exc:
        fail(str(exc), 1)
    what = "reused (nothing changed)" if built.reused else "built"
    Console().print(f"{built.tag} {what}: {built.size_bytes / 1e6:,.0f} MB, {built.seconds:.1f} s (base {built.base}); "
                    f"also tagged fcl-emu:latest", markup=False, highlight=False)


@app.command("methods")
def list_methods(
    name: Annotated[Optional[str], typer.Argument(help="A method (or alias) to describe in full.")] = None,
) -> None:
    """List the learning methods, or describe one: its options and defaults, optimiser, server-side jobs, the
    extras it needs and the run features it refuses."""
    from fcl_emu.method_info import method_card, methods_table
    from fcl_emu.methods import registry

    if name is None:
        return Console().print(methods_table(registry.all_specs()))
    try:
        spec = registry.get(name)
    except KeyError as exc:
        raise typer.BadParameter(str(exc).strip("'\""), param_hint="NAME") from None
    Console().print(method_card(spec))


@app.command()
def compatibility(
    page: Annotated[Optional[Path], typer.Option(
        "--page", help="Also write the matrix into this docs page, between its <!-- table: compatibility --> and "
                       "<!-- /table: compatibility --> markers (docs/compatibility.md); the page must exist.")] = None,
) -> None:
    """What combines with what: each method and feature against the round policies, privacy, SecAgg+, edge
    aggregators, backends and robust rules (yes, no with the error, ignored), read from the compatibility table."""
    from rich.measure import Measurement

    from fcl_emu.page_blocks import PageError, write_table
    from fcl_emu.compatibility import BLOCK, matrix_markdown, matrix_table

    if page is not None:
        try:
            write_table(page, BLOCK, matrix_markdown())
        except PageError as exc:
            fail(str(exc), 1)
        return Console().print(f"{page}: matrix written", markup=False, highlight=False)
    table, notes = matrix_table()
    stdout = Console()
    unbroken = Measurement.get(stdout, stdout.options.update(max_width=1000), table).maximum
    stdout.width = max(stdout.width, unbroken)  # wider than the terminal rather than each cell cut short
    stdout.print(table)
    for note in notes:
        stdout.print(note, markup=False, highlight=False, soft_wrap=True)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (summary.json, events.jsonl).")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Output directory (default RUN_DIR/report).")] = None,
) -> None:
    """Plot a run (accuracy matrix, seen-class accuracy, bytes, round phases, online clients) and write report.md."""
    from fcl_emu.monitoring.report import write_report
    from fcl_emu.monitoring.run_dir import RunDirError, load_run
    from fcl_emu.runconfig.defaults import defaults_for

    out = run_dir / "report" if out is None else out
    writable(out)
    try:
        run = load_run(run_dir)
        path = write_report(run, out, defaults_for)
    except RunDirError as exc:
        fail(str(exc), 1)
    Console().print(f"report: {path} (plots beside it); run status: {run.status}", markup=False, highlight=False,
                    style=None if run.completed else "yellow")


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories to put side by side.")],
    out: Annotated[Path, typer.Option("--out", help="Where compare.png goes.")] = Path("."),
    include_incomplete: Annotated[bool, typer.Option(
        "--include-incomplete", help="Also compare runs not completed (failed, interrupted, still running), "
                                     "marked with * and hatched bars.")] = False,
) -> None:
    """Average accuracy, forgetting, total bytes, wall-clock and emulated time of several runs, and the settings
    each changed: a table and compare.png. Folders that hold no run are skipped; runs not completed are left out
    unless --include-incomplete; differing scenario and system settings are warned about."""
    from fcl_emu.monitoring.compare import NothingToCompare, compare_runs, format_table
    from fcl_emu.monitoring.run_dir import RunDirError
    from fcl_emu.runconfig.defaults import defaults_for

    writable(out)
    stdout = Console()
    try:
        found = compare_runs(run_dirs, out, include_incomplete, defaults_for)
    except NothingToCompare as exc:
        for note in exc.notes:
            stdout.print(note, markup=False, highlight=False, soft_wrap=True)
        fail(str(exc), 1)
    except RunDirError as exc:
        fail(str(exc), 1)
    for note in found.notes:
        stdout.print(note, markup=False, highlight=False, soft_wrap=True)
    for warning in found.warnings:
        stdout.print(f"warning: {warning}", style="yellow", markup=False, highlight=False, soft_wrap=True)
    stdout.print(format_table(found.rows, found.shared_settings))
    stdout.print(f"plot: {found.png}", markup=False, highlight=False)


unwrap_help(app)  # last: every command is registered

if __name__ == "__main__":
    app()
