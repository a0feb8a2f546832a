"""``fcl-emu bench churn``: configs per point, the CSV and the plot (unit), and one tiny real sweep (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from fcl_emu.bench import churn
from fcl_emu.runconfig import RunConfig
from fcl_emu.launchers.process import node_env
from fcl_emu.monitoring.results import Clients, RunSummary


def fake_summary(acc: float, forgetting: float, rounds: int = 12, skipped: int = 0, left: int = 0) -> RunSummary:
    return RunSummary(status="completed", method="fedavg", dataset="mnist", accuracy_matrix=[],
                      average_accuracy=acc, average_forgetting=forgetting, rounds=rounds, rounds_skipped=skipped,
                      bytes_total=250_000_000, wall_clock_s=30.5,
                      clients=Clients(joined=60, left=left, rejoined=left // 2, dropped=1), missed_deadline=2)


def test_churn_rate_maps_to_availability():
    assert churn.availability_for(0) == "always"
    assert churn.availability_for(0.3) == "bernoulli:0.7"
    assert churn.availability_for(0.5) == "bernoulli:0.5"
    with pytest.raises(ValueError):
        churn.availability_for(1.0)
    assert churn.parse_rates("0.5, 0,10%,0.1") == [0.0, 0.1, 0.5]
    for bad in ("", "x", "1", "-0.1"):
        with pytest.raises(ValueError):
            churn.parse_rates(bad)


def test_point_configs_layer_defaults_base_yaml_and_flags(tmp_path):
    base_yaml = tmp_path / "base.yaml"
    base_yaml.write_text(yaml.safe_dump({"scenario": {"num_clients": 40}, "training": {"lr": 0.02},
                                         "rounds": {"deadline_s": 30}, "run_dir": "somewhere"}))
    base = churn.base_config(base_yaml, clients_per_round=8, data_root=[tmp_path])
    assert base["scenario"]["num_clients"] == 40 and base["scenario"]["dataset"] == "mnist"  # yaml over defaults
    assert base["rounds"]["clients_per_round"] == 8 and base["rounds"]["min_participants"] == 4  # half of K
    assert base["rounds"]["deadline_s"] == 30 and base["training"]["lr"] == 0.02
    assert base["data_root"] == [str(tmp_path.resolve())] and "run_dir" not in base
    config = RunConfig.model_validate(churn.point_config(base, "fedlwf2t", 0.2, 0.05, seed=4))
    assert config.edge.availability == "bernoulli:0.8" and config.edge.crash_rate == 0.05
    assert config.method == "fedlwf2t" and config.seed == 4 and config.scenario.seed == 4
    assert RunConfig.model_validate(churn.point_config(base, "fedavg", 0.0, 0.0, 0)).edge.availability == "always"
    with pytest.raises(ValueError, match="unknown method"):
        churn.point_config(base, "nope", 0.1, 0.0, 0)
    with pytest.raises(ValueError, match="min_participants"):
        churn.point_config(churn.base_config(None, clients_per_round=2, min_participants=3), "fedavg", 0.1, 0, 0)


def test_rows_csv_plot_and_table_from_fake_summaries(tmp_path):
    rows = []
    for method, acc in (("fedavg", 30.0), ("fedlwf2t", 60.0)):
        for k, rate in enumerate((0.0, 0.25, 0.5)):
            summary = fake_summary(acc - 10 * k, 90.0 - 20 * k, skipped=2 * k, left=40 * k)
            rows.append(churn.row_from_summary(method, rate, 0.0, 0, 12, tmp_path / f"{method}{k}", summary))
    rows.append(churn.row_from_summary("fedlwf2t", 0.75, 0.0, 0, 12, tmp_path / "x", None, "timeout (600 s)"))
    assert rows[2]["rounds_completed"] == 8 and rows[2]["left"] == 80 and rows[2]["status"] == "completed"
    assert rows[-1]["average_accuracy"] is None and rows[-1]["status"] == "timeout (600 s)"

    path = churn.write_csv(rows, tmp_path / "out" / churn.CSV_NAME)
    read = churn.read_csv(path)
    assert list(read[0]) == churn.CSV_COLUMNS
    assert len(read) == 7
    assert read[1]["method"] == "fedavg" and float(read[1]["churn_rate"]) == 0.25
    assert float(read[1]["average_accuracy"]) == 20.0 and int(read[1]["rounds_completed"]) == 10
    assert int(read[1]["bytes_total"]) == 250_000_000 and read[1]["rounds_total"] == "12"
    assert read[-1]["average_accuracy"] == "" and read[-1]["status"] == "timeout (600 s)"

    png = churn.plot_churn(rows, tmp_path / "out" / churn.PNG_NAME)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(churn.format_table(rows))
    text = console.export_text()
    assert "fedlwf2t" in text and "10/12" in text and "timeout" in text


@pytest.mark.slow
def test_tiny_real_sweep(tmp_path, mnist_root):
    """One method at churn 0 and 0.5 on 10 clients (40 samples each), 1 task x 2 rounds: real `up` runs."""
    base = tmp_path / "tiny.yaml"
    base.write_text(yaml.safe_dump({"scenario": {"partition": "task_pool", "task_pool_size": 1,
                                                 "samples_per_client_task": 40},
                                    "rounds": {"eval_every": 100}}))
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "fcl_emu", "bench", "churn", "--config", str(base), "--methods", "fedavg",
         "--rates", "0,0.5", "--clients", "10", "--tasks", "1", "--rounds-per-task", "2",
         "--clients-per-round", "4", "--data-root", str(mnist_root), "--out", str(out)],
        env=node_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = churn.read_csv(out / churn.CSV_NAME)
    assert [(r["method"], float(r["churn_rate"]), r["status"]) for r in rows] == [
        ("fedavg", 0.0, "completed"), ("fedavg", 0.5, "completed")]
    calm, churned = rows
    assert int(calm["rounds_total"]) == 2 and int(calm["rounds_completed"]) == 2
    assert int(calm["left"]) == 0 and int(calm["rejoined"]) == 0
    assert int(churned["left"]) > 0  # clients went away and came back
    assert int(churned["rounds_completed"]) <= 2
    for row in rows:
        run_dir = out / "runs" / churn.point_name("fedavg", float(row["churn_rate"]), 0.0, 0)
        assert row["run_dir"] == str(run_dir.resolve())
        assert (run_dir / "summary.json").exists() and (run_dir / churn.CONFIG_NAME).exists()
    config = yaml.safe_load((out / "runs" / churn.point_name("fedavg", 0.5, 0.0, 0) / "config.yaml").read_text())
    assert config["edge"]["availability"] == "bernoulli:0.5"
    assert (out / churn.PNG_NAME).stat().st_size > 10_000


def test_straggler_points_compare_round_policies_at_equal_updates_per_round(tmp_path):
    from fcl_emu.bench import stragglers

    assert stragglers.parse_shares("0,20,50") == [0.0, 0.2, 0.5] == stragglers.parse_shares("0.5,0,0.2")
    for bad in ("x", "100", "-5"):
        with pytest.raises(ValueError, match="--stragglers"):
            stragglers.parse_shares(bad)
    assert stragglers.parse_aggregations("sync, fedbuff") == ["sync", "fedbuff"]
    with pytest.raises(ValueError, match="--aggregations"):
        stragglers.parse_aggregations("sync,bulk")
    base = churn.base_config(None, clients=20, clients_per_round=5, data_root=[tmp_path])
    points = stragglers.points(base, ["fedavg"], [0.0, 0.5], ["sync", "fedbuff"], 3, tmp_path)
    assert [name for name, _, _ in points] == [
        "fedavg-stragglers0.00-sync-s3", "fedavg-stragglers0.00-fedbuff-s3",
        "fedavg-stragglers0.50-sync-s3", "fedavg-stragglers0.50-fedbuff-s3"]
    config = RunConfig.model_validate(points[3][1])
    policy = config.aggregation.policy
    assert policy.name == "fedbuff" and policy.buffer == policy.concurrency == 5
    assert config.rounds.eval_every == 1 and config.emulated_clock and config.edge.availability == "always"
    profiles = yaml.safe_load(open(config.edge.device_profiles))["profiles"]
    assert [(p["name"], p["share"], p["ms_per_sample"]) for p in profiles] == [
        ("phone", 0.5, 3.0), ("straggler", 0.5, 30.0)]
    assert points[3][2] == {"sweep": "stragglers", "aggregation": "fedbuff", "stragglers": 0.5}
    assert RunConfig.model_validate(points[0][1]).aggregation.policy.name == "sync"


def test_time_to_accuracy_reads_the_first_tasks_evaluations_in_emulated_time(tmp_path):
    lines = [{"event": "round", "task": 0, "emulated_clock_s": 1.5, "accuracy_seen": 40.0},
             {"event": "round", "task": 0, "emulated_clock_s": 3.0, "accuracy_seen": None},
             {"event": "round", "task": 0, "emulated_clock_s": 4.5, "accuracy_seen": None},
             {"event": "task_end", "task": 0, "accuracy_seen": 85.0},
             {"event": "round", "task": 1, "emulated_clock_s": 6.0, "accuracy_seen": 90.0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert churn.time_to_accuracy(tmp_path, 80.0) == 4.5  # reached at the task's end, after its last round
    assert churn.time_to_accuracy(tmp_path, 30.0) == 1.5
    assert churn.time_to_accuracy(tmp_path, 95.0) is None
    assert churn.time_to_accuracy(tmp_path / "nothing", 80.0) is None


def test_straggler_rows_get_their_own_panel(tmp_path):
    rows = []
    for aggregation, seconds in (("sync", (6.5, 20.0, 30.0)), ("fedbuff", (6.5, 10.4, 12.0))):
        for share, t in zip((0.0, 0.2, 0.5), seconds):
            row = churn.row_from_summary("fedavg", 0.0, 0.0, 0, 12, tmp_path / "x", fake_summary(40.0, 20.0))
            row.update(sweep="stragglers", aggregation=aggregation, stragglers=share, target_accuracy=80.0,
                       time_to_accuracy_s=t)
            rows.append(row)
    churn_row = churn.row_from_summary("fedavg", 0.0, 0.0, 0, 12, tmp_path / "y", fake_summary(40.0, 20.0))
    for some in (rows, rows + [churn_row]):
        png = churn.plot_churn(some, tmp_path / f"{len(some)}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    read = churn.read_csv(churn.write_csv(rows, tmp_path / churn.CSV_NAME))
    assert (read[4]["aggregation"], read[4]["stragglers"], read[4]["time_to_accuracy_s"]) == ("fedbuff", "0.2", "10.4")
