"""The ``fcl-emu`` command line (typer).

``up`` runs a whole emulation on this machine; ``coordinator`` and ``node``
run the two halves separately (other hosts); ``methods`` lists the learning
methods; ``report`` and ``compare`` plot finished runs; ``bench`` holds the
benchmarks.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import pydantic
import typer
from rich.console import Console

from fcl_emu.config import RunConfig, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Emulate federated class-incremental learning at the edge.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios against baselines measured in the same run).")
app.add_typer(bench_app, name="bench")
console = Console(stderr=True)

# Where each config field is set on the command line (for error messages).
FLAG_OF = {
    ("scenario", "num_clients"): "--clients",
    ("scenario", "dataset"): "--dataset",
    ("scenario", "num_tasks"): "--tasks",
    ("scenario", "partition"): "--partition",
    ("scenario", "dirichlet_beta"): "--beta",
    ("scenario", "seed"): "--seed",
    ("rounds", "clients_per_round"): "--clients-per-round",
    ("rounds", "rounds_per_task"): "--rounds-per-task",
    ("rounds", "deadline_s"): "--round-deadline",
    ("rounds", "min_participants"): "--min-participants",
    ("training", "local_epochs"): "--local-epochs",
    ("training", "lr"): "--lr",
    ("network", "bind"): "--bind",
    ("rounds", "overcommit"): "--overcommit",
    ("rounds", "late_updates"): "--late-updates",
    ("edge", "availability"): "--availability",
    ("edge", "crash_rate"): "--crash-rate",
    ("edge", "device_profiles"): "--device-profiles",
    ("secagg", "enabled"): "--secagg",
    ("secagg", "neighbors"): "--secagg-neighbors",
    ("secagg", "threshold"): "--secagg-threshold",
    ("gpu", "workers"): "--gpu-workers",
    ("gpu", "device"): "--gpu-device",
    ("metrics", "port"): "--metrics-port",
    ("metrics", "host"): "--metrics-host",
    ("metrics", "prometheus_port"): "--prometheus-port",
    ("method",): "--method",
    ("method_options",): "--method-option",
    ("model",): "--model",
    ("nodes",): "--nodes",
    ("device",): "--device",
    ("data_root",): "--data-root",
    ("seed",): "--seed",
    ("run_dir",): "--run-dir",
}


def _flag_for(loc: tuple) -> str:
    for n in range(len(loc), 0, -1):
        if tuple(loc[:n]) in FLAG_OF:
            return FLAG_OF[tuple(loc[:n])]
    return ".".join(str(p) for p in loc) or "config"


def _set(overrides: dict, path: tuple[str, ...], value: Any) -> None:
    if value is None:
        return
    node = overrides
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _parse_method_options(items: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r}: use KEY=VALUE", param_hint="--method-option")
        out[key] = yaml.safe_load(value)
    return out


def build_config(config_file: Optional[Path], **flags: Any) -> RunConfig:
    """Resolve file + flags, turning validation errors into messages that name the flag."""
    overrides: dict = {}
    _set(overrides, ("scenario", "num_clients"), flags.get("clients"))
    _set(overrides, ("scenario", "dataset"), flags.get("dataset"))
    _set(overrides, ("scenario", "num_tasks"), flags.get("tasks"))
    _set(overrides, ("scenario", "partition"), flags.get("partition"))
    _set(overrides, ("scenario", "dirichlet_beta"), flags.get("beta"))
    _set(overrides, ("rounds", "clients_per_round"), flags.get("clients_per_round"))
    _set(overrides, ("rounds", "rounds_per_task"), flags.get("rounds_per_task"))
    _set(overrides, ("rounds", "deadline_s"), flags.get("round_deadline"))
    _set(overrides, ("rounds", "min_participants"), flags.get("min_participants"))
    _set(overrides, ("training", "local_epochs"), flags.get("local_epochs"))
    _set(overrides, ("training", "lr"), flags.get("lr"))
    _set(overrides, ("network", "bind"), flags.get("bind"))
    _set(overrides, ("rounds", "overcommit"), flags.get("overcommit"))
    _set(overrides, ("rounds", "late_updates"), flags.get("late_updates"))
    _set(overrides, ("edge", "availability"), flags.get("availability"))
    _set(overrides, ("edge", "crash_rate"), flags.get("crash_rate"))
    _set(overrides, ("edge", "device_profiles"), flags.get("device_profiles"))
    if flags.get("secagg"):
        _set(overrides, ("secagg", "enabled"), True)
    _set(overrides, ("secagg", "neighbors"), flags.get("secagg_neighbors"))
    _set(overrides, ("secagg", "threshold"), flags.get("secagg_threshold"))
    _set(overrides, ("gpu", "workers"), flags.get("gpu_workers"))
    _set(overrides, ("gpu", "device"), flags.get("gpu_device"))
    _set(overrides, ("metrics", "port"), flags.get("metrics_port"))
    _set(overrides, ("metrics", "host"), flags.get("metrics_host"))
    _set(overrides, ("metrics", "prometheus_port"), flags.get("prometheus_port"))
    for flag in ("prometheus", "keep_prometheus"):
        if flags.get(flag):
            _set(overrides, ("metrics", flag), True)
    for key in ("method", "model", "nodes", "device", "run_dir"):
        _set(overrides, (key,), flags.get(key))
    if flags.get("seed") is not None:
        overrides["seed"] = flags["seed"]
        overrides.setdefault("scenario", {})["seed"] = flags["seed"]
    if flags.get("data_root"):
        overrides["data_root"] = [str(p) for p in flags["data_root"]]
    if flags.get("method_option"):
        overrides["method_options"] = _parse_method_options(flags["method_option"])
    if flags.get("download"):
        overrides["download"] = True
    try:
        return load_config(config_file, overrides)
    except pydantic.ValidationError as exc:
        lines = [f"Invalid value for {_flag_for(tuple(e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise typer.BadParameter("\n".join(lines)) from None
    except (ValueError, KeyError) as exc:
        raise typer.BadParameter(str(exc).strip("'\"")) from None


def _finish(runner, cfg: RunConfig) -> None:
    """Run, turning a missing dataset into a one-paragraph error; exit 0 only if the run completed."""
    from coordinator.checkpoint import CheckpointError
    from coordinator.engine import BindError
    from monitoring.stack import PortInUseError
    from scenario.datasets import DatasetNotFoundError

    try:
        summary = runner(cfg, console)
    except (DatasetNotFoundError, BindError, CheckpointError) as exc:
        console.print(f"error: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    except PortInUseError as exc:
        console.print(f"error: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(2) from None
    raise typer.Exit(0 if summary.get("status") == "completed" else 1)


# What may be given with --resume: where the data and the metrics live, not what the run does.
RESUME_KEEPS = frozenset({"data_root", "metrics_port", "metrics_host", "prometheus", "prometheus_port",
                          "keep_prometheus", "verbose", "resume"})


def _resume(runner_name: str, run_dir: Path, params: dict[str, Any]) -> None:
    """``up --resume`` / ``coordinator --resume``: refuse flags that would change the run, load and check
    RUN_DIR's config and checkpoint (exit 1 with one line if unusable), then continue the run."""
    import functools

    from fcl_emu import run

    refused = ["--" + k.replace("_", "-") for k, v in params.items()
               if k not in RESUME_KEEPS and v is not None and v is not False and v != []]
    if refused:
        raise typer.BadParameter(f"{', '.join(refused)} cannot be combined with --resume: a resumed run keeps "
                                 f"the configuration in RUN_DIR/config.yaml", param_hint="--resume")
    overrides: dict = {}
    _set(overrides, ("metrics", "port"), params.get("metrics_port"))
    _set(overrides, ("metrics", "host"), params.get("metrics_host"))
    _set(overrides, ("metrics", "prometheus_port"), params.get("prometheus_port"))
    for flag in ("prometheus", "keep_prometheus"):
        if params.get(flag):
            _set(overrides, ("metrics", flag), True)
    if params.get("data_root"):
        overrides["data_root"] = [str(p) for p in params["data_root"]]
    try:
        cfg, ckpt = run.open_resume(run_dir, overrides)
    except run.ResumeError as exc:
        console.print(f"error: cannot resume {run_dir}: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    _finish(functools.partial(getattr(run, runner_name), resume=ckpt), cfg)


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML config file; flags override it.")]
ClientsOpt = Annotated[Optional[int], typer.Option(help="Number of emulated clients.")]
PerRoundOpt = Annotated[Optional[int], typer.Option("--clients-per-round", help="Clients sampled per round (K).")]
MethodOpt = Annotated[Optional[str], typer.Option(help="Learning method (see `fcl-emu methods`).")]
MethodOptionOpt = Annotated[Optional[list[str]], typer.Option(
    "--method-option", help="Method hyper-parameter KEY=VALUE (repeatable).")]
DatasetOpt = Annotated[Optional[str], typer.Option(help="Dataset name.")]
DataRootOpt = Annotated[Optional[list[Path]], typer.Option(
    "--data-root", help="Where datasets are looked for (repeatable; default $FCL_EMU_DATA_ROOT or ./data).")]
TasksOpt = Annotated[Optional[int], typer.Option(help="Number of class-incremental tasks.")]
RoundsOpt = Annotated[Optional[int], typer.Option("--rounds-per-task", help="Communication rounds per task.")]
EpochsOpt = Annotated[Optional[int], typer.Option("--local-epochs", help="Local epochs per round.")]
NodesOpt = Annotated[Optional[int], typer.Option(help="Edge-node processes to start.")]
DeviceOpt = Annotated[Optional[str], typer.Option(help="auto, cpu or cuda.")]
SeedOpt = Annotated[Optional[int], typer.Option(help="Seed of the scenario, sampling and training.")]
RunDirOpt = Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory (default runs/<time>-...).")]
MetricsPortOpt = Annotated[Optional[int], typer.Option(
    "--metrics-port", help="Serve the coordinator's Prometheus /metrics on this port; edge node i of `up` "
                           "takes PORT+1+i (default: no endpoints).")]
MetricsHostOpt = Annotated[Optional[str], typer.Option(
    "--metrics-host", help="Address the /metrics endpoints listen on (default 127.0.0.1; 0.0.0.0 for a "
                           "Prometheus on another host or in a container).")]
PrometheusOpt = Annotated[bool, typer.Option(
    "--prometheus", help="Start a local Prometheus server (the `prometheus` binary) scraping this run.")]
PrometheusPortOpt = Annotated[Optional[int], typer.Option(
    "--prometheus-port", help="Port of the local Prometheus (default 9090, on 127.0.0.1).")]
KeepPrometheusOpt = Annotated[bool, typer.Option(
    "--keep-prometheus", help="Leave the local Prometheus running after the run ends.")]
ResumeOpt = Annotated[Optional[Path], typer.Option(
    "--resume", metavar="RUN_DIR", help="Continue the interrupted run in RUN_DIR from its last checkpoint, "
    "same address and run id (docs/resume.md). Only --data-root, --metrics-*, --prometheus* and --verbose "
    "may go with it.")]
DeadlineOpt = Annotated[Optional[float], typer.Option("--round-deadline", help="Seconds before a round closes.")]
MinParticipantsOpt = Annotated[Optional[int], typer.Option("--min-participants",
                                                           help="Fewer updates: round skipped.")]
OvercommitOpt = Annotated[Optional[float], typer.Option(
    "--overcommit", help="Select ceil(K x FACTOR) clients, close the round at the first K updates.")]
LateUpdatesOpt = Annotated[Optional[str], typer.Option(
    "--late-updates", help="drop (count them) or next_round (aggregate stale deltas of the same task).")]
AvailabilityOpt = Annotated[Optional[str], typer.Option(
    "--availability", help="always | bernoulli:P | onoff:MEAN_ON_S:MEAN_OFF_S | trace:PATH (docs/edge.md).")]
CrashRateOpt = Annotated[Optional[float], typer.Option(
    "--crash-rate", help="Probability that a client selected for a round crashes during it.")]
ProfilesOpt = Annotated[Optional[Path], typer.Option(
    "--device-profiles", help="Device profiles file: compute factor, bandwidth, latency (docs/edge.md).")]
SecAggOpt = Annotated[bool, typer.Option(
    "--secagg", help="Sum the model deltas under SecAgg+ masks: the coordinator sees only the sum (docs/secagg.md).")]
SecAggNeighborsOpt = Annotated[Optional[int], typer.Option(
    "--secagg-neighbors", help="Neighbours per client k (default 2*ceil(log2 n); n-1 or more: SecAgg).")]
SecAggThresholdOpt = Annotated[Optional[int], typer.Option(
    "--secagg-threshold", help="Shamir threshold t: shares to rebuild a secret (default floor(k/2)+1).")]
GpuWorkersOpt = Annotated[Optional[int], typer.Option(
    "--gpu-workers", help="Worker processes for server-side jobs, one device each (default 0: a thread of the "
                          "coordinator; docs/gpu.md).")]
GpuDeviceOpt = Annotated[Optional[str], typer.Option(
    "--gpu-device", help="Device of the GPU workers: auto (CUDA if present), cuda or cpu.")]


@app.command()
def up(
    config: ConfigOpt = None,
    clients: ClientsOpt = None,
    clients_per_round: PerRoundOpt = None,
    method: MethodOpt = None,
    method_option: MethodOptionOpt = None,
    dataset: DatasetOpt = None,
    data_root: DataRootOpt = None,
    tasks: TasksOpt = None,
    rounds_per_task: RoundsOpt = None,
    local_epochs: EpochsOpt = None,
    nodes: NodesOpt = None,
    device: DeviceOpt = None,
    seed: SeedOpt = None,
    run_dir: RunDirOpt = None,
    partition: Annotated[Optional[str], typer.Option(help="iid, dirichlet, class_fraction, private_classes, task_pool, accessible_classes (other scenario options: --config YAML).")] = None,
    beta: Annotated[Optional[float], typer.Option(help="Dirichlet concentration for --partition dirichlet.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Backbone: auto, cnn, resnet18, resnet32.")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Local learning rate.")] = None,
    round_deadline: DeadlineOpt = None,
    min_participants: MinParticipantsOpt = None,
    overcommit: OvercommitOpt = None,
    late_updates: LateUpdatesOpt = None,
    availability: AvailabilityOpt = None,
    crash_rate: CrashRateOpt = None,
    device_profiles: ProfilesOpt = None,
    secagg: SecAggOpt = False,
    secagg_neighbors: SecAggNeighborsOpt = None,
    secagg_threshold: SecAggThresholdOpt = None,
    gpu_workers: GpuWorkersOpt = None,
    gpu_device: GpuDeviceOpt = None,
    download: Annotated[bool, typer.Option("--download", help="Download a missing dataset with torchvision.")] = False,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = None,
    prometheus: PrometheusOpt = False,
    prometheus_port: PrometheusPortOpt = None,
    keep_prometheus: KeepPrometheusOpt = False,
    resume: ResumeOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a whole emulation here: the coordinator plus --nodes edge-node processes."""
    if resume is not None:
        _logging(verbose)
        return _resume("run_local", resume, locals())
    cfg = build_config(config, **{k: v for k, v in locals().items() if k not in ("config", "verbose")})
    _logging(verbose)
    from fcl_emu.run import run_local

    _finish(run_local, cfg)


@app.command()
def coordinator(
    config: ConfigOpt = None,
    bind: Annotated[Optional[str], typer.Option(help="ZeroMQ endpoint to bind, e.g. tcp://0.0.0.0:5555.")] = None,
    round_deadline: DeadlineOpt = None,
    min_participants: MinParticipantsOpt = None,
    overcommit: OvercommitOpt = None,
    late_updates: LateUpdatesOpt = None,
    availability: AvailabilityOpt = None,
    crash_rate: CrashRateOpt = None,
    device_profiles: ProfilesOpt = None,
    secagg: SecAggOpt = False,
    secagg_neighbors: SecAggNeighborsOpt = None,
    secagg_threshold: SecAggThresholdOpt = None,
    gpu_workers: GpuWorkersOpt = None,
    gpu_device: GpuDeviceOpt = None,
    clients: ClientsOpt = None,
    clients_per_round: PerRoundOpt = None,
    method: MethodOpt = None,
    method_option: MethodOptionOpt = None,
    dataset: DatasetOpt = None,
    data_root: DataRootOpt = None,
    tasks: TasksOpt = None,
    rounds_per_task: RoundsOpt = None,
    local_epochs: EpochsOpt = None,
    device: DeviceOpt = None,
    seed: SeedOpt = None,
    run_dir: RunDirOpt = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = None,
    prometheus: PrometheusOpt = False,
    prometheus_port: PrometheusPortOpt = None,
    keep_prometheus: KeepPrometheusOpt = False,
    resume: ResumeOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run only the coordinator; edge nodes connect with `fcl-emu node --connect`."""
    if resume is not None:
        _logging(verbose)
        return _resume("run_coordinator", resume, locals())
    cfg = build_config(config, nodes=1, **{k: v for k, v in locals().items() if k not in ("config", "verbose")})
    _logging(verbose)
    from fcl_emu.run import run_coordinator

    _finish(run_coordinator, cfg)


@app.command("gpu-worker", hidden=True)
def gpu_worker(
    connect: Annotated[str, typer.Option(help="The GPU pool's endpoint.")],
    index: Annotated[int, typer.Option(min=0, help="Worker index (its identity and CUDA device).")],
    device: Annotated[str, typer.Option(help="auto, cuda or cpu.")] = "auto",
    parent_pid: Annotated[Optional[int], typer.Option("--parent-pid", help="Exit when this process is gone.")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(
        "--metrics-port", min=1, max=65535, help="Serve this worker's Prometheus /metrics on this port.")] = None,
    metrics_host: Annotated[str, typer.Option("--metrics-host", help="Address /metrics listens on.")] = "127.0.0.1",
    metrics_linger: Annotated[float, typer.Option(
        "--metrics-linger", min=0, help="Seconds to keep /metrics up after the shutdown.")] = 0.0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """One GPU worker of the coordinator's pool (started by the coordinator, docs/gpu.md)."""
    from fcl_emu.launcher import exit_with_parent

    if parent_pid is not None:
        exit_with_parent(parent_pid)
    _logging(verbose)
    from coordinator.gpu_worker import serve, worker_device
    from monitoring.metrics import GpuWorkerMetrics

    metrics = GpuWorkerMetrics(worker_device(device, index))
    if metrics_port is not None:
        try:
            metrics.serve(metrics_port, metrics_host)
        except OSError as exc:  # metrics are an aid: the worker still runs
            logging.getLogger("fcl_emu.gpu_worker").error(
                "cannot serve /metrics on %s:%d (%s); running without it", metrics_host, metrics_port, exc)
            metrics_port = None
    serve(connect, index, device, metrics=metrics)
    if metrics_port is not None:
        time.sleep(metrics_linger)  # a last scrape sees the end
        metrics.close()


@app.command()
def node(
    connect: Annotated[str, typer.Option(help="Coordinator endpoint, e.g. tcp://HOST:5555.")],
    clients: Annotated[str, typer.Option(help="Client indices hosted here, e.g. 0-149 or 0,5,7-9.")],
    data_root: DataRootOpt = None,
    name: Annotated[Optional[str], typer.Option(help="Node name (default node-<pid>).")] = None,
    threads: Annotated[int, typer.Option(min=1, help="Torch threads for local training.")] = 1,
    metrics_port: Annotated[Optional[int], typer.Option(
        "--metrics-port", min=1, max=65535, help="Serve this node's Prometheus /metrics on this port.")] = None,
    metrics_host: Annotated[str, typer.Option("--metrics-host", help="Address /metrics listens on.")] = "127.0.0.1",
    metrics_linger: Annotated[float, typer.Option(
        "--metrics-linger", min=0, help="Seconds to keep /metrics up after the clients shut down.")] = 0.0,
    parent_pid: Annotated[Optional[int], typer.Option(
        "--parent-pid", help="Exit as soon as this process, the node's parent, is gone (set by `fcl-emu up`).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run one edge node hosting many emulated clients."""
    from fcl_emu.config import default_data_roots
    from fcl_emu.launcher import exit_with_parent, parse_client_set

    if parent_pid is not None:
        exit_with_parent(parent_pid)
    try:
        indices = parse_client_set(clients)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--clients") from None
    _logging(verbose)
    from edge_node.node import EdgeNode

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    edge = EdgeNode(connect, indices, name=name, data_roots=list(data_root or default_data_roots()),
                    threads=threads)
    serving = False
    if metrics_port is not None:
        try:
            edge.metrics.serve(metrics_port, metrics_host)
            serving = True
        except OSError as exc:  # metrics are an aid: the clients still run
            logging.getLogger("fcl_emu.edge_node").error(
                "cannot serve /metrics on %s:%d (%s); running without it", metrics_host, metrics_port, exc)
    try:
        edge.run(stop)
        if serving and metrics_linger > 0:
            stop.wait(metrics_linger)  # a last scrape sees the end
    finally:
        edge.metrics.close()


@app.command("methods")
def list_methods() -> None:
    """List the registered learning methods."""
    from rich.table import Table

    from methods import registry

    table = Table("method", "aliases", "description")
    for spec in registry.all_specs():
        table.add_row(spec.name, ", ".join(spec.aliases), spec.description)
    Console().print(table)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (summary.json, events.jsonl).")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Output directory (default RUN_DIR/report).")] = None,
) -> None:
    """Plot a run (accuracy matrix, seen-class accuracy, bytes, round phases, online clients) and write report.md."""
    from monitoring.report import RunDirError, write_report

    try:
        path = write_report(run_dir, out)
    except RunDirError as exc:
        console.print(f"error: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    Console().print(f"report: {path} (plots beside it)", markup=False, highlight=False)


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories to put side by side.")],
    out: Annotated[Path, typer.Option("--out", help="Where compare.png goes.")] = Path("."),
) -> None:
    """Average accuracy, forgetting, total bytes and wall-clock of several runs: a table and compare.png."""
    from monitoring.compare import compare_runs, format_table
    from monitoring.report import RunDirError

    try:
        rows, png = compare_runs(run_dirs, out)
    except RunDirError as exc:
        console.print(f"error: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(1) from None
    stdout = Console()
    stdout.print(format_table(rows))
    stdout.print(f"plot: {png}", markup=False, highlight=False)


@bench_app.command("wire")
def bench_wire(
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    seconds: Annotated[float, typer.Option(help="Measuring time per case.")] = 2.0,
) -> None:
    """Framing throughput between two processes vs raw zero-copy pyzmq and pickle."""
    from fcl_emu.bench.wire import run

    run(json_path, seconds, console)


@bench_app.command("round")
def bench_round(
    clients: Annotated[int, typer.Option(help="Emulated clients.")] = 300,
    rounds: Annotated[int, typer.Option(help="Rounds to time.")] = 5,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    data_root: DataRootOpt = None,
) -> None:
    """Coordinator time per round outside client training, and memory per idle client."""
    from fcl_emu.bench.round import run

    run(clients, rounds, json_path, data_root, console)


@bench_app.command("secagg")
def bench_secagg(
    clients: Annotated[int, typer.Option(min=3, help="Clients in the round (N).")] = 100,
    dim: Annotated[int, typer.Option(min=1, help="Values per client (D).")] = 1_000_000,
    neighbors: Annotated[Optional[int], typer.Option(
        help="Neighbours per client (K; default 2*ceil(log2 N); N-1: SecAgg).")] = None,
    threshold: Annotated[Optional[int], typer.Option(help="Shamir threshold t (default floor(K/2)+1).")] = None,
    dropout: Annotated[float, typer.Option(help="Probability that a client drops, at a random phase.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the inputs, graph and dropouts.")] = 0,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    flower: Annotated[bool, typer.Option(
        "--flower/--no-flower", help="Also time Flower's SecAgg+ client on the same N, K, D (needs flwr).")] = True,
) -> None:
    """SecAgg+ in one process: client and server time and bytes per phase; masking vs its lower bound and Flower."""
    from fcl_emu.bench.secagg import run

    try:
        run(clients, dim, neighbors, threshold, dropout, seed, json_path, console, flower=flower)
    except ValueError as exc:
        console.print(f"error: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(2) from None


@bench_app.command("metrics")
def bench_metrics(
    clients: Annotated[int, typer.Option(help="Clients of the simulated run that fills the registries.")] = 300,
    url: Annotated[Optional[list[str]], typer.Option(
        "--url", help="Also time scrapes of this live /metrics URL (repeatable).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """Prometheus metrics overhead: time per update, scrape time and size at --clients clients."""
    from fcl_emu.bench.metrics import run

    run(clients, list(url or []), json_path, console)


@bench_app.command("churn")
def bench_churn(
    methods: Annotated[str, typer.Option(help="Comma-separated learning methods.")] = "fedavg,fedlwf2t",
    rates: Annotated[str, typer.Option(
        help="Comma-separated churn rates c in [0, 1): P(client unavailable in a slot); runs bernoulli:(1-c).")]
        = "0,0.1,0.2,0.3,0.4,0.5",
    crash_rate: Annotated[float, typer.Option(
        "--crash-rate", min=0, max=1, help="edge.crash_rate of every run.")] = 0.0,
    clients: ClientsOpt = None,
    tasks: TasksOpt = None,
    rounds_per_task: RoundsOpt = None,
    clients_per_round: PerRoundOpt = None,
    min_participants: Annotated[Optional[int], typer.Option(
        "--min-participants", help="Fewer updates: round skipped (default: half of --clients-per-round).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of every run.")] = 0,
    data_root: DataRootOpt = None,
    out: Annotated[Path, typer.Option("--out", help="Writes churn.csv, churn.png and runs/ here.")] = Path("runs/churn"),
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="Base YAML config (over the bench's defaults; the flags above override it).")] = None,
) -> None:
    """Churn sweep: accuracy, forgetting, completed rounds and bytes against the churn rate (real `up` runs)."""
    from fcl_emu.bench import churn

    try:
        base = churn.base_config(config, clients=clients, tasks=tasks, rounds_per_task=rounds_per_task,
                                 clients_per_round=clients_per_round, min_participants=min_participants,
                                 data_root=data_root)
        sweep = churn.run(churn.parse_list(methods, "--methods"), churn.parse_rates(rates), crash_rate, seed, out,
                          base, console)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    raise typer.Exit(0 if all(r["status"] == "completed" for r in sweep.rows) else 1)


if __name__ == "__main__":
    app()
