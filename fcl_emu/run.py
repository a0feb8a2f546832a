"""Running the coordinator with live progress and a closing summary table."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

import pydantic

from fcl_emu.containers.faults import FaultInjector, Target, load_plan
from fcl_emu.containers.stats import ContainerStats
from fcl_emu.coordinator import checkpoint
from fcl_emu.coordinator.checkpoint import Checkpoint
from fcl_emu.coordinator.contracts import BindError, CheckpointError, Interrupted, RunAborted
from fcl_emu.coordinator.lifecycle import Coordinator
from fcl_emu.coordinator.resume import CHECKPOINT_DIR, run_fingerprint
from fcl_emu.runconfig import RunConfig, gpu_worker_metrics_port, load_config, metrics_ports
from fcl_emu.keys import RunKeys
from fcl_emu.launchers import NodeLauncher, launcher
from fcl_emu.writable import check_writable
from fcl_emu.monitoring import stack
from fcl_emu.monitoring.results import (RunSummary, SummaryNotWritten, energy_text, epsilon_text, failure_status,
                                        link_rows, link_text)
from fcl_emu.monitoring.settings_diff import non_default_settings, settings_text
from fcl_emu.progress import ProgressView
from fcl_emu.run_directory import empty_run_dir
from fcl_emu.runconfig.defaults import defaults_for
from fcl_emu.runconfig.nodes import CLIENTS_PER_NODE, nodes_chosen
from fcl_emu.scenario.datasets import find_dataset


def summary_table(summary: RunSummary, config: RunConfig | None = None) -> Table:
    """The closing table of a run; with its ``config``, the settings it did not leave at their defaults and those
    of its config file that it ignored."""
    table = Table(title=f"fcl-emu run: {summary.method} on {summary.dataset}", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")

    def pct(v):
        return "-" if v is None else f"{v:.2f}"

    table.add_row("status", escape(summary.status))  # a reason may name an extra: fcl-emu[text]
    table.add_row("average accuracy (%)", pct(summary.average_accuracy))
    table.add_row("average incremental (time-averaged) accuracy (%)", pct(summary.average_incremental_accuracy))
    table.add_row("average forgetting (%)", pct(summary.average_forgetting))
    if summary.learned_accuracy:
        table.add_row("each task right after it (%)", " ".join(pct(a) for a in summary.learned_accuracy))
    kr = summary.knowledge_retention
    table.add_row("knowledge retention KR_t / KR_s (%)", f"{pct(kr.temporal)} / {pct(kr.spatial)}")
    if summary.overlapping_shares:
        table.add_row("clients sharing samples", Text(summary.overlapping_shares, justify="left"))
    table.add_row("rounds (skipped)", f"{summary.rounds} ({summary.rounds_skipped})")
    for name, link in link_rows(summary):  # a star: one row; edge aggregators: one a tier
        table.add_row(name, link_text(link, summary.bytes_total))
    c = summary.clients
    table.add_row("clients joined / left / dropped", f"{c.joined} / {c.left} / {c.dropped}")
    table.add_row("rejected messages", str(sum(summary.rejected_messages.values())))
    table.add_row("wall clock", f"{summary.wall_clock_s:.1f} s")
    if summary.emulated_s is not None:
        table.add_row("emulated time", f"{summary.emulated_s:.1f} s")
    if summary.energy_joules is not None:
        table.add_row("clients' energy (compute share)", energy_text(summary.energy_joules))
    if summary.privacy is not None:
        table.add_row("epsilon (delta)", epsilon_text(summary.privacy))
    if config is not None:
        settings = config.model_dump(mode="json")
        changed = non_default_settings(settings, defaults_for(settings))
        table.add_row("settings (not default)", Text(settings_text(changed, separator="\n"), justify="left"))
        if config.ignored:
            table.add_row("ignored (config file)", Text("\n".join(map(str, config.ignored)), justify="left"))
    table.add_row("run directory", summary.run_dir)
    return table


def default_run_dir(config: RunConfig) -> Path:
    """A new folder: ``runs/<date>-<time>-<method>-<dataset>-s<seed>``, then ``-2``, ``-3`` ... where a run started
    in the same second has it."""
    first = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{config.method}-{config.scenario.dataset}-s{config.seed}"
    candidates = itertools.chain([first], (first.with_name(f"{first.name}-{n}") for n in itertools.count(2)))
    return next(path for path in candidates if not path.exists())


def resolve_metrics(config: RunConfig, start_nodes: bool) -> RunConfig:
    """Check the /metrics ports are free; ``--prometheus`` without a port picks a free block from 9400.

    Raises :class:`fcl_emu.monitoring.stack.PortInUseError`.
    """
    m = config.metrics
    if m.port is None:
        if not m.prometheus:
            return config
        count = 1 + (config.nodes if start_nodes or config.gpu.workers else 0) + config.gpu.workers
        port = stack.find_port_block(m.host, count)
        config = config.model_copy(update={"metrics": m.model_copy(update={"port": port})})
    stack.check_ports(config.metrics.host, metrics_ports(config, start_nodes))
    return config


def _start_metrics(config: RunConfig, coordinator: Coordinator, run_dir: Path, start_nodes: bool,
                   console: Console) -> stack.LocalPrometheus | None:
    """Serve the coordinator's /metrics, write the targets file, start the local Prometheus if asked."""
    m = config.metrics
    if not m.enabled:
        return None
    coordinator.metrics.serve(m.port, m.host)
    targets, path = _write_targets(config, coordinator, run_dir, start_nodes)
    nodes = f"; edge nodes {m.port + 1}-{m.port + config.nodes}" if start_nodes else ""
    workers = config.gpu.workers
    if workers:
        first = gpu_worker_metrics_port(config, 0)
        nodes += f"; gpu workers {first}-{first + workers - 1}"
    console.print(f"metrics: http://{targets[0].address}/metrics (coordinator){nodes}; targets {path}",
                  markup=False, highlight=False)
    if not m.prometheus:
        return None
    prometheus = stack.LocalPrometheus(run_dir, port=m.prometheus_port, scrape_interval_s=m.scrape_interval_s)
    try:
        prometheus.start()
    except RuntimeError as exc:
        console.print(f"warning: {exc}", style="yellow", markup=False, highlight=False)
        return None
    console.print(f"prometheus: {prometheus.url} (data in {prometheus.data_dir})", markup=False, highlight=False)
    # the first round waits for a first scrape of every process, so that rate() sees the run from its first
    # round (a histogram observed before a series' first sample is invisible to it): at most 2 intervals
    first_scrape = _cached_true(lambda: prometheus.scraped(len(targets)), every_s=0.25)
    coordinator.before_rounds.append(("the local Prometheus's first scrape of every process", first_scrape,
                                      2 * m.scrape_interval_s + 10.0))
    return prometheus


