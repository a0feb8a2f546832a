"""SecAgg+ on the emulated clock (coordinator/secure_timeline.py): each phase's dropouts are decided in emulated
time, so the same seed gives the same survivors per phase, the same recovered sum and the same accuracy on a
busy host with one edge node as on a quiet host with three."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import seeded_run

pytestmark = pytest.mark.slow

SECURE = {"enabled": True}


def profiles(tmp_path, clients: dict[int, str], **classes: dict) -> str:
    """A device profiles file: ``classes`` by name, each client pinned to one."""
    path = tmp_path / "profiles.yaml"
    path.write_text(yaml.safe_dump({"profiles": [{"name": name, **values} for name, values in classes.items()],
                                    "clients": clients}))
    return str(path)


def busy_and_quiet(tmp_path, mnist_root, **common):
    """The same seeded secure run on one edge node beside two busy-loop processes, and on three edge nodes on a
    quiet host; their summaries and round records."""
    loaded = seeded_run(tmp_path, mnist_root, "loaded", hogs=2, nodes=1, secagg=SECURE, **common)
    quiet = seeded_run(tmp_path, mnist_root, "quiet", nodes=3, secagg=SECURE, **common)
    return loaded, quiet


def phases(rounds: list[dict]) -> list[tuple]:
    """What a round's secure aggregation decided: outcome, survivors and emulated seconds per phase."""
    keys = ("outcome", "survivors", "emulated_phase_s", "dropouts")
    return [tuple(r["secagg"][k] for k in keys) for r in rounds]


def test_the_same_survivors_per_phase_and_accuracy_on_a_busy_host_with_one_node_and_a_quiet_one_with_three(
        tmp_path, mnist_root):
    """Two clients upload over 2 Mbit/s: their 1.1 MB masked inputs take 4.5 s, past the 3 s deadline, so
    they drop out of the masked-input phase whenever they are sampled: the unmasking recovers their masks (or,
    with both sampled, a survivor keeps fewer than t share holders and the round aborts). A fixed cost per
    sample makes the emulated times exact."""
    devices = profiles(tmp_path, {0: "slow", 1: "slow"} | {i: "ok" for i in range(2, 10)},
                       ok={"ms_per_sample": 2}, slow={"ms_per_sample": 2, "uplink_mbps": 2})
    (loaded, loaded_rounds), (quiet, quiet_rounds) = busy_and_quiet(
        tmp_path, mnist_root, seed=4, training={"local_epochs": 1},
        scenario={"num_clients": 10, "num_tasks": 1, "samples_per_client_task": 100},
        rounds={"clients_per_round": 5, "rounds_per_task": 3, "deadline_s": 3, "eval_every": 3},
        edge={"device_profiles": devices})
    assert loaded.clock == quiet.clock == "emulated"
    assert phases(loaded_rounds) == phases(quiet_rounds)
    recovered = [r for r in quiet_rounds if r["secagg"]["outcome"] == "completed" and r["secagg"]["recovered"]]
    assert recovered and all(r["late"] == r["secagg"]["recovered"] for r in recovered)  # the slow ones' inputs
    assert loaded.accuracy_matrix == quiet.accuracy_matrix
    assert loaded.emulated_s == quiet.emulated_s
    assert loaded.host_timeouts == quiet.host_timeouts == 0


def test_a_client_gone_between_its_masked_input_and_the_unmasking_is_recovered_alike(tmp_path, mnist_root):
    """Every device has a 0.5 s one-way latency and a fixed cost per sample, so round 1's phases close at
    1, 2, 3 and 4 s of emulated time. Client 0's trace turns it off at 3.5 s: after its masked input arrived,
    before its unmasking reply would: it stays in the sum, and its self-mask is rebuilt from its neighbours'
    shares. Round 2 goes on without it."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({str(i): {"active": [0], "inactive": [3.5 if i == 0 else 1000],
                                          "finish_time": 1000} for i in range(5)}))
    devices = profiles(tmp_path, {i: "std" for i in range(5)}, std={"ms_per_sample": 2, "latency_ms": 500})
    (loaded, loaded_rounds), (quiet, quiet_rounds) = busy_and_quiet(
        tmp_path, mnist_root, seed=1, training={"local_epochs": 1},
        scenario={"num_clients": 5, "num_tasks": 1, "samples_per_client_task": 100},
        rounds={"clients_per_round": 5, "rounds_per_task": 2, "deadline_s": 10, "eval_every": 2},
        edge={"device_profiles": devices, "availability": f"trace:{trace}"})
    assert phases(loaded_rounds) == phases(quiet_rounds)
    assert loaded.accuracy_matrix == quiet.accuracy_matrix
    first, second = quiet_rounds
    everyone = [f"client-{i:04d}" for i in range(5)]
    secagg = first["secagg"]
    assert secagg["outcome"] == "completed" and secagg["clients"] == 5  # client 0's input is in the sum
    assert secagg["survivors"]["masked_input"] == everyone
    assert secagg["survivors"]["unmasking"] == everyone[1:]
    assert secagg["dropouts"] == {"advertise_keys": 0, "share_keys": 0, "masked_input": 0, "unmasking": 1}
    assert secagg["emulated_phase_s"] == pytest.approx({"advertise_keys": 1.0, "share_keys": 1.0,
                                                        "masked_input": 1.0, "unmasking": 1.0})
    assert first["participants"] == 5 and first["emulated_s"] == pytest.approx(4.0)
    assert second["selected"] == 4 and second["secagg"]["survivors"]["unmasking"] == everyone[1:]
