"""What a new user meets on the command line: `methods` and `methods NAME`, the extras check before a run, the
help panels and --x/--no-x switches of the run commands, --join-timeout, and the commands `keys` prints."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer
import yaml
from typer.core import TyperOption
from typer.testing import CliRunner

from fcl_emu import options
from fcl_emu.cli import app, build_config
from fcl_emu.keys import host_commands, node_blocks
from fcl_emu.methods import registry
from fcl_emu.methods.requirements import SECAGG, missing_extras, pip_install
from fcl_emu.runconfig import RunConfig

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args: str) -> tuple[int, str]:
    """(exit code, output with rich's box drawing and wrapping undone)."""
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.replace("│", " ").split())


def _command(name: str):
    return typer.main.get_command(app).commands[name]


@pytest.mark.parametrize("command", ["up", "coordinator", "deploy"])
def test_every_run_option_is_in_a_panel_and_every_switch_has_its_off_side(command):
    flags = [p for p in _command(command).params if isinstance(p, TyperOption) and p.name != "help"]
    assert len(flags) > 40
    for param in flags:
        assert getattr(param, "rich_help_panel", None) in options.PANELS, param.opts
        if param.is_flag:
            (on,) = [o for o in param.opts if o.startswith("--")]
            assert param.secondary_opts == ["--no-" + on[2:]], param.opts


def test_up_help_shows_the_panels_the_defaults_and_both_sides_of_a_switch():
    code, output = invoke("up", "--help")
    assert code == 0
    for panel in options.PANELS:
        assert f"─ {panel} ─" in output, panel
    assert "--secagg --no-secagg" in output and "only the sum (docs/secagg.md). Default off." in output
    assert "Default 300; at least 1." in output  # --clients
    assert "--insecure --no-insecure" in output and "Sets plain; default curve." in output


def test_either_side_of_a_switch_overrides_the_config_file_and_neither_leaves_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"secagg": {"enabled": True}, "security": {"transport": "plain"}}))
    assert build_config(path).secagg.enabled and build_config(path).security.transport == "plain"
    off = build_config(path, secagg=False, insecure=False)
    assert not off.secagg.enabled and off.security.transport == "curve"
    assert build_config(None, secagg=True, insecure=True).security.transport == "plain"
    assert options.refused_with_resume({"secagg": False, "prometheus": False}) == ["--secagg"]


def test_the_join_timeout_is_a_flag_and_stays_a_config_key(tmp_path):
    assert build_config(None, join_timeout=300.0).network.join_timeout_s == 300.0
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"network": {"join_timeout_s": 45}}))
    assert build_config(path).network.join_timeout_s == 45
    assert build_config(path, join_timeout=60.0).network.join_timeout_s == 60
    code, output = invoke("up", "--join-timeout", "0")
    assert code == 2 and "--join-timeout" in output
    assert "--join-timeout" in invoke("coordinator", "--help")[1]


def test_methods_lists_each_method_with_its_extras_unmangled_by_rich():
    code, output = invoke("methods")
    assert code == 0
    assert "'fcl-emu[text]'" in output  # rich's markup would eat "[text]"
    assert all(name in output for name in registry.names())


def test_methods_name_describes_options_optimiser_jobs_extras_and_refusals():
    code, output = invoke("methods", "lander")
    assert code == 0, output
    flat = output.replace(" ", "")
    assert "lr_schedule" in output and "cosine|constant" in flat  # an option, its type and default
    assert "lr 0.04, momentum 0.9, weight_decay 0.0005 (the method's code)" in output
    assert "Cosine over each task's rounds" in output  # its learning-rate schedule
    assert "lander.text_embeddings" in output and "lander.synthesize" in output
    assert "pip install 'fcl-emu[text]'" in output
    assert "refuses --secagg" in output and "lander/projector/" in output
    assert "BatchNorm" in output
    code, output = invoke("methods", "glfc")
    assert code == 0 and "prototype_gradients" in output and "glfc.proxy" in output
    code, output = invoke("methods", "finetune")  # an alias
    assert code == 0 and "fedavg" in output and "takes every run feature" in output
    code, output = invoke("methods", "nope")
    assert code == 2 and "unknown method 'nope'" in output


@pytest.mark.parametrize("name", registry.names())
def test_the_config_refuses_secure_aggregation_exactly_where_the_method_says(name):
    spec = registry.get(name)
    data = {"method": name, "secagg": {"enabled": True}}
    if SECAGG in spec.refusals:
        with pytest.raises(ValueError, match=re.escape(f"--secagg: {spec.refusals[SECAGG]}")):
            RunConfig.model_validate(data)
    else:
        assert RunConfig.model_validate(data).secagg.enabled


