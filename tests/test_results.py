"""The FCIL metric definitions, against hand-computed values; the summary.json record."""

import json
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fcl_emu.monitoring.results import (Checkpoints, Clients, GpuJobs, JobTotals, KnowledgeRetention, LinkBytes,
                                        LinkTraffic, Liveness, RunRecorder, RunSummary, SecAggTotals, TimeAccounting,
                                        average_accuracy, average_forgetting, average_incremental_accuracy,
                                        client_test_accuracy, link_bytes, link_rows, link_text, spatial_retention,
                                        temporal_retention)

# After task 0: 90 on task 0. After task 1: 60 on task 0, 80 on task 1.
# After task 2: 30 on task 0, 50 on task 1, 70 on task 2.
MATRIX = [[90.0, None, None], [60.0, 80.0, None], [30.0, 50.0, 70.0]]


def test_average_accuracy_is_the_mean_of_the_last_row():
    assert average_accuracy(MATRIX) == pytest.approx((30 + 50 + 70) / 3)


def test_average_incremental_accuracy_averages_each_rows_seen_tasks():
    assert average_incremental_accuracy(MATRIX) == pytest.approx((90 + (60 + 80) / 2 + 50) / 3)


def test_forgetting_is_the_drop_from_the_best_earlier_accuracy():
    # task 0: best 90 (after task 0) -> 30; task 1: best 80 -> 50
    assert average_forgetting(MATRIX) == pytest.approx(((90 - 30) + (80 - 50)) / 2)
    assert average_forgetting([[55.0]]) == 0.0


def test_tasks_without_classes_are_left_out():
    # task 1 introduced no class (clients on their own sequences): its column is None
    matrix = [[80.0, None, None], [40.0, None, None], [20.0, None, 60.0]]
    assert average_accuracy(matrix) == pytest.approx(40.0)
    assert average_forgetting(matrix) == pytest.approx(80.0 - 20.0)  # only task 0 counts


def test_temporal_retention_is_the_final_share_of_the_best_accuracy():
    # task 0: 30 of its best 90; task 1: 50 of its best 80
    assert temporal_retention(MATRIX) == pytest.approx(100 * (30 / 90 + 50 / 80) / 2)
    # a task whose accuracy rises later (its classes came back) counts its best: never more than 100
    assert temporal_retention([[10.0, None, None], [40.0, 70.0, None], [20.0, 35.0, 50.0]]) == pytest.approx(
        100 * (20 / 40 + 35 / 70) / 2)
    assert temporal_retention([[55.0]]) is None


def test_spatial_retention_per_client_and_private_classes():
    hits, totals = np.array([9, 5, 0, 8]), np.array([10, 10, 10, 10])
    clients = [np.array([0, 1]), np.array([1, 2]), np.array([1, 3]), np.array([], dtype=np.int64)]
    kr = spatial_retention(hits, totals, clients)
    # client 0: 14/20, client 1: 5/20, client 2: 13/20 (the empty client is left out)
    assert kr["spatial"] == pytest.approx(100 * (14 / 20 + 5 / 20 + 13 / 20) / 3)
    assert kr["private"] == pytest.approx(100 * (9 + 0 + 8) / 30)  # classes 0, 2, 3 have one owner each
    assert spatial_retention(hits, totals, [np.array([0, 1])] * 2)["private"] is None


def test_client_test_accuracy_sums_every_clients_task_test_sets():
    hits, totals = np.array([9, 5, 0, 8]), np.array([10, 10, 10, 20])
    # client 0: task 0 classes {0, 1}, task 1 class {3}; client 1: task 0 {1}, task 1 nothing new
    clients = [[np.array([0, 1]), np.array([3])], [np.array([1]), np.array([], dtype=np.int64)]]
    # correct: 9 + 5 + 8 + 5 = 27 of 10 + 10 + 20 + 10 = 50 (class 1 counted once per holder)
    assert client_test_accuracy(hits, totals, clients) == pytest.approx(100 * 27 / 50)
    assert client_test_accuracy(hits, totals, [[np.array([], dtype=np.int64)]]) is None


