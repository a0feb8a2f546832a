"""How the reproduction tables judge a paper's claim: a learnability gate on the table's FedAvg pilot, then a
verdict from the seeds' paired differences (docs/reproduction.md, "The verdict rule").

A claim is "``method`` is better than ``other`` in ``metric``" as a paper's table states it, with the paper's own
two numbers in the same metric where the paper gives them (:class:`Claim`). The rows the tables pass in are
per-seed dicts with ``method`` (or the table's row key), ``seed``, ``status`` and the metrics named below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fcl_emu.monitoring.results import RunSummary, learned_accuracy

#: The verdicts, worded as the results pages word them.
REPRODUCED = "reproduced in direction"
INCONCLUSIVE = "inconclusive"
NOT_REPRODUCED = "not reproduced (reversed)"
UNINFORMATIVE = "uninformative (below the learnability gate)"

#: The row fields a claim may be judged on, and how the tables name them.
METRICS = {
    "avg_accuracy": "final average accuracy",  # LANDER, TARGET, AF-FCL
    "time_avg": "time-averaged accuracy",  # MFCL, GLFC ("Avg.")
    "avg_forgetting": "average forgetting",
    "ga_mean": "mean GA",  # FedCBC
}
#: The gate: every task learned to at least this accuracy right after it ...
GATE_FLOOR = 40.0
#: ... and to at least this many times chance (one over the classes the run uses) ...
GATE_TIMES_CHANCE = 4.0
#: ... and at the end, the old tasks keep at most this share of what was learned of them (forgetting to prevent).
GATE_HEADROOM = 1 / 3
#: Seeds a verdict needs at least.
MIN_SEEDS = 3
#: The least mean difference (percentage points) a verdict other than inconclusive needs, whatever the spread:
#: deterministic runs that differ by hundredths of a point in every seed say nothing about a method.
MIN_EFFECT = 1.0


@dataclass(frozen=True)
class Claim:
    """``method`` is better than ``other`` in ``metric`` (lower for forgetting), as ``source`` states it (the
    paper and its table); ``paper`` holds the paper's own two numbers in that metric, where it gives them."""

    method: str
    other: str
    source: str
    metric: str = "avg_accuracy"
    paper: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"claim metric {self.metric!r}: one of {', '.join(METRICS)}")

    @property
    def lower_is_better(self) -> bool:
        return self.metric == "avg_forgetting"

    def text(self) -> str:
        word = "forgets less than" if self.lower_is_better else "above"
        paper = "" if self.paper is None else f"; paper: {self.paper[0]:.2f} vs {self.paper[1]:.2f}"
        return f"{self.method} {word} {self.other} in {METRICS[self.metric]} ({self.source}{paper})"


@dataclass(frozen=True)
class Gate:
    """Whether a protocol can tell (``passed``) and the numbers that say so."""

    passed: bool
    reason: str


def learnability_gate(pilot: dict | None, num_classes: int) -> Gate:
    """The gate on a table's pilot run (FedAvg, its first seed; a row with ``learned_accuracy``, each task's
    accuracy right after it, and ``final_row``, the last row of the accuracy matrix): every task learned to at
    least :data:`GATE_FLOOR` % and :data:`GATE_TIMES_CHANCE` x chance (1 / ``num_classes``), and the old tasks
    keeping at most :data:`GATE_HEADROOM` of that at the end."""
    if pilot is None or pilot.get("status") != "completed" or not pilot.get("learned_accuracy"):
        return Gate(False, "no completed pilot run (fedavg, first seed)")
    learned = [a for a in pilot["learned_accuracy"] if a is not None]
    need = max(GATE_FLOOR, GATE_TIMES_CHANCE * 100 / num_classes)
    numbers = f"pilot's tasks right after each: {', '.join(f'{a:.1f}' for a in learned)} % (need {need:.1f})"
    if min(learned) < need:
        return Gate(False, numbers)
    old = [(a, f) for a, f in zip(pilot["learned_accuracy"][:-1], pilot["final_row"][:-1])
           if a is not None and f is not None]
    if not old:
        return Gate(False, numbers + "; one task: nothing to forget")
    kept, learnt = float(np.mean([f for _, f in old])), float(np.mean([a for a, _ in old]))
    numbers += f"; old tasks at the end {kept:.1f} of {learnt:.1f} %"
    return Gate(kept <= GATE_HEADROOM * learnt, numbers + ("" if kept <= GATE_HEADROOM * learnt else
                                                           " (over a third kept: little forgetting to prevent)"))