def test_the_extras_check_looks_up_every_module_an_extra_brings():
    assert missing_extras(("text",), find_spec=lambda name: object()) == []
    assert missing_extras(("text",), find_spec=lambda name: None if name == "sentence_transformers" else 1) == \
        ["text"]

    def broken(name):
        raise ModuleNotFoundError(name)

    assert missing_extras(("text",), find_spec=broken) == ["text"]
    assert pip_install(["text"]) == "pip install 'fcl-emu[text]'"
    assert registry.get("lander").requires_extras == ("text",)


_WITHOUT_SENTENCE_TRANSFORMERS = """
import importlib.abc
import sys


class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "sentence_transformers":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, Hidden())
from fcl_emu.cli import app

app(sys.argv[1:], prog_name="fcl-emu")
"""


@pytest.mark.slow
def test_a_method_whose_extra_is_missing_stops_up_in_one_line_before_anything_starts(tmp_path):
    script = tmp_path / "without_text.py"
    script.write_text(textwrap.dedent(_WITHOUT_SENTENCE_TRANSFORMERS))
    run_dir = tmp_path / "runs" / "r"
    done = subprocess.run([sys.executable, str(script), "up", "--method", "lander", "--clients", "4", "--nodes", "1",
                           "--run-dir", str(run_dir)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ["error: method lander needs the text extra, which is not installed: "
                     "pip install 'fcl-emu[text]'"], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["without_text.py"]  # no run folder, keys or logs


def test_keys_prints_a_complete_command_for_every_host(tmp_path):
    blocks = node_blocks(10, 3)
    lines = host_commands(tmp_path, blocks, "tcp://0.0.0.0:6000", "coord.lan")
    assert lines[0] == f"coordinator: fcl-emu coordinator --keys {tmp_path} --clients 10 --bind tcp://0.0.0.0:6000"
    assert lines[2] == (f"node 1: fcl-emu node --connect tcp://coord.lan:6000 --clients 4-7 --server-key "
                        f"{tmp_path / 'coordinator.key'} --key {tmp_path / 'node-1.key_secret'}")
    code, output = invoke("keys", str(tmp_path / "k"), "--clients", "4", "--nodes", "2", "--coordinator-host",
                          "10.0.0.5")
    assert code == 0
    assert "--bind tcp://0.0.0.0:5555" in output and "--connect tcp://10.0.0.5:5555 --clients 2-3" in output
    code, output = invoke("keys", str(tmp_path / "any"), "--clients", "4", "--bind", "tcp://0.0.0.0:0")
    assert code == 2 and "fixed port" in output and not (tmp_path / "any").exists()


def _every_command(command, path: tuple[str, ...] = ()):
    """``command`` and every command under it, as the argument paths that reach them (hidden ones aside)."""
    if not getattr(command, "hidden", False):
        yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _every_command(sub, (*path, name))


RST = re.compile(r"``|:(?:func|class|meth|mod|data|attr|math):`|\.\. \w+::")


@pytest.mark.parametrize("path", [p for p in _every_command(typer.main.get_command(app)) if p != ("node",)],
                         ids=lambda path: " ".join(path) or "fcl-emu")
def test_every_commands_help_is_prose_without_hard_breaks_placeholders_or_markup(path):
    """Rendered wide, no help text wraps: a line that continues the one above (in a box, its first column blank;
    outside, a second line of a paragraph) is a hard break from the source."""
    output = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "1000"}).output
    lines = output.splitlines()
    for above, line in zip(lines, lines[1:]):
        assert not re.match(r"│\s{6,}\S", line), f"{' '.join(path)}: a hard break before {line.strip('│ ')[:60]!r}"
        outside = [text for text in (above, line) if text.strip() and not re.match(r"[│╭╰]", text)]
        assert len(outside) < 2, f"{' '.join(path)}: a hard break before {line.strip()[:60]!r}"
    assert not RST.search(output), output


def test_the_model_option_lists_every_model_the_classifier_builds():
    from fcl_emu.methods.models import classifier, names

    assert names.MODELS == classifier.MODELS
    code, output = invoke("up", "--help")
    listed = re.search(r"--model <str> Backbone: ([^;.]*)", output).group(1)
    assert sorted(re.split(r", | or ", listed)) == sorted(classifier.MODELS), listed


@pytest.mark.parametrize("name", registry.names())
def test_methods_name_renders_its_docstrings_as_plain_text(name):
    code, output = invoke("methods", name)
    assert code == 0 and not RST.search(output), output
