"""Edge nodes in real Docker containers: the image, a docker-backend run, real limits and real faults.

Every test here talks to a real Docker engine and runs the real image (skipped, with the reason, where no engine
answers; `.ci/run` installs and starts one). The cheap checks of plans, limits and node grouping need no engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from fcl_emu.containers import docker_client
from fcl_emu.scenario.faults import load_plan
from fcl_emu.launchers.base import node_specs
from fcl_emu.runconfig import RunConfig, load_config
from fcl_emu.scenario.devices import memory_bytes, memory_limit
from tests.conftest import small_config, up

pytestmark = pytest.mark.timeout(900)


# -- no engine needed ----------------------------------------------------------------------------------------


def test_memory_limits_are_checked():
    assert memory_limit("512M") == "512m" and memory_bytes("1.5g") == 1610612736
    for bad in ("lots", "1x", "-5m", "1k"):
        with pytest.raises(ValueError):
            memory_limit(bad)


def test_fault_plans_are_checked(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {action: kill, node: node-1, round: 2}\n  - {action: pause, rate_per_min: 3}\n")
    assert [f.action for f in load_plan(plan).faults] == ["kill", "pause"]
    for text, problem in [("faults:\n  - {action: explode, round: 1}\n", "action"),
                          ("faults:\n  - {action: kill}\n", "exactly one of"),
                          ("faults:\n  - {action: kill, round: 1, at_s: 3}\n", "exactly one of"),
                          ("faults:\n  - {action: kill, round: 1, node: a, device_class: b}\n", "not both"),
                          ("faults:\n  - {action: kill, at_s: 1, round_point: dispatched}\n", "needs round"),
                          ("faults:\n  - {action: kill, round: 1, round_point: end}\n", "round_point"),
                          ("faults: [\n", "cannot parse")]:
        plan.write_text(text)
        with pytest.raises(ValueError, match=problem):
            load_plan(plan)
    with pytest.raises(ValueError, match="No such file"):
        load_plan(tmp_path / "missing.yaml")


class _Container:
    """A container as the injector sees it: its status, and the actions it was given."""

    def __init__(self, done: list[str]):
        self.status, self.done = "running", done

    def reload(self):
        pass

    def kill(self):
        self.done.append("kill")

    def pause(self):
        self.done.append("pause")

    def unpause(self):
        self.done.append("unpause")


def test_a_round_s_faults_land_at_its_events_and_at_once_before_the_round_goes_on():
    """Faults are placed by the run's events, not by host time: a round's fault with no delay has landed when the
    progress call that triggered it returns (the coordinator goes on only then), at the round's start or once its
    requests are sent; round 2's faults ignore round 1's close; a resumed run's earlier rounds trigger nothing."""
    import threading

    from fcl_emu.containers.faults import FaultInjector, Target
    from fcl_emu.scenario.faults import FaultPlan

    done: list[str] = []
    recorded: list[tuple[str, str | None]] = []
    nodes = {"node-0": _Container(done), "node-1": _Container(done)}
    plan = FaultPlan.model_validate({"faults": [
        {"action": "pause", "node": "node-0", "round": 2, "duration_s": 0.2},
        {"action": "kill", "node": "node-1", "round": 2, "round_point": "dispatched"},
        {"action": "kill", "node": "node-1", "round": 1}]})
    undone = threading.Event()

    def record(action, node=None, **fields):
        recorded.append((action, node))
        if action == "unpause":
            undone.set()

    injector = FaultInjector(plan, Target(lambda: nodes, {"node-0": None, "node-1": None}, network=None), seed=0,
                             record=record)
    try:
        injector.on_progress("ready", {})
        injector.on_progress("round", {"round": 1})  # round 1 closed: round 2 has not started
        injector.on_progress("round_start", {"round": 2})
        assert done == ["pause"]  # landed before the call returned; the dispatched one not yet
        injector.on_progress("dispatched", {"round": 2})
        assert done == ["pause", "kill"]
        injector.on_progress("round_start", {"round": 2})  # once per round
        injector.on_progress("round_start", {"round": 1})  # a round before the last: nothing
        assert undone.wait(5)  # the undo runs from the injector's thread after duration_s
        assert recorded == [("pause", "node-0"), ("kill", "node-1"), ("unpause", "node-0")]
    finally:
        injector.close()


