"""The synthetic population behaviour trace: FedScale's format, reproducible by seed, the documented daily
pattern; `fcl-emu trace behaviour|stats`; the trace reader's per-client resolution at scale."""

import gc
import json
import math
from itertools import islice

import msgspec
import numpy as np
import pytest
from typer.testing import CliRunner

from fcl_emu.cli import app
from fcl_emu.scenario import behaviour_trace as bt
from fcl_emu.scenario.availability import TraceEntry, client_availability, load_trace, parse_availability, transitions

runner = CliRunner()


def test_the_same_seed_writes_the_same_trace_and_another_seed_another():
    assert bt.behaviour_trace(200, seed=3) == bt.behaviour_trace(200, seed=3)
    assert bt.behaviour_trace(200, seed=3) != bt.behaviour_trace(200, seed=4)


@pytest.mark.parametrize("name", ["trace.json", "client_behave_trace"])
def test_entries_are_in_fedscale_format_and_read_back_unchanged(tmp_path, name):
    trace = bt.behaviour_trace(500, seed=1)
    assert sorted(trace) == list(range(500))
    for entry in trace.values():
        active, inactive, period = entry["active"], entry["inactive"], entry["finish_time"]
        assert period == 6 * 86_400 and len(active) == len(inactive)
        times = [t for pair in zip(active, inactive) for t in pair]
        assert all(isinstance(t, int) for t in times) and times == sorted(times)
        assert all(a < b for a, b in zip(active, inactive)) and all(0 <= t <= period for t in times)
        assert all(b < a for b, a in zip(inactive, active[1:]))  # merged: no two sessions touch
        assert entry["duration"] == sum(b - a for a, b in zip(active, inactive))
    path = tmp_path / name
    bt.write_trace(trace, path)
    assert (path.read_bytes()[:1] == b"\x80") == (name != "trace.json")  # a pickle, as FedScale ships it
    entries = load_trace(path)
    assert [list(map(list, e.intervals)) for e in entries] == [list(map(list, zip(v["active"], v["inactive"])))
                                                               for v in trace.values()]


def test_the_statistics_meet_the_documented_targets():
    stats = bt.stats_of(bt.behaviour_trace(3000, seed=11))
    assert np.allclose(stats.online_by_hour, bt.TARGET_ONLINE_BY_HOUR, atol=0.03), stats.online_by_hour
    assert stats.online == pytest.approx(bt.TARGET_ONLINE, abs=0.02)
    assert stats.sessions_per_day == pytest.approx(bt.TARGET_SESSIONS_PER_DAY, abs=0.06)
    assert min(stats.online_by_hour[:4]) > 0.5 and max(stats.online_by_hour[12:19]) < 0.1  # night, afternoon


def test_an_overnight_session_past_the_period_wraps_round_to_its_start():
    trace = bt.behaviour_trace(400, seed=0, days=1)
    wrapped = [e for e in trace.values() if e["active"][:1] == [0] and e["inactive"][-1:] == [86_400]]
    assert len(wrapped) > 100
    assert all(e["finish_time"] == 86_400 for e in trace.values())


def test_merging_joins_each_clients_overlapping_and_touching_sessions_only():
    owner, start, end = bt._merge(np.array([0, 0, 1, 0, 0]), np.array([0, 5, 2, 20, 30]),
                                  np.array([10, 12, 40, 30, 31]), period=100)
    assert owner.tolist() == [0, 0, 1] and start.tolist() == [0, 20, 2] and end.tolist() == [12, 31, 40]


def test_statistics_of_a_known_trace():
    entries = [TraceEntry(((0.0, 3_600.0),), 86_400.0), TraceEntry(((1_800.0, 5_400.0), (7_200.0, 10_800.0)), 86_400.0)]
    stats = bt.trace_stats(entries)
    assert stats.online_by_hour[:4] == (0.75, 0.25, 0.5, 0.0) and stats.sessions_per_day == 1.5
    assert stats.online == pytest.approx(3 * 3_600 / (2 * 86_400)) and stats.days == 1
    short = bt.trace_stats([TraceEntry(((0.0, 50.0),), 100.0)])  # a period shorter than a day reaches hour 0 only
    assert short.online_by_hour[0] == 0.5 and math.isnan(short.online_by_hour[1])
    with pytest.raises(ValueError, match="no statistics"):
        bt.trace_stats([])


def test_the_command_writes_a_trace_prints_its_statistics_and_measures_any_trace(tmp_path):
    out = tmp_path / "trace.json"
    result = runner.invoke(app, ["trace", "behaviour", "--clients", "300", "--seed", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "300 clients over 6 days: online" in result.output
    assert f"--availability trace:{out}" in result.output
    assert len(load_trace(out)) == 300 and json.loads(out.read_text()) == json.loads(json.dumps(
        bt.behaviour_trace(300, seed=2)))
    line = bt.stats_of(bt.behaviour_trace(300, seed=2)).line()
    measured = runner.invoke(app, ["trace", "stats", str(out)])
    assert measured.exit_code == 0 and measured.output.strip() == f"{out}: {line}"
    assert runner.invoke(app, ["trace", "behaviour", "--clients", "0", "--out", str(out)]).exit_code == 2
    (tmp_path / "bad.json").write_text("[1, 2]")
    failed = runner.invoke(app, ["trace", "stats", str(tmp_path / "bad.json")])
    assert failed.exit_code == 1 and "error: availability trace" in failed.output


def test_each_client_resolves_to_its_entry_shared_not_copied_and_the_reader_leaves_the_collector_on(tmp_path):
    path = tmp_path / "t.json"
    bt.write_trace(bt.behaviour_trace(50, seed=5), path)
    spec, entries = parse_availability(f"trace:{path}"), load_trace(path)
    models = [client_availability(spec, i, seed=0, slot_s=1, trace_time_scale=0.5) for i in range(60)]
    assert models[7]["intervals"] is entries[7].intervals and models[57]["intervals"] is entries[7].intervals
    (start, end), *_ = entries[7].intervals
    welcome = msgspec.msgpack.decode(msgspec.msgpack.encode(models[7]))  # as its node reads it: lists
    assert welcome["intervals"][0] == [start, end]
    assert (start * 0.5, True) in list(islice(transitions(models[7]), 2))  # on at its start, scaled
    assert list(islice(transitions(models[7]), 40)) == list(islice(transitions(welcome), 40))
    with pytest.raises(ValueError, match="malformed"):
        transitions({**welcome, "intervals": [["a", 1]]})
    bad = tmp_path / "bad.json"
    bad.write_text('{"1": {"active": [5, 1], "inactive": [6, 2], "finish_time": 10}}')
    assert gc.isenabled()
    with pytest.raises(ValueError, match="increasing"):
        load_trace(bad)
    assert gc.isenabled()
