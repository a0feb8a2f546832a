"""The data-free generative replay table of docs/experiments.md: fedavg, mfcl, target and lander, same runs.

    python benchmarks/generative_table.py --data-root ../shared/data --out runs/generative
    python benchmarks/generative_table.py --dataset fashion-mnist --methods fedavg,mfcl --out runs/gen-fmnist

Every method runs the same scenario (``BASE`` below: 5 tasks of 2 classes, 10 clients, 5 per round, the
``cnn_bn`` model, seed 0) as one real ``fcl-emu up`` (coordinator and two edge-node processes over ZeroMQ,
server jobs on one GPU-worker process). The generators' budgets are the papers' / official code's loss
weights at CPU-sized step counts (``METHOD_OPTIONS``). A run whose directory already holds a
``summary.json`` is read, not run again. The Markdown table goes to stdout and ``--out/table.md``, the raw
numbers to ``--out/table.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from runs import run_up

BASE = {
    "scenario": {"num_tasks": 5, "num_clients": 10},
    "rounds": {"clients_per_round": 5, "rounds_per_task": 5, "deadline_s": 600, "eval_every": 5},
    # weight decay 5e-4 as in TARGET's and LANDER's code (MFCL's: 1e-5)
    "training": {"local_epochs": 1, "batch_size": 32, "lr": 0.05, "weight_decay": 5e-4},
    "network": {"liveness_timeout_s": 120, "join_timeout_s": 120},
    "gpu": {"workers": 1, "job_timeout_s": 3600, "threads": 2},
    "model": "cnn_bn",
    "nodes": 2,
    "device": "cpu",
    "seed": 0,
}

# CPU-sized step counts; loss weights and everything else at each method's defaults (methods/<name>.py).
METHOD_OPTIONS = {
    "fedavg": {},
    "mfcl": {"generator_iterations": 200, "generator_width": 64, "synthetic_batch": 64},
    "target": {"generator_width": 64, "student_steps": 100, "synthetic_batch": 64},
    "lander": {"synthesis_rounds": 12, "warmup": 2, "generator_steps": 20, "generator_width": 64,
               "synthetic_batch": 64},
}

ASSETS = ("old_model", "generator", "synthetic_data", "label_text")


def run(method: str, dataset: str, data_root: str, out: Path) -> dict:
    config = {**BASE, "scenario": {**BASE["scenario"], "dataset": dataset}, "method": method,
              "method_options": METHOD_OPTIONS.get(method, {})}
    return run_up(method, config, data_root, out)


def row(method: str, s: dict) -> dict:
    sent = {t: v.get("sent", 0) for t, v in s["bytes"].items()}
    jobs = s.get("gpu_jobs", {}).get("by_kind", {})
    return {
        "method": method, "status": s["status"],
        "avg_accuracy": s["average_accuracy"], "avg_forgetting": s["average_forgetting"],
        "mb_models": (sent.get("train_request", 0) + s["bytes"].get("update", {}).get("received", 0)) / 1e6,
        **{f"mb_{a}": sent.get(a, 0) / 1e6 for a in ASSETS},
        "mb_total": s["bytes_total"] / 1e6,
        "server_job_s": sum(k["run_s"] for kind, k in jobs.items() if not kind.startswith("device.")),
        "wall_s": s["wall_clock_s"],
    }


def markdown(rows: list[dict]) -> str:
    head = ("| method | avg. accuracy % | avg. forgetting % | models MB | old model MB | generator MB | "
            "synthetic MB | label text MB | total MB | server jobs s | wall s |")
    lines = [head, "| --- |" + " ---: |" * 10]
    for r in rows:
        if r["status"] != "completed":
            lines.append(f"| {r['method']} | {r['status']} |" + " |" * 9)
            continue
        lines.append(f"| {r['method']} | {r['avg_accuracy']:.2f} | {r['avg_forgetting']:.2f} | {r['mb_models']:.1f} | "
                     f"{r['mb_old_model']:.1f} | {r['mb_generator']:.1f} | {r['mb_synthetic_data']:.1f} | "
                     f"{r['mb_label_text']:.3f} | {r['mb_total']:.1f} | {r['server_job_s']:.0f} | "
                     f"{r['wall_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--data-root", default="../shared/data")
    ap.add_argument("--methods", default="fedavg,mfcl,target,lander")
    ap.add_argument("--out", type=Path, default=Path("runs/generative"))
    args = ap.parse_args()
    rows = [row(m, run(m, args.dataset, args.data_root, args.out)) for m in args.methods.split(",")]
    table = markdown(rows)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "table.json").write_text(json.dumps(rows, indent=1))
    print(table)


if __name__ == "__main__":
    main()
