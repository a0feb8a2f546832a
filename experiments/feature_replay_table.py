"""The feature-space replay tables of docs/results/reproduction-glfc-affcl-fedcbc.md: FedCBC on its paper's
protocol, AF-FCL on the limitless task pool with and without noisy clients.

    python -m experiments.feature_replay_table --data-root ../shared/data --table fedcbc --out runs/fedcbc
    python -m experiments.feature_replay_table --data-root ../shared/data --table fedcbc-cifar10 \
        --out runs/fedcbc-cifar10
    python -m experiments.feature_replay_table --data-root ../shared/data --table affcl --out runs/affcl

Every row is one real ``fcl-emu up`` per seed (coordinator, edge-node process and one GPU-worker process over
ZeroMQ) of the table's scenario with one method; the table gives mean ± sample standard deviation over the
seeds (``--seeds``, default 0,1,2) of the accuracy measures and the means of the costs. GA is FedCBC's global
accuracy, over the whole test set (``accuracy_all``); "clients' own test sets" is AF-FCL's measure
(``accuracy_clients``, mean over the tasks).

- ``fedcbc``: FedCBC's MNIST protocol (scenario partition ``accessible_classes``: 3 clients, each with 6
  accessible classes of which 2 are private, 5 tasks of 3 classes drawn afresh from them, 5 rounds per
  task, all clients every round), ``fedcbc``, ``fedavg``, ``fedprox`` and ``glfc`` (2,000 exemplars per
  client, the paper's default; the emulator's task start as its transition signal: in this protocol classes
  come back, so an entropy rise does not separate new from old), and ``glfc-m200`` with 200. Every row trains
  1 local epoch a round (the paper: 50 for the baselines; the CPU budget). The paper's Table 1 is printed
  beside:
  average global accuracy FedCBC 81.08, GLFC 55.58, FedAvg 25.28, FedProx 12.73.
- ``fedcbc-incremental``: the same rows on class-incremental MNIST (5 tasks of 2 classes, 3 clients, one class
  of each task private to one client, the other shared by all: ``private_classes``), where no class comes back
  and the baselines forget: the protocol on which FedCBC's claims pass the learnability gate.
- ``fedcbc-cifar10``: the same on CIFAR-10 (the paper's Table 2: FedCBC 57.93, GLFC 42.66, FedAvg 21.92).
- ``affcl``: AF-FCL's limitless task pool on MNIST (4 clients, 5 pool tasks of 2 classes, each client its
  own random sequence of 3 of them, 5 rounds per task; the stream by first use is 6, 2 and 2 classes),
  ``affcl`` (defaults, and ``affcl-strong``: every old-knowledge weight at 1), ``fedavg`` and ``fedlwf2t``,
  clean and with 2 of the 4 clients training on random labels in their first task (``-noisy``; AF-FCL there
  with the options of its code's README command for noisy clients: ``NOISY_AFFCL``).
- ``affcl-incremental``: the same rows on class-incremental MNIST (5 tasks of 2 classes, 4 clients with IID
  shares), where every old class is lost without help: the protocol on which AF-FCL's claims pass the
  learnability gate.
- ``affcl-mixed``: AF-FCL's noisy-client study (its Table 1's noisy rows) on MNIST + Fashion-MNIST (20 classes,
  5 class-incremental tasks of 4, 4 clients, at most 1,500 samples a client a task), every row trained with the
  paper's Adam (at 1e-3 for a budget 25 times smaller than the paper's): ``MIXED_AFFCL``; AF-FCL with its code's
  README command for the mixed pool (``MIXED_AFFCL_ROWS``).
- ``fedcbc-cifar10-incremental``: the FedCBC rows on class-incremental CIFAR-10 (``private_classes`` as in
  ``fedcbc-incremental``), GLFC's memory swept over 200, 500, 1,000 and 2,000 exemplars per client.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from experiments import add_page_options, check_page, publish
from experiments.claims import Claim, accuracy_fields, learnability_gate, pilot_row, verdicts
from experiments.runs import (add_method_options, add_report_only, events, grouped, mean_of, pm, run_up,
                              seeded, seeds, with_options)
from fcl_emu.monitoring.results import RunSummary
from fcl_emu.scenario.datasets import NUM_CLASSES

COMMON = {
    # the papers' protocols have no round deadline: every selected client counts, whatever its device
    "rounds": {"rounds_per_task": 5, "deadline_s": 86_400, "eval_every": 5},
    "training": {"local_epochs": 1, "batch_size": 32, "lr": 0.01, "momentum": 0.9},
    "network": {"liveness_timeout_s": 300, "join_timeout_s": 120},
    "gpu": {"workers": 1, "job_timeout_s": 3600, "threads": 1},
    "nodes": 1,
    # the papers' protocols have no defences: every update is averaged as it came
    "aggregation": {"direction_check": "off", "adaptive_clip": "off"},
    "device": "cpu",
}
FEDCBC_SCENARIO = {"num_tasks": 5, "num_clients": 3, "partition": "accessible_classes"}
GLFC = {"memory_size": 2000, "task_detection": "oracle", "proxy_iterations": 40, "proxy_keep": 10}
# GLFC's memory swept below the paper's 2,000 exemplars per client (which hold a third of each MNIST class a client
# has): where FedCBC, which keeps no exemplar, overtakes it
MEMORY_SWEEP = (200, 500, 1000)
FEDCBC_ROWS = {"fedcbc": ("fedcbc", {}), "fedavg": ("fedavg", {}), "fedprox": ("fedprox", {}), "glfc": ("glfc", GLFC),
               **{f"glfc-m{m}": ("glfc", {**GLFC, "memory_size": m}) for m in MEMORY_SWEEP}}
POOL_SCENARIO = {"num_tasks": 3, "num_clients": 4, "partition": "task_pool", "task_pool_size": 5}
NOISY = {"noisy_client_fraction": 0.5, "noisy_tasks": 1}
# the options of the AF-FCL code's README command for noisy clients (EMNIST-noisy: --flow_lr 1e-3 --k_loss_flow
# 0.5 --k_flow_lastflow 0.1 --flow_explore_theta 0.5; its --lr 1e-4 is replay_lr's default): the -noisy rows
NOISY_AFFCL = {"flow_lr": 1e-3, "k_loss_flow": 0.5, "k_flow_last": 0.1, "theta": 0.5}
# affcl-strong: every old-knowledge term at weight 1 and no p_bar scaling of the replay (theta = 1)
STRONG = {"k_loss_flow": 1.0, "k_kd_last": 1.0, "k_kd_feature": 1.0, "theta": 1.0}
WORKER_TYPES = ("job", "job_result", "worker_hello")  # the GPU worker pool's traffic, not the clients'


def affcl_rows(clean: dict, noisy: dict) -> dict[str, tuple[str, dict]]:
    """AF-FCL (defaults, and every old-knowledge weight at 1), FedAvg and FedLwF-2T, clean and ``-noisy``; the
    AF-FCL rows with ``clean`` / ``noisy`` options."""
    return {f"{name}{suffix}": (method, {**((noisy if suffix else clean) if method == "affcl" else {}), **options})
            for suffix in ("", "-noisy")
            for name, method, options in (("affcl", "affcl", {}), ("affcl-strong", "affcl", STRONG),
                                          ("fedavg", "fedavg", {}), ("fedlwf2t", "fedlwf2t", {}))}


AFFCL_ROWS = affcl_rows({}, NOISY_AFFCL)

# Class-incremental MNIST for FedCBC's claims: 5 tasks of 2 classes, 3 clients, half of each task's classes private
# to one client (``private_classes``), so old classes do not come back and the baselines have something to forget
INCREMENTAL_SCENARIO = {"num_tasks": 5, "num_clients": 3, "partition": "private_classes", "private_fraction": 0.5}

# Class-incremental MNIST for AF-FCL's claims: 5 tasks of 2 classes shared IID by 4 clients
INCREMENTAL_AFFCL = {"num_tasks": 5, "num_clients": 4, "partition": "iid"}

# AF-FCL's noisy-client study on its mixed pool's kind of data: MNIST and Fashion-MNIST (20 classes) in 5
# class-incremental tasks of 4, 4 clients with IID shares of at most 1,500 samples a task, every model trained with
# Adam (the paper's optimiser for every method, App. C.3) at 1e-3: the paper's 1e-4 is for 60 rounds of 100
# iterations a task, 25 times this budget (5 rounds of about 47)
MIXED_AFFCL = {"dataset": "mnist-fashion", "num_tasks": 5, "num_clients": 4, "partition": "iid",
               "samples_per_client_task": 1500}
ADAM = {"optimizer": "adam", "lr": 1e-3, "weight_decay": 0.0}
# AF-FCL there with its code's README command for the mixed pool (MNIST-SVHN-FASHION: --flow_lr 1e-3 --k_loss_flow
# 0.1 --k_flow_lastflow 0 --flow_explore_theta 0) and for noisy clients, and its replay step at the classifier's lr
# (the code's --lr serves both)
MIXED_AFFCL_ROWS = affcl_rows({"flow_lr": 1e-3, "k_loss_flow": 0.1, "k_flow_last": 0.0, "theta": 0.0,
                               "replay_lr": ADAM["lr"]}, {**NOISY_AFFCL, "replay_lr": ADAM["lr"]})

# The claims each table judges (docs/reproduction.md): FedCBC's Table 1 (MNIST, mean GA), AF-FCL's Table 1 (best
# in accuracy and forgetting on every benchmark; none of its numbers for these rows survives in the text).
_FEDCBC_CLAIMS = (Claim("fedcbc", "fedavg", "FedCBC Table 1", "ga_mean", (81.08, 25.28)),
                  Claim("fedcbc", "glfc", "FedCBC Table 1", "ga_mean", (81.08, 55.58)),
                  Claim("glfc", "fedavg", "FedCBC Table 1", "ga_mean", (55.58, 25.28)),
                  Claim("fedcbc", "fedprox", "FedCBC Table 1", "ga_mean", (81.08, 12.73)))
_AFFCL_CLAIMS = tuple(Claim(f"affcl{n}", f"{other}{n}", "AF-FCL Table 1", metric)
                      for n in ("", "-noisy") for other in ("fedavg", "fedlwf2t")
                      for metric in ("avg_accuracy", "avg_forgetting"))
_CIFAR10_CLAIMS = (Claim("fedcbc", "fedavg", "FedCBC Table 2", "ga_mean", (57.93, 21.92)),
                   Claim("fedcbc", "glfc", "FedCBC Table 2", "ga_mean", (57.93, 42.66)),
                   *(Claim("fedcbc", f"glfc-m{m}", "FedCBC Table 2, there at 2,000 exemplars", "ga_mean")
                     for m in MEMORY_SWEEP))
CLAIMS = {"affcl": _AFFCL_CLAIMS, "affcl-incremental": _AFFCL_CLAIMS, "affcl-mixed": _AFFCL_CLAIMS,
          "fedcbc": _FEDCBC_CLAIMS, "fedcbc-incremental": _FEDCBC_CLAIMS,
          "fedcbc-cifar10": _CIFAR10_CLAIMS, "fedcbc-cifar10-incremental": _CIFAR10_CLAIMS}

TABLES = {
    "fedcbc-incremental": ({**COMMON, "scenario": {"dataset": "mnist", **INCREMENTAL_SCENARIO},
                            "rounds": {**COMMON["rounds"], "clients_per_round": 3}}, FEDCBC_ROWS,
                           {"fedcbc": 81.08, "glfc": 55.58, "fedavg": 25.28, "fedprox": 12.73}),
    "fedcbc": ({**COMMON, "scenario": {"dataset": "mnist", **FEDCBC_SCENARIO},
                "rounds": {**COMMON["rounds"], "clients_per_round": 3}}, FEDCBC_ROWS,
               {"fedcbc": 81.08, "glfc": 55.58, "fedavg": 25.28, "fedprox": 12.73}),
    "fedcbc-cifar10": ({**COMMON, "scenario": {"dataset": "cifar10", **FEDCBC_SCENARIO},
                        "rounds": {**COMMON["rounds"], "clients_per_round": 3}}, FEDCBC_ROWS,
                       {"fedcbc": 57.93, "glfc": 42.66, "fedavg": 21.92}),
    "fedcbc-cifar10-incremental": ({**COMMON, "scenario": {"dataset": "cifar10", **INCREMENTAL_SCENARIO},
                                    "rounds": {**COMMON["rounds"], "clients_per_round": 3}}, FEDCBC_ROWS,
                                   {"fedcbc": 57.93, "glfc": 42.66, "fedavg": 21.92}),
    "affcl-mixed": ({**COMMON, "model": "cnn_leaky", "scenario": MIXED_AFFCL,
                     "training": {**COMMON["training"], **ADAM},
                     "rounds": {**COMMON["rounds"], "clients_per_round": 4}}, MIXED_AFFCL_ROWS, {}),
    "affcl": ({**COMMON, "model": "cnn_leaky", "scenario": {"dataset": "mnist", **POOL_SCENARIO},
               "rounds": {**COMMON["rounds"], "clients_per_round": 4}}, AFFCL_ROWS, {}),
    "affcl-incremental": ({**COMMON, "model": "cnn_leaky", "scenario": {"dataset": "mnist", **INCREMENTAL_AFFCL},
                           "rounds": {**COMMON["rounds"], "clients_per_round": 4}}, AFFCL_ROWS, {}),
}


def config(base: dict, name: str, method: str, options: dict) -> dict:
    scenario = {**base["scenario"], **(NOISY if name.endswith("-noisy") else {})}
    return {**base, "scenario": scenario, "method": method, "method_options": options}


def flow_diagnostics(evs: list[dict]) -> dict:
    """AF-FCL's mechanism check from its clients' round metrics: the flow's NLL (nats) of the current features in
    the last round, the worst NLL the flow gave the previous task's flow's samples in a later task (a flow that
    models both tasks' features gives numbers of the same order), how often the classifier labels the generated
    features as their class in the last round (chance: one in the classes seen), and the credibility (eq. 8) of
    the generated features of the batch's own classes beside ``p_bar``, the weight every other one gets, both in
    the last round. Empty for other methods."""
    metrics = [e.get("client_metrics") or {} for e in evs if e["event"] == "round"]

    def last(key: str) -> float | None:
        return next((m[key] for m in reversed(metrics) if key in m), None)

    if last("flow_nll") is None:
        return {}
    old = [m["flow_nll_old"] for m in metrics if m.get("flow_nll_old")]
    return {"flow_nll_old_max": max(old) if old else None,
            **{key: last(key) for key in ("flow_nll", "generated_agreement", "credibility_local", "p_bar")}}


def row(name: str, seed: int, s: RunSummary, paper: dict, evs: list[dict] = ()) -> dict:
    kr = s.knowledge_retention
    clients = {kind: b for kind, b in s.bytes.items() if kind not in WORKER_TYPES}
    sent = {kind: b.get("sent", 0) / 1e6 for kind, b in clients.items()}
    received = {kind: b.get("received", 0) / 1e6 for kind, b in clients.items()}
    to_workers = sum(b.get("sent", 0) + b.get("received", 0) for k, b in s.bytes.items() if k in WORKER_TYPES)
    jobs = s.gpu_jobs.by_kind if s.gpu_jobs else {}
    return {
        "row": name, "seed": seed, "method": s.method, "status": s.status,
        "ga_per_task": s.accuracy_all, "ga_mean": float(np.mean(s.accuracy_all)) if s.accuracy_all else None,
        "paper_ga_mean": paper.get(s.method),
        **accuracy_fields(s),
        # AF-FCL's measure: every client on its own tasks' test sets, mean over the tasks (absent before it existed)
        "client_accuracy": float(np.mean(s.accuracy_clients)) if s.accuracy_clients else None,
        "kr_t": kr.temporal, "kr_s": kr.spatial, "private_accuracy": kr.private,
        "mb_sent": sum(sent.values()), "mb_received": sum(received.values()), "mb_workers": to_workers / 1e6,
        "mb_sent_by_type": sent, "mb_received_by_type": received,
        "server_jobs_s": sum(j.run_s for kind, j in jobs.items() if not kind.startswith("device.")),
        "wall_s": s.wall_clock_s,
        **flow_diagnostics(evs),
    }


def learned(runs: list[dict]) -> str:
    """Each task's accuracy right after it, mean over the runs (``-`` for a task that introduced no class)."""
    columns = zip(*[r["learned_accuracy"] for r in runs])
    return ", ".join("-" if None in c else f"{np.mean(c):.1f}" for c in columns)


def _num(row: dict, key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key]:.2g}"


