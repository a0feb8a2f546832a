"""The arguments of the processes a run starts (edge_node/args.py, gpu_worker/args.py): each gives
itself back through its flags, refuses bad values naming the flag, and is what the launchers build."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fcl_emu.gpu_worker import GpuWorkerArgs
from fcl_emu.edge_node.args import NodeArgs, format_client_set, parse_client_set
from fcl_emu.cli import app
from fcl_emu.launchers import node_args
from fcl_emu.runconfig import load_config
from fcl_emu.runtime.flags import Flags, flag, flag_name
from fcl_emu.runtime.process import ArgsError

KEYED = dict(server_key=Path("/k/coordinator.key"), key=Path("/k/node-0.key_secret"))


@pytest.mark.parametrize("args", [
    NodeArgs("tcp://10.0.0.5:5555", [0, 5, 7, 8, 9], insecure=True),
    NodeArgs("tcp://h:1", range(150), data_roots=["/a", "/b"], name="node-3", threads=4, metrics_port=9101,
             metrics_host="0.0.0.0", metrics_linger=2.5, parent_pid=42, verbose=True, **KEYED),
    NodeArgs("ipc:///tmp/x", [3], metrics_port=65535, metrics_linger=1e-7, key=Path("/k"),
             server_key=Path("/k/coordinator.key")),
])
def test_node_args_come_back_from_their_flags(args):
    assert NodeArgs.from_argv(args.to_argv()) == args


def test_a_striped_client_set_stays_short_on_the_command_line():
    """A node's striped half of 100,000 clients in a few characters (one argument may hold at most 128 KiB), and
    back; runs of consecutive clients keep their old form."""
    args = NodeArgs("tcp://h:1", range(1, 100_000, 2), own_connections=True, insecure=True)
    argv = args.to_argv()
    assert argv[argv.index("--clients") + 1] == "1-99999/2" and NodeArgs.from_argv(argv) == args
    mixed = [0, 2, 4, 5, 6, 7, 10, 13, 16, 17]
    assert NodeArgs("tcp://h:1", mixed, insecure=True).to_argv()[3] == "0-4/2,5-7,10-16/3,17"
    assert NodeArgs.from_argv(["--connect", "tcp://h:1", "--clients", "0-4/2,5-7,10-16/3,17", "--insecure"]
                              ).clients == tuple(mixed)


def test_node_args_normalise_what_they_are_given():
    args = NodeArgs("tcp://h:1", [9, 3, 3, 4], data_roots=["/d"], server_key="/k/s", key="/k/n")
    assert args.clients == (3, 4, 9) and args.data_roots == (Path("/d"),) and args.key == Path("/k/n")
    assert args.to_argv()[:4] == ["--connect", "tcp://h:1", "--clients", "3-4,9"]
    moved = args.with_paths(server_key="/run/secrets/coordinator.key", key="/run/secrets/node-0.key_secret")
    assert moved == dataclasses.replace(args, server_key=Path("/run/secrets/coordinator.key"),
                                        key=Path("/run/secrets/node-0.key_secret"))
    assert moved.to_argv()[moved.to_argv().index("--key") + 1] == "/run/secrets/node-0.key_secret"


@pytest.mark.parametrize("fields, flag, message", [
    (dict(connect="nowhere"), "--connect", "is not a ZeroMQ endpoint"),
    (dict(connect="tcp://h:70000"), "--connect", "is not a ZeroMQ endpoint"),
    (dict(clients=[]), "--clients", "give one client index"),
    (dict(clients=[-1, 2]), "--clients", "give one client index"),
    (dict(threads=0), "--threads", "give 1 or more"),
    (dict(metrics_port=0), "--metrics-port", "not a TCP port"),
    (dict(metrics_port=65536), "--metrics-port", "not a TCP port"),
    (dict(metrics_linger=-1.0), "--metrics-linger", "0 or more seconds"),
    (dict(insecure=False), "--key", "give --server-key and --key"),
    (dict(key=Path("/k")), "--insecure", "drop --server-key / --key"),
])
def test_node_args_refuse_bad_values_naming_the_flag(fields, flag, message):
    with pytest.raises(ArgsError, match=message) as caught:
        NodeArgs(**{"connect": "tcp://h:1", "clients": [0], "insecure": True, **fields})
    assert caught.value.flag == flag


@pytest.mark.parametrize("text, message", [
    ("", "the client set is empty"), ("3-1", "bad client range"), ("a-b", "bad client set"), ("-2", "bad client"),
])
def test_bad_client_sets(text, message):
    with pytest.raises(ArgsError, match=message) as caught:
        parse_client_set(text)
    assert caught.value.flag == "--clients"


def test_client_sets_round_trip():
    for indices in ([0], [0, 1, 2, 3, 7, 9, 10], list(range(0, 300, 2)), [5, 6, 100]):
        assert parse_client_set(format_client_set(indices)) == indices


@pytest.mark.parametrize("argv, expected", [
    (["--connect", "nowhere", "--clients", "0", "--insecure"], "argument --connect: 'nowhere' is not a ZeroMQ"),
    (["--connect", "tcp://h:1", "--clients", "3-1", "--insecure"], "argument --clients: bad client range"),
    (["--connect", "tcp://h:1", "--clients", "1-9/0", "--insecure"], "argument --clients: bad client range"),
    (["--connect", "tcp://h:1", "--clients", "0", "--insecure", "--metrics-port", "99999"], "not a TCP port"),
    (["--connect", "tcp://h:1", "--clients", "0", "--insecure", "--threads", "x"], "invalid int value"),
    (["--clients", "0", "--insecure"], "the following arguments are required: --connect"),
])
def test_from_argv_reports_a_bad_value_as_a_usage_error(argv, expected, capsys):
    with pytest.raises(SystemExit) as exited:
        NodeArgs.from_argv(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and expected in err and len(err.splitlines()) == 1  # one line, no usage block


def test_python_m_edge_node_is_a_node(tmp_path):
    """`python -m fcl_emu.edge_node`: the node's own one-line errors, exit 1 (as under `fcl-emu node`)."""
    run = subprocess.run([sys.executable, "-m", "fcl_emu.edge_node", "--connect", "tcp://127.0.0.1:9",
                          "--clients", "0-3", "--insecure", "--data-root", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1].startswith("error: no data root exists")
    assert "Traceback" not in run.stderr


def test_what_launchers_build_is_what_the_command_line_takes(tmp_path):
    """A launcher's NodeArgs as flags are valid `fcl-emu node` flags (the CLI maps its options onto the same
    object) and come back equal."""
    config = load_config(None, {"metrics": {"port": 9300}, "nodes": 3, "data_root": [str(tmp_path)],
                                "security": {"transport": "plain"}})
    args = node_args("tcp://127.0.0.1:5555", [1, 4, 7], config, "node-1", 1, parent_pid=77)
    assert (args.metrics_port, args.parent_pid, args.insecure, args.clients) == (9302, 77, True, (1, 4, 7))
    assert NodeArgs.from_argv(args.to_argv()) == args
    # the same flags through `fcl-emu node`: a bad value is the parser's usage error naming the flag (no parent to
    # watch: a node that ran would end this process with it)
    argv = dataclasses.replace(args, parent_pid=None).to_argv()
    result = CliRunner().invoke(app, ["node", *argv, "--threads", "0"])
    assert result.exit_code == 2 and "--threads" in result.output


@pytest.mark.parametrize("args", [
    GpuWorkerArgs("tcp://127.0.0.1:4000", 0),
    GpuWorkerArgs("tcp://127.0.0.1:4000", 3, "cuda", parent_pid=9, metrics_port=9304, metrics_host="0.0.0.0",
                  metrics_linger=1.5, verbose=True, **KEYED),
])
def test_gpu_worker_args_come_back_from_their_flags(args):
    assert GpuWorkerArgs.from_argv(args.to_argv()) == args


@pytest.mark.parametrize("fields, flag", [
    (dict(connect="x"), "--connect"), (dict(index=-1), "--index"), (dict(device="tpu"), "--device"),
    (dict(metrics_port=0), "--metrics-port"), (dict(key=Path("/k")), "--key"),
])
def test_gpu_worker_args_refuse_bad_values(fields, flag):
    with pytest.raises(ArgsError) as caught:
        GpuWorkerArgs(**{"connect": "tcp://h:1", "index": 0, **fields})
    assert caught.value.flag == flag


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))


