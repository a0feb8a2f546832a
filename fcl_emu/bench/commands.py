"""``fcl-emu bench ...``: the benchmarks, each printing ratios against a baseline measured in the same run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from fcl_emu import options
from fcl_emu.bench.flower_env import FlowerEnvError, FlowerPython, NoFlowerEnv, create, created_lines, find_python
from fcl_emu.command_line import console, fail, folder, writable
from fcl_emu.runconfig.nodes import CLIENTS_PER_NODE

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios against baselines measured in the same run).")
ClientsOpt = options.elsewhere("clients")
PerRoundOpt = options.elsewhere("clients_per_round")
DataRootOpt = options.elsewhere("data_root")
TasksOpt = options.elsewhere("tasks")
RoundsOpt = options.elsewhere("rounds_per_task")
FlowerPythonOpt = Annotated[Optional[Path], typer.Option(
    help="Python of Flower's environment (default: $FCL_EMU_FLOWER_PYTHON, else the one `fcl-emu bench flower-env` "
         "creates).")]


def int_list(text: str, flag: str, minimum: int) -> list[int]:
    """``text`` as comma-separated integers, each at least ``minimum``; else a usage error naming ``flag``."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: use comma-separated integers", param_hint=flag) from None
    if not values or min(values) < minimum:
        raise typer.BadParameter(f"{text!r}: give integers of at least {minimum}", param_hint=flag)
    return values


@bench_app.command("wire")
def bench_wire(
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    seconds: Annotated[float, typer.Option(min=0.1, help="Measuring time per case.")] = 2.0,
) -> None:
    """Framing throughput between two processes vs raw zero-copy pyzmq and pickle."""
    from fcl_emu.bench.wire import run

    writable(folder(json_path))
    run(json_path, seconds, console)


@bench_app.command("round")
def bench_round(
    clients: Annotated[int, typer.Option(min=3, help="Emulated clients.")] = 300,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds to time.")] = 5,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    data_root: DataRootOpt = None,
) -> None:
    """Coordinator time per round outside client training, and memory per idle client."""
    from fcl_emu.bench.round import run

    writable(folder(json_path))
    run(clients, rounds, json_path, data_root, console)


@bench_app.command("energy")
def bench_energy(
    cases: Annotated[str, typer.Option(help="Comma-separated cases (fedavg is always run, as the baseline): "
                                            "fedavg, fedbuff, mfcl, glfc, fedavg-low-battery.")] =
        "fedavg,fedbuff,mfcl,glfc,fedavg-low-battery",
    clients: Annotated[int, typer.Option(min=2, help="Emulated clients.")] = 20,
    clients_per_round: Annotated[int, typer.Option(min=1, help="Clients a round (and FedBuff's buffer).")] = 5,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds per task (two tasks).")] = 4,
    samples: Annotated[int, typer.Option(min=1, help="Training samples of each client per task.")] = 200,
    seed: Annotated[int, typer.Option(help="Seed of every run.")] = 0,
    target_accuracy: Annotated[float, typer.Option(min=0, max=100, help="Accuracy (%) whose energy is "
                                                                         "reported.")] = 50.0,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="Write the energy bar chart (PNG) here.")] =
        None,
    data_root: DataRootOpt = None,
) -> None:
    """Clients' energy per method on the default device mix: compute vs radio, energy to a target accuracy, the
    class that pays most, low-battery dropouts; ratios against FedAvg in the same run."""
    from fcl_emu.bench.energy import parse_cases, run

    try:
        chosen = parse_cases(cases)
    except ValueError as exc:
        fail(str(exc))
    writable(folder(json_path))
    writable(folder(plot_path))
    try:
        run(chosen, clients, clients_per_round, rounds, samples, seed, target_accuracy, json_path,
            plot_path, data_root, console)
    except (ValueError, RuntimeError) as exc:
        fail(str(exc), 1)