def _write_targets(config: RunConfig, coordinator: Coordinator, run_dir: Path, start_nodes: bool,
                   node_hosts: dict[str, str] | None = None) -> tuple[list[stack.Target], Path]:
    """The run's Prometheus targets file: the coordinator, the nodes (on ``node_hosts``' addresses where given, else
    on the metrics host) and the GPU workers."""
    m = config.metrics
    targets = stack.run_targets(m.host, m.port, config.nodes if start_nodes else 0, config.gpu.workers,
                                gpu_offset=config.nodes)
    targets = [dataclasses.replace(t, host=(node_hosts or {}).get(t.process, t.host)) for t in targets]
    return targets, stack.write_targets(run_dir, targets, coordinator.run_id)


def _cached_true(check: Callable[[], bool], every_s: float) -> Callable[[], bool]:
    """``check`` asked at most every ``every_s`` seconds, and never again once it held."""
    asked, held = -math.inf, False

    def cached() -> bool:
        nonlocal asked, held
        if not held and time.monotonic() - asked >= every_s:
            asked, held = time.monotonic(), check()
        return held
    return cached


def _stop_prometheus(prometheus: stack.LocalPrometheus | None, keep: bool, console: Console) -> None:
    if prometheus is None:
        return
    if keep:
        console.print(f"prometheus keeps running at {prometheus.url} (pid {prometheus.proc.pid}; "
                      f"stop it with: kill $(cat {prometheus.pid_file}))", markup=False, highlight=False)
        prometheus.detach()
    else:
        prometheus.stop()
        console.print(f"prometheus stopped; browse the run again with: prometheus "
                      f"--config.file={prometheus.config_file} --storage.tsdb.path={prometheus.data_dir}",
                      markup=False, highlight=False)