@pytest.mark.parametrize("cls, command", [(NodeArgs, "node"), (GpuWorkerArgs, "gpu-worker")])
def test_every_field_is_a_flag_of_the_parser_and_of_the_commands_help(cls, command):
    """The fields are the flags: the argparse parser's and `fcl-emu node --help`'s (the command hands its
    arguments to the same parser)."""
    fields = {flag_name(field) for field in dataclasses.fields(cls)}
    assert fields == _flags(cls.parser().format_help()) - {"--help"}
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0 and result.output.startswith(f"usage: fcl-emu {command} ")
    assert fields == _flags(result.output) - {"--help"}


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(size) for size in text.split("x"))


@dataclass(frozen=True)
class Tiny(Flags, prog="tiny", description="A process with one flag of each kind."):
    endpoint: str = flag("Where to connect.")
    shape: tuple[int, ...] = flag("Sizes, e.g. 2x3.", parse=_sizes, format=lambda shape: "x".join(map(str, shape)))
    roots: tuple[Path, ...] = flag("A data root (repeatable).", default=(), repeat="--root")
    rate: float | None = flag("A rate.", default=None)
    out: Path = flag("Where to write.", default=Path("out"))
    quiet: bool = flag("Say less.", default=False, alias="-q")


@dataclass(frozen=True)
class Grown(Tiny):
    batch_size: int = flag("Examples per step.", default=32)