# --------------------------------------------------------------------------- summary.json, the RunSummary record
def full_summary() -> RunSummary:
    """A record with every part filled in, as the coordinator writes it (numpy numbers included)."""
    return RunSummary(
        status="completed", run_id="0123456789ab", run_dir="runs/x", method="glfc", method_options={"w_rd": 0.5},
        dataset="mnist", model="cnn", scenario={"num_tasks": 3, "num_clients": 20}, seed=3,
        accuracy_matrix=MATRIX, accuracy_seen=[90.0, 70.0, 50.0], accuracy_all=[18.0, 28.0, 30.0],
        accuracy_clients=[91.0, None, 52.5], average_accuracy=50.0, average_incremental_accuracy=70.0,
        average_forgetting=45.0, knowledge_retention=KnowledgeRetention(temporal=47.9, spatial=51.0),
        bytes={"train_request": {"sent": 6_000_000}, "update": {"received": 5_900_000}},
        messages={"train_request/sent": 12, "update/received": 12}, bytes_total=np.int64(11_900_000), rounds=6,
        rounds_skipped=1, wall_clock_s=np.float64(42.5), clock="emulated", emulated_s=120.0, host_timeouts=1,
        bytes_discarded=1000, time=TimeAccounting(wall_s=43.0, parts_s={"join": 1.0, "rounds": 41.0}, accounted=0.9767),
        phase_s={"dispatch": 0.1, "collect": 10.0}, handling_s={"update": 0.5},
        liveness=Liveness(heartbeat_interval_s=1.0, liveness_timeout_s=10.0),
        clients=Clients(configured=20, joined=20, rejoined=1, left=2, dropped=3, online_at_end=15,
                        switched_connection=1),
        missed_deadline=1, late_updates=2, late_side_channel=3, rejected_messages={"too_large": 2},
        refused_handshakes={"unknown_key": 4}, rejected_gpu_pool={"frame_count": 1},
        secagg=SecAggTotals(completed=5, aborted=1, phase_s={"keys": 0.2}, dropouts={"masked": 1}),
        gpu_jobs=GpuJobs(workers=1, device="cpu", by_kind={"glfc.proxy": JobTotals(jobs=3, attempts=3, run_s=4.5)}),
        resumes=1, checkpoints=Checkpoints(saved=7, seconds=0.07, bytes=1_170_000),
        link_bytes=LinkBytes(coordinator=LinkTraffic(down=6_000_000, up=5_900_000),
                             clients=LinkTraffic(down=6_000_000, up=5_900_000)))


def test_summary_round_trips_through_its_json_file(tmp_path):
    record = full_summary()
    recorder = RunRecorder(tmp_path, "seed: 3\n")
    path = recorder.summary(record)
    recorder.close()
    data = json.loads(path.read_text())
    assert data == record.to_dict() and list(data) == list(RunSummary.__struct_fields__)
    assert type(data["bytes_total"]) is int and data["gpu_jobs"]["by_kind"]["glfc.proxy"]["failed"] == 0
    loaded = RunSummary.load(path)
    assert loaded == record and loaded.to_dict() == data
    assert loaded.clients.joined == 20 and loaded.gpu_jobs.by_kind["glfc.proxy"].run_s == 4.5


def test_summary_of_an_older_run_loads_with_defaults():
    old = {"status": "interrupted", "method": "fedavg", "dataset": "mnist", "accuracy_matrix": [[80.0]],
           "bytes_total": 10, "rounds": 2, "wall_clock_s": 3.0, "clients": {"configured": 4, "joined": 4}}
    record = RunSummary.from_dict(old)
    assert record.clients.switched_connection == 0 and record.time is None and record.clock is None
    assert record.knowledge_retention == KnowledgeRetention() and record.gpu_jobs is None and not record.completed
    assert record.refused_handshakes is None and record.rejected_gpu_pool == {}
    with pytest.raises(msgspec.ValidationError, match="missing required field `status`"):
        RunSummary.from_dict({k: v for k, v in old.items() if k != "status"})


