"""`fcl-emu bench scale` and `fcl-emu bench flower` on tiny points: real runs, every column filled, the sweep
stops with a reason at a point that does not fit."""

from __future__ import annotations

import csv

import pytest

from fcl_emu.bench import scale

pytestmark = pytest.mark.slow


def test_a_small_sweep_fills_every_column(tmp_path, mnist_root):
    from rich.console import Console

    result = scale.run([8, 16], cohort=3, largest_cohort=4, rounds=1, share=6, clients_per_node=10, idle_s=1.0,
                       out=tmp_path, json_path=tmp_path / "scale.json", data_root=[mnist_root],
                       console=Console(width=250))
    rows = list(csv.DictReader(open(tmp_path / scale.CSV_NAME)))
    assert [int(r["clients"]) for r in rows] == [8, 16] and all(r["status"] == "completed" for r in rows)
    assert [int(r["cohort"]) for r in rows] == [3, 4]  # the largest population with its own cohort
    assert int(rows[1]["nodes"]) == 3  # the reference node and two for the other 15 (10 per node)
    for row in rows:
        assert float(row["join_s"]) > 0 and float(row["round_s"]) > float(row["overhead_per_round_s"]) > 0
        assert float(row["work_cpu_per_round_s"]) > 0
        assert float(row["bytes_per_round"]) > 0 and float(row["coordinator_peak_rss_mb"]) > 0
    assert (tmp_path / scale.PNG_NAME).stat().st_size > 0 and result["stopped"] is None


def test_the_sweep_stops_where_memory_would_not_fit():
    previous = {"clients": 100, "coordinator_peak_rss_mb": 600.0, "nodes_peak_rss_mb": 900.0,
                "mb_per_idle_client": 1.0}
    assert scale.fits(1000, previous) is None
    reason = scale.fits(10**8, previous)
    assert reason is not None and "1.00 MB per client measured at 100" in reason


def test_flower_side_by_side_on_one_small_point(tmp_path, mnist_root, flower_python):
    from fcl_emu.bench.flower import point

    row = point(10, 3, 1, 1, [mnist_root], tmp_path, flower_python)
    assert row["fcl_emu_status"] == "completed"
    assert row["fcl_emu_s"] > 0 and row["flower_s"] > 0 and row["memory_ratio"] > 0
    assert 0 <= row["fcl_emu_accuracy"] <= 100 and 0 <= row["flower_accuracy"] <= 100
