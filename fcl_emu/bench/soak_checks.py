"""The fault soak's checks on a finished run (``fcl-emu bench soak``, :mod:`fcl_emu.bench.soak`): updates counted
twice, and the faulted run against the baseline round by round and by accuracy matrix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fcl_emu.monitoring.results import RunSummary


def read_events(run_dir: Path) -> list[dict]:
    """``run_dir/events.jsonl`` as it stands (a line being written is left out)."""
    try:
        lines = (Path(run_dir) / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def double_counts(events: list[dict]) -> list[str]:
    """A client's update aggregated twice in a round; a round recorded twice by one coordinator; a round recorded
    after a resume from a checkpoint that already held it (each would count updates twice)."""
    problems, this_run, after = [], set(), 0
    for e in events:
        if e["event"] == "resume":
            this_run, after = set(), e.get("after_round", 0)
        if e["event"] != "round":
            continue
        n, contributors = e["round"], e.get("contributors") or []
        if len(set(contributors)) != len(contributors):
            problems.append(f"round {n}: an update aggregated twice ({contributors})")
        if n in this_run:
            problems.append(f"round {n} recorded twice without a resume between")
        elif n <= after:
            problems.append(f"round {n} run again after resuming from a checkpoint after round {after}")
        this_run.add(n)
    return problems


def last_records(events: list[dict]) -> dict[int, dict]:
    """Each round's record; a round run again after a resume counts as its last record."""
    return {e["round"]: e for e in events if e["event"] == "round"}


def emulated_drift(baseline: dict[int, dict], faulted: dict[int, dict], upto: int) -> dict[str, Any]:
    """Rounds up to ``upto`` in both runs: the largest difference of the emulated clock at a round's close and the
    bytes the faulted run sent more. Each resume starts new edge nodes, whose clients are sent their task's start
    again: the emulated clock counts its transfer."""
    common = [n for n in baseline if n in faulted and n <= upto]
    return {"rounds": len(common),
            "max_clock_difference_s": max((abs((faulted[n].get("emulated_clock_s") or 0.0)
                                               - (baseline[n].get("emulated_clock_s") or 0.0)) for n in common),
                                          default=0.0),
            "extra_bytes_sent": sum(faulted[n].get("bytes_sent", 0) - baseline[n].get("bytes_sent", 0)
                                    for n in common)}


def compare(baseline: RunSummary, faulted: RunSummary, baseline_events: list[dict], events: list[dict],
            losses: list[tuple[int, set[str]]]) -> dict:
    """The faulted run against the baseline, round by round (the clients aggregated) and by accuracy matrix:
    the same, or differences that start at a lossy fault and that it explains. ``losses``: each lossy fault as
    (the number of events recorded when it was injected, the edge nodes it took: a killed node, a lost host's)."""
    a, b = baseline.accuracy_matrix, faulted.accuracy_matrix
    cells = [{"task": i, "column": j, "baseline": a[i][j], "faulted": b[i][j]}
             for i in range(min(len(a), len(b))) for j in range(min(len(a[i]), len(b[i]))) if a[i][j] != b[i][j]]
    was, got = last_records(baseline_events), last_records(events)
    contributors = {n: (was.get(n, {}).get("contributors"), got.get(n, {}).get("contributors"))
                    for n in sorted(set(was) | set(got))}
    rounds = [{"round": n, "baseline": old, "faulted": new} for n, (old, new) in contributors.items() if old != new]
    exits = [(i, e["node"]) for i, e in enumerate(events) if e["event"] == "node_exit"]
    lost = set().union(*(nodes for _, nodes in losses))
    problems = [f"node_exit of {node} without a fault that took it" for node in sorted({n for _, n in exits} - lost)]
    result: dict[str, Any] = {"baseline": a, "faulted": b, "same": a == b, "cells_differing": cells,
                              "rounds_differing": rounds, "problems": problems}
    if not exits and not losses:
        result["emulated_time"] = emulated_drift(was, got, max(got, default=0))
        result["explanation"] = "no node was lost: every fault only delayed the run or was resumed, so it must match"
        if rounds or a != b:
            problems.append("the run differs from the baseline with no lossy fault")
        return result
    first = min([i for i, _ in losses] + [i for i, _ in exits])  # events recorded before the first loss
    counted = {e["round"]: i for i, e in enumerate(events) if e["event"] == "round"}  # a round's last record
    before = max((n for n, i in counted.items() if i < first), default=0)
    early = [r["round"] for r in rounds if counted.get(r["round"], len(events)) < first]
    if early:
        problems.append(f"rounds {early} aggregated other clients before the first lossy fault")
    ended = {e["task"]: i for i, e in enumerate(events) if e["event"] == "task_end"}
    rows = [t for t, i in sorted(ended.items()) if i < first and t < min(len(a), len(b)) and a[t] != b[t]]
    if rows:
        problems.append(f"accuracy rows {rows} differ although their tasks ended before the first lossy fault")
    if not rounds and a != b:
        problems.append("the matrix differs although every round aggregated the same clients")
    result["emulated_time"] = emulated_drift(was, got, before)
    nodes = ", ".join(sorted(lost | {n for _, n in exits}))
    numbers = [r["round"] for r in rounds]
    result["explanation"] = (
        f"node {nodes} lost (killed, or on a lost host; the first after round {before}): " + (
            f"{len(numbers)} rounds from round {numbers[0]} to {numbers[-1]} aggregated other clients than the "
            f"baseline's (the lost nodes' clients were gone until `up --resume` started every node again, or to the "
            f"end), so {len(cells)} cells of the accuracy matrix differ" if rounds else
            "a resume started its clients again before a round of theirs was lost, so the run matches"))
    return result
