"""The zygote that forks ``up``'s edge nodes (fcl_emu/launchers/zygote.py): real forks in a fresh process (a
pytest process runs threads, where :func:`zygote.start` rightly refuses to fork)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from conftest import events, small_config, wait_for
from fcl_emu.launchers import zygote

# run in a fresh interpreter: fork the zygote, then act on the children it forks
SCRIPT = textwrap.dedent("""
    import json, signal, subprocess, sys, time
    from pathlib import Path
    from fcl_emu.edge_node.args import NodeArgs
    from fcl_emu.launchers import zygote
    logs = Path(sys.argv[1])
    z = zygote.start()
    out = {"zygote": z.pid}
    bad = z.spawn(NodeArgs("tcp://127.0.0.1:9", [0], data_roots=["/no/such/dir"], insecure=True), logs / "bad.log",
                  {})
    out["bad"] = bad.wait(timeout=60)
    # a node that waits for a coordinator that never comes: ended by a signal, as `up` ends a stuck node
    stuck = z.spawn(NodeArgs("tcp://127.0.0.1:9", range(4), data_roots=[sys.argv[2]], insecure=True),
                    logs / "stuck.log", {"OMP_NUM_THREADS": "1"})
    out["stuck_pid"] = stuck.pid
    try:
        stuck.wait(timeout=0.5)
        out["stuck_waited"] = "exited"
    except subprocess.TimeoutExpired:
        out["stuck_waited"] = "timeout"
    out["stuck_running"] = stuck.poll()
    if sys.argv[3] == "orphan":  # leave it running, tell the test, and wait to be killed
        print(json.dumps(out), flush=True)
        time.sleep(120)
    stuck.send_signal(signal.SIGTERM)
    out["stuck"] = stuck.wait(timeout=30)
    z.close()
    out["zygote_after_close"] = z.returncode(12345)
    print(json.dumps(out), flush=True)
""")


def _script(tmp_path, mnist_root, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), str(mnist_root), mode],
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.slow  # a fresh interpreter forks a zygote, which forks nodes that import the edge node
def test_forked_nodes_report_their_exit_codes_logs_and_signals(tmp_path, mnist_root):
    proc = _script(tmp_path, mnist_root, "close")
    out = json.loads(proc.communicate(timeout=180)[0])
    assert proc.returncode == 0
    assert out["bad"] == 1 and "error: no data root exists" in (tmp_path / "bad.log").read_text()
    assert out["stuck_waited"] == "timeout" and out["stuck_running"] is None
    assert out["stuck"] == 0  # SIGTERM: the node's handler stops it cleanly
    assert out["zygote_after_close"] == -signal.SIGKILL  # its children are gone with it
    assert not psutil.pid_exists(out["zygote"])


@pytest.mark.slow  # as above
def test_nodes_die_with_up(tmp_path, mnist_root):
    """``up`` SIGKILLed: the zygote and the nodes it forked end too (their parents' death signals)."""
    proc = _script(tmp_path, mnist_root, "orphan")
    try:
        out = json.loads(proc.stdout.readline())
        assert " ".join(psutil.Process(out["stuck_pid"]).cmdline()).startswith("fcl-emu node ")  # not up's command
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: gone(out["stuck_pid"]), 10, "the forked node to end with up")
    wait_for(lambda: gone(out["zygote"]), 10, "the zygote to end with up")


def gone(pid: int) -> bool:
    """Ended (a zombie where nothing reaps orphans counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_no_zygote_beside_other_threads():
    """A process with other threads does not fork (a fork copies one thread; their locks would be broken):
    nodes are then started afresh."""
    halt = threading.Event()
    helper = threading.Thread(target=halt.wait)
    helper.start()
    try:
        assert zygote.start() is None and zygote.current() is None
    finally:
        halt.set()
        helper.join()


@pytest.mark.slow  # a fresh interpreter that starts a zygote
def test_spawn_after_the_zygote_is_gone_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, signal, sys
        from fcl_emu.edge_node.args import NodeArgs
        from fcl_emu.launchers import zygote
        z = zygote.start()
        os.kill(z.pid, signal.SIGKILL)
        os.waitpid(z.pid, 0)
        try:
            z.spawn(NodeArgs("tcp://127.0.0.1:9", [0], insecure=True), sys.argv[1], {})
        except zygote.ZygoteGone as exc:
            print("gone:", exc)
    """), str(tmp_path / "x.log")], capture_output=True, text=True, timeout=120)
    assert "gone: the zygote process" in proc.stdout, proc.stderr


@pytest.mark.slow  # a whole run
def test_a_forked_node_that_dies_at_start_up_is_reported_at_once(tmp_path, mnist_root):
    """`up`'s path with a zygote: node-1 cannot read its key file and exits; the coordinator reports it with the
    node's own error line (the zygote's exit report) and goes on with node-0's clients."""
    # 100 samples a client (not 3,750): the whole run then takes seconds, far from the 60 s join timeout that
    # the time bound below tells apart
    config = small_config(tmp_path / "c.yaml", scenario={"num_clients": 8, "samples_per_client_task": 100},
                          rounds={"clients_per_round": 2, "rounds_per_task": 1})
    script = textwrap.dedent("""
        import dataclasses, io, json, sys, time
        from rich.console import Console
        from fcl_emu.launchers import process, zygote
        forks = zygote.start()  # as `fcl-emu up` does, before anything else
        from fcl_emu import run
        from fcl_emu.runconfig import load_config

        original = process.node_args

        def node_args(address, indices, config, name, n=0, parent_pid=None, **kw):
            args = original(address, indices, config, name, n, parent_pid=parent_pid, **kw)
            return dataclasses.replace(args, key=sys.argv[3]) if n == 1 else args

        process.node_args = node_args
        config = load_config(sys.argv[1], {"data_root": [sys.argv[2]], "run_dir": sys.argv[4]})
        out = io.StringIO()
        started = time.monotonic()
        summary = run.run_local(config, Console(file=out, width=200))
        forks.close()
        print(json.dumps({"s": time.monotonic() - started, "status": summary.status,
                          "joined": summary.clients.joined, "out": out.getvalue()}))
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(config), str(mnist_root),
                           str(tmp_path / "stolen.key_secret"), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["s"] < 50 and out["status"] == "completed" and out["joined"] == 4
    assert "edge node node-1 exited (code 1): error: cannot read key file" in out["out"]
    exits = [e for e in events(tmp_path / "run") if e["event"] == "node_exit"]
    assert len(exits) == 1 and exits[0]["node"] == "node-1" and exits[0]["code"] == 1