def test_a_field_declared_with_the_helper_is_a_flag_that_round_trips():
    help = Grown.parser().format_help()
    assert help.startswith("usage: tiny ") and "Examples per step. Default 32." in help
    assert _flags(help) == {"--help", "--endpoint", "--shape", "--root", "--rate", "--out", "--quiet", "--batch-size"}
    least = Grown("tcp://h:1", (2, 3))
    assert least.to_argv() == ["--endpoint", "tcp://h:1", "--shape", "2x3"]  # required flags, no defaults
    most = Grown("tcp://h:1", (4,), roots=(Path("/a"), Path("/b")), rate=1e-7, out=Path("/o"), quiet=True,
                 batch_size=8)
    assert most.to_argv()[-2:] == ["--batch-size", "8"]
    for args in (least, most):
        assert Grown.from_argv(args.to_argv()) == args
    assert Grown.from_argv(["--endpoint", "e", "--shape", "1", "-q", "--batch-size", "2"]).quiet


@pytest.mark.parametrize("argv, expected", [
    (["--endpoint", "e"], "error: tiny: the following arguments are required: --shape (see: tiny --help)"),
    (["--endpoint", "e", "--shape", "2xa"], "error: tiny: argument --shape: invalid literal for int()"),
    (["--endpoint", "e", "--shape", "2", "--rate", "fast"], "error: tiny: argument --rate: invalid float value"),
])
def test_a_bad_value_of_a_declared_flag_is_a_usage_error(argv, expected, capsys):
    with pytest.raises(SystemExit) as exited:
        Tiny.from_argv(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and expected in err and len(err.splitlines()) == 1  # one line, no usage block


@pytest.mark.parametrize("argv, line", [
    (["node", "--connect", "tcp://h:1", "--clients", "0", "--insecure", "--threads", "0"],
     "error: fcl-emu node: argument --threads: 0: give 1 or more (see: fcl-emu node --help)"),
    (["gpu-worker", "--connect", "tcp://h:1", "--index", "0", "--device", "tpu"],
     "error: fcl-emu gpu-worker: argument --device: 'tpu': choose one of auto, cuda, cpu (see: fcl-emu gpu-worker "
     "--help)"),
])
def test_a_bad_value_on_the_command_line_exits_2_naming_the_flag(argv, line):
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1] == line


def test_a_nodes_exit_names_its_last_error_not_its_progress_lines():
    from fcl_emu.launchers.base import last_error_line, signal_exit

    log = ("2026-11-26 04:29:08,001 fcl_emu.edge_node.connection INFO node-1: connecting to tcp://h:1 with 4 clients\n"
           "Traceback (most recent call last):\n  ...\nOSError: [Errno 28] No space left on device\n\n"
           "2026-11-26 04:29:09,132 fcl_emu.edge_node.connection INFO node-1: joined run 24a0 at tcp://h:1\n")
    assert last_error_line(log) == "OSError: [Errno 28] No space left on device"
    assert last_error_line("2026-11-26 04:29:09,132 fcl_emu.edge_node.connection INFO node-1: joined\n") == ""
    assert signal_exit(137) == "ended by signal 9 (SIGKILL)" == signal_exit(-9)
    assert signal_exit(0) == signal_exit(1) == signal_exit(None) == ""
