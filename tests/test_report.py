"""Run reports and run comparisons, on small run directories written by hand with known numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from fcl_emu.monitoring.compare import NothingToCompare, compare_runs, format_table
from fcl_emu.monitoring.plots import round_phase_parts
from fcl_emu.monitoring.report import PLOTS, REPORT, write_report
from fcl_emu.monitoring.run_dir import PARTIAL, RunDirError, load_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# After task 1: 90 on task 1. After task 2: 60, 80. After task 3: 30, 50, 70.
MATRIX = [[90.0, None, None], [60.0, 80.0, None], [30.0, 50.0, 70.0]]
AVG_ACC = (30 + 50 + 70) / 3  # 50.0
AVG_INC = (90 + (60 + 80) / 2 + 50) / 3  # 70.0
FORGETTING = ((90 - 30) + (80 - 50)) / 2  # 45.0


def summary(matrix=MATRIX, status="completed", rounds=6, bytes_total=12_345_678, wall=42.5, seed=0,
            method="fedavg", **averages) -> dict:
    """A summary.json of the shape coordinator/summary.py writes."""
    averages = {"average_accuracy": AVG_ACC, "average_incremental_accuracy": AVG_INC,
                "average_forgetting": FORGETTING, **averages}
    return {
        "status": status, "run_id": "abc", "run_dir": "x", "method": method, "method_options": {},
        "dataset": "mnist", "model": "auto",
        "scenario": {"dataset": "mnist", "num_tasks": 3, "num_clients": 20, "partition": "dirichlet",
                     "dirichlet_beta": 0.5},
        "seed": seed, "accuracy_matrix": matrix,
        "accuracy_seen": [sum(r[: t + 1]) / (t + 1) for t, r in enumerate(matrix)],
        **averages,
        "bytes": {"train_request": {"sent": 6_000_000}, "update": {"received": 6_000_000},
                  "heartbeat": {"received": 345_678}},
        "messages": {"train_request/sent": 12, "update/received": 12},
        "bytes_total": bytes_total, "rounds": rounds, "rounds_skipped": 1 if rounds > 1 else 0,
        "wall_clock_s": wall,
        "phase_s": {"dispatch": 0.1, "collect": 10.0, "receive_updates": 0.5, "aggregate": 0.2, "evaluate": 0.3},
        "handling_s": {"update": 0.5},
        "clients": {"configured": 20, "joined": 20, "rejoined": 1, "left": 2, "dropped": 3, "online_at_end": 15},
        "missed_deadline": 1, "late_updates": 0, "rejected_messages": {"too_large": 2, "bad_header": 1},
    }


def round_event(task: int, rnd: int, task_round: int, time: float, accuracy_seen=None, skipped=False) -> dict:
    """An events.jsonl `round` record of the RoundRecord shape."""
    return {
        "event": "round", "time": time, "task": task, "round": rnd, "task_round": task_round,
        "selected": 4, "participants": 1 if skipped else 4, "late": 1 if skipped else 0, "failed": 0,
        "skipped": skipped, "samples": 400, "mean_loss": 0.5, "accuracy_seen": accuracy_seen,
        "duration_s": 2.0, "coordinator_cpu_s": 0.1,
        "phases_s": {"dispatch": 0.1, "collect": 1.5, "receive_updates": 0.2, "aggregate": 0.1, "evaluate": 0.05},
        "bytes_sent": 1_000_100, "bytes_received": 1_003_000,
        "bytes_by_type": {"task_start": {"sent": 100}, "train_request": {"sent": 1_000_000},
                          "update": {"received": 1_000_000}, "heartbeat": {"received": 3000}},
        "online": 20 - rnd,
    }


def events(num_tasks=3, rounds_per_task=2) -> list[dict]:
    out = [{"event": "start", "time": 1.0, "run_id": "abc", "address": "tcp://127.0.0.1:1", "online": 20}]
    t, rnd = 1.0, 0
    for task in range(num_tasks):
        for task_round in range(rounds_per_task):
            rnd += 1
            t += 2.0
            out.append(round_event(task, rnd, task_round, t, accuracy_seen=75.0 if task_round == 0 else None,
                                   skipped=rnd == 2))
        t += 0.5
        row = MATRIX[task][: task + 1]
        out.append({"event": "task_end", "time": t, "task": task, "accuracy": row,
                    "accuracy_seen": sum(row) / len(row)})
    out.append({"event": "end", "time": t + 0.1, "status": "completed"})
    return out


def make_run(path: Path, summary_data: dict | None = None, event_list: list[dict] | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps(summary_data if summary_data is not None else summary(),
                                                  indent=2))
    lines = [json.dumps(e) for e in (event_list if event_list is not None else events())]
    (path / "events.jsonl").write_text("\n".join(lines) + "\n")
    (path / "config.yaml").write_text("rounds:\n  clients_per_round: 4\n  rounds_per_task: 2\n")
    return path


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, f"{path} is only {len(data)} bytes"


def test_report_writes_every_plot_and_a_markdown_summary(tmp_path):
    run_dir = make_run(tmp_path / "run")
    report = write_report(run_dir)
    assert report == run_dir / "report" / REPORT
    for name in PLOTS.values():
        assert_png(run_dir / "report" / name)
    text = report.read_text()
    for name in PLOTS.values():
        assert f"]({name})" in text
    assert "| average accuracy (%) | 50.00 |" in text
    assert "| average forgetting (%) | 45.00 |" in text
    assert "| average incremental accuracy (%) | 70.00 |" in text
    assert "| bytes on the wire | 12.3 MB (6.0 down, 6.3 up) |" in text
    assert "| rounds (skipped) | 6 (1) |" in text
    assert "| clients joined / left / dropped | 20 / 2 / 3 |" in text
    assert "| rejected messages | 3 |" in text
    assert "dirichlet partition (β=0.5), 4 per round, 2 rounds per task" in text
    assert "not completed" not in text


def test_interrupted_run_still_reports(tmp_path):
    # One task of three finished after a single round, then interrupted.
    matrix = [[88.0, None, None]]
    data = summary(matrix=matrix, status="interrupted", rounds=1, average_accuracy=88.0,
                   average_incremental_accuracy=88.0, average_forgetting=0.0)
    evs = [e for e in events(num_tasks=1, rounds_per_task=1) if e["event"] != "end"]
    evs[-1].update(accuracy=[88.0], accuracy_seen=88.0)
    run_dir = make_run(tmp_path / "run", data, evs + [{"event": "end", "time": 9.0, "status": "interrupted"}])
    run = load_run(run_dir)
    assert (len(run.rounds), len(run.task_ends), run.num_tasks, run.completed) == (1, 1, 3, False)
    report = write_report(run_dir, tmp_path / "elsewhere")  # and to the directory given
    assert report == tmp_path / "elsewhere" / REPORT
    assert not (run_dir / "report").exists()
    for name in PLOTS.values():
        assert_png(tmp_path / "elsewhere" / name)
    text = report.read_text()
    assert "Run not completed** (status: interrupted): 1 of 3 tasks finished, 1 rounds" in text
    assert "| average accuracy (%) | 88.00 |" in text


def test_run_stopped_before_any_round_still_reports(tmp_path):
    data = summary(matrix=[], status="aborted: no clients joined", rounds=0, average_accuracy=None,
                   average_incremental_accuracy=None, average_forgetting=None, bytes_total=0, wall=120.0)
    run_dir = make_run(tmp_path / "run", data, [{"event": "end", "time": 120.0, "status": "aborted"}])
    text = write_report(run_dir).read_text()
    for name in PLOTS.values():
        assert_png(run_dir / "report" / name)
    assert "| average accuracy (%) | – |" in text
    assert "0 of 3 tasks finished, 0 rounds" in text


def test_phases_split_collect_without_double_counting():
    parts = round_phase_parts(round_event(0, 1, 0, 3.0))
    assert parts["waiting (collect - receive_updates)"] == pytest.approx(1.3)
    assert parts["receive_updates"] == pytest.approx(0.2)
    assert sum(parts.values()) == pytest.approx(2.0)  # the round's duration


def test_not_a_run_directory(tmp_path):
    with pytest.raises(RunDirError, match="not a run directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="neither summary.json nor events.jsonl"):
        write_report(tmp_path / "empty")


def test_run_without_summary_reads_as_partial(tmp_path):
    """No summary.json (still running, or killed): the run so far, from its events and config, status partial."""
    run_dir = make_run(tmp_path / "run", event_list=events()[:-3])  # task 3's second round, end and summary to come
    (run_dir / "summary.json").unlink()
    (run_dir / "config.yaml").write_text("method: fedavg\nseed: 3\nscenario:\n  dataset: mnist\n  num_tasks: 3\n")
    run = load_run(run_dir)
    assert (run.partial, run.completed, run.status) == (True, False, PARTIAL)
    s = run.summary
    assert (s.method, s.dataset, s.seed, s.run_id, s.rounds, s.rounds_skipped) == ("fedavg", "mnist", 3, "abc", 5, 1)
    assert s.accuracy_matrix == [[90.0, None, None], [60.0, 80.0, None]]
    assert (s.average_accuracy, s.average_forgetting) == (70.0, 30.0)
    assert s.bytes_total == 5 * 2_003_100 and s.wall_clock_s == 12.0
    text = write_report(run_dir).read_text()
    assert f"**Run not completed** (status: {PARTIAL}): 2 of 3 tasks finished, 5 rounds" in text


@pytest.mark.parametrize("content, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({k: v for k, v in summary().items() if k != "accuracy_matrix"}),
     "missing required field `accuracy_matrix`"),
    (json.dumps({**summary(), "clients": {"joined": "many"}}), "Expected `int`, got `str` - at `\\$.clients.joined`"),
])
def test_malformed_summary_is_named(tmp_path, content, why):
    run_dir = make_run(tmp_path / "run")
    (run_dir / "summary.json").write_text(content)
    with pytest.raises(RunDirError, match=f"summary.json in run directory {run_dir}.*{why}"):
        load_run(run_dir)


def test_bad_events_line_is_reported_with_its_number(tmp_path):
    run_dir = make_run(tmp_path / "run")
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    lines[3] = lines[3][:40]  # a truncated record on line 4
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RunDirError, match=r"events.jsonl line 4 in run directory .*not valid JSON") as err:
        write_report(run_dir)
    assert err.value.line == 4


def test_round_event_missing_a_field_is_reported_with_its_number(tmp_path):
    evs = events()
    del evs[2]["phases_s"]  # line 3: the second round
    run_dir = make_run(tmp_path / "run", event_list=evs)
    with pytest.raises(RunDirError, match=r"events.jsonl line 3 .*'round' event: phases_s: Field required"):
        load_run(run_dir)
    (run_dir / "events.jsonl").write_text('{"event": "start", "time": 0}\n"just a string"\n')
    with pytest.raises(RunDirError, match="line 2 .*not an event record"):
        load_run(run_dir)


def test_compare_two_runs(tmp_path):
    a = make_run(tmp_path / "a" / "run")
    b = make_run(tmp_path / "b" / "run",  # same dir name, second run interrupted after task 1
                 summary(matrix=[[80.0, None, None]], status="interrupted", rounds=2, bytes_total=2_000_000,
                         wall=10.0, seed=1, method="fedlwf2t", average_accuracy=80.0, average_forgetting=0.0))
    found = compare_runs([a, b], tmp_path / "cmp", include_incomplete=True)
    rows, png = found.rows, found.png
    assert found.notes == ["seeds: 0, 1"] and found.warnings == []
    assert png == tmp_path / "cmp" / "compare.png"
    assert_png(png)
    assert [(r.method, r.seed, r.status, r.tasks_finished) for r in rows] == [
        ("fedavg", 0, "completed", 3), ("fedlwf2t", 1, "interrupted", 1)]
    assert rows[0].average_accuracy == pytest.approx(AVG_ACC)
    assert rows[0].average_forgetting == pytest.approx(FORGETTING)
    assert (rows[0].bytes_total, rows[0].wall_clock_s) == (12_345_678, 42.5)
    assert (rows[1].average_accuracy, rows[1].average_forgetting) == (80.0, 0.0)
    assert (rows[1].bytes_total, rows[1].wall_clock_s) == (2_000_000, 10.0)
    assert rows[0].label.startswith("fedavg/mnist/s0 (") and rows[1].label.startswith("fedlwf2t/mnist/s1 (")

    # the same run twice: labels stay distinguishable
    rows = compare_runs([a, a], tmp_path / "cmp").rows
    assert rows[0].label != rows[1].label

    console = Console(record=True, width=200)
    console.print(format_table(rows))
    out = console.export_text()
    assert "50.00" in out and "45.00" in out and "12.3" in out and "42.5" in out


# two edge aggregators: the coordinator's socket counted each client's model whole, its links carried it once per
# aggregator; the clients' links, as the aggregators reported them
TIER_BYTES = {"edge_cloud": {"sent": 2_400_000, "received": 1_200_000},
              "client_edge": {"sent": 6_000_000, "received": 6_000_000}}


def test_report_gives_the_bytes_of_each_tier_under_edge_aggregators(tmp_path):
    star = write_report(make_run(tmp_path / "star"), tmp_path / "star-report").read_text()
    assert "| bytes on the wire | 12.3 MB (6.0 down, 6.3 up) |" in star and "bytes at the coordinator" not in star
    tiered = write_report(make_run(tmp_path / "tiered", {**summary(), "tier_bytes": TIER_BYTES}),
                          tmp_path / "tiered-report").read_text()
    assert "| bytes at the coordinator | 3.6 MB (2.4 down, 1.2 up) |" in tiered
    assert "| bytes on clients' links | 12.0 MB (6.0 down, 6.0 up) |" in tiered
    assert "bytes on the wire |" not in tiered and "which no link carried" in tiered


def test_compare_at_80_columns_says_what_the_runs_share_once(tmp_path):
    from fcl_emu.runconfig.defaults import defaults_for
    from tests.test_settings_diff import with_config

    shared = {"scenario": {"num_tasks": 2, "num_clients": 20}, "training": {"local_epochs": 1}}
    star = with_config(make_run(tmp_path / "20261202-101010-fedavg-mnist-s0"), **shared)
    tiered = with_config(make_run(tmp_path / "20261202-102020-fedavg-mnist-s0",
                                  {**summary(), "tier_bytes": TIER_BYTES}), **shared,
                         topology={"edge_aggregators": 2})
    found = compare_runs([star, tiered], tmp_path / "cmp", defaults=defaults_for)
    assert found.shared_settings == ("scenario: scenario.num_tasks=2, scenario.num_clients=20; "
                                     "method: training.local_epochs=1")
    assert [r.settings for r in found.rows] == ["none", "deployment: topology.edge_aggregators=2"]
    console = Console(record=True, width=80)
    console.print(format_table(found.rows, found.shared_settings))
    out = console.export_text()
    assert max(map(len, out.splitlines())) <= 80
    assert out.count("scenario.num_clients=20") == 1 and out.count("completed") == 1  # said once
    assert "MB coord" in out and "MB clients" in out
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    # run, tasks, accuracy, forgetting, the coordinator's links, the clients' (in a star the same), wall clock
    assert cells == [["1", "3/3", "50.00", "45.00", "12.3", "12.3", "42.5"],
                     ["2", "3/3", "50.00", "45.00", "3.6", "12.0", "42.5"]]
    assert "2  fedavg/mnist/s0 (20261202-102020-fedavg-mnist-s0); other settings:" in out
    assert "deployment: topology.edge_aggregators=2" in out


def test_compare_fails_clearly_on_a_missing_or_malformed_run(tmp_path):
    a = make_run(tmp_path / "a")
    with pytest.raises(RunDirError, match="not a run directory"):
        compare_runs([a, tmp_path / "missing"], tmp_path / "cmp")
    b = make_run(tmp_path / "b")
    (b / "summary.json").write_text("{not json")
    with pytest.raises(RunDirError, match="not valid JSON"):
        compare_runs([a, b], tmp_path / "cmp")


def test_compare_skips_folders_without_a_run_and_leaves_out_incomplete_runs(tmp_path):
    """runs/*: a folder a start that did not finish left (keys only) is skipped, runs not completed are left out,
    each with one line; with include_incomplete they are compared, marked."""
    done = make_run(tmp_path / "runs" / "done")
    keys_only = tmp_path / "runs" / "keys-only"
    (keys_only / "keys").mkdir(parents=True)
    failed = make_run(tmp_path / "runs" / "failed", summary(matrix=[[80.0, None, None]], status="failed: boom"))
    running = make_run(tmp_path / "runs" / "running", event_list=events()[:4])
    (running / "summary.json").unlink()
    notes = tmp_path / "runs" / "notes.txt"
    notes.write_text("a file beside the runs")
    dirs = [done, keys_only, failed, running, notes]
    found = compare_runs(dirs, tmp_path / "cmp")
    assert [r.run_dir for r in found.rows] == [done]
    assert len(found.notes) == 4
    assert found.notes[3] == f"skipped {notes}: not a run directory: {notes} is not a directory"
    assert found.notes[0] == (f"skipped {keys_only}: not a run directory: {keys_only} has neither summary.json nor "
                              f"events.jsonl (it holds keys)")
    assert found.notes[1] == (f"left out {failed}: run not completed (status: failed: boom); --include-incomplete "
                              f"shows it, marked")
    assert f"left out {running}: run not completed (status: partial: no summary.json" in found.notes[2]

    found = compare_runs(dirs, tmp_path / "cmp", include_incomplete=True)
    assert [(r.run_dir, r.status, r.tasks_finished) for r in found.rows] == [
        (done, "completed", 3), (failed, "failed: boom", 1), (running, PARTIAL, 1)]
    console = Console(record=True, width=300)
    console.print(format_table(found.rows))
    out = console.export_text()
    assert "(failed) *" in out and "* run not completed" in out

    with pytest.raises(NothingToCompare, match="left out without --include-incomplete") as err:
        compare_runs([keys_only, failed], tmp_path / "cmp")
    assert len(err.value.notes) == 2


def test_compare_warns_when_scenarios_differ(tmp_path):
    def scenario(**changes) -> dict:
        return summary(scenario={"dataset": "mnist", "num_tasks": 3, "num_clients": 20, "partition": "iid",
                                 "classes_per_task": None, "seed": 0, **changes})

    a = make_run(tmp_path / "a", scenario())
    b = make_run(tmp_path / "b", scenario(seed=1, num_clients=50))
    c = make_run(tmp_path / "c", scenario(partition="dirichlet", classes_per_task=2))
    assert compare_runs([a, make_run(tmp_path / "a2", scenario(seed=5))], tmp_path / "cmp").warnings == []
    assert compare_runs([a, b, c], tmp_path / "cmp").warnings == [
        "the runs differ in scenario: clients: 20 (a, c); 50 (b)",
        "the runs differ in scenario: partition: 'iid' (a, b); 'dirichlet' (c)",
        "the runs differ in scenario: classes per task: None (a, b); 2 (c)",
    ]


@pytest.mark.slow  # two reports and three comparisons, each drawing its plots
def test_report_and_compare_commands(tmp_path):
    from typer.testing import CliRunner

    from fcl_emu.cli import app

    runner = CliRunner()
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", summary(seed=1, wall=50.0))
    result = runner.invoke(app, ["report", str(a)])
    assert result.exit_code == 0, result.output
    assert (a / "report" / REPORT).is_file() and "run status: completed" in result.output
    result = runner.invoke(app, ["compare", str(a), str(b), "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    assert "runs compared" in result.output and (tmp_path / "cmp" / "compare.png").is_file()
    for args in (["report", str(tmp_path / "nothing")], ["compare", str(a), str(tmp_path / "nothing")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and "error:" in result.output, result.output

    c = make_run(tmp_path / "c", summary(status="interrupted: SIGTERM", scenario={"dataset": "mnist", "num_tasks": 5}))
    (tmp_path / "d").mkdir()
    result = runner.invoke(app, ["report", str(c)])
    assert result.exit_code == 0 and "run status: interrupted: SIGTERM" in result.output, result.output
    result = runner.invoke(app, ["compare", str(a), str(c), str(tmp_path / "d"), "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    assert f"left out {c}: run not completed" in result.output and f"skipped {tmp_path / 'd'}" in result.output
    result = runner.invoke(app, ["compare", str(a), str(c), "--include-incomplete", "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    assert "warning: the runs differ in scenario: tasks: 3 (a); 5 (c)" in result.output
    result = runner.invoke(app, ["compare", str(c), str(tmp_path / "d"), "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 1 and "error: no run to compare" in result.output, result.output


@pytest.mark.slow  # `fcl-emu up` as a process
def test_a_start_that_fails_leaves_no_run_folder(tmp_path, mnist_root):
    """`up` whose edge nodes cannot start (no Docker engine for --backend docker) removes the keys it wrote and the
    folders made for them: nothing is left in runs/ for report or compare to trip on."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    done = subprocess.run([sys.executable, "-m", "fcl_emu", "up", "--run-dir", str(tmp_path / "runs" / "a"),
                           "--backend", "docker", "--clients", "4", "--data-root", str(mnist_root)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "no Docker engine answers" in done.stdout + done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "runs").exists()
