"""The fault soak: its schedule, its checks on fake events, and a short real soak (``fcl-emu bench soak``)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

from fcl_emu.bench import soak, soak_checks
from fcl_emu.launchers.process import node_env


def test_schedule_is_seeded_and_draws_every_kind_per_cycle():
    first = soak.schedule(soak.KINDS, 7, 20, seed=3)
    assert first == soak.schedule(soak.KINDS, 7, 20, seed=3)
    assert sorted(f.kind for f in soak.schedule(soak.KINDS, 5, 20, seed=3)) == sorted(soak.KINDS)
    assert [f.at_round for f in first] == sorted(f.at_round for f in first)
    kinds = [f.kind for f in first]
    assert kinds[-kinds.count("node_kill"):] == ["node_kill"] * kinds.count("node_kill") and "node_kill" in kinds
    assert all(1 <= f.at_round <= 15 for f in first)
    for f in first:  # delays stay well inside the liveness timeout; the others have no duration
        assert (0 < f.duration_s < 0.5 * soak.LIVENESS_S) == (f.kind in ("node_stop", "net_cut"))


def _round(n, contributors):
    return {"event": "round", "round": n, "contributors": contributors}


def test_double_counts_allow_a_round_again_only_after_a_resume():
    events = [_round(1, ["a", "b"]), _round(2, ["a"]), {"event": "resume", "after_round": 1}, _round(2, ["a", "b"]),
              _round(3, ["b"])]
    assert soak_checks.double_counts(events) == []
    assert soak_checks.double_counts(events[:3] + [_round(1, ["a"])]) == [
        "round 1 run again after resuming from a checkpoint after round 1"]
    assert soak_checks.double_counts([_round(1, ["a", "a"])]) == ["round 1: an update aggregated twice (['a', 'a'])"]
    assert soak_checks.double_counts([_round(1, ["a"]), _round(1, ["a"])]) == [
        "round 1 recorded twice without a resume between"]


def _summary(matrix):
    return SimpleNamespace(accuracy_matrix=matrix, status="completed")


def test_compare_explains_differences_by_node_kills_only():
    base = [_round(1, ["a", "b"]), {"event": "task_end", "task": 0}, _round(2, ["a", "b"])]
    kill = {"node-1"}
    faulted = [_round(1, ["a", "b"]), {"event": "task_end", "task": 0}, {"event": "node_exit", "node": "node-1"},
               _round(2, ["a"])]
    same = soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [80.0, 70.0]]), base, base, set())
    assert same["problems"] == [] and same["same"]
    explained = soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [81.0, 69.0]]), base, faulted,
                             kill)
    assert explained["problems"] == [] and [r["round"] for r in explained["rounds_differing"]] == [2]
    assert "node node-1 SIGKILLed (first after round 1)" in explained["explanation"]
    assert len(explained["cells_differing"]) == 2
    assert explained["emulated_time"] == {"rounds": 1, "max_clock_difference_s": 0.0, "extra_bytes_sent": 0}
    unexplained = soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [81.0, 69.0]]), base,
                                      faulted, set())
    assert unexplained["problems"] == ["node_exit of node-1 without a node kill"]
    rerun = [_round(1, ["a", "b"]), {"event": "task_end", "task": 0}, _round(2, ["a", "b"]), {"event": "resume"},
             {"event": "node_exit", "node": "node-1"}, _round(2, ["a"])]  # round 2 run again after the kill
    assert soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [81.0, 69.0]]), base, rerun,
                        kill)["problems"] == []
    early = [_round(1, ["b"]), {"event": "task_end", "task": 0}, {"event": "node_exit", "node": "node-1"}]
    assert soak_checks.compare(_summary([[90.0]]), _summary([[91.0]]), base[:2], early, kill)["problems"] == [
        "rounds [1] aggregated other clients before any node exit",
        "accuracy rows [0] differ although their tasks ended before any node exit"]
    delayed = soak_checks.compare(_summary([[90.0]]), _summary([[89.0]]), base[:1], base[:1], set())
    assert delayed["problems"] == ["the run differs from the baseline with no node exit"]


def test_fill_stops_at_a_full_disk(tmp_path, monkeypatch):
    written = []

    class Full:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, chunk):
            if sum(written) + len(chunk) > 3_000_000:
                raise OSError(28, "No space left on device")
            written.append(len(chunk))
            return len(chunk)

    monkeypatch.setattr(soak, "open", Full, raising=False)  # the module's own name shadows the builtin
    assert soak.fill(tmp_path / "filler") == 3_000_000


@pytest.mark.slow
def test_short_soak_survives_every_fault(tmp_path, mnist_root):
    """Five faults, one of each kind, into a 6-client, 3-node, 2 x 8-round MNIST run: every check passes."""
    out = tmp_path / "soak"
    proc = subprocess.run(
        [sys.executable, "-m", "fcl_emu", "bench", "soak", "--faults", "5", "--clients", "6", "--nodes", "3",
         "--rounds-per-task", "8", "--samples", "128", "--data-root", str(mnist_root), "--out", str(out)],
        env=node_env(), capture_output=True, text=True, timeout=400)
    result = json.loads((out / "soak.json").read_text())
    problems = {**result["checks"], **{f"{f['kind']}@{f['at_round']}": f["problems"] for f in result["faults"]}}
    assert proc.returncode == 0, json.dumps({k: v for k, v in problems.items() if v})
    assert result["ok"] and not any(result["checks"].values())
    faults = {f["kind"]: f for f in result["faults"]}
    assert set(faults) == set(soak.KINDS)
    for kind, fault in faults.items():  # a fault is skipped only where this machine cannot inject it
        assert fault["survived"] or fault["skipped"] == result["skipped"].get(kind), fault
    assert result["faults_survived"] == result["faults_injected"] >= 3
    assert result["faults_per_hour"] > 0
    assert (out / "faults.csv").read_text().splitlines()[0].startswith("kind,at_round,target")
    assert (out / "faulted" / "summary.json").exists() and (out / "baseline" / "summary.json").exists()
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or ())]
