"""The fault soak: its schedule, its checks on fake events, and a short real soak (``fcl-emu bench soak``)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

from fcl_emu.bench import soak, soak_checks, soak_cluster
from fcl_emu.containers import local_cluster
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
    on_cluster = soak.schedule(soak_cluster.KINDS, 20, 40, seed=1)  # both lossy kinds after every other fault
    kinds = [f.kind for f in on_cluster]
    lossy = [k for k in kinds if k in soak.LOSSY]
    assert set(lossy) == {"container_kill", "lose_host"} and kinds[-len(lossy):] == lossy
    assert all((0 < f.duration_s <= 0.4 * soak.LIVENESS_S) == (f.kind in soak.LONGEST) for f in on_cluster)


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


def test_compare_explains_differences_by_lossy_faults_only():
    base = [_round(1, ["a", "b"]), {"event": "task_end", "task": 0}, _round(2, ["a", "b"])]
    kill = [(2, {"node-1"})]
    faulted = [_round(1, ["a", "b"]), {"event": "task_end", "task": 0}, {"event": "node_exit", "node": "node-1"},
               _round(2, ["a"])]
    same = soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [80.0, 70.0]]), base, base, [])
    assert same["problems"] == [] and same["same"]
    explained = soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [81.0, 69.0]]), base, faulted,
                             kill)
    assert explained["problems"] == [] and [r["round"] for r in explained["rounds_differing"]] == [2]
    assert "node node-1 lost (killed, or on a lost host; the first after round 1)" in explained["explanation"]
    assert len(explained["cells_differing"]) == 2
    assert explained["emulated_time"] == {"rounds": 1, "max_clock_difference_s": 0.0, "extra_bytes_sent": 0}
    unexplained = soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [81.0, 69.0]]), base,
                                      faulted, [])
    assert unexplained["problems"] == ["node_exit of node-1 without a fault that took it"]
    rerun = [_round(1, ["a", "b"]), {"event": "task_end", "task": 0}, _round(2, ["a", "b"]), {"event": "resume"},
             {"event": "node_exit", "node": "node-1"}, _round(2, ["a"])]  # round 2 run again after the kill
    assert soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [81.0, 69.0]]), base, rerun,
                        kill)["problems"] == []
    early = [_round(1, ["b"]), {"event": "task_end", "task": 0}, {"event": "node_exit", "node": "node-1"}]
    assert soak_checks.compare(_summary([[90.0]]), _summary([[91.0]]), base[:2], early, kill)["problems"] == [
        "rounds [1] aggregated other clients before the first lossy fault",
        "accuracy rows [0] differ although their tasks ended before the first lossy fault"]
    delayed = soak_checks.compare(_summary([[90.0]]), _summary([[89.0]]), base[:1], base[:1], [])
    assert delayed["problems"] == ["the run differs from the baseline with no lossy fault"]
    # a lost host's nodes exit late or never (the swarm sees the host down minutes later): the loss itself, at the
    # events recorded when it was injected, is where the run may start to differ
    lost = [_round(1, ["a", "b"]), {"event": "task_end", "task": 0}, _round(2, ["a"])]
    explained = soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [81.0, 69.0]]), base, lost,
                                    [(2, {"node-1", "node-3"})])
    assert explained["problems"] == [] and "node node-1, node-3 lost" in explained["explanation"]
    assert soak_checks.compare(_summary([[90.0], [80.0, 70.0]]), _summary([[90.0], [81.0, 69.0]]), base, lost,
                               [(3, {"node-1"})])["problems"] == [
        "rounds [2] aggregated other clients before the first lossy fault"]


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
    """Five faults, one of each kind, into a 6-client, 3-node, 2 x 100-round MNIST run (its rounds take a fraction
    of a second each, its faults seconds: the run must outlast them): every check passes."""
    out = tmp_path / "soak"
    proc = subprocess.run(
        [sys.executable, "-m", "fcl_emu", "bench", "soak", "--faults", "5", "--clients", "6", "--nodes", "3",
         "--rounds-per-task", "100", "--samples", "128", "--data-root", str(mnist_root), "--out", str(out)],
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


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_cluster_soak_survives_every_fault_across_hosts(image, tmp_path, mnist_root):
    """One fault of each cluster kind (partition, slowed host, paused and killed containers, a lost host, the
    coordinator killed and resumed, a full disk) into a 6-client run whose 3 edge nodes are Swarm services on a
    3-host local cluster the soak makes: every check passes and the cluster is gone afterwards."""
    from tests.test_cluster import _why_not

    reason = _why_not()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "soak"
    proc = subprocess.run(
        [sys.executable, "-m", "fcl_emu", "bench", "soak", "--cluster", "local", "--hosts", "3", "--image", image,
         "--faults", str(len(soak_cluster.KINDS)), "--clients", "6", "--nodes", "3", "--rounds-per-task", "50",
         "--samples", "128", "--data-root", str(mnist_root), "--out", str(out)],
        env=node_env(), capture_output=True, text=True, timeout=1100)
    result = json.loads((out / "soak.json").read_text())
    problems = {**result["checks"], **{f"{f['kind']}@{f['at_round']}": f["problems"] for f in result["faults"]}}
    assert proc.returncode == 0, json.dumps({k: v for k, v in problems.items() if v}) + proc.stdout[-3000:]
    faults = {f["kind"]: f for f in result["faults"]}
    assert set(faults) == set(soak_cluster.KINDS)
    for kind, fault in faults.items():  # a fault is skipped only where this machine cannot inject it
        assert fault["survived"] or fault["skipped"] == result["skipped"].get(kind), fault
    assert result["resumes"] >= 1 and result["cluster"]["config"]["backend"] == "swarm"
    lost = faults["lose_host"]
    assert lost["survived"] and lost["target"] in result["cluster"]["lost"] and lost["lost"]
    assert local_cluster.leftovers(soak_cluster.NAME) == []