def test_a_fault_plan_needs_containers(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("faults:\n  - {action: kill, round: 2}\n")
    with pytest.raises(ValueError, match="use it with --backend docker or swarm"):
        load_config(None, {"containers": {"faults": str(plan)}})
    load_config(None, {"containers": {"faults": str(plan), "backend": "docker"}})


def test_nodes_group_device_classes_under_containers(tmp_path):
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(yaml.safe_dump({"profiles": [
        {"name": "fast", "share": 0.75, "container": {"cpus": 1.0}},
        {"name": "slow", "share": 0.25, "container": {"cpus": 0.25, "memory": "512m"}}]}))
    overrides = {"scenario": {"num_clients": 200}, "nodes": 5, "edge": {"device_profiles": str(profiles)}}
    striped = node_specs(load_config(None, overrides))  # host processes: striped, no classes
    assert [s.clients[:2] for s in striped[:2]] == [[0, 5], [1, 6]] and striped[0].device_class is None
    specs = node_specs(load_config(None, {**overrides, "containers": {"backend": "docker"}}))
    assert len(specs) == 5 and sorted(sum((s.clients for s in specs), [])) == list(range(200))
    by_class = {c: [s for s in specs if s.device_class == c] for c in ("fast", "slow")}
    assert [len(by_class["fast"]), len(by_class["slow"])] in ([4, 1], [3, 2])
    assert all(s.limits.cpus == 0.25 and s.limits.memory == "512m" for s in by_class["slow"])
    with pytest.raises(ValueError, match="fewer than the 2 device classes"):
        node_specs(load_config(None, {**overrides, "nodes": 1, "containers": {"backend": "docker"}}))


@pytest.mark.slow
def test_a_node_log_that_cannot_be_saved_is_a_warning_and_the_tear_down_goes_on(tmp_path, caplog):
    """On a full disk (here: a log directory that is a file) saving a node's log at the run's end must not raise:
    the services would stay, and the run's own end would be lost behind a traceback."""
    from fcl_emu.launchers.docker import DockerLauncher

    launcher = DockerLauncher.__new__(DockerLauncher)  # no engine needed to save a log
    launcher._log_dir = None
    (tmp_path / "logs").write_text("not a directory")
    launcher._log_dir = tmp_path / "logs"
    launcher._save_log(node_specs(RunConfig())[0], b"its last words\n")
    assert "the log of node-0 was not saved" in caplog.text
    launcher._log_dir = tmp_path
    launcher._save_log(node_specs(RunConfig())[0], b"its last words\n")
    assert (tmp_path / "node-0.log").read_bytes() == b"its last words\n"


def test_no_engine_is_one_clear_line(tmp_path, mnist_root):
    env_run = subprocess.run([sys.executable, "-m", "fcl_emu", "up", "--backend", "docker", "--clients", "4",
                              "--nodes", "2", "--data-root", str(mnist_root), "--run-dir", str(tmp_path / "r")],
                             capture_output=True, text=True, timeout=120,
                             env={**__import__("os").environ, "DOCKER_HOST": "unix:///nonexistent.sock"})
    assert env_run.returncode == 1
    assert "no Docker engine answers" in env_run.stderr and "Traceback" not in env_run.stderr


# -- a real engine -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_image_is_reused_when_nothing_changed(image):
    from fcl_emu.containers.image import build_image

    again = build_image(log=lambda _msg: None)
    assert again.reused and again.tag == image and again.size_bytes > 0
    out = docker_client.client().containers.run(image, ["methods"], remove=True).decode()
    assert "fedavg" in out and "lander" in out


@pytest.mark.slow
def test_killed_container_crashes_its_clients_and_a_paused_one_straggles(tmp_path, image, mnist_root, no_leftovers):
    """Round 2: node-1's container is killed once its clients were sent their requests (they are recorded as
    crashed, the run goes on). Round 3: node-0's container is frozen before the round's requests are sent, past
    the round deadline (its clients miss it, then come back).
    Round 5: node-2's container is cut off its network past the deadline (its clients miss it)."""
    plan = tmp_path / "faults.yaml"
    plan.write_text(yaml.safe_dump({"faults": [
        {"action": "kill", "node": "node-1", "round": 2, "round_point": "dispatched"},
        {"action": "pause", "node": "node-0", "round": 3, "duration_s": 16},
        {"action": "disconnect", "node": "node-2", "round": 5, "duration_s": 16}]}))
    # 400 samples per client and task and a 12 s deadline (the real clock's, as under every container backend):
    # a node's four clients make the first round, the slowest, beside two busy processes on a 2-core host (with
    # 800 samples and 8 s, one node missed it there); a fault outlasts the deadline by 4 s
    config = small_config(tmp_path / "config.yaml", scenario={"num_clients": 12, "num_tasks": 2,
                                                              "partition": "task_pool",
                                                              "samples_per_client_task": 400},
                          rounds={"clients_per_round": 12, "rounds_per_task": 3, "deadline_s": 12},
                          network={"heartbeat_interval_s": 1.0, "liveness_timeout_s": 40.0},
                          training={"local_epochs": 1, "batch_size": 32}, nodes=3)
    done, summary, events = up(tmp_path, "--config", str(config), "--backend", "docker", "--image", image,
                               "--faults", str(plan), "--data-root", str(mnist_root))
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary.status == "completed"
    faults = [(e["action"], e["node"]) for e in events if e["event"] == "fault"]
    assert faults == [("kill", "node-1"), ("pause", "node-0"), ("unpause", "node-0"), ("disconnect", "node-2"),
                      ("reconnect", "node-2")]
    exits = [e for e in events if e["event"] == "node_exit"]
    assert [(e["node"], e["code"]) for e in exits] == [("node-1", 137)] and "SIGKILL" in exits[0]["error"]
    rounds = [e for e in events if e["event"] == "round"]
    assert rounds[0]["participants"] == 12
    assert rounds[1]["participants"] < 12  # node-1's four clients died during round 2
    assert rounds[2]["late"] == 4 and rounds[2]["participants"] == 4  # node-0 frozen, node-2 on time
    assert rounds[3]["participants"] == 8  # node-0 thawed; node-1 is gone
    assert rounds[4]["late"] == 4 and rounds[4]["participants"] == 4  # node-2 cut off, node-0 on time
    assert summary.clients.dropped == 4
    no_leftovers()


@pytest.mark.slow
def test_real_cpu_limits_slow_training_and_a_memory_limit_kills_as_a_crash(tmp_path, image, mnist_root, no_leftovers):
    """Three device classes with container limits: 1 CPU, 0.25 CPU, and a memory limit too small to train in.
    The 0.25-CPU class trains several times slower; the starved node is OOM-killed, recorded as such, and the
    run goes on with the other classes. A real Prometheus scrapes the containers' counters: every query of the
    containers dashboard has data, and the throttling shows on the 0.25-CPU class only."""
    import time

    from fcl_emu.monitoring import stack
    from tests.conftest import free_port
    from tests.test_monitoring import CONTAINERS_BOARD, dashboard_queries, has_data, query_range

    prometheus_here = stack.prometheus_binary() is not None
    metrics = ["--metrics-port", str(stack.find_port_block("127.0.0.1", 4, start=20000 + free_port() % 20000,
                                                          stop=65000)),
               "--prometheus", "--prometheus-port", str(free_port())] if prometheus_here else []
    started = time.time()
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(yaml.safe_dump({"profiles": [
        {"name": "fast", "share": 1, "container": {"cpus": 1.0}},
        {"name": "slow", "share": 1, "container": {"cpus": 0.25}},
        {"name": "starved", "share": 1, "container": {"memory": "200m"}}]}))
    # 12 clients (3 fast, 6 slow, 3 starved), 200 samples each, one round: the 0.25-CPU node trains its clients
    # one after the other, 5 s of its time here (24 clients of 800 samples in two rounds took it 75 s). Prometheus
    # scrapes, and the containers' counters are sampled, every second (default 5 s), so the short run still has
    # the samples every rate() of the dashboard needs; the coordinator evaluates on one thread, beside the nodes.
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"scenario": {"samples_per_client_task": 200},
                                      "metrics": {"scrape_interval_s": 1.0}, "coordinator_threads": 1}))
    done, summary, events = up(
        tmp_path, "--config", str(config), "--backend", "docker", "--image", image, "--device-profiles",
        str(profiles), "--clients", "12",
        "--clients-per-round", "12", "--tasks", "1", "--rounds-per-task", "1", "--local-epochs", "1",
        "--nodes", "3", "--data-root", str(mnist_root), *metrics)
    ended = time.time()
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary.status == "completed"
    exits = [e for e in events if e["event"] == "node_exit"]
    assert len(exits) == 1 and exits[0]["code"] == 137 and "out of memory" in exits[0]["error"]
    train = [e["train_s_by_class"] for e in events if e["event"] == "round"]
    assert all(set(t) == {"fast", "slow"} for t in train)
    assert all(t["slow"] > 2 * t["fast"] for t in train), train
    no_leftovers()
    if not prometheus_here:
        pytest.skip("the `prometheus` binary is not installed: the container metrics were not checked")
    prometheus = stack.LocalPrometheus(tmp_path / "run", port=free_port(), scrape_interval_s=5.0)
    prometheus.start()
    try:
        run_id = json.loads((tmp_path / "run" / "prometheus_targets.json").read_text())[0]["labels"]["run_id"]
        for board, title, expr in dashboard_queries():
            if board == CONTAINERS_BOARD:
                concrete = expr.replace("$__rate_interval", "20s").replace("$run_id", run_id)
                assert has_data(query_range(prometheus.url, concrete, started, ended)), title
        throttled = query_range(prometheus.url, f'max_over_time(fcl_container_cpu_throttled_seconds_total'
                                                f'{{run_id="{run_id}"}}[10m])', started, ended)
        last = {series["metric"]["device_class"]: float(series["values"][-1][1]) for series in throttled}
        assert last["slow"] > 1.0 and last["slow"] > 10 * last["fast"], last
    finally:
        prometheus.stop()