def markdown(rows: list[dict], claims: tuple[Claim, ...] = (), num_classes: int = 10) -> str:
    """The table, then the learnability gate on the ``fedavg`` row's first seed and a verdict per claim."""
    lines = ["| run | seeds | GA per task % | mean GA % | paper mean GA % | avg. accuracy % | avg. forgetting % "
             "| each task right after it % | clients' own test sets % | KR_t % | KR_s % | private-class acc. % "
             "| client MB sent / received | worker MB | server jobs s | wall s |",
             "| --- | ---: | --- |" + " ---: |" * 4 + " --- |" + " ---: |" * 8]
    for name, runs, failed in grouped(rows):
        if not runs:
            lines.append(f"| {name} | 0 | {failed[0]['status']} |" + " |" * 13)
            continue
        ga = ", ".join(f"{a:.1f}" for a in np.mean([r["ga_per_task"] for r in runs], axis=0))
        paper = runs[0]["paper_ga_mean"]
        lines.append(f"| {name} | {len(runs)} | {ga} | {pm([r['ga_mean'] for r in runs], 2)} | "
                     f"{'-' if paper is None else f'{paper:.2f}'} | {pm([r['avg_accuracy'] for r in runs], 2)} | "
                     f"{pm([r['avg_forgetting'] for r in runs], 2)} | {learned(runs)} | "
                     f"{pm([r['client_accuracy'] for r in runs])} | "
                     f"{pm([r['kr_t'] for r in runs])} | "
                     f"{pm([r['kr_s'] for r in runs])} | {pm([r['private_accuracy'] for r in runs])} | "
                     f"{mean_of(runs, 'mb_sent')} / {mean_of(runs, 'mb_received')} | {mean_of(runs, 'mb_workers')} | "
                     f"{mean_of(runs, 'server_jobs_s', 0)} | {mean_of(runs, 'wall_s', 0)} |")
    flows = [r for r in rows if r.get("flow_nll") is not None]
    if flows:
        lines.append("\nAF-FCL's flow (mechanism check), per run: NLL of the current features in the last round / "
                     "the worst NLL it gave the previous task's flow's samples in a later task (nats) / the share "
                     "of generated features the classifier labels as their class / the credibility (eq. 8) of "
                     "generated features of the batch's own classes against p_bar, the weight of all others, in the "
                     "last round: " + "; ".join(
                         f"{r['row']} s{r['seed']} {r['flow_nll']:.0f} / {r['flow_nll_old_max'] or 0:.3g} / "
                         f"{_num(r, 'generated_agreement')} / {_num(r, 'credibility_local')} vs {_num(r, 'p_bar')}"
                         for r in flows) + ".")
    gate = learnability_gate(pilot_row(rows, key="row"), num_classes)
    return "\n".join(lines + [""] + verdicts(rows, claims, gate, key="row"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default="../shared/data")
    ap.add_argument("--table", choices=sorted(TABLES), default="fedcbc")
    ap.add_argument("--rows", default=None, help="comma-separated rows of the table (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="default: runs/<table>")
    ap.add_argument("--seeds", type=seeds, default=[0, 1, 2],
                    help="the runs' seeds (class order, partition, noisy clients, initial weights)")
    add_method_options(ap)
    add_report_only(ap)
    add_page_options(ap)
    args = ap.parse_args()
    base, rows_spec, paper = TABLES[args.table]
    out = args.out or Path("runs") / args.table
    check_page(args, out)
    rows = []
    for seed in args.seeds:
        for name in (args.rows.split(",") if args.rows else rows_spec):
            method, options = rows_spec[name]
            cfg = with_options(config(base, name, method, options), args.option)
            summary = run_up(f"{name}-s{seed}", seeded(cfg, seed), args.data_root, out, args.report_only)
            if summary is not None:
                rows.append(row(name, seed, summary, paper, events(out, f"{name}-s{seed}")))
    table = markdown(rows, CLAIMS[args.table], NUM_CLASSES[base["scenario"]["dataset"]])
    publish(args, out, table, {"table": args.table, "rows": rows})


if __name__ == "__main__":
    main()