@bench_app.command("hierarchy")
def bench_hierarchy(
    populations: Annotated[str, typer.Option(help="Comma-separated client populations.")] = "1000,10000",
    aggregators: Annotated[str, typer.Option(help="Comma-separated edge-aggregator counts (the star, 0, always "
                                                  "runs, as the baseline).")] = "4",
    edge_rounds: Annotated[str, typer.Option(help="Comma-separated edge rounds per cloud round (HierFAVG's K), each "
                                                  "with every aggregator count.")] = "1",
    clients_per_round: Annotated[int, typer.Option(min=1, help="Clients a round.")] = 100,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds (one task).")] = 5,
    seed: Annotated[int, typer.Option(help="Seed of every run.")] = 0,
    edge_uplink_mbps: Annotated[Optional[float], typer.Option(min=0, help="Each aggregator's link up to the "
                                                                           "coordinator (unset: not limited).")] = None,
    edge_downlink_mbps: Annotated[Optional[float], typer.Option(min=0, help="And down.")] = None,
    edge_latency_ms: Annotated[float, typer.Option(min=0, help="Its one-way latency.")] = 0.0,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="Write the plot (PNG) here.")] = None,
    data_root: DataRootOpt = None,
) -> None:
    """A star against two tiers (edge aggregators) at growing populations: update bytes into the coordinator, its
    downlink bytes and its work per round, accuracy, emulated time; ratios against the star in the same run."""
    from fcl_emu.bench.hierarchy import run

    writable(folder(json_path))
    writable(folder(plot_path))
    link = {k: v for k, v in (("uplink_mbps", edge_uplink_mbps), ("downlink_mbps", edge_downlink_mbps),
                              ("latency_ms", edge_latency_ms)) if v}
    sizes, tiers = int_list(populations, "--populations", 2), int_list(aggregators, "--aggregators", 0)
    edge_round_counts = int_list(edge_rounds, "--edge-rounds", 1)
    try:
        run(sizes, tiers, edge_round_counts, clients_per_round, rounds, seed, link, json_path, plot_path, data_root,
            console)
    except (ValueError, RuntimeError) as exc:
        fail(str(exc), 1)


@bench_app.command("overcommit")
def bench_overcommit(
    clients: Annotated[int, typer.Option(min=2, help="Emulated clients.")] = 24,
    clients_per_round: Annotated[int, typer.Option(min=1, help="Updates a round waits for (K).")] = 4,
    overcommit: Annotated[float, typer.Option(min=1.0, help="Clients selected per round: ceil(K x this).")] = 2.0,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds per task (two tasks).")] = 3,
    samples: Annotated[int, typer.Option(min=1, help="Training samples of each client per task.")] = 600,
    seed: Annotated[int, typer.Option(help="Seed of both runs.")] = 0,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    data_root: DataRootOpt = None,
) -> None:
    """Host CPU of an overcommitted emulated run, cancelling late trainings vs training every selected client."""
    from fcl_emu.bench.overcommit import run

    writable(folder(json_path))
    try:
        run(clients, clients_per_round, overcommit, rounds, samples, seed, json_path, data_root, console)
    except RuntimeError as exc:
        fail(str(exc), 1)


@bench_app.command("secagg")
def bench_secagg(
    clients: Annotated[int, typer.Option(min=3, help="Clients in the round (N).")] = 100,
    dim: Annotated[int, typer.Option(min=1, help="Values per client (D).")] = 1_000_000,
    neighbors: Annotated[Optional[int], typer.Option(
        min=2, help="Neighbours per client (K; default 2*ceil(log2 N); N-1: SecAgg).")] = None,
    threshold: Annotated[Optional[int], typer.Option(min=2, help="Shamir threshold t (default floor(K/2)+1).")] = None,
    dropout: Annotated[float, typer.Option(help="Probability that a client drops, at a random phase.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the inputs, graph and dropouts.")] = 0,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    flower: Annotated[bool, typer.Option(
        "--flower/--no-flower", help="Also time Flower's SecAgg+ client on the same N, K, D, in Flower's "
                                     "environment (fcl-emu bench flower-env); without one the report says so.")]
        = True,
    flower_python: FlowerPythonOpt = None,
) -> None:
    """SecAgg+ in one process: client and server time and bytes per phase; masking vs its lower bound and Flower."""
    from fcl_emu.bench.secagg import run

    if flower:
        flower_interpreter(flower_python, required=False)  # a wrong one fails now, before the measuring
    writable(folder(json_path))
    try:
        run(clients, dim, neighbors, threshold, dropout, seed, json_path, console, flower=flower,
            flower_python=flower_python)
    except ValueError as exc:
        fail(str(exc), 2)