def check_before_start(config: RunConfig, start_nodes: bool, resume: Checkpoint | None,
                       run_dir: Path) -> RunConfig:
    """What can be checked before a run writes anything (its run directory, its keys): that ``run_dir`` can be
    written, the /metrics ports (``--prometheus`` without a port picks a free block), a new run's TCP port, and
    that the dataset is there (unless it is to be downloaded). The configuration is valid by construction.

    Raises :class:`fcl_emu.writable.NotWritableError`, :class:`fcl_emu.monitoring.stack.PortInUseError`,
    :class:`fcl_emu.coordinator.contracts.BindError` or :class:`fcl_emu.scenario.datasets.DatasetNotFoundError`.
    """
    check_writable(run_dir)
    config = resolve_metrics(config, start_nodes)
    if resume is None:
        _check_bind(config.network.bind)
    if not config.download:
        find_dataset(config.scenario.dataset, config.data_root)
    return config


def _check_bind(endpoint: str) -> None:
    """Raise :class:`BindError` if ``endpoint`` is ``tcp://HOST:PORT`` with a fixed port that cannot be bound now
    (the coordinator binds it after the run's keys are written). An address by interface name, and other
    transports, are left to the coordinator."""
    match = re.fullmatch(r"tcp://\[?(.+?)\]?:(\d+)", endpoint)
    if match is None or int(match[2]) == 0:
        return
    host = "0.0.0.0" if match[1] == "*" else match[1]
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            probe.bind((host, int(match[2])))
        except socket.gaierror:  # not a host name: an interface name, say, which ZeroMQ resolves itself
            return
        except OSError as exc:
            raise BindError(f"cannot bind {endpoint}: {exc.strerror}") from None


def _run(config: RunConfig, console: Console, start_nodes: bool, resume: Checkpoint | None = None,
         overwrite: bool = False) -> RunSummary:
    """Run (``resume``: continue) the run in its run directory; ``overwrite``: empty it first of the run it holds,
    once the checks before the start have passed (:func:`fcl_emu.run_directory.empty_run_dir`)."""
    run_dir = Path(config.run_dir) if config.run_dir else default_run_dir(config)
    config = check_before_start(config, start_nodes, resume, run_dir)
    if overwrite:
        empty_run_dir(run_dir, config.security.keys)
    keys = RunKeys(run_dir)
    if config.security.transport == "curve" and start_nodes:
        config = keys.write(config)
    elif config.security.transport == "plain":
        console.print("warning: --insecure: plain TCP, any peer that reaches the port may join and speak for any "
                      "client (docs/security.md)", style="yellow", markup=False, highlight=False)
    try:
        return _start_and_run(config, run_dir, console, start_nodes, resume, started=keys.keep)
    finally:
        keys.discard()  # unless the run started


def chosen_nodes_line(config: RunConfig) -> str | None:
    """The start line of ``up`` saying how many edge nodes it chose for the population; None where the user set
    ``nodes``."""
    if not nodes_chosen(config):
        return None
    clients = config.scenario.num_clients
    return (f"edge nodes: {config.nodes} (chosen for {clients:,} client{'s' * (clients != 1)}, at most "
            f"{CLIENTS_PER_NODE:,} per node; --nodes sets it)")