# -- Docker Swarm (a single-node swarm here) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm(image):
    """This engine as a swarm manager; a swarm made here is left again afterwards."""
    client = docker_client.client()
    made = client.info()["Swarm"]["LocalNodeState"] != "active"
    if made:
        client.swarm.init(advertise_addr="127.0.0.1" if not _default_route() else None)
    yield client
    if made:
        client.swarm.leave(force=True)


def _default_route() -> bool:
    return any(line.split()[1] == "00000000" for line in Path("/proc/net/route").read_text().splitlines()[1:])


@pytest.mark.slow
def test_swarm_backend_runs_to_completion(tmp_path, image, swarm, mnist_root, no_leftovers):
    # a round per task, 50 samples per client: the services, their joins and a task boundary are what is tested
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"scenario": {"samples_per_client_task": 50}, "coordinator_threads": 1}))
    args = ["--clients", "20", "--clients-per-round", "5", "--tasks", "2", "--rounds-per-task", "1",
            "--local-epochs", "1", "--nodes", "2", "--seed", "3", "--data-root", str(mnist_root), "--config",
            str(config)]
    done, summary, events = up(tmp_path, *args, "--backend", "swarm", "--image", image)
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary.status == "completed" and summary.clients.joined == 20
    assert swarm.services.list(filters={"label": "fcl-emu.run"}) == []
    assert swarm.secrets.list(filters={"label": "fcl-emu.run"}) == []
    no_leftovers()