@bench_app.command("metrics")
def bench_metrics(
    clients: Annotated[int, typer.Option(min=1, help="Clients of the simulated run that fills the registries.")] = 300,
    url: Annotated[Optional[list[str]], typer.Option(
        "--url", help="Also time scrapes of this live /metrics URL (repeatable).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """Prometheus metrics overhead: time per update, scrape time and size at --clients clients."""
    from fcl_emu.bench.metrics import run

    writable(folder(json_path))
    run(clients, list(url or []), json_path, console)


@bench_app.command("scale")
def bench_scale(
    populations: Annotated[str, typer.Option(help="Comma-separated client populations.")]
        = "100,300,1000,3000,10000,30000,100000",
    cohort: Annotated[int, typer.Option(min=1, help="Clients per round at every point but the largest (fewer if N "
                                                    "is smaller).")] = 100,
    largest_cohort: Annotated[int, typer.Option(min=1, help="Clients per round at the largest population.")] = 1000,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds per point.")] = 3,
    share: Annotated[int, typer.Option(min=1, help="Training samples per client (drawn with replacement across "
                                                   "clients where N x share exceeds MNIST's 60,000).")] = 10,
    clients_per_node: Annotated[int, typer.Option(min=1, help="Clients per edge-node process (at least two nodes).")]
        = CLIENTS_PER_NODE,
    idle_s: Annotated[float, typer.Option(min=1, help="Seconds of idle serving measured at each point.")] = 5.0,
    data_root: DataRootOpt = None,
    out: Annotated[Path, typer.Option("--out", help="Writes scale.csv and scale.png here.")] = Path("runs/scale"),
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """Scaling sweep: join time, coordinator overhead, idle CPU and memory per client against the population."""
    from fcl_emu.bench.scale import run

    sizes = int_list(populations, "--populations", 2)
    writable(out, folder(json_path))
    try:
        run(sizes, cohort, largest_cohort, rounds, share, clients_per_node, idle_s, out, json_path, data_root,
            console)
    except RuntimeError as exc:
        fail(str(exc), 1)


@bench_app.command("containers")
def bench_containers(
    clients: Annotated[int, typer.Option(min=2, help="Clients (IID shares of MNIST).")] = 100,
    cohort: Annotated[int, typer.Option(min=1, help="Clients per round.")] = 20,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds per run.")] = 3,
    nodes: Annotated[int, typer.Option(min=1, help="Edge nodes (containers).")] = 4,
    samples: Annotated[Optional[int], typer.Option(min=1, help="Training samples per client (default: its whole "
                                                                "IID share of MNIST).")] = None,
    data_root: DataRootOpt = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """Edge nodes in containers against host processes: start-up, idle memory, round time, CPU-limit slow-down."""
    from fcl_emu.containers.docker_client import EngineError
    from fcl_emu.containers.image import ImageError
    from fcl_emu.bench.containers import run
    from fcl_emu.runconfig import default_data_roots

    writable(folder(json_path))
    try:
        run(clients, cohort, rounds, nodes, [Path(p) for p in data_root] if data_root else default_data_roots(),
            json_path, Console(), samples)
    except (EngineError, ImageError) as exc:
        fail(str(exc), 1)


@bench_app.command("flower")
def bench_flower(
    points: Annotated[str, typer.Option(help="Comma-separated N:K points (clients : clients per round).")]
        = "100:10,300:30",
    rounds: Annotated[int, typer.Option(min=1, help="Rounds on both sides.")] = 3,
    epochs: Annotated[int, typer.Option(min=1, help="Local epochs on both sides.")] = 1,
    data_root: DataRootOpt = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    flower_python: FlowerPythonOpt = None,
) -> None:
    """fcl-emu against Flower's simulation engine on the same FedAvg workload: wall clock, memory, accuracy."""
    from fcl_emu.bench.flower import run

    try:
        parsed = [tuple(int(v) for v in p.split(":")) for p in points.split(",") if p.strip()]
        assert parsed and all(len(p) == 2 and 0 < p[1] <= p[0] for p in parsed)
    except (ValueError, AssertionError):
        raise typer.BadParameter(f"{points!r}: use N:K pairs with 0 < K <= N, e.g. 100:10,300:30",
                                 param_hint="--points") from None
    flower = flower_interpreter(flower_python, required=True)
    writable(folder(json_path))
    try:
        run(parsed, rounds, epochs, data_root, json_path, console, flower)
    except RuntimeError as exc:
        fail(str(exc), 1)


@bench_app.command("flower-env")
def bench_flower_env(
    directory: Annotated[Optional[Path], typer.Option(
        "--dir", help="Where (default: $FCL_EMU_FLOWER_ENV, else ~/.cache/fcl-emu/flower-env).")] = None,
) -> None:
    """Create Flower's environment for the Flower comparisons (bench flower, bench secagg), kept if already there."""
    try:
        flower = create(directory)
    except FlowerEnvError as exc:
        fail(str(exc), 1)
    print("\n".join(created_lines(flower)))


def flower_interpreter(explicit: Optional[Path], required: bool) -> Optional[FlowerPython]:
    """The interpreter of Flower's environment (:func:`fcl_emu.bench.flower_env.find_python`); one that cannot be
    used, or none where ``required``, is a usage error on --flower-python."""
    try:
        return find_python(explicit)
    except FlowerEnvError as exc:
        if isinstance(exc, NoFlowerEnv) and not required:
            return None
        raise typer.BadParameter(str(exc), param_hint="--flower-python") from None


@bench_app.command("churn")
def bench_churn(
    methods: Annotated[str, typer.Option(help="Comma-separated learning methods.")] = "fedavg,fedlwf2t",
    rates: Annotated[Optional[str], typer.Option(
        help="Comma-separated churn rates c in [0, 1): P(client unavailable in a slot); runs bernoulli:(1-c). "
             "Default: 0,0.1,0.2,0.3,0.4,0.5, or none with --stragglers.")] = None,
    stragglers: Annotated[Optional[str], typer.Option(
        help="Comma-separated shares of straggling clients (10x slower to train), e.g. 0,20,50 (percent): "
             "rows of time to --target-accuracy in emulated time, one per round policy of --aggregations.")]
        = None,
    aggregations: Annotated[str, typer.Option(
        help="Round policies of the --stragglers rows: sync, fedbuff, fedasync, comma-separated.")]
        = "sync,fedbuff",
    target_accuracy: Annotated[float, typer.Option(
        "--target-accuracy", min=0, max=100, help="Accuracy (%) on the seen classes that time_to_accuracy_s "
        "measures, in the first task.")] = 80.0,
    crash_rate: Annotated[float, typer.Option(
        "--crash-rate", min=0, max=1, help="edge.crash_rate of every run.")] = 0.0,
    clients: ClientsOpt = None,
    tasks: TasksOpt = None,
    rounds_per_task: RoundsOpt = None,
    clients_per_round: PerRoundOpt = None,
    min_participants: Annotated[Optional[int], typer.Option(
        "--min-participants", help="Fewer updates: round skipped (default: half of --clients-per-round).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of every run.")] = 0,
    faults: Annotated[str, typer.Option(
        help="emulated (the nodes tell clients to leave and crash), containers (edge nodes in Docker: nodes "
             "paused and restarted at the same per-round rates), or both, comma-separated.")] = "emulated",
    data_root: DataRootOpt = None,
    out: Annotated[Path, typer.Option("--out", help="Writes churn.csv, churn.png and runs/ here.")]
        = Path("runs/churn"),
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="Base YAML config (over the bench's defaults; the flags above override it).")] = None,
) -> None:
    """Churn sweep: accuracy, forgetting, completed rounds and bytes against the churn rate; with --stragglers,
    synchronous against asynchronous aggregation: emulated time to an accuracy (real `up` runs)."""
    from fcl_emu.bench import churn
    from fcl_emu.bench import stragglers as straggler_rows

    writable(out)
    try:
        base = churn.base_config(config, clients=clients, tasks=tasks, rounds_per_task=rounds_per_task,
                                 clients_per_round=clients_per_round, min_participants=min_participants,
                                 data_root=data_root)
        modes = churn.parse_list(faults, "--faults")
        unknown = sorted(set(modes) - set(churn.FAULT_MODES))
        if unknown:
            raise ValueError(f"--faults: unknown {', '.join(unknown)}; choose from {', '.join(churn.FAULT_MODES)}")
        method_list = churn.parse_list(methods, "--methods")
        policies = straggler_rows.parse_aggregations(aggregations)  # checked with or without --stragglers
        rate_list = churn.parse_rates(rates) if rates else [] if stragglers else list(churn.DEFAULT_RATES)
        straggler_points = [] if not stragglers else straggler_rows.points(
            base, method_list, straggler_rows.parse_shares(stragglers),
            policies, seed, out)
        sweep = churn.run(method_list, rate_list, crash_rate, seed, out, base, console, modes,
                          stragglers=straggler_points, target=target_accuracy)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    raise typer.Exit(0 if all(r["status"] == "completed" for r in sweep.rows) else 1)


@bench_app.command("soak")
def bench_soak(
    faults: Annotated[int, typer.Option(min=1, help="Faults to inject, one after another.")] = 10,
    kinds: Annotated[Optional[str], typer.Option(
        help="Comma-separated fault kinds, drawn in shuffled cycles (default: every kind of the backend: "
             "node_stop, net_cut, node_kill, coordinator_kill, disk_full; with --cluster: partition, slow_host, "
             "container_pause, container_kill, lose_host, coordinator_kill, disk_full).")] = None,
    clients: Annotated[int, typer.Option(min=2, help="Clients.")] = 8,
    nodes: Annotated[int, typer.Option(min=2, help="Edge nodes.")] = 4,
    tasks: Annotated[int, typer.Option(min=1, help="Tasks.")] = 2,
    rounds_per_task: Annotated[int, typer.Option(min=2, help="Rounds per task.")] = 10,
    samples: Annotated[int, typer.Option(min=1, help="Training samples per client and task.")] = 200,
    seed: Annotated[int, typer.Option(help="Seed of the run and of the fault schedule.")] = 0,
    cluster: Annotated[Optional[str], typer.Option(
        help="local: the faulted run on a local Swarm cluster the soak makes (and removes), its edge nodes as "
             "services over the hosts, with host faults among the faults (root; docs/across-hosts.md).")] = None,
    hosts: Annotated[int, typer.Option(min=2, max=50, help="With --cluster: hosts of the cluster (host 1 is the "
                                                           "manager).")] = 4,
    image: Annotated[Optional[str], typer.Option(help="With --cluster: the edge nodes' image (default: build or "
                                                      "reuse the project's).")] = None,
    data_root: DataRootOpt = None,
    out: Annotated[Path, typer.Option("--out", help="Writes soak.json, faults.csv and both runs here.")]
        = Path("runs/soak"),
) -> None:
    """Fault soak: one emulated-clock run under seeded real faults, checked against the same run without them."""
    from fcl_emu.bench import soak, soak_cluster
    from fcl_emu.containers.docker_client import EngineError
    from fcl_emu.containers.local_cluster import ClusterError
    from fcl_emu.runconfig import default_data_roots

    if cluster not in (None, "local"):
        raise typer.BadParameter(f"{cluster!r}: the soak faults hosts of a local cluster only (--cluster local)",
                                 param_hint="--cluster")
    allowed = soak_cluster.KINDS if cluster else soak.KINDS
    chosen = [k.strip() for k in (kinds or ",".join(allowed)).split(",") if k.strip()]
    if not chosen or set(chosen) - set(allowed):
        raise typer.BadParameter(f"{kinds!r}: choose from {', '.join(allowed)}"
                                 + (" (with --cluster)" if cluster else ""), param_hint="--kinds")
    writable(out)
    on = soak_cluster.ClusterSoak(hosts, image) if cluster else None
    try:
        result = soak.run(faults, chosen, clients, nodes, tasks, rounds_per_task, samples, seed,
                          [Path(p) for p in data_root] if data_root else default_data_roots(), out, Console(), on)
    except (ClusterError, EngineError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    raise typer.Exit(0 if result["ok"] else 1)


@bench_app.command("jobs")
def bench_jobs(
    device: Annotated[Optional[list[str]], typer.Option(
        "--device", help="Device to profile on (repeatable; default cpu): cpu, cuda (skipped with a reason where "
                         "absent).")] = None,
    scale: Annotated[float, typer.Option(min=0.01, help="Multiplies every job's step budget.")] = 1.0,
    kinds: Annotated[Optional[str], typer.Option(help="Comma-separated job kinds (default: every kind).")] = None,
    threads: Annotated[int, typer.Option(min=1, help="Torch CPU threads (GPU workers: gpu.threads, 1).")] = 1,
    repeat: Annotated[int, typer.Option(min=1, max=50, help="Timed runs per job and path, taken in turn across "
                                                            "a kind's paths; the median is reported.")] = 1,
    classes: Annotated[int, typer.Option(min=1, max=1000, help="Classes of the synthetic inputs: fused VAEs, "
                                                               "prototype gradients, classifier outputs (10: "
                                                               "MNIST's; 200: Tiny-ImageNet's).")] = 10,
    out: Annotated[Path, typer.Option("--out", help="Writes the table as CSV here.")] = Path("runs/bench-jobs.csv"),
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
) -> None:
    """Server-side jobs: FLOPs, wall time and GFLOP/s of each job kind against this machine's measured peak."""
    from fcl_emu.bench.jobs import run

    devices = list(dict.fromkeys(device or ["cpu"]))
    bad = sorted(set(devices) - {"cpu", "cuda"})
    if bad:
        raise typer.BadParameter(f"{', '.join(bad)}: choose cpu or cuda", param_hint="--device")
    writable(folder(out), folder(json_path))
    try:
        run(devices, scale, [k.strip() for k in kinds.split(",") if k.strip()] if kinds else None,
            threads, out, json_path, console, repeat, classes)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--kinds") from None