def paired_verdict(a: list[float], b: list[float], lower_is_better: bool = False) -> tuple[str, str]:
    """The verdict on "``a`` is better than ``b``" from per-seed values in the same seed order, and its numbers:
    :data:`REPRODUCED` when every seed's difference has the claimed sign and their mean exceeds two standard
    errors and :data:`MIN_EFFECT`, :data:`NOT_REPRODUCED` when every difference is reversed and the mean exceeds
    both the other way, :data:`INCONCLUSIVE` otherwise."""
    if len(a) != len(b):
        raise ValueError(f"paired values: {len(a)} against {len(b)}")
    d = np.array(a, dtype=float) - np.array(b, dtype=float)
    if lower_is_better:
        d = -d
    if len(d) < MIN_SEEDS:
        return f"not judged: {len(d)} paired seeds (needs {MIN_SEEDS})", ""
    mean, se = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(len(d))
    text = f"paired difference {mean:+.2f} ± {se:.2f} (standard error), per seed {', '.join(f'{x:+.2f}' for x in d)}"
    if (d > 0).all() and mean > max(2 * se, MIN_EFFECT):
        return REPRODUCED, text
    if (d < 0).all() and -mean > max(2 * se, MIN_EFFECT):
        return NOT_REPRODUCED, text
    return INCONCLUSIVE, text


def between(claims: tuple[Claim, ...], names) -> tuple[Claim, ...]:
    """The ``claims`` whose two rows are both among ``names`` (the rows a table has): the ones it can judge."""
    names = set(names)
    return tuple(c for c in claims if {c.method, c.other} <= names)


def verdicts(rows: list[dict], claims: tuple[Claim, ...], gate: Gate, key: str = "method") -> list[str]:
    """One Markdown line per claim: below the gate :data:`UNINFORMATIVE`, else :func:`paired_verdict` on the
    seeds where both rows completed."""
    lines = [f"Learnability gate: {'passed' if gate.passed else 'not passed'} ({gate.reason})."]
    for claim in claims:
        values = {}
        for name in (claim.method, claim.other):
            values[name] = {r["seed"]: r.get(claim.metric) for r in rows if r[key] == name
                            and r["status"] == "completed" and r.get(claim.metric) is not None}
        seeds = sorted(set(values[claim.method]) & set(values[claim.other]))
        if not gate.passed:
            lines.append(f"- {claim.text()}: {UNINFORMATIVE}")
            continue
        if not seeds:
            lines.append(f"- {claim.text()}: not measured yet")
            continue
        a, b = [values[claim.method][s] for s in seeds], [values[claim.other][s] for s in seeds]
        verdict, text = paired_verdict(a, b, claim.lower_is_better)
        ours = f"ours: {np.mean(a):.2f} vs {np.mean(b):.2f}, seeds {', '.join(map(str, seeds))}"
        lines.append(f"- {claim.text()}: **{verdict}** ({ours}" + (f"; {text})" if text else ")"))
    return lines


def accuracy_fields(s: RunSummary) -> dict:
    """The accuracy figures every table row carries, for the claims and the gate: the final average accuracy, the
    time-averaged accuracy, the forgetting, each task's accuracy right after it and the matrix's last row."""
    matrix = s.accuracy_matrix
    return {"avg_accuracy": s.average_accuracy, "time_avg": s.average_incremental_accuracy,
            "avg_forgetting": s.average_forgetting, "learned_accuracy": learned_accuracy(matrix),
            "final_row": matrix[-1] if matrix else None}


def pilot_row(rows: list[dict], key: str = "method", name: str = "fedavg") -> dict | None:
    """The pilot of a table: its ``name`` row at the lowest seed."""
    runs = sorted((r for r in rows if r[key] == name), key=lambda r: r["seed"])
    return runs[0] if runs else None