# Under two edge aggregators: the coordinator's socket counted each client's model whole (12 MB sent) but put it on
# the wire once per aggregator (2.4 MB); it received the aggregators' notices and aggregates (1.2 MB). The clients'
# links, as the aggregators reported them, carried the model to each client and each client's update up.
TIERED = {"bytes": {"train_request": {"sent": 12_000_000}, "edge_aggregate": {"received": 1_200_000}},
          "bytes_total": 13_200_000,
          "tier_bytes": {"edge_cloud": {"sent": 2_400_000, "received": 1_200_000},
                         "client_edge": {"sent": 12_000_000, "received": 11_900_000}}}


def test_link_bytes_are_the_coordinators_and_the_clients_links_each_direction():
    star = link_bytes({"train_request": {"sent": 6_000_000}, "update": {"received": 5_900_000}}, {})
    assert star.tiers == 1 and star.coordinator == star.clients == LinkTraffic(down=6_000_000, up=5_900_000)
    tiered = link_bytes(TIERED["bytes"], TIERED["tier_bytes"])
    assert tiered.tiers == 2
    assert tiered.coordinator == LinkTraffic(down=2_400_000, up=1_200_000)  # what the coordinator's links carried
    assert tiered.clients == LinkTraffic(down=12_000_000, up=11_900_000) and tiered.clients.total == 23_900_000


def test_a_summary_from_before_link_bytes_gets_them_from_its_byte_counts():
    old = {"status": "completed", "method": "fedavg", "dataset": "mnist", "accuracy_matrix": [[80.0]], "rounds": 2,
           "wall_clock_s": 3.0}
    tiered = RunSummary.from_dict({**old, **TIERED})
    assert tiered.link_bytes == link_bytes(TIERED["bytes"], TIERED["tier_bytes"])
    star = RunSummary.from_dict({**old, "bytes": {"update": {"received": 10}}, "bytes_total": 10})
    assert star.link_bytes.tiers == 1 and star.link_bytes.coordinator.up == 10
    assert RunSummary.from_dict({**old, "bytes_total": 10}).link_bytes is None  # nothing to tell the links apart


def test_summaries_print_one_byte_row_in_a_star_and_one_per_tier_under_edge_aggregators():
    def printed(summary: RunSummary) -> list[tuple[str, str]]:
        return [(name, link_text(link, summary.bytes_total)) for name, link in link_rows(summary)]

    old = {"status": "completed", "method": "fedavg", "dataset": "mnist", "accuracy_matrix": [[80.0]], "rounds": 2,
           "wall_clock_s": 3.0}
    assert printed(full_summary()) == [("bytes on the wire", "11.9 MB (6.0 down, 5.9 up)")]
    assert printed(RunSummary.from_dict({**old, **TIERED})) == [
        ("bytes at the coordinator", "3.6 MB (2.4 down, 1.2 up)"),
        ("bytes on clients' links", "23.9 MB (12.0 down, 11.9 up)")]  # not the 13.2 MB that no link carried
    assert printed(RunSummary.from_dict({**old, "bytes_total": 10_000_000})) == [
        ("bytes counted at the coordinator", "10.0 MB")]


def test_every_documented_summary_key_is_a_field_and_every_field_is_documented():
    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    table = text.split("`summary.json` of every run holds", 1)[1].split("\n\n", 2)[1]
    documented = {key for line in table.splitlines() if line.startswith("| `")
                  for key in re.findall(r"`(\w+)`", line.split(" | ")[0])}
    assert documented == set(RunSummary.__struct_fields__)
