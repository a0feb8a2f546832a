"""``fcl-emu bench soak``: one long run on the emulated clock under a seeded schedule of real faults.

The same ``fcl-emu up`` run (MNIST, the process backend, ``rounds.clock: emulated``, every client a phone of one
fixed cost so emulated times are exact) is run twice: once undisturbed (the baseline) and once while this
process injects faults into it, one after another, at rounds drawn from ``--seed``:

- ``node_stop``: SIGSTOP to an edge node, SIGCONT after a while (well within the liveness timeout): only a delay;
- ``net_cut``: every TCP connection of an edge node to the coordinator dropped by the kernel for a while
  (iptables DROP rules on the node's ports, both ways; root only): only a delay. A running node cannot be moved
  into another network namespace and ``up`` forks its nodes in its own, so rules on the node's connections are
  the closest real cut of one node: its packets are lost and TCP retransmits them once the cut is lifted;
- ``node_kill``: SIGKILL to an edge node: its clients and their updates are gone (a ``node_exit`` event), so the
  accuracy matrix may differ from the baseline's from that task on;
- ``coordinator_kill``: SIGKILL to ``up`` (its edge nodes end with it), then ``fcl-emu up --resume RUN_DIR``;
- ``disk_full``: the run directory lives on a small tmpfs (root only); a filler file takes all its space, the
  run must end ``failed: disk full (PATH)`` with its last checkpoint intact, and resume once the filler is gone.

With ``--cluster local`` the faulted run's edge nodes are Swarm services on a local cluster of several hosts,
and the faults are those of hosts and containers (:mod:`fcl_emu.bench.soak_cluster`).

Kinds come in shuffled cycles, so ``--faults`` at least the number of kinds injects each kind at least once;
faults fall in the run's first three quarters, lossy ones (:data:`LOSSY`: node kills, container kills, lost
hosts) on the last of their rounds, so that everything before them is checked exactly. A fault whose round has
passed (the ones before it took longer) comes at once; one that finds the run ended is recorded as not injected.
Checks, besides each fault's own: no round aggregates a client's update twice and no round is recorded twice
without a resume between (the ``contributors`` of each round event in ``events.jsonl``); the checkpoint's
position never goes back and the checkpoint loads (SHA-256 checked) whenever the coordinator is down; no
process of the run is left afterwards; the accuracy matrix equals the baseline's, or, after a lossy fault,
equals it in every row of a task that ended before the first one, with the differences recorded
(:mod:`fcl_emu.bench.soak_checks`).

Writes ``OUT/soak.json`` (configuration, faults, checks, comparison, faults survived per hour) and
``OUT/faults.csv`` (one row per fault); the runs are ``OUT/baseline/`` and ``OUT/faulted/``.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

import psutil
import yaml
from rich.console import Console
from rich.table import Table

from fcl_emu.bench.churn import emulated_base, run_point
from fcl_emu.runconfig.config import merge_config
from fcl_emu.bench.soak_checks import compare, double_counts, read_events
from fcl_emu.bench.soak_cluster import ClusterSoak
from fcl_emu.bench.soak_run import LIVENESS_S, Fault, FaultedRun, delayed_only
from fcl_emu.monitoring.results import RunSummary


KINDS = ("node_stop", "net_cut", "node_kill", "coordinator_kill", "disk_full")
LOSSY = frozenset({"node_kill", "container_kill", "lose_host"})  # faults after which a run may differ
# how long each delay lasts at most, as a share of the liveness timeout: a TCP retransmission after a cut comes up
# to the cut's length later, so cuts stay under a quarter of it
LONGEST = {"node_stop": 0.4, "net_cut": 0.25, "partition": 0.25, "slow_host": 0.4, "container_pause": 0.4}
CSV_COLUMNS = ["kind", "at_round", "target", "injected_at_s", "duration_s", "survived", "skipped", "problems",
               "detail"]
TMPFS_SIZE = "64m"
IPTABLES_CHAIN = "FCL_SOAK"

DEFAULT_CONFIG: dict[str, Any] = {
    "scenario": {"dataset": "mnist", "num_tasks": 2, "num_clients": 8, "samples_per_client_task": 200},
    "rounds": {"clients_per_round": 4, "rounds_per_task": 10, "deadline_s": 60.0, "clock": "emulated",
               "eval_every": 10**6},  # the accuracy matrix only: rounds stay short, faults many
    "training": {"local_epochs": 1},
    "network": {"heartbeat_interval_s": 0.5, "liveness_timeout_s": LIVENESS_S, "join_timeout_s": 120.0},
    "model": "cnn",
    "nodes": 4,
    "device": "cpu",
}


def schedule(kinds: Sequence[str], count: int, total_rounds: int, seed: int) -> list[Fault]:
    """``count`` faults: kinds in shuffled cycles of ``kinds``, at rounds drawn in the first three quarters of the
    run (the rest leaves room for faults that lag behind a fast run). Lossy faults (:data:`LOSSY`) take the last
    of these rounds: up to the first, the run must match the baseline round by round."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < count:
        cycle = list(kinds)
        rng.shuffle(cycle)
        order += cycle
    order = sorted(order[:count], key=lambda kind: kind in LOSSY)
    last = max(1, 3 * total_rounds // 4)  # distinct rounds while there are enough
    rounds = sorted(rng.sample(range(1, last + 1), min(count, last)) + [rng.randint(1, last)
                                                                         for _ in range(count - last)])
    return [Fault(kind, at, round(rng.uniform(0.0, 1.0), 3),
                  round(rng.uniform(0.5, 1.0) * LONGEST.get(kind, 0.0) * LIVENESS_S, 2), rng.random())
            for kind, at in zip(order, rounds)]


# ------------------------------------------------------------------ injectors
def _pick_node(run: FaultedRun, fault: Fault) -> Optional[psutil.Process]:
    nodes = run.nodes()
    if not nodes:
        fault.skipped = "no live edge node"
        return None
    name = list(nodes)[int(fault.pick * len(nodes))]
    fault.target = name
    return nodes[name]


def inject_node_stop(run: FaultedRun, fault: Fault) -> None:
    node = _pick_node(run, fault)
    if node is None:
        return
    node.send_signal(signal.SIGSTOP)
    try:
        time.sleep(fault.duration_s)
    finally:
        node.send_signal(signal.SIGCONT)
    fault.detail = f"SIGSTOP pid {node.pid}, SIGCONT after {fault.duration_s:g} s"
    delayed_only(run, fault, [fault.target])


def _iptables(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True)


def net_cut_unavailable() -> Optional[str]:
    """Why a network cut cannot be injected here, or None."""
    if os.geteuid() != 0:
        return "not root: iptables rules need CAP_NET_ADMIN"
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    probe = _iptables("-L", "OUTPUT", "-n")
    return None if probe.returncode == 0 else f"iptables refused: {probe.stderr.strip()}"


def inject_net_cut(run: FaultedRun, fault: Fault) -> None:
    node = _pick_node(run, fault)
    if node is None:
        return
    argv = node.cmdline()
    port = int(argv[argv.index("--connect") + 1].rsplit(":", 1)[1])
    ports = sorted({c.laddr.port for c in node.net_connections("tcp") if c.raddr and c.raddr.port == port})
    if not ports:
        fault.skipped = "the node has no connection to the coordinator"
        return
    _iptables("-N", IPTABLES_CHAIN)
    _iptables("-I", "OUTPUT", "-j", IPTABLES_CHAIN)
    try:
        for p in ports:  # every packet passes OUTPUT on its way: from the node, and to it (only this connection)
            for source, destination in ((p, port), (port, p)):
                rule = _iptables("-A", IPTABLES_CHAIN, "-p", "tcp", "--sport", str(source), "--dport",
                                 str(destination), "-j", "DROP")
                if rule.returncode != 0:
                    raise RuntimeError(f"iptables: {rule.stderr.strip()}")
        time.sleep(fault.duration_s)
        dropped = _dropped_packets()
    finally:
        remove_net_cut()
    fault.detail = (f"{len(ports)} TCP connections of pid {node.pid} cut for {fault.duration_s:g} s "
                    f"({dropped} packets dropped)")
    if not dropped:  # heartbeats go out twice a second: a cut that drops nothing cut nothing
        fault.problems.append("the cut dropped no packet")
    delayed_only(run, fault, [fault.target])


def _dropped_packets() -> int:
    """Packets the cut's rules have dropped so far."""
    listing = _iptables("-L", IPTABLES_CHAIN, "-v", "-n", "-x").stdout.splitlines()
    return sum(int(line.split()[0]) for line in listing[2:] if line.split() and line.split()[0].isdigit())


def remove_net_cut() -> None:
    _iptables("-D", "OUTPUT", "-j", IPTABLES_CHAIN)
    _iptables("-F", IPTABLES_CHAIN)
    _iptables("-X", IPTABLES_CHAIN)


def inject_node_kill(run: FaultedRun, fault: Fault) -> None:
    if len(run.nodes()) < 2:
        fault.skipped = "last live node (killing it ends the run: every edge node exited)"
        return
    node = _pick_node(run, fault)
    node.send_signal(signal.SIGKILL)
    fault.lost = [fault.target]
    fault.detail = f"SIGKILL pid {node.pid}"
    if not run.wait(lambda: fault.target in run.node_exits(fault.events_before) or not run.running(), 15.0) \
            or fault.target not in run.node_exits(fault.events_before):
        fault.problems.append("no node_exit event recorded")


def _resume(run: FaultedRun, fault: Fault) -> None:
    """Check the coordinator's processes are gone and its checkpoint intact, then ``up --resume``."""
    if not run.wait(lambda: not [p for p in run.alive_of_run()], 15.0):
        fault.problems.append(f"orphan processes after the coordinator ended: {run.alive_of_run()}")
        run.stop_all()
    fault.problems += run.checkpoint_problems()
    count = len([e for e in run.events() if e["event"] == "resume"])
    run.start(resume=True)
    if not run.wait(lambda: len([e for e in run.events() if e["event"] == "resume"]) > count or not run.running(),
                    180.0):
        fault.problems.append("no resume event within 180 s")


def inject_coordinator_kill(run: FaultedRun, fault: Fault) -> None:
    fault.target = "coordinator"
    fault.detail = f"SIGKILL pid {run.proc.pid}, then up --resume"
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait()
    _resume(run, fault)


def fill(path: Path) -> int:
    """Write zeros to ``path`` until the file system is full; the bytes written."""
    written, chunk = 0, b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    return written
                chunk = chunk[:len(chunk) // 2]


def _stray_arrays(directory: Path) -> list[str]:
    """The arrays files beside the one the checkpoint names: what a discarded save left behind."""
    try:
        named = json.loads((directory / "state.json").read_text())["arrays"]["file"]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # checkpoint_problems says what is wrong with it
    stray = sorted(p.name for p in directory.glob("arrays-*.npz") if p.name != named)
    return [f"the discarded checkpoint left {', '.join(stray)}"] if stray else []


def inject_disk_full(run: FaultedRun, fault: Fault, mount: Optional[Path]) -> None:
    if mount is None:
        fault.skipped = "the run directory is not on its own small file system (see the soak's disk_full note)"
        return
    fault.target = str(mount)
    filler = mount / "filler"
    size = fill(filler)
    try:
        if not run.wait(lambda: not run.running(), 180.0):
            fault.problems.append("the run did not end within 180 s of the disk filling")
            run.stop_all()
        log = run.log_path.read_text(errors="replace")
        last = " ".join(log[log.rfind("$ "):].split())  # the terminal may have wrapped a line at any space
        if run.proc.returncode == 0:
            fault.skipped = "the run completed before it wrote to the full disk"
            return
        if "run failed: disk full (" not in last:
            fault.problems.append("no 'run failed: disk full (PATH)' line")
        try:
            status = RunSummary.load(run.run_dir / "summary.json").status
        except (OSError, ValueError):  # allowed when the disk is still too full for it, and then said
            status = "(no summary.json)" if "summary.json could not be written" in last else "(summary.json lost)"
        if not status.startswith(("failed: disk full (", "(no summary.json)")):
            fault.problems.append(f"status {status!r}")
        fault.detail = f"filler of {size / 1e6:.1f} MB; exit {run.proc.returncode}; {status}"
        fault.problems += _stray_arrays(run.run_dir / "checkpoint")
    finally:
        filler.unlink()
    _resume(run, fault)


# ------------------------------------------------------------------ the soak
def soak_config(base: dict, clients: int, nodes: int, tasks: int, rounds_per_task: int, samples: int, seed: int,
                data_roots: list[Path], out: Path) -> dict:
    config = merge_config(base, {
        "scenario": {"num_clients": clients, "num_tasks": tasks, "samples_per_client_task": samples, "seed": seed},
        "rounds": {"rounds_per_task": rounds_per_task,
                   "clients_per_round": min(clients, base["rounds"]["clients_per_round"])},
        "nodes": nodes, "seed": seed, "data_root": [str(Path(p).resolve()) for p in data_roots]})
    return emulated_base(config, out)


def _mount_tmpfs(mount: Path) -> tuple[Optional[Path], Optional[str]]:
    """A small tmpfs at ``mount`` for the run directory; (mount, None) or (None, why not)."""
    if os.geteuid() != 0:
        return None, "not root: mounting a tmpfs needs CAP_SYS_ADMIN"
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    return (mount, None) if done.returncode == 0 else (None, f"mount refused: {done.stderr.strip()}")


def run_faulted(config: dict, faults: list[Fault], out: Path, console: Console,
                cluster: Optional[ClusterSoak] = None) -> tuple[FaultedRun, dict]:
    """The faulted run, with ``faults`` injected in order (on ``cluster``'s hosts and containers where given);
    (the run, notes on what could not be injected)."""
    notes: dict[str, str] = {}
    mount, why = _mount_tmpfs(out / "faulted-tmpfs") if "disk_full" in {f.kind for f in faults} else (None, None)
    if why:
        notes["disk_full"] = why
    cut = net_cut_unavailable() if "net_cut" in {f.kind for f in faults} else None
    if cut:
        notes["net_cut"] = cut
    run_dir = (mount or out) / "faulted"
    config_path = out / "faulted-config.yaml"
    config_path.write_text(yaml.safe_dump({**config, "run_dir": str(run_dir)}, sort_keys=False))
    run = FaultedRun(config_path, run_dir, out / "faulted-up.log")
    injectors = {"node_stop": inject_node_stop, "net_cut": inject_net_cut, "node_kill": inject_node_kill,
                 "coordinator_kill": inject_coordinator_kill,
                 "disk_full": lambda r, f: inject_disk_full(r, f, mount),
                 **(cluster.injectors() if cluster is not None else {})}
    # containers of a resumed run start slowly: a cluster's faults wait for its first round, to find them
    ready = run.going if cluster is not None else (lambda: True)
    try:
        run.start()
        for fault in faults:
            if not run.wait(lambda: (run.last_round() >= fault.at_round and ready()) or not run.running(), 900.0) \
                    or not run.running() or run.ended():
                fault.skipped = "the run had ended"
                continue
            if run.last_round() == fault.at_round:  # a fault that lags behind the run is injected at once
                time.sleep(fault.offset_s)
            if fault.kind in notes:
                fault.skipped = notes[fault.kind]
                continue
            fault.events_before = len(run.events())
            fault.injected_at_s = round(time.monotonic() - run.started, 2)
            try:
                injectors[fault.kind](run, fault)
            except Exception as exc:  # an injector that could not finish (a container gone under it): a failure
                fault.problems.append(f"the injector failed: {type(exc).__name__}: {exc}")
            console.print(f"{fault.injected_at_s:8.1f} s  round {fault.at_round:3d}  {fault.kind:16s} "
                          f"{fault.target or '':12s} {fault.skipped or fault.detail} "
                          f"{'; '.join(fault.problems)}", markup=False, highlight=False)
        if not run.wait(lambda: not run.running(), 1800.0):
            notes["end"] = "the run did not end within 30 minutes of the last fault"
        run.wait(lambda: not run.alive_of_run(), 15.0)
        alive = run.alive_of_run()
        run.orphans = [f"processes {alive}"] if alive else []
        if cluster is not None:
            run.orphans += cluster.leftovers(run)
    finally:
        run.stop_all()
        if "net_cut" in {f.kind for f in faults} and not cut:
            remove_net_cut()
        if mount is not None:
            if run_dir.exists():
                shutil.copytree(run_dir, out / "faulted", dirs_exist_ok=True)
            subprocess.run(["umount", str(mount)], capture_output=True)
            run.run_dir = out / "faulted"
    return run, notes


def run(count: int, kinds: Sequence[str], clients: int, nodes: int, tasks: int, rounds_per_task: int, samples: int,
        seed: int, data_roots: list[Path], out: Path, console: Console,
        cluster: Optional[ClusterSoak] = None) -> dict:
    """The baseline, the faulted run (on ``cluster``, made while the baseline runs and removed at the end, where
    given) and every check; writes ``soak.json`` and ``faults.csv``; the result."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = soak_config(DEFAULT_CONFIG, clients, nodes, tasks, rounds_per_task, samples, seed, data_roots, out)
    faults = schedule(kinds, count, tasks * rounds_per_task, seed)
    say = lambda text: console.print(text, markup=False, highlight=False)  # noqa: E731
    with ThreadPoolExecutor(1) as pool:
        made = pool.submit(cluster.up, lambda _msg: None) if cluster is not None else None
        try:
            started = time.monotonic()
            baseline, baseline_status = run_point(config, out / "baseline", 1800.0)
            baseline_s = time.monotonic() - started
            say(f"baseline: {baseline_status} in {baseline_s:.0f} s")
            faulted_config = config
            if made is not None:
                made.result()  # a cluster that could not be made fails the soak here, saying why
                say(f"cluster {cluster.cluster.name}: {len(cluster.cluster.hosts)} hosts, image {cluster.image}")
                faulted_config = merge_config(config, cluster.config())
            started = time.monotonic()
            faulted_run, notes = run_faulted(faulted_config, faults, out, console, cluster)
            faulted_s = time.monotonic() - started
        finally:
            if made is not None:
                wait([made])
                cluster.down()
    events, orphans = faulted_run.events(), faulted_run.orphans
    try:
        faulted = RunSummary.load(faulted_run.run_dir / "summary.json")
    except (OSError, ValueError):
        faulted = None
    checks: dict[str, list[str]] = {
        "status": [] if faulted is not None and faulted.status == "completed" else
        [f"faulted run ended {faulted.status if faulted else '(no summary.json)'}"],
        "double_counts": double_counts(events),
        "checkpoint": faulted_run.checkpoint_problems() + (
            [] if faulted_run.positions == sorted(faulted_run.positions) else
            [f"checkpoint positions not monotone: {faulted_run.positions}"]),
        "orphans": [f"left: {'; '.join(orphans)}"] if orphans else [],
    }
    if baseline is not None and faulted is not None:
        losses = [(f.events_before, set(f.lost)) for f in faults if f.lost]
        comparison = compare(baseline, faulted, read_events(out / "baseline"), events, losses)
    else:
        comparison = {"problems": [f"no summary to compare (baseline {baseline_status})"]}
    checks["comparison"] = comparison["problems"]
    for fault in faults:
        later = events[fault.events_before:]
        progressed = any(e["event"] == "round" for e in later) or any(
            e["event"] == "end" and e.get("status") == "completed" for e in later)
        if fault.injected_at_s is not None and not fault.skipped:
            fault.survived = not fault.problems and progressed and not checks["status"]
    survived = [f for f in faults if f.survived]
    injected = [f for f in faults if f.injected_at_s is not None and not f.skipped]
    result = {
        "config": config, "seed": seed, "baseline_s": round(baseline_s, 1), "faulted_s": round(faulted_s, 1),
        "faults_injected": len(injected), "faults_survived": len(survived),
        "faults_per_hour": round(len(survived) / (faulted_s / 3600), 1) if faulted_s > 0 else None,
        "resumes": sum(e["event"] == "resume" for e in events),
        "cluster": None if cluster is None else {"hosts": [h.name for h in cluster.cluster.hosts],
                                                 "lost": sorted(cluster.lost), "image": cluster.image,
                                                 "config": faulted_config["containers"]},
        "skipped": notes, "faults": [asdict(f) for f in faults], "checks": checks, "comparison": comparison,
        "ok": not any(checks.values()) and len(survived) == len(injected),
    }
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(out / "faults.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for fault in faults:
            writer.writerow({**asdict(fault), "problems": "; ".join(fault.problems)})
    _print(result, console)
    return result


def _print(result: dict, console: Console) -> None:
    where = f" on {len(result['cluster']['hosts'])} hosts" if result["cluster"] else ""
    table = Table(title=f"soak{where}: {result['faults_survived']} of {result['faults_injected']} faults survived in "
                        f"{result['faulted_s']:.0f} s ({result['faults_per_hour']} per hour, {result['resumes']} "
                        f"resumes)")
    for column in ("kind", "round", "target", "survived", "what happened"):
        table.add_column(column)
    for f in result["faults"]:
        table.add_row(f["kind"], str(f["at_round"]), f["target"] or "", str(f["survived"]),
                      f["skipped"] or "; ".join([f["detail"], *f["problems"]]))
    console.print(table)
    for name, problems in result["checks"].items():
        console.print(f"{name}: {'ok' if not problems else '; '.join(problems)}", markup=False, highlight=False)
    comparison = result["comparison"]
    console.print(f"accuracy matrix: {'the same as' if comparison.get('same') else 'differs from'} the baseline's; "
                  f"{comparison.get('explanation', '-')}", markup=False, highlight=False)
    drift = comparison.get("emulated_time")
    if drift:
        console.print(f"emulated clock over the {drift['rounds']} rounds before any node exit: at most "
                      f"{drift['max_clock_difference_s']:.6f} s from the baseline's; {drift['extra_bytes_sent']} bytes "
                      f"more sent (task starts sent again to the clients of nodes a resume started)",
                      markup=False, highlight=False)
