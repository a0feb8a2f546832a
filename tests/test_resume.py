"""Checkpoints and ``--resume``: the format, server-state restore, and a coordinator killed mid-round; one run
per run directory (``--overwrite``)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fcl_emu.coordinator import checkpoint
from fcl_emu.coordinator.contracts import CheckpointError
from fcl_emu.coordinator.resume import CHECKPOINT_DIR
from fcl_emu.coordinator.clients import ClientRegistry, Status
from fcl_emu.cli import app
from fcl_emu.runconfig import RunConfig
from fcl_emu.methods import registry as methods
from fcl_emu.aggregation.update import DELTA, ClientUpdate
from fcl_emu.methods.base import ServerContext
from fcl_emu.methods.models.classifier import build_model
from fcl_emu.monitoring.results import RunRecorder, RunSummary, SummaryNotWritten, failure_status, write_json_atomic
from fcl_emu.run_directory import RunDirInUse, check_new_run_dir, empty_run_dir
from tests.conftest import device_keys, events, fcl_emu, free_port, kill_left, small_config, wait_for

SHAPE = (1, 28, 28)
SCENARIO = SimpleNamespace(task_classes=lambda t: list(range(2 * t, 2 * t + 2)),
                           seen_classes=lambda t: list(range(2 * t + 2)))


# ------------------------------------------------------------------ format
def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"server/conv.weight": rng.normal(size=(4, 3)).astype(np.float32),
            "server/bn.num_batches_tracked": np.asarray(7, dtype=np.int64),
            "rng/torch": rng.integers(0, 256, 50, dtype=np.uint8),
            "odd name|with/slashes": np.zeros((0, 2), np.float32)}


def _same_arrays(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_checkpoint_round_trip_keeps_only_the_latest(tmp_path):
    state = {"next": {"task": 1, "task_round": 2}, "rng": {"numpy": np.random.default_rng(3).bit_generator.state},
             "matrix": [[99.5, None], [float("nan"), 12.25]]}
    checkpoint.save(tmp_path, state, _arrays(0))
    checkpoint.save(tmp_path, {**state, "next": {"task": 2, "task_round": 0}}, _arrays(1))
    loaded = checkpoint.load(tmp_path)
    assert loaded.state["next"] == {"task": 2, "task_round": 0}
    assert loaded.state["rng"] == state["rng"]  # 128-bit integers survive JSON
    assert loaded.state["matrix"][0] == [99.5, None] and np.isnan(loaded.state["matrix"][1][0])
    assert _same_arrays(loaded.arrays, _arrays(1))
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".npz") == [loaded.state["arrays"]["file"]]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("fail_at", ["arrays", "commit"])
def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, fail_at):
    checkpoint.save(tmp_path, {"n": 1}, _arrays(0))
    previous = sorted(tmp_path.iterdir())
    if fail_at == "arrays":  # the disk fills up while the arrays are written: a partial file, no commit
        def savez(f, **arrays):
            f.write(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(checkpoint.np, "savez", savez)
    else:  # fails after writing everything but before the rename
        def replace(src, dst):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(OSError) as failed:
        checkpoint.save(tmp_path, {"n": 2}, _arrays(1))
    monkeypatch.undo()
    assert failure_status(failed.value).startswith(f"failed: disk full ({tmp_path}{os.sep}")
    assert sorted(tmp_path.iterdir()) == previous  # what the failed save wrote is gone, space and all
    loaded = checkpoint.load(tmp_path)
    assert loaded.state["n"] == 1 and _same_arrays(loaded.arrays, _arrays(0))
    checkpoint.save(tmp_path, {"n": 3}, _arrays(2))  # the next save clears the leftovers
    assert len(list(tmp_path.glob("arrays-*.npz"))) == 1
    assert checkpoint.load(tmp_path).state["n"] == 3


def test_a_write_on_a_full_disk_names_its_file_and_a_summary_it_stops_fails_the_run(tmp_path, monkeypatch):
    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(type(tmp_path), "write_text", full)
    with pytest.raises(OSError) as failed:
        write_json_atomic(tmp_path / "summary.json", {})
    assert failure_status(failed.value) == f"failed: disk full ({tmp_path / 'summary.json'})"
    assert failure_status(ValueError("bad")) == "failed: ValueError: bad"
    recorder = RunRecorder(tmp_path, None)
    for status, recorded in [("completed", f"failed: disk full ({tmp_path / 'summary.json'})"),
                             ("failed: disk full (ckpt)", "failed: disk full (ckpt)")]:
        with pytest.raises(SummaryNotWritten) as not_written:
            recorder.summary(SimpleNamespace(status=status, write=lambda path: write_json_atomic(path, {})))
        assert not_written.value.status == recorded
    assert list(tmp_path.iterdir()) == [tmp_path / "events.jsonl"]


def test_a_run_whose_summary_cannot_be_written_prints_its_status(tmp_path):
    import io

    from rich.console import Console

    from fcl_emu import run as run_module

    (tmp_path / "summary.json").write_text("{}")  # an earlier session's: not this run's record
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "summary.json"))
    out = io.StringIO()
    assert run_module._failed(SummaryNotWritten("failed: disk full (ckpt)", error), tmp_path,
                              Console(file=out, width=300)) is None
    assert out.getvalue().startswith("run failed: disk full (ckpt) (traceback: ")


def test_missing_and_corrupt_checkpoints_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint.load(tmp_path)
    checkpoint.save(tmp_path, {"n": 1}, _arrays(0))
    npz = tmp_path / checkpoint.load(tmp_path).state["arrays"]["file"]
    data = npz.read_bytes()
    npz.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        checkpoint.load(tmp_path)
    npz.unlink()
    with pytest.raises(CheckpointError, match="corrupt"):
        checkpoint.load(tmp_path)
    (tmp_path / checkpoint.STATE).write_text('{"format": 1, "arr')
    with pytest.raises(CheckpointError, match="corrupt"):
        checkpoint.load(tmp_path)


# ------------------------------------------------------------- server state
def _update(server, seed: int) -> ClientUpdate:
    rng = np.random.default_rng(seed)
    tensors = {DELTA + k: (rng.normal(scale=0.01, size=v.shape).astype(np.float32) if v.dtype.kind == "f"
                           else np.asarray(v) + 1)
               for k, v in server.global_state.items()}
    return ClientUpdate(f"client-{seed:04d}", 10 + seed, tensors, 0.5)


def _assert_same_server(a, b, task: int) -> None:
    assert _same_arrays(dict(a.global_state), dict(b.global_state))
    assert _same_arrays(dict(a.round_tensors(task, 0)), dict(b.round_tensors(task, 0)))
    assert a.task_assets(task).keys() == b.task_assets(task).keys()
    for kind, arrays in a.task_assets(task).items():
        assert _same_arrays(dict(arrays), dict(b.task_assets(task)[kind]))
    x = torch.randn(3, *SHAPE)
    with torch.no_grad():
        assert torch.equal(a.eval_model().eval()(x), b.eval_model().eval()(x))


@pytest.mark.parametrize("method,options", [("fedavg", {}), ("fedprox", {"mu": 0.1}), ("fedewc", {}),
                                            ("fedlwf2t", {}), ("fedlwf2t", {"old_teacher": "global"})])
def test_restored_server_parts_behave_like_the_original(method, options):
    spec = methods.get(method)

    def make(seed: int):
        torch.manual_seed(seed)
        ctx = ServerContext(spec.options(**options), SCENARIO, lambda n: build_model("cnn", SHAPE, n), seed=0)
        return spec.server(ctx)

    original = make(0)
    original.start_task(0)
    original.aggregate(0, 1, [_update(original, 1), _update(original, 2)])
    original.end_task(0)
    original.start_task(1)  # the head grows to 4 classes
    original.aggregate(1, 2, [_update(original, 3)])
    arrays = {k: np.array(v) for k, v in original.state_arrays().items()}
    meta = json.loads(json.dumps(original.state_meta()))
    restored = make(1)  # other initial weights and a 2-class head: everything must come from the state
    restored.load_state_arrays(arrays)
    restored.load_state_meta(meta)
    _assert_same_server(original, restored, 1)
    if options.get("old_teacher") == "global":
        assert restored.task_assets(1)  # the previous task's model is sent again after a restore
    for server in (original, restored):  # the same future gives the same result
        server.aggregate(1, 3, [_update(server, 4)])
        server.end_task(1)
        torch.manual_seed(5)
        server.start_task(2)
    _assert_same_server(original, restored, 2)
    assert original.global_state["head.weight"].shape[0] == 6


def test_cancelling_late_trainings_is_not_part_of_what_a_checkpoint_must_match():
    """``rounds.skip_late`` changes the host's work, not the results: a run resumes with either setting, and the
    checkpoints of runs from before the setting existed still match."""
    from fcl_emu.coordinator.resume import run_fingerprint

    assert run_fingerprint(RunConfig()) == run_fingerprint(RunConfig(rounds={"skip_late": False}))
    assert run_fingerprint(RunConfig()) != run_fingerprint(RunConfig(rounds={"overcommit": 1.5}))


def test_registry_snapshot_and_restore():
    reg = ClientRegistry(10.0)
    for i in range(3):
        reg.join(f"client-{i:04d}", i, "node-a", 0)
    reg.leave("client-0002")
    reg.records["client-0000"].rounds_trained = 4
    again = ClientRegistry(10.0)
    again.restore(json.loads(json.dumps(reg.snapshot())))
    assert again.awaiting_rejoin == 2 and again.online_count == 0 and not again.online()
    assert again.records["client-0002"].status is Status.LEFT
    assert again.records["client-0000"].rounds_trained == 4
    again.join("client-0000", 0, "node-b", 0)  # back after the restart: not a rejoin of its own
    assert again.counts.rejoined == 0 and again.counts.joined == 3 and again.online_count == 1
    assert again.drop_resumed() == ["client-0001"] and again.counts.dropped == 1


def _resumed_registry(clients: int) -> ClientRegistry:
    reg = ClientRegistry(10.0)
    for i in range(clients):
        reg.join(f"client-{i:04d}", i, f"node-{i % 2}", 0)
    again = ClientRegistry(10.0)
    again.restore(json.loads(json.dumps(reg.snapshot())))
    return again


@pytest.mark.parametrize("own_nodes", [False, True])
def test_a_resume_that_started_its_nodes_waits_for_every_client_however_slowly_they_come(own_nodes):
    """Client 0 rejoins at once, the others after three liveness timeouts (containers starting on busy hosts):
    nodes started elsewhere count them as away for now; nodes the resumed `up` started itself are waited for."""
    from fcl_emu.coordinator.resume import Checkpointer

    registry = _resumed_registry(4)
    config = RunConfig(network={"liveness_timeout_s": 0.05, "heartbeat_interval_s": 0.01})
    state = SimpleNamespace(config=config, registry=registry, task=0, progress=lambda *a: None,
                            metrics=SimpleNamespace(client_dropped=lambda reason: None))
    joins = [[0], [], [], [], [1, 2, 3]]  # one batch per 0.05 s

    def serve(condition, deadline):
        for batch in joins:
            for i in batch:
                registry.join(f"client-{i:04d}", i, f"node-{i % 2}", 0)
            if condition():
                return
            time.sleep(0.05)

    missing = Checkpointer(state, clock=None, address="").wait_for_rejoin(serve, own_nodes=own_nodes)
    assert missing == ([] if own_nodes else ["client-0001", "client-0002", "client-0003"])
    assert len(registry.online()) == (4 if own_nodes else 1)


def test_clients_awaited_after_a_resume_whose_node_exited_are_not_waited_for():
    registry = _resumed_registry(4)
    assert registry.drop_awaited("client-0001") and not registry.drop_awaited("client-0001")
    registry.join("client-0000", 0, "node-0", 0)
    assert not registry.drop_awaited("client-0000")  # back: dropping it is the liveness scan's or its node's
    assert registry.awaiting_rejoin == 2 and registry.counts.dropped == 1
    assert registry.records["client-0001"].status is Status.DEAD
    assert registry.drop_resumed() == ["client-0002", "client-0003"] and registry.awaiting_rejoin == 0


# ---------------------------------------------------------------- bad input
runner = CliRunner()


def _invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.replace("│", " ").split())


def test_bad_resume_inputs_give_one_line_errors(tmp_path):
    code, out = _invoke("coordinator", "--resume", str(tmp_path / "nope"))
    assert code == 1 and "no such directory" in out and "Traceback" not in out
    assert _invoke("coordinator", "--resume", str(tmp_path))[1].count("not a run directory") == 1
    config = RunConfig(data_root=[tmp_path])
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    code, out = _invoke("up", "--resume", str(tmp_path))
    assert code == 1 and "no checkpoint" in out
    checkpoint.save(tmp_path / "checkpoint", {"fingerprint": "another"}, {})
    code, out = _invoke("coordinator", "--resume", str(tmp_path), "--verbose")
    assert code == 1 and "another configuration" in out
    (tmp_path / "checkpoint" / checkpoint.STATE).write_text("{not json")
    code, out = _invoke("coordinator", "--resume", str(tmp_path))
    assert code == 1 and "corrupt checkpoint" in out
    code, out = _invoke("up", "--resume", str(tmp_path), "--clients", "5", "--seed", "2")
    assert code == 2 and "--clients, --seed cannot be combined with --resume" in out
    code, out = _invoke("coordinator", "--resume", str(tmp_path), "--bind", "tcp://127.0.0.1:5")
    assert code == 2 and "--bind" in out


# ------------------------------------------------------------ one run, one run directory
def _used_run_dir(run_dir) -> dict[str, bytes]:
    """A run directory as a run leaves it; then :func:`_files` of it."""
    for name, text in {"config.yaml": RunConfig().to_yaml(), "events.jsonl": '{"event": "start", "time": 0}\n',
                       "summary.json": '{"status": "completed"}\n', "checkpoint/state.json": "{}",
                       "logs/coordinator.log": "started\n", "summary.json.tmp": "{"}.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    return _files(run_dir)


def _files(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command", [["up", "--nodes", "1"], ["coordinator", "--insecure"]])
def test_a_run_directory_that_holds_a_run_is_refused_in_one_line_and_left_as_it_was(tmp_path, command):
    run_dir = tmp_path / "run"
    before = _used_run_dir(run_dir)
    result = runner.invoke(app, [*command, "--clients", "4", "--run-dir", str(run_dir),
                                 "--data-root", str(tmp_path / "no-data")])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"error: {run_dir} holds a run already (config.yaml, events.jsonl, summary.json, checkpoint): give another "
        f"--run-dir, replace that run with --overwrite, or continue it with --resume {run_dir} if it did not end"]
    assert _files(run_dir) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    code, out = _invoke(command[0], "--resume", str(run_dir), "--overwrite")
    assert code == 2 and "--resume continues the run in RUN_DIR, --overwrite would delete it" in out
    assert _files(run_dir) == before


def test_an_empty_folder_or_one_without_a_runs_record_takes_a_new_run(tmp_path):
    check_new_run_dir(tmp_path / "new", overwrite=False)
    check_new_run_dir(tmp_path, overwrite=False)
    (tmp_path / "logs").mkdir()  # a start that ended before the run wrote anything of its record
    check_new_run_dir(tmp_path, overwrite=False)


def test_overwrite_empties_the_run_directory_of_its_run_once_the_checks_pass_and_runs(tmp_path, monkeypatch):
    from fcl_emu import run as run_module

    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    _used_run_dir(run_dir)
    elsewhere.mkdir()
    (elsewhere / "plot.png").write_text("kept")
    (run_dir / "report").symlink_to(elsewhere)  # a link of the run's is removed, not what it points to
    found = []

    def start_and_run(config, run_dir, *args, **kwargs):
        found.append(sorted(p.name for p in run_dir.iterdir()))
        return SimpleNamespace(exit_code=0)

    monkeypatch.setattr(run_module, "_start_and_run", start_and_run)
    code, out = _invoke("coordinator", "--insecure", "--download", "--clients", "4", "--bind", "tcp://127.0.0.1:0",
                        "--run-dir", str(run_dir), "--overwrite")
    assert code == 0, out
    assert found == [[]] and _files(elsewhere) == {"plot.png": b"kept"}


def test_overwrite_never_empties_a_folder_that_holds_more_than_a_run_nor_the_runs_keys(tmp_path):
    before = _used_run_dir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirInUse, match=r"holds more than a run's files \(notes.txt\): remove the run yourself"):
        empty_run_dir(tmp_path)
    assert _files(tmp_path) == {**before, "notes.txt": b"mine"}
    (tmp_path / "notes.txt").unlink()
    with pytest.raises(RunDirInUse, match="would delete the run's keys"):
        empty_run_dir(tmp_path, keys=tmp_path / "keys")
    assert _files(tmp_path) == before
    empty_run_dir(tmp_path, keys=tmp_path.parent / "keys")
    assert list(tmp_path.iterdir()) == []


def test_the_default_run_directory_is_a_new_one_for_each_run(tmp_path, monkeypatch):
    from fcl_emu.run import default_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261201-120000")  # two runs in the same second
    first = default_run_dir(RunConfig())
    first.mkdir(parents=True)
    assert first.parent.name == "runs" and first.name.startswith("20261201-120000-fedavg-")
    assert default_run_dir(RunConfig()) == first.with_name(first.name + "-2")


# ------------------------------------------------------------ real processes
def _final_model(run_dir) -> dict[str, np.ndarray]:
    ckpt = checkpoint.load(run_dir / "checkpoint")
    assert ckpt.state["complete"]
    return {k: v for k, v in ckpt.arrays.items() if k.startswith("server/")}


RESUMED_CLIENTS = 40


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mnist_root):
    """The configuration of the runs that are interrupted and resumed below, and its uninterrupted run, made once
    for the tests that compare a resumed run with it: (the config file, the reference's run directory)."""
    work = tmp_path_factory.mktemp("reference")
    # 200 samples a client and task (of the 750 that 40 clients would share): rounds of about a second, so that
    # an interruption lands mid-run; 3 rounds a task, so that one lands mid-task
    config = small_config(work / "c.yaml", scenario={"num_clients": RESUMED_CLIENTS, "samples_per_client_task": 200},
                          rounds={"clients_per_round": 4, "rounds_per_task": 3, "eval_every": 3},
                          training={"local_epochs": 1}, nodes=1, method="fedavg", seed=5)
    run_dir = work / "run"
    up = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir", str(run_dir))
    assert up.wait(timeout=180) == 0
    return config, run_dir


@pytest.mark.slow
def test_coordinator_killed_mid_round_resumes_to_the_same_model(tmp_path, mnist_root, reference):
    config, reference = reference
    clients = RESUMED_CLIENTS
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    common = ["--data-root", str(mnist_root)]
    keys, node_keys = device_keys(tmp_path / "keys", clients)
    first = fcl_emu("coordinator", "--config", str(config), "--bind", address, "--run-dir", str(run_dir),
                    "--keys", str(keys), *common)
    node = fcl_emu("node", "--connect", address, "--clients", f"0-{clients - 1}", *common, *node_keys)
    resumed = None
    try:
        # kill during the 5th round (task 1): its clients are training, the 4th round is checkpointed
        wait_for(lambda: sum(e["event"] == "round" for e in events(run_dir)) >= 4, 120, "four rounds")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        assert not (run_dir / "summary.json").exists()
        resumed = fcl_emu("coordinator", "--resume", str(run_dir), *common)  # the node reconnects on its own
        assert resumed.wait(timeout=120) == 0
        assert node.wait(timeout=30) == 0  # shut down by the resumed coordinator
    finally:
        for p in (first, node, resumed):
            if p is not None and p.poll() is None:
                p.kill()

    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.resumes == 1 and summary.rounds == 6
    assert summary.clients.joined == clients and summary.clients.rejoined == 0
    log = events(run_dir)
    resume = [e for e in log if e["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["missing"] == 0 and resume[0]["address"] == address
    assert all(e["online"] == clients for e in log if e["event"] == "round")  # all back, none lost after
    numbers = [e["round"] for e in log if e["event"] == "round"]
    assert sorted(set(numbers)) == list(range(1, 7))
    assert len(numbers) - len(set(numbers)) <= 1  # at most the round in flight is repeated
    assert [e["task"] for e in log if e["event"] == "task_end"] == [0, 1]
    expected = RunSummary.load(reference / "summary.json")
    assert expected.accuracy_matrix == summary.accuracy_matrix
    assert expected.accuracy_clients == summary.accuracy_clients and len(summary.accuracy_clients) == 2
    ours, theirs = _final_model(run_dir), _final_model(reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert np.array_equal(ours[name], theirs[name]), name

    code, out = _invoke("coordinator", "--resume", str(run_dir), "--data-root", str(mnist_root))
    assert code == 1 and "completed" in out


@pytest.mark.slow
def test_nodes_of_a_killed_up_end_with_it_and_up_resume_finishes_the_run(tmp_path, mnist_root):
    import psutil

    # 100 samples a client (not the 750 that 40 clients would share): the run is killed in its first rounds
    config = small_config(tmp_path / "c.yaml", scenario={"num_clients": 40, "samples_per_client_task": 100},
                          rounds={"clients_per_round": 4, "rounds_per_task": 2, "eval_every": 2},
                          training={"local_epochs": 1}, nodes=2)
    run_dir = tmp_path / "run"
    common = ["--data-root", str(mnist_root)]
    up = fcl_emu("up", "--config", str(config), "--run-dir", str(run_dir), *common)
    resumed = None
    try:
        wait_for(lambda: any(e["event"] == "round" for e in events(run_dir)), 120, "the first round")
        family = psutil.Process(up.pid).children(recursive=True)  # the zygote and the nodes it forked
        assert sum(" ".join(p.cmdline()).startswith("fcl-emu node ") for p in family) == 2
        os.kill(up.pid, signal.SIGKILL)
        up.wait(timeout=10)
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, "edge nodes (or their zygote) outlived their killed `fcl-emu up`"
        resumed = fcl_emu("up", "--resume", str(run_dir), *common)
        assert resumed.wait(timeout=120) == 0
    finally:
        kill_left(up, resumed)
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.resumes == 1 and summary.rounds == 4
    assert summary.clients.joined == 40 and summary.clients.rejoined == 0


@pytest.mark.slow
def test_a_run_that_fails_says_so_keeps_its_checkpoint_and_resumes(tmp_path, mnist_root, monkeypatch):
    """An exception in round 3 (of 4): `up` prints `run failed: ...` with the resume command, exits with the
    failed status, and `up --resume` then completes the run."""
    import io

    from rich.console import Console

    from fcl_emu.methods import base
    from fcl_emu import run as run_module
    from fcl_emu.runconfig import load_config

    calls = {"n": 0}
    original = base.fedavg

    def failing_fedavg(updates, *rule):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk on fire")
        return original(updates, *rule)

    monkeypatch.setattr(base, "fedavg", failing_fedavg)
    run_dir = tmp_path / "run"
    # 100 samples a client, not the 3,750 that 8 clients would share: the failure and the resume are checked
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 8, "samples_per_client_task": 100},
                                      rounds={"clients_per_round": 2, "rounds_per_task": 2, "eval_every": 2},
                                      training={"local_epochs": 1}),
                         {"data_root": [str(mnist_root)], "run_dir": str(run_dir)})
    out = io.StringIO()
    summary = run_module.run_local(config, Console(file=out, width=300))
    assert summary.status == "failed: RuntimeError: disk on fire" and summary.rounds == 2
    text = out.getvalue()
    assert "run failed: RuntimeError: disk on fire" in text and f"fcl-emu up --resume {run_dir}" in text
    assert "disk on fire" in (run_dir / "logs" / "failure.txt").read_text()
    monkeypatch.setattr(base, "fedavg", original)
    resumed_config, ckpt = run_module.open_resume(run_dir, {"data_root": [str(mnist_root)]})
    summary = run_module.run_local(resumed_config, Console(file=io.StringIO()), resume=ckpt)
    assert summary.status == "completed" and summary.rounds == 4 and summary.resumes == 1


@pytest.mark.slow
def test_sigterm_ends_a_run_like_ctrl_c_with_its_summary_checkpoint_and_resume_command(tmp_path, mnist_root,
                                                                                        reference):
    """SIGTERM (what `timeout`, Slurm and systemd send) mid-run: the nodes stop, summary.json says
    `interrupted: SIGTERM`, the checkpoint stays, the summary table and the exact resume command are printed,
    exit 143; `up --resume` then finishes the run with the uninterrupted run's accuracy matrix."""
    import psutil

    config, reference = reference
    run_dir = tmp_path / "run"
    common = ["--data-root", str(mnist_root)]
    up = fcl_emu("up", "--config", str(config), "--run-dir", str(run_dir), *common,
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    resumed = None
    try:
        wait_for(lambda: any(e["event"] == "round" for e in events(run_dir)), 120, "the first round")
        family = psutil.Process(up.pid).children(recursive=True)
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=60)
        assert up.returncode == 143, out[-3000:]
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, "edge nodes outlived the interrupted run"
        assert "run interrupted by SIGTERM" in out and f"--resume {run_dir}" in out and "interrupted: SIGTERM" in out
        summary = RunSummary.load(run_dir / "summary.json")
        assert summary.status == "interrupted: SIGTERM" and summary.exit_code == 143
        assert events(run_dir)[-1] == {**events(run_dir)[-1], "event": "end", "status": "interrupted: SIGTERM"}
        assert not list(run_dir.glob("*.tmp")) and checkpoint.exists(run_dir / CHECKPOINT_DIR)
        resumed = fcl_emu("up", "--resume", str(run_dir), *common)
        assert resumed.wait(timeout=120) == 0
    finally:
        kill_left(up, resumed)
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == "completed" and summary.resumes == 1 and summary.rounds == 6
    assert summary.accuracy_matrix == RunSummary.load(reference / "summary.json").accuracy_matrix


def test_a_task_that_trained_nothing_is_never_reported_completed():
    """Every round of a task skipped (its clients gone, say, after the task before ended): `degraded`, naming
    the task; no round trained at all: `failed`."""
    from fcl_emu.coordinator.run_status import trained_status as _trained_status

    def rounds(*skipped_by_task):
        return [SimpleNamespace(task=t, skipped=s, diverged=None, accuracy_seen=None)
                for t, flags in enumerate(skipped_by_task) for s in flags]

    assert _trained_status(rounds([False, True], [True, False])) == "completed"
    assert _trained_status(rounds([False], [True, True], [True])).startswith("degraded: tasks 1, 2 trained nothing")
    assert _trained_status(rounds([True], [True])).startswith("failed: every round was skipped")
    exit_codes = {status: RunSummary(status=status, method="fedavg", dataset="mnist", accuracy_matrix=[],
                                     bytes_total=0, rounds=0, wall_clock_s=0.0).exit_code
                  for status in ("completed", "interrupted: SIGTERM", "interrupted: SIGINT", "interrupted",
                                 "degraded: task 1 trained nothing", "aborted: every edge node exited")}
    assert exit_codes == {"completed": 0, "interrupted: SIGTERM": 143, "interrupted: SIGINT": 130,
                          "interrupted": 130, "degraded: task 1 trained nothing": 1,
                          "aborted: every edge node exited": 1}


@pytest.mark.slow
def test_nodes_killed_during_a_tasks_end_abort_the_run_with_their_exits_recorded(tmp_path, mnist_root, monkeypatch):
    """Every edge node SIGKILLed (an out-of-memory kill, a lost host) while the coordinator does task 0's
    end-of-task work, when nothing serves its socket: the next round notices, records each node's exit and ends
    the run `aborted`, never `completed`; the checkpoint after task 0 stays for a resume."""
    import io

    import psutil
    from rich.console import Console

    from fcl_emu.methods import base
    from fcl_emu import run as run_module
    from fcl_emu.runconfig import load_config

    original = base.ServerPart.end_task

    def end_task_as_the_nodes_die(self, task):
        nodes = [p for p in psutil.Process().children(recursive=True) if "node" in " ".join(p.cmdline())]
        for p in nodes:
            p.kill()
        psutil.wait_procs(nodes, timeout=10)
        return original(self, task)

    monkeypatch.setattr(base.ServerPart, "end_task", end_task_as_the_nodes_die)
    run_dir = tmp_path / "run"
    # 100 samples a client, not 3,750: one round has to train before the task ends
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 8, "samples_per_client_task": 100},
                                      rounds={"clients_per_round": 2, "rounds_per_task": 1},
                                      training={"local_epochs": 1}),
                         {"data_root": [str(mnist_root)], "run_dir": str(run_dir)})
    out = io.StringIO()
    summary = run_module.run_local(config, Console(file=out, width=300))
    assert summary.status.startswith("aborted: every edge node exited") and summary.rounds == 1
    assert len([e for e in events(run_dir) if e["event"] == "node_exit"]) == 2
    assert f"fcl-emu up --resume {run_dir}" in out.getvalue()