def _start_and_run(config: RunConfig, run_dir: Path, console: Console, start_nodes: bool,
                   resume: Checkpoint | None, started: Callable[[], None]) -> dict:
    """Start the coordinator, the nodes and the metrics; call ``started`` and run; stop them all."""
    nodes: NodeLauncher | None = None
    if start_nodes:
        nodes = launcher(config.containers.backend, config.containers.cluster)
        if (chosen := chosen_nodes_line(config)) is not None:
            console.print(chosen, markup=False, highlight=False)
        if config.containers.backend != "process":
            console.print(f"{config.containers.backend} backend: image {config.containers.image or '(build or reuse)'}",
                          markup=False, highlight=False)
        config = nodes.prepare(config, run_dir)
    view = ProgressView(config, console)
    try:
        coordinator = Coordinator(config, progress=view, resume=resume)
    except BaseException:
        if nodes is not None:
            nodes.stop(grace_s=0)
        raise
    resumed = "" if resume is None else \
        f" (resuming run {coordinator.run_id} after round {resume.state['global_round']})"
    console.print(f"coordinator listening on {coordinator.address}; run directory {run_dir}{resumed}")
    prometheus = None
    faults: FaultInjector | None = None
    container_stats: ContainerStats | None = None
    finished = False
    try:
        prometheus = _start_metrics(config, coordinator, run_dir, start_nodes, console)
        if nodes is not None:
            nodes.start(coordinator.address, config, run_dir / "logs")
            coordinator.watch_nodes(nodes.exited, nodes.count, nodes.hosts())
            elsewhere = nodes.metrics_addresses()
            if config.metrics.enabled and elsewhere:  # nodes on other hosts: scraped there
                _write_targets(config, coordinator, run_dir, True, elsewhere)
            target = None if config.containers.backend == "process" else nodes.container_target()
            if config.containers.faults is not None:
                faults = _inject_faults(config, target, coordinator, view)
            if config.metrics.enabled and target is not None:
                container_stats = ContainerStats(target.containers, target.classes, config.metrics.scrape_interval_s)
                coordinator.metrics.registry.register(container_stats)
        started()
        try:
            with view.progress, _signals_end_the_run():
                summary = coordinator.run(run_dir)
        except KeyboardInterrupt as exc:  # the coordinator wrote the summary and keeps its last checkpoint
            how = exc.signal_name if isinstance(exc, Interrupted) else "SIGINT"
            console.print(_interrupted(how, config, nodes), style="yellow", markup=False, highlight=False)
            summary = _read_summary(run_dir)
            _how_to_resume(run_dir, start_nodes, console)
        except RunAborted as exc:
            console.print(f"run aborted: {exc}", style="red", markup=False, highlight=False)
            summary = _read_summary(run_dir)
            _how_to_resume(run_dir, start_nodes, console)
        except Exception as exc:  # recorded as "failed: ..." by the coordinator; the traceback goes to a file
            summary = _failed(exc, run_dir, console)
            _how_to_resume(run_dir, start_nodes, console)
            if summary is None:
                raise RunNotRecorded(str(exc) if isinstance(exc, SummaryNotWritten) else
                                     f"the run wrote no summary ({run_dir / 'summary.json'})") from None
        finished = True
    finally:
        if finished and config.metrics.enabled:
            time.sleep(config.metrics.linger)  # a last scrape sees the end (the nodes linger alongside)
        if faults is not None:
            faults.close()
        if container_stats is not None:
            container_stats.close()
        if nodes is not None:
            nodes.stop()
        coordinator.close()
        _stop_prometheus(prometheus, config.metrics.keep_prometheus and finished, console)
    console.print(summary_table(summary, config))
    return summary


