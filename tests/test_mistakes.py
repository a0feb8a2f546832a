"""A new user's mistakes, run as a user runs them: each is one line on stderr (`error: ...`) and exit 2 (a usage or
configuration mistake) or 1 (an input that is not there or cannot be written: docs/commands.md#exit-codes), never a
traceback.

Each case is a process of its own, forked from one interpreter that imported the CLI and torch once (what most
cases import: a fresh interpreter per case cost about 3 s each); a few cases also run through the installed
`fcl-emu` entry point, so the script itself is tested too. Each case is then its own test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FCL_EMU = Path(sys.executable).with_name("fcl-emu")
pytestmark = [pytest.mark.slow,  # real processes: every case a process of its own
              pytest.mark.timeout(600)]

FILES = {
    "badsyntax.yaml": "scenario: [1, 2\n",
    "unknown.yaml": "scenario:\n  no_such_key: 1\n",
    "wrongtype.yaml": "rounds:\n  rounds_per_task: many\n",
    "list.yaml": "- 1\n- 2\n",
    "badmethod.yaml": "method: nosuch\n",
    "negative.yaml": "scenario:\n  num_clients: -3\n",
    "afile": "not a folder\n",
    "usedrun/config.yaml": "method: fedavg\n",
}

# (arguments, exit code, a phrase of the one line)
CASES: list[tuple[list[str], int, str]] = [
    # up: option values
    (["up", "--clients", "0"], 2, "--clients"),
    (["up", "--clients", "abc"], 2, "--clients"),
    (["up", "--clients", "-5"], 2, "at least 1"),
    (["up", "--bogus"], 2, "No such option"),
    (["up", "--method", "nosuch"], 2, "unknown method"),
    (["up", "--dataset", "nosuch"], 2, "unknown dataset"),
    (["up", "--tasks", "0"], 2, "--tasks"),
    (["up", "--rounds-per-task", "0"], 2, "--rounds-per-task"),
    (["up", "--clients-per-round", "0"], 2, "--clients-per-round"),
    (["up", "--clients", "10", "--clients-per-round", "20"], 2, "exceeds"),
    (["up", "--nodes", "0"], 2, "--nodes"),
    (["up", "--lr", "-1"], 2, "--lr"),
    (["up", "--lr", "nan"], 2, "--lr"),
    (["up", "--local-epochs", "0"], 2, "--local-epochs"),
    (["up", "--availability", "nosuch"], 2, "--availability"),
    (["up", "--availability", "onoff:abc"], 2, "onoff:MEAN_ON_S:MEAN_OFF_S"),
    (["up", "--crash-rate", "2"], 2, "--crash-rate"),
    (["up", "--secagg", "--method", "fedcbc"], 2, "VAEs"),
    (["up", "--aggregator", "nosuch"], 2, "--aggregator"),
    (["up", "--aggregation", "nosuch"], 2, "--aggregation"),
    (["up", "--edge-aggregators", "-1"], 2, "--edge-aggregators"),
    (["up", "--metrics-port", "99999"], 2, "--metrics-port"),
    (["up", "--backend", "nosuch"], 2, "--backend"),
    (["up", "--clock", "nosuch"], 2, "--clock"),
    (["up", "--partition", "nosuch"], 2, "--partition"),
    (["up", "--model", "nosuch"], 2, "unknown model"),
    (["up", "--join-timeout", "0"], 2, "--join-timeout"),
    (["up", "--resume", "missing-run"], 1, "cannot resume"),
    (["up", "--resume", "empty", "--clients", "5"], 2, "cannot be combined with --resume"),
    (["up", "--data-root", "nowhere"], 1, "not found"),
    (["up", "--run-dir", "afile/run"], 1, "cannot write"),
    (["up", "--run-dir", "usedrun"], 2, "holds a run already"),
    (["up", "--resume", "usedrun", "--overwrite"], 2, "--overwrite"),
    # up: settings the configuration ignores, and what cannot work
    (["up", "--dp-noise-multiplier", "1.0"], 2, "needs --privacy"),
    (["up", "--buffer", "5"], 2, "round policy sync takes no option buffer (fedbuff takes it"),
    (["up", "--secagg", "--clients-per-round", "5", "--secagg-threshold", "6"], 2, "every round would be skipped"),
    # up: config files
    (["up", "--config", "missing.yaml"], 2, "cannot read"),
    (["up", "--config", "badsyntax.yaml"], 2, "not valid YAML"),
    (["up", "--config", "unknown.yaml"], 2, "unknown key"),
    (["up", "--config", "wrongtype.yaml"], 2, "valid integer"),
    (["up", "--config", "list.yaml"], 2, "mapping"),
    (["up", "--config", "badmethod.yaml"], 2, "unknown method"),
    (["up", "--config", "negative.yaml"], 2, "at least 1"),
    # coordinator, node
    (["coordinator", "--clients", "0"], 2, "--clients"),
    (["coordinator", "--bogus"], 2, "No such option"),
    (["coordinator", "--resume", "missing-run"], 1, "cannot resume"),
    (["node"], 2, "required"),
    (["node", "--connect", "notaurl", "--clients", "0-3"], 2, "ZeroMQ endpoint"),
    (["node", "--connect", "tcp://127.0.0.1:1", "--clients", "0-3", "--bogus"], 2, "unrecognized arguments"),
    (["node", "--connect", "tcp://127.0.0.1:1", "--clients", "abc"], 2, "bad client set"),
    # deploy, report, compare
    (["deploy"], 2, "Missing argument"),
    (["deploy", "out", "--clients", "0"], 2, "--clients"),
    (["deploy", "out", "--data-root", "nowhere"], 2, "--data-root"),
    (["deploy", "out", "--resume", "x"], 2, "--resume"),
    (["report", "missing-run"], 1, "not a run directory"),
    (["report", "empty"], 1, "not a run directory"),
    (["compare"], 2, "Missing argument"),
    (["compare", "missing-run"], 1, "not a run directory"),
    (["compare", "empty"], 1, "no run to compare"),
    # bench
    (["bench", "nosuch"], 2, "No such command"),
    (["bench", "round", "--clients", "0"], 2, "--clients"),
    (["bench", "wire", "--seconds", "0"], 2, "--seconds"),
    (["bench", "secagg", "--clients", "2"], 2, "--clients"),
    (["bench", "secagg", "--dropout", "1.5", "--no-flower"], 2, "--dropout"),
    (["bench", "secagg", "--neighbors", "0", "--no-flower"], 2, "--neighbors"),
    (["bench", "hierarchy", "--populations", "abc"], 2, "--populations"),
    (["bench", "hierarchy", "--edge-rounds", "0"], 2, "--edge-rounds"),
    (["bench", "scale", "--populations", "1"], 2, "--populations"),
    (["bench", "flower", "--points", "abc"], 2, "--points"),
    (["bench", "churn", "--faults", "nosuch"], 2, "--faults"),
    (["bench", "churn", "--aggregations", "nosuch"], 2, "--aggregations"),
    (["bench", "energy", "--cases", "nosuch"], 2, "--cases"),
    (["bench", "soak", "--kinds", "nosuch"], 2, "--kinds"),
    (["bench", "jobs", "--device", "tpu"], 2, "--device"),
    (["bench", "metrics", "--clients", "0"], 2, "--clients"),
    # methods, keys, cluster, trace, image
    (["methods", "nosuch"], 2, "unknown method"),
    (["methods", "glfc", "extra"], 2, "unexpected extra argument"),
    (["keys", "kdir", "--nodes", "5", "--clients", "2"], 2, "5 nodes for 2 clients"),
    (["keys", "kdir", "--bind", "notcp"], 2, "--bind"),
    (["keys", "kdir", "--nodes", "0"], 2, "--nodes"),
    (["keys", "afile/keys"], 1, "cannot write"),
    (["cluster", "nosuch"], 2, "No such command"),
    (["cluster", "up", "--hosts", "0"], 2, "--hosts"),
    (["trace", "behaviour", "--clients", "0"], 2, "--clients"),
    (["trace", "stats", "missing.csv"], 1, "missing.csv"),
    (["image", "nosuch"], 2, "No such command"),
    (["nosuch"], 2, "No such command"),
]


ENTRY_POINT_CASES = (0, 3)  # also through the installed script: an up option value and an unknown option

# The fork server: imports what most cases import, then forks one child per case (sequentially: a child is a fresh
# process but for those imports), whose stdout and stderr go to files and whose exit status is the case's.
FORK_SERVER = """
import json, os, sys
import importlib
for module in ("torch", "matplotlib.pyplot", "fcl_emu.run", "fcl_emu.monitoring.report", "fcl_emu.monitoring.compare",
               "fcl_emu.deploy", "fcl_emu.keys", "fcl_emu.edge_node.args", "fcl_emu.bench.commands"):
    importlib.import_module(module)  # what the cases import, once