@pytest.mark.slow
def test_a_full_disk_fails_the_run_in_one_line_and_keeps_the_last_checkpoint(tmp_path, mnist_root, monkeypatch):
    """The second checkpoint (after round 1) finds the disk full: the run is recorded as `failed: disk full
    (<the file>)`, `up` says so in one line and exits 1, the first checkpoint is intact and `up --resume`
    completes the run."""
    import io

    import typer
    from rich.console import Console

    from fcl_emu import cli
    from fcl_emu import run as run_module
    from fcl_emu.runconfig import load_config

    saves, savez = [], np.savez

    def savez_on_a_disk_that_fills_up(f, **arrays):
        saves.append(f.name)
        if len(saves) == 2:
            f.write(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        savez(f, **arrays)

    monkeypatch.setattr(checkpoint.np, "savez", savez_on_a_disk_that_fills_up)
    run_dir = tmp_path / "run"
    # one task of all ten classes would give each of the 4 clients 15,000 samples (a minute of training); 100
    # each are enough to reach the checkpoints
    config = load_config(small_config(tmp_path / "c.yaml", scenario={"num_clients": 4, "num_tasks": 1,
                                                                     "samples_per_client_task": 100},
                                      rounds={"clients_per_round": 2, "rounds_per_task": 2, "eval_every": 2},
                                      training={"local_epochs": 1}, nodes=1),
                         {"data_root": [str(mnist_root)], "run_dir": str(run_dir)})
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=300))
    with pytest.raises(typer.Exit) as ended:
        cli._finish(run_module.run_local, config)
    assert ended.value.exit_code == 1
    summary = RunSummary.load(run_dir / "summary.json")
    assert summary.status == f"failed: disk full ({saves[1]})" and summary.rounds == 1
    text = out.getvalue()
    assert f"run {summary.status}" in text and f"fcl-emu up --resume {run_dir}" in text
    assert "Traceback" not in text and "Errno" not in text
    monkeypatch.undo()
    ckpt = checkpoint.load(run_dir / "checkpoint")  # the one before: when the clients had joined
    assert ckpt.state["next"] == {"task": 0, "task_round": 0} and ckpt.state["global_round"] == 0
    assert [p.name for p in (run_dir / "checkpoint").glob("arrays-*.npz")] == [ckpt.state["arrays"]["file"]]
    resumed_config, ckpt = run_module.open_resume(run_dir, {"data_root": [str(mnist_root)]})
    summary = run_module.run_local(resumed_config, Console(file=io.StringIO()), resume=ckpt)
    assert summary.status == "completed" and summary.rounds == 2 and summary.resumes == 1