@contextmanager
def _signals_end_the_run() -> Iterator[None]:
    """SIGINT and SIGTERM end the run the same way, once (a second signal while the run is being closed is
    ignored): :class:`Interrupted` with the signal's exit code. Only the main thread can take signals; elsewhere
    (a run started from a thread) the process's handlers stay."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signal.Signals(signum).name, 128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _inject_faults(config: RunConfig, target: Target, coordinator: Coordinator,
                   view: ProgressView) -> FaultInjector:
    """Carry out the run's fault plan on its containers, timed by the coordinator's progress events."""
    injector = FaultInjector(load_plan(config.containers.faults), target, config.seed,
                             record=coordinator.record_fault)

    def progress(kind: str, info: dict) -> None:
        view(kind, info)
        injector.on_progress(kind, info)

    coordinator.progress = progress
    return injector


class RunNotRecorded(Exception):
    """A run ended without writing its summary.json (a full disk, say); its status was printed."""


def _failed(exc: Exception, run_dir: Path, console: Console) -> RunSummary | None:
    """After a run that ``exc`` ended: its traceback in RUN_DIR/logs/failure.txt (where the disk has room for it),
    one line with its status, and the summary it recorded (None if it wrote none)."""
    failure: Path | None = run_dir / "logs" / "failure.txt"
    try:
        failure.parent.mkdir(parents=True, exist_ok=True)
        failure.write_text(traceback.format_exc())
    except OSError:
        failure = None
    summary = None
    if not isinstance(exc, SummaryNotWritten):  # else a summary.json there is an earlier session's
        try:
            summary = _read_summary(run_dir)
        except (OSError, ValueError):
            pass
    status = exc.status if isinstance(exc, SummaryNotWritten) else (
        failure_status(exc) if summary is None else summary.status)
    where = "" if failure is None else f" (traceback: {failure})"
    console.print(f"run {status}{where}", style="red", markup=False, highlight=False)
    return summary


def _interrupted(how: str, config: RunConfig, nodes: NodeLauncher | None) -> str:
    """What an interrupted run does before its summary, said at once: what is stopped and what is waited for."""
    stopping = [f"{n} {what}{'s' * (n != 1)}" for n, what in ((nodes.count if nodes else 0, "edge node"),
                                                              (config.gpu.workers, "GPU worker")) if n]
    scrape = f"; waiting for a last metrics scrape ({config.metrics.linger:g} s)" if config.metrics.enabled else ""
    return (f"run interrupted by {how}: the round in progress is dropped and the summary written"
            f"{'; stopping ' + ' and '.join(stopping) if stopping else ''}{scrape} ...")


def _how_to_resume(run_dir: Path, start_nodes: bool, console: Console) -> None:
    """After a run that ended early: the command that continues it from its checkpoint, if it has one."""
    if checkpoint.exists(run_dir / CHECKPOINT_DIR):
        console.print(f"its checkpoint is kept: continue with `fcl-emu {'up' if start_nodes else 'coordinator'} "
                      f"--resume {run_dir}`", markup=False, highlight=False)


def _read_summary(run_dir: Path) -> RunSummary:
    return RunSummary.load(run_dir / "summary.json")


def run_local(config: RunConfig, console: Console, resume: Checkpoint | None = None,
              overwrite: bool = False) -> RunSummary:
    """``fcl-emu up``: coordinator in this process, edge nodes as child processes."""
    return _run(config, console, start_nodes=True, resume=resume, overwrite=overwrite)


def run_coordinator(config: RunConfig, console: Console, resume: Checkpoint | None = None,
                    overwrite: bool = False) -> RunSummary:
    """``fcl-emu coordinator``: nodes are started elsewhere by the user."""
    return _run(config, console, start_nodes=False, resume=resume, overwrite=overwrite)


class ResumeError(Exception):
    """A run directory that cannot be resumed (the message says why, in one line)."""


def open_resume(run_dir: Path, overrides: dict) -> tuple[RunConfig, Checkpoint]:
    """The config (RUN_DIR/config.yaml with ``overrides``, settings that do not change the run) and the
    checkpoint of an interrupted run, checked before anything starts."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise ResumeError("no such directory")
    if not config_path.is_file():
        raise ResumeError("not a run directory (it has no config.yaml)")
    try:
        config = load_config(config_path, {**overrides, "run_dir": str(run_dir)})
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        raise ResumeError(f"{config_path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    except ValueError as exc:
        raise ResumeError(str(exc).splitlines()[0]) from None
    if not checkpoint.exists(run_dir / CHECKPOINT_DIR):
        raise ResumeError("it has no checkpoint (the coordinator died before its clients had joined, "
                          "or the run predates checkpoints): start the run again")
    try:
        ckpt = checkpoint.load(run_dir / CHECKPOINT_DIR)
    except CheckpointError as exc:
        raise ResumeError(str(exc)) from None
    if ckpt.state.get("fingerprint") != run_fingerprint(config):
        raise ResumeError("its checkpoint was written under another configuration than its config.yaml")
    if ckpt.state.get("complete") and _summary_status(run_dir) == "completed":
        raise ResumeError("the run has completed; there is nothing to resume")
    return config, ckpt


def _summary_status(run_dir: Path) -> str | None:
    try:
        return _read_summary(run_dir).status
    except (OSError, ValueError):  # ValueError: not JSON, or not a summary (msgspec.ValidationError)
        return None
