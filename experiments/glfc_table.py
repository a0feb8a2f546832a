"""The GLFC table of docs/results/reproduction-glfc-affcl-fedcbc.md: fedavg, fedlwf2t and glfc from the same
scenario, and the proxy's reconstruction quality.

    python -m experiments.glfc_table --data-root ../shared/data --seeds 0,1,2 --out runs/glfc

Every row is one real ``fcl-emu up`` of ``BASE`` (MNIST, 5 tasks of 2 classes, 10 clients at the start
and 2 more joining at every task boundary, 10 % of the earlier clients keeping only their old classes at
each boundary (GLFC's three client groups), 5 clients per round, 5 rounds per task) per seed; the table
gives mean ± sample standard deviation over the seeds. GLFC runs
with a 200-exemplar memory per client and CPU-sized proxy budgets (``GLFC``), once with the emulator's task
start as its transition signal (``oracle``), once with the paper's entropy-rise detection, in the paper's three
ablations (each replacing one component: plain BCE, iCaRL's distillation, the last model for the proxy's pick) and
as its iCaRL+FL baseline (``icarl``); ``glfc-no-rd`` (no distillation) and ``glfc-code-losses`` (the official
code's loss forms) on request. Below the table: the learnability gate on FedAvg's first seed and a verdict per
claim of :data:`CLAIMS` (:mod:`claims`).

Reconstruction quality: for every class, the prototype of its first holder is chosen, perturbed and
encoded exactly as a GLFC client does (with the first seed's glfc run's final global model), reconstructed exactly as
the proxy does, and compared: PSNR (pixels in [0, 1]) of the last kept reconstruction against the
perturbed prototype (what the channel could leak), of the perturbed prototype against the original (what
the perturbation hides), and whether the label came back right; again with Gaussian noise of std 0.25
and 1.0 (normalised units) added to the perturbed prototype (``perturb_noise``). The proxy itself never sees a
prototype; this measurement needs the client's data and runs here, outside the emulation.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from experiments import add_page_options, check_page, publish
from experiments.claims import Claim, between, accuracy_fields, learnability_gate, pilot_row, verdicts
from experiments.runs import (add_method_options, add_report_only, events, grouped, mean_of, pm,
                              run_up, seeded, seeds, with_options)
from fcl_emu.monitoring.results import RunSummary
from fcl_emu.run_model import final_model
from fcl_emu.scenario.datasets import NUM_CLASSES

DATASET = "mnist"
BASE = {
    "scenario": {"dataset": DATASET, "num_tasks": 5, "num_clients": 18, "new_clients_per_task": 2,
                 "old_only_fraction": 0.1},
    # the papers' protocols have no round deadline: every selected client counts, whatever its device
    "rounds": {"clients_per_round": 5, "rounds_per_task": 5, "deadline_s": 86_400, "eval_every": 5},
    "training": {"local_epochs": 1, "batch_size": 32, "lr": 0.05, "weight_decay": 5e-4},
    "network": {"liveness_timeout_s": 120, "join_timeout_s": 120},
    "gpu": {"workers": 1, "job_timeout_s": 3600, "threads": 1},
    "model": "cnn",
    "nodes": 2,
    # the papers' protocols have no defences: every update is averaged as it came
    "aggregation": {"direction_check": "off", "adaptive_clip": "off"},
    "device": "cpu",
}
# The paper's setting at a CPU budget on a 50-class Tiny-ImageNet-32 subset in 5 tasks of 10 (the protocol whose
# FedAvg pilot passes the learnability gate: docs/reproduction.md), each client holding 60 % of a task's classes
# (GLFC's class_fraction), 10 rounds a task; memory and proxy steps by --option (e.g. glfc:memory_size=300)
TINY50 = {**BASE, "scenario": {**BASE["scenario"], "dataset": "tiny-imagenet-32", "class_subset": 50,
                               "partition": "class_fraction", "class_fraction": 0.6},
          "rounds": {**BASE["rounds"], "rounds_per_task": 10, "eval_every": 10}, "model": "cnn_bn",
          "training": {**BASE["training"], "lr": 0.01}}
PROTOCOLS = {"mnist": BASE, "tiny50": TINY50}
GLFC = {"memory_size": 200, "proxy_iterations": 40, "proxy_keep": 10}
NOISE = (None, 0.25, 1.0)  # reconstruction quality with the run's perturbation, then with Gaussian noise added
ROWS = {
    "fedavg": ("fedavg", {}),
    "fedlwf2t": ("fedlwf2t", {}),
    "glfc-oracle": ("glfc", {**GLFC, "task_detection": "oracle"}),
    "glfc-entropy": ("glfc", {**GLFC, "entropy_threshold": 0.3}),
    # the paper's ablations (GLFC Table 1), each replacing one component, with the oracle signal: plain BCE for the
    # gradient compensation (w/o CGC), iCaRL's distillation for the relation distillation (w/o CRD), the last model
    # for the proxy's pick (w/o PRS); and its iCaRL+FL baseline (all three replaced)
    "glfc-no-cgc": ("glfc", {**GLFC, "task_detection": "oracle", "compensation": "off"}),
    "glfc-no-crd": ("glfc", {**GLFC, "task_detection": "oracle", "distillation": "icarl"}),
    "glfc-no-prs": ("glfc", {**GLFC, "task_detection": "oracle", "old_model": "last"}),
    "icarl": ("icarl", {"memory_size": GLFC["memory_size"]}),
    # without any distillation term; the official code's loss forms
    "glfc-no-rd": ("glfc", {**GLFC, "task_detection": "oracle", "w_rd": 0.0}),
    "glfc-code-losses": ("glfc", {**GLFC, "task_detection": "oracle", "loss_form": "code"}),
}
DEFAULT_ROWS = ("fedavg", "fedlwf2t", "glfc-oracle", "glfc-entropy", "glfc-no-cgc", "glfc-no-crd", "glfc-no-prs",
                "icarl")

# The claims judged (time-averaged accuracy, GLFC Table 1: CIFAR-100, T=10; FedCBC Table 1 for GLFC above FedAvg,
# there in mean GA): GLFC with the oracle signal against its iCaRL+FL baseline, each ablation and FedAvg.
CLAIMS: tuple[Claim, ...] = (
    Claim("glfc-oracle", "icarl", "GLFC Table 1", "time_avg", (66.9, 51.8)),
    Claim("glfc-oracle", "glfc-no-cgc", "GLFC Table 1", "time_avg", (66.9, 60.1)),
    Claim("glfc-oracle", "glfc-no-crd", "GLFC Table 1", "time_avg", (66.9, 65.8)),
    Claim("glfc-oracle", "glfc-no-prs", "GLFC Table 1", "time_avg", (66.9, 64.6)),
    Claim("glfc-oracle", "fedavg", "FedCBC Table 1, there in mean GA: 55.58 vs 25.28", "time_avg"),
)


def row(name: str, seed: int, s: RunSummary, evs: list[dict]) -> dict:
    rounds = [e for e in evs if e["event"] == "round"]
    tasks = s.scenario["num_tasks"]
    channel = [sum(r["bytes_by_type"].get("prototype_gradients", {}).get("received", 0)
                   for r in rounds if r["task"] == t) for t in range(tasks)]
    metrics = [r["client_metrics"] or {} for r in rounds]
    detected = [m for m in metrics if "task_detected" in m]
    proxy = s.gpu_jobs.by_kind.get("glfc.proxy") if s.gpu_jobs else None
    return {
        "row": name, "seed": seed, "method": s.method, "status": s.status,
        **accuracy_fields(s),
        "mb_total": s.bytes_total / 1e6,
        "mb_old_model": s.bytes.get("old_model", {}).get("sent", 0) / 1e6,
        "kb_prototype_gradients_per_task": [b / 1e3 for b in channel],
        "prototype_gradient_messages": s.messages.get("prototype_gradients/received", 0),
        "detected_rate": float(np.mean([m["task_detected"] for m in detected])) if detected else None,
        "transition_rate": float(np.mean([m["transition"] for m in detected])) if detected else None,
        **{f"{k}_rate": float(np.mean([m[f"detection_{k}"] for m in detected]))
           if detected and f"detection_{k}" in detected[0] else None for k in ("missed", "false_alarm")},
        "proxy_s": proxy.run_s if proxy else 0.0,
        "proxy_picks": proxy_picks(evs),
        "wall_s": s.wall_clock_s,
    }


def proxy_picks(evs: list[dict]) -> dict | None:
    """GLFC's proxy (mechanism check), from the run's events: in how many tasks it kept the task's last global
    model (its pick is the best-scoring round, the later on a tie, as the server keeps it), and in how many
    rounds its score (the model's accuracy on the reconstructions) was perfect, where it cannot tell models
    apart. None without proxy jobs."""
    jobs = [e for e in evs if e["event"] == "job" and e.get("job_kind") == "glfc.proxy" and e.get("ok")]
    rounds = [(e["task"], e["round"]) for e in evs if e["event"] == "server_job" and e.get("kind") == "proxy"
              and e.get("ok")]
    scored = [(task, rnd, job["metrics"]["score"]) for (task, rnd), job in zip(rounds, jobs)
              if "score" in job["metrics"]]
    if not scored:
        return None
    tasks = sorted({task for task, _, _ in scored})
    last = 0
    for task in tasks:
        of_task = [(score, rnd) for t, rnd, score in scored if t == task]
        last += max(of_task)[1] == max(rnd for _, rnd in of_task)
    return {"last_picked": last, "tasks": len(tasks),
            "perfect": sum(score >= 1.0 for _, _, score in scored), "scored": len(scored)}


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def reconstruction_quality(run_dir: Path, data_root: str, noise: float | None = None) -> dict:
    """Client-side prototypes of every class against the proxy's reconstructions of their gradients
    (``noise``: the clients' ``perturb_noise`` instead of the run's)."""
    from fcl_emu.methods.glfc import (GLFCOptions, GradientEncoder, label_from_gradients,
                              perturb_prototype, prototype_index, reconstruct)
    from fcl_emu.scenario.scenario import build_scenario
    from fcl_emu.scenario.spec import ScenarioSpec
    from fcl_emu.scenario.transforms import denormalize, to_tensor

    config, ds, model, _ = final_model(run_dir, data_root)
    o = GLFCOptions(**config["method_options"])
    if noise is not None:
        o = o.model_copy(update={"perturb_noise": noise})
    scenario = build_scenario(ScenarioSpec(**config["scenario"]), ds)
    encoder = GradientEncoder(ds.input_shape, ds.num_classes, o.encoder_seed)
    names = [n for n, _ in encoder.named_parameters()]
    gen = torch.Generator().manual_seed(0)
    out = []
    for t in range(scenario.num_tasks):
        for c in scenario.task_classes(t):
            holder = next(k for k in scenario.active_clients(t) if c in scenario.client_classes(k, t))
            idx = scenario.client_indices(holder, t)
            idx = idx[scenario.train_labels[idx] == c]
            x = to_tensor(ds.train_x[idx], ds.mean, ds.std)
            with torch.no_grad():
                features = model.features(x)
            proto = x[prototype_index(features)][None]
            label = torch.tensor([int(c)])
            perturbed = perturb_prototype(model, proto, label, o.perturb_steps,
                                          config["training"]["lr"] * o.perturb_lr_ratio, o.perturb_noise,
                                          o.loss_form, gen)
            target = dict(zip(names, encoder.gradients(perturbed, label)))
            recovered = label_from_gradients(target)
            images, loss = reconstruct(encoder, target, recovered, ds.input_shape, o.proxy_iterations,
                                       o.proxy_lr, o.proxy_keep, gen)
            pixels = [denormalize(v, ds.mean, ds.std).clamp(0, 1) for v in (proto, perturbed, images[-1:])]
            out.append({"class": int(c), "label_ok": recovered == int(c), "match_loss": loss,
                        "psnr_reconstruction_vs_perturbed": _psnr(pixels[2], pixels[1]),
                        "psnr_perturbed_vs_prototype": _psnr(pixels[1], pixels[0])})
    return {"perturb_noise": o.perturb_noise, "per_class": out,
            "labels_recovered": sum(r["label_ok"] for r in out) / len(out),
            "psnr_reconstruction_mean": float(np.mean([r["psnr_reconstruction_vs_perturbed"] for r in out])),
            "psnr_reconstruction_min": float(np.min([r["psnr_reconstruction_vs_perturbed"] for r in out])),
            "psnr_perturbation_mean": float(np.mean([r["psnr_perturbed_vs_prototype"] for r in out]))}


def markdown(rows: list[dict], classes: int = NUM_CLASSES[DATASET]) -> str:
    """Mean ± standard deviation over the seeds of accuracy and forgetting; means of the rest; then the gate and
    the verdicts."""
    lines = ["| run | seeds | avg. accuracy % | time-avg. accuracy % | avg. forgetting % | total MB | old model MB | "
             "prototype-gradient KB per task | jobs with a detected / a true transition | proxy s | wall s |",
             "| --- |" + " ---: |" * 10]
    for name, runs, failed in grouped(rows):
        if not runs:
            lines.append(f"| {name} | 0 | {failed[0]['status']} |" + " |" * 8)
            continue
        kb = ", ".join(f"{v:.0f}" for v in np.mean([r["kb_prototype_gradients_per_task"] for r in runs], axis=0))
        det = "-"
        if runs[0]["detected_rate"] is not None:
            det = f"{mean_of(runs, 'detected_rate', 2)} / {mean_of(runs, 'transition_rate', 2)}"
            if runs[0]["missed_rate"] is not None:
                det += f" (missed {mean_of(runs, 'missed_rate', 2)}, false {mean_of(runs, 'false_alarm_rate', 2)})"
        lines.append(f"| {name} | {len(runs)} | {pm([r['avg_accuracy'] for r in runs], 2)} | "
                     f"{pm([r['time_avg'] for r in runs], 2)} | {pm([r['avg_forgetting'] for r in runs], 2)} | "
                     f"{mean_of(runs, 'mb_total')} | "
                     f"{mean_of(runs, 'mb_old_model')} | {kb if runs[0]['method'] == 'glfc' else '-'} | {det} | "
                     f"{mean_of(runs, 'proxy_s', 0)} | {mean_of(runs, 'wall_s', 0)} |")
    picks = [r for r in rows if r.get("proxy_picks")]
    if picks:
        lines.append("\nGLFC's proxy (mechanism check), per run: tasks whose pick was the task's last global model / "
                     "rounds whose score was perfect (a tie: the later model kept): "
                     + "; ".join(f"{r['row']} s{r['seed']} {r['proxy_picks']['last_picked']} of "
                                 f"{r['proxy_picks']['tasks']} / {r['proxy_picks']['perfect']} of "
                                 f"{r['proxy_picks']['scored']}" for r in picks) + ".")
    judged = between(CLAIMS, (r["row"] for r in rows))
    gate = learnability_gate(pilot_row(rows, key="row"), classes)
    return "\n".join(lines + [""] + verdicts(rows, judged, gate, key="row"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default="../shared/data")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"of {', '.join(ROWS)}")
    ap.add_argument("--seeds", type=seeds, default=[0, 1, 2])
    ap.add_argument("--protocol", choices=sorted(PROTOCOLS), default="mnist",
                    help="mnist: 5 tasks of 2 classes; tiny50: a 50-class Tiny-ImageNet-32 subset in 5 tasks of 10")
    ap.add_argument("--out", type=Path, default=Path("runs/glfc"))
    ap.add_argument("--skip-reconstruction", action="store_true",
                    help="leave out the proxy's reconstruction quality (minutes of CPU after the runs)")
    add_method_options(ap)
    add_report_only(ap)
    add_page_options(ap)
    args = ap.parse_args()
    check_page(args, args.out)
    base = PROTOCOLS[args.protocol]
    rows = []
    for seed in args.seeds:
        for name in args.rows.split(","):
            method, options = ROWS[name]
            run = f"{name}-s{seed}"
            cfg = with_options({**base, "method": method, "method_options": options}, args.option)
            summary = run_up(run, seeded(cfg, seed),
                             args.data_root, args.out, args.report_only)
            if summary is not None:
                rows.append(row(name, seed, summary, events(args.out, run)))
    table = markdown(rows, base["scenario"].get("class_subset") or NUM_CLASSES[base["scenario"]["dataset"]])
    glfc_runs = [f"{r['row']}-s{r['seed']}" for r in rows if r["method"] == "glfc" and r["status"] == "completed"]
    quality = [reconstruction_quality(args.out / glfc_runs[0], args.data_root, noise)
               for noise in NOISE] if glfc_runs and not args.skip_reconstruction else []
    publish(args, args.out, table, {"rows": rows, "reconstruction": quality})
    for q in quality:
        print(json.dumps({k: v for k, v in q.items() if k != "per_class"}))


if __name__ == "__main__":
    main()
