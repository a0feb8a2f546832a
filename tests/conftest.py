"""Shared fixtures: a scratch working directory, the data root, Flower's environment, free ports, and a real
emulation started as processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from fcl_emu.monitoring.results import RunSummary
from fcl_emu.runconfig import default_data_roots
from fcl_emu.launchers.process import node_env
from fcl_emu.scenario.datasets import DATA_ROOT_ENV

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _outside_the_checkout(tmp_path_factory):
    """The tests run in a scratch directory: nothing that a test, or a command it starts, writes where no path
    was given (``runs/<time>/``, say) lands in the checkout. The data roots are made absolute first; the commands
    started as processes import the project as installed (``pip install -e .``: this checkout), never its bare
    folders."""
    roots = default_data_roots()
    with pytest.MonkeyPatch.context() as patch:
        if os.environ.get(DATA_ROOT_ENV) or any(root.exists() for root in roots):
            patch.setenv(DATA_ROOT_ENV, os.pathsep.join(str(root.resolve()) for root in roots))
        patch.chdir(tmp_path_factory.mktemp("cwd"))
        yield


def find_dataset_root(folder: str) -> Path:
    """The data root holding ``folder``; skip (saying where we looked) if none does."""
    roots = default_data_roots()
    for root in roots:
        if (root / folder).exists():
            return root
    pytest.skip(f"dataset folder {folder!r} not found under {', '.join(map(str, roots))} "
                f"(set FCL_EMU_DATA_ROOT)")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Keep a module's torch work on one core (the test machine has two, shared with child processes)."""
    from fcl_emu.methods.jobs import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def mnist_root() -> Path:
    return find_dataset_root("mnist")


