"""How well AF-FCL's flow can model a finished run's features, raw and standardised.

    python -m experiments.flow_fit runs/affcl-incremental/affcl-s0 --data-root ../shared/data

The run's final global model embeds ``--samples`` training and ``--samples // 3`` test images of every class
(the flow's feature space, :func:`fcl_emu.methods.affcl.embed`); a fresh flow of the run's options is trained on
the training features with Adam (batch 32, ``--lr``), once with ``flow_input: raw`` (the code's form) and once
with ``standardized``, and reported after each of ``--steps``: the held-out NLL (nats, and per dimension: the
standard normal prior's floor is 0.919), the median norm of class-conditional samples against the features'
median norm, and how often a nearest-class-mean rule over the training features labels a sample as the class
it was drawn for (beside the rule's accuracy on the real test features). The features are fixed, so this
measures the flow alone, not the drift of a run's features.

A second table scores the run's own final flow (its checkpoint) on each task's held-out test features: NLL per
dimension (of the features as they are), how often the run's final classifier labels the real features right,
and how often it labels the flow's samples of that task's classes as the class they were drawn for. A flow that
kept the old tasks gives their held-out features an NLL of the last task's order and samples the classifier reads
as their class.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

from fcl_emu.methods.affcl import AFFCLOptions, build_flow
from fcl_emu.run_model import final_model

PRIOR_FLOOR = 0.5 * math.log(2 * math.pi)  # NLL per dimension of a density no higher than the standard normal's


def nearest_class_mean(h: torch.Tensor, y: torch.Tensor, num_classes: int):
    """A rule labelling features by the nearest class mean of ``(h, y)``."""
    means = torch.stack([h[y == c].mean(dim=0) for c in range(num_classes)])
    return lambda v: torch.cdist(v, means).argmin(dim=1)


def fit(train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor], num_classes: int,
        options: AFFCLOptions, steps: list[int], lr: float, seed: int = 0) -> list[dict]:
    """Train a fresh flow on ``train`` features for ``max(steps)`` Adam steps; a report at each of ``steps``."""
    (h, y), (h_test, y_test) = train, test
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    flow = build_flow(h.shape[1], num_classes, options)
    opt = torch.optim.Adam(flow.parameters(), lr=lr)
    rule = nearest_class_mean(h, y, num_classes)
    labels = torch.arange(num_classes).repeat_interleave(max(1, 500 // num_classes))
    out = []
    for step in range(1, max(steps) + 1):
        batch = torch.randint(0, len(y), (32,), generator=gen)
        flow.observe(h[batch])
        loss = -flow.log_prob(h[batch], y[batch])[0].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step in steps:
            with torch.no_grad():
                nll = -float(flow.log_prob(h_test, y_test)[0].mean())
                samples = flow.sample(labels, torch.Generator().manual_seed(seed + 1))[0]
            out.append({"flow_input": options.flow_input, "step": step, "nll": nll, "nll_per_dim": nll / h.shape[1],
                        "sample_norm": float(samples.norm(dim=1).median()),
                        "feature_norm": float(h_test.norm(dim=1).median()),
                        "sample_max": float(samples.abs().max()),
                        "sample_agreement": float((rule(samples) == labels).float().mean())})
    return out


def run_features(run_dir: Path, data_root: str, samples: int, seed: int = 0):
    """``(train, test, num_classes, options)``: the flow-space features of the run's final global model."""
    from fcl_emu.methods.affcl import embed
    from fcl_emu.scenario.transforms import to_tensor

    config, ds, model, _ = final_model(run_dir, data_root, "affcl")
    gen = torch.Generator().manual_seed(seed)

    def features(x, y, n):
        idx = torch.randperm(len(y), generator=gen)[:n].numpy()
        with torch.no_grad():
            return embed(model, to_tensor(x[idx], ds.mean, ds.std)), torch.as_tensor(y[idx]).long()

    return (features(ds.train_x, ds.train_y, samples), features(ds.test_x, ds.test_y, samples // 3), ds.num_classes,
            AFFCLOptions(**config.get("method_options") or {}))


def own_flow(run_dir: Path, data_root: str, per_task: int, seed: int = 0) -> list[dict]:
    """The run's final flow and classifier on up to ``per_task`` held-out test images of each task (see the module
    docstring)."""
    from fcl_emu.methods.affcl import FLOW, classify, embed, flow_dim
    from fcl_emu.scenario.scenario import build_scenario
    from fcl_emu.scenario.spec import ScenarioSpec
    from fcl_emu.scenario.transforms import to_tensor

    config, ds, model, state = final_model(run_dir, data_root, "affcl")
    arrays = {k[len(FLOW):]: v for k, v in state.items() if k.startswith(FLOW)}
    options = AFFCLOptions(**config.get("method_options") or {})
    flow = build_flow(flow_dim(model), ds.num_classes, options, arrays).eval()
    scenario = build_scenario(ScenarioSpec(**config["scenario"]), ds)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(scenario.num_tasks):
        # the classes the clients trained on in task t (a task pool's tasks introduce none of their own)
        classes = np.unique(np.concatenate([scenario.client_classes(k, t) for k in scenario.active_clients(t)]))
        idx = scenario.test_indices(classes)
        idx = idx[torch.randperm(len(idx), generator=gen)[:per_task].numpy()]
        y = torch.tensor(scenario.test_labels[idx]).long()  # the scenario's class ids, the model's outputs
        with torch.no_grad():
            h = embed(model, to_tensor(ds.test_x[idx], ds.mean, ds.std))
            samples = flow.sample(y, gen)[0]
            out.append({"task": t + 1, "classes": classes.tolist(),
                        "nll_per_dim": -float(flow.log_prob(h, y)[0].mean()) / flow.dim,
                        "real_accuracy": float((classify(model, h).argmax(dim=1) == y).float().mean()),
                        "sample_agreement": float((classify(model, samples).argmax(dim=1) == y).float().mean())})
    return out


def own_flow_markdown(rows: list[dict]) -> str:
    """:func:`own_flow`'s rows as a Markdown table."""
    lines = ["| task | classes | held-out NLL per dimension (nats) | classifier on the real features | "
             "classifier on the flow's samples |", "| ---: | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['task']} | {', '.join(map(str, r['classes']))} | {r['nll_per_dim']:.3g} | "
              f"{r['real_accuracy']:.2f} | {r['sample_agreement']:.2f} |" for r in rows]
    return "\n".join(lines)


def markdown(rows: list[dict], real_agreement: float) -> str:
    lines = ["| flow input | Adam steps | held-out NLL (nats) | per dimension | sample norm / feature norm | "
             "largest sample value | samples a nearest-class-mean rule labels right |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['flow_input']} | {r['step']} | {r['nll']:.0f} | {r['nll_per_dim']:.3f} | "
              f"{r['sample_norm']:.1f} / {r['feature_norm']:.1f} | {r['sample_max']:.3g} | "
              f"{r['sample_agreement']:.2f} |" for r in rows]
    return "\n".join(lines + [f"\nThe rule on the real test features: {real_agreement:.2f}; the prior's floor: "
                              f"{PRIOR_FLOOR:.3f} nats a dimension."])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a finished affcl run's directory (its checkpoint and config)")
    ap.add_argument("--data-root", default="../shared/data")
    ap.add_argument("--samples", type=int, default=6000, help="training features (a third as many test ones)")
    ap.add_argument("--steps", default="500,2000", help="comma-separated step counts to report at")
    ap.add_argument("--lr", type=float, default=1e-4, help="the flow's Adam lr (AF-FCL's flow_lr default)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, test, classes, options = run_features(args.run_dir, args.data_root, args.samples)
    steps = sorted(int(s) for s in args.steps.split(","))
    rows = [r for form in ("raw", "standardized")
            for r in fit(train, test, classes, options.model_copy(update={"flow_input": form}), steps, args.lr)]
    rule = nearest_class_mean(*train, classes)
    print(markdown(rows, float((rule(test[0]) == test[1]).float().mean())))
    print("\nThe run's own final flow and classifier, per task:\n")
    print(own_flow_markdown(own_flow(args.run_dir, args.data_root, args.samples // 3)))


if __name__ == "__main__":
    main()
