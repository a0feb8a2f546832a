"""What combines with what (runconfig/compatibility.py): every refusal of the table is reached by its own example and
is the error the config gives; allowed combinations pass; a method's refusals, its card and the docs' matrix are
read from the same table. The table's ignored entries (runconfig/ignored.py's rows) each have their case in
tests/test_ignored_settings.py, which fails on a row without one."""

from __future__ import annotations

import importlib.util
import re
from operator import attrgetter
from pathlib import Path

import pydantic
import pytest
from typer.testing import CliRunner

from fcl_emu import options
from fcl_emu.cli import app
from fcl_emu.compatibility import DOC_PAGE, cases, matrix, matrix_markdown
from fcl_emu.methods import registry
from fcl_emu.runconfig import RunConfig, load_config
from fcl_emu.runconfig.compatibility import REFUSED, TABLE, example_data, method_refusals, refused
from fcl_emu.runconfig.ignored import DEPENDENT

ROOT = Path(__file__).resolve().parents[1]


def _id(entry) -> str:
    return "+".join(entry.settings) + (f"[{entry.feature}]" if entry.feature else "")


@pytest.fixture
def accountant(monkeypatch):
    """The privacy entries are checked whether or not dp-accounting is installed here."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "dp_accounting" else find_spec(name, *a))


def test_every_entry_is_named_once_and_the_table_holds_the_ignored_rows():
    ids = [_id(entry) for entry in REFUSED]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert TABLE == (*REFUSED, *DEPENDENT) and {entry.kind for entry in TABLE} == {"refused", "ignored"}
    flags, paths = set(options.FLAG_OF.values()), {".".join(path) for path in options.FLAG_OF}
    unknown = [s for entry in REFUSED for s in entry.settings if s.split()[0] not in flags and s not in paths
               and attrgetter_or_none(RunConfig(), s) is None]
    assert not unknown, f"settings named neither as a flag nor as a config key: {unknown}"


def attrgetter_or_none(config, path: str):
    try:
        return attrgetter(path)(config)
    except AttributeError:
        return None


@pytest.mark.parametrize("entry", REFUSED, ids=_id)
def test_each_refusal_is_the_error_its_example_gets(entry, tmp_path, accountant):
    data = example_data(entry, tmp_path)
    config = RunConfig.model_validate(data, context={"combinations": False})
    spec = registry.get(config.method)
    assert entry.when(config, spec), "the example does not trigger its entry"
    assert refused(config, spec)[0] is entry, f"an earlier entry holds first: {_id(refused(config, spec)[0])}"
    with pytest.raises(ValueError) as info:
        RunConfig.model_validate(data)
    message = entry.reason(config, spec)
    assert "\n" not in message and f"Value error, {message} [" in str(info.value)


@pytest.mark.parametrize("data", [
    {},
    {"secagg": {"enabled": True}, "privacy": {"mode": "distributed"}, "topology": {"edge_aggregators": 2}},
    {"privacy": {"mode": "central"}, "rounds": {"overcommit": 1.3}},
    {"aggregation": {"policy": "fedasync"}, "edge": {"availability": "onoff:60:30"}},
    {"aggregation": {"rule": "krum"}, "topology": {"edge_aggregators": 5}, "nodes": 5},
    {"containers": {"backend": "swarm", "cluster": "lab"}},
    {"method": "fedcbc", "containers": {"backend": "docker"}},
], ids=str)
def test_allowed_combinations_pass_and_hold_no_entry(data, accountant):
    config = RunConfig.model_validate(data)
    assert refused(config, registry.get(config.method)) == []


def test_a_methods_refusals_are_its_server_parts_declarations_read_through_the_table():
    for name in registry.names():
        spec = registry.get(name)
        features = [feature for feature, _ in method_refusals(spec)]
        assert [f for f in features if f in spec.refusals] == list(spec.refusals)
        assert any(f.startswith("--model") for f in features) == spec.server.needs_batchnorm
    assert method_refusals(registry.get("fedavg")) == []


def test_the_methods_card_lists_the_tables_refusals_for_that_method():
    result = CliRunner().invoke(app, ["methods", "mfcl"])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert all(f"refuses {feature}: {' '.join(why.split())}" in flat
               for feature, why in method_refusals(registry.get("mfcl")))


def test_the_matrix_marks_each_cell_from_the_table():
    text = matrix_markdown()
    rows = {line.split(" | ")[0].strip("| `"): line for line in text.splitlines() if line.startswith("| ")}
    header = [cell.strip() for cell in text.splitlines()[0].strip("|").split("|")]
    cell = lambda row, column: [c.strip() for c in rows[row].strip("|").split("|")][header.index(column)]
    assert cell("fedavg", "sync") == "yes" and cell("fedavg", "secagg") == "yes"
    assert cell("fedcbc", "secagg").startswith("no (") and cell("glfc", "fedbuff").startswith("no (")
    assert cell("--aggregation fedasync", "edge aggregators").startswith("no (")
    assert cell("--secagg", "central DP").startswith("no (") and cell("--secagg", "distributed DP") == "yes"
    notes = dict(re.findall(r"^\[(\d+)\]: (.+)$", text, re.M)) or dict(re.findall(r"^(\d+)\. (.+)$", text, re.M))
    number = re.search(r"no \((\d+)\)", cell("--secagg", "central DP"))[1]
    assert notes[number].startswith("--privacy central cannot be combined with --secagg")


def test_each_cell_is_what_the_config_does_with_its_settings(accountant):
    notes = matrix().notes
    for (label, cells), (_, marks) in zip(cases(), matrix().rows):
        for data, mark in zip(cells, marks):
            if mark == "yes":
                RunConfig.model_validate(data)
            elif mark.startswith("no ("):
                with pytest.raises(ValueError) as info:
                    RunConfig.model_validate(data)
                assert f"Value error, {notes[int(mark[4:-1]) - 1]} [" in str(info.value), (label, data)
            elif mark.startswith("ignored ("):  # as flags: refused, naming what the setting needs
                why = notes[int(mark[9:-1]) - 1].split(": ", 1)[1]
                with pytest.raises(pydantic.ValidationError, match=re.escape(why)):
                    load_config(None, data)
            else:
                assert mark == "-" and data is None, (label, mark)


def test_the_docs_page_holds_the_matrix_the_table_gives():
    """Regenerate with `fcl-emu compatibility --page docs/compatibility.md`."""
    page = (ROOT / DOC_PAGE).read_text()
    block = re.search(r"<!-- table: compatibility -->\n(.*?)\n<!-- /table: compatibility -->", page, re.S)
    assert block, f"{DOC_PAGE} lacks the compatibility block"
    assert block[1] == matrix_markdown().strip("\n"), \
        f"{DOC_PAGE} is out of date: run `fcl-emu compatibility --page {DOC_PAGE}`"


def test_the_command_prints_the_matrix_and_writes_the_page(tmp_path):
    result = CliRunner().invoke(app, ["compatibility"])
    assert result.exit_code == 0 and "fedcbc" in result.output and "distributed DP" in result.output, result.output
    page = tmp_path / "page.md"
    page.write_text("# Page\n")
    assert CliRunner().invoke(app, ["compatibility", "--page", str(page)]).exit_code == 0
    assert matrix_markdown().strip("\n") in page.read_text() and page.read_text().startswith("# Page\n")
    missing = CliRunner().invoke(app, ["compatibility", "--page", str(tmp_path / "nope.md")])
    assert missing.exit_code == 1 and "does not exist" in missing.output