@pytest.fixture(scope="session")
def flower_python():
    """The interpreter of Flower's environment (fcl_emu/bench/flower_env.py: --flower-python's lookup), or a skip
    saying why there is none that can be used."""
    from fcl_emu.bench.flower_env import FlowerEnvError, find_python

    try:
        return find_python()
    except FlowerEnvError as exc:
        pytest.skip(f"no usable Flower environment: {exc}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fcl_emu(*args: str, **kw) -> subprocess.Popen:
    """Start the real command line as a child process."""
    return subprocess.Popen([sys.executable, "-m", "fcl_emu", *args], env=node_env(), **kw)


def kill_left(*procs: subprocess.Popen | None) -> None:
    """Kill what is still running of ``procs`` (a test's commands, when it fails half-way)."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()


def small_config(path: Path, **overrides) -> Path:
    """A tiny but complete FCIL scenario on MNIST (100 clients of ~300 samples per task), fast heartbeats."""
    config = {
        "scenario": {"dataset": "mnist", "num_tasks": 2, "num_clients": 100},
        "rounds": {"clients_per_round": 4, "rounds_per_task": 2, "deadline_s": 60, "eval_every": 2},
        "training": {"local_epochs": 2, "batch_size": 32},
        "network": {"heartbeat_interval_s": 0.3, "liveness_timeout_s": 2.0, "join_timeout_s": 60},
        "model": "cnn",
        "nodes": 2,
        "device": "cpu",
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            config.setdefault(key, {}).update(value)
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


HOG = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    pass\n"  # a busy loop


def seeded_run(tmp_path: Path, mnist_root: Path, name: str, *, hogs: int = 0, **overrides):
    """One seeded `fcl-emu up` run of :func:`small_config` with ``overrides``, beside ``hogs`` processes that
    keep a core busy each all along; its summary and its round records."""
    from fcl_emu.monitoring.results import RunSummary

    config = small_config(tmp_path / f"{name}.yaml", **overrides)
    busy = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        proc = fcl_emu("up", "--config", str(config), "--data-root", str(mnist_root), "--run-dir",
                       str(tmp_path / name), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output, _ = proc.communicate(timeout=240)
    finally:
        for h in busy:
            h.kill()
            h.wait()
    assert proc.returncode == 0, output
    summary = RunSummary.load(tmp_path / name / "summary.json")
    return summary, [e for e in events(tmp_path / name) if e.get("event") == "round"]


def device_keys(directory: Path, clients: int) -> tuple[Path, list[str]]:
    """Per-device CurveZMQ keys for ``clients`` clients in ``directory``: (the key directory for `fcl-emu
    coordinator --keys`, the key arguments of any `fcl-emu node` hosting some of them)."""
    from fcl_emu.keys import write_run_keys

    keys = write_run_keys(directory, [list(range(clients))], per_device=True)
    return keys, node_key_flags(keys)


def keyed(config, directory: Path):
    """``config`` (a RunConfig) with per-device keys written in ``directory``; and the nodes' key arguments."""
    from fcl_emu.keys import with_keys

    config = with_keys(config, directory, [list(range(config.scenario.num_clients))], per_device=True)
    return config, node_key_flags(config.security.keys)


def node_key_flags(keys: Path) -> list[str]:
    """The key flags of `fcl-emu node` for the first edge node of a run keyed in ``keys``."""
    from fcl_emu.launchers.base import node_key_files

    server_key, key = node_key_files(keys, 0)
    return ["--server-key", str(server_key), "--key", str(key)]


def raw_header(**overrides) -> bytes:
    """A header frame built field by field, to hand-craft messages the encoder would refuse."""
    import msgspec

    from fcl_emu.wire.messages import PROTOCOL_VERSION, Header

    fields = dict(v=PROTOCOL_VERSION, type="heartbeat", sender="c", seq=1, round=0, task=0,
                  body=msgspec.Raw(msgspec.msgpack.encode({})), tensors=[])
    fields.update(overrides)
    return msgspec.msgpack.encode(Header(**fields))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def exit_code(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    """``proc``'s exit code; if it is still running after ``timeout`` s, fail with the end of its ``log`` and the
    stacks of its threads (the fcl-emu commands print them on SIGUSR1)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        raise AssertionError(f"still running after {timeout} s; its log ends:\n{log.read_text()[-12000:]}") from None


def run_beside(coordinator, runners, run_dir: Path):
    """Run ``coordinator`` into ``run_dir`` with ``runners`` (edge nodes, edge aggregators: each ``run(stop)`` serves
    until ``stop`` is set) in threads of this process; stop and join them and close the coordinator; its summary."""
    import threading

    stop = threading.Event()
    threads = [threading.Thread(target=r.run, args=(stop,), daemon=True) for r in runners]
    for t in threads:
        t.start()
    try:
        return coordinator.run(run_dir)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        coordinator.close()


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- container backends ---------------------------------------------------------------------------------------


def up(tmp: Path, *args: str,
       timeout: float = 600) -> tuple[subprocess.CompletedProcess, RunSummary | None, list[dict]]:
    """``fcl-emu up`` as a user runs it; returns (process, summary.json or None, events.jsonl)."""
    run_dir = tmp / "run"
    done = subprocess.run([sys.executable, "-m", "fcl_emu", "up", "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=timeout)
    summary = RunSummary.load(run_dir / "summary.json") if (run_dir / "summary.json").exists() else None
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()] \
        if (run_dir / "events.jsonl").exists() else []
    return done, summary, events


@pytest.fixture(scope="session")
def image() -> str:
    """The project's image, built (or reused) once per test session; skips without a Docker engine."""
    from fcl_emu.containers import docker_client

    reason = docker_client.available()
    if reason:
        pytest.skip(f"needs a Docker engine: {reason}")
    from fcl_emu.containers.image import ImageError, build_image

    try:
        return build_image(log=lambda _msg: None).tag
    except ImageError as exc:
        if "mmdebstrap is not installed" in str(exc):
            pytest.skip(str(exc))
        raise


def _run_objects() -> set[str]:
    """The containers and networks on the engine that carry a run's label."""
    from fcl_emu.containers import docker_client

    client = docker_client.client()
    return ({f"container {c.name}" for c in client.containers.list(all=True, filters={"label": "fcl-emu.run"})}
            | {f"network {n.name}" for n in client.networks.list(filters={"label": "fcl-emu.run"})})


@pytest.fixture
def no_leftovers(image) -> Callable[[], None]:
    """A check that nothing the test's runs made stays on the engine. What was there before the test is left out:
    the engine may be shared (another user's run, or one whose test session was killed)."""
    before = _run_objects()

    def check() -> None:
        assert _run_objects() - before == set()

    return check