from fcl_emu.cli import app
from fcl_emu.methods import registry
registry.names()
results = []
for i, args in enumerate(json.loads(sys.argv[1])):
    out, err = f"case-{i}.out", f"case-{i}.err"
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, out), (2, err)):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.argv = ["fcl-emu", *args]
        code = 0
        try:
            app()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    results.append([os.waitstatus_to_exitcode(status), open(out).read(), open(err).read()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A fresh folder holding the case files."""
    work = tmp_path_factory.mktemp("mistakes")
    for name, text in FILES.items():
        (work / name).parent.mkdir(exist_ok=True)
        (work / name).write_text(text)
    (work / "empty").mkdir()
    return work


@pytest.fixture(scope="module")
def outcomes(work) -> dict[int, subprocess.CompletedProcess]:
    """Every case's process (forked from the fork server, in ``work``)."""
    server = subprocess.run([sys.executable, "-c", FORK_SERVER, json.dumps([args for args, _, _ in CASES])], cwd=work,
                            capture_output=True, text=True, timeout=500, stdin=subprocess.DEVNULL)
    assert server.returncode == 0, server.stderr[-3000:]
    return {i: subprocess.CompletedProcess(CASES[i][0], code, out, err)
            for i, (code, out, err) in enumerate(json.loads(server.stdout.splitlines()[-1]))}


def test_the_table_is_a_new_users_first_hour():
    assert len(CASES) >= 60
    commands = {args[0] for args, _, _ in CASES}
    assert {"up", "node", "coordinator", "deploy", "report", "compare", "bench", "methods", "keys", "cluster",
            "trace"} <= commands


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(args) for args, _, _ in CASES])
def test_a_mistake_is_one_line_and_its_exit_code(outcomes, index):
    check_one_line(outcomes[index], *CASES[index][1:])


@pytest.mark.parametrize("index", ENTRY_POINT_CASES, ids=[" ".join(CASES[i][0]) for i in ENTRY_POINT_CASES])
def test_the_installed_entry_point_says_the_same(work, index):
    if not FCL_EMU.exists():
        pytest.skip(f"no installed entry point at {FCL_EMU} (install the project: pip install -e .)")
    done = subprocess.run([str(FCL_EMU), *CASES[index][0]], cwd=work, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    check_one_line(done, *CASES[index][1:])


def check_one_line(done: subprocess.CompletedProcess, code: int, phrase: str) -> None:
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "╭" not in output, output
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert phrase in lines[0], lines[0]
    assert done.returncode == code, (done.returncode, lines[0])