@pytest.mark.slow
def test_deployed_stack_runs_and_prometheus_scrapes_it(tmp_path, image, swarm, mnist_root):
    """`fcl-emu deploy` files, deployed by the user's own `docker stack deploy`: the coordinator service finishes
    the run, and the stack's Prometheus (from the project's image) scraped the coordinator and both nodes."""
    import time

    out = tmp_path / "deploy"
    # a round per task of 50 samples per client; the stack's Prometheus scrapes every second (default 5 s), so
    # the nodes are scraped while the short run lasts
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"scenario": {"samples_per_client_task": 50},
                                      "metrics": {"scrape_interval_s": 1.0}}))
    done = subprocess.run([sys.executable, "-m", "fcl_emu", "deploy", str(out), "--clients", "12",
                           "--clients-per-round", "4", "--tasks", "2", "--rounds-per-task", "1", "--local-epochs",
                           "1", "--nodes", "2", "--image", image, "--data-root", str(mnist_root), "--config",
                           str(config), "--publish-monitoring"],  # Prometheus on the manager's port 9090
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compose = yaml.safe_load((out / "compose.yml").read_text())
    assert set(compose["services"]) == {"coordinator", "prometheus", "grafana", "node-0", "node-1"}
    assert compose["services"]["node-0"]["restart"] == "no"
    stack = "fcltest"
    deployed = subprocess.run(["docker", "stack", "deploy", "-c", "stack.yml", stack], cwd=out,
                              capture_output=True, text=True, timeout=120)
    if deployed.returncode != 0 and "unknown command" in deployed.stderr:
        pytest.skip(f"this docker CLI has no `stack deploy`: {deployed.stderr.strip()}")
    assert deployed.returncode == 0, deployed.stderr
    try:
        summary_file = out / "runs" / "run" / "summary.json"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (summary_file.exists() and json.loads(
                summary_file.read_text()).get("status") == "completed"):
            time.sleep(2)
        assert json.loads(summary_file.read_text())["status"] == "completed"
        query = "http://127.0.0.1:9090/api/v1/query?query=" + urllib.parse.quote("max_over_time(up[10m])")
        with urllib.request.urlopen(query, timeout=10) as reply:
            scraped = {r["metric"]["instance"] for r in json.load(reply)["data"]["result"]
                       if r["value"][1] == "1"}
        assert {"coordinator:9100", "node-0:9101", "node-1:9102"} <= scraped
    finally:
        subprocess.run(["docker", "stack", "rm", stack], capture_output=True, timeout=120)


@pytest.mark.slow
def test_bench_containers_measures_both_backends(tmp_path, image, mnist_root, no_leftovers):
    """A small `fcl-emu bench containers`: both backends measured on the same workload, same accuracy."""
    from rich.console import Console

    from fcl_emu.bench.containers import run

    # 200 samples per client: a quarter CPU still trains a client for several of the quota's 100 ms periods, so
    # the slowdown is the quota's (with 1,500 the 0.25-CPU node trained for about 25 s); the session's image, not
    # a second build of it
    result = run(clients=8, cohort=8, rounds=1, nodes=2, data_root=[mnist_root], json_path=tmp_path / "c.json",
                 console=Console(file=open(tmp_path / "out.txt", "w")), samples=200, image=image)
    assert json.loads((tmp_path / "c.json").read_text())["workload"]["clients"] == 8
    assert result["process"]["status"] == result["docker"]["status"] == result["classes"]["status"] == "completed"
    assert result["process"]["accuracy"] == result["docker"]["accuracy"]
    for backend in ("process", "docker"):
        assert result[backend]["startup_s"] > 0 and result[backend]["mb_per_idle_client"] > 1
    assert result["slowdown_quarter_cpu"] > 1.5
    no_leftovers()


def test_gpu_containers_get_a_cuda_device_request(image):
    """`containers.gpus`: edge-node containers get the host's GPUs through a CUDA device request."""
    import docker

    if "nvidia" not in docker_client.client().info().get("Runtimes", {}):
        pytest.skip("no GPU here: the engine has no NVIDIA container runtime, so a CUDA device request cannot be "
                    "served (the request is made by fcl_emu/launchers/docker.py when containers.gpus is set)")
    out = docker_client.client().containers.run(
        image, ["-c", "import torch; print(torch.cuda.device_count())"], entrypoint=["python3"], remove=True,
        device_requests=[docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]).decode()
    assert int(out.strip()) >= 1


@pytest.mark.slow
def test_a_class_uplink_cap_really_limits_what_a_container_sends(image):
    """`uplink_mbit`: the kernel's token bucket on the container's egress. 2 MB sent to the host at 8 Mbit/s
    takes about 2 s; uncapped, a fraction of that."""
    import socket
    import threading

    from fcl_emu.launchers.engine_launcher import tbf_entrypoint

    client = docker_client.client()
    network = client.networks.create("fcl-emu-test-uplink", driver="bridge")
    gateway = client.networks.get(network.id).attrs["IPAM"]["Config"][0]["Gateway"]
    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]

    def drain() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            while conn.recv(1 << 16):
                pass
            conn.close()

    threading.Thread(target=drain, daemon=True).start()
    send = (f"import socket, time; s = socket.create_connection(('{gateway}', {port})); t = time.time(); "
            f"s.sendall(b'x' * 2_000_000); s.shutdown(socket.SHUT_WR); s.recv(1); print(time.time() - t)")
    try:
        capped = float(client.containers.run(image, ["-c", send], entrypoint=tbf_entrypoint(8, "python3"),
                                              cap_add=["NET_ADMIN"], network=network.name, remove=True).decode())
        free = float(client.containers.run(image, ["-c", send], entrypoint=["python3"], network=network.name,
                                           remove=True).decode())
    finally:
        listener.close()
        network.remove()
    assert 1.6 < capped < 6 and free < capped / 3, (capped, free)
